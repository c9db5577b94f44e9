"""A stand-in inference server speaking the Atropos ``/generate`` format (SPEC §7), with
scripted policies so that environment tests know exactly what rewards to expect.

    python tests/envs/fake_inference.py --port P --policy oracle|uniform|fixed:TEXT [--status S]

- ``oracle``: the right answer then EOS; ``fixed:10``: "10" then EOS whatever the prompt;
  ``uniform``: tokens drawn uniformly from the vocabulary (seeded by the request's seed),
  stopping at EOS or max_tokens.
- Every sampled token's logprob is ``-(0.1 + 0.01 * position)`` (recognisable in tests).
- ``weight_version`` is the number of ``POST /set_version`` calls (starts at 0).
- ``GET /stats`` → ``{"requests", "in_flight", "bodies": last 50 request bodies}``;
  ``POST /hold`` makes later /generate requests wait until ``POST /release``.
- ``--status S``: answer every /generate with HTTP S (to test error handling).
- ``POST /configure {"policy", "status"}``: switch, and reset counters and holds (one server
  serves a whole test module).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import string
from typing import Any

from aiohttp import web

VOCAB = ["[PAD]", "[BOS]", "[EOS]", "[UNK]", *string.digits, "+", "-", "*", "=", "<", ">", "|", "#"]
IDS = {t: i for i, t in enumerate(VOCAB)}
EOS = IDS["[EOS]"]


def answer_of(prompt_ids: list[int]) -> str:
    text = "".join(VOCAB[i] for i in prompt_ids if i > 3)
    m = re.fullmatch(r"(\d+)([-+*])(\d+)=", text)
    assert m, text
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def completion(policy: str, prompt_ids: list[int], max_tokens: int, rng: random.Random) -> list[int]:
    if policy == "uniform":
        out: list[int] = []
        while len(out) < max_tokens:
            tok = rng.randrange(len(VOCAB))
            out.append(tok)
            if tok == EOS:
                break
        return out
    text = answer_of(prompt_ids) if policy == "oracle" else policy.split(":", 1)[1]
    return ([IDS[c] for c in text] + [EOS])[:max_tokens]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--policy", default="oracle")
    ap.add_argument("--status", type=int, default=200)
    args = ap.parse_args()
    state: dict[str, Any] = {
        "requests": 0,
        "in_flight": 0,
        "version": 0,
        "bodies": [],
        "policy": args.policy,
        "status": args.status,
    }
    released = asyncio.Event()
    released.set()

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        state["requests"] += 1
        state["bodies"] = [*state["bodies"][-49:], body]
        if state["status"] != 200:
            return web.Response(status=state["status"], text="scripted failure")
        state["in_flight"] += 1
        try:
            await released.wait()
        finally:
            state["in_flight"] -= 1
        prompt = body["prompt"]["prompt_token_ids"]
        rng = random.Random(body.get("seed"))
        outs = [completion(state["policy"], prompt, int(body["max_tokens"]), rng) for _ in range(int(body["n"]))]
        return web.json_response(
            {
                "text": ["".join(VOCAB[t] for t in o) for o in outs],
                "token_ids": outs,
                "logprobs": [[[{str(t): -(0.1 + 0.01 * j)}] for j, t in enumerate(o)] for o in outs],
                "finish_reasons": ["stop" if o and o[-1] == EOS else "length" for o in outs],
                "weight_version": state["version"],
            }
        )

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({k: state[k] for k in ("requests", "in_flight", "bodies")})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def set_version(request: web.Request) -> web.Response:
        state["version"] += 1
        return web.json_response({"weight_version": state["version"]})

    async def configure(request: web.Request) -> web.Response:
        body = await request.json()
        state.update(
            requests=0, version=0, bodies=[], policy=body.get("policy", "oracle"), status=int(body.get("status", 200))
        )
        released.set()
        return web.json_response({})

    async def hold(request: web.Request) -> web.Response:
        released.clear()
        return web.json_response({})

    async def release(request: web.Request) -> web.Response:
        released.set()
        return web.json_response({})

    app = web.Application()
    app.add_routes(
        [
            web.post("/generate", generate),
            web.get("/stats", stats),
            web.get("/health", health),
            web.post("/set_version", set_version),
            web.post("/hold", hold),
            web.post("/release", release),
            web.post("/configure", configure),
        ]
    )
    # Held requests must not delay a stop.
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, shutdown_timeout=0.2)


if __name__ == "__main__":
    main()

"""Every atroposlib server type against `atroposd inference` (SPEC §7): SGLang's `/generate` and
TRL's `/generate/` beside vLLM's `/generate` and the OpenAI routes, their refusals, and the
health probes (`max_tokens ≤ 1`) answered ahead of queued rollouts and counted apart from them.

atroposlib 0.4.0's own classes (VLLMServer, SGLangServer, OpenAIServer, TrlVllmServer) drive the
server through ServerManager, as an environment's `--openai.*` flags set them up."""

from __future__ import annotations

import asyncio
import random
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from atroposd.inference.torch_engine import TorchEngine
from atroposd.models.tiny import BOS_ID, EOS_ID
from tests import fuzzseed
from tests.inference.conftest import MAX_MODEL_LEN, Server

PROMPT = [BOS_ID, 5, 14, 7, 17]  # "[BOS]1+3="
STOPS = ["+", "-", "*", "="]  # one token each in builtin:tiny's vocabulary
STOP_IDS = {14, 15, 16, 17}


def _metrics(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


# ---------------------------------------------------------------------------- SGLang's /generate


def test_sglang_generate_answers_as_sglang(server: Server) -> None:
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "return_text_in_logprobs": False,
        "sampling_params": {"max_new_tokens": 4, "n": 3, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7},
    }
    status, answer = server.http("POST", "/generate", body)
    assert status == 200, answer
    assert isinstance(answer, list) and len(answer) == 3  # one object per sample when n > 1
    for sample in answer:
        meta = sample["meta_info"]
        assert [t for _, t, _ in meta["output_token_logprobs"]] == sample["output_ids"]
        assert all(lp <= 0 and text is None for lp, _, text in meta["output_token_logprobs"])
        assert meta["finish_reason"] == {"type": "length", "length": 4}
        assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (5, 4, 0)
    # The same engine path as vLLM's body: the same seed gives the same tokens and logprobs.
    status, vllm = server.http(
        "POST",
        "/generate",
        {"prompt": {"prompt_token_ids": PROMPT}, "n": 3, "max_tokens": 4, "ignore_eos": True, "seed": 7, "logprobs": 0},
    )
    assert status == 200
    assert vllm["token_ids"] == [s["output_ids"] for s in answer]
    assert [[next(iter(t[0].values())) for t in c] for c in vllm["logprobs"]] == [
        [lp for lp, _, _ in s["meta_info"]["output_token_logprobs"]] for s in answer
    ]
    # n = 1 is one object; text prompts are tokenized as SGLang does (BOS added).
    status, one = server.http(
        "POST", "/generate", {"text": "1+3=", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    )
    assert status == 200 and isinstance(one, dict) and len(one["output_ids"]) == 2
    assert "output_token_logprobs" not in one["meta_info"]  # not asked
    assert one["meta_info"]["prompt_tokens"] == len(PROMPT)


def test_sglang_stop_strings_prompt_logprobs_and_token_text(server: Server) -> None:
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "logprob_start_len": 1,
        "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 40, "n": 8, "stop": STOPS, "ignore_eos": True, "sampling_seed": 3},
    }
    status, answer = server.http("POST", "/generate", body)
    assert status == 200, answer
    stopped = 0
    for sample in answer:
        meta, ids = sample["meta_info"], sample["output_ids"]
        assert not STOP_IDS & set(ids[:-1])  # generation ends at the first stop string
        if meta["finish_reason"]["type"] == "stop":
            stopped += 1
            assert ids[-1] in STOP_IDS and meta["finish_reason"]["matched"] in STOPS
            special = {"[PAD]", "[BOS]", "[EOS]", "[UNK]"}  # in the token texts, skipped in the text
            assert sample["text"] == "".join(
                text for _, _, text in meta["output_token_logprobs"][:-1] if text not in special
            )
        else:
            assert meta["finish_reason"] == {"type": "length", "length": 40} and len(ids) == 40
        assert all(len(top) == 2 for top in meta["output_top_logprobs"])
        # The prompt's logprobs from position 1: each entry the actual prompt token.
        assert [t for _, t, _ in meta["input_token_logprobs"]] == PROMPT[1:]
        assert all(lp <= 0 for lp, _, _ in meta["input_token_logprobs"])
    assert stopped >= 1, "no sample met a stop string in 8 × 40 tokens"


# ---------------------------------------------------------------------------- TRL's /generate/


def test_trl_generate_answers_completion_ids(server: Server) -> None:
    body = {
        "prompts": ["1+3=", "2+2="],
        "n": 3,
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "max_tokens": 5,
    }
    status, answer = server.http("POST", "/generate/", body)
    assert status == 200, answer
    assert len(answer["completion_ids"]) == 6  # each prompt's n completions, in order
    assert all(1 <= len(ids) <= 5 for ids in answer["completion_ids"])
    assert answer["prompt_ids"] == [PROMPT] * 3 + [[BOS_ID, 6, 14, 6, 17]] * 3
    assert [len(lp) for lp in answer["logprobs"]] == [len(ids) for ids in answer["completion_ids"]]
    assert answer["weight_version"] == 0


# ---------------------------------------------------------------------------- refusals

SGLANG_BAD: list[tuple[Any, str]] = [
    ({"input_ids": [], "sampling_params": {}}, "input_ids"),
    ({"input_ids": "1+3="}, "input_ids"),
    ({"input_ids": [[1, 5], [1, 6]]}, "input_ids"),
    ({"input_ids": [BOS_ID, 99_999]}, "input_ids"),
    ({"text": 5}, "text"),
    ({"input_ids": PROMPT, "text": "1+3="}, "text"),
    ({"sampling_params": {"max_new_tokens": 3}}, "input_ids or text"),
    ({"input_ids": PROMPT, "sampling_params": []}, "sampling_params"),
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": "3"}}, "max_new_tokens"),
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10 * MAX_MODEL_LEN}}, "max_new_tokens"),
    ({"input_ids": PROMPT, "sampling_params": {"n": 0}}, "n must"),
    ({"input_ids": PROMPT, "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"input_ids": PROMPT, "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": PROMPT, "sampling_params": {"stop": 3}}, "stop"),
    ({"input_ids": PROMPT, "sampling_params": {"sampling_seed": "x"}}, "sampling_seed"),
    ({"input_ids": PROMPT, "sampling_params": {"min_new_tokens": 2}}, "min_new_tokens"),
    ({"input_ids": PROMPT, "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
    ({"input_ids": PROMPT, "sampling_params": {"json_schema": "{}"}}, "json_schema"),
    (
        {"input_ids": PROMPT, "sampling_params": {"spaces_between_special_tokens": False}},
        "spaces_between_special_tokens",
    ),
    ({"input_ids": PROMPT, "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": PROMPT, "top_logprobs_num": 1000}, "top_logprobs_num"),
    ({"input_ids": PROMPT, "logprob_start_len": len(PROMPT)}, "logprob_start_len"),
    ({"input_ids": PROMPT, "stream": True}, "stream"),
    ({"input_ids": PROMPT, "rid": 5}, "rid"),
    ({"input_ids": PROMPT, "lora_path": "adapter"}, "lora_path"),
]
TRL_BAD: list[tuple[Any, str]] = [
    ([], "JSON object"),
    ({"prompts": []}, "prompts"),
    ({"prompts": "1+3="}, "prompts"),
    ({"prompts": ["1+3=", 5]}, "prompts"),
    ({"prompts": ["1+3="], "n": 0}, "n must"),
    ({"prompts": ["1+3="], "max_tokens": "5"}, "max_tokens"),
    ({"prompts": ["1+3="], "max_tokens": 10 * MAX_MODEL_LEN}, "max_tokens"),
    ({"prompts": ["1+3="], "temperature": -1}, "temperature"),
    ({"prompts": ["1+3="], "repetition_penalty": 1.3}, "repetition_penalty"),
    ({"prompts": ["1+3="], "min_p": 0.1}, "min_p"),
    ({"prompts": ["1+3="], "images": ["x.png"]}, "images"),
    ({"prompts": ["1+3="], "guided_decoding_regex": "[0-9]"}, "guided_decoding_regex"),
    ({"prompts": ["1+3="], "generation_kwargs": {"beam_width": 2}}, "beam_width"),
    ({"prompts": ["1+3="], "n": 2, "generation_kwargs": {"n": 3}}, "repeats field(s): n"),
    ({"prompts": ["1+3="], "generation_kwargs": [1]}, "generation_kwargs"),
    ({"prompts": ["1+3="], "prompt": "x"}, "prompt"),
]


@pytest.mark.parametrize(
    ("path", "body", "field"), [("/generate", b, f) for b, f in SGLANG_BAD] + [("/generate/", b, f) for b, f in TRL_BAD]
)
def test_malformed_sglang_and_trl_bodies_get_400_naming_the_field(
    server: Server, path: str, body: Any, field: str
) -> None:
    status, answer = server.http("POST", path, body)
    assert status == 400, (status, answer)
    assert field in answer["error"], answer


def _junk(rng: random.Random, depth: int = 0) -> Any:
    """A JSON value of any kind, small."""
    kinds = ["int", "neg", "big", "float", "str", "bool", "null"] + (["list", "dict"] if depth < 2 else [])
    kind = rng.choice(kinds)
    return {
        "int": lambda: rng.randint(0, 30),
        "neg": lambda: -rng.randint(1, 5),
        "big": lambda: 10 ** rng.randint(6, 30),
        "float": lambda: rng.choice([0.0, 0.5, 1.0, 2.5, float("inf")]),
        "str": lambda: rng.choice(["", "x", "1+3="]),
        "bool": lambda: rng.random() < 0.5,
        "null": lambda: None,
        "list": lambda: [_junk(rng, depth + 1) for _ in range(rng.randint(0, 3))],
        "dict": lambda: {rng.choice(["n", "a", "max_new_tokens"]): _junk(rng, depth + 1)},
    }[kind]()


def test_random_sglang_and_trl_bodies_are_never_a_500(server: Server) -> None:
    """Fields of SGLang's and TRL's bodies set to values of any JSON kind: each answer is a 200
    or a 400 with a message, never a 500 (fuzzseed: --fuzz-seed N replays a run)."""
    rng = fuzzseed.rng("inference-server-types")
    sglang_top = [
        "input_ids",
        "text",
        "return_logprob",
        "return_text_in_logprobs",
        "logprob_start_len",
        "top_logprobs_num",
        "rid",
        "stream",
    ]
    sglang_sp = [
        "max_new_tokens",
        "n",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "stop_token_ids",
        "sampling_seed",
        "ignore_eos",
        "skip_special_tokens",
        "no_stop_trim",
        "min_p",
    ]
    trl = [
        "prompts",
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_tokens",
        "repetition_penalty",
        "generation_kwargs",
        "images",
    ]
    for _ in range(40):
        body: dict[str, Any] = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        for key in rng.sample(sglang_top, rng.randint(1, 3)):
            body[key] = _junk(rng)
        for key in rng.sample(sglang_sp, rng.randint(0, 3)):
            body["sampling_params"][key] = _junk(rng)
        status, answer = server.http("POST", "/generate", body)
        assert status in (200, 400), (fuzzseed.replay_hint(), body, status, answer)
        assert status == 200 or answer["error"], body
        tbody: dict[str, Any] = {"prompts": ["1+3="], "max_tokens": 2}
        for key in rng.sample(trl, rng.randint(1, 3)):
            tbody[key] = _junk(rng)
        status, answer = server.http("POST", "/generate/", tbody)
        assert status in (200, 400), (fuzzseed.replay_hint(), tbody, status, answer)
        assert status == 200 or answer["error"], tbody


def test_invalid_json_on_the_trl_route_is_a_400(server: Server) -> None:
    status, answer = server.http("POST", "/generate/", raw=b"{prompts")
    assert status == 400 and "invalid JSON" in answer["error"]


# ---------------------------------------------------------------------------- probes


def test_probes_are_counted_apart_from_rollouts(server: Server) -> None:
    before = _metrics(server)
    _, health = server.http("GET", "/health")
    probes = [
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
            "chat",
        ),
        ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1}, "completions"),
        ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}, "sglang"),
        ("/generate", {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 1}, "generate"),
        ("/generate/", {"prompts": ["hi"], "max_tokens": 1}, "trl"),
    ]
    for path, body, _ in probes:
        status, answer = server.http("POST", path, body)
        assert status == 200, answer
    rollout = {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 2, "ignore_eos": True}
    assert server.http("POST", "/generate", rollout)[0] == 200
    after = _metrics(server)

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    for _, _, route in probes:
        assert grew("atroposd_inference_probes_total", route=route, outcome="ok") == 1, route
    assert grew("atroposd_inference_probe_seconds_count") == len(probes)
    # Only the rollout counts as one: requests, samples, tokens, latency, /health's generations.
    assert grew("atroposd_inference_requests_total", route="generate", outcome="ok") == 1
    assert (
        sum(
            grew("atroposd_inference_requests_total", route=r, outcome="ok")
            for r in ("sglang", "trl", "chat", "completions")
        )
        == 0
    )
    assert grew("atroposd_inference_generations_total") == 1
    assert grew("atroposd_inference_generated_tokens_total") == 2
    assert server.http("GET", "/health")[1]["generations"] == health["generations"] + 1


@pytest.fixture
async def engine(tiny_dir: Path) -> AsyncIterator[TorchEngine]:
    eng = TorchEngine(model_dir=tiny_dir, max_model_len=MAX_MODEL_LEN, seed=0)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.close()


@pytest.mark.anyio
async def test_torch_engine_answers_a_probe_ahead_of_queued_rollouts(engine: TorchEngine) -> None:
    order: list[str] = []
    answers: dict[str, dict[str, Any]] = {}

    async def run(name: str, **kw: Any) -> None:
        answers[name] = await engine.generate({"prompt": {"prompt_token_ids": PROMPT}, "ignore_eos": True, **kw})
        order.append(name)

    async with engine._compute:  # the model is busy: what arrives now queues
        first = asyncio.create_task(run("first", max_tokens=4, n=3))
        for _ in range(10_000):  # until the scheduler took it as a batch (it waits for the model)
            if engine._last_rows == 3 and not engine._queue:
                break
            await asyncio.sleep(0.001)
        rollouts = [asyncio.create_task(run(f"rollout{i}", max_tokens=4, n=2)) for i in range(3)]
        probe = asyncio.create_task(run("probe", max_tokens=1))
        for _ in range(10_000):
            if len(engine._queue) == 4:
                break
            await asyncio.sleep(0.001)
    await asyncio.wait_for(asyncio.gather(first, *rollouts, probe), 60)
    assert order[:2] == ["first", "probe"], order
    assert engine.batches == 2  # the probe had no forward pass of its own
    assert len(answers["probe"]["token_ids"][0]) == 1 and answers["probe"]["finish_reasons"] == ["length"]
    # The probe rode on the rollouts' batch (its rows left after the first step): their tokens
    # and logprobs are still exactly the model's.
    from tests.inference.test_torch_engine import reference_logprobs

    for i in range(3):
        for ids, lps in zip(answers[f"rollout{i}"]["token_ids"], answers[f"rollout{i}"]["logprobs"], strict=True):
            ref = reference_logprobs(engine.model, PROMPT + ids, len(PROMPT), 1.0)
            got = [next(iter(entry[0].values())) for entry in lps]
            assert len(ids) == 4 and max(abs(a - b) for a, b in zip(got, ref, strict=True)) < 2e-3


@pytest.mark.anyio
async def test_a_scoring_request_riding_as_a_probe_keeps_its_prompt_logprobs(engine: TorchEngine) -> None:
    """atroposlib's get_logprobs (a teacher's scores) asks /generate for prompt_logprobs with
    max_tokens = 1: a probe by its size. Riding on queued rollouts' batch, with prompts longer
    and shorter than theirs, each gets the prompt logprobs and the token it gets alone."""
    from tests.inference.test_torch_engine import reference_logprobs

    prompts = {"long": [*PROMPT, 6, 15, 5, 17, 8, 16, 9, 17], "short": [BOS_ID, 9, 17]}

    def scoring(ids: list[int]) -> dict[str, Any]:
        return {"prompt": {"prompt_token_ids": ids}, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0.0}

    answers: dict[str, dict[str, Any]] = {}

    async def run(name: str, body: dict[str, Any]) -> None:
        answers[name] = await engine.generate(body)

    rollout = {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 4, "ignore_eos": True}
    async with engine._compute:  # the model is busy: what arrives now queues
        first = asyncio.create_task(run("first", {**rollout, "n": 3}))
        for _ in range(10_000):
            if engine._last_rows == 3 and not engine._queue:
                break
            await asyncio.sleep(0.001)
        queued = [asyncio.create_task(run(f"rollout{i}", {**rollout, "n": 2})) for i in range(2)]
        queued += [asyncio.create_task(run(name, scoring(ids))) for name, ids in prompts.items()]
        for _ in range(10_000):
            if len(engine._queue) == 4:
                break
            await asyncio.sleep(0.001)
    await asyncio.wait_for(asyncio.gather(first, *queued), 60)
    # (counted once a batch ends, before its rollouts are answered; a probe is answered earlier)
    assert engine.batches == 2, "the scoring requests rode on the rollouts' batch"
    alone = {name: await engine.generate(scoring(ids)) for name, ids in prompts.items()}
    for name, ids in prompts.items():
        got, want = answers[name], alone[name]
        assert got["token_ids"] == want["token_ids"]
        assert got["prompt_logprobs"][0] is None and len(got["prompt_logprobs"]) == len(ids)
        for entry, ref in zip(got["prompt_logprobs"][1:], want["prompt_logprobs"][1:], strict=True):
            assert entry.keys() == ref.keys() and all(abs(entry[k] - ref[k]) < 1e-5 for k in ref), (name, entry, ref)
        # and they are the model's: the actual prompt token's logprob at each position
        actual = [float(e[str(t)]) for e, t in zip(got["prompt_logprobs"][1:], ids[1:], strict=True)]
        assert (
            max(abs(a - b) for a, b in zip(actual, reference_logprobs(engine.model, ids, 1, 1.0), strict=True)) < 2e-3
        )


# ---------------------------------------------------------------------------- atroposlib's classes


def _manager(server: Server, tiny_dir: Path, server_type: str) -> Any:
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.server_manager import ServerManager

    # The base URL each type needs against atroposd (docs/ENVIRONMENTS.md: "Atropos environments of every
    # server type"): TRL's class appends /generate/ to it; the others strip /v1 for their own routes.
    base = server.url if server_type == "trl" else server.url + "/v1"
    # TRL's class loads its tokenizer from model_name: a local directory here.
    config = APIServerConfig(
        base_url=base,
        model_name=str(tiny_dir),
        tokenizer_name=str(tiny_dir),
        server_type=server_type,
        api_key="x",
        health_check=False,
        timeout=60,
        num_requests_for_eval=0,
    )
    return ServerManager(configs=[config])


async def _close(manager: Any) -> None:
    for srv in manager.servers:
        client = getattr(srv, "openai", None)
        if client is not None:
            await client.close()


async def _healthy(srv: Any) -> None:
    """The class's own health check, from unhealthy: it must find the server healthy."""
    srv.server_healthy = False
    task = asyncio.create_task(srv.check_server_status_task())
    try:
        for _ in range(300):
            if srv.server_healthy:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"{type(srv).__name__}'s health check never passed")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _no_stop_inside(ids: list[int], finish: str, max_tokens: int) -> None:
    assert not STOP_IDS & set(ids[:-1]), ids
    if finish == "stop":
        assert ids[-1] in STOP_IDS | {EOS_ID}, ids
    else:
        assert finish == "length" and len(ids) == max_tokens, (finish, ids)


async def _text_calls(manager: Any, tokenizer: Any) -> None:
    """What every class serves: completions and chat, n = 1 and n > 1, max_tokens."""

    def tokens(text: str | None) -> int:  # TRL's class decodes special tokens into the text
        return len(tokenizer.encode(text or "", add_special_tokens=False))

    for n in (1, 5):
        comp = await manager.completion(prompt="1+3=", n=n, max_tokens=3, temperature=1.0)
        assert len(comp.choices) == n and all(tokens(c.text) <= 3 for c in comp.choices)
        chat = await manager.chat_completion(messages=[{"role": "user", "content": "1+3="}], n=n, max_tokens=3)
        assert len(chat.choices) == n and all(c.message.role == "assistant" for c in chat.choices)
        assert all(tokens(c.message.content) <= 3 for c in chat.choices)


async def _token_calls(manager: Any, tokenizer: Any) -> None:
    """What the vllm and sglang classes add: token ids and logprobs (ManagedServer's path)."""
    for n in (1, 4):
        prompt, out, lps, reasons = await manager.tokens_and_logprobs_completion(
            prompt="1+3=", n=n, max_tokens=3, temperature=1.0, ignore_eos=True
        )
        assert prompt == PROMPT and len(out) == len(lps) == len(reasons) == n
        assert all(len(t) == len(lp) == 3 for t, lp in zip(out, lps, strict=True))
        assert all(x <= 0 for lp in lps for x in lp)
    prompt, out, _, reasons = await manager.tokens_and_logprobs_completion(
        prompt="1+3=", n=8, max_tokens=30, temperature=1.0, ignore_eos=True, stop=STOPS, seed=5
    )
    finishes = [r["type"] if isinstance(r, dict) else r for r in reasons]
    for ids, finish in zip(out, finishes, strict=True):
        _no_stop_inside(ids, finish, 30)
    assert "stop" in finishes, reasons
    async with manager.managed_server(tokenizer=tokenizer) as managed:
        await managed.completion(prompt="1+3=", n=3, max_tokens=3, temperature=1.0, ignore_eos=True)
        nodes = managed.get_state()["nodes"]
    assert len(nodes) == 3
    for node in nodes:
        assert node.tokens[: len(PROMPT)] == PROMPT and len(node.tokens) == len(PROMPT) + 3
        assert node.masked_tokens[: len(PROMPT)] == [-100] * len(PROMPT)
        assert all(lp <= 0 for lp in node.logprobs[len(PROMPT) :])


async def _text_stops(manager: Any, tokenizer: Any) -> None:
    comp = await manager.completion(
        prompt="1+3=", n=8, max_tokens=30, temperature=1.0, stop=STOPS, seed=5, extra_body={"ignore_eos": True}
    )
    assert any(c.finish_reason == "stop" for c in comp.choices)
    for c in comp.choices:
        assert not set(c.text) & set("".join(STOPS)), c.text  # the stop string is not in the text


CASES: dict[str, Callable[[Any, Any], Awaitable[None]]] = {
    "vllm": _token_calls,
    "sglang": _token_calls,
    "openai": _text_stops,
    "trl": lambda m, t: asyncio.sleep(0),
}


@pytest.mark.atroposlib
@pytest.mark.parametrize("server_type", ["vllm", "sglang", "openai", "trl"])
def test_atroposlib_server_class_through_server_manager(server: Server, tiny_dir: Path, server_type: str) -> None:
    pytest.importorskip("atroposlib")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    before = _metrics(server)

    async def run() -> None:
        manager = _manager(server, tiny_dir, server_type)
        try:
            await _healthy(manager.servers[0])
            await _text_calls(manager, tokenizer)
            await CASES[server_type](manager, tokenizer)
        finally:
            await _close(manager)

    asyncio.run(run())
    after = _metrics(server)
    probes = sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == "atroposd_inference_probes_total")
    # The sglang and openai classes probe with a one-token chat completion; vllm's GETs /health;
    # trl's does not probe at all.
    assert (probes >= 1) == (server_type in ("sglang", "openai")), probes

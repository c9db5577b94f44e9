"""`atroposd inference` as a real child process: the wire shapes clients read, refusals, the
control socket, atroposlib's and OpenAI's clients, concurrency."""

from __future__ import annotations

import asyncio
import stat
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from atroposd.models.tiny import BOS_ID
from tests.inference.conftest import MAX_MODEL_LEN, Server
from tests.support import spawn, stop_process

PROMPT = [BOS_ID, 5, 14, 7, 17]


def gen_body(prompt: list[int] = PROMPT, **kw: Any) -> dict[str, Any]:
    return {"prompt": {"prompt_token_ids": prompt}, "logprobs": 0, **kw}


def test_generate_response_shape(server: Server) -> None:
    status, body = server.http(
        "POST",
        "/generate",
        gen_body(n=3, max_tokens=4, temperature=1.0, top_p=1.0, ignore_eos=True, model="builtin:tiny"),
    )
    assert status == 200, body
    assert {"text", "token_ids", "logprobs", "finish_reasons", "weight_version", "prompt_token_ids"} <= set(body)
    assert "prompt_logprobs" not in body  # only when asked
    assert isinstance(body["weight_version"], int)
    assert len(body["logprobs"]) == len(body["token_ids"]) == len(body["finish_reasons"]) == len(body["text"]) == 3
    for ids, per_token, reason in zip(body["token_ids"], body["logprobs"], body["finish_reasons"], strict=True):
        assert len(per_token) == len(ids) == 4 and reason == "length"
        for tid, item in zip(ids, per_token, strict=True):
            assert isinstance(item, list) and len(item) == 1 and len(item[0]) == 1
            ((key, lp),) = item[0].items()
            assert int(key) == tid and lp <= 0.0
    status, body = server.http("POST", "/generate", gen_body(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    assert status == 200
    pl = body["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(PROMPT)
    assert all(str(t) in entry for t, entry in zip(PROMPT[1:], pl[1:], strict=True))


def test_health_info_models(server: Server, tiny_dir: Path) -> None:
    assert server.http("GET", "/health")[0] == 200
    status, info = server.http("GET", "/info")
    assert status == 200
    assert info["engine"] == "torch" and info["max_model_len"] == MAX_MODEL_LEN and info["model"] == str(tiny_dir)
    assert info["tokenizer"]["vocab_size"] == 22 and info["tokenizer"]["special_ids"]["eos"] == 2
    assert isinstance(info["tokenizer"]["fingerprint"], str) and info["awaiting_weights"] is False
    assert info["ready"] is True and info["weight_version"] == 0
    from atroposd.models.resolve import tokenizer_fingerprint

    assert info["tokenizer"] == tokenizer_fingerprint(tiny_dir)
    status, models = server.http("GET", "/v1/models")
    assert status == 200 and models["data"][0]["id"] == str(tiny_dir)


@pytest.mark.parametrize(
    "path, body, raw, message",
    [
        ("/generate", None, b"{not json", "invalid JSON"),
        ("/generate", {"prompt": "1+1="}, None, "prompt must be"),
        ("/generate", gen_body(max_tokens=MAX_MODEL_LEN), None, "exceeds max_model_len"),
        ("/generate", gen_body(n="2"), None, "n must be"),
        ("/generate", gen_body([1, 22]), None, "outside the vocabulary"),
        ("/generate", gen_body(best=1), None, "unknown field"),
        ("/v1/completions", {"prompt": "1+1=", "stream": True}, None, "stream"),
        ("/v1/completions", {"prompt": 5}, None, "prompt must be"),
        ("/v1/completions", {"prompt": "1+", "max_tokens": MAX_MODEL_LEN}, None, "exceeds max_model_len"),
        ("/v1/chat/completions", {"messages": "hi"}, None, "messages must be"),
    ],
)
def test_malformed_requests_get_400_with_a_message(
    server: Server, path: str, body: Any, raw: bytes | None, message: str
) -> None:
    status, answer = server.http("POST", path, body, raw=raw)
    assert status == 400, answer
    text = answer["error"]["message"] if path.startswith("/v1") else answer["error"]
    assert message in text
    assert server.http("GET", "/health")[0] == 200


def test_control_routes_only_on_the_unix_socket(server: Server) -> None:
    for route in ("/pause", "/resume", "/update_weights", "/load", "/probe_generate"):
        assert server.http("POST", route, {})[0] in (404, 405)
    assert server.http("GET", "/weight_info")[0] in (404, 405)
    assert stat.S_IMODE(server.socket.stat().st_mode) == 0o600
    status, info = server.control("GET", "/weight_info")
    assert status == 200 and info["paused"] is False and info["engine"] == "torch"
    status, probe = server.control("POST", "/probe_generate")
    assert status == 200 and len(probe["token_ids"][0]) == 1
    status, answer = server.control("POST", "/update_weights", {"manifest": "/etc/passwd", "mode": "attach"})
    assert status == 409 and "pause" in answer["error"]
    assert server.control("POST", "/pause")[1]["paused"] is True
    try:
        status, answer = server.control("POST", "/update_weights", {"manifest": "/etc/passwd", "mode": "attach"})
        assert status == 400 and answer["error"]
        status, answer = server.control("POST", "/load", {"path": "/etc", "weight_version": 1})
        assert status == 400 and "sync directory" in answer["error"]
        status, answer = server.control("POST", "/resume", {"weight_version": "x"})
        assert status == 400
    finally:
        status, resumed = server.control("POST", "/resume", {"weight_version": 0})
    assert status == 200 and resumed == {"paused": False, "weight_version": 0}


def test_probe_does_not_generate_while_the_trainer_holds_the_pause(server: Server) -> None:
    """The daemon's liveness probe generates beside the rollouts, bypassing the pause; while the
    trainer holds generation paused for a weight update it must not (an update refuses to run
    beside a generation in flight: the job failed on that race under load)."""
    assert server.control("POST", "/pause")[1]["paused"] is True
    try:
        status, probe = server.control("POST", "/probe_generate")
        assert status == 200 and probe["skipped"] and "token_ids" not in probe
        status, info = server.control("GET", "/weight_info")
        assert status == 200 and info["paused"] is True
    finally:
        status, resumed = server.control("POST", "/resume", {"weight_version": 0})
    assert status == 200 and resumed["paused"] is False
    status, probe = server.control("POST", "/probe_generate")
    assert status == 200 and len(probe["token_ids"][0]) == 1


def test_concurrent_requests_all_answered(server: Server) -> None:
    import aiohttp

    async def run() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as session:

            async def one(k: int) -> dict[str, Any]:
                body = gen_body([BOS_ID, *range(4, 4 + 1 + k % 7)], n=4, max_tokens=3, seed=k)
                async with session.post(server.url + "/generate", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return dict(await resp.json())

            return await asyncio.gather(*(one(k) for k in range(32)))

    answers = asyncio.run(run())
    assert len(answers) == 32
    for k, a in enumerate(answers):
        assert a["prompt_token_ids"] == [BOS_ID, *range(4, 4 + 1 + k % 7)]
        assert len(a["token_ids"]) == 4 and all(len(t) <= 3 for t in a["token_ids"])


@pytest.mark.atroposlib
def test_atroposlib_vllm_client_reads_the_responses(server: Server, tiny_dir: Path) -> None:
    pytest.importorskip("atroposlib")
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.vllm_server import VLLMServer

    async def run() -> None:
        client = VLLMServer(
            APIServerConfig(
                base_url=server.url + "/v1",
                model_name=str(tiny_dir),
                tokenizer_name=str(tiny_dir),
                server_type="vllm",
                api_key="x",
                health_check=False,
                timeout=60,
            )
        )
        prompt_tokens, out_tokens, out_lps, reasons = await client.tokens_and_logprobs_completion(
            prompt="1+3=", n=4, max_tokens=3, temperature=1.0, model=str(tiny_dir), ignore_eos=True
        )
        assert prompt_tokens == PROMPT  # atroposlib tokenised with the same tokenizer (BOS added)
        assert len(out_tokens) == len(out_lps) == len(reasons) == 4
        assert all(len(t) == len(lp) == 3 for t, lp in zip(out_tokens, out_lps, strict=True))
        assert all(isinstance(x, float) and x <= 0 for lp in out_lps for x in lp)
        assert reasons == ["length"] * 4
        teacher = await client.get_logprobs(input_ids=PROMPT, top_k=2, model=str(tiny_dir))
        assert teacher["prompt_tokens"] == PROMPT
        assert len(teacher["prompt_topk_token_ids"]) == len(PROMPT)
        assert teacher["prompt_topk_token_ids"][0] == []  # the first position has no logprob
        assert all(PROMPT[j] in teacher["prompt_topk_token_ids"][j] for j in range(1, len(PROMPT)))
        completion = await client.completion(prompt="1+3=", n=2, max_tokens=3, model=str(tiny_dir))
        assert len(completion.choices) == 2 and all(isinstance(c.text, str) for c in completion.choices)
        chat = await client.chat_completion(
            messages=[{"role": "user", "content": "1+3="}], n=2, max_tokens=3, model=str(tiny_dir)
        )
        assert len(chat.choices) == 2 and chat.choices[0].message.role == "assistant"
        # ManagedServer: the tracked sequences a trainer gets (tokens, -100 masks, 1.0 logprob sentinels).
        from atroposlib.envs.server_handling.managed_server import ManagedServer

        managed = ManagedServer(client, tokenizer=client.tokenizer)
        await managed.completion(prompt="1+3=", n=3, max_tokens=3, temperature=1.0, ignore_eos=True)
        nodes = managed.get_state()["nodes"]
        assert len(nodes) == 3
        for node in nodes:
            assert node.tokens[: len(PROMPT)] == PROMPT and len(node.tokens) == len(PROMPT) + 3
            assert node.masked_tokens[: len(PROMPT)] == [-100] * len(PROMPT)
            assert node.masked_tokens[len(PROMPT) :] == node.tokens[len(PROMPT) :]
            assert node.logprobs[: len(PROMPT)] == [1.0] * len(PROMPT)
            assert all(lp <= 0 for lp in node.logprobs[len(PROMPT) :])
        await client.openai.close()

    asyncio.run(run())


def test_openai_client_with_logprobs(server: Server, tiny_dir: Path) -> None:
    openai = pytest.importorskip("openai")

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x")
        try:
            comp = await client.completions.create(
                model=str(tiny_dir),
                prompt="2+2=",
                max_tokens=3,
                logprobs=1,
                temperature=1.0,
                extra_body={"ignore_eos": True},
            )
            lp = comp.choices[0].logprobs
            assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == 3
            special = {"[PAD]", "[BOS]", "[EOS]", "[UNK]"}  # in the tokens, skipped in the text (as vLLM does)
            assert "".join(t for t in lp.tokens if t not in special) == comp.choices[0].text
            chat = await client.chat.completions.create(
                model=str(tiny_dir),
                max_tokens=3,
                logprobs=True,
                messages=[{"role": "user", "content": "2+2="}],
                extra_body={"ignore_eos": True},
            )
            content = chat.choices[0].logprobs.content
            assert content is not None and len(content) == 3 and all(c.logprob <= 0 for c in content)
            several = await client.completions.create(model=str(tiny_dir), prompt=["1+1=", "3+3="], max_tokens=2)
            assert [c.index for c in several.choices] == [0, 1]
        finally:
            await client.close()

    asyncio.run(run())


def test_port_in_use_is_an_error_naming_the_port(server: Server, short_tmp: Path, tiny_dir: Path) -> None:
    port = server.url.rsplit(":", 1)[1]
    log = short_tmp / "second.log"
    proc = spawn(
        [
            sys.executable,
            "-m",
            "atroposd",
            "inference",
            "--port",
            port,
            "--model",
            str(tiny_dir),
            "--control-socket",
            str(short_tmp / "x.sock"),
        ],
        log=log,
    )
    try:
        code = proc.wait(120)
    finally:
        stop_process(proc)
    assert code == 1
    assert f"port {port}" in log.read_text()
    assert server.http("GET", "/health")[0] == 200  # the running server is untouched


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_that_is_not_there_is_a_usage_error(short_tmp: Path, tiny_dir: Path) -> None:
    from tests.support import atroposd, free_port

    result = atroposd(
        "inference",
        "--model",
        str(tiny_dir),
        "--device",
        "cuda:0",
        "--port",
        str(free_port()),
        "--control-socket",
        str(short_tmp / "s"),
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "inference.device = 'cuda:0' but CUDA is not available" in result.stderr
    assert not (short_tmp / "s").exists()


def test_a_bad_model_directory_is_a_usage_error(short_tmp: Path) -> None:
    from tests.support import atroposd

    result = atroposd(
        "inference", "--model", str(short_tmp / "nope"), "--control-socket", str(short_tmp / "s"), timeout=120
    )
    assert result.returncode == 2
    assert "neither builtin:tiny nor an existing local directory" in result.stderr


def test_info_answers_while_the_engine_loads() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from atroposd.inference.server import _Front, build_tcp_app

    async def run() -> None:
        front = _Front(model_name="m", max_model_len=64, await_weights=True)
        async with TestClient(TestServer(build_tcp_app(front))) as client:
            resp = await client.get("/info")
            assert resp.status == 503  # not even the tokenizer is known yet
            front.info = {"model": "m", "tokenizer": {"vocab_size": 22}}
            resp = await client.get("/info")
            body = await resp.json()
            assert resp.status == 200 and body["ready"] is False and body["awaiting_weights"] is True
            assert body["tokenizer"] == {"vocab_size": 22} and body["weight_version"] is None
            assert (await client.get("/health")).status == 503
            assert (await client.post("/generate", json={})).status == 503

    asyncio.run(run())


def test_sigterm_while_generations_wait_at_a_paused_gate(short_tmp: Path, tiny_dir: Path) -> None:
    """A stop does not wait for a resume that will never come: the waiting generations get a
    503 naming the shutdown and the server exits 0 at once (not after the HTTP server's grace)."""
    import os
    import signal
    import threading
    import time

    from tests.inference.conftest import start_server

    srv = start_server(short_tmp, tiny_dir)
    answers: list[tuple[int, Any]] = []
    try:
        assert srv.control("POST", "/pause")[0] == 200
        threads = [
            threading.Thread(
                target=lambda k=k: answers.append(
                    srv.http("POST", "/generate", gen_body(max_tokens=3, seed=k), timeout=60)
                )
            )
            for k in range(6)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30  # all six reach the handler and wait at the gate
        while srv.control("GET", "/weight_info")[1]["waiting"] != 6:
            assert time.monotonic() < deadline, "the generations never reached the paused gate"
            time.sleep(0.02)
        assert not answers
        t0 = time.monotonic()
        os.killpg(srv.proc.pid, signal.SIGTERM)
        code = srv.proc.wait(30)
        took = time.monotonic() - t0
        for t in threads:
            t.join(30)
    finally:
        stop_process(srv.proc)
    assert code == 0, srv.tail()
    assert took < 10, f"stop took {took:.1f} s"
    assert len(answers) == 6
    assert all(status == 503 and "shutting down" in str(body) for status, body in answers), answers


def _metrics(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_counts_generations_tokens_outcomes_and_pauses(server: Server) -> None:
    before = _metrics(server)
    body = {"prompt": {"prompt_token_ids": [BOS_ID, 5, 6]}, "n": 3, "max_tokens": 4, "ignore_eos": True}
    assert server.http("POST", "/generate", body)[0] == 200
    assert server.http("POST", "/generate", {"prompt": {"prompt_token_ids": []}})[0] == 400
    assert server.control("POST", "/pause")[0] == 200
    assert server.control("POST", "/resume", {"weight_version": 0})[0] == 200
    after = _metrics(server)

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert grew("atroposd_inference_generations_total") == 3
    assert grew("atroposd_inference_generated_tokens_total") == 12
    assert grew("atroposd_inference_requests_total", route="generate", outcome="ok") == 1
    assert grew("atroposd_inference_requests_total", route="generate", outcome="error") == 1
    assert grew("atroposd_inference_request_seconds_count", route="generate") == 2
    assert grew("atroposd_inference_pauses_total") == 1 and grew("atroposd_inference_paused_seconds_total") > 0
    assert after[("atroposd_inference_requests_in_flight", ())] == 0
    assert after[("atroposd_inference_engine_ready", ())] == 1

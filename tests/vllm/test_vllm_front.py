"""The shared front with the vLLM engine (``--engine vllm``): the same routes and shapes as
with the torch engine, and a push weight update through the control socket. Needs the vllm
venv: ``.venv-vllm/bin/python -m pytest -m vllm tests/vllm``."""

from __future__ import annotations

import asyncio
import importlib.util
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from atroposd.models.tiny import ensure_builtin_model
from tests.inference.conftest import MAX_MODEL_LEN, Server, env_with_nonce, start_server
from tests.support import stop_process

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]

SEQ = [1, 7, 14, 9, 17, 16, 6]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """builtin:tiny, as the inference tests build it."""
    return ensure_builtin_model(tmp_path_factory.mktemp("tiny-state"), seed=0, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def nonce() -> str:
    return "t" + secrets.token_hex(6)


@pytest.fixture(scope="module")
def vllm_server(tiny_dir: Path, nonce: str) -> Iterator[Server]:
    root = Path(tempfile.mkdtemp(prefix="atpd-vf-", dir="/tmp"))
    srv = start_server(root, tiny_dir, extra=["--engine", "vllm"], env=env_with_nonce(nonce))
    try:
        yield srv
    finally:
        code = stop_process(srv.proc, timeout=60)
        shutil.rmtree(root, ignore_errors=True)
        assert code == 0, srv.tail()


def test_routes_and_shapes(vllm_server: Server) -> None:
    srv = vllm_server
    status, info = srv.http("GET", "/info")
    assert status == 200 and info["engine"] == "vllm" and info["tokenizer"]["vocab_size"] == 22
    status, body = srv.http(
        "POST",
        "/generate",
        {
            "prompt": {"prompt_token_ids": SEQ[:5]},
            "n": 3,
            "max_tokens": 3,
            "logprobs": 0,
            "temperature": 1.0,
            "ignore_eos": True,
        },
    )
    assert status == 200, body
    assert len(body["logprobs"]) == 3 and all(len(c) == 3 for c in body["logprobs"])
    assert all(len(item) == 1 and len(item[0]) == 1 for c in body["logprobs"] for item in c)
    assert isinstance(body["weight_version"], int)
    status, body = srv.http("POST", "/generate", {"prompt": {"prompt_token_ids": SEQ}, "max_tokens": 300})
    assert status == 400 and "max_model_len" in body["error"]
    status, comp = srv.http("POST", "/v1/completions", {"prompt": "1+2=", "max_tokens": 2, "logprobs": 0})
    assert status == 200 and comp["usage"]["prompt_tokens"] == 5
    status, probe = srv.control("POST", "/probe_generate")
    assert status == 200 and len(probe["token_ids"][0]) == 1


def test_push_update_is_served(vllm_server: Server, tiny_dir: Path, nonce: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from atroposd.weights.sync import PushSync

    srv = vllm_server
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tiny_dir))).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)  # far from uniform: a weight change shows in every logprob
        logits = model(input_ids=torch.tensor([SEQ])).logits[0].float()
    want = [float(torch.log_softmax(logits, -1)[i - 1, SEQ[i]]) for i in range(1, len(SEQ))]
    weights_dir = srv.root / "run" / "weights"
    weights_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    push = PushSync(nonce=nonce, weights_dir=weights_dir, control_socket=srv.socket)
    try:
        asyncio.run(push.attach(model, 4))
        status, body = srv.http(
            "POST",
            "/generate",
            {"prompt": {"prompt_token_ids": SEQ}, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0},
        )
    finally:
        push.close()
    assert status == 200 and body["weight_version"] == 4
    got = [body["prompt_logprobs"][i][str(SEQ[i])] for i in range(1, len(SEQ))]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 2e-3

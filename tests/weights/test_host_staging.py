"""``push`` through host staging (SPEC §7): a replica that cannot map the trainer's memory (another
GPU, a tensor-parallel replica) copies from one staging buffer in host shared memory, which the
trainer fills per bucket for all such replicas, while a replica on the trainer's device copies
from the exported buffers themselves, both in the same sync. On the CPU the choice is forced
(``paths``), and real `atroposd inference` processes take each path: their weights then equal
the trainer's bit for bit, ``status`` names each replica's path, a sync is split into the
replicas' pause and the transfer, and nothing is left in /dev/shm after ``close``."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from atroposd.config import load_config
from atroposd.weights.manifest import manifest_path, staging_manifest_path
from atroposd.weights.shm import SHM_DIR, list_segments
from atroposd.weights.source import bucket_bytes_of, plan_buckets
from atroposd.weights.sync import PushSync, make_weight_sync, push_paths, replica_sync_status
from atroposd.weights.tensors import model_tensors
from tests.inference.test_weights import local_logprobs, served, train_step, trainer_model
from tests.weights.test_bucket_push import (
    BUCKET,
    Replicas,
    assert_serves,
    digests,
    tiny_dir,
    two_replicas,
)

__all__ = ["tiny_dir"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def pair(tiny_dir: Path) -> Iterator[Replicas]:
    """Two replicas for the module's tests that kill nothing."""
    with two_replicas(tiny_dir) as replicas:
        yield replicas


def staging_segments(nonce: str, exported: set[str]) -> dict[str, int]:
    """The launch's shm segments that are not the trainer's exported buffers: the staging buffer."""
    return {n: os.stat(SHM_DIR / n).st_size for n in list_segments(f"atroposd-{nonce}-") if n not in exported}


@pytest.mark.anyio
async def test_push_through_host_staging_reaches_a_real_replica_bit_for_bit(pair: Replicas) -> None:
    direct, staged = pair.servers
    model = trainer_model(pair.tiny_dir, seed=5)
    sync = PushSync(
        nonce=pair.nonce,
        weights_dir=pair.weights_dir,
        control_sockets=[direct.socket, staged.socket],
        paths=["direct", "host_staging"],
        bucket_bytes=BUCKET,
        digest=True,
    )
    sync.deadline = 60.0
    try:
        await sync.attach(model, 1)
        assert sync.arena is not None
        exported = {seg.name for seg in sync.arena.segments}
        assert replica_sync_status(sync, 0) == {"mode": "push", "path": "shm"}
        assert replica_sync_status(sync, 1) == {"mode": "push", "path": "host_staging"}
        assert sync.stager is not None and sync.stager.last_results[1] == digests(model)
        assert 0 not in sync.stager.last_results  # the direct replica never touched the staging buffer
        for srv in (direct, staged):
            await asyncio.to_thread(assert_serves, srv, model, 1)
        assert sync.replica_versions() == [1, 1] and sync.server_current

        # One staging buffer, one bucket large (not the model), beside the exported buffers.
        specs = sync.stager.source(model).specs()
        largest = max(bucket_bytes_of(specs, b) for b in plan_buckets(specs, BUCKET))
        model_bytes = sum(t.numel() * t.element_size() for t in model_tensors(model).tensors.values())
        seen = staging_segments(pair.nonce, exported)
        assert list(seen.values()) == [largest] and largest < model_bytes / 4
        assert staging_manifest_path(pair.weights_dir, pair.nonce).exists()

        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for version in (2, 3):
            before = local_logprobs(model)
            async with sync.paused(version):
                train_step(model, opt)
            await sync.after_step(model, version)
            assert local_logprobs(model) != before
            assert sync.stager.last_results[1] == digests(model), "the staged replica's weights differ"
            for srv in (direct, staged):
                lps, v = await asyncio.to_thread(served, srv)
                assert v == version and lps == pytest.approx(local_logprobs(model), abs=1e-5)
            # metrics.jsonl's split: the replicas' pause apart from the transfer
            last = sync.last_sync
            assert set(last) >= {"sync_pause_s", "sync_transfer_s", "seconds"}
            assert 0 < last["sync_pause_s"] and 0 < last["sync_transfer_s"] <= last["seconds"]
        assert staging_segments(pair.nonce, exported) == seen  # reused, never a second buffer
    finally:
        sync.close()
    assert not list_segments(f"atroposd-{pair.nonce}-")
    assert not manifest_path(pair.weights_dir, pair.nonce).exists()
    assert not staging_manifest_path(pair.weights_dir, pair.nonce).exists()


@pytest.mark.anyio
async def test_a_restarted_staged_replica_gets_the_weights_from_reattach(pair: Replicas) -> None:
    _, staged = pair.servers
    model = trainer_model(pair.tiny_dir, seed=9)
    sync = PushSync(
        nonce=pair.nonce,
        weights_dir=pair.weights_dir,
        control_sockets=[staged.socket],
        paths=["host_staging"],
        bucket_bytes=BUCKET,
        digest=True,
    )
    sync.deadline = 60.0
    try:
        await sync.attach(model, 7)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_step(model, opt)
        await sync.reattach(model, 8, 0)
        assert sync.stager is not None and sync.stager.last_results[0] == digests(model)
        await asyncio.to_thread(assert_serves, staged, model, 8)
        assert sync.replica_versions() == [8]
    finally:
        sync.close()
    assert not list_segments(f"atroposd-{pair.nonce}-")


def _cfg(short_tmp: Path, **over: Any) -> Any:
    cfg = load_config(None, discover=False)
    cfg.daemon.runtime_dir, cfg.daemon.state_dir = str(short_tmp / "run"), str(short_tmp / "state")
    for key, value in over.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def test_each_replica_gets_its_path_and_auto_picks_push_off_the_trainers_device(short_tmp: Path) -> None:
    cpu = _cfg(short_tmp, trainer__device="cpu", inference__device="cpu", inference__replicas=2)
    assert push_paths(cpu) == ["direct", "direct"] and cpu.weight_sync == "shared"
    cpu.trainer.push_path = "host_staging"  # forced: every replica through the staging buffer
    assert push_paths(cpu) == ["host_staging", "host_staging"]

    # cuda:0 trains; replica 0 shares its GPU (CUDA IPC), replica 1 is on another, replica 2 is
    # tensor-parallel over two: both through host staging. auto then picks push, not shared.
    gpus = _cfg(
        short_tmp,
        trainer__device="cuda:0",
        inference__device=["cuda", "cuda:1", "cuda:2,cuda:3"],
        inference__replicas=3,
    )
    assert push_paths(gpus) == ["direct", "host_staging", "host_staging"]
    assert gpus.weight_sync == "push"
    same = _cfg(short_tmp, trainer__device="cuda:1", inference__device="cuda:1", inference__replicas=2)
    assert same.weight_sync == "shared" and push_paths(same) == ["direct", "direct"]
    lora = _cfg(short_tmp, trainer__device="cuda:0", inference__device="cuda:1", trainer__mode="lora")
    assert lora.weight_sync == "reload"

    gpus.trainer.weight_sync = "push"
    socks = [short_tmp / f"inference-{i}.sock" for i in range(3)]
    sync = make_weight_sync(gpus, nonce="tnonce", control_sockets=socks)
    assert isinstance(sync, PushSync) and sync.paths == ["direct", "host_staging", "host_staging"]
    assert sync.stager is not None and sync.stager.host_staging
    assert sync.stager.manifest_file == staging_manifest_path(Path(gpus.daemon.runtime_dir) / "weights", "tnonce")
    bucketed = make_weight_sync(gpus, nonce="tnonce", control_sockets=socks, bucketed=True)
    assert getattr(bucketed, "host_staging", None) is True
    assert replica_sync_status(bucketed, 1) == {"mode": "push", "path": "host_staging"}
    with pytest.raises(ValueError, match="one of"):
        PushSync(nonce="tnonce", weights_dir=short_tmp, control_sockets=socks[:1], paths=["cuda"])


def test_push_path_is_checked(short_tmp: Path) -> None:
    from atroposd.config import ConfigError, parse_toml

    with pytest.raises(ConfigError, match=r"trainer\.push_path"):
        parse_toml('[trainer]\npush_path = "pcie"\n')
    assert parse_toml('[trainer]\npush_path = "host_staging"\n').trainer.push_path == "host_staging"


@pytest.mark.gpu
def test_host_staging_on_a_gpu_is_pinned_and_copies_to_the_device(short_tmp: Path) -> None:
    """The staging buffer of GPU tensors lives in pinned host shared memory, filled from the
    device bit for bit, and unpinned before it is unmapped."""
    from atroposd.weights.staging import StagingBuffer

    dev = torch.device("cuda:0")
    src = {"a": torch.randn(1000, 64, device=dev, dtype=torch.bfloat16), "b": torch.randn(77, device=dev)}
    buf = StagingBuffer.create("tgpu0", 1 << 20, dev, host=True)
    try:
        assert buf.transport == "shm" and buf.pinned and buf.fits(1 << 20, dev, host=True)
        assert not buf.fits(1 << 20, dev)  # a CUDA IPC buffer is another buffer
        entries = buf.fill(["a", "b"], src)
        for e in entries:
            view = buf.segment.view(e.offset, e.nbytes, src[e.name].dtype, tuple(e.shape))
            assert torch.equal(view, src[e.name].cpu())
        del view
    finally:
        buf.close()
    assert not buf.pinned


@pytest.mark.slow  # a whole job
@pytest.mark.timeout(900)
def test_a_job_pushes_through_host_staging_to_two_replicas(short_tmp: Path) -> None:
    """``[trainer] push_path = "host_staging"``: a whole job's replicas copy every sync from the
    staging buffer; metrics.jsonl splits each sync into pause and transfer; nothing is left."""
    import re

    from tests.e2e.jobs import daemon_env, metrics, replica_job_config
    from tests.support import atroposd

    cfg = replica_job_config(
        short_tmp, replicas=2, steps=4, trainer={"weight_sync": "push", "sync_every": 2, "push_path": "host_staging"}
    )
    res = atroposd("run", "-c", str(cfg), env=daemon_env(), timeout=840)
    assert res.returncode == 0, f"run exited {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    state = short_tmp / "state"
    rows = metrics(state)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        synced = r["step"] % 2 == 0
        assert ("sync_pause_s" in r) == synced and ("sync_transfer_s" in r) == synced, r
        if synced:
            assert r["sync_pause_s"] >= 0 and r["sync_transfer_s"] > 0
    log = "".join(f.read_text() for f in (state / "logs").glob("*.log"))
    created = [line for line in log.splitlines() if "staging buffer for the push created" in line]
    assert created and all(re.search(r'host_staging"?\s*[:=]\s*[Tt]rue', line) for line in created), [
        line for line in log.splitlines() if "staging" in line
    ][:5]
    nonces = set(re.findall(r"config-([0-9a-f]+)\.toml", log))
    assert nonces and not any(list_segments(f"atroposd-{n}-") for n in nonces)

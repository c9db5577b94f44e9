"""The bucketed push and the sharded reload (several trainer ranks, SPEC §12.1 "Weights with
N > 1"), into real `atroposd inference` servers (torch engine, the builtin tiny model), fed by
the one-rank tensor source: the weights stream through one staging buffer a bucket at a time,
every replica copies each bucket, generation carries exactly the version the replicas were
resumed with, a replica that dies or refuses halfway never serves a mix, and nothing is left."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from atroposd.models.tiny import ensure_builtin_model
from atroposd.weights.client import WeightControlError
from atroposd.weights.manifest import (
    ALIGNMENT,
    BucketRef,
    Manifest,
    TensorSpec,
    manifest_path,
    process_start_time,
)
from atroposd.weights.protocol import SYNC_INDEX_FILE, WeightUpdateError
from atroposd.weights.receiver import ReceiverState, apply_update, load_dir
from atroposd.weights.shm import SHM_DIR, list_segments
from atroposd.weights.source import ModelSource, TensorSource, bucket_bytes_of, plan_buckets
from atroposd.weights.staging import StagingBuffer
from atroposd.weights.sync import BucketPushSync, ReloadSync, make_weight_sync
from atroposd.weights.tensors import model_tensors, tensor_digest
from tests.inference.conftest import MAX_MODEL_LEN, Server, env_with_nonce, start_server
from tests.inference.test_weights import (
    SEQ,
    close,
    local_logprobs,
    served,
    train_step,
    trainer_model,
)
from tests.support import stop_process

BUCKET = 200_000  # the tiny model (1.3 MB) takes 8 buckets


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_builtin_model(tmp_path_factory.mktemp("tiny-state"), seed=0, max_model_len=MAX_MODEL_LEN)


class Replicas:
    """`atroposd inference --await-weights` servers of one launch (one nonce), under one root."""

    def __init__(self, tiny_dir: Path) -> None:
        self.tiny_dir = tiny_dir
        self.nonce = "t" + secrets.token_hex(6)
        self.root = Path(tempfile.mkdtemp(prefix="atpd-b-", dir="/tmp"))
        self.servers: list[Server] = []
        self.weights_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    @property
    def weights_dir(self) -> Path:
        return self.root / "run" / "weights"

    @property
    def sync_dir(self) -> Path:
        return self.root / "state" / "sync"

    def start(self) -> Server:
        srv = start_server(self.root, self.tiny_dir, extra=["--await-weights"], env=env_with_nonce(self.nonce))
        self.servers.append(srv)
        return srv

    def stop(self, srv: Server) -> None:
        stop_process(srv.proc)
        self.servers.remove(srv)

    def close(self) -> None:
        for srv in list(self.servers):
            self.stop(srv)
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def two_replicas(tiny_dir: Path) -> Iterator[Replicas]:
    """Two running replicas, stopped and removed at the end (the weight tests' module fixtures)."""
    replicas = Replicas(tiny_dir)
    try:
        replicas.start()
        replicas.start()
        yield replicas
    finally:
        replicas.close()


def digests(model: torch.nn.Module) -> dict[str, str]:
    """sha256 of each exchangeable tensor's bytes: equal digests, equal bits."""
    return {n: tensor_digest(t) for n, t in model_tensors(model).tensors.items()}


@pytest.fixture(scope="module")
def launch(tiny_dir: Path) -> Iterator[Replicas]:
    """Two replicas for the module's tests that kill nothing."""
    with two_replicas(tiny_dir) as replicas:
        yield replicas


def push_sync(launch: Replicas, servers: Sequence[Server], **kw: Any) -> BucketPushSync:
    return BucketPushSync(
        nonce=launch.nonce,
        weights_dir=launch.weights_dir,
        control_sockets=[s.socket for s in servers],
        bucket_bytes=BUCKET,
        **kw,
    )


def assert_serves(srv: Server, model: torch.nn.Module, version: int) -> None:
    lps, v = served(srv)
    assert v == version
    assert close(lps, local_logprobs(model), 1e-5), "the replica does not serve the trainer's weights"


class Watched:
    """The one-rank source, recording what each gather hands out and what lies in /dev/shm."""

    def __init__(self, model: torch.nn.Module, nonce: str) -> None:
        self.inner = ModelSource(model)
        self.model = model
        self.nonce = nonce
        self.gathered: list[list[str]] = []
        self.copies = 0  # gathered tensors that are not the model's own memory
        self.segments: list[dict[str, int]] = []  # the launch's segments, seen at each gather
        self.on_gather: Any = None

    def specs(self) -> dict[str, TensorSpec]:
        return self.inner.specs()

    def tied(self) -> dict[str, str]:
        return self.inner.tied()

    def lora(self) -> dict[str, Any] | None:
        return self.inner.lora()

    async def gather(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        if self.on_gather is not None:
            await self.on_gather(len(self.gathered))
        self.gathered.append(list(names))
        self.segments.append({n: os.stat(SHM_DIR / n).st_size for n in list_segments(f"atroposd-{self.nonce}-")})
        out = await self.inner.gather(names)
        own = model_tensors(self.model).tensors
        self.copies += sum(1 for n, t in out.items() if t.data_ptr() != own[n].data_ptr())
        return out


def test_plan_buckets_in_order_every_name_once_and_a_large_tensor_alone() -> None:
    specs = {
        "a": TensorSpec("float32", (10,)),
        "big": TensorSpec("float32", (1000,)),
        "b": TensorSpec("bfloat16", (30,)),
        "c": TensorSpec("float32", (20,)),
        "d": TensorSpec("float16", (40,)),
    }
    plan = plan_buckets(specs, 256)
    assert plan == [["a"], ["big"], ["b", "c"], ["d"]]
    assert [n for b in plan for n in b] == list(specs)
    assert all(bucket_bytes_of(specs, b) <= 256 for b in plan if b != ["big"])
    assert bucket_bytes_of(specs, ["a"]) == ALIGNMENT  # each tensor counted with its alignment
    assert plan_buckets(specs, 1 << 20) == [list(specs)]
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(specs, 0)
    assert isinstance(ModelSource(torch.nn.Linear(2, 2)), TensorSource)


@pytest.mark.anyio
async def test_bucketed_push_reaches_every_replica_with_one_bucket_of_staging(launch: Replicas) -> None:
    first, second = launch.servers
    model = trainer_model(launch.tiny_dir, seed=7)
    source = Watched(model, launch.nonce)
    sync = push_sync(launch, launch.servers, source_for=lambda m: source)
    specs = source.specs()
    model_bytes = sum(t.numel() * t.element_size() for t in model_tensors(model).tensors.values())
    plan = plan_buckets(specs, BUCKET)
    try:
        await sync.attach(model, 3)
        assert len(plan) >= 4 and source.gathered == plan
        for srv in (first, second):
            await asyncio.to_thread(assert_serves, srv, model, 3)
        assert sync.replica_versions() == [3, 3] and sync.server_current

        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        before = local_logprobs(model)
        async with sync.paused(4):
            train_step(model, opt)
        report = await sync.after_step(model, 4)
        assert report is sync.last_sync and report["buckets"] == len(plan)  # the step's sync, returned
        assert not close(before, local_logprobs(model), 1e-3)  # the step changed what is served
        for srv in (first, second):
            await asyncio.to_thread(assert_serves, srv, model, 4)
            status, info = await asyncio.to_thread(srv.control, "GET", "/weight_info")
            assert status == 200 and info["weight_version"] == 4 and info["paused"] is False

        # Rank 0's extra memory: one staging segment of the largest bucket, the same one for
        # every bucket of every sync; the one-rank source hands out the model's own tensors.
        largest = max(bucket_bytes_of(specs, b) for b in plan)
        seen = [s for s in source.segments if s]
        assert len(seen) == 2 * len(plan) - 1  # from the second gather on: the segment is there
        assert all(s == seen[0] for s in seen) and len(seen[0]) == 1
        assert list(seen[0].values()) == [largest] and largest <= BUCKET < model_bytes / 4
        assert sync.last_sync["staging_bytes"] == largest and sync.last_sync["buckets"] == len(plan)
        assert sync.last_sync["bytes"] == model_bytes
        assert source.copies == 0
    finally:
        sync.close()
    assert not list_segments(f"atroposd-{launch.nonce}-")
    assert not manifest_path(launch.weights_dir, launch.nonce).exists()


@pytest.mark.slow  # a whole job or a long search: run by .ci/run, not in the default run
@pytest.mark.anyio
async def test_a_replica_killed_mid_sync_is_skipped_and_reattach_brings_it_current(tiny_dir: Path) -> None:
    replicas = Replicas(tiny_dir)
    try:
        first, victim = replicas.start(), replicas.start()
        model = trainer_model(tiny_dir, seed=11)
        source = Watched(model, replicas.nonce)
        sync = push_sync(replicas, [first, victim], source_for=lambda m: source)
        try:
            await sync.attach(model, 4)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            train_step(model, opt)
            start = len(source.gathered)

            async def kill_in_the_middle(i: int) -> None:
                if i == start + 3:
                    os.kill(victim.proc.pid, signal.SIGKILL)
                    await asyncio.to_thread(victim.proc.wait, 10)

            source.on_gather = kill_in_the_middle
            await sync.after_step(model, 5)  # the dead replica is skipped; the sync goes on
            assert len(source.gathered) == start + len(plan_buckets(source.specs(), BUCKET))
            await asyncio.to_thread(assert_serves, first, model, 5)
            assert sync.replica_versions() == [5, 4] and not sync.server_current
            assert not sync.replicas[1].current
            replicas.stop(victim)

            back = replicas.start()  # the restarted replica (the daemon keeps its socket path)
            sync.replicas[1].socket = back.socket
            await sync.reattach(model, 5, 1)
            await asyncio.to_thread(assert_serves, back, model, 5)
            assert sync.replica_versions() == [5, 5] and sync.server_current
        finally:
            sync.close()
        assert not list_segments(f"atroposd-{replicas.nonce}-")
    finally:
        replicas.close()


@pytest.mark.anyio
async def test_a_replica_refusing_halfway_never_serves_a_mix(launch: Replicas) -> None:
    import aiohttp

    srv = launch.servers[0]
    model = trainer_model(launch.tiny_dir, seed=21)
    sync = push_sync(launch, [srv])
    try:
        await sync.attach(model, 6)
        await asyncio.to_thread(assert_serves, srv, model, 6)
        # A tensor the server's model lacks, in the last bucket: the earlier buckets are copied,
        # then the replica refuses, naming it.
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_step(model, opt)
        model.model.norm.register_parameter("extra", torch.nn.Parameter(torch.ones(3)))
        with pytest.raises(
            WeightControlError, match=r"refused a bucket.*'model\.norm\.extra' is in the export but not"
        ):
            await sync.after_step(model, 7)
        assert not sync.server_current and sync.replica_versions() == [6]
        status, info = await asyncio.to_thread(srv.control, "GET", "/weight_info")
        assert info["paused"] is True and info["weight_version"] == 6
        status, answer = await asyncio.to_thread(srv.control, "POST", "/resume", {"weight_version": 6})
        assert status == 400 and "incomplete" in answer["error"] and "mix of versions" in answer["error"]
        # A generation waits at the gate: it is answered once every bucket arrived, with the new version.
        async with aiohttp.ClientSession() as session:
            body = {"prompt": {"prompt_token_ids": SEQ}, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
            held = asyncio.ensure_future(session.post(srv.url + "/generate", json=body))
            await asyncio.sleep(1.0)
            assert not held.done()
            del model.model.norm.extra
            await sync.reattach(model, 7, 0)
            resp = await asyncio.wait_for(held, 60)
            answer = await resp.json()
            assert resp.status == 200 and answer["weight_version"] == 7
        await asyncio.to_thread(assert_serves, srv, model, 7)
        assert sync.server_current
    finally:
        sync.close()


@pytest.mark.anyio
@pytest.mark.parametrize("bad", ["dtype", "shape"])
async def test_a_bucket_of_another_dtype_or_shape_is_refused(launch: Replicas, bad: str) -> None:
    srv = launch.servers[1]
    good = trainer_model(launch.tiny_dir, seed=31)
    if bad == "dtype":
        wrong = trainer_model(launch.tiny_dir, seed=31).to(torch.bfloat16)
        message = r"dtype bfloat16 != the importer's float32"
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(str(launch.tiny_dir))
        cfg.intermediate_size *= 2
        wrong = AutoModelForCausalLM.from_config(cfg)
        message = r"'model\.layers\.0\.mlp\.gate_proj\.weight': shape \[512, 128\] != the importer's \[256, 128\]"
    sync = push_sync(launch, [srv])
    try:
        with pytest.raises(WeightControlError, match=message):
            await sync.attach(wrong, 8)
        assert not sync.server_current
        await sync.reattach(good, 8, 0)
        await asyncio.to_thread(assert_serves, srv, good, 8)
    finally:
        sync.close()
    assert not list_segments(f"atroposd-{launch.nonce}-")


@pytest.mark.anyio
async def test_sharded_reload_writes_a_bucket_per_file_and_every_replica_loads_it(launch: Replicas) -> None:
    model = trainer_model(launch.tiny_dir, seed=41)
    source = Watched(model, launch.nonce)
    sync = ReloadSync(
        sync_dir=launch.sync_dir,
        control_sockets=[s.socket for s in launch.servers],
        bucket_bytes=BUCKET,
        source_for=lambda m: source,
    )
    plan = plan_buckets(source.specs(), BUCKET)
    try:
        await sync.attach(model, 9)
        for srv in launch.servers:
            await asyncio.to_thread(assert_serves, srv, model, 9)
        assert source.gathered == plan
        assert sync.current is not None
        shards = sorted(p.name for p in sync.current.glob("model-*.safetensors"))
        assert len(shards) == len(plan) and (sync.current / SYNC_INDEX_FILE).is_file()
        assert not (sync.current / "model.safetensors").exists()
        # The receiver checks the shards against the index.
        copy = launch.sync_dir / "v99"
        shutil.copytree(sync.current, copy)
        other = trainer_model(launch.tiny_dir, seed=0)
        result = load_dir(other, copy, weight_version=9)
        assert result["weight_version"] == 9 and close(local_logprobs(other), local_logprobs(model), 1e-6)
        with pytest.raises(WeightUpdateError, match="holds weight_version 9, the request says 10"):
            load_dir(other, copy, weight_version=10)
        (copy / shards[-1]).unlink()
        with pytest.raises(WeightUpdateError, match=f"{shards[-1]}, listed in {SYNC_INDEX_FILE}, does not exist"):
            load_dir(other, copy)
        shutil.rmtree(copy)
    finally:
        sync.close()
    assert not list(launch.sync_dir.iterdir())


def _bucket_manifest(
    staging: StagingBuffer,
    nonce: str,
    weights_dir: Path,
    tensors: dict[str, torch.Tensor],
    names: list[str],
    version: int,
    bucket: BucketRef,
    tied: dict[str, str],
) -> Path:
    start = process_start_time(os.getpid())
    assert start is not None
    entries = staging.fill(names, tensors)
    path = manifest_path(weights_dir, nonce)
    Manifest(
        nonce=nonce,
        exporter_pid=os.getpid(),
        exporter_start_time=start,
        export_id=bucket.index + 1,
        weight_version=version,
        transport="shm",
        segments=(staging.ref(),),
        tensors=tuple(entries),
        tied=tied,
        bucket=bucket,
    ).write(path)
    return path


def test_the_receiver_takes_buckets_in_order_and_only_a_complete_set(short_tmp: Path, tiny_dir: Path) -> None:
    nonce = "t" + secrets.token_hex(6)
    weights_dir = short_tmp / "weights"
    weights_dir.mkdir(mode=0o700)
    trainer, server = trainer_model(tiny_dir, seed=51), trainer_model(tiny_dir, seed=52)
    mt = model_tensors(trainer)
    specs = mt.specs()
    plan = plan_buckets(specs, BUCKET)
    state = ReceiverState(nonce=nonce, weights_dir=weights_dir)
    staging = StagingBuffer.create(nonce, max(bucket_bytes_of(specs, b) for b in plan), torch.device("cpu"))

    def send(i: int, version: int = 3, names: list[str] | None = None) -> dict[str, Any]:
        path = _bucket_manifest(
            staging, nonce, weights_dir, mt.tensors, names or plan[i], version, BucketRef(i, len(plan)), mt.tied
        )
        return apply_update(server, {"manifest": str(path), "mode": "copy", "weight_version": version}, state=state)

    try:
        with pytest.raises(WeightUpdateError, match=r"bucket 1 of .* out of order: expected bucket 0"):
            send(1)
        assert state.incomplete() is None  # nothing was touched
        first = send(0)
        assert first["bucket"] == 0 and first["complete"] is False and state.weight_version is None
        assert "1 of the" in (state.incomplete() or "")
        with pytest.raises(WeightUpdateError, match=r"out of order: expected bucket 1 of .* of weight_version 3"):
            send(2)
        with pytest.raises(WeightUpdateError, match="out of order"):
            send(1, version=4)
        path = _bucket_manifest(staging, nonce, weights_dir, mt.tensors, plan[1], 3, BucketRef(1, len(plan)), mt.tied)
        with pytest.raises(WeightUpdateError, match=r"copied .mode 'copy'., not 'attach'"):
            apply_update(server, {"manifest": str(path), "mode": "attach"}, state=state)
        for i in range(1, len(plan) - 1):
            send(i)
        # The last bucket without one of its tensors: the set is not complete.
        short = plan[-1][:-1]
        with pytest.raises(WeightUpdateError, match=f"did not hold every tensor of the model: '{plan[-1][-1]}'"):
            send(len(plan) - 1, names=short)
        assert state.incomplete() is not None
        for i in range(len(plan)):  # a push starts again from bucket 0
            last = send(i)
        assert last["complete"] is True and state.incomplete() is None and state.weight_version == 3
        assert close(local_logprobs(server), local_logprobs(trainer), 1e-6)
    finally:
        state.release(server)
        staging.close()
        manifest_path(weights_dir, nonce).unlink(missing_ok=True)


def test_make_weight_sync_picks_the_bucketed_strategies(short_tmp: Path) -> None:
    from atroposd.config import load_config

    cfg = load_config(None, discover=False)
    cfg.daemon.runtime_dir, cfg.daemon.state_dir = str(short_tmp / "run"), str(short_tmp / "state")
    sock = short_tmp / "inference.sock"
    cfg.trainer.weight_sync = "push"
    sync = make_weight_sync(cfg, nonce="tnonce", control_socket=sock, bucketed=True, bucket_bytes=1 << 20)
    assert isinstance(sync, BucketPushSync) and sync.bucket_bytes == 1 << 20 and sync.mode == "push"
    assert type(make_weight_sync(cfg, nonce="tnonce", control_socket=sock)).__name__ == "PushSync"
    cfg.trainer.weight_sync = "reload"
    reload = make_weight_sync(cfg, nonce="tnonce", control_socket=sock, bucketed=True)
    assert isinstance(reload, ReloadSync) and reload.bucket_bytes == 512 << 20
    cfg.trainer.weight_sync = "shared"
    with pytest.raises(ValueError, match=r"shared.*one trainer rank"):
        make_weight_sync(cfg, nonce="tnonce", control_socket=sock, bucketed=True)

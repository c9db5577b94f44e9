"""Weight sync to several inference replicas (SPEC §12.2), each a real server process
(tests/weights/child_server.py): every sync reaches every replica; a replica killed -9 is
skipped while training goes on and gets the current weights when it is back. The Replicas
object every mode holds: its fan-out, an unreachable replica, one object for push and its
staged replicas; the trainer's source given to the factory."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import pytest
import torch

from atroposd.weights.replicas import Replica, Replicas
from atroposd.weights.shm import list_segments
from atroposd.weights.sync import PushSync, ReloadSync, SharedSync, WeightSync
from tests.weights.conftest import ChildFactory, make_model, score, train_step

pytestmark = pytest.mark.anyio

ATOL = 1e-5


def _sync(mode: str, dirs: dict[str, Path], nonce: str, sockets: list[Path]) -> WeightSync:
    if mode == "shared":
        return SharedSync(nonce=nonce, weights_dir=dirs["weights"], control_sockets=sockets)
    if mode == "push":
        return PushSync(nonce=nonce, weights_dir=dirs["weights"], control_sockets=sockets)
    return ReloadSync(sync_dir=dirs["sync"], control_sockets=sockets)


async def _step(sync: WeightSync, model: torch.nn.Module, opt: torch.optim.Optimizer, version: int) -> None:
    async with sync.paused(version):
        train_step(model, opt)
    await sync.after_step(model, version)


@pytest.mark.slow  # a whole job or a long search: run by .ci/run, not in the default run
@pytest.mark.parametrize("mode", ["shared", "push", pytest.param("reload")])
async def test_every_replica_follows_and_a_killed_one_catches_up(
    mode: str, dirs: dict[str, Path], nonce: str, child_factory: ChildFactory
) -> None:
    first, second = child_factory.reuse(), child_factory.start()
    model = make_model(0)
    sync = _sync(mode, dirs, nonce, [first.socket, second.socket])
    try:
        await sync.attach(model, 0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        await _step(sync, model, opt, 1)
        for child in (first, second):
            lp, version = await child.logprobs()
            assert version == 1
            torch.testing.assert_close(lp, score(model), atol=ATOL, rtol=0)
        assert sync.replica_versions() == [1, 1]
        if mode == "shared":  # one copy for all: both replicas map the trainer's buffers, nothing copied
            for child in (first, second):
                assert (await child.call("GET", "/weight_info"))["updates"] == 1

        os.kill(second.proc.pid, signal.SIGKILL)
        second.proc.wait(10)
        for v in (2, 3):  # the dead replica is skipped; the live one follows every step
            await _step(sync, model, opt, v)
            lp, version = await first.logprobs()
            assert version == v
            torch.testing.assert_close(lp, score(model), atol=ATOL, rtol=0)
        assert sync.replica_versions() == [3, 1] and not sync.server_current

        back = child_factory.start()
        sync.replicas[1].socket = back.socket  # the restarted replica (the daemon keeps the socket path)
        await sync.reattach(model, 3, 1)  # the restarted replica alone
        lp, version = await back.logprobs()
        assert version == 3 and sync.server_current
        torch.testing.assert_close(lp, score(model), atol=ATOL, rtol=0)
        await _step(sync, model, opt, 4)
        for child in (first, back):
            assert (await child.logprobs())[1] == 4
    finally:
        sync.close()
    assert not list_segments(f"atroposd-{nonce}-")


# ---------------------------------------------------------------------------- the replicas object


async def test_a_fan_out_runs_every_call_and_raises_the_first_replicas_failure_once_all_ended(
    short_tmp: Path,
) -> None:
    reps = Replicas([short_tmp / f"r{i}.sock" for i in range(3)])
    ended: list[int] = []

    async def fn(r: Replica) -> int:
        await anyio.sleep(0.05 * (3 - r.index))  # replica 2 ends first, replica 0 last
        ended.append(r.index)
        if r.index > 0:
            raise ValueError(f"replica {r.index}")
        return r.index

    with pytest.raises(ValueError, match="replica 1"):  # by replica, not by time
        await reps.each(reps, fn)
    assert ended == [2, 1, 0]  # nobody was cancelled

    async def index(r: Replica) -> int:
        await anyio.sleep(0.05 * (3 - r.index))
        return r.index

    assert await reps.each(reps, index) == [0, 1, 2]  # in the targets' order, not the order they ended


async def test_an_unreachable_replica_is_skipped_marked_not_current_and_keeps_its_version(short_tmp: Path) -> None:
    reps = Replicas([short_tmp / "gone.sock"], deadline=2.0)
    r = reps[0]
    r.current, r.version = True, 4
    timed: list[tuple[float, float]] = []
    ok = await reps.update(r, 5, 0, "load", short_tmp / "v5", 5, timed=lambda p, t: timed.append((p, t)))
    assert ok is False
    assert not r.current and r.version == 4 and reps.versions() == [4] and not reps.current
    assert reps.sync_timeouts == 0 and timed == []  # never paused: nothing timed
    assert reps.targets(None) == [r] and reps.targets(0) == [r] and reps.targets(3) == []


def test_push_and_its_staged_replicas_are_one_replicas_object(dirs: dict[str, Path], nonce: str) -> None:
    """The host-staging replicas are fed through the same Replicas: one deadline, one count of
    timed-out requests (what the watchdog reads), one view of who is current."""
    sync = PushSync(
        nonce=nonce,
        weights_dir=dirs["weights"],
        control_sockets=[dirs["weights"] / "a.sock", dirs["weights"] / "b.sock"],
        paths=["direct", "host_staging"],
    )
    try:
        assert sync.stager is not None and sync.stager.replicas is sync.replicas
        sync.deadline = 7.0
        assert sync.stager.deadline == sync.replicas.deadline == 7.0
        sync.replicas.sync_timeouts = 2
        assert sync.sync_timeouts == sync.stager.sync_timeouts == 2
        sync.replicas[1].current = True
        assert not sync.server_current
        sync.replicas[0].current = True
        assert sync.server_current and sync.replica_versions() == [None, None]
    finally:
        sync.close()


def test_the_factory_gives_each_mode_the_trainers_source(short_tmp: Path) -> None:
    """``source_for`` is given when the sync is made (no one patches it in afterwards): the
    bucketed push, the sharded reload and broadcast read the model's tensors from it."""
    from atroposd.config import load_config
    from atroposd.weights.source import ModelSource
    from atroposd.weights.sync import BroadcastSync, BucketPushSync, ReloadSync, make_weight_sync

    cfg = load_config(None, discover=False)
    cfg.daemon.runtime_dir, cfg.daemon.state_dir = str(short_tmp / "run"), str(short_tmp / "state")
    model = make_model(0)
    asked: list[torch.nn.Module] = []

    def source_for(m: torch.nn.Module) -> ModelSource:
        asked.append(m)
        return ModelSource(m)

    sock = short_tmp / "inference.sock"
    for mode, bucketed, kind in (
        ("push", True, BucketPushSync),
        ("reload", True, ReloadSync),
        ("broadcast", False, BroadcastSync),
    ):
        cfg.trainer.weight_sync = mode
        sync = make_weight_sync(cfg, nonce="tnonce", control_socket=sock, bucketed=bucketed, source_for=source_for)
        try:
            assert isinstance(sync, kind)
            first = sync.source(model)
            assert sync.source(model) is first and asked == [model]  # made once per model
            other = make_model(1)
            assert sync.source(other) is not first and asked == [model, other]
        finally:
            sync.close()
            asked.clear()


async def test_the_trainer_gives_the_sync_the_source_of_its_current_model(short_tmp: Path) -> None:
    """What the daemon hands the sync as ``source_for``: with several ranks the source that
    gathers the current model's shards, for any other model (or one rank) the model's own."""
    from types import SimpleNamespace

    from atroposd.config import load_config
    from atroposd.trainer.service import TrainerService
    from atroposd.trainer.sharded_source import ShardedSource
    from atroposd.weights.source import ModelSource
    from atroposd.weights.sync import make_weight_sync

    cfg = load_config(None, discover=False)
    cfg.daemon.runtime_dir, cfg.daemon.state_dir = str(short_tmp / "run"), str(short_tmp / "state")
    cfg.trainer.weight_sync = "reload"
    service = TrainerService(
        cfg, instance="t", weights=make_weight_sync(cfg, nonce="t", control_socket=None), envs_alive=lambda: True
    )
    try:
        model, other = make_model(0), make_model(1)
        assert isinstance(service.weight_source(model), ModelSource)
        ranks = SimpleNamespace(world=2)
        service._attach_source(
            SimpleNamespace(ranks=ranks, policy=SimpleNamespace(model=model), tensor_specs={}, tied={})
        )
        sharded = service.weight_source(model)
        assert isinstance(sharded, ShardedSource) and sharded.model is model and sharded.ranks is ranks
        assert isinstance(service.weight_source(other), ModelSource)
        service._attach_source(SimpleNamespace(ranks=SimpleNamespace(world=1), policy=SimpleNamespace(model=model)))
        assert isinstance(service.weight_source(model), ModelSource)  # a group of one rank: the model's own
    finally:
        service.compute.close()

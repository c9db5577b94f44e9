"""What the loop writes into each metrics.jsonl row about the weight sync and the replicas, with a
real learner on the tiny model: ``gather_s`` is the gathering of the sync that ran in that step
(0 in a step without a sync, or with a sync that gathers nothing), also through the daemon's
watched wrapper; ``replica_generations`` is whatever the handed-in reader says at that row."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from atroposd.daemon.watchdog import WatchedSync
from atroposd.trainer.loop import Progress, TrainingLoop
from atroposd.trainer.metrics import MetricsWriter, read_metrics
from atroposd.trainer.setup import build_learner, load_for_training
from tests.trainer.conftest import make_cfg
from tests.trainer.test_loop import ListFeed

pytestmark = pytest.mark.anyio


class GatheringSync:
    """Syncs every second step, each sync reporting the seconds it 'gathered' (like the bucketed
    push)."""

    mode = "push"

    def __init__(self) -> None:
        self.last_sync: dict[str, float] = {}
        self.steps = 0

    @asynccontextmanager
    async def paused(self, new_version: int | None = None) -> AsyncIterator[None]:
        yield

    async def after_step(self, model: torch.nn.Module, version: int) -> dict[str, float] | None:
        self.steps += 1
        if self.steps % 2 == 0:
            self.last_sync = {"buckets": 1, "bytes": 10, "gather_s": 0.25 * version, "seconds": 1.0}
            return self.last_sync
        return None


async def _run(tiny_dir: Path, state_dir: Path, weights: Any, steps: int, **kw: Any) -> tuple[TrainingLoop, list[Any]]:
    cfg = make_cfg(state_dir, tiny_dir, steps=steps, checkpoint_every=100)
    setup = load_for_training(cfg)
    learner = build_learner(cfg, setup)
    loop = TrainingLoop(
        tcfg=cfg.trainer,
        feed=ListFeed([]),
        learner=learner,
        weights=weights,  # type: ignore[arg-type]
        metrics=MetricsWriter(state_dir / "metrics.jsonl"),
        checkpointer=setup.checkpointer(learner),
        progress=Progress(total_steps=steps),
        envs_alive=lambda: True,
        lock=anyio.Lock(),
        **kw,
    )
    try:
        assert await loop.run() == "finished"
    finally:
        loop.metrics.close()
    return loop, read_metrics(state_dir / "metrics.jsonl")


async def test_gather_time_of_the_steps_that_synced_and_the_replicas_counts(tiny_dir: Path, state_dir: Path) -> None:
    counts = iter([[3, 4], [5, None], [8, 9], [8, 12]])
    loop, rows = await _run(
        tiny_dir, state_dir, WatchedSync(GatheringSync()), 4, replica_generations=lambda: next(counts)
    )
    assert [r["gather_s"] for r in rows] == [0.0, 0.5, 0.0, 1.0]
    assert all(r["sync_s"] >= 0 for r in rows)
    assert [r["replica_generations"] for r in rows] == [[3, 4], [5, None], [8, 9], [8, 12]]
    assert loop.progress.seconds["gather"] == 1.5


async def test_a_sync_without_gathering_and_no_replica_reader(tiny_dir: Path, state_dir: Path) -> None:
    from tests.trainer.test_loop import RecordingSync

    _, rows = await _run(tiny_dir, state_dir, RecordingSync(), 2)
    assert [r["gather_s"] for r in rows] == [0.0, 0.0]
    assert all("replica_generations" not in r for r in rows)

"""The training loop's own decisions, with a real learner on the tiny model: a step whose loss
is not finite is skipped (no optimizer step, no weight version, no sync), a run of them ends
the run, and a batch without one usable group is skipped and its groups counted."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from atroposd.trainer import loop as loop_mod
from atroposd.trainer.loop import Progress, TrainerError, TrainingLoop
from atroposd.trainer.metrics import MetricsWriter, read_metrics
from atroposd.trainer.setup import build_learner, load_for_training
from tests.trainer.conftest import make_cfg, make_groups

pytestmark = pytest.mark.anyio


class ListFeed:
    """The feed's interface over prepared lists of groups (the network side has its own tests)."""

    def __init__(self, batches: list[list[Any]]) -> None:
        self.batches = batches
        self.fetched = self.released = 0
        self.last_filtered: list[dict[str, Any]] = []  # filter_groups is off
        self.last_timeline: dict[str, float | None] = {}

    async def next(self, *, data_timeout: float, envs_alive: Any) -> list[Any] | None:
        self.fetched += 1
        # one group of 8: one micro-batch, one forward pass per step
        return self.batches.pop(0) if self.batches else make_groups(100 + self.fetched, n=1)

    def release(self) -> None:
        self.released += 1

    def cancel_wait(self) -> None:
        pass


class RecordingSync:
    """The weight-sync interface, recording what the loop asks of it."""

    def __init__(self) -> None:
        self.paused_versions: list[int] = []
        self.synced_versions: list[int] = []

    @asynccontextmanager
    async def paused(self, version: int) -> AsyncIterator[None]:
        self.paused_versions.append(version)
        yield

    async def after_step(self, model: torch.nn.Module, version: int) -> None:
        self.synced_versions.append(version)


def _loop(tiny_dir: Path, state_dir: Path, feed: ListFeed, steps: int) -> tuple[TrainingLoop, RecordingSync]:
    cfg = make_cfg(state_dir, tiny_dir, steps=steps, checkpoint_every=100)
    setup = load_for_training(cfg)
    learner = build_learner(cfg, setup)
    sync = RecordingSync()
    loop = TrainingLoop(
        tcfg=cfg.trainer,
        feed=feed,
        learner=learner,
        weights=sync,  # type: ignore[arg-type]
        metrics=MetricsWriter(state_dir / "metrics.jsonl"),
        checkpointer=setup.checkpointer(learner),
        progress=Progress(total_steps=steps),
        envs_alive=lambda: True,
        lock=anyio.Lock(),
    )
    return loop, sync


def _poison(model: torch.nn.Module, calls: int) -> list[int]:
    """The final norm outputs NaN for the next ``calls`` forward passes: a non-finite loss."""
    left = [calls]

    def hook(_m: torch.nn.Module, _i: Any, out: torch.Tensor) -> torch.Tensor:
        if left[0] > 0:
            left[0] -= 1
            return out * float("nan")
        return out

    model.get_submodule("model.norm").register_forward_hook(hook)
    return left


async def test_a_non_finite_step_is_skipped_without_touching_the_weights(tiny_dir: Path, state_dir: Path) -> None:
    feed = ListFeed([])
    loop, sync = _loop(tiny_dir, state_dir, feed, steps=3)
    model = loop.learner.policy.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    left = _poison(model, 2)  # the first two steps' forward passes
    try:
        assert await loop.run() == "finished"
    finally:
        loop.metrics.close()
    p = loop.progress
    assert left[0] == 0 and p.step == 3 and p.weight_version == 3
    assert p.skipped_steps == 2, p.skipped_steps  # two batches had a NaN loss
    assert sync.paused_versions == [1, 2, 3] and sync.synced_versions == [1, 2, 3]
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    rows = read_metrics(state_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["skipped_steps"] == 2
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert feed.fetched == feed.released == 5  # every fetched batch released, skipped ones included
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


async def test_a_run_of_non_finite_steps_ends_the_run(
    tiny_dir: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loop_mod, "MAX_CONSECUTIVE_SKIPS", 3)
    loop, sync = _loop(tiny_dir, state_dir, ListFeed([]), steps=5)
    model = loop.learner.policy.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _poison(model, 10**6)
    try:
        with pytest.raises(TrainerError, match="3 consecutive steps had a non-finite loss"):
            await loop.run()
    finally:
        loop.metrics.close()
    assert loop.progress.skipped_steps == 3 and loop.progress.step == 0 and sync.paused_versions == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # bit-identical


async def test_a_batch_of_only_rejected_groups_is_skipped_and_counted(tiny_dir: Path, state_dir: Path) -> None:
    hostile = make_groups(3, n=2, size=4)
    hostile[0]["tokens"][0][1] = 10**6  # outside the vocabulary
    hostile[1]["scores"][0] = float("inf")
    feed = ListFeed([hostile])
    loop, _sync = _loop(tiny_dir, state_dir, feed, steps=1)
    try:
        assert await loop.run() == "finished"
    finally:
        loop.metrics.close()
    assert loop.progress.rejected_groups == {"token_out_of_range": 1, "score_invalid": 1}
    assert read_metrics(state_dir / "metrics.jsonl")[0]["rejected_groups"] == loop.progress.rejected_groups


async def test_a_batch_whose_preparation_fails_past_the_group_checks_is_skipped(
    tiny_dir: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from atroposd.trainer import batch as batch_mod

    real_pad = batch_mod._pad
    calls = [0]

    def pad_once_broken(rows: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("a defect in padding")
        return real_pad(rows)

    monkeypatch.setattr(batch_mod, "_pad", pad_once_broken)
    loop, _sync = _loop(tiny_dir, state_dir, ListFeed([make_groups(8, n=2, size=4)]), steps=1)
    try:
        assert await loop.run() == "finished"
    finally:
        loop.metrics.close()
    assert loop.progress.rejected_groups == {"error": 2} and loop.progress.step == 1

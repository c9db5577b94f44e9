"""Rollback after a collapse (SPEC §15): the plan, its finish, and what the checkpoints kept.

A detector that trips (``[health] rollback`` on) raises :class:`~atroposd.trainer.health.Collapse`
out of the training loop. :func:`plan_rollback` records it (the rollbacks, the learning rate
halved, the newest known-good checkpoint or the starting weights as the target) and returns the
:class:`Rollback` the next generation loads; once the known-good weights are loaded and every
replica has them, :func:`finish_rollback` writes them as a checkpoint of the current step
(known-good, carrying the count) and drops what the collapsed weights sampled. Past
``max_rollbacks`` the job then ends (exit 6). :func:`restore_health` reads back, at the start,
what the newest checkpoint kept of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from atroposd.trainer.state import TrainerState

if TYPE_CHECKING:
    from atroposd.config import Config
    from atroposd.trainer.health import Collapse
    from atroposd.trainer.loop import Progress, TrainingLoop

__all__ = ["Rollback", "finish_rollback", "plan_rollback", "restore_health"]

log = structlog.get_logger("trainer", component="trainer")


@dataclass(frozen=True)
class Rollback:
    """A collapse to roll back from: where to (a known-good checkpoint, or the starting weights),
    the step and version to go on from, and whether the job then ends (exit 6)."""

    target: Path | str
    step: int
    weight_version: int
    skipped_steps: int
    give_up: bool
    reason: str


def restore_health(p: Progress, health: dict[str, Any], checkpoints_dir: Path) -> None:
    """At the start: the rollbacks, the learning rate's scale and the known-good marks the
    checkpoints kept (``health``: the checkpoint's health record)."""
    from atroposd.trainer.checkpoint import newest_known_good

    h = health
    p.rollbacks = int(h.get("rollbacks", 0))
    p.lr_scale = float(h.get("lr_scale", 1.0))
    p.dropped_groups = int(h.get("dropped_groups", 0))
    kept = h.get("canary_prompts")
    if isinstance(kept, list) and all(isinstance(x, list) for x in kept):
        p.canary_prompts = [list(x) for x in kept]  # checked against the vocabulary by make_sentinel
    last = h.get("last_rollback")
    p.last_rollback = dict(last) if isinstance(last, dict) else None
    drop = h.get("drop")
    if isinstance(drop, dict):  # the queue may still hold groups of the weights that collapsed
        from atroposd.trainer.health import DropRule

        p.drop = DropRule(int(drop["good_version"]), int(drop["resync_version"]), float(drop["resync_time"]))
    good = newest_known_good(checkpoints_dir)
    p.known_good = str(good) if good is not None else "start"
    if p.rollbacks:
        log.info(
            "health restored from the checkpoint",
            rollbacks=p.rollbacks,
            lr_scale=p.lr_scale,
            known_good=p.known_good,
        )


def plan_rollback(cfg: Config, p: Progress, collapse: Collapse, checkpoints_dir: Path) -> Rollback:
    """A detector tripped: plan the rollback to the newest known-good weights (the next generation
    loads them), with the learning rate halved; past max_rollbacks the job then ends (exit 6)."""
    from atroposd.trainer.checkpoint import newest_known_good
    from atroposd.trainer.setup import START

    h = cfg.health
    good = newest_known_good(checkpoints_dir)
    p.rollbacks += 1
    p.lr_scale /= 2
    give_up = p.rollbacks > h.max_rollbacks
    target = good if good is not None else START
    p.last_rollback = {
        "step": collapse.step,
        "detector": collapse.trip.detector,
        "reason": collapse.trip.reason,
        "to": str(target),
        "lr": cfg.trainer.lr * p.lr_scale,
        "time": time.time(),
        "final": give_up,
    }
    p.state, p.waiting_for = TrainerState.WAITING, "model"
    log.error(
        "collapse detected: rolling back to the newest known-good weights",
        step=collapse.step,
        detector=collapse.trip.detector,
        reason=collapse.trip.reason,
        to=str(target),
        rollbacks=p.rollbacks,
        max_rollbacks=h.max_rollbacks,
        lr=cfg.trainer.lr * p.lr_scale,
        **({"then": "the job ends (exit 6)"} if give_up else {}),
    )
    return Rollback(target, p.step, p.weight_version, p.skipped_steps, give_up, str(collapse))


async def finish_rollback(
    cfg: Config, p: Progress, loop: TrainingLoop, plan: Rollback, good_version: int
) -> str | None:
    """The known-good weights are loaded and every replica has them: write them as a checkpoint
    of the current step (known-good, carrying the count), drop what the collapsed weights
    sampled. Past max_rollbacks: the trainer's error (the job ends, exit 6); else None."""
    from atroposd.trainer.checkpoint import mark_known_good
    from atroposd.trainer.health import DropRule

    p.drop = loop.drop = DropRule(good_version, p.weight_version, time.time())
    path = await loop.checkpoint()
    if path is not None:
        mark_known_good(path, {"step": p.step, "rollback": p.rollbacks, "from": str(plan.target), "time": time.time()})
        p.known_good = str(path)
    if p.last_rollback is not None:
        p.last_rollback["weight_version"] = p.weight_version
    p.health = "ok"
    log.warning(
        "rolled back",
        step=p.step,
        weight_version=p.weight_version,
        to=str(plan.target),
        checkpoint=str(path) if path else None,
        rollbacks=p.rollbacks,
        lr=cfg.trainer.lr * p.lr_scale,
    )
    if not plan.give_up:
        return None
    p.state = TrainerState.FAILED
    p.error = (
        f"the run collapsed past health.max_rollbacks = {cfg.health.max_rollbacks} "
        f"({p.rollbacks} collapses); last: {plan.reason}"
    )
    log.error("trainer ends: " + p.error, step=p.step, known_good=p.known_good)
    return p.error

"""Collapse detection over the per-step metrics (SPEC §15 "Collapse"): small pure detectors.

Each detector sees one step at a time — the ``metrics.jsonl`` row the loop writes, or a
non-finite step that was skipped — and answers ``None`` (healthy) or the reason it tripped.
They hold only a short window of the run's own history, so the same code runs on a recorded
``metrics.jsonl`` (``tests/trainer/test_health.py``) as in the loop:

- ``nonfinite``: ``max_nonfinite_steps`` steps in a row whose loss or gradient norm was not
  finite (each was skipped, never applied).
- ``grad_norm``: the gradient norm (before clipping) above ``GRAD_SPIKE_ONCE`` × its running
  median at one step, or above ``GRAD_SPIKE`` × on ``SPIKE_REPEAT`` of the last ``SPIKE_WITHIN``
  steps: weights blown up by one step give millions ×, while a healthy run's lone spike reaches
  tens × (clipping bounds what it applies).
- ``clipped_fraction``: above ``CLIPPED_LIMIT`` for ``PATIENCE`` steps in a row while its running
  median was below half of that — the ratio runs away from the rollouts' policy. Only where a
  clip can act (:func:`clip_acts`): with awsft there is no ratio, and with a rollout correction
  and one optimizer step per batch the ratio is 1 (its clipped fraction is 0 at every step).
- ``reward_spread``: the batch's reward spread (``reward_std``) at 0 for ``PATIENCE`` steps in a
  row after a running median of at least ``SPREAD_HAD`` — while the mean reward is not above its
  running median (a run that masters its task loses its spread too, with a rising reward).
- ``entropy``: the policy's entropy per completion token below ``ENTROPY_DROP`` × its running
  median for ``PATIENCE`` steps in a row.

The ratio detectors arm after ``WARMUP`` steps of history; the running medians cover the last
``WINDOW`` healthy steps, so a slow drift moves the baseline and a sudden break does not.
:class:`HealthMonitor` combines them and counts the healthy steps since a checkpoint
(``known_good_after`` of them make it known-good).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from atroposd.groupext import sampled_versions
from atroposd.timeline import group_timing

__all__ = [
    "CLIPPED_LIMIT",
    "ENTROPY_DROP",
    "GRAD_SPIKE",
    "GRAD_SPIKE_ONCE",
    "PATIENCE",
    "SPIKE_REPEAT",
    "SPIKE_WITHIN",
    "SPREAD_HAD",
    "WARMUP",
    "WINDOW",
    "ClippedRunaway",
    "Collapse",
    "DropRule",
    "EntropyCollapse",
    "GradSpike",
    "HealthMonitor",
    "NonFinite",
    "SpreadVanish",
    "Trip",
    "clip_acts",
    "replay",
]

WINDOW = 50  # steps in the running medians
WARMUP = 10  # steps of history before the ratio detectors may trip
PATIENCE = 3  # steps in a row a condition must hold (a gradient spike: SPIKE_REPEAT of SPIKE_WITHIN)
# × the running median of the gradient norm. A healthy embedded run reaches 16×, one with filter_groups
# 24×, one with gspo, clip-higher and filter_groups 70× at one step (a false trip rolls a healthy run
# back and halves its learning rate); weights blown up by one step (a 3000× learning rate) give 10^6-10^7×.
GRAD_SPIKE = 50.0  # on SPIKE_REPEAT of the last SPIKE_WITHIN steps
GRAD_SPIKE_ONCE = 1000.0  # at one step
SPIKE_REPEAT = 2
SPIKE_WITHIN = 3
CLIPPED_LIMIT = 0.5  # share of completion tokens whose ratio was clipped
ENTROPY_DROP = 0.1  # × the running median of the entropy
SPREAD_HAD = 0.05  # the running median of reward_std that counts as "had spread"
_EPS = 1e-9


@dataclass(frozen=True)
class Trip:
    """A detector that tripped: which one, and what it saw (for the log, status and metrics)."""

    detector: str
    reason: str


def _number(row: Mapping[str, Any], key: str) -> float | None:
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


class _Running:
    """A window of recent values and its median."""

    def __init__(self, window: int = WINDOW) -> None:
        self.values: deque[float] = deque(maxlen=window)

    def add(self, v: float) -> None:
        self.values.append(v)

    @property
    def ready(self) -> bool:
        return len(self.values) >= WARMUP

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else 0.0


class NonFinite:
    """``limit`` non-finite steps in a row."""

    name = "nonfinite"

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_row = 0

    def observe(self, finite: bool) -> Trip | None:
        self.in_row = 0 if finite else self.in_row + 1
        if self.in_row >= self.limit:
            return Trip(
                self.name, f"{self.in_row} non-finite steps in a row (health.max_nonfinite_steps = {self.limit})"
            )
        return None


class GradSpike:
    """The gradient norm against its running median: far above it once, or well above it again."""

    name = "grad_norm"

    def __init__(
        self,
        factor: float = GRAD_SPIKE,
        once: float = GRAD_SPIKE_ONCE,
        repeat: int = SPIKE_REPEAT,
        within: int = SPIKE_WITHIN,
    ) -> None:
        self.factor, self.once, self.repeat = factor, once, repeat
        self.history = _Running()
        self.recent: deque[bool] = deque(maxlen=within)  # over ``factor`` at each of the last steps

    def observe(self, row: Mapping[str, Any]) -> Trip | None:
        g = _number(row, "grad_norm")
        if g is None or not math.isfinite(g):
            return None
        median = self.history.median
        armed = self.history.ready and median > _EPS
        self.recent.append(armed and g > self.factor * median)
        if armed and g > self.once * median:
            self.recent.clear()  # a trip is told once: the next steps start a new count
            return Trip(
                self.name,
                f"gradient norm {g:.4g} is {g / median:.1f}× its running median {median:.4g} (limit {self.once:g}×)",
            )
        if sum(self.recent) >= self.repeat:
            reason = (
                f"gradient norm {g:.4g} is {g / median:.1f}× its running median {median:.4g}, over "
                f"{self.factor:g}× at {sum(self.recent)} of the last {len(self.recent)} steps"
            )
            self.recent.clear()
            return Trip(self.name, reason)
        if not self.recent[-1]:
            self.history.add(g)  # a spike does not move the baseline it is measured against
        return None


class ClippedRunaway:
    """The clipped fraction far above its usual level, step after step."""

    name = "clipped_fraction"

    def __init__(self, limit: float = CLIPPED_LIMIT, patience: int = PATIENCE) -> None:
        self.limit, self.patience = limit, patience
        self.history = _Running()
        self.in_row = 0

    def observe(self, row: Mapping[str, Any]) -> Trip | None:
        c = _number(row, "clipped_fraction")
        if c is None or not math.isfinite(c):
            return None
        if self.history.ready and c > self.limit and self.history.median < self.limit / 2:
            self.in_row += 1
            if self.in_row >= self.patience:
                return Trip(
                    self.name,
                    f"clipped fraction {c:.3f} above {self.limit:g} for {self.in_row} steps "
                    f"(running median {self.history.median:.3f})",
                )
            return None
        self.in_row = 0
        self.history.add(c)
        return None


class SpreadVanish:
    """The reward's spread gone on a run that had one, without the reward rising."""

    name = "reward_spread"

    def __init__(self, had: float = SPREAD_HAD, patience: int = PATIENCE) -> None:
        self.had, self.patience = had, patience
        self.spread = _Running()
        self.reward = _Running()
        self.in_row = 0

    def observe(self, row: Mapping[str, Any]) -> Trip | None:
        s, r = _number(row, "reward_std"), _number(row, "reward_mean")
        if s is None or r is None or not (math.isfinite(s) and math.isfinite(r)):
            return None
        if self.spread.ready and s <= _EPS and self.spread.median >= self.had and r <= self.reward.median:
            self.in_row += 1
            if self.in_row >= self.patience:
                return Trip(
                    self.name,
                    f"no reward spread for {self.in_row} steps (running median "
                    f"{self.spread.median:.3f}) at reward {r:.3f}, not above its running "
                    f"median {self.reward.median:.3f}",
                )
            return None
        self.in_row = 0
        self.spread.add(s)
        self.reward.add(r)
        return None


class EntropyCollapse:
    """The policy's entropy falling to a small share of its usual level."""

    name = "entropy"

    def __init__(self, drop: float = ENTROPY_DROP, patience: int = PATIENCE) -> None:
        self.drop, self.patience = drop, patience
        self.history = _Running()
        self.in_row = 0

    def observe(self, row: Mapping[str, Any]) -> Trip | None:
        e = _number(row, "entropy")
        if e is None:
            return None
        median = self.history.median
        if self.history.ready and median > _EPS and (not math.isfinite(e) or e < self.drop * median):
            self.in_row += 1
            if self.in_row >= self.patience:
                return Trip(
                    self.name,
                    f"entropy {e:.4g} below {self.drop:g}× its running median {median:.4g} for {self.in_row} steps",
                )
            return None
        self.in_row = 0
        if math.isfinite(e):
            self.history.add(e)
        return None


def clip_acts(loss: str, rollout_correction: str, optimizer_steps_per_batch: int) -> bool:
    """Can the ratio's clip act under this objective (SPEC §14)? Not for awsft (no ratio); with a
    rollout correction only from the second optimizer step on a batch (the ratio is taken against
    the trainer's own logprobs before the first update)."""
    if loss == "awsft":
        return False
    return rollout_correction == "none" or optimizer_steps_per_batch > 1


@dataclass
class HealthMonitor:
    """Every detector over one run, and the healthy steps since the last checkpoint.

    ``step(row)`` for an applied step (its metrics row), ``skipped()`` for a non-finite step;
    each returns the first :class:`Trip` or None. ``reset()`` after a rollback: the history
    belongs to the weights that collapsed."""

    max_nonfinite_steps: int = 3
    # the clipped-fraction detector watches only where a clip can act (:func:`clip_acts`)
    clip_acts: bool = True
    healthy_steps: int = 0
    last_trip: Trip | None = None
    detectors: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.nonfinite = NonFinite(self.max_nonfinite_steps)
        self.detectors = [GradSpike(), SpreadVanish(), EntropyCollapse()]
        if self.clip_acts:
            self.detectors.insert(1, ClippedRunaway())
        self.healthy_steps = 0

    def step(self, row: Mapping[str, Any]) -> Trip | None:
        trip = self.nonfinite.observe(True)
        for d in self.detectors:
            found = d.observe(row)
            trip = trip or found
        if trip is None:
            self.healthy_steps += 1
        else:
            self.healthy_steps = 0
            self.last_trip = trip
        return trip

    def skipped(self) -> Trip | None:
        trip = self.nonfinite.observe(False)
        self.healthy_steps = 0
        if trip is not None:
            self.last_trip = trip
        return trip


def replay(
    rows: Iterable[Mapping[str, Any]], *, max_nonfinite_steps: int = 3, clip_acts: bool = True
) -> list[tuple[int, Trip]]:
    """Run a recorded ``metrics.jsonl`` through the detectors: ``(step, trip)`` for each trip."""
    monitor = HealthMonitor(max_nonfinite_steps=max_nonfinite_steps, clip_acts=clip_acts)
    out = []
    for row in rows:
        trip = monitor.step(row)
        if trip is not None:
            out.append((int(row.get("step", 0)), trip))
    return out


class Collapse(RuntimeError):
    """The run collapsed (a detector tripped) and ``[health] rollback`` is on: roll back."""

    def __init__(self, trip: Trip, step: int) -> None:
        super().__init__(f"collapse at step {step}: {trip.detector}: {trip.reason}")
        self.trip = trip
        self.step = step


@dataclass(frozen=True)
class DropRule:
    """After a rollback: the groups sampled after the known-good weights and before the replicas
    had the rolled-back ones are dropped — by the versions its tokens were sampled under where a
    group carries them (``weight_versions``, else ``weight_version``: one above ``good_version``
    and below ``resync_version``), else by the time it was posted (before ``resync_time``, a
    Unix time)."""

    good_version: int
    resync_version: int
    resync_time: float

    def drops(self, group: Mapping[str, Any]) -> bool:
        # a group whose tokens span a weight swap (SPEC §7) goes when any of its versions does:
        # its newest, and also an older one when it was sampled on into the resynced weights
        versions = sampled_versions(group)
        if versions:
            return any(self.good_version < v < self.resync_version for v in versions)
        timing = group_timing(group)
        posted = timing.get("posted_at") if timing is not None else None
        if isinstance(posted, (int, float)) and not isinstance(posted, bool):
            return float(posted) < self.resync_time
        return False

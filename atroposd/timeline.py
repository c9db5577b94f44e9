"""Where a step's time goes: the rollout side of the per-step timeline (``metrics.jsonl``), a
leaf shared by the writer (the built-in environments) and the reader (the trainer).

The trainer's own parts (``batch_wait_s``, ``prepare_s``, ``compute_s``, ``pause_s``,
``optimizer_s``, ``sync_s``) are measured by the loop. The rollout side comes with the groups:
the built-in environments put ``group_overrides.atroposd.timing = {"gate_s", "generate_s",
"posted_at"}`` in every group (``atroposd.envs.runner.stamp_timing``), and the feed notes when
each batch arrived. Per step, over the batch's groups that carry it (null when none does):

* ``rollout_gate_s``: mean seconds a group waited at the environment's gate for room in the
  queue before it started;
* ``rollout_generate_s``: mean seconds generating and scoring;
* ``rollout_delivery_s``: mean seconds from posting to the batch's arrival at the trainer
  (the POST, the time queued at the API, the ``GET /batch``). It compares Unix times of two
  processes: on one machine exact, across machines it includes their clock offset.
* ``fetch_s``: the ``GET /batch`` that brought the batch (the request alone).

A group from an environment that sends no timing (any atroposlib environment) adds nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

from atroposd.groupext import extension, extension_for_write

__all__ = ["ROLLOUT_FIELDS", "TIMING_KEY", "group_timing", "rollout_timing", "stamp_timing"]

ROLLOUT_FIELDS = ("rollout_gate_s", "rollout_generate_s", "rollout_delivery_s")
#: where a group carries its timing: ``group_overrides.atroposd[TIMING_KEY]``
TIMING_KEY = "timing"


def stamp_timing(payload: dict[str, Any], *, gate_s: float, generate_s: float) -> None:
    """Put a group's rollout timeline into ``group_overrides.atroposd``: seconds it waited at the
    gate for room, seconds generating and scoring, and the Unix time it is posted at (the trainer
    measures the rest — posting, the queue, the fetch — against it on arrival)."""
    ext = extension_for_write(payload)
    if ext is not None:
        ext[TIMING_KEY] = {"gate_s": round(gate_s, 6), "generate_s": round(generate_s, 6), "posted_at": time.time()}


def group_timing(group: object) -> Mapping[str, Any] | None:
    """The timing :func:`stamp_timing` put into a group (None when it has none)."""
    timing = extension(group).get(TIMING_KEY)
    return timing if isinstance(timing, Mapping) else None


def _seconds(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def rollout_timing(groups: Iterable[Any], received_at: float) -> dict[str, float | None]:
    """The rollout side of one step from its batch's groups; ``received_at``: Unix time the
    batch arrived at the trainer."""
    gate: list[float] = []
    generate: list[float] = []
    delivery: list[float] = []
    for group in groups:
        timing = group_timing(group)
        if timing is None:
            continue
        for key, into in (("gate_s", gate), ("generate_s", generate)):
            value = _seconds(timing.get(key))
            if value is not None and value >= 0:
                into.append(value)
        posted = _seconds(timing.get("posted_at"))
        if posted is not None:
            delivery.append(max(0.0, received_at - posted))
    return {"rollout_gate_s": _mean(gate), "rollout_generate_s": _mean(generate), "rollout_delivery_s": _mean(delivery)}

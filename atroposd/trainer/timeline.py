"""Where a step's time goes: the rollout side of the per-step timeline (``metrics.jsonl``).

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
from collections.abc import Iterable
from typing import Any

__all__ = ["ROLLOUT_FIELDS", "rollout_timing"]

ROLLOUT_FIELDS = ("rollout_gate_s", "rollout_generate_s", "rollout_delivery_s")


def _timing(group: Any) -> dict[str, Any] | None:
    if not isinstance(group, dict):
        return None
    overrides = group.get("group_overrides")
    ext = overrides.get("atroposd") if isinstance(overrides, dict) else None
    timing = ext.get("timing") if isinstance(ext, dict) else None
    return timing if isinstance(timing, dict) else None


def _seconds(value: Any) -> float | None:
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
        timing = _timing(group)
        if timing is None:
            continue
        for key, into in (("gate_s", gate), ("generate_s", generate)):
            value = _seconds(timing.get(key))
            if value is not None and value >= 0:
                into.append(value)
        posted = _seconds(timing.get("posted_at"))
        if posted is not None:
            delivery.append(max(0.0, received_at - posted))
    return {"rollout_gate_s": _mean(gate), "rollout_generate_s": _mean(generate),
            "rollout_delivery_s": _mean(delivery)}

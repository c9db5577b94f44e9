"""The rollout side of the per-step timeline: what an environment stamps on a group and what the
trainer reads back from a batch (bad or missing timing adds nothing, never an error)."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from atroposd.timeline import TIMING_KEY, rollout_timing, stamp_timing


def _group(**timing: Any) -> dict[str, Any]:
    return {"tokens": [[1, 2]], "group_overrides": {"atroposd": {"weight_version": 3, TIMING_KEY: timing}}}


def test_stamp_keeps_the_extension_and_adds_the_timing() -> None:
    payload: dict[str, Any] = {"group_overrides": {"atroposd": {"weight_version": 1}, "theirs": 2}}
    before = time.time()
    stamp_timing(payload, gate_s=0.25, generate_s=0.0123456789)
    timing = payload["group_overrides"]["atroposd"][TIMING_KEY]
    assert payload["group_overrides"]["atroposd"]["weight_version"] == 1  # kept beside it
    assert payload["group_overrides"]["theirs"] == 2 and len(payload["group_overrides"]) == 2  # one key of ours
    assert timing["gate_s"] == 0.25 and timing["generate_s"] == 0.012346
    assert before <= timing["posted_at"] <= time.time()
    bare: dict[str, Any] = {}
    stamp_timing(bare, gate_s=0.0, generate_s=0.0)
    assert set(bare["group_overrides"]["atroposd"][TIMING_KEY]) == {"gate_s", "generate_s", "posted_at"}
    odd: dict[str, Any] = {"group_overrides": {"atroposd": "not a mapping"}}
    stamp_timing(odd, gate_s=0.0, generate_s=0.0)  # someone else's shape: left as it is
    assert odd == {"group_overrides": {"atroposd": "not a mapping"}}


def test_means_over_the_groups_that_carry_timing() -> None:
    now = 1000.0
    groups = [
        _group(gate_s=0.1, generate_s=0.02, posted_at=999.9),
        _group(gate_s=0.3, generate_s=0.04, posted_at=999.7),
        {"tokens": [[1]]},
    ]  # an atroposlib environment's group: no timing
    out = rollout_timing(groups, now)
    assert out["rollout_gate_s"] == pytest.approx(0.2)
    assert out["rollout_generate_s"] == pytest.approx(0.03)
    assert out["rollout_delivery_s"] == pytest.approx(0.2)


@pytest.mark.parametrize(
    "bad",
    [None, "x", [], {"gate_s": "1"}, {"gate_s": math.nan, "generate_s": True}, {"gate_s": -1.0, "posted_at": math.inf}],
)
def test_bad_timing_adds_nothing(bad: Any) -> None:
    group = {"group_overrides": {TIMING_KEY: bad}}
    assert rollout_timing([group, "not a group", {"group_overrides": 7}], 5.0) == {
        "rollout_gate_s": None,
        "rollout_generate_s": None,
        "rollout_delivery_s": None,
    }


def test_a_clock_behind_the_trainer_counts_zero_not_negative() -> None:
    assert rollout_timing([_group(posted_at=10.5)], 10.0)["rollout_delivery_s"] == 0.0

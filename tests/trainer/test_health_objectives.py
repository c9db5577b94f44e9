"""The collapse detectors' thresholds on recorded healthy runs of other objectives than the
default (SPEC §15 with §14): each run never trips them, each detector still trips on a break put
in where its signal moves under that objective, and the clipped-fraction detector watches only
where the clip can act (:func:`atroposd.trainer.health.clip_acts`).

``data/healthy_*_metrics.jsonl``: the embedded job shortened to the tests' small task
(``tests/e2e/jobs.SHORT_TASK``, ``atroposd run``), their detector inputs kept:

* ``gspo``: ``loss = "gspo"`` on its own clip range (``"auto"``: 3e-4 / 4e-4), 300 steps;
* ``token_tis``: ``rollout_correction = "token-tis"``, 300 steps;
* ``ppo2_token_tis``: ``ppo_epochs = 2`` with ``rollout_correction = "token-tis"``, 150 steps.
"""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from atroposd.trainer.health import clip_acts, replay

DATA = Path(__file__).parent / "data"
# name → (file, loss, rollout_correction, optimizer steps per batch)
RUNS = {
    "gspo": ("healthy_gspo_metrics.jsonl", "gspo", "none", 1),
    "token_tis": ("healthy_token_tis_metrics.jsonl", "grpo", "token-tis", 1),
    "ppo2_token_tis": ("healthy_ppo2_token_tis_metrics.jsonl", "grpo", "token-tis", 2),
}


def _rows(name: str) -> list[dict[str, Any]]:
    path = DATA / RUNS[name][0]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _acts(name: str) -> bool:
    _, loss, correction, steps = RUNS[name]
    return clip_acts(loss, correction, steps)


def _broken(rows: list[dict[str, Any]], at: int, n: int, **values: float) -> list[dict[str, Any]]:
    out = copy.deepcopy(rows)
    for row in out[at : at + n]:
        row.update(values)
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_a_healthy_run_of_each_objective_never_trips(name: str) -> None:
    rows = _rows(name)
    assert len(rows) >= 150 and all(r["health"] == "ok" for r in rows)
    assert replay(rows, clip_acts=_acts(name)) == []
    assert replay(rows[len(rows) // 2 :], clip_acts=_acts(name)) == []  # from a resumed run's start
    # it was a run that learned, not an idle one
    first = statistics.mean(r["reward_mean"] for r in rows[:10])
    last = statistics.mean(r["reward_mean"] for r in rows[-10:])
    assert last >= first + 0.3, (first, last)


def test_the_clip_acts_where_it_can_and_nowhere_else() -> None:
    assert clip_acts("grpo", "none", 1) and clip_acts("gspo", "none", 1)
    assert not clip_acts("awsft", "none", 1) and not clip_acts("awsft", "none", 4)
    assert not clip_acts("grpo", "token-tis", 1)  # the ratio against the trainer's own logprobs: 1
    assert clip_acts("grpo", "token-tis", 2)  # from the batch's second optimizer step on
    # measured: with a correction and one step per batch the clipped fraction is 0 at every step...
    assert all(r["clipped_fraction"] == 0 for r in _rows("token_tis"))
    # ...and with two passes it moves
    moved = [r["clipped_fraction"] for r in _rows("ppo2_token_tis")]
    assert max(moved) > 0 and len(set(moved)) > 10


@pytest.mark.parametrize("name", list(RUNS))
def test_each_detector_trips_on_a_break_in_each_run(name: str) -> None:
    rows = _rows(name)
    at = len(rows) // 2
    acts = _acts(name)
    median = statistics.median(r["grad_norm"] for r in rows[at - 50 : at])
    trips = replay(_broken(rows, at, 1, grad_norm=median * 2000), clip_acts=acts)  # blown up once
    assert [t.detector for _, t in trips] == ["grad_norm"], trips
    trips = replay(_broken(rows, at, 2, grad_norm=median * 200), clip_acts=acts)  # well over it, again
    assert [(s, t.detector) for s, t in trips] == [(rows[at + 1]["step"], "grad_norm")], trips
    assert replay(_broken(rows, at, 1, grad_norm=median * 200), clip_acts=acts) == []  # a lone spike
    trips = replay(_broken(rows, at, 4, entropy=0.001), clip_acts=acts)
    assert [t.detector for _, t in trips][:1] == ["entropy"], trips
    runaway = replay(_broken(rows, at, 5, clipped_fraction=0.95), clip_acts=acts)
    baseline = statistics.median(r["clipped_fraction"] for r in rows[at - 50 : at])
    if acts and baseline < 0.25:
        assert [t.detector for _, t in runaway][:1] == ["clipped_fraction"], runaway
    else:
        # no clip to act (the detector is off), or a clip that acts on nearly every sequence at
        # once (gspo's range on this task: its clipped fraction sits near 1, nothing to run away to)
        assert runaway == [], runaway

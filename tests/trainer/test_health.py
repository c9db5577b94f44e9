"""The collapse detectors on recorded metric series, known-good marks and pruning, the rollback's
group-drop rule and learning-rate scale (SPEC §15).

``data/healthy_metrics.jsonl``: the embedded job's own run (the shipped example config, 800 steps,
``atroposd run``), its detector inputs kept.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from atroposd.trainer.checkpoint import (
    KNOWN_GOOD_FILE,
    STATE_FILE,
    complete_checkpoints,
    is_known_good,
    mark_known_good,
    newest_known_good,
    prune,
)
from atroposd.trainer.health import DropRule, HealthMonitor, replay

HEALTHY = Path(__file__).parent / "data" / "healthy_metrics.jsonl"


@pytest.fixture(scope="module")
def healthy() -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in HEALTHY.read_text().splitlines() if line.strip()]
    assert len(rows) == 800
    return rows


def test_a_healthy_run_never_trips(healthy: list[dict[str, Any]]) -> None:
    assert replay(healthy) == []
    # nor with the strictest non-finite setting, nor from any starting point (a resumed run)
    assert replay(healthy, max_nonfinite_steps=1) == []
    assert replay(healthy[400:]) == []


def _broken(rows: list[dict[str, Any]], at: int, n: int, **values: float) -> list[dict[str, Any]]:
    out = copy.deepcopy(rows)
    for row in out[at : at + n]:
        row.update(values)
    return out


def test_gradient_norm_far_over_its_median_trips_at_once_and_well_over_it_when_it_repeats(
    healthy: list[dict[str, Any]],
) -> None:
    median = sorted(r["grad_norm"] for r in healthy[250:300])[25]
    # weights blown up by one step: millions of times the median (a 3000x learning rate gave 10^7x)
    trips = replay(_broken(healthy, 300, 1, grad_norm=median * 2000))
    assert [(s, t.detector) for s, t in trips] == [(301, "grad_norm")]
    assert "running median" in trips[0][1].reason and "limit 1000" in trips[0][1].reason
    # one step at 200x is a healthy run's lone spike (gspo with clip-higher and filter_groups
    # reached 70x, and clipping bounds what it applies); a second within three steps is not
    assert replay(_broken(healthy, 300, 1, grad_norm=median * 200)) == []
    twice = _broken(healthy, 300, 1, grad_norm=median * 200)
    twice[302]["grad_norm"] = median * 200
    trips = replay(twice)
    assert [(s, t.detector) for s, t in trips] == [(303, "grad_norm")]
    assert "at 2 of the last 3 steps" in trips[0][1].reason
    apart = _broken(healthy, 300, 1, grad_norm=median * 200)
    apart[304]["grad_norm"] = median * 200
    assert replay(apart) == []
    # steps at 30x the median are no spike, in a row either (a run with filter_groups reached 24x)
    assert replay(_broken(healthy, 300, 3, grad_norm=median * 30)) == []


def test_clipped_fraction_running_away(healthy: list[dict[str, Any]]) -> None:
    trips = replay(_broken(healthy, 500, 5, clipped_fraction=0.9))
    assert (trips[0][0], trips[0][1].detector) == (503, "clipped_fraction")
    # two steps are noise, not a runaway
    assert replay(_broken(healthy, 500, 2, clipped_fraction=0.9)) == []


def test_entropy_collapse(healthy: list[dict[str, Any]]) -> None:
    trips = replay(_broken(healthy, 600, 4, entropy=0.001))
    assert trips[0][0] == 603 and trips[0][1].detector == "entropy"
    assert replay(_broken(healthy, 600, 4, entropy=math.nan))[0][1].detector == "entropy"


def test_reward_spread_vanishing_without_a_rising_reward(healthy: list[dict[str, Any]]) -> None:
    trips = replay(_broken(healthy, 400, 3, reward_std=0.0, reward_mean=0.0))
    assert [(s, t.detector) for s, t in trips] == [(403, "reward_spread")]
    # mastery: every answer right, no spread left, the reward at its best: not a collapse
    assert replay(_broken(healthy, 400, 20, reward_std=0.0, reward_mean=1.0)) == []


def test_nonfinite_steps_in_a_row() -> None:
    m = HealthMonitor(max_nonfinite_steps=3)
    assert m.skipped() is None and m.skipped() is None
    m.step({"step": 1, "grad_norm": 1.0})  # a finite step ends the row
    assert m.skipped() is None and m.skipped() is None
    trip = m.skipped()
    assert trip is not None and trip.detector == "nonfinite" and "3 non-finite steps" in trip.reason


def test_healthy_steps_count_and_reset(healthy: list[dict[str, Any]]) -> None:
    m = HealthMonitor()
    for row in healthy[:60]:
        assert m.step(row) is None
    assert m.healthy_steps == 60
    m.skipped()
    assert m.healthy_steps == 0


def _checkpoint(root: Path, step: int) -> Path:
    path = root / f"step-{step}"
    path.mkdir(parents=True)
    (path / STATE_FILE).write_bytes(b"x")
    return path


def test_pruning_keeps_the_newest_known_good(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        _checkpoint(tmp_path, step)
    assert newest_known_good(tmp_path) is None
    mark_known_good(tmp_path / "step-10", {"step": 10})
    mark_known_good(tmp_path / "step-20", {"step": 20})
    assert is_known_good(tmp_path / "step-20") and newest_known_good(tmp_path) == tmp_path / "step-20"
    assert json.loads((tmp_path / "step-20" / KNOWN_GOOD_FILE).read_text()) == {"step": 20}
    _checkpoint(tmp_path, 40)
    prune(tmp_path, 1)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [20, 40]  # 10: known-good, not the newest
    prune(tmp_path, 0)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [20]


def _group(version: int | None, posted: float | None) -> dict[str, Any]:
    ext: dict[str, Any] = {}
    if version is not None:
        ext["weight_version"] = version
    if posted is not None:
        ext["timing"] = {"posted_at": posted}
    return {"tokens": [[1]], "group_overrides": {"atroposd": ext}}


def test_drop_rule_by_version_else_by_time() -> None:
    rule = DropRule(good_version=20, resync_version=45, resync_time=1000.0)
    assert not rule.drops(_group(20, 2000.0))  # sampled by the known-good weights
    assert rule.drops(_group(21, 2000.0)) and rule.drops(_group(44, None))  # by the collapsed ones
    assert not rule.drops(_group(45, 0.0))  # by the rolled-back weights: the version decides
    assert rule.drops(_group(None, 999.0)) and not rule.drops(_group(None, 1001.0))
    assert not rule.drops({"tokens": [[1]]})  # nothing to tell by: kept


def test_lr_scale_applies_to_a_restored_schedule() -> None:
    from atroposd.trainer.optim import build_scheduler
    from atroposd.trainer.setup import scale_lr

    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([param], lr=1e-3)
    sched = build_scheduler(opt, warmup_steps=10)
    for _ in range(4):
        opt.step()
        sched.step()
    saved = sched.state_dict()
    opt2 = torch.optim.AdamW([param], lr=1e-3)
    sched2 = build_scheduler(opt2, warmup_steps=10)
    sched2.load_state_dict(saved)
    scale_lr(opt2, sched2, 1e-3 * 0.5)
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.5 * 1e-3 * 5 / 10)  # warm-up position kept
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.5 * 1e-3 * 6 / 10)


def test_status_json_text_and_systemd_line_show_a_rollback() -> None:
    from types import SimpleNamespace

    import anyio

    from atroposd.commands import _render_status
    from atroposd.config import Config
    from atroposd.daemon.state import DaemonState
    from atroposd.daemon.status import status_line
    from atroposd.trainer.service import TrainerService

    async def make() -> TrainerService:  # its lock belongs to an event loop
        return TrainerService(Config(), instance="t", weights=None, envs_alive=lambda: True)  # type: ignore[arg-type]

    svc = anyio.run(make)
    clean = svc.status()
    assert clean["health"] == "ok" and clean["rollbacks"] == 0 and clean["known_good"] == "start"
    p = svc.progress
    p.health, p.rollbacks, p.dropped_groups = "entropy", 1, 12
    p.last_rollback = {
        "step": 57,
        "detector": "entropy",
        "reason": "entropy 0.01 below 0.1× its running median",
        "to": "/var/lib/atroposd/checkpoints/step-40",
        "lr": 1.5e-4,
        "final": False,
    }
    st = svc.status()
    assert st["rollbacks"] == 1 and st["max_rollbacks"] == 3 and st["last_rollback"]["to"].endswith("step-40")
    text = _render_status(
        {
            "state": "running",
            "pid": 1,
            "uptime_s": 1.0,
            "config": "/x.toml",
            "components": [],
            "trainer": st,
            "queue": None,
        }
    )
    assert "trainer: health: entropy tripped at the last step" in text
    assert "1 rollback(s) of at most 3; last at step 57: entropy 0.01" in text and "12 groups dropped" in text
    view = SimpleNamespace(units={}, state=DaemonState.RUNNING, trainer=svc, watchdog=None)
    line = status_line(view)
    assert line.endswith("; health: entropy; 1/3 rollbacks, last at step 57 (entropy) to step-40, lr 0.00015"), line


def _health_loop(tiny_dir: Path, state_dir: Path, *, steps: int, checkpoint_every: int, **health: Any) -> Any:
    import anyio

    from atroposd.config import HealthConfig
    from atroposd.trainer.loop import Progress, TrainingLoop
    from atroposd.trainer.metrics import MetricsWriter
    from atroposd.trainer.setup import build_learner, load_for_training
    from tests.trainer.conftest import make_cfg
    from tests.trainer.test_loop import ListFeed, RecordingSync

    cfg = make_cfg(state_dir, tiny_dir, steps=steps, checkpoint_every=checkpoint_every, keep_checkpoints=1)
    setup = load_for_training(cfg)
    learner = build_learner(cfg, setup)
    progress = Progress(total_steps=steps)
    loop = TrainingLoop(
        tcfg=cfg.trainer,
        feed=ListFeed([]),
        learner=learner,
        weights=RecordingSync(),  # type: ignore[arg-type]
        metrics=MetricsWriter(state_dir / "metrics.jsonl"),
        checkpointer=setup.checkpointer(learner),
        progress=progress,
        envs_alive=lambda: True,
        lock=anyio.Lock(),
        health=HealthConfig(**health),
    )
    loop.checkpointer.health = progress.health_record
    return loop


@pytest.mark.anyio
async def test_the_loop_raises_a_collapse_after_max_nonfinite_steps(tiny_dir: Path, state_dir: Path) -> None:
    from atroposd.trainer.health import Collapse
    from tests.trainer.test_loop import _poison

    loop = _health_loop(tiny_dir, state_dir, steps=5, checkpoint_every=100, max_nonfinite_steps=2)
    _poison(loop.learner.policy.model, 10**6)
    try:
        with pytest.raises(Collapse, match="2 non-finite steps in a row") as caught:
            await loop.run()
    finally:
        loop.metrics.close()
    assert caught.value.trip.detector == "nonfinite" and loop.progress.health == "nonfinite"
    assert loop.progress.skipped_steps == 2 and loop.progress.step == 0


@pytest.mark.anyio
async def test_without_rollback_a_collapse_is_only_shown(tiny_dir: Path, state_dir: Path) -> None:
    from tests.trainer.test_loop import _poison

    loop = _health_loop(tiny_dir, state_dir, steps=2, checkpoint_every=100, max_nonfinite_steps=1, rollback=False)
    _poison(loop.learner.policy.model, 1)
    try:
        assert await loop.run() == "finished"
    finally:
        loop.metrics.close()
    assert loop.progress.skipped_steps == 1 and loop.progress.health == "ok"  # healthy steps followed


@pytest.mark.anyio
async def test_checkpoints_become_known_good_and_carry_the_health_record(tiny_dir: Path, state_dir: Path) -> None:
    from atroposd.trainer.checkpoint import load_checkpoint
    from atroposd.trainer.metrics import read_metrics

    loop = _health_loop(tiny_dir, state_dir, steps=5, checkpoint_every=2, known_good_after=2)
    loop.progress.rollbacks, loop.progress.lr_scale = 1, 0.5  # as restored after a rollback
    try:
        assert await loop.run() == "finished"
    finally:
        loop.metrics.close()
    root = state_dir / "checkpoints"
    # step-2 became known-good at step 4 (step-4 would at step 6); keep = 1 keeps the newest
    # (step-5) and the newest known-good (step-2); step-4 went
    assert [s for s, _ in complete_checkpoints(root)] == [2, 5]
    assert is_known_good(root / "step-2") and not is_known_good(root / "step-5")
    assert json.loads((root / "step-2" / KNOWN_GOOD_FILE).read_text())["healthy_steps"] == 2
    assert loop.progress.known_good == str(root / "step-2")
    state = load_checkpoint(root / "step-5").state
    assert state["health"]["rollbacks"] == 1 and state["health"]["lr_scale"] == 0.5
    rows = read_metrics(state_dir / "metrics.jsonl")
    assert [(r["health"], r["rollbacks"]) for r in rows] == [("ok", 1)] * 5

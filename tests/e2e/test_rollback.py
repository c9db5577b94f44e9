"""A collapse made on purpose in a real job (SPEC §15): detected, rolled back to the known-good
checkpoint with the learning rate halved, training goes on and recovers; one collapse past
``max_rollbacks`` ends the job with exit 6, and a restart resumes from the known-good checkpoint
with the count kept."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from atroposd.plot import rollback_steps
from tests.e2e.jobs import (
    SHORT_TASK,
    daemon_env,
    job_config,
    metrics,
    problem_lines,
    replica_job_config,
)
from tests.faults import fault_env
from tests.support import atroposd

# The optimizer steps whose learning rate the lr_burst fault multiplies (tests/faults)
BURSTS = (40, 75)
FACTOR = 3000.0


def _events(log_text: str, event: str) -> list[dict[str, Any]]:
    out = []
    for line in log_text.splitlines():
        if event in line and line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == event:
                out.append(record)
    return out


def _checksum(checkpoint: Path, name: str = "model.safetensors") -> str:
    return str(json.loads((checkpoint / "checksums.json").read_text())["files"][name])


@pytest.mark.slow
def test_collapse_rolls_back_recovers_then_exits_6_and_a_restart_keeps_the_count(short_tmp: Path) -> None:
    steps = 110
    cfg = job_config(
        short_tmp,
        steps=steps,
        envs=SHORT_TASK,
        trainer={"checkpoint_every": 10},
        health={"known_good_after": 10, "max_rollbacks": 1},
    )
    state = short_tmp / "state"
    env = {**daemon_env(), **fault_env(lr_burst={"steps": list(BURSTS), "factor": FACTOR})}
    res = atroposd("run", "-c", str(cfg), env=env, timeout=400)
    assert res.returncode == 6, f"run exited {res.returncode}\n{problem_lines(res.stderr)}"
    detected = _events(res.stderr, "collapse detected: rolling back to the newest known-good weights")
    assert len(detected) == 2, problem_lines(res.stderr)
    first, second = detected
    # detected within a few steps of the blow-up, rolled back to the checkpoint before it
    assert BURSTS[0] < first["step"] <= BURSTS[0] + 4, first
    assert first["to"].endswith("/step-30"), first  # step-40 holds the blown-up weights: never known-good
    assert BURSTS[1] < second["step"] <= BURSTS[1] + 4 and second["then"] == "the job ends (exit 6)", second
    assert "collapsed past health.max_rollbacks = 1" in res.stderr

    rows = metrics(state)
    by_step = {r["step"]: r for r in rows}
    assert [r["step"] for r in rows] == sorted(by_step) == list(range(1, second["step"] + 1))
    versions = [r["weight_version"] for r in rows]
    assert versions == sorted(set(versions)), "weight_version must keep increasing"
    assert by_step[first["step"]]["health"] == first["detector"] and by_step[first["step"]]["rollbacks"] == 0
    after = [r for r in rows if first["step"] < r["step"] <= BURSTS[1]]
    before = [r for r in rows if BURSTS[0] - 10 <= r["step"] < BURSTS[0]]
    assert all(r["rollbacks"] == 1 and r["health"] == "ok" for r in after)
    assert all(r["lr"] == pytest.approx(before[-1]["lr"] / 2) for r in after), "learning rate halved"
    # the first step after the rollback resynced every replica at a new version
    assert by_step[first["step"] + 1]["weight_version"] == by_step[first["step"]]["weight_version"] + 2
    assert after[-1]["dropped_groups"] > 0  # the groups the blown-up weights sampled
    resynced = _events(res.stderr, "rolled back")
    assert [e["step"] for e in resynced] == [first["step"], second["step"]]
    # every group trained after the rollback was sampled by the rolled-back weights or later
    # (staleness = weight_version - 1 - the oldest version sampled)
    assert all(r["weight_version"] - 1 - r["staleness"] >= resynced[0]["weight_version"] for r in after)
    # training goes on and recovers: the policy's entropy and the reward are back where they were
    pre_entropy = statistics.mean(r["entropy"] for r in before)
    assert min(by_step[s]["entropy"] for s in range(BURSTS[0] + 1, first["step"] + 1)) < 0.5 * pre_entropy
    assert statistics.mean(r["entropy"] for r in after[5:]) > 0.8 * pre_entropy
    assert (
        statistics.mean(r["reward_mean"] for r in after[10:])
        >= statistics.mean(r["reward_mean"] for r in before) - 0.03
    )
    assert rollback_steps(rows) == [first["step"] + 1]  # where `atroposd plot` marks it

    # past max_rollbacks the known-good weights were still restored and written, marked, counted
    final = state / "checkpoints" / f"step-{second['step']}"
    assert (final / "known_good.json").is_file()
    assert _checksum(final) == _checksum(Path(second["to"])), "the last checkpoint holds the known-good weights"

    # a restart resumes from it with the count, the halved rate and the drop rule kept
    res2 = atroposd("run", "-c", str(cfg), env=daemon_env(), timeout=400)
    assert res2.returncode == 0, f"restart exited {res2.returncode}\n{problem_lines(res2.stderr)}"
    resumed = _events(res2.stderr, "resumed from checkpoint")
    assert resumed and resumed[0]["path"] == str(final), resumed
    restored = _events(res2.stderr, "health restored from the checkpoint")
    assert restored and restored[0]["rollbacks"] == 2, restored
    rows2 = [r for r in metrics(state) if r["step"] > second["step"]]
    assert [r["step"] for r in rows2] == list(range(second["step"] + 1, steps + 1))
    assert all(r["rollbacks"] == 2 and r["lr"] == pytest.approx(before[-1]["lr"] / 4) for r in rows2)
    assert rows2[0]["weight_version"] > versions[-1]
    # no group of the blown-up weights reached training after the restart either
    assert all(r["weight_version"] - 1 - r["staleness"] >= resynced[1]["weight_version"] for r in rows2)
    assert rows2[-1]["dropped_groups"] >= after[-1]["dropped_groups"]
    assert statistics.mean(r["entropy"] for r in rows2[:10]) > 0.8 * pre_entropy


@pytest.mark.slow
def test_two_ranks_roll_back_together(short_tmp: Path) -> None:
    """device = ["cpu", "cpu"]: every rank stops, loads the known-good checkpoint rank 0 picked and
    takes the halved learning rate; the group trains on to its last step."""
    steps, burst = 24, 14
    cfg = replica_job_config(
        short_tmp,
        replicas=1,
        steps=steps,
        trainer={
            "device": ["cpu", "cpu"],
            "batch_size": 16,
            "micro_batch_size": 4,
            "join_timeout": 120.0,
            "checkpoint_every": 4,
        },
        health={"known_good_after": 4},
    )
    env = {**daemon_env(), **fault_env(lr_burst={"steps": [burst], "factor": FACTOR})}
    res = atroposd("run", "-c", str(cfg), env=env, timeout=400)
    assert res.returncode == 0, f"run exited {res.returncode}\n{problem_lines(res.stderr)}"
    detected = _events(res.stderr, "collapse detected: rolling back to the newest known-good weights")
    assert len(detected) == 1 and burst < detected[0]["step"] <= burst + 4, problem_lines(res.stderr)
    assert detected[0]["to"].endswith("/step-8"), detected[0]  # step-12: not 4 healthy steps old
    rows = metrics(short_tmp / "state")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    after = [r for r in rows if r["step"] > detected[0]["step"]]
    assert after and all(r["rollbacks"] == 1 and r["lr"] == pytest.approx(rows[0]["lr"] / 2) for r in after)
    versions = [r["weight_version"] for r in rows]
    assert versions == sorted(set(versions))
    # the other rank took the halved learning rate from rank 0 when it rebuilt its optimizer
    rank1 = (short_tmp / "state" / "logs" / "trainer-1.log").read_text()
    scaled = _events(rank1, "learning rate scaled after rollbacks")
    assert scaled and scaled[-1]["scale"] == 0.5 and scaled[-1]["rank"] == 1, rank1[-3000:]

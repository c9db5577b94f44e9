"""The embedded job end to end through the command line: run, start/status/stop, faults, resume."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.e2e.jobs import (
    SHORT_TASK,
    component,
    daemon_env,
    job_config,
    kill9,
    metrics,
    run_short_learning_job,
    status,
)
from tests.support import atroposd, wait_for

REQUIRED_METRICS = {
    "step",
    "time",
    "loss",
    "reward_mean",
    "reward_std",
    "accuracy",
    "weight_version",
    "staleness",
    "mean_ratio",
    "clipped_fraction",
    "mean_kl",
    "grad_norm",
    "tokens",
    "skipped_steps",
}


def _segments_of_job(state_dir: Path) -> list[str]:
    """The shared-memory segments still named after this job's per-launch nonces."""
    nonces = set(re.findall(r"config-([0-9a-f]+)\.toml", (state_dir / "logs" / "daemon.log").read_text()))
    assert nonces, "the daemon log names no launch"
    return [n for n in os.listdir("/dev/shm") if any(n.startswith(f"atroposd-{x}-") for x in nonces)]


def test_run_finishes_its_steps_and_leaves_nothing(short_tmp: Path) -> None:
    cfg = job_config(short_tmp, steps=6)  # a checkpoint every 3 steps: one mid-run, one at the end
    res = atroposd("run", "-c", str(cfg), env=daemon_env(), timeout=240)
    assert res.returncode == 0, f"run exited {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    rows = metrics(short_tmp / "state")
    assert [r["step"] for r in rows] == list(range(1, 7))
    missing = REQUIRED_METRICS - set(rows[-1])
    assert not missing, f"metrics.jsonl lacks {sorted(missing)}"
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    ckpts = sorted(p.name for p in (short_tmp / "state" / "checkpoints").iterdir())
    assert "step-6" in ckpts, ckpts
    assert (short_tmp / "state" / "checkpoints" / "step-6" / "config.json").exists()
    assert _segments_of_job(short_tmp / "state") == []
    assert not (short_tmp / "run" / "control.sock").exists()


def test_start_status_stop(short_tmp: Path) -> None:
    cfg = job_config(short_tmp, steps=100_000)
    res = atroposd("start", "-c", str(cfg), env=daemon_env(), timeout=240)
    try:
        assert res.returncode == 0, f"start exited {res.returncode}: {res.stderr[-3000:]}"
        st = status(cfg)
        assert st["state"] in ("running", "degraded")
        names = {c["name"]: c for c in st["components"]}
        assert {"api", "inference", "arithmetic-0"} <= set(names), names
        for c in names.values():
            assert c["state"] == "ready", c
            assert isinstance(c["pid"], int) and psutil.pid_exists(c["pid"])
        first = st["trainer"]["step"]
        wait_for(lambda: status(cfg)["trainer"]["step"] >= first + 5, timeout=90, what="training steps")
        st = status(cfg)
        assert st["trainer"]["state"] in ("training", "waiting")  # waiting: between two batches
        assert st["queue"]["capacity"] == 8192
        human = atroposd("status", "-c", str(cfg), timeout=30)
        assert human.returncode == 0 and "inference" in human.stdout
        pids = [c["pid"] for c in st["components"]] + [st["pid"]]
    finally:
        stopped = atroposd("stop", "-c", str(cfg), timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert atroposd("status", "-c", str(cfg), timeout=30).returncode == 3


@pytest.mark.slow
def test_faults_while_training_then_daemon_kill9_and_start_resumes(short_tmp: Path) -> None:
    """kill -9 of each child in turn: each comes back and the trainer keeps stepping. Then kill -9
    of the daemon takes every child with it, and the next start resumes at the step after the
    last complete checkpoint (one job for both: the start is most of either's cost)."""
    cfg = job_config(short_tmp, steps=100_000, trainer={"checkpoint_every": 10})
    res = atroposd("start", "-c", str(cfg), env=daemon_env(), timeout=240)
    try:
        assert res.returncode == 0, res.stderr[-3000:]
        for name in ("arithmetic-0", "inference", "api"):
            before = component(status(cfg), name)
            step0 = status(cfg)["trainer"]["step"]
            kill9(before["pid"])

            def back(name: str = name, before: dict[str, Any] = before) -> bool:
                c = component(status(cfg), name)
                return c["state"] == "ready" and c["pid"] != before["pid"] and c["restarts"] > before["restarts"]

            wait_for(back, timeout=120, interval=0.5, what=f"{name} to be restarted")
            wait_for(
                lambda step0=step0: status(cfg)["trainer"]["step"] >= step0 + 10,
                timeout=120,
                interval=0.5,
                what=f"training to advance after {name} was killed",
            )
        st = status(cfg)
        assert st["trainer"]["state"] in ("training", "waiting")  # waiting: between two batches
        rows = metrics(short_tmp / "state")
        steps = [r["step"] for r in rows]
        assert steps == sorted(set(steps)), "a step was trained twice or out of order"

        # kill -9 of the daemon: its children die with it; the next start resumes
        def checkpoints() -> list[int]:
            return sorted(
                int(p.name.split("-")[1])
                for p in (short_tmp / "state" / "checkpoints").iterdir()
                if p.name.startswith("step-") and p.name.split("-")[1].isdigit()
            )

        # the newest three are kept: step-20 may be gone already, a later one is there
        wait_for(lambda: checkpoints() and checkpoints()[-1] >= 20, timeout=120, interval=0.5, what="a checkpoint")
        st = status(cfg)
        children = [c["pid"] for c in st["components"]]
        kill9(st["pid"])
        wait_for(
            lambda: (
                not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in children)
            ),
            timeout=15,
            what="children to die with the daemon",
        )
        complete = checkpoints()
        restarted_at = time.time()
        res = atroposd("start", "-c", str(cfg), env=daemon_env(), timeout=240)
        assert res.returncode == 0, res.stderr[-3000:]
        resumed = status(cfg)["trainer"]
        assert resumed["step"] >= complete[-1], (resumed, complete)
        wait_for(lambda: status(cfg)["trainer"]["step"] > complete[-1] + 3, timeout=90, what="steps after resume")
        rows = metrics(short_tmp / "state")
        assert any(r["step"] == complete[-1] + 1 and r["time"] >= restarted_at for r in rows), (
            "training did not continue at the step after the last complete checkpoint"
        )
    finally:
        assert atroposd("stop", "-c", str(cfg), timeout=120).returncode == 0


@pytest.mark.slow
def test_a_short_job_learns(short_tmp: Path) -> None:
    """The embedded job, shortened to a smaller task (operands 0–4: 25 problems, one-digit sums):
    reward and exact-match accuracy both rise well past a prompt-ignoring policy's. The daemon
    builds builtin:tiny itself, as on a user's first start."""
    run_short_learning_job(
        job_config(short_tmp, steps=400, envs=SHORT_TASK, trainer={"checkpoint_every": 400}, prebuilt_model=False),
        short_tmp / "state",
    )
    assert "builtin model built" in (short_tmp / "state" / "logs" / "daemon.log").read_text()

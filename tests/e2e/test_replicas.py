"""The embedded job with two inference replicas (SPEC §12.2), end to end through the command line:
both replicas serve, kill -9 of one leaves generation to the other and the restarted one comes
back with the current weights, and stop leaves nothing."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from tests.e2e.jobs import (
    SHORT_TASK,
    component,
    daemon_env,
    kill9,
    metrics,
    processes_of_instance,
    replica_health,
    replica_job_config,
    run_short_learning_job,
    segments_of,
    status,
)
from tests.support import atroposd, wait_for


@pytest.mark.slow
def test_two_replicas_serve_survive_a_kill_and_stop_cleanly(short_tmp: Path) -> None:
    cfg = replica_job_config(short_tmp, steps=100_000)
    res = atroposd("start", "-c", str(cfg), env=daemon_env(), timeout=300)
    nonce = ""
    try:
        assert res.returncode == 0, f"start exited {res.returncode}: {res.stderr[-3000:]}"
        st = status(cfg)
        nonce = st["instance"]
        names = [c["name"] for c in st["components"]]
        assert names[:3] == ["api", "inference-0", "inference-1"], names
        assert "inference" not in names
        for name in ("inference-0", "inference-1"):
            assert component(st, name)["state"] == "ready"
        # both serve: each replica's own count of generations grows
        wait_for(
            lambda: all(replica_health(cfg, i)["generations"] >= 3 for i in (0, 1)),
            timeout=120,
            interval=0.5,
            what="both replicas to serve",
        )
        wait_for(lambda: status(cfg)["trainer"]["step"] >= 3, timeout=120, interval=0.5, what="training steps")

        before = component(status(cfg), "inference-1")
        version_at_kill = replica_health(cfg, 0)["weight_version"]
        kill9(before["pid"])
        # generation goes on through replica 0: the trainer keeps stepping
        step0 = status(cfg)["trainer"]["step"]
        served0 = replica_health(cfg, 0)["generations"]
        wait_for(
            lambda: status(cfg)["trainer"]["step"] >= step0 + 3,
            timeout=120,
            interval=0.5,
            what="training to go on with one replica",
        )
        assert replica_health(cfg, 0)["generations"] > served0

        def back() -> bool:
            c = component(status(cfg), "inference-1")
            return c["state"] == "ready" and c["pid"] != before["pid"] and c["restarts"] > before["restarts"]

        wait_for(back, timeout=180, interval=0.5, what="inference-1 to be restarted")
        # it came back with the trainer's weights (never the base model), and serves again
        restarted = replica_health(cfg, 1)
        assert restarted["weight_version"] is not None and restarted["weight_version"] > version_at_kill, restarted
        wait_for(
            lambda: replica_health(cfg, 1)["generations"] >= 2,
            timeout=120,
            interval=0.5,
            what="the restarted replica to serve",
        )

        def current() -> bool:
            # The trainer steps every few tens of ms, faster than three reads: each replica must hold
            # at least the version the trainer had before they were read (one behind while a sync runs).
            trainer_version = status(cfg)["trainer"]["weight_version"]
            return all(replica_health(cfg, i)["weight_version"] >= trainer_version - 1 for i in (0, 1))

        wait_for(current, timeout=60, interval=0.2, what="both replicas at the trainer's weight_version")
        human = atroposd("status", "-c", str(cfg), timeout=30)
        assert "inference-0" in human.stdout and "inference-1" in human.stdout
        pids = [c["pid"] for c in status(cfg)["components"]]
    finally:
        stopped = atroposd("stop", "-c", str(cfg), timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert processes_of_instance(nonce) == []
    assert segments_of(nonce) == []
    rows = metrics(short_tmp / "state")
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps))


@pytest.mark.slow
def test_a_short_job_with_two_replicas_learns(short_tmp: Path) -> None:
    """test_job's shortened learning run, with two inference replicas: the same floor."""
    run_short_learning_job(
        replica_job_config(short_tmp, steps=400, envs=SHORT_TASK, trainer={"checkpoint_every": 400}),
        short_tmp / "state",
    )
    log = (short_tmp / "state" / "logs" / "daemon.log").read_text()
    assert "inference-1" in log

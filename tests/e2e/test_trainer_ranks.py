"""The embedded job with two trainer ranks (SPEC §12.1), end to end through the command line: rank 1
is the supervised child ``trainer-1``; a rank killed -9 or stopped with SIGSTOP restarts the whole
group from the last complete checkpoint and training passes its pre-fault step; a rank that never
joins fails the start within join_timeout; stop leaves nothing."""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.e2e.jobs import (
    SHORT_TASK,
    component,
    daemon_env,
    kill9,
    metrics,
    processes_of_instance,
    replica_job_config,
    run_short_learning_job,
    segments_of,
    status,
)
from tests.faults import fault_env
from tests.support import atroposd, wait_for

RANKS = {"device": ["cpu", "cpu"], "batch_size": 16, "micro_batch_size": 4, "join_timeout": 120.0}


def _config(root: Path, *, replicas: int = 1, trainer: dict[str, Any] | None = None, **kw: Any) -> Path:
    return replica_job_config(root, replicas=replicas, trainer={**RANKS, **(trainer or {})}, **kw)


def _rank_ready_again(cfg: Path, old_pid: int) -> bool:
    rank = component(status(cfg), "trainer-1")
    return bool(rank["state"] == "ready" and rank["pid"] not in (None, old_pid))


def _ready_group(cfg: Path) -> dict[str, Any] | None:
    """The status while trainer-1 is ready and training goes on (not between a fault and the restart)."""
    st = status(cfg)
    rank = component(st, "trainer-1")
    forming = st["trainer"]["waiting_for"] in ("ranks", "model")
    return st if rank["state"] == "ready" and rank["pid"] and not forming else None


def _stop_and_check(cfg: Path, nonce: str) -> None:
    res = atroposd("stop", "-c", str(cfg), env=daemon_env(), timeout=120)
    assert res.returncode == 0, res.stderr
    if nonce:
        wait_for(lambda: not processes_of_instance(nonce), timeout=30, what="every process of the job gone")
        assert not segments_of(nonce)


@pytest.mark.slow
def test_two_ranks_train_restart_after_kill_and_sigstop(short_tmp: Path) -> None:
    cfg = _config(
        short_tmp,
        steps=100_000,
        trainer={"checkpoint_every": 5, "collective_timeout": 8.0, "restart_window": 600.0},
        daemon={"stop_timeout": 5.0},
    )
    res = atroposd("start", "-c", str(cfg), env=daemon_env(), timeout=300)
    nonce = ""
    try:
        assert res.returncode == 0, f"start exited {res.returncode}: {res.stderr[-3000:]}"
        st = status(cfg)
        nonce = st["instance"]
        assert st["trainer"]["ranks"] == 2
        rank1 = component(st, "trainer-1")
        assert rank1["state"] == "ready" and rank1["kind"] == "trainer"
        assert psutil.Process(rank1["pid"]).environ().get("ATROPOSD_INSTANCE") == nonce
        wait_for(lambda: status(cfg)["trainer"]["step"] >= 7, timeout=180, interval=0.5, what="training steps")

        # kill -9 of rank 1: the group restarts from the last checkpoint and passes the pre-kill step
        # (the rank as it is now: on a loaded machine a slow collective may have restarted it already)
        st = wait_for(lambda: _ready_group(cfg), timeout=120, interval=0.2, what="trainer-1 ready")
        before, restarts, rank1 = st["trainer"]["step"], st["trainer"]["group_restarts"], component(st, "trainer-1")
        kill9(rank1["pid"])
        wait_for(
            lambda: status(cfg)["trainer"]["group_restarts"] >= restarts + 1,
            timeout=60,
            interval=0.2,
            what="the trainer group to restart",
        )
        wait_for(
            lambda: _rank_ready_again(cfg, rank1["pid"]) and status(cfg)["trainer"]["step"] > before + 1,
            timeout=180,
            interval=0.5,
            what="a new trainer-1 and training past the pre-kill step",
        )
        st = status(cfg)
        assert not psutil.pid_exists(rank1["pid"]) or psutil.Process(rank1["pid"]).status() == psutil.STATUS_ZOMBIE
        assert "trainer-1" in (st["trainer"]["last_fault"] or "")
        assert st["state"] == "running"

        # SIGSTOP of rank 1: the next collective outlasts collective_timeout → the group restarts
        st = wait_for(lambda: _ready_group(cfg), timeout=120, interval=0.2, what="trainer-1 ready")
        new1 = component(st, "trainer-1")
        before, restarts = st["trainer"]["step"], st["trainer"]["group_restarts"]
        os.kill(new1["pid"], signal.SIGSTOP)
        stopped_at = time.monotonic()
        wait_for(
            lambda: status(cfg)["trainer"]["group_restarts"] >= restarts + 1,
            timeout=90,
            interval=0.2,
            what="the trainer group to restart after a stuck collective",
        )
        assert time.monotonic() - stopped_at < 60
        wait_for(
            lambda: _rank_ready_again(cfg, new1["pid"]) and status(cfg)["trainer"]["step"] > before + 1,
            timeout=180,
            interval=0.5,
            what="a new trainer-1 and training past the pre-stop step",
        )
        assert not psutil.pid_exists(new1["pid"]) or psutil.Process(new1["pid"]).status() == psutil.STATUS_ZOMBIE
        st = status(cfg)
        assert st["trainer"]["weight_version"] >= st["trainer"]["step"]
        # versions never go backwards across the restarts: the metrics rows (trimmed to the
        # checkpoint a group restarted from) carry strictly increasing weight versions
        versions = [r["weight_version"] for r in metrics(short_tmp / "state")]
        assert versions and all(a < b for a, b in itertools.pairwise(versions)), versions

        # kill -9 of the daemon takes every rank with it; the next start resumes
        wait_for(lambda: status(cfg)["trainer"]["last_checkpoint"] is not None, timeout=60, what="a checkpoint")
        kill9(st["pid"])
        wait_for(lambda: not processes_of_instance(nonce), timeout=30, what="every process of the killed job gone")
        res = atroposd("start", "-c", str(cfg), env=daemon_env(), timeout=300)
        assert res.returncode == 0, f"restart exited {res.returncode}: {res.stderr[-3000:]}"
        st = status(cfg)
        nonce = st["instance"]
        assert st["trainer"]["step"] >= 5 and component(st, "trainer-1")["state"] == "ready"
        assert st["trainer"]["last_checkpoint"] is not None
    except Exception as exc:
        raise AssertionError(f"{exc!r}\n--- daemon log ---\n{_log_tail(short_tmp)}") from exc
    finally:
        _stop_and_check(cfg, nonce)


def _log_tail(root: Path, lines: int = 40) -> str:
    logs = root / "state" / "logs"
    out = []
    for name in ("trainer-1.log", "daemon.log"):  # the daemon's last: a cut output keeps its end
        path = logs / name
        if path.exists():
            kept = [line for line in path.read_text(errors="replace").splitlines() if '"event":"step"' not in line]
            out.append(f"[{name}]\n" + "\n".join(line[:400] for line in kept[-lines:]))
    return "\n".join(out)


def test_rank_that_never_joins_fails_the_start(short_tmp: Path) -> None:
    cfg = _config(short_tmp, steps=10, trainer={"join_timeout": 2.0})
    started = time.monotonic()
    res = atroposd("start", "-c", str(cfg), env={**daemon_env(), **fault_env(rank_hang="join")}, timeout=300)
    try:
        assert res.returncode != 0
        text = res.stdout + res.stderr
        assert "trainer-1" in text and "join_timeout" in text, text[-3000:]
        assert time.monotonic() - started < 120
    finally:
        if res.returncode == 0:
            _stop_and_check(cfg, "")


@pytest.mark.slow
def test_two_ranks_two_replicas_learn(short_tmp: Path) -> None:
    """The whole job with device = ["cpu", "cpu"] and replicas = 2 learns the shortened task."""
    steps = 400
    cfg = _config(
        short_tmp,
        replicas=2,
        steps=steps,
        seed=0,
        envs=SHORT_TASK,
        trainer={"batch_size": 32, "micro_batch_size": 8, "checkpoint_every": 200},
    )
    rows = run_short_learning_job(cfg, short_tmp / "state", steps=steps)
    assert all(r["weight_version"] == r["step"] for r in rows)

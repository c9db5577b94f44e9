"""Silent stalls (SPEC §4, Liveness): a child that is alive but stuck is found, named and restarted;
a trainer stall no child explains ends the job with exit 1 and the next start resumes.

Real processes throughout: the embedded job (tiny model on CPU) with short liveness intervals;
a child is stopped with SIGSTOP (alive, holding its port, answering nothing).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.e2e.jobs import component, daemon_env, job_config, metrics, status
from tests.faults import fault_env
from tests.support import atroposd, free_port, wait_for

# Short liveness settings: a stopped child is declared hung after 3 failed checks, 0.5 s apart.
LIVE = {"live_interval": 0.5, "live_timeout": 1.0, "live_failures": 3}


def _live_job(root: Path, **trainer: Any) -> Path:
    envs = [{"name": "arithmetic", "builtin": "arithmetic", **LIVE}]
    return job_config(
        root,
        steps=100_000,
        envs=envs,
        trainer={"checkpoint_every": 100_000, **trainer},
        daemon={"stop_timeout": 5.0},
        api=LIVE,
        inference={**LIVE, "live_generate_every": 4},
    )


def _watch_until(
    cfg: Path, done: Callable[[dict[str, Any]], bool], *, timeout: float, what: str
) -> list[dict[str, Any]]:
    """Poll status until ``done``; every status seen (what it showed in between)."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = status(cfg)
        seen.append(st)
        if done(st):
            return seen
        time.sleep(0.1)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what}; last status: {json.dumps(seen[-1] if seen else None)[:3000]}"
    )


def _sigstop_and_recover(cfg: Path, name: str) -> dict[str, float]:
    """SIGSTOP ``name``; wait until it was declared hung, restarted, and the trainer steps again.

    Returns the seconds from the SIGSTOP to: hung (seen stopping/backoff), ready again, and
    training again (a step finished after the restarted child was ready).
    """
    before = component(status(cfg), name)
    wait_for(lambda: status(cfg)["trainer"]["step"] > 0, timeout=120, what="a first step")
    pid = before["pid"]
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        marks: dict[str, float] = {}

        def restarted(st: dict[str, Any]) -> bool:
            c = component(st, name)
            if "hung" not in marks and (c["state"] != "ready" or c["pid"] != pid):
                marks["hung"] = time.monotonic() - t0
            return c["state"] == "ready" and c["pid"] != pid

        seen = _watch_until(cfg, restarted, timeout=90, what=f"{name} to be restarted as hung")
        marks["ready"] = time.monotonic() - t0
        ready_step = seen[-1]["trainer"]["step"]
        showed = [component(st, name) for st in seen]
        assert any(
            c["live"]["state"] in ("failing", "hung") or c["state"] in ("stopping", "backoff") for c in showed
        ), f"status never showed {name} failing or hung: {showed}"
        after = component(seen[-1], name)
        assert after["last_exit"]["reason"] == "hung", after
        assert after["restarts"] == before["restarts"] + 1, after
        assert after["live"]["last_hung"]["pid"] == pid, after
        _watch_until(
            cfg,
            lambda st: st["trainer"]["step"] >= ready_step + 2,
            timeout=120,
            what=f"training to advance after {name} was restarted",
        )
        marks["training"] = time.monotonic() - t0
        return marks
    finally:
        if psutil.pid_exists(pid):  # never leave a stopped process behind
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_sigstop_of_each_child_while_training(short_tmp: Path) -> None:
    """Inference, API and a built-in environment in turn: each stopped one is found by its
    liveness check, killed, restarted (inference with the current weights, the API with its
    spool), and the trainer's step advances again."""
    cfg = _live_job(short_tmp)
    res = atroposd("start", "-c", str(cfg), env=daemon_env(), timeout=240)
    try:
        assert res.returncode == 0, res.stderr[-3000:]
        times = {name: _sigstop_and_recover(cfg, name) for name in ("inference", "api", "arithmetic-0")}
        print("SIGSTOP → hung / ready / training again (s):", json.dumps(times))
        # within live_interval × live_failures + stop_timeout (+ a probe's timeout), with slack
        assert times["inference"]["hung"] <= 0.5 * 3 + 1.0 + 5.0 + 5.0, times
        log = (short_tmp / "state" / "logs" / "daemon.log").read_text()
        for name in ("inference", "api", "arithmetic-0"):
            assert f'"unit": "{name}"' in log or f'"unit":"{name}"' in log
        hung = [json.loads(line) for line in log.splitlines() if '"hung"' in line and line.startswith("{")]
        assert {h.get("unit") for h in hung if h.get("event") == "hung"} >= {"inference", "api", "arithmetic-0"}
        st = status(cfg)
        assert st["trainer"]["state"] in ("training", "waiting"), st["trainer"]
        steps = [r["step"] for r in metrics(short_tmp / "state")]
        assert steps == sorted(set(steps)), "a step was trained twice or out of order"
    finally:
        assert atroposd("stop", "-c", str(cfg), timeout=120).returncode == 0


@pytest.mark.slow  # a whole job or a long search: run by .ci/run, not in the default run
def test_unresolved_stall_ends_the_job_and_the_next_start_resumes(short_tmp: Path) -> None:
    """A trainer step blocked by the ``stall_step`` fault (tests/faults): status shows ``stalled``
    at the trainer's own stage; past twice stall_timeout the job exits 1; the next start resumes
    from the last checkpoint."""
    marker = short_tmp / "stalled-once"
    metrics_port = free_port()
    cfg = job_config(
        short_tmp,
        steps=8,
        trainer={"checkpoint_every": 3, "stall_timeout": 3.0},
        daemon={"stop_timeout": 5.0, "metrics_port": metrics_port},
    )
    env = {**daemon_env(), **fault_env(stall_step={"step": 5, "marker": str(marker)})}
    with open(short_tmp / "run1.err", "wb") as err_file:
        proc = psutil.Popen(
            [*_cli(), "run", "-c", str(cfg)], env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=err_file
        )
    try:
        seen = wait_for(
            lambda: _status_or_none(cfg, lambda st: (st["trainer"] or {}).get("state") == "stalled"),
            timeout=120,
            interval=0.2,
            what="status to show the trainer stalled",
        )
        t = seen["trainer"]
        assert t["stage"] == "trainer", t
        assert t["stalled_for_s"] >= 3.0, t
        assert t["step"] == 4, t
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        gauge = [
            line
            for line in scrape.splitlines()
            if line.startswith("atroposd_trainer_stalled_seconds{") and 'stage="trainer"' in line
        ]
        assert gauge and float(gauge[0].split()[-1]) >= 3.0, scrape[-2000:]
        code = proc.wait(timeout=60)
    finally:
        if proc.is_running():
            proc.kill()
            proc.wait(timeout=10)
    err = (short_tmp / "run1.err").read_text()
    assert code == 1, err[-3000:]
    assert "stall not resolved" in err, err[-3000:]
    assert (short_tmp / "state" / "checkpoints" / "step-3").is_dir()
    # The next start resumes from step 3 and finishes (the hook fires once).
    res = atroposd("run", "-c", str(cfg), env=env, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [r["step"] for r in metrics(short_tmp / "state")]
    assert steps == list(range(1, 9)), steps


def _cli() -> list[str]:
    import sys

    return [sys.executable, "-m", "atroposd"]


def _status_or_none(cfg: Path, pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    res = atroposd("status", "-c", str(cfg), "--json", timeout=30)
    if res.returncode != 0:
        return None
    st: dict[str, Any] = json.loads(res.stdout)
    return st if pred(st) else None

"""reload / SIGHUP: environments change live, the rest is refused, an invalid file changes nothing."""

from __future__ import annotations

import os
import signal
from typing import Any

import psutil
import pytest

from tests.daemon.conftest import Job, base_sections, env, script
from tests.support import wait_for


def _pids(job: Job) -> dict[str, Any]:
    return {c["name"]: c["pid"] for c in job.status()["components"] if c["kind"] == "env"}


def test_reload_adds_removes_and_restarts_environments_without_touching_the_others(job: Job) -> None:
    keep, drop = env("keep", script("cooperative.py")), env("drop", script("cooperative.py"))
    job.write(**base_sections(job.dir, [keep, drop]))
    assert job.cli("start").returncode == 0
    before = _pids(job)
    assert set(before) == {"keep-0", "drop-0"}

    job.write(env=[keep, env("new", script("cooperative.py"), replicas=2)])
    r = job.cli("reload")
    assert r.returncode == 0, r.stderr
    assert "added: new" in r.stdout and "removed: drop" in r.stdout
    wait_for(
        lambda: all(c["state"] == "ready" for c in job.status()["components"] if c["kind"] == "env"),
        what="new environments ready",
    )
    after = _pids(job)
    assert set(after) == {"keep-0", "new-0", "new-1"}
    assert after["keep-0"] == before["keep-0"]  # untouched
    assert not psutil.pid_exists(before["drop-0"]) or psutil.Process(before["drop-0"]).status() == psutil.STATUS_ZOMBIE

    job.write(env=[{**keep, "start_seconds": 0.3}, env("new", script("cooperative.py"), replicas=2)])
    r = job.cli("reload")
    assert r.returncode == 0 and "changed: keep" in r.stdout
    wait_for(
        lambda: (c := job.component("keep-0"))["state"] == "ready" and c["pid"] != before["keep-0"],
        what="changed environment restarted",
    )
    assert _pids(job)["new-0"] == after["new-0"]
    assert job.cli("stop").returncode == 0


@pytest.mark.slow
def test_reload_refuses_changes_that_need_a_restart(job: Job) -> None:
    job.write(**base_sections(job.dir, [env("keep", script("cooperative.py"))]))
    assert job.cli("start").returncode == 0
    before = _pids(job)
    job.write(
        trainer={"enabled": False, "steps": 7},
        env=[env("keep", script("cooperative.py")), env("extra", script("cooperative.py"))],
    )
    r = job.cli("reload")
    assert r.returncode == 2
    assert "trainer.steps" in r.stderr and "nothing was changed" in r.stderr
    assert _pids(job) == before  # the added environment was not started either
    assert job.cli("stop").returncode == 0


@pytest.mark.slow
def test_sighup_with_an_invalid_file_keeps_the_running_config(job: Job) -> None:
    job.write(**base_sections(job.dir, [env("keep", script("cooperative.py"))]))
    assert job.cli("start").returncode == 0
    before = _pids(job)
    good = job.config.read_text()
    job.config.write_text(good + '\n[[env]]\nname = "broken"\nreplicas = 0\n')
    assert job.cli("reload").returncode == 2  # the client sees the bad file first
    pid = job.daemon_pid()
    assert pid is not None
    os.kill(pid, signal.SIGHUP)  # the daemon re-reads it itself
    log = job.state_dir / "logs" / "daemon.log"
    wait_for(lambda: "reload refused: invalid config" in log.read_text(), what="refusal logged")
    assert "env[1].replicas" in log.read_text()
    job.config.write_text(good)  # the CLI needs a valid file to find the daemon
    st = job.status()
    assert st["state"] == "running" and _pids(job) == before
    assert job.cli("stop").returncode == 0

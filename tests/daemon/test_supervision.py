"""Supervision details: start failures, orphan reaping, control-socket permissions."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import psutil
import pytest

from tests.daemon.conftest import Job, base_sections, env, script
from tests.support import REPO, free_port, wait_for


def test_start_reports_why_a_required_component_failed(job: Job) -> None:
    job.write(
        **base_sections(
            job.dir,
            [env("worker", script("cooperative.py"))],
            api={"enabled": True, "url": "", "port": free_port(), "command": script("crashloop.py", "2")},
        )
    )
    r = job.cli("start")
    assert r.returncode == 1
    assert "api did not become ready" in r.stderr
    assert "usage or config error" in r.stderr and "crashloop: exiting with 2" in r.stderr
    assert not (job.state_dir / "logs" / "worker-0.log").exists()  # environments never started
    assert job.cli("status").returncode == 3


@pytest.mark.slow
def test_adopted_orphans_are_reaped_and_own_children_keep_their_status(job: Job) -> None:
    pidfile = job.dir / "orphans"
    job.write(
        **base_sections(
            job.dir,
            [
                env("maker", script("orphan_maker.py", str(pidfile), "1.5")),
                env("crashy", script("crashloop.py", "3"), max_restarts=1),
            ],
        )
    )
    assert job.cli("start").returncode == 0
    daemon = job.daemon_pid()
    assert daemon is not None
    orphans = [
        int(p)
        for p in wait_for(
            lambda: pidfile.exists() and len(pidfile.read_text().split()) == 3 and pidfile.read_text(), what="orphans"
        ).split()
    ]

    def ppid(pid: int) -> int | None:
        try:
            return psutil.Process(pid).ppid()
        except psutil.NoSuchProcess:
            return None

    # the daemon is a child subreaper: the orphans are re-parented to it, not to init
    assert any(ppid(p) == daemon for p in orphans)

    def zombies() -> list[int]:
        return [c.pid for c in psutil.Process(daemon).children() if c.status() == psutil.STATUS_ZOMBIE]

    def orphans_reaped() -> bool:
        return not any(psutil.pid_exists(p) and p in zombies() for p in orphans)

    wait_for(orphans_reaped, timeout=10, what="orphans reaped")
    # The crash-looping child's own exit statuses were seen by its unit, not stolen by the reaper.
    crashy = job.wait_state("crashy-0", "failed", timeout=20)
    assert crashy["last_exit"]["code"] == 3
    assert job.cli("stop").returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_a_client_refused_by_the_file_system_is_told_permission_denied(job: Job) -> None:
    job.write(**base_sections(job.dir, [env("worker", script("cooperative.py"))]))
    assert job.cli("start").returncode == 0
    os.chmod(job.dir, 0o755)
    os.chmod(job.config, 0o644)
    r = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-m",
            "atroposd",
            "status",
            "-c",
            str(job.config),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=REPO,
        env={**os.environ, "HOME": "/"},
    )
    if "No module named" in r.stderr or "Permission denied: '/work" in r.stderr:
        pytest.skip("the interpreter is not usable by an unprivileged user here")
    assert r.returncode == 1, r.stderr
    assert "permission denied" in r.stderr
    assert job.cli("stop").returncode == 0


@pytest.mark.slow
def test_metrics_port_serves_component_states(job: Job) -> None:
    import urllib.request

    port = free_port()
    job.write(**base_sections(job.dir, [env("worker", script("cooperative.py"))], daemon={"metrics_port": port}))
    assert job.cli("start").returncode == 0
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'atroposd_component_state{component="worker-0",kind="env",state="ready"} 1.0' in text
    assert 'atroposd_component_restarts_total{component="worker-0",kind="env"} 0.0' in text
    assert "atroposd_uptime_seconds" in text
    assert job.cli("stop").returncode == 0

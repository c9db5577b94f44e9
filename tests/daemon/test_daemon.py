"""The daemon end to end through the CLI, with purpose-built children (tests/child_scripts)."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import psutil
import pytest

from tests.daemon.conftest import Job, base_sections, env, script
from tests.support import free_port, wait_for


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_start_status_stop(job: Job) -> None:
    job.write(**base_sections(job.dir, [env("worker", script("cooperative.py"), replicas=2)]))
    t0 = time.monotonic()
    # NCCL's defaults (and anything the launcher says) end a process on a failed collective:
    # the daemon sets its own over them before anything, whatever the rank count (SPEC §12.1)
    r = job.cli("start", env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_ENABLE_MONITORING": "1"})
    start_s = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert "ready" in r.stdout
    st = job.status()
    assert st["state"] == "running"
    assert st["pid"] == job.daemon_pid()
    assert st["config"] == str(job.config.resolve())
    assert isinstance(st["uptime_s"], float)
    assert st["trainer"] is None
    names = [c["name"] for c in st["components"]]
    assert names == ["api", "inference", "worker-0", "worker-1"]
    for c in st["components"]:
        assert set(c) >= {"name", "kind", "external", "state", "pid", "restarts", "last_exit", "since_s"}
    api = st["components"][0]
    assert api["external"] is True and api["pid"] is None and api["state"] == "unreachable"
    worker = st["components"][2]
    assert worker["kind"] == "env" and worker["external"] is False and worker["state"] == "ready"
    assert worker["restarts"] == 0 and worker["last_exit"] is None and _alive(worker["pid"])
    child_pids = [c["pid"] for c in st["components"][2:]]
    # every child carries the instance nonce and no systemd variable
    for pid in child_pids:
        environ = psutil.Process(pid).environ()
        assert environ["ATROPOSD_INSTANCE"] == st["instance"]
        assert environ["ATROPOSD_NAME"] in ("worker-0", "worker-1")
        assert "NOTIFY_SOCKET" not in environ
        # what the daemon's own environment held when it started its children
        assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2", environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        assert environ["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    human = job.cli("status")
    assert human.returncode == 0 and "worker-1" in human.stdout
    logs = job.cli("logs", "worker-0")
    assert logs.returncode == 0 and "ATROPOSD_REPLICA" in logs.stdout
    t0 = time.monotonic()
    r = job.cli("stop")
    stop_s = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert not any(_alive(p) for p in child_pids)
    assert not (job.runtime_dir / "control.sock").exists()
    assert job.cli("status").returncode == 3
    print(f"start {start_s:.2f}s stop {stop_s:.2f}s")
    assert stop_s < 8.0  # two interpreter starts included; cooperative children exit at once


def test_not_running_and_already_running(job: Job) -> None:
    job.write(**base_sections(job.dir, [env("worker", script("cooperative.py"))]))
    for cmd in (("status",), ("stop",), ("reload",), ("logs", "-f")):
        r = job.cli(*cmd)
        assert r.returncode == 3, (cmd, r.returncode, r.stderr)
        assert "no daemon is running" in r.stderr
    assert job.cli("start").returncode == 0
    r = job.cli("start")
    assert r.returncode == 4 and "already running" in r.stderr
    r = job.cli("run")
    assert r.returncode == 4 and "already running" in r.stderr
    assert job.cli("stop").returncode == 0


def test_start_order_api_before_registered_environments(job: Job) -> None:
    marker = job.dir / "order"
    port = free_port()
    job.write(
        **base_sections(
            job.dir,
            [
                env(
                    "reg",
                    script("registering_env.py", str(marker)),
                    ready="registered",
                    start_seconds=30.0,
                    ready_timeout=20.0,
                ),
                env("plain", script("cooperative.py", str(marker))),
            ],
            api={"enabled": True, "url": "", "port": port, "command": script("fake_api.py", "{port}", str(marker))},
        )
    )
    t0 = time.monotonic()
    r = job.cli("start")
    assert r.returncode == 0, r.stderr
    # registered readiness came from the API's registrations, not from start_seconds (30 s)
    assert time.monotonic() - t0 < 20
    st = job.status()
    assert [c["state"] for c in st["components"] if c["kind"] == "env"] == ["ready", "ready"]
    api = st["components"][0]
    assert api["name"] == "api" and api["external"] is False and api["state"] == "ready"
    assert st["queue"] == {"sequences": 3, "capacity": 8192}
    lines = [ln.split() for ln in marker.read_text().splitlines()]
    order = [name for name, _ in sorted(lines, key=lambda x: float(x[1]))]
    assert order[0] == "api" and set(order[1:]) == {"reg-0", "plain-0"}
    assert job.cli("stop").returncode == 0


def test_crash_looping_environment_degrades_the_daemon_and_fails(job: Job) -> None:
    job.write(
        **base_sections(
            job.dir,
            [
                env("steady", script("cooperative.py")),
                env("crashy", script("crashloop.py", "1"), max_restarts=1, start_seconds=0.5),
            ],
        )
    )
    r = job.cli("start")
    assert r.returncode == 0, r.stderr  # an environment that fails does not fail the start
    crashy = job.wait_state("crashy-0", "failed", timeout=20)
    assert crashy["restarts"] == 1 and crashy["last_exit"]["code"] == 1
    # the unit's failure reaches the daemon's state through its event queue: wait for it
    st = wait_for(lambda: (s := job.status())["state"] == "degraded" and s, timeout=10, what="daemon degraded")
    steady = next(c for c in st["components"] if c["name"] == "steady-0")
    assert steady["state"] == "ready" and steady["restarts"] == 0
    assert job.cli("stop").returncode == 0


def test_stop_within_stop_timeout_with_a_stubborn_child(job: Job) -> None:
    pidfile = job.dir / "stubborn.pids"
    job.write(
        **base_sections(
            job.dir,
            [env("stubborn", script("stubborn.py", str(pidfile))), env("coop", script("cooperative.py"))],
            daemon={"stop_timeout": 2.0},
        )
    )
    assert job.cli("start").returncode == 0
    child, grandchild = map(int, wait_for(lambda: pidfile.exists() and pidfile.read_text(), what="pids").split())
    wait_for(
        lambda: (
            json.loads((job.state_dir / "recovery" / "instance.json").read_text())["descendants"]
            and any(
                p == grandchild
                for p, _ in json.loads((job.state_dir / "recovery" / "instance.json").read_text())["descendants"]
            )
        ),
        what="grandchild tracked",
    )
    t0 = time.monotonic()
    r = job.cli("stop")
    stop_s = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert not _alive(child) and not _alive(grandchild)
    print(f"stubborn stop {stop_s:.2f}s")
    # The children's termination, as the daemon measured it, stays within stop_timeout; the
    # command's wall time adds two interpreter starts on a loaded machine.
    events = [
        json.loads(ln) for ln in (job.state_dir / "logs" / "daemon.log").read_text().splitlines() if ln.startswith("{")
    ]
    term = [e for e in events if e.get("event") == "terminated" and e.get("unit") == "stubborn-0"]
    assert term and term[-1]["seconds"] <= 2.0 + 0.25, term
    assert any(e.get("event") == "escalated to SIGKILL" and e.get("unit") == "stubborn-0" for e in events)
    assert stop_s < 2.0 + 6.0
    assert not (job.state_dir / "recovery" / "instance.json").exists()


def test_kill_9_of_the_daemon_then_the_next_start_cleans_up(job: Job) -> None:
    pidfile = job.dir / "stubborn.pids"
    job.write(
        **base_sections(
            job.dir, [env("stubborn", script("stubborn.py", str(pidfile))), env("coop", script("cooperative.py"))]
        )
    )
    assert job.cli("start").returncode == 0
    child, grandchild = map(int, wait_for(lambda: pidfile.exists() and pidfile.read_text(), what="pids").split())
    coop = job.component("coop-0")["pid"]
    record = job.state_dir / "recovery" / "instance.json"
    wait_for(
        lambda: any(p == grandchild for p, _ in json.loads(record.read_text())["descendants"]),
        what="grandchild recorded",
    )
    daemon = job.daemon_pid()
    assert daemon is not None
    os.kill(daemon, signal.SIGKILL)
    # the parent-death signal takes every direct child with the daemon
    wait_for(
        lambda: not _alive(child) and not _alive(coop) and not _alive(daemon), timeout=10, what="direct children gone"
    )
    assert _alive(grandchild)  # escaped in its own session: the next start must clean it up
    pidfile.unlink()
    assert job.cli("start").returncode == 0
    assert not _alive(grandchild)
    assert job.cli("stop").returncode == 0


def test_kill_9_of_the_daemon_then_the_next_start_removes_left_shared_memory(job: Job) -> None:
    """A component whose grandchild maps segments (as vLLM's EngineCore maps its psm_* queues)
    outlives the daemon's kill -9; the next start ends it and removes the segments."""
    import secrets

    tag = secrets.token_hex(4)
    a, b = f"psm_t{tag}_a", f"psm_t{tag}_b"
    marker = job.dir / "holder.ready"
    job.write(**base_sections(job.dir, [env("holder", script("shm_holder.py", "--grandchild", str(marker), a, b))]))
    try:
        assert job.cli("start").returncode == 0
        wait_for(marker.exists, what="segments mapped")
        child = int(marker.read_text())
        record = job.state_dir / "recovery" / "instance.json"
        wait_for(lambda: len(json.loads(record.read_text())["descendants"]) >= 2, what="grandchild recorded")
        daemon = job.daemon_pid()
        assert daemon is not None
        os.kill(daemon, signal.SIGKILL)
        wait_for(lambda: not _alive(child) and not _alive(daemon), timeout=10, what="daemon and child gone")
        assert os.path.exists(f"/dev/shm/{a}") and os.path.exists(f"/dev/shm/{b}")
        # the next start runs something else (the holder would map the names again)
        job.write(**base_sections(job.dir, [env("coop", script("cooperative.py"))]))
        assert job.cli("start").returncode == 0
        assert not os.path.exists(f"/dev/shm/{a}") and not os.path.exists(f"/dev/shm/{b}")
        assert job.cli("stop").returncode == 0
    finally:
        for n in (a, b):
            if os.path.exists(f"/dev/shm/{n}"):
                os.unlink(f"/dev/shm/{n}")


def test_segments_of_children_that_all_died_with_the_daemon_are_removed_at_the_next_start(job: Job) -> None:
    """Nothing of the dead daemon survives to be asked what it mapped: the recovery record
    names the segments (recorded every few seconds) and the next start removes them."""
    import secrets

    a = f"psm_t{secrets.token_hex(4)}_a"
    marker = job.dir / "holder.ready"
    job.write(**base_sections(job.dir, [env("holder", script("shm_holder.py", str(marker), a))]))
    try:
        assert job.cli("start").returncode == 0
        wait_for(marker.exists, what="segment mapped")
        child = int(marker.read_text())
        record = job.state_dir / "recovery" / "instance.json"
        wait_for(lambda: a in json.loads(record.read_text()).get("segments", []), timeout=20, what="segment recorded")
        daemon = job.daemon_pid()
        assert daemon is not None
        os.kill(daemon, signal.SIGKILL)
        wait_for(lambda: not _alive(child) and not _alive(daemon), timeout=10, what="daemon and child gone")
        assert os.path.exists(f"/dev/shm/{a}")
        job.write(**base_sections(job.dir, [env("coop", script("cooperative.py"))]))
        assert job.cli("start").returncode == 0
        assert not os.path.exists(f"/dev/shm/{a}")
        assert job.cli("stop").returncode == 0
    finally:
        if os.path.exists(f"/dev/shm/{a}"):
            os.unlink(f"/dev/shm/{a}")


def test_port_in_use_is_a_clear_error_and_nothing_is_killed(job: Job) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        job.write(
            **base_sections(
                job.dir,
                [env("worker", script("cooperative.py"))],
                api={"enabled": True, "url": "", "port": port, "command": script("fake_api.py", "{port}")},
            )
        )
        r = job.cli("start")
        assert r.returncode == 1
        assert f"port {port}" in r.stderr and "already in use" in r.stderr
        assert f"pid {os.getpid()}" in r.stderr
        holder.getsockname()  # still ours
    assert not (job.state_dir / "logs" / "worker-0.log").exists()


def test_sigterm_to_run_stops_cleanly_with_exit_0(job: Job) -> None:
    from tests.support import spawn, stop_process

    job.write(**base_sections(job.dir, [env("worker", script("cooperative.py"))]))
    proc = spawn([*__import__("sys").executable.split(), "-m", "atroposd", "run", "-c", str(job.config)])
    try:
        wait_for(
            lambda: job.cli("status", "--json").returncode == 0 and job.status()["state"] == "running", what="running"
        )
        worker = job.component("worker-0")["pid"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert not _alive(worker)
    finally:
        stop_process(proc)


@pytest.mark.slow
def test_unexpected_exit_of_an_environment_restarts_it(job: Job) -> None:
    job.write(**base_sections(job.dir, [env("worker", script("cooperative.py"))]))
    assert job.cli("start").returncode == 0
    first = job.component("worker-0")["pid"]
    os.kill(first, signal.SIGKILL)
    c = wait_for(
        lambda: (c := job.component("worker-0"))["state"] == "ready" and c["pid"] != first and c, what="restarted"
    )
    assert c["restarts"] == 1 and c["last_exit"]["signal"] == "SIGKILL"
    assert job.cli("stop").returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["daemon"])
def test_logs_of_the_daemon(job: Job, name: str) -> None:
    job.write(**base_sections(job.dir, [env("worker", script("cooperative.py"))]))
    assert job.cli("start").returncode == 0
    r = job.cli("logs", name, "-n", "500")
    assert r.returncode == 0 and "READY" in r.stdout
    assert job.cli("logs", "nope").returncode == 2
    assert job.cli("stop").returncode == 0
    assert "daemon exits" in Path(job.state_dir / "logs" / "daemon.log").read_text()


@pytest.mark.slow
def test_logs_follow_across_rotation_until_the_daemon_stops(job: Job) -> None:
    import subprocess
    import sys

    from tests.support import REPO

    job.write(
        **base_sections(
            job.dir, [env("ticker", script("ticker.py", "0.05"))], daemon={"log_max_bytes": 4096, "log_backups": 3}
        )
    )
    assert job.cli("start").returncode == 0
    follower = subprocess.Popen(
        [sys.executable, "-m", "atroposd", "logs", "ticker-0", "-f", "-n", "0", "-c", str(job.config)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert follower.stdout is not None
        first = follower.stdout.readline()  # following has begun
        assert first.startswith("tick ")
        log = job.state_dir / "logs" / "ticker-0.log"

        def last_tick() -> int:
            return max(int(ln.split()[1]) for ln in log.read_text().splitlines() if ln.startswith("tick "))

        # ~20 lines fill a 4096-byte file: 45 more lines is at least two rotations
        wait_for(lambda: last_tick() > int(first.split()[1]) + 45, timeout=30, what="two rotations")
        assert job.cli("stop").returncode == 0
        follower.wait(30)  # it ends when the daemon is gone (what it printed fits the pipe)
        out = first + follower.stdout.read()  # the text buffer, not the raw pipe: readline() filled it
        assert follower.returncode == 0
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
        if follower.stdout is not None:
            follower.stdout.close()
    ticks = [int(line.split()[1]) for line in out.splitlines() if line.startswith("tick ")]
    assert len(ticks) > 45
    assert ticks == list(range(ticks[0], ticks[0] + len(ticks))), "lines lost or repeated across rotation"


def test_api_token_from_a_file_reaches_the_api_and_the_daemons_own_requests(job: Job) -> None:
    token_file = job.dir / "api.token"
    token_file.write_text("s3cret-from-file\n")
    port = free_port()
    job.write(
        **base_sections(
            job.dir,
            [env("worker", script("cooperative.py"))],
            api={"enabled": True, "url": "", "port": port, "token_file": str(token_file)},
        )
    )
    r = job.cli("start")
    assert r.returncode == 0, r.stderr  # the API's readiness probe sent the token it requires
    st = job.status()
    api = st["components"][0]
    assert api["name"] == "api" and api["state"] == "ready"
    assert "s3cret-from-file" not in " ".join(psutil.Process(api["pid"]).cmdline())  # never in ps
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/info", timeout=5)
    assert refused.value.code == 401
    refused.value.close()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/info", headers={"Authorization": "Bearer s3cret-from-file"})
    with urllib.request.urlopen(req, timeout=5) as ok:
        assert ok.status == 200
    assert job.cli("stop").returncode == 0


def test_an_unreadable_api_token_file_fails_the_start_naming_it(job: Job) -> None:
    job.write(
        **base_sections(
            job.dir,
            [],
            api={"enabled": True, "url": "", "port": free_port(), "token_file": str(job.dir / "missing.token")},
        )
    )
    r = job.cli("run", timeout=60)
    assert r.returncode == 1
    assert "api.token_file" in r.stdout + r.stderr

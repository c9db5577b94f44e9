"""sd_notify against a real datagram socket: READY, STATUS, WATCHDOG, STOPPING; no leak of
NOTIFY_SOCKET to children; the unit file's required settings."""

from __future__ import annotations

import configparser
import os
import signal
import socket
import sys
import time
from pathlib import Path

import psutil
import pytest

from atroposd.systemd import Notifier
from tests.daemon.conftest import Job, base_sections, env, script
from tests.support import REPO, spawn, stop_process, wait_for


class Listener:
    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path if not path.startswith("@") else "\0" + path[1:])
        self.sock.settimeout(0.1)
        self.messages: list[str] = []

    def poll(self) -> list[str]:
        try:
            while True:
                self.messages.append(self.sock.recv(65536).decode())
        except (TimeoutError, BlockingIOError):
            pass
        return self.messages

    def lines(self) -> list[str]:
        return [ln for m in self.poll() for ln in m.splitlines()]

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("abstract", [False, True])
def test_notifier_sends_and_strips_the_environment(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch, abstract: bool
) -> None:
    path = f"@atroposd-test-{os.getpid()}" if abstract else str(short_tmp / "notify")
    listener = Listener(path)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        monkeypatch.setenv("WATCHDOG_USEC", "2000000")
        monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
        n = Notifier.from_environment()
        assert "NOTIFY_SOCKET" not in os.environ and "WATCHDOG_USEC" not in os.environ
        assert n.watchdog_usec == 2_000_000
        assert n.ready("up") and n.status("step 3") and n.extend_timeout(1.5) and n.stopping()
        msgs = wait_for(lambda: len(listener.poll()) >= 4 and listener.messages, what="4 datagrams")
        assert msgs[:4] == ["READY=1\nSTATUS=up", "STATUS=step 3", "EXTEND_TIMEOUT_USEC=1500000", "STOPPING=1"]
    finally:
        listener.close()


def test_notifier_without_a_socket_or_with_a_gone_one_never_raises(short_tmp: Path) -> None:
    assert not Notifier().ready()
    n = Notifier(address=str(short_tmp / "missing"))
    assert not n.ready() and n.failures == 1


def test_watchdog_for_another_pid_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert Notifier.from_environment().watchdog_usec == 0


def test_daemon_speaks_sd_notify_and_children_do_not_inherit_it(job: Job) -> None:
    job.write(**base_sections(job.dir, [env("worker", script("cooperative.py"))]))
    notify = str(job.dir / "notify")
    listener = Listener(notify)
    proc = spawn(
        [sys.executable, "-m", "atroposd", "run", "-c", str(job.config)],
        env={"NOTIFY_SOCKET": notify, "WATCHDOG_USEC": "300000"},
    )
    try:
        wait_for(lambda: "READY=1" in listener.lines(), timeout=30, what="READY=1")
        assert any(ln.startswith("STATUS=") for ln in listener.lines())
        assert any(ln.startswith("EXTEND_TIMEOUT_USEC=") for ln in listener.lines())
        n = listener.lines().count("WATCHDOG=1")
        wait_for(lambda: listener.lines().count("WATCHDOG=1") >= n + 2, timeout=5, what="watchdog pings")
        worker = job.component("worker-0")["pid"]
        environ = psutil.Process(worker).environ()
        for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            assert var not in environ
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert time.monotonic() - t0 < 5
        assert "STOPPING=1" in listener.lines()
    finally:
        stop_process(proc)
        listener.close()


def test_unit_file_has_the_required_settings() -> None:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(REPO / "systemd" / "atroposd.service")
    svc, unit = parser["Service"], parser["Unit"]
    assert svc["Type"] == "notify" and svc["NotifyAccess"] == "main" and svc["KillMode"] == "mixed"
    assert svc["Restart"] == "on-failure" and svc["RestartSec"] == "5"
    assert set(svc["RestartPreventExitStatus"].split()) == {"2", "4", "6"}  # 6: collapsed past max_rollbacks
    assert svc["RuntimeDirectoryPreserve"] == "restart" and svc["RuntimeDirectory"] and svc["StateDirectory"]
    assert int(svc["WatchdogSec"].rstrip("s")) > 0
    # TimeoutStopSec above checkpoint_timeout + stop_timeout (defaults 120 + 30)
    assert int(svc["TimeoutStopSec"].rstrip("s")) > 150
    assert "StartLimitBurst" in unit and "StartLimitIntervalSec" in unit
    assert "atroposd run" in svc["ExecStart"]


@pytest.mark.slow
def test_a_notify_socket_nobody_reads_never_blocks_the_daemon(job: Job) -> None:
    """Regression: a full datagram queue once blocked the event loop (SIGTERM went unanswered)."""
    job.write(**base_sections(job.dir, [env("worker", script("cooperative.py"), replicas=12)]))
    notify = str(job.dir / "notify")
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(notify)  # bound, never read
    # watchdog pings every 10 ms fill the unread queue at once
    proc = spawn(
        [sys.executable, "-m", "atroposd", "run", "-c", str(job.config)],
        env={"NOTIFY_SOCKET": notify, "WATCHDOG_USEC": "20000"},
    )
    try:
        wait_for(
            lambda: job.cli("status", "--json").returncode == 0 and job.status()["state"] == "running",
            timeout=30,
            what="running",
        )
        for _ in range(3):
            assert job.cli("status").returncode == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        stop_process(proc)
        sink.close()

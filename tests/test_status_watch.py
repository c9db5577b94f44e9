"""``atroposd status --watch`` and ``logs -f`` against a real control socket served by a stand-in daemon."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from atroposd.control import decode_length, encode
from tests.support import wait_for, write_config

STATUS: dict[str, Any] = {
    "state": "running",
    "pid": 4242,
    "uptime_s": 3.0,
    "config": "/x.toml",
    "components": [],
    "trainer": None,
    "queue": None,
}


class StandIn:
    """Answers any request (with a status) on a Unix socket ``answers`` times, then closes the next
    ``resets`` connections without reading them (as a daemon on its way out does), then stops listening."""

    def __init__(self, path: Path, answers: int, resets: int = 0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.path = path
        self.answers = answers
        self.resets = resets
        self.served = 0
        self.reset = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.served < self.answers:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed by the test
                return
            with conn:
                header = conn.recv(4, socket.MSG_WAITALL)
                conn.recv(decode_length(header), socket.MSG_WAITALL)
                self.served += 1
                conn.sendall(encode({"ok": True, "status": {**STATUS, "uptime_s": float(self.served)}}))
        while self.reset < self.resets:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            wait_for(lambda c=conn: _pending(c), timeout=5, what="a request")
            conn.close()  # unread: the client's read fails with ECONNRESET
            self.reset += 1
        self.close()

    def close(self) -> None:
        self.sock.close()
        if self.path.exists():
            self.path.unlink()


def _pending(conn: socket.socket) -> bool:
    try:
        return len(conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)) > 0
    except BlockingIOError:
        return False


def _config(tmp_path: Path) -> tuple[Path, Path]:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    cfg = write_config(
        tmp_path / "atroposd.toml", {"daemon": {"runtime_dir": str(run), "state_dir": str(tmp_path / "state")}}
    )
    return cfg, run / "control.sock"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "atroposd", *args]


def test_watch_redraws_until_the_daemon_is_gone(tmp_path: Path) -> None:
    cfg, sock = _config(tmp_path)
    standin = StandIn(sock, answers=3)
    res = subprocess.run(
        _cli("status", "--watch", "--json", "-c", str(cfg)),
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    standin.thread.join(5)
    assert res.returncode == 3, res.stderr  # the daemon went away: "not running"
    lines = [line for line in res.stdout.splitlines() if line]
    assert len(lines) == 3 and '"uptime_s": 3.0' in lines[-1]


def test_watch_ends_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    cfg, sock = _config(tmp_path)
    standin = StandIn(sock, answers=1000)
    proc = subprocess.Popen(
        _cli("status", "--watch", "-c", str(cfg)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        # the third request follows the second redraw (an answer served is not yet drawn)
        wait_for(lambda: standin.served >= 3, timeout=20, what="two redraws")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        standin.answers = 0
        standin.close()
    assert proc.returncode == 0, err
    assert out.count("atroposd running") >= 2 and "Ctrl-C to stop" in out
    assert "Traceback" not in err


def test_logs_follow_outlasts_a_daemon_resetting_its_connections_while_it_stops(tmp_path: Path) -> None:
    cfg, sock = _config(tmp_path)
    log = tmp_path / "state" / "logs" / "ticker-0.log"
    log.parent.mkdir(parents=True)
    log.write_text("tick 1\n")
    standin = StandIn(sock, answers=2, resets=2)  # the first check, one ping, then two resets, then gone
    proc = subprocess.Popen(
        _cli("logs", "ticker-0", "-f", "-n", "5", "-c", str(cfg)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "tick 1\n"
        with log.open("a") as fh:
            fh.write("tick 2\n")
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        standin.answers = standin.resets = 0
        standin.close()
    assert standin.reset == 2  # both resets were met, and following went on past them
    assert proc.returncode == 0, err
    assert out == "tick 2\n" and "Traceback" not in err


def test_logs_follow_goes_on_from_where_the_lines_shown_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a line appended between the last lines shown and the following is shown once, not lost
    from atroposd import commands
    from atroposd.config import load_config
    from atroposd.process.logfiles import tail

    cfg_path, _ = _config(tmp_path)
    log = tmp_path / "ticker.log"
    log.write_text("tick 1\ntick 2\n")
    assert tail(log, max_lines=5, end=len("tick 1\n")) == "tick 1"  # only what lies before ``end``
    assert tail(log, max_lines=5) == "tick 1\ntick 2"
    monkeypatch.setattr(commands, "_ping", lambda cfg: None)  # the daemon is gone: drain once and end
    assert commands._follow(load_config(cfg_path), log, len("tick 1\n")) == 0
    assert capsys.readouterr().out == "tick 2\n"

"""``atroposd status --watch`` against a real control socket served by a stand-in daemon."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from atroposd.control import decode_length, encode
from tests.support import wait_for, write_config

STATUS: dict[str, Any] = {"state": "running", "pid": 4242, "uptime_s": 3.0, "config": "/x.toml",
                          "components": [], "trainer": None, "queue": None}


class StandIn:
    """Answers ``status`` on a Unix socket ``answers`` times, then stops listening."""

    def __init__(self, path: Path, answers: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        self.path = path
        self.answers = answers
        self.served = 0
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
        self.close()

    def close(self) -> None:
        self.sock.close()
        if self.path.exists():
            self.path.unlink()


def _config(tmp_path: Path) -> tuple[Path, Path]:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    cfg = write_config(tmp_path / "atroposd.toml", {"daemon": {"runtime_dir": str(run),
                                                               "state_dir": str(tmp_path / "state")}})
    return cfg, run / "control.sock"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "atroposd", *args]


def test_watch_redraws_until_the_daemon_is_gone(tmp_path: Path) -> None:
    cfg, sock = _config(tmp_path)
    standin = StandIn(sock, answers=3)
    res = subprocess.run(_cli("status", "--watch", "--json", "-c", str(cfg)), capture_output=True, text=True,
                         timeout=30, env={**os.environ, "PYTHONPATH": os.getcwd()})
    standin.thread.join(5)
    assert res.returncode == 3, res.stderr  # the daemon went away: "not running"
    lines = [line for line in res.stdout.splitlines() if line]
    assert len(lines) == 3 and '"uptime_s": 3.0' in lines[-1]


def test_watch_ends_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    cfg, sock = _config(tmp_path)
    standin = StandIn(sock, answers=1000)
    proc = subprocess.Popen(_cli("status", "--watch", "-c", str(cfg)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        wait_for(lambda: standin.served >= 2, timeout=20, what="two redraws")
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

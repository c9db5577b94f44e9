"""Progress on a terminal: the lines of ``start`` and ``run``, the live line kept below the log,
and (slow) both commands on a real pseudo-terminal; off a terminal nothing changes."""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from atroposd.commands import _Tee
from atroposd.progress import ERASE, fit, run_line, start_line


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _status(**trainer: Any) -> dict[str, Any]:
    return {
        "state": "starting",
        "uptime_s": 12.0,
        "components": [
            {"name": "api", "state": "ready", "since_s": 3.0},
            {"name": "inference", "state": "starting", "since_s": 42.5},
        ],
        "trainer": trainer or None,
    }


def test_start_line_names_what_it_waits_for() -> None:
    assert start_line(None, 2.2) == "atroposd: starting the daemon… 2s"
    line = start_line(_status(), 65)
    assert "1/2 components ready" in line and "waiting for inference (starting, 42s)" in line and "1m05s" in line


def test_run_line() -> None:
    st = _status(state="training", step=30, total_steps=100, steps_per_s=2.0, reward_mean=0.4567, accuracy=0.25)
    line = run_line(st)
    assert line.startswith("step 30/100 [######..............]")
    assert "2.00 steps/s" in line and "reward 0.457" in line and "accuracy 0.250" in line and "left 35s" in line
    assert "waiting for inference" in run_line(
        _status(state="waiting", step=0, total_steps=100, waiting_for="inference")
    )
    assert fit("x" * 200, 40).endswith("…") and len(fit("x" * 200, 40)) == 39


def test_the_live_line_stays_below_the_log(tmp_path: Path) -> None:
    term = Terminal()
    tee = _Tee(term, tmp_path / "daemon.log", max_bytes=1 << 20, backups=1)
    tee.write("first\n")
    tee.set_footer("step 1/10")
    tee.write("second")  # a log line written in two parts (print's text, then its newline)
    tee.set_footer("step 2/10")  # mid-line: not drawn into the log line
    tee.write("\n")
    tee.set_footer("")
    tee._file.close()
    assert term.getvalue() == f"first\n{ERASE}step 1/10{ERASE}second\nstep 2/10{ERASE}"
    assert (tmp_path / "daemon.log").read_text() == "first\nsecond\n"  # the file never has the line


def test_off_a_terminal_the_log_is_unchanged(tmp_path: Path) -> None:
    out = io.StringIO()
    tee = _Tee(out, tmp_path / "daemon.log", max_bytes=1 << 20, backups=1)
    tee.write("a\n")
    tee.write("b\n")
    tee._file.close()
    assert out.getvalue() == "a\nb\n"


def _on_a_pty(argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run ``argv`` with stdout and stderr on a pseudo-terminal; its exit code and output."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)
        os.close(master)
    return code, b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_start_and_run_on_a_terminal(short_tmp: Path) -> None:
    from tests.e2e.jobs import daemon_env, job_config
    from tests.support import atroposd

    env = {**os.environ, **daemon_env(), "PYTHONPATH": os.getcwd(), "COLUMNS": "160"}
    cfg = job_config(short_tmp, steps=100_000)
    code, out = _on_a_pty([sys.executable, "-m", "atroposd", "start", "-c", str(cfg)], env, 240)
    try:
        assert code == 0, out
        assert re.search(r"waiting for (inference|api|arithmetic-0|the trainer)", out), out
        assert "atroposd: ready" in out
    finally:
        assert atroposd("stop", "-c", str(cfg), timeout=120).returncode == 0

    cfg = job_config(short_tmp / "run", steps=12)
    code, out = _on_a_pty([sys.executable, "-m", "atroposd", "run", "-c", str(cfg)], env, 240)
    assert code == 0, out[-3000:]
    assert re.search(r"step \d+/12 \[[#.]{20}\]", out), out[-3000:]
    # the per-step log lines give way to the live line: step lines only every 10 steps
    assert len(re.findall(r"\bstep\b.*\bof=12\b", out)) <= 3


def test_waiting_for_the_trainer_ranks_reads_as_words() -> None:
    st = _status(state="waiting", step=4, total_steps=100, waiting_for="ranks")
    assert "(waiting for the trainer ranks to form the group)" in run_line(st)

"""torch's own /dev/shm files (its CUDA IPC reference counters, named ``torch_<pid>_<random>_<n>``
after the process that made them) that a dead job's processes left are removed at the next
start — those of this job's dead processes only: not another process's, not a live one's, not
one a live process still maps."""

from __future__ import annotations

import mmap
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from atroposd.pids import start_ticks
from atroposd.process import reaper
from atroposd.shmscan import SHM_DIR, torch_segments_of


def _dead() -> tuple[int, int]:
    """The pid and start ticks of a real process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    ticks = start_ticks(proc.pid)
    assert ticks is not None
    proc.communicate(b"")
    return proc.pid, ticks


@pytest.fixture
def made() -> Iterator[list[str]]:
    names: list[str] = []
    try:
        yield names
    finally:
        for name in names:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass


def _torch_file(made: list[str], pid: int) -> str:
    """A file named as torch names its reference-counter files, 0600, of this user."""
    name = f"torch_{pid}_{secrets.randbelow(2**31)}_{len(made)}"
    fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)
    made.append(name)
    return name


def test_recovery_removes_the_torch_files_of_this_jobs_dead_processes_only(tmp_path: Path, made: list[str]) -> None:
    daemon_pid, daemon_ticks = _dead()
    child_pid, child_ticks = _dead()
    stranger_pid, _ = _dead()  # dead too, but never this job's
    me = start_ticks(os.getpid())
    assert me is not None
    time.sleep(0.05)  # the files are made after the dead daemon started, on any clock
    daemon_file = _torch_file(made, daemon_pid)
    child_file = _torch_file(made, child_pid)
    child_mapped = _torch_file(made, child_pid)  # a live process maps it still
    stranger_file = _torch_file(made, stranger_pid)
    other_torch = f"torch_{child_pid}_notours"  # not torch's pattern
    fd = os.open(os.path.join(SHM_DIR, other_torch), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    made.append(other_torch)
    live_pid = os.getppid()  # alive, recorded with another start: a pid held by another process now
    live_file = _torch_file(made, live_pid)
    assert torch_segments_of([daemon_pid, child_pid]) == sorted([daemon_file, child_file, child_mapped])
    record = reaper.InstanceRecord(
        "t0rchsegs", daemon_pid, daemon_ticks, [(child_pid, child_ticks), (live_pid, (start_ticks(live_pid) or 0) + 7)]
    )
    path = tmp_path / "instance.json"
    reaper.write_record(path, record)
    with open(os.path.join(SHM_DIR, child_mapped), "r+b") as f, mmap.mmap(f.fileno(), 4096) as held:
        assert reaper.recover_dead_instance(path) is not None
        assert held[0] == 0
    left = set(os.listdir(SHM_DIR))
    assert daemon_file not in left and child_file not in left
    assert {child_mapped, stranger_file, other_torch, live_file} <= left


def test_a_dead_jobs_torch_file_made_before_the_job_started_is_left(tmp_path: Path, made: list[str]) -> None:
    """Only what was made since the dead daemon started (a pid reused since is not the job's)."""
    child_pid, child_ticks = _dead()
    old = _torch_file(made, child_pid)
    time.sleep(0.3)  # well past the slack between a file's ctime and a start in clock ticks
    daemon_pid, daemon_ticks = _dead()  # started after the file was made
    reaper.write_record(
        tmp_path / "instance.json",
        reaper.InstanceRecord("t0rchold", daemon_pid, daemon_ticks, [(child_pid, child_ticks)]),
    )
    reaper.recover_dead_instance(tmp_path / "instance.json")
    assert os.path.exists(os.path.join(SHM_DIR, old))

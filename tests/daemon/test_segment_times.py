"""Which left-over ``/dev/shm`` segments recovery removes is decided on boot-relative times
(SPEC §13: clock steps do not matter): the dead daemon's start comes from its start ticks and
this boot's id, put on the wall clock only at the check."""

from __future__ import annotations

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
from atroposd.shmscan import SHM_DIR, boot_seconds, unlink_orphaned_segments


@pytest.fixture
def dead_daemon() -> tuple[int, int]:
    """The pid and start ticks of a process that has exited (a daemon that died)."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    ticks = start_ticks(proc.pid)
    assert ticks is not None
    proc.communicate(b"")
    time.sleep(0.05)  # a segment created after it started, on any clock
    return proc.pid, ticks


@pytest.fixture
def segment() -> Iterator[str]:
    name = f"apd-test-{secrets.token_hex(6)}"
    os.close(os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    try:
        yield name
    finally:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


def _recover(tmp_path: Path, pid: int, ticks: int, segment: str, **fields: object) -> list[str]:
    record = reaper.InstanceRecord("n0nce", pid, ticks, [], [segment], **fields)  # type: ignore[arg-type]
    path = tmp_path / "instance.json"
    reaper.write_record(path, record)
    reaper.recover_dead_instance(path)
    return [n for n in [segment] if not os.path.exists(os.path.join(SHM_DIR, n))]


def test_a_clock_stepped_back_since_the_dead_daemon_started_does_not_keep_its_segments(
    tmp_path: Path, dead_daemon: tuple[int, int], segment: str
) -> None:
    """The wall clock read an hour later when the daemon started than now (stepped back since):
    its segment still counts as created after that start, and is removed."""
    pid, ticks = dead_daemon
    assert _recover(tmp_path, pid, ticks, segment, started_at=time.time() + 3600) == [segment]


def test_a_record_of_an_earlier_boot_removes_nothing(
    tmp_path: Path, dead_daemon: tuple[int, int], segment: str
) -> None:
    pid, ticks = dead_daemon
    assert _recover(tmp_path, pid, ticks, segment, started_at=0.0, boot_id="another-boot") == []


def test_an_older_record_without_boot_id_keeps_its_wall_clock_start(
    tmp_path: Path, dead_daemon: tuple[int, int], segment: str
) -> None:
    pid, ticks = dead_daemon
    assert _recover(tmp_path, pid, ticks, segment, started_at=time.time() + 3600, boot_id=None) == []
    assert _recover(tmp_path, pid, ticks, segment, started_at=time.time() - 3600, boot_id=None) == [segment]


def test_a_start_since_boot_is_put_on_the_wall_clock_at_the_check(segment: str) -> None:
    assert unlink_orphaned_segments([segment], since_boot=boot_seconds() + 60) == []  # created before
    assert unlink_orphaned_segments([segment], since_boot=boot_seconds() - 60) == [segment]

"""Crash recovery: what a dead daemon left is found by record or by nonce, and only that."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

from atroposd.process import reaper
from tests.support import stop_process, wait_for


def _sleeper(nonce: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, reaper.INSTANCE_VAR: nonce},
        start_new_session=True,
    )


def _dead_daemon() -> tuple[int, float]:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    start = psutil.Process(proc.pid).create_time()
    proc.wait()
    return proc.pid, start


def test_survivors_of_a_dead_daemon_are_terminated_and_others_spared(tmp_path: Path) -> None:
    pid, start = _dead_daemon()
    recorded, unrecorded, other = _sleeper("deadbeef0001"), _sleeper("deadbeef0001"), _sleeper("aliveaaa0002")
    try:
        wait_for(
            lambda: all(
                psutil.Process(p.pid).environ().get(reaper.INSTANCE_VAR) for p in (recorded, unrecorded, other)
            ),
            what="children running",
        )
        rec_start = psutil.Process(recorded.pid).create_time()
        path = tmp_path / "instance.json"
        reaper.write_record(path, reaper.InstanceRecord("deadbeef0001", pid, start - 1.0, [(recorded.pid, rec_start)]))
        record = reaper.recover_dead_instance(path, grace=2.0)
        assert record is not None and record.nonce == "deadbeef0001"
        assert recorded.wait(5) is not None and unrecorded.wait(5) is not None
        assert other.poll() is None  # another launch's process is never touched
    finally:
        for p in (recorded, unrecorded, other):
            stop_process(p)


def test_a_live_daemon_record_is_left_alone(tmp_path: Path) -> None:
    me = psutil.Process()
    child = _sleeper("liveaaaa0003")
    try:
        path = tmp_path / "instance.json"
        reaper.write_record(
            path,
            reaper.InstanceRecord(
                "liveaaaa0003", me.pid, me.create_time(), [(child.pid, psutil.Process(child.pid).create_time())]
            ),
        )
        assert reaper.recover_dead_instance(path) is None
        assert child.poll() is None
    finally:
        stop_process(child)


def test_a_recycled_pid_is_not_mistaken_for_a_descendant(tmp_path: Path) -> None:
    child = _sleeper("otheraaa0004")
    try:
        pid, start = _dead_daemon()
        path = tmp_path / "instance.json"
        # the record names the pid with another start time: a different process
        reaper.write_record(
            path,
            reaper.InstanceRecord(
                "deadbeef0005", pid, start, [(child.pid, psutil.Process(child.pid).create_time() - 5)]
            ),
        )
        reaper.recover_dead_instance(path)
        assert child.poll() is None
    finally:
        stop_process(child)


def test_unreadable_record_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "instance.json"
    path.write_text("{not json")
    assert reaper.recover_dead_instance(path) is None

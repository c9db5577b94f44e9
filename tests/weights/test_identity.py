"""Process identity by boot-relative start time (atroposd.pids): exact, and unmoved by a step
of the wall clock; the weight manifest records the exporter that way."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from atroposd import pids


def _stat_starttime(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def test_start_ticks_are_the_kernels_starttime() -> None:
    me = pids.start_ticks(os.getpid())
    assert me == _stat_starttime(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        ticks = pids.start_ticks(child.pid)
        assert ticks is not None and me is not None and ticks >= me
        assert pids.same_process(child.pid, ticks) is not None
        assert pids.same_process(child.pid, ticks + 1) is None  # exact: one tick off is another process
        assert pids.same_process(child.pid, ticks - 1) is None
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(30)
    assert pids.start_ticks(child.pid) is None
    assert pids.same_process(child.pid, ticks) is None


def test_a_wall_clock_step_does_not_change_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a clock step psutil's create_time (boot time re-derived from the wall clock) moves;
    the recorded ticks still name the process."""
    ticks = pids.start_ticks(os.getpid())
    assert ticks is not None
    real = psutil.Process.create_time
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: real(self) + 3600.0)
    assert pids.same_process(os.getpid(), ticks) is not None


def test_manifest_records_the_exporter_in_ticks() -> None:
    from atroposd.weights.manifest import (
        Manifest,
        ManifestError,
        exporter_alive,
        process_start_time,
    )

    start = process_start_time(os.getpid())
    assert isinstance(start, int) and exporter_alive(os.getpid(), start)
    m = Manifest(
        nonce="abcd",
        exporter_pid=os.getpid(),
        exporter_start_time=start,
        export_id=1,
        weight_version=0,
        transport="shm",
        segments=(),
        tensors=(),
    )
    assert Manifest.from_json(m.to_json()).exporter_start_time == start
    raw = m.to_json().replace(b'"exporter_start_time":%d' % start, b'"exporter_start_time":1.5')
    with pytest.raises(ManifestError, match="exporter_start_time must be an integer"):
        Manifest.from_json(raw)

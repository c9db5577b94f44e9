"""Process identity: a pid together with its start time, so that a recycled pid is never taken
for the process it once named. Used by the supervisor (``process.reaper``), the API (which
environment registered from which process) and the weight manifests (is the exporter alive).

The start time to record is :func:`start_ticks`: the kernel's ``starttime`` (field 22 of
``/proc/<pid>/stat``), in clock ticks since boot. It never changes for a process and no clock
step (NTP, a VM resumed) moves it, so identities compare exactly. A float start time is the
older, wall-clock form (psutil's ``create_time``, derived from the boot time the kernel
re-derives from the wall clock); records that still hold one are compared as before, with
:data:`TIME_SLACK`.
"""

from __future__ import annotations

import psutil

__all__ = ["TIME_SLACK", "Start", "identity", "is_alive", "same_process", "start_ticks"]

# Wall-clock start times (the legacy float form): two reads of one process agree far better.
TIME_SLACK = 0.05

# A recorded start: int = clock ticks since boot (exact); float = legacy wall-clock seconds.
Start = int | float

_STARTTIME_FIELD = 22


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (None when it does not exist)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # Field 2 (comm) is parenthesised and may hold spaces or ')': fields 3.. follow the last ')'.
    end = data.rfind(b")")
    if end < 0:  # pragma: no cover - not a procfs stat line
        return None
    rest = data[end + 1 :].split()
    try:
        return int(rest[_STARTTIME_FIELD - 3])
    except (IndexError, ValueError):  # pragma: no cover - not a procfs stat line
        return None


def identity(pid: int) -> psutil.Process | None:
    """A handle on ``pid`` that remembers its start time (None if it is gone)."""
    try:
        proc = psutil.Process(pid)
        proc.create_time()
        return proc
    except psutil.Error:
        return None


def is_alive(proc: psutil.Process) -> bool:
    """Running, not a zombie, and still the same process (start time)."""
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def same_process(pid: int, start: Start) -> psutil.Process | None:
    """The live process ``pid`` if it started at ``start``, else None.

    ``start`` from :func:`start_ticks` (an int) must match exactly; a float (a wall-clock
    ``create_time``, the older form) within :data:`TIME_SLACK`.
    """
    if isinstance(start, int) and not isinstance(start, bool):
        if start_ticks(pid) != start:
            return None
        proc = identity(pid)
        try:
            if proc is None or proc.status() == psutil.STATUS_ZOMBIE or start_ticks(pid) != start:
                return None
        except psutil.Error:
            return None
        return proc
    proc = identity(pid)
    if proc is None or abs(proc.create_time() - start) > TIME_SLACK or not is_alive(proc):
        return None
    return proc

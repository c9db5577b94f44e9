"""Process identity: a pid together with its start time, so that a recycled pid is never taken
for the process it once named. Used by the supervisor (``process.reaper``), the API (which
environment registered from which process) and the weight manifests (is the exporter alive).
"""

from __future__ import annotations

import psutil

__all__ = ["TIME_SLACK", "identity", "is_alive", "same_process"]

# Start times from psutil are floats from /proc; two reads of one process agree far better.
TIME_SLACK = 0.05


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
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def same_process(pid: int, start_time: float) -> psutil.Process | None:
    """The live process ``pid`` if it started at ``start_time``, else None."""
    proc = identity(pid)
    if proc is None or abs(proc.create_time() - start_time) > TIME_SLACK or not is_alive(proc):
        return None
    return proc

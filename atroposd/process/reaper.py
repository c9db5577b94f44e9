"""Process identity, the child subreaper, descendant tracking and crash recovery.

The daemon signals only processes it started: each is held as a ``psutil.Process``, whose
``send_signal`` checks the pid *and* its start time, so a recycled pid is never hit.

Reaping has one owner per process: the event loop's child watcher waits for every child the
daemon spawned; :class:`OrphanReaper` reaps only orphans the kernel re-parented to the daemon
(it is a child subreaper), so no exit status is stolen.

Crash recovery: the daemon records its nonce, pid, start time and every child's descendants in
``state_dir/recovery/instance.json``.  The next start terminates whatever of a dead daemon
survived (pid and start time checked, or carrying the dead daemon's ``ATROPOSD_INSTANCE``).

Shared memory that children leave: a child killed before its own cleanup (vLLM's engine keeps
its message queues in ``/dev/shm/psm_*`` segments of a few hundred MB) leaves segments behind
that hold RAM until the machine reboots. Before a component's processes are stopped, the
segments they map are noted (``/proc/<pid>/maps``); once they are gone, every noted segment
that no live process maps any more and that was created since the component started is
unlinked (the scan lives in :mod:`atroposd.shmscan`). Recovery does the same for the
processes a dead daemon left.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil

from atroposd.fsutil import write_atomic
from atroposd.logs import get_logger
from atroposd.pids import TIME_SLACK, Start, is_alive, same_process, start_ticks
from atroposd.shmscan import OWN_SEGMENT_PREFIX as OWN_SEGMENT_PREFIX  # re-exported for the daemon
from atroposd.shmscan import boot_id, mapped_shm, torch_segments_of, unlink_orphaned_segments, wall_of_boot

log = get_logger("atroposd.reaper")

PR_SET_CHILD_SUBREAPER = 36
_CLK_TCK = os.sysconf("SC_CLK_TCK")  # the unit of /proc/<pid>/stat's start times
INSTANCE_VAR = "ATROPOSD_INSTANCE"


def set_child_subreaper() -> bool:
    """Make orphans of our descendants re-parent to this process instead of init."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("subreaper unavailable", error=os.strerror(ctypes.get_errno()))
        return False
    return True


def descendants(pid: int) -> list[psutil.Process]:
    try:
        children: list[psutil.Process] = psutil.Process(pid).children(recursive=True)
        return children
    except psutil.Error:
        return []


def descendant_map(roots: Iterable[int]) -> dict[int, list[psutil.Process]]:
    """Every live descendant of each root, from one pass over the process table.

    One scan serves every unit (``children(recursive=True)`` would read the whole table once
    per unit, every 0.5 s).
    """
    children: dict[int, list[psutil.Process]] = {}
    for proc in psutil.process_iter(["ppid"]):
        ppid = proc.info.get("ppid")
        if ppid:
            children.setdefault(ppid, []).append(proc)
    out: dict[int, list[psutil.Process]] = {}
    for root in roots:
        found: list[psutil.Process] = []
        stack = list(children.get(root, []))
        while stack:
            proc = stack.pop()
            found.append(proc)
            stack.extend(children.get(proc.pid, []))
        out[root] = found
    return out


def signal_all(procs: Iterable[psutil.Process], sig: int) -> int:
    """Send ``sig`` to each live process (identity checked by psutil); returns how many got it."""
    sent = 0
    for proc in procs:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            proc.send_signal(sig)
            sent += 1
        except psutil.Error:
            continue
    return sent


def signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


class OrphanReaper:
    """Reaps processes re-parented to the daemon, never a child someone else waits for.

    ``waitid(P_ALL, WEXITED | WNOHANG | WNOWAIT)`` tells whether any child has exited without
    consuming its status; then each zombie child is reaped only if the daemon did not spawn it
    (``own(pid)`` false) — adopted descendants the tracker saw at once, unknown ones only once
    they have stayed zombies over two passes (an in-process waiter would have reaped them).
    """

    def __init__(self) -> None:
        self._seen_unknown: set[int] = set()
        self.reaped = 0

    def reap(self, *, own: set[int], adopted: set[int]) -> list[tuple[int, int]]:
        try:
            peek = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            self._seen_unknown.clear()
            return []
        if peek is None:
            return []
        out: list[tuple[int, int]] = []
        unknown_now: set[int] = set()
        for child in psutil.Process().children():
            try:
                if child.status() != psutil.STATUS_ZOMBIE or child.pid in own:
                    continue
            except psutil.Error:
                continue
            if child.pid not in adopted and child.pid not in self._seen_unknown:
                unknown_now.add(child.pid)
                continue
            try:
                pid, status = os.waitpid(child.pid, os.WNOHANG)
            except ChildProcessError:
                continue
            if pid:
                out.append((pid, status))
                self.reaped += 1
        self._seen_unknown = unknown_now
        return out


# --------------------------------------------------------------------------- recovery record


@dataclass
class InstanceRecord:
    """What the next start needs to clean up after this daemon if it dies.

    ``start_time`` and each descendant's start are process identities (:mod:`atroposd.pids`):
    clock ticks since boot, compared exactly; a float is the older wall-clock form.
    ``boot_id`` is the boot those ticks count from. ``started_at`` is the daemon's start on the
    wall clock, used only for a record without ticks or boot id (written by an older atroposd).
    """

    nonce: str
    pid: int
    start_time: Start
    descendants: list[tuple[int, Start]] = field(default_factory=list)
    # /dev/shm segments the children mapped when last looked at (atroposd's own aside): what
    # they leave if they all die with the daemon before their cleanup.
    segments: list[str] = field(default_factory=list)
    started_at: float | None = None
    boot_id: str | None = field(default_factory=boot_id)

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "nonce": self.nonce,
                "pid": self.pid,
                "start_time": self.start_time,
                "started_at": self.started_at,
                "boot_id": self.boot_id,
                "descendants": [[p, t] for p, t in self.descendants],
                "segments": self.segments,
            }
        )

    @classmethod
    def from_json(cls, data: bytes) -> InstanceRecord:
        raw = orjson.loads(data)
        started_at = raw.get("started_at")
        boot = raw.get("boot_id")
        return cls(
            nonce=str(raw["nonce"]),
            pid=int(raw["pid"]),
            start_time=_start(raw["start_time"]),
            descendants=[(int(p), _start(t)) for p, t in raw.get("descendants", [])],
            segments=[str(n) for n in raw.get("segments", [])],
            started_at=float(started_at) if started_at is not None else None,
            boot_id=str(boot) if boot is not None else None,
        )

    @property
    def wall_start(self) -> float:
        """The daemon's start on the wall clock as it reads now (file times are compared with it).

        From its start in ticks since boot when the record is of this boot, so a clock step
        since then does not matter; a record of an earlier boot: +inf (nothing that exists now
        was created by its processes); only an older record without ticks or boot id falls
        back to the wall-clock time it wrote."""
        if isinstance(self.start_time, int) and self.boot_id is not None:
            if self.boot_id != boot_id():
                return math.inf
            return wall_of_boot(self.start_time / _CLK_TCK)
        if self.started_at is not None:
            return self.started_at
        if isinstance(self.start_time, float):
            return self.start_time
        return 0.0  # unknown: every segment named in the record is a candidate


def _start(value: int | float | str) -> Start:
    """A recorded start as written: int ticks stay exact, anything else is legacy seconds."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return float(value)


def write_record(path: Path, record: InstanceRecord) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, record.to_json())


def read_record(path: Path) -> InstanceRecord | None:
    try:
        return InstanceRecord.from_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("unreadable crash-recovery record ignored", path=str(path), error=str(exc))
        return None


def record_alive(record: InstanceRecord) -> bool:
    return same_process(record.pid, record.start_time) is not None


def _instance_of(proc: psutil.Process) -> str | None:
    try:
        nonce: str | None = proc.environ().get(INSTANCE_VAR)
        return nonce
    except (psutil.Error, OSError):
        return None


def survivors(record: InstanceRecord) -> list[psutil.Process]:
    """Live processes of this user that belong to the dead daemon of ``record``."""
    me = os.getpid()
    found: dict[int, psutil.Process] = {}
    for pid, start in record.descendants:
        proc = same_process(pid, start)
        if proc is not None and proc.pid != me:
            found[proc.pid] = proc
    uid = os.getuid()
    for proc in psutil.process_iter(["uids", "create_time"]):
        try:
            if proc.pid == me or proc.pid in found or proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            # Started after the dead daemon, and carrying its nonce.
            if not _started_since(proc, record.start_time):
                continue
        except psutil.Error:
            continue
        if _instance_of(proc) == record.nonce and is_alive(proc):
            found[proc.pid] = proc
    return list(found.values())


def _started_since(proc: psutil.Process, start: Start) -> bool:
    """Whether ``proc`` started at or after ``start`` (ticks since boot; legacy: wall seconds)."""
    if isinstance(start, int):
        ticks = start_ticks(proc.pid)
        return ticks is not None and ticks >= start
    return bool(proc.info["create_time"] + TIME_SLACK >= start)


def terminate(procs: list[psutil.Process], *, grace: float) -> list[psutil.Process]:
    """SIGTERM, wait up to ``grace``, SIGKILL what is left; returns the processes that were hit."""
    if not procs:
        return []
    signal_all(procs, signal.SIGTERM)
    _gone, alive = psutil.wait_procs(procs, timeout=grace)
    alive = [p for p in alive if is_alive(p)]
    if alive:
        signal_all(alive, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=max(grace, 1.0))
    return procs


def recover_dead_instance(path: Path, *, grace: float = 2.0) -> InstanceRecord | None:
    """Terminate what a crashed daemon left behind; returns its record (None if nothing to do).

    Blocking (waits for the processes to go): run it before the event loop starts anything.
    """
    record = read_record(path)
    if record is None:
        return None
    if record_alive(record):
        # Another daemon with this state_dir is alive (the pidfile lock normally prevents this).
        return None
    left = survivors(record)
    segments = set(record.segments)
    if left:
        log.warning(
            "terminating processes left by a dead daemon",
            nonce=record.nonce,
            dead_pid=record.pid,
            pids=[p.pid for p in left],
        )
        segments |= set(mapped_shm(pids=[p.pid for p in left]))
        t0 = time.monotonic()
        terminate(left, grace=grace)
        log.info("left-over processes gone", seconds=round(time.monotonic() - t0, 3))
    segments |= set(torch_segments_of(dead_job_pids(record, left)))
    removed = unlink_orphaned_segments(segments, since=record.wall_start)
    if removed:
        log.info("removed shared-memory segments the dead daemon's processes left", segments=removed)
    return record


def dead_job_pids(record: InstanceRecord, left: Iterable[psutil.Process] = ()) -> list[int]:
    """The pids of the dead daemon of ``record`` and of its processes (recorded, or found and
    terminated: ``left``) that no other process holds now: whatever torch named after them in
    /dev/shm is theirs. A pid another live process holds again is left out (its files may be
    that process's); this process's own pid counts (a container's next daemon often gets the
    dead one's pid), since whatever torch file it made itself so far it still maps."""
    pids = {record.pid, *(pid for pid, _ in record.descendants), *(p.pid for p in left)}
    me = os.getpid()
    return sorted(pid for pid in pids if pid == me or not psutil.pid_exists(pid) or _zombie(pid))


def _zombie(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return True


def describe(proc: psutil.Process) -> dict[str, Any]:
    try:
        return {"pid": proc.pid, "cmdline": " ".join(proc.cmdline())[:200]}
    except psutil.Error:
        return {"pid": proc.pid}

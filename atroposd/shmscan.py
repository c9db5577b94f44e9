"""Which ``/dev/shm`` segments live processes map, and the removal of ones nobody maps.

A leaf shared by the supervisor (:mod:`atroposd.process.reaper`: what a stopped component
left), the weight exchange (:mod:`atroposd.weights.shm`: is a segment of a dead launch still
in use) and the vLLM engine (the message-queue segments its EngineCore leaves).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable

from atroposd.logs import get_logger

__all__ = [
    "OWN_SEGMENT_PREFIX",
    "SHM_DIR",
    "boot_id",
    "boot_seconds",
    "mapped_shm",
    "torch_segments_of",
    "unlink_orphaned_segments",
    "wall_of_boot",
]

log = get_logger("atroposd.shmscan")

SHM_DIR = "/dev/shm"
OWN_SEGMENT_PREFIX = "atroposd-"  # the weight segments: their owner unlinks them (atroposd.weights.shm)
# A segment's ctime against a process's start: two reads agree far better.
CTIME_SLACK = 0.05


def boot_seconds() -> float:
    """Seconds since this machine booted (CLOCK_BOOTTIME, the clock of ``/proc/<pid>/stat``'s
    start times): no clock step moves it."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def boot_id() -> str | None:
    """This boot's id (``/proc/sys/kernel/random/boot_id``): times since boot compare only within one."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:  # pragma: no cover - no procfs
        return None


def wall_of_boot(seconds: float) -> float:
    """A moment given in seconds since boot, on the wall clock as it reads now: a clock step
    between that moment and now does not move it against file times taken now."""
    return time.time() - (boot_seconds() - seconds)


def mapped_shm(prefix: str = "", pids: Iterable[int] | None = None) -> dict[str, set[int]]:
    """Segment name → pids that map it, from ``/proc/<pid>/maps`` (every readable process when
    ``pids`` is None). Deleted segments (unlinked while still mapped) are not listed.

    A POSIX named semaphore (multiprocessing's ``sem.mp-*``) is mapped under another name:
    glibc's ``sem_open`` maps a temporary file, links it to the semaphore's name and unlinks
    the temporary, so the mapping reads ``/dev/shm/sem.XXXXXX (deleted)``. Such a mapping
    counts for the file that has its inode, when one is there."""
    marker = f"{SHM_DIR}/"
    found: dict[str, set[int]] = {}
    by_inode: dict[tuple[str, int], set[int]] = {}  # (device "major:minor", inode) → pids
    if pids is None:
        try:
            pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
        except FileNotFoundError:  # pragma: no cover - no procfs
            return found
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    at = line.find(marker)
                    if at < 0:
                        continue
                    if line.rstrip().endswith("(deleted)"):
                        fields = line.split()
                        if len(fields) >= 5 and fields[4].isdigit():
                            by_inode.setdefault((fields[3], int(fields[4])), set()).add(pid)
                        continue
                    name = line[at + len(SHM_DIR) + 1 :].split()[0]
                    if name.startswith(prefix):
                        found.setdefault(name, set()).add(pid)
        except OSError:  # gone, or another user's
            continue
    if by_inode:
        for name, key in _shm_inodes(prefix).items():
            if key in by_inode:
                found.setdefault(name, set()).update(by_inode[key])
    return found


# torch's own files in /dev/shm: its CUDA IPC reference counters (a producer's, one file for
# many exports) and tensors shared through the file system. torch names each after the process
# that made it: "/torch_<pid>_<random>_<counter>" (at::NewProcessWideShmHandle).
TORCH_SEGMENT_RE = re.compile(r"^torch_(\d+)_\d+_\d+$")


def torch_segments_of(pids: Iterable[int], directory: str | None = None) -> list[str]:
    """The names of torch's own ``/dev/shm`` files (:data:`TORCH_SEGMENT_RE`) that the processes
    ``pids`` made, sorted. Nothing else is looked at: whether one may go (no live process maps
    it, it is this user's, made since the job started) is :func:`unlink_orphaned_segments`'s."""
    wanted = set(pids)
    try:
        names = os.listdir(directory if directory is not None else SHM_DIR)
    except OSError:  # pragma: no cover - no /dev/shm
        return []
    out = []
    for name in names:
        m = TORCH_SEGMENT_RE.match(name)
        if m is not None and int(m.group(1)) in wanted:
            out.append(name)
    return sorted(out)


def _shm_inodes(prefix: str) -> dict[str, tuple[str, int]]:
    """Name → (device as ``/proc/<pid>/maps`` writes it, inode) of each file in /dev/shm."""
    out: dict[str, tuple[str, int]] = {}
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:  # pragma: no cover - no /dev/shm
        return out
    for name in names:
        try:
            st = os.stat(os.path.join(SHM_DIR, name), follow_symlinks=False)
        except OSError:
            continue
        out[name] = (f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", st.st_ino)
    return out


def unlink_orphaned_segments(
    names: Iterable[str],
    *,
    since: float | None = None,
    since_boot: float | None = None,
    ignore_pids: Iterable[int] = (),
) -> list[str]:
    """Unlink the ``/dev/shm`` segments among ``names`` that no live process maps any more
    (processes in ``ignore_pids`` aside: a process about to exit may clean up what it still
    maps) and that were created at or after a start; ``atroposd-*`` weight segments are left to
    their owner. Returns the names removed.

    The start: ``since_boot`` (seconds since boot; put on the wall clock at the check, so a
    clock step since that start does not matter) or ``since`` (epoch seconds, read just before
    by the caller), compared with each segment's ctime."""
    candidates = {n for n in names if n and "/" not in n and not n.startswith(OWN_SEGMENT_PREFIX)}
    if not candidates:
        return []
    if since_boot is not None:
        since = wall_of_boot(since_boot)
    if since is None:
        raise TypeError("unlink_orphaned_segments needs since or since_boot")
    ignored = set(ignore_pids)
    in_use = {name for name, pids in mapped_shm().items() if pids - ignored}
    removed = []
    for name in sorted(candidates - set(in_use)):
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.stat(path, follow_symlinks=False)
            if st.st_uid != os.getuid() or st.st_ctime + CTIME_SLACK < since:
                continue
            os.unlink(path)
            removed.append(name)
        except FileNotFoundError:  # its owner cleaned it up
            continue
        except OSError as exc:
            log.warning("cannot remove a left-over shared-memory segment", segment=name, error=str(exc))
    return removed


class SegmentCheckError(ValueError):
    """An opened segment that is not ours to read: another user's, readable by others, or short.
    ``permission``: the first two (the caller may raise PermissionError for them)."""

    def __init__(self, message: str, *, permission: bool) -> None:
        super().__init__(message)
        self.permission = permission


def check_private_segment(fd: int, name: str, min_size: int) -> int:
    """Check an opened shared-memory segment before mapping it: owned by this user, mode 0600
    (nothing for group or others), at least ``min_size`` bytes. Returns its size."""
    import stat

    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise SegmentCheckError(
            f"shared-memory segment {name!r} is owned by uid {st.st_uid}, not by this user", permission=True
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise SegmentCheckError(
            f"shared-memory segment {name!r} has mode {stat.S_IMODE(st.st_mode):o}; expected 0600", permission=True
        )
    if st.st_size < min_size:
        raise SegmentCheckError(
            f"shared-memory segment {name!r} is {st.st_size} bytes; expected at least {min_size}", permission=False
        )
    return int(st.st_size)

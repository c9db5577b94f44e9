"""Crash recovery (SPEC §4): clean up after a daemon that died, and keep this one's record.

At start, :func:`recover` terminates what a crashed daemon left (its record names every
descendant by pid and start time), removes its sockets, child configs, weight segments and
manifests.  While running, :class:`RecoveryRecord` rewrites ``recovery/instance.json`` when
the set of processes or of mapped ``/dev/shm`` segments changes, so that the next start can
do the same for this daemon.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

import psutil

from atroposd.daemon.runtime import remove_dead_runtime_files
from atroposd.logs import get_logger
from atroposd.paths import Paths
from atroposd.pids import Start, identity, start_ticks
from atroposd.process import reaper
from atroposd.process.unit import Unit

log = get_logger("atroposd.daemon")

RECORD_NAME = "instance.json"
SEGMENT_SCAN_TICKS = 10  # the children's /dev/shm mappings are recorded every 10 ticks (5 s)
SHM_DIR = Path("/dev/shm")


def record_path(paths: Paths) -> Path:
    return paths.recovery_dir / RECORD_NAME


def recover(paths: Paths) -> reaper.InstanceRecord | None:
    """Before anything else: terminate what a crashed daemon left, remove its files.

    The caller holds the pidfile lock: every socket and child config in the runtime
    directory belongs to a dead daemon.  Returns the dead daemon's record, if any.
    """
    record = reaper.recover_dead_instance(record_path(paths))
    rt = paths.runtime_dir
    remove_dead_runtime_files(rt)
    if record is not None:
        dead = record.nonce
        has_segments = any(p.name.startswith(f"atroposd-{dead}-") for p in SHM_DIR.glob("atroposd-*"))
        if has_segments or (rt / "weights").is_dir():
            from atroposd.weights.shm import cleanup_stale

            removed = cleanup_stale(rt, lambda nonce: nonce != dead)
            if removed:
                log.info("removed a dead daemon's weight segments and manifests", nonce=dead, removed=removed)
    return record


class RecoveryRecord:
    """This daemon's ``instance.json``: its identity, its children's and their segments."""

    def __init__(self, paths: Paths, *, nonce: str, pid: int, start_time: Start, started_at: float) -> None:
        self.path = record_path(paths)
        self.nonce, self.pid, self.start_time = nonce, pid, start_time
        self.started_at = started_at
        self._key: tuple[tuple[int, float], ...] = ()
        self._segments: tuple[str, ...] = ()
        self._ticks = 0
        self._identities: dict[int, psutil.Process] = {}

    def _processes(self, units: Iterable[Unit]) -> tuple[tuple[int, float], ...]:
        entries: list[tuple[int, Start]] = []
        for unit in units:
            procs = list(unit.tracked.values())
            if unit.pid is not None:
                proc = self._identities.get(unit.pid)
                if proc is None or proc.pid != unit.pid:
                    proc = identity(unit.pid)
                    if proc is not None:
                        self._identities[unit.pid] = proc
                if proc is not None:
                    procs.append(proc)
            for p in procs:
                # is_running: still the process psutil met (not a recycled pid), then its
                # boot-relative start, the identity the record keeps.
                ticks = start_ticks(p.pid) if p.is_running() else None
                if ticks is not None:
                    entries.append((p.pid, ticks))
        return tuple(sorted(set(entries)))

    def update(self, units: Iterable[Unit]) -> None:
        """Rewrite the record if the processes or their segments changed (or it is missing)."""
        key = self._processes(units)
        # The segments the children map: read from /proc every few seconds (and when the set of
        # processes changes), not every tick: an engine's maps run to thousands of lines.
        self._ticks = (self._ticks + 1) % SEGMENT_SCAN_TICKS
        if key != self._key or self._ticks == 0:
            mapped = reaper.mapped_shm(pids=[pid for pid, _ in key])
            segments = tuple(sorted(n for n in mapped if not n.startswith(reaper.OWN_SEGMENT_PREFIX)))
        else:
            segments = self._segments
        if (key, segments) == (self._key, self._segments) and self.path.exists():
            return
        self._key, self._segments = key, segments
        reaper.write_record(
            self.path,
            reaper.InstanceRecord(
                self.nonce, self.pid, self.start_time, list(key), list(segments), started_at=self.started_at
            ),
        )

    def remove(self) -> None:
        """At a clean exit (every child gone): nothing is left to recover."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

"""Batches through shared memory for trainers on the API's host (SPEC §5).

``GET /batch?format=shm`` takes the next batch as usual, writes it into a fresh POSIX
shared-memory segment in the binary layout (:mod:`atroposd.api.binary`) and answers
``{"shm": {"name", "size", "batch_id"}}``. The batch is delivered once the client
acknowledges it (``POST /batch/ack {"batch_id"}``); the segment is unlinked then. A batch not
acknowledged within ``shm_ack_timeout`` seconds is served again (first, in any format) and its
segment unlinked; a late acknowledgement is answered ``{"acknowledged": false}`` and changes
nothing. ``{"batch_id", "release": true}`` gives a batch back at once (a client that cannot map
the segment). An acknowledgement is answered the same when repeated, also after a restart with
the spool (the ack record carries the batch id), so a client whose answer was lost to a
restart retries and still gets it right.

Segments follow the weight segments' rules (SPEC §7): named
``atroposd-batch-<pid>-<launch>-<random>`` (the last two parts from ``secrets``; the name, which
any local user can list in /dev/shm, says nothing of the batch id that acknowledges the batch),
created with ``O_CREAT | O_EXCL`` and mode 0600, sized up front, written with ``pwrite`` (the
API maps nothing), never through ``multiprocessing.shared_memory`` (its resource tracker). The
batch is planned, laid out and written on a worker thread, never on the API's event loop; the
scratch buffer it is laid out in is kept for the next batch only up to ``SCRATCH_KEEP_BYTES``. Every pending segment
is unlinked when
the API stops. With a spool, the launch's prefix is recorded in the spool directory (file
``shm-batches``) before the first segment exists, so an API started again after ``kill -9``
removes what the previous launch left (the spool's lock says no other API uses that directory);
any API, spooled or not, also removes at its start the batch segments of API processes that
no longer run (the pid in the name).

This module imports no torch: the weight segments' module (:mod:`atroposd.weights.shm`) does,
so the few system calls are repeated here.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atroposd.api.binary import plan_batch, rows_from_group
from atroposd.fsutil import write_atomic
from atroposd.logs import get_logger

if TYPE_CHECKING:
    from aiohttp import web

    from atroposd.api.metrics import ApiMetrics
    from atroposd.api.queue import TrajectoryStore
    from atroposd.api.schema import Group

try:
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

__all__ = ["BATCH_PREFIX", "RECORD_NAME", "ShmBatches", "remove_orphans", "remove_segments"]

log = get_logger("api.shm")

BATCH_PREFIX = "atroposd-batch-"
RECORD_NAME = "shm-batches"
SHM_DIR = Path("/dev/shm")
RECENT_ACKS = 1024  # acknowledged ids remembered, so that a repeated acknowledgement is answered the same
# A batch is laid out in a scratch buffer, then written into its segment. The buffer is kept for
# the next batch up to this size; a larger one is given back once its batch is written.
SCRATCH_KEEP_BYTES = 64 << 20


def _shm_open(name: str, flags: int, mode: int = 0o600) -> int:
    if _posixshmem is not None:
        return int(_posixshmem.shm_open("/" + name, flags | os.O_CLOEXEC, mode))
    return os.open(SHM_DIR / name, flags | os.O_CLOEXEC | os.O_NOFOLLOW, mode)  # pragma: no cover


def _shm_unlink(name: str) -> None:
    try:
        if _posixshmem is not None:
            _posixshmem.shm_unlink("/" + name)
        else:  # pragma: no cover
            os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        pass


def remove_segments(prefix: str) -> list[str]:
    """Unlink this user's segments whose names start with ``prefix``; returns their names."""
    return _remove_own(lambda name: name.startswith(prefix))


def remove_orphans() -> list[str]:
    """Unlink this user's batch segments whose creating API process no longer runs (its pid is
    the first part of the name). A reused pid keeps them (until the record of that launch's
    spool removes them). Should a live API's segment go (one in another pid namespace sharing
    /dev/shm), nothing is lost: its client cannot map it and releases the batch, or the batch
    expires, and it is served again."""

    def orphaned(name: str) -> bool:
        if not name.startswith(BATCH_PREFIX):
            return False
        pid_text = name[len(BATCH_PREFIX) :].split("-", 1)[0]
        return pid_text.isdigit() and not _alive(int(pid_text))

    return _remove_own(orphaned)


def _remove_own(wanted: Callable[[str], bool]) -> list[str]:
    """Unlink each segment of this user that ``wanted`` names; returns their names."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:  # pragma: no cover
        return []
    removed = []
    for name in sorted(names):
        if not wanted(name):
            continue
        try:
            if os.stat(SHM_DIR / name, follow_symlinks=False).st_uid != os.geteuid():
                continue
        except FileNotFoundError:
            continue
        _shm_unlink(name)
        removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a pid we can judge
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_segment(name: str, data: memoryview) -> None:
    fd = _shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, len(data))
        done = 0
        while done < len(data):  # written, not mapped: tmpfs takes it in one copy
            done += os.pwrite(fd, data[done:], done)
    except BaseException:
        _shm_unlink(name)
        raise
    finally:
        os.close(fd)


def _unlink_written(job: asyncio.Future[tuple[str, int]]) -> None:
    if not job.cancelled() and job.exception() is None:
        _shm_unlink(job.result()[0])


@dataclass
class _Pending:
    batch: list[Group]
    epoch: int
    segment: str
    timer: asyncio.TimerHandle


class ShmBatches:
    """The shared-memory batches of one API launch."""

    def __init__(
        self,
        store: TrajectoryStore,
        *,
        ack_timeout: float,
        spool_dir: str | None,
        metrics: ApiMetrics | None = None,
        executor: Executor | None = None,
    ) -> None:
        self.store = store
        self.ack_timeout = ack_timeout
        self.record = Path(spool_dir) / RECORD_NAME if spool_dir else None
        self.metrics = metrics
        self.prefix = f"{BATCH_PREFIX}{os.getpid()}-{secrets.token_hex(8)}-"
        self.pending: dict[str, _Pending] = {}
        self._acked: OrderedDict[str, None] = OrderedDict()
        self._scratch = bytearray()  # the file is laid out here, then written into the segment
        self._scratch_lock = threading.Lock()
        self.executor = executor  # where batches are laid out and written (None: the loop's default)
        self.expired = 0
        self._started = False
        self._closed = False

    # ------------------------------------------------------------------ launch

    def start(self) -> None:
        """Remove what the previous launch on this spool left, and record this launch's prefix."""
        if self._started:
            return
        self._started = True
        for batch_id in self.store.acked_batch_ids:  # acknowledged before a restart (the spool)
            self._acked[batch_id] = None
        orphans = remove_orphans()
        if orphans:
            log.info("removed batch segments of API processes that no longer run", segments=orphans)
        if self.record is None:
            return
        try:
            previous = self.record.read_text().strip()
        except FileNotFoundError:
            previous = ""
        except OSError as exc:
            log.warning("cannot read the previous launch's shared-memory record", path=str(self.record), error=str(exc))
            previous = ""
        if previous.startswith(BATCH_PREFIX) and len(previous) > len(BATCH_PREFIX):
            removed = remove_segments(previous)
            if removed:
                log.info("removed batch segments a previous API launch left", segments=removed)
        write_atomic(self.record, (self.prefix + "\n").encode(), mode=0o600)

    def close(self) -> None:
        """Unlink every pending segment (their batches were not delivered: the spool replays
        them) and the record."""
        self._closed = True
        for p in self.pending.values():
            p.timer.cancel()
            _shm_unlink(p.segment)
        if self.pending:
            log.info("unlinked the segments of unacknowledged batches", batches=len(self.pending))
        self.pending.clear()
        if self.record is not None and self._started:
            try:
                self.record.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("cannot remove the shared-memory record", path=str(self.record), error=str(exc))

    async def on_startup(self, app: web.Application) -> None:
        self.start()

    async def on_cleanup(self, app: web.Application) -> None:
        self.close()

    # ------------------------------------------------------------------ batches

    async def offer(self, batch: list[Group], epoch: int, step: int) -> dict[str, Any]:
        """Write ``batch`` into a new segment (on the executor) and hold it until acknowledged;
        raises OSError when the segment cannot be made (the caller puts the batch back)."""
        self.start()
        batch_id = secrets.token_hex(12)
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(self.executor, self.write, batch, batch_id, step)
        try:
            name, size = await asyncio.shield(job)
        except asyncio.CancelledError:  # the request went away: the segment goes when written
            job.add_done_callback(_unlink_written)
            raise
        if self._closed:  # the API stopped meanwhile: close() did not know this segment
            _shm_unlink(name)
            raise OSError("the API is stopping")
        timer = loop.call_later(self.ack_timeout, self._expire, batch_id)
        self.pending[batch_id] = _Pending(batch, epoch, name, timer)
        return {"name": name, "size": size, "batch_id": batch_id}

    def write(self, batch: list[Group], batch_id: str, step: int) -> tuple[str, int]:
        """Lay ``batch`` out and write it into a new segment: (its name, its size). Any thread."""
        name = f"{self.prefix}{secrets.token_hex(16)}"  # not the batch id: that acknowledges it
        layout = plan_batch([rows_from_group(g) for g in batch], {"batch_id": batch_id, "step": str(step)})
        with self._scratch_lock:
            if len(self._scratch) < layout.size:
                self._scratch = bytearray()  # the old one goes first
                self._scratch = bytearray(layout.size)
            try:
                data = memoryview(self._scratch)[: layout.size]
                try:
                    layout.fill(data)  # every byte: the header, then the tensors back to back
                    _write_segment(name, data)
                finally:
                    data.release()
            finally:
                if len(self._scratch) > SCRATCH_KEEP_BYTES:
                    self._scratch = bytearray()  # given back: one large batch does not pin it
        return name, layout.size

    def ack(self, batch_id: str, *, release: bool = False) -> dict[str, Any]:
        """Acknowledge (delivered) or release (served again now) a pending batch."""
        p = self.pending.pop(batch_id, None)
        if p is None:
            if batch_id in self._acked and not release:
                return {"acknowledged": True, "batch_id": batch_id}
            return {
                "acknowledged": False,
                "batch_id": batch_id,
                "detail": "no such pending batch: it was acknowledged late (it is served again) or by "
                "another launch of the API",
            }
        p.timer.cancel()
        _shm_unlink(p.segment)
        if release:
            self.store.undeliver(p.batch, p.epoch)
            return {"acknowledged": False, "released": True, "batch_id": batch_id}
        self.store.delivered(p.batch, p.epoch, batch_id)
        self._acked[batch_id] = None
        while len(self._acked) > RECENT_ACKS:
            self._acked.popitem(last=False)
        if self.metrics is not None:
            self.metrics.batches_served.inc()
            self.metrics.sequences_served.inc(sum(g.n for g in p.batch))
        return {"acknowledged": True, "batch_id": batch_id}

    def _expire(self, batch_id: str) -> None:
        p = self.pending.pop(batch_id, None)
        if p is None:
            return
        _shm_unlink(p.segment)
        self.store.undeliver(p.batch, p.epoch)
        self.expired += 1
        if self.metrics is not None:
            self.metrics.batch_write_failures.inc()
        log.warning(
            "shared-memory batch not acknowledged in time; it is served again",
            batch_id=batch_id,
            timeout=self.ack_timeout,
        )

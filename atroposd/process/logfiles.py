"""Children's output: bounded, never blocking the event loop, rotated at ``log_max_bytes``.

The daemon reads each child's stdout/stderr pipe in the event loop and hands the bytes to one
writer thread through a bounded buffer per file.  When a file's buffer is full (a child
floods faster than the disk takes it) new output is dropped and counted, and a marker line
records how much was lost once writing catches up.  The child itself is never blocked on its
pipe, and the event loop never waits on the disk.
"""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path

from atroposd.logs import get_logger

log = get_logger("atroposd.logs")

DEFAULT_BUFFER_BYTES = 4 * 1024 * 1024


class RotatingFile:
    """Append-only file rotated to ``.1`` … ``.N`` when it would exceed ``max_bytes``."""

    def __init__(self, path: Path, *, max_bytes: int, backups: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(path, "ab", buffering=0)
        self._size = self._fh.tell()

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            room = self.max_bytes - self._size
            if room <= 0 or (self._size and len(view) > room and b"\n" not in view[:room]):
                self._rotate()
                room = self.max_bytes
            piece = view[:room]
            if len(piece) < len(view):
                # Rotate at a line boundary when the piece has one.
                cut = bytes(piece).rfind(b"\n")
                if cut >= 0:
                    piece = piece[: cut + 1]
            self._fh.write(piece)
            self._size += len(piece)
            view = view[len(piece) :]

    def _rotate(self) -> None:
        self._fh.close()
        if self.backups <= 0:
            self.path.unlink(missing_ok=True)
        else:
            for i in range(self.backups - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._fh = open(self.path, "ab", buffering=0)
        self._size = 0

    def close(self) -> None:
        self._fh.close()


class LogSink:
    """One component's log: a bounded queue in front of a :class:`RotatingFile`."""

    def __init__(self, hub: LogHub, path: Path, *, max_bytes: int, backups: int, buffer_bytes: int) -> None:
        self._hub = hub
        self.path = path
        self._file: RotatingFile | None = RotatingFile(path, max_bytes=max_bytes, backups=backups)
        self._pending: collections.deque[bytes] = collections.deque()
        self._pending_bytes = 0
        self._buffer_bytes = buffer_bytes
        self.dropped_bytes = 0
        self._unreported_drop = 0
        self.write_errors = 0
        self.closed = False
        self._write_lock = threading.Lock()

    def write(self, data: bytes) -> None:
        """Queue ``data`` for the file (never blocks; drops and counts when the buffer is full)."""
        if not data or self.closed:
            return
        with self._hub.lock:
            if self._pending_bytes + len(data) > self._buffer_bytes:
                self.dropped_bytes += len(data)
                self._unreported_drop += len(data)
                return
            self._pending.append(data)
            self._pending_bytes += len(data)
            self._hub.wake.notify()

    def _has_work(self) -> bool:
        return bool(self._pending or self._unreported_drop)

    def sync(self) -> None:
        """Write what is queued now (blocking; the writer thread's path, and before reading a tail)."""
        with self._write_lock:
            with self._hub.lock:
                chunks = self._take()
            if chunks and self._file is not None:
                try:
                    self._file.write(b"".join(chunks))
                except OSError:
                    # A full disk must not stop the job: count what could not be written.
                    self.write_errors += 1

    def _take(self) -> list[bytes]:
        chunks = list(self._pending)
        self._pending.clear()
        self._pending_bytes = 0
        if self._unreported_drop:
            chunks.append(f"\n[atroposd: {self._unreported_drop} bytes of output dropped]\n".encode())
            self._unreported_drop = 0
        return chunks

    def _close_file(self) -> None:
        with self._write_lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def close(self) -> None:
        """Flush what is queued and close the file (called from the event loop at unit removal)."""
        self._hub.close_sink(self)


class LogHub:
    """The writer thread shared by every component's :class:`LogSink`."""

    def __init__(
        self, logs_dir: Path, *, max_bytes: int, backups: int, buffer_bytes: int = DEFAULT_BUFFER_BYTES
    ) -> None:
        self.logs_dir = logs_dir
        self.max_bytes = max_bytes
        self.backups = backups
        self.buffer_bytes = buffer_bytes
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self._sinks: dict[Path, LogSink] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="atroposd-logs", daemon=True)
        self._thread.start()

    def sink(self, name: str) -> LogSink:
        path = self.logs_dir / f"{name}.log"
        with self.lock:
            existing = self._sinks.get(path)
            if existing is not None and not existing.closed:
                return existing
        sink = LogSink(self, path, max_bytes=self.max_bytes, backups=self.backups, buffer_bytes=self.buffer_bytes)
        with self.lock:
            self._sinks[path] = sink
        return sink

    def close_sink(self, sink: LogSink) -> None:
        sink.sync()
        with self.lock:
            sink.closed = True
            if self._sinks.get(sink.path) is sink:
                del self._sinks[sink.path]
        sink.sync()
        sink._close_file()

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self._stopping and not any(s._has_work() for s in self._sinks.values()):
                    self.wake.wait()
                busy = [s for s in self._sinks.values() if s._has_work()]
                stopping = self._stopping
            for sink in busy:
                sink.sync()
            if stopping and not busy:
                return

    def close(self) -> None:
        """Flush everything and stop the writer thread."""
        with self.lock:
            self._stopping = True
            self.wake.notify()
        self._thread.join(timeout=10)
        for sink in list(self._sinks.values()):
            self.close_sink(sink)


def tail(path: Path, max_lines: int = 20, max_bytes: int = 8192, *, end: int | None = None) -> str:
    """The last lines of a log file ('' if it does not exist); with ``end``, of its first ``end``
    bytes (what a follower prints before it reads on from ``end``)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell() if end is None else min(end, fh.tell())
            fh.seek(max(0, size - max_bytes))
            data = fh.read(size - max(0, size - max_bytes))
    except OSError:
        return ""
    lines = data.decode(errors="replace").splitlines()
    if size > max_bytes and lines:
        lines = lines[1:]
    return "\n".join(lines[-max_lines:])

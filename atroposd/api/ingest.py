"""A helper process that inflates, parses and checks posted bodies, so that the API's event loop
and the helper each use a core.

Per posted group of 8 × 512 tokens the event loop spends about 0.12 ms inflating the gzip body,
0.25 ms parsing it and 0.15 ms on HTTP: on its own it is bound by one core. The helper
(``python -m atroposd.api.ingest FD PPID``) takes bodies over a Unix socket and sends back the
finished groups (their numpy arrays as raw buffers, pickle protocol 5) or the refusal, decided
by the same :func:`~atroposd.api.bodies.groups_from_body` the loop would call, so a body gets
the same answer either way. The loop hands a body over only while the helper holds fewer than
``DEPTH`` (one parsing, one waiting) and parses the others itself (:meth:`ParseHelper.groups`
answers None for those): both stay busy and neither
waits for the other. Bodies under ``MIN_BYTES`` are cheaper to parse than to hand over. What
it gains is measured by ``benchmarks/bench_api.py`` (docs/MEASURED.md's table of the parts).

The helper is a child of the API process: it dies with it (parent-death signal, and it exits
when its socket closes), ignores SIGTERM/SIGINT so that a group stop lets the API close it, and
a helper that dies is started again (after ``RESTART_DELAY_S``); bodies it held are parsed on
the loop, so none is lost. ``ATROPOSD_API_PARSE_HELPER=0`` turns it off, ``=1`` on even with
one CPU; by default it runs when the process may use two or more.

Frames both ways: a header (payload length, kind, flags) and the payload.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import deque
from typing import Any

from atroposd.api.bodies import groups_from_body, gunzip
from atroposd.api.schema import Group, InvalidRequest
from atroposd.logs import get_logger
from atroposd.pyexec import python_module

__all__ = ["ParseHelper", "helper_wanted"]

log = get_logger("api.ingest")

ENV = "ATROPOSD_API_PARSE_HELPER"
HEADER = struct.Struct("<QBB6x")  # payload bytes, kind, flags
JOB_ARGS = struct.Struct("<qq")  # max_request_bytes, max_token_len (-1: none)
JOB, JOB_GZIP, DONE, REFUSED, FAILED, READY = 1, 2, 3, 4, 5, 6  # kinds
LISTED = 1  # flag: a /scored_data_list body
DEPTH = 2  # bodies in the helper's hands at once
# Smaller bodies are parsed on the loop: below this, handing one over (about 0.05 ms of the
# loop's time, and the helper's) costs more than parsing it.
MIN_BYTES = 8 << 10
RESTART_DELAY_S = 2.0
READY_TIMEOUT_S = 30.0  # the helper's imports (numpy, simdjson) take about 0.3 s
SOCKET_BUFFER = 4 << 20


def helper_wanted() -> bool:
    """``ATROPOSD_API_PARSE_HELPER`` if set (0/1), else whether two or more CPUs are usable."""
    value = os.environ.get(ENV, "").strip()
    if value in ("0", "1"):
        return value == "1"
    try:
        return len(os.sched_getaffinity(0)) >= 2
    except (AttributeError, OSError):
        return (os.cpu_count() or 1) >= 2


class HelperGone(Exception):
    """The helper could not answer for a body (it died or failed): the loop parses it."""


class ParseHelper:
    """The helper process, as the API's event loop sees it."""

    def __init__(self, max_request_bytes: int) -> None:
        self.limit = max_request_bytes
        self.proc: asyncio.subprocess.Process | None = None
        self._reaping: asyncio.Task[None] | None = None
        self.handed = 0  # bodies handed to the helper
        self.on_loop = 0  # bodies parsed on the loop (the helper busy, down or failing)
        self.restarts = 0
        self._writer: asyncio.StreamWriter | None = None
        self._pending: deque[asyncio.Future[list[Group]]] = deque()
        self._reading: asyncio.Task[None] | None = None
        self._closing = False
        self._down_since: float | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for s in (ours, theirs):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *python_module("atroposd.api.ingest"),
                str(theirs.fileno()),
                str(os.getpid()),
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        try:
            kind = HEADER.unpack(await asyncio.wait_for(reader.readexactly(HEADER.size), READY_TIMEOUT_S))[1]
            if kind != READY:
                raise OSError(f"the parse helper said {kind} instead of ready")
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            writer.close()
            await self._reap(self.proc)
            raise OSError(f"the parse helper did not start (exit code {self.proc.returncode}): {exc!r}") from None
        self._writer = writer
        self._down_since = None
        self._reading = asyncio.ensure_future(self._read_loop(reader, self.proc))
        log.info("parse helper started", pid=self.proc.pid)

    async def close(self) -> None:
        """Close the socket (the helper exits at its end) and reap the helper."""
        self._closing = True
        if self._writer is not None:
            self._writer.close()
        if self._reading is not None:
            await asyncio.gather(self._reading, return_exceptions=True)
        if self._reaping is not None:
            await asyncio.gather(self._reaping, return_exceptions=True)
        await self._reap(self.proc)

    @property
    def up(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    # ------------------------------------------------------------------ bodies

    async def try_start(self) -> bool:
        """Start the helper; False (logged) when it cannot be, and the loop parses everything."""
        try:
            await self.start()
        except OSError as exc:
            log.error("cannot start the parse helper; parsing on the event loop", error=str(exc))
            return False
        return True

    async def groups(
        self, raw: bytes | bytearray, gzip: bool, *, listed: bool, max_token_len: int | None
    ) -> list[Group] | None:
        """The validated groups of a posted body from the helper, or None when the body is the
        loop's to parse (small, the helper busy, down or failing). Raises ``InvalidRequest`` as
        :func:`groups_from_body` does."""
        if (
            not self.up
            and not self._closing
            and self._down_since is not None
            and time.monotonic() - self._down_since >= RESTART_DELAY_S
        ):
            self._down_since = time.monotonic()  # one attempt per delay, even if it fails
            if await self.try_start():
                self.restarts += 1
        if len(raw) >= MIN_BYTES and self.up and len(self._pending) < DEPTH:
            try:
                return await self._hand_over(raw, gzip, listed, max_token_len)
            except HelperGone:
                pass
        self.on_loop += 1
        return None

    async def _hand_over(
        self, raw: bytes | bytearray, gzip: bool, listed: bool, max_token_len: int | None
    ) -> list[Group]:
        writer = self._writer
        assert writer is not None
        fut: asyncio.Future[list[Group]] = asyncio.get_running_loop().create_future()
        self._pending.append(fut)
        writer.write(HEADER.pack(JOB_ARGS.size + len(raw), JOB_GZIP if gzip else JOB, LISTED if listed else 0))
        writer.write(JOB_ARGS.pack(self.limit, -1 if max_token_len is None else max_token_len))
        writer.write(raw)
        self.handed += 1
        return await fut

    async def _read_loop(self, reader: asyncio.StreamReader, proc: asyncio.subprocess.Process) -> None:
        try:
            while True:
                size, kind, _ = HEADER.unpack(await reader.readexactly(HEADER.size))
                payload = await reader.readexactly(size)
                fut = self._pending[0]  # stays pending until decoded: a failure below still answers it
                if fut.done():  # the request went away meanwhile
                    self._pending.popleft()
                    continue
                if kind == DONE:
                    answer: list[Group] | BaseException = decode_groups(payload)
                elif kind == REFUSED:
                    status, reason, message = pickle.loads(payload)
                    answer = InvalidRequest(message, status, reason)
                else:
                    log.warning(
                        "the parse helper failed on a body; parsing it on the event loop",
                        error=payload.decode(errors="replace")[-2000:],
                    )
                    answer = HelperGone()
                self._pending.popleft()
                if isinstance(answer, BaseException):
                    fut.set_exception(answer)
                else:
                    fut.set_result(answer)
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            if not self._closing:
                log.error(
                    "the parse helper is gone; parsing on the event loop until it is back",
                    pid=proc.pid,
                    returncode=proc.returncode,
                    error=repr(exc),
                )
        except Exception as exc:  # an answer that does not decode: this helper is not to be trusted
            log.error(
                "the parse helper sent an answer that does not decode; replacing it", pid=proc.pid, error=repr(exc)
            )
        finally:
            if self._writer is not None:
                self._writer.close()
            self._down_since = time.monotonic()
            while self._pending:
                fut = self._pending.popleft()
                if not fut.done():
                    fut.set_exception(HelperGone())
            if not self._closing:
                self._reaping = asyncio.ensure_future(self._reap(proc))

    @staticmethod
    async def _reap(proc: asyncio.subprocess.Process | None) -> None:
        """Wait for the helper to exit (it does once its socket is closed); kill it after 2 s."""
        if proc is None:
            return
        try:
            await asyncio.wait_for(proc.wait(), 2.0)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()


# ---------------------------------------------------------------------- wire format of results


def encode_groups(groups: list[Group]) -> list[Any]:
    """``groups`` as buffers to send: lengths, the pickle, then each array's bytes."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(groups, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    parts: list[Any] = [struct.pack(f"<QQ{len(raws)}Q", len(head), len(raws), *(r.nbytes for r in raws)), head]
    parts.extend(raws)
    return parts


def decode_groups(payload: bytes) -> list[Group]:
    """The groups of ``encode_groups``; their arrays are read-only views on ``payload``."""
    head_len, n = struct.unpack_from("<QQ", payload, 0)
    sizes = struct.unpack_from(f"<{n}Q", payload, 16)
    view = memoryview(payload)
    pos = 16 + 8 * n
    head = view[pos : pos + head_len]
    pos += head_len
    buffers = []
    for size in sizes:
        buffers.append(view[pos : pos + size])
        pos += size
    groups: list[Group] = pickle.loads(head, buffers=buffers)  # our own child's output, never a client's bytes
    return groups


# ---------------------------------------------------------------------- the helper process


def _send(sock: socket.socket, parts: list[Any]) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def _answer(kind: int, flags: int, args: bytes, raw: bytes) -> tuple[int, list[Any]]:
    limit, max_token_len = JOB_ARGS.unpack(args)
    try:
        body = gunzip(raw, limit) if kind == JOB_GZIP else raw
        groups = groups_from_body(
            body, listed=bool(flags & LISTED), max_token_len=None if max_token_len < 0 else max_token_len
        )
        return DONE, encode_groups(groups)
    except InvalidRequest as exc:
        return REFUSED, [pickle.dumps((exc.status, exc.reason, str(exc)))]
    except Exception as exc:  # a bug here must not take the helper down: the loop decides
        return FAILED, [repr(exc).encode()]


def serve(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    sock.sendall(HEADER.pack(0, READY, 0))
    stream = sock.makefile("rb", buffering=SOCKET_BUFFER)
    while True:
        head = stream.read(HEADER.size)
        if len(head) < HEADER.size:
            return  # the API closed the socket (or is gone)
        size, kind, flags = HEADER.unpack(head)
        args = stream.read(JOB_ARGS.size)
        raw = stream.read(size - JOB_ARGS.size)
        if len(args) + len(raw) < size:
            return
        out_kind, parts = _answer(kind, flags, args, raw)
        total = sum(memoryview(p).nbytes for p in parts)
        _send(sock, [HEADER.pack(total, out_kind, 0), *parts])


def main() -> int:
    fd, parent = int(sys.argv[1]), int(sys.argv[2])
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the API
    if os.getppid() != parent:
        return 0  # the API died before the line above
    # A group stop signals the API and this helper alike: the API closes the socket, which
    # ends the helper; the parent-death signal covers an API that dies.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        serve(fd)
    except (ConnectionError, OSError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

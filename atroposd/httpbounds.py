"""What bounds an HTTP port against whoever reaches it (SPEC §13), shared by the trajectory API
and the inference servers: a cap on open connections, one bound of request-body bytes in flight
charged as the bytes arrive, and a deadline for a body to arrive.

- :class:`CappedSite`: an aiohttp ``TCPSite`` serving at most ``cap`` connections at once; one
  more is answered 503 (``Retry-After``) and closed, counted, logged at most once per 10 s.
- :class:`Inflight` and :class:`Charge`: bytes of bodies being read, inflated or parsed, counted
  as they arrive — whatever a ``Content-Length`` declares, a connection that sends nothing holds
  nothing — past the bound a 503 (one body alone always passes, so any acceptable body fits).
- :func:`read_body`: a body of at most ``limit`` bytes read within ``timeout`` seconds, charged
  chunk by chunk; what arrived of a refused body is freed at once.

Refusals are :class:`BodyRefused` (a status, a reason for the metrics labels, a message).
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import Callable
from typing import Protocol

from aiohttp import web

from atroposd.logs import get_logger

__all__ = [
    "FD_RESERVE",
    "REFUSED_LINGER_S",
    "RETRY_AFTER_S",
    "BodyRefused",
    "CappedSite",
    "Charge",
    "Inflight",
    "connection_cap",
    "read_body",
]

log = get_logger("httpbounds")

RETRY_AFTER_S = 1
FD_RESERVE = 64  # file descriptors kept for the process's own files: the cap stays below the limit
REFUSED_LINGER_S = 1.0  # a refused connection is closed after this (or when the client closes it)


class BodyRefused(Exception):
    """A request body refused: ``status`` 413 (too large), 408 (too slow) or 503 (too many bytes
    in flight; ``Retry-After``), ``reason`` its metrics label."""

    def __init__(self, message: str, status: int, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


def connection_cap(max_connections: int) -> int:
    """``max_connections``, kept below the process's file descriptor limit."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(1, min(max_connections, soft - FD_RESERVE))


# ---------------------------------------------------------------------------- bytes in flight


class Inflight:
    """Bytes of request bodies in flight on one port, at most ``max_bytes`` (one body alone
    always passes)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0

    def charge(self, nbytes: int) -> None:
        """Count ``nbytes`` more; :class:`BodyRefused` (503) when they would pass the bound."""
        if nbytes > 0 and self.bytes > 0 and self.bytes + nbytes > self.max_bytes:
            raise BodyRefused(f"too many request bytes in flight ({self.bytes}); try again", 503, "inflight")
        self.bytes += nbytes


class Charge:
    """The bytes one request has charged against an :class:`Inflight`; ``release`` gives them
    back (a refused charge gives back everything at once, so that bodies read in the same turn
    of the loop find the room)."""

    __slots__ = ("body", "inflight", "n")

    def __init__(self, inflight: Inflight) -> None:
        self.inflight = inflight
        self.n = 0
        self.body = 0  # body bytes that arrived (and were charged) so far

    def add(self, nbytes: int) -> None:
        if nbytes > 0:
            try:
                self.inflight.charge(nbytes)
            except BaseException:
                self.release()
                raise
            self.n += nbytes

    def release(self) -> None:
        self.inflight.bytes -= self.n
        self.n = 0


def too_large(limit: int, what: str = "max_request_bytes") -> BodyRefused:
    return BodyRefused(f"request body larger than {what} ({limit})", 413, "too_large")


async def read_body(request: web.Request, *, limit: int, charge: Charge, timeout: float) -> bytes | bytearray:
    """The body of ``request`` as sent: at most ``limit`` bytes (a declared length past it is
    refused before anything is read), within ``timeout`` seconds, each chunk charged as it
    arrives — a declared length is never charged ahead of its bytes."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise too_large(limit)
    # One chunk stays as it came (no copy); more are gathered in one buffer that grows in place
    # and goes back to the system whole when the request ends.
    parts: list[bytes | bytearray] = []

    async def read() -> None:
        got = 0
        while chunk := await request.content.readany():
            got += len(chunk)
            if got > limit:
                raise too_large(limit)
            charge.add(len(chunk))
            charge.body = got
            if not parts:
                parts.append(chunk)
            elif isinstance(parts[0], bytearray):
                parts[0] += chunk
            else:
                parts[0] = bytearray(parts[0]) + chunk

    try:
        await asyncio.wait_for(read(), timeout)
    except BaseException as exc:
        # What arrived goes now: the exception's traceback holds read()'s frame in a cycle
        # (through wait_for's task), which only the cyclic collector would break.
        parts.clear()
        if isinstance(exc, asyncio.TimeoutError):
            raise BodyRefused(f"request body not received within {timeout:g} s", 408, "body_timeout") from None
        raise
    return parts[0] if parts else b""


# ---------------------------------------------------------------------------- connections


class _Refusal(asyncio.Protocol):
    """A connection past the cap: answered 503 at once, its input discarded, closed."""

    RESPONSE = (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: %d\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
    )

    def __init__(self, detail: bytes) -> None:
        self._timer: asyncio.TimerHandle | None = None
        self._detail = detail

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self.RESPONSE % (RETRY_AFTER_S, len(self._detail), self._detail))
        try:
            transport.write_eof()  # the client reads the answer; a close now could reset it first
        except OSError:
            pass
        self._timer = asyncio.get_running_loop().call_later(REFUSED_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # discarded

    def eof_received(self) -> bool:
        return False  # closes the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()


class RefusalCounter(Protocol):
    """What counts refused connections: a Prometheus counter (its ``inc``)."""

    def inc(self) -> None: ...


class _Counted(asyncio.Protocol):
    """The app's protocol for one connection, counted while it is open."""

    __slots__ = ("cap", "inner")

    def __init__(self, inner: asyncio.Protocol, cap: ConnectionCap) -> None:
        self.inner = inner
        self.cap = cap

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cap.open -= 1
        self.inner.connection_lost(exc)


class ConnectionCap:
    """A protocol factory: the app's handler for up to ``cap`` connections at once, a 503 past it."""

    def __init__(
        self, factory: Callable[[], asyncio.Protocol], cap: int, refused: RefusalCounter | None, what: str
    ) -> None:
        self.factory = factory
        self.cap = cap
        self.refused = refused  # a counter (``inc()``); None: not counted
        self.open = 0
        self.detail = b'{"detail": "too many connections to the %s; try again"}' % what.encode()
        self._logged = 0.0

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.cap:
            if self.refused is not None:
                self.refused.inc()
            now = time.monotonic()
            if now - self._logged >= 10.0:  # one line per 10 s, whatever the rate
                self._logged = now
                log.warning("connection refused: too many open", cap=self.cap)
            return _Refusal(self.detail)
        self.open += 1
        return _Counted(self.factory(), self)


class CappedSite(web.TCPSite):
    """``web.TCPSite`` whose connections are capped (SPEC §13)."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        *,
        cap: int,
        refused: RefusalCounter | None,
        what: str = "server",
    ) -> None:
        super().__init__(runner, host, port)
        self.cap = cap
        self.refused = refused
        self.what = what
        self.connections: ConnectionCap | None = None

    @property
    def open(self) -> int:
        """Connections open now (0 before the site started)."""
        return self.connections.open if self.connections is not None else 0

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None
        self.connections = ConnectionCap(server, self.cap, self.refused, self.what)
        self._server = await asyncio.get_running_loop().create_server(
            self.connections,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )

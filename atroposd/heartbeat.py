"""Heartbeats: a child tells the daemon it is alive with a tiny datagram (SPEC §4, Liveness).

The daemon binds one Unix datagram socket (``{runtime_dir}/beat.sock``) and passes its path
to every environment as ``ATROPOSD_HEARTBEAT``.  A child sends one JSON datagram every
``ATROPOSD_HEARTBEAT_INTERVAL`` seconds (default 1)::

    {"name": "arithmetic-0", "pid": 4260, "generating": 2, "oldest_generation_s": 0.4, "groups": 17}

Only ``name`` and ``pid`` are required; the rest says what the child waits on, which lets the
daemon name a stuck stage.  Sending never blocks and never fails the child: with no daemon
listening (a child started by hand, a daemon restarting) a beat is dropped silently — the
simplest channel that works the same under the daemon and without it.  Any child, a
``command`` environment included, may send beats to the same socket.

This is a leaf module: the sender (environments) and the receiver (the daemon) import it.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = [
    "ENV_INTERVAL",
    "ENV_SOCKET",
    "MAX_BEAT_BYTES",
    "SOCKET_NAME",
    "Beat",
    "HeartbeatSender",
    "decode",
    "encode",
]

ENV_SOCKET = "ATROPOSD_HEARTBEAT"
ENV_INTERVAL = "ATROPOSD_HEARTBEAT_INTERVAL"
SOCKET_NAME = "beat.sock"
DEFAULT_INTERVAL = 1.0
MAX_BEAT_BYTES = 4096


@dataclass(frozen=True)
class Beat:
    """One heartbeat as the daemon received it (``at``: its monotonic clock)."""

    name: str
    pid: int
    data: Mapping[str, Any] = field(default_factory=dict)
    at: float = field(default_factory=time.monotonic)

    @property
    def oldest_generation_s(self) -> float:
        """How long the child's oldest generation request has waited (0 when none)."""
        value = self.data.get("oldest_generation_s")
        return float(value) if isinstance(value, (int, float)) else 0.0


def encode(name: str, pid: int, extra: Mapping[str, Any] | None = None) -> bytes:
    return orjson.dumps({**(extra or {}), "name": name, "pid": pid})


def decode(raw: bytes) -> Beat | None:
    """The beat in ``raw``, or None when it is not one (ignored: anyone may write to the socket)."""
    if len(raw) > MAX_BEAT_BYTES:
        return None
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    name, pid = data.get("name"), data.get("pid")
    if not isinstance(name, str) or not name or not isinstance(pid, int) or isinstance(pid, bool):
        return None
    return Beat(name=name, pid=pid, data=data)


class HeartbeatSender:
    """Sends beats to ``path`` (non-blocking; a beat nobody takes is dropped)."""

    def __init__(
        self,
        path: str | None,
        name: str,
        *,
        interval: float = DEFAULT_INTERVAL,
        state: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        self.path = path
        self.name = name
        self.interval = interval if interval > 0 else DEFAULT_INTERVAL
        self.state = state
        self.sent = 0
        self._sock: socket.socket | None = None

    @classmethod
    def from_environ(
        cls,
        name: str,
        environ: Mapping[str, str] | None = None,
        *,
        state: Callable[[], Mapping[str, Any]] | None = None,
    ) -> HeartbeatSender:
        env = os.environ if environ is None else environ
        try:
            interval = float(env.get(ENV_INTERVAL, DEFAULT_INTERVAL))
        except ValueError:
            interval = DEFAULT_INTERVAL
        return cls(env.get(ENV_SOCKET) or None, name, interval=interval, state=state)

    def beat(self) -> bool:
        """Send one beat now; True if the socket took it."""
        if not self.path:
            return False
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
        try:
            self._sock.sendto(encode(self.name, os.getpid(), self.state() if self.state else None), self.path)
        except OSError:  # no daemon listening, or its buffer is full: this beat is dropped
            return False
        self.sent += 1
        return True

    async def run(self) -> None:
        """Beat every ``interval`` seconds until cancelled (a task of the child's event loop:
        a beat proves that loop runs)."""
        import anyio

        if not self.path:
            return
        try:
            while True:
                self.beat()
                await anyio.sleep(self.interval)
        finally:
            self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

"""Which process registered an environment: the pid holding the client end of a loopback
connection, found in ``/proc`` (the socket's inode in ``/proc/net/tcp{,6}``, then the processes'
fd tables). One lookup at a time, each within a time budget, so that registrations cannot make
the API scan the host's sockets without bound."""

from __future__ import annotations

import asyncio
import os
import time

from aiohttp import web

from atroposd.httpbounds import RefusalCounter
from atroposd.logs import get_logger
from atroposd.net import is_loopback

__all__ = ["PEER_LOOKUP_BUDGET_S", "PeerLookup", "find_pid"]

log = get_logger("api.server")

PEER_LOOKUP_BUDGET_S = 0.5  # one peer-pid lookup at a time, for at most this long


class PeerLookup:
    """The peer pids of requests, one lookup at a time; ``skipped`` counts the requests not
    looked up because another lookup was running."""

    def __init__(self, skipped: RefusalCounter, budget: float = PEER_LOOKUP_BUDGET_S) -> None:
        self.lock = asyncio.Lock()
        self.skipped = skipped
        self.budget = budget

    async def pid(self, request: web.Request) -> int | None:
        """The pid of the process holding the client end of this connection (loopback only)."""
        transport = request.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        if not peer or len(peer) < 2:
            return None
        key = (str(peer[0]), int(peer[1]))
        if not is_loopback(key[0]):
            return None
        # Not cached: atroposlib opens a new connection per request, and a port is soon reused.
        if self.lock.locked():
            self.skipped.inc()
            return None
        async with self.lock:
            return await asyncio.to_thread(find_pid, key, time.monotonic() + self.budget)


def find_pid(local: tuple[str, int], deadline: float) -> int | None:
    """The pid owning the TCP socket bound to ``local``: its inode from /proc/net/tcp{,6}, then
    the processes' fd tables (newest pid first), until ``deadline``."""
    ip, port = local
    inode = _socket_inode(port)
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    try:
        pids_found = sorted((int(p) for p in os.listdir("/proc") if p.isdigit()), reverse=True)
    except OSError:
        return None
    for pid in pids_found:
        if time.monotonic() > deadline:
            log.info("peer pid lookup ran out of time", peer=f"{ip}:{port}")
            return None
        try:
            with os.scandir(f"/proc/{pid}/fd") as fds:
                for fd in fds:
                    try:
                        if os.readlink(fd.path) == target:
                            return pid
                    except OSError:
                        continue
        except OSError:
            continue
    return None


def _socket_inode(port: int) -> int | None:
    """Inode of the TCP socket whose local port is ``port`` (the client's end of the connection)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 9 and int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] != "0":
                        return int(fields[9])
        except (OSError, ValueError):
            continue
    return None

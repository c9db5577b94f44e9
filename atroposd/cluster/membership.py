"""Who is in the cluster: node states as the head sees them (SPEC §12.3).

A node is ``joining`` from its join until it reports ready (its inference replicas are),
then ``ready``; it is ``lost`` when its heartbeats stop for ``heartbeat_timeout`` (a
SIGSTOPped node keeps its connection open: silence, not a closed connection, finds it), when
its connection closes, or when it leaves. A node that has not joined yet is listed as
``joining`` with no host. Node 0 is the head itself; its row comes from the head's own
reports.

Pure bookkeeping with an injectable clock: the head's endpoint drives it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["JOINING", "LOST", "READY", "STATES", "Member", "Membership", "replicas_ready"]

JOINING, READY, LOST = "joining", "ready", "lost"
STATES = (JOINING, READY, LOST)


def replicas_ready(components: Sequence[Mapping[str, Any]]) -> bool:
    """A node is ready once every inference replica it runs is ``ready`` (true with none)."""
    return all(c.get("state") == "ready" for c in components if c.get("kind") == "inference")


@dataclass
class Member:
    node_rank: int
    host: str = ""
    address: str = ""
    pid: int | None = None
    instance: str = ""
    units: dict[str, Any] = field(default_factory=dict)
    components: list[dict[str, Any]] = field(default_factory=list)
    ready: bool = False
    state: str = JOINING
    reason: str = "not joined yet"
    since: float = 0.0
    last_seen: float | None = None
    joins: int = 0


# (node_rank, old state, new state, reason)
ChangeCallback = Callable[[int, str, str, str], None]


class Membership:
    def __init__(self, nodes: int, heartbeat_timeout: float, *, clock: Callable[[], float] = time.monotonic,
                 on_change: ChangeCallback | None = None) -> None:
        self.nodes, self.heartbeat_timeout, self.clock = nodes, heartbeat_timeout, clock
        self.on_change = on_change
        now = clock()
        self.members: dict[int, Member] = {r: Member(r, since=now) for r in range(nodes)}

    def _set(self, m: Member, state: str, reason: str) -> None:
        old = m.state
        if old != state:
            m.since = self.clock()
        m.state, m.reason = state, reason
        if old != state and self.on_change is not None:
            self.on_change(m.node_rank, old, state, reason)

    def join(self, node_rank: int, *, host: str, address: str = "", pid: int | None = None, instance: str = "",
             units: Mapping[str, Any] | None = None, components: Sequence[Mapping[str, Any]] = (),
             ready: bool = False) -> Member:
        m = self.members[node_rank]
        m.host, m.address, m.pid, m.instance = host, address, pid, instance
        m.units = dict(units or {})
        m.joins += 1
        m.last_seen = self.clock()
        self.report(node_rank, components, ready)
        if m.state == JOINING and not ready:
            m.reason = "joined; waiting for its inference replicas"
        return m

    def seen(self, node_rank: int) -> None:
        self.members[node_rank].last_seen = self.clock()

    def report(self, node_rank: int, components: Sequence[Mapping[str, Any]], ready: bool) -> None:
        m = self.members[node_rank]
        m.components = [dict(c) for c in components]
        m.ready = ready
        m.last_seen = self.clock()
        if ready:
            self._set(m, READY, "")
        else:
            self._set(m, JOINING, "joined; waiting for its inference replicas")

    def lose(self, node_rank: int, reason: str) -> None:
        m = self.members[node_rank]
        if m.state != LOST:
            self._set(m, LOST, reason)

    def silent(self) -> list[int]:
        """Nodes not lost that have been silent for ``heartbeat_timeout`` (not node 0)."""
        now = self.clock()
        return [r for r, m in self.members.items()
                if r and m.state != LOST and m.last_seen is not None and now - m.last_seen > self.heartbeat_timeout]

    def all_ready(self) -> bool:
        return all(m.state == READY for m in self.members.values())

    def view(self) -> list[dict[str, Any]]:
        """The ``nodes`` of ``status --json``: one row per node, node 0 first."""
        now = self.clock()
        out = []
        for r in sorted(self.members):
            m = self.members[r]
            out.append({
                "node_rank": r,
                "host": m.host or None,
                "address": m.address or None,
                "pid": m.pid,
                "state": m.state,
                "reason": m.reason or None,
                "since_s": round(now - m.since, 3),
                "last_heartbeat_s": None if m.last_seen is None or r == 0 else round(now - m.last_seen, 3),
                "joins": m.joins,
                "units": dict(m.units),
                "components": [dict(c) for c in m.components],
            })
        return out

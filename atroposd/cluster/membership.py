"""Who is in the cluster: node states as the head sees them (SPEC §12.3).

A node is ``joining`` from its join until it reports ready (its inference replicas are),
then ``ready``; it is ``lost`` when its heartbeats stop for ``heartbeat_timeout`` (a
SIGSTOPped node keeps its connection open: silence, not a closed connection, finds it), when
its connection closes, or when it leaves. A node that has not joined yet is listed as
``joining`` with no host. Node 0 is the head itself; its row comes from the head's own
reports.

Pure bookkeeping with an injectable clock: the head's endpoint drives it. What a node sends
(its host, units, components, reasons) is cleaned where it arrives (``clean_text``,
``clean_value``, ``clean_rows``): bounded in rows, keys, depth and string length, with terminal
escapes and other control characters taken out, so that ``status`` prints nothing a node chose.
"""

from __future__ import annotations

import enum
import itertools
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "JOINING",
    "LOST",
    "MAX_REPORT_ROWS",
    "MAX_TEXT",
    "READY",
    "STATES",
    "Member",
    "Membership",
    "NodeState",
    "clean_rows",
    "clean_text",
    "clean_value",
    "replicas_ready",
]


class NodeState(str, enum.Enum):
    """A node as the head sees it (its ``state`` in ``status --json``: the value)."""

    JOINING = "joining"
    READY = "ready"
    LOST = "lost"

    def __str__(self) -> str:
        return self.value


JOINING, READY, LOST = NodeState.JOINING, NodeState.READY, NodeState.LOST
STATES = tuple(NodeState)

# Bounds on what a node's messages put in the head's memory and in ``status``.
MAX_REPORT_ROWS = 256  # component rows of one node
MAX_TEXT = 512  # characters of one string (longer: cut, with an ellipsis)
MAX_ITEMS = 64  # keys of a mapping, items of a list, below a row
MAX_DEPTH = 4  # nesting below a row

# ESC sequences (CSI, OSC up to BEL or ST, and two-character ones), then every other C0/C1
# control character (tab and newline too: a node's string is one line in ``status``).
_ESCAPES = re.compile(
    r"\x1b(?:\[[0-?]*[ -/]*[@-~]?|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_]?)"
    r"|\x9b[0-?]*[ -/]*[@-~]?"
)
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def clean_text(value: object, limit: int = MAX_TEXT) -> str:
    """``value`` as a string a terminal shows as it is: escapes and control characters taken
    out, at most ``limit`` characters."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > 4 * limit:  # never run the patterns over more than the bound asks for
        text = text[: 4 * limit]
    text = _CONTROLS.sub("", _ESCAPES.sub("", text))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def clean_value(value: Any, depth: int = 0) -> Any:
    """A JSON value from a node, bounded: strings cleaned (``clean_text``), at most
    ``MAX_ITEMS`` keys or items per level and ``MAX_DEPTH`` levels (deeper: None)."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return clean_text(value)
    if depth >= MAX_DEPTH:
        return None
    if isinstance(value, dict):
        return {clean_text(k, 64): clean_value(v, depth + 1) for k, v in list(value.items())[:MAX_ITEMS]}
    if isinstance(value, list):
        return [clean_value(v, depth + 1) for v in value[:MAX_ITEMS]]
    return clean_text(value)


def clean_rows(rows: object) -> list[dict[str, Any]]:
    """A node's component rows: the objects of a list, at most ``MAX_REPORT_ROWS``, each cleaned."""
    if not isinstance(rows, list):
        return []
    return [clean_value(r) for r in itertools.islice((r for r in rows if isinstance(r, dict)), MAX_REPORT_ROWS)]


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
    state: NodeState = JOINING
    reason: str = "not joined yet"
    since: float = 0.0
    last_seen: float | None = None
    joins: int = 0


# (node_rank, old state, new state, reason)
ChangeCallback = Callable[[int, NodeState, NodeState, str], None]


class Membership:
    def __init__(
        self,
        nodes: int,
        heartbeat_timeout: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: ChangeCallback | None = None,
    ) -> None:
        self.nodes, self.heartbeat_timeout, self.clock = nodes, heartbeat_timeout, clock
        self.on_change = on_change
        now = clock()
        self.members: dict[int, Member] = {r: Member(r, since=now) for r in range(nodes)}

    def _set(self, m: Member, state: NodeState, reason: str) -> None:
        old = m.state
        if old != state:
            m.since = self.clock()
        m.state, m.reason = state, reason
        if old != state and self.on_change is not None:
            self.on_change(m.node_rank, old, state, reason)

    def join(
        self,
        node_rank: int,
        *,
        host: str,
        address: str = "",
        pid: int | None = None,
        instance: str = "",
        units: Mapping[str, Any] | None = None,
        components: Sequence[Mapping[str, Any]] = (),
        ready: bool = False,
    ) -> Member:
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
        return [
            r
            for r, m in self.members.items()
            if r and m.state != LOST and m.last_seen is not None and now - m.last_seen > self.heartbeat_timeout
        ]

    def all_ready(self) -> bool:
        return all(m.state == READY for m in self.members.values())

    def view(self) -> list[dict[str, Any]]:
        """The ``nodes`` of ``status --json``: one row per node, node 0 first."""
        now = self.clock()
        out = []
        for r in sorted(self.members):
            m = self.members[r]
            out.append(
                {
                    "node_rank": r,
                    "host": m.host or None,
                    "address": m.address or None,
                    "pid": m.pid,
                    "state": m.state.value,
                    "reason": m.reason or None,
                    "since_s": round(now - m.since, 3),
                    "last_heartbeat_s": None if m.last_seen is None or r == 0 else round(now - m.last_seen, 3),
                    "joins": m.joins,
                    "units": dict(m.units),
                    "components": [dict(c) for c in m.components],
                }
            )
        return out

"""The daemon's own state machine and the events its main task applies.

States (SPEC §2's ``status`` ``state``)::

    starting → running ⇄ degraded
        ↘         ↘        ↙
              stopping

``starting`` goes to ``stopping`` when the start fails or a stop is asked for during it;
``degraded`` means a component failed, and goes back to ``running`` when a reload removes it.
Every move goes through :meth:`DaemonState.check_move`, which refuses one not listed.

Signal handlers, control requests, the units and the trainer only put an :data:`Event` on one
queue; the main task applies them in order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

if TYPE_CHECKING:
    from atroposd.process.unit import Unit
    from atroposd.trainer.service import TrainerOutcome


class IllegalMove(RuntimeError):
    """A daemon state change that the state machine does not allow."""


class DaemonState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    DEGRADED = "degraded"
    STOPPING = "stopping"

    @property
    def serving(self) -> bool:
        """Started and not stopping: the components are reconciled."""
        return self in (DaemonState.RUNNING, DaemonState.DEGRADED)

    def can_move_to(self, new: DaemonState) -> bool:
        return new in _LEGAL[self]

    def check_move(self, new: DaemonState) -> None:
        """Raise IllegalMove unless ``self → new`` is a legal move."""
        if not self.can_move_to(new):
            raise IllegalMove(f"daemon: {self.value} → {new.value}")


_LEGAL: dict[DaemonState, frozenset[DaemonState]] = {
    DaemonState.STARTING: frozenset({DaemonState.RUNNING, DaemonState.STOPPING}),
    DaemonState.RUNNING: frozenset({DaemonState.DEGRADED, DaemonState.STOPPING}),
    DaemonState.DEGRADED: frozenset({DaemonState.RUNNING, DaemonState.STOPPING}),
    DaemonState.STOPPING: frozenset(),
}


# ----------------------------------------------------------------------------- events


class Reply:
    """Where the main task puts the answer to a request (a reload) and wakes its asker."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.value: dict[str, Any] = {}

    def set(self, value: dict[str, Any]) -> None:
        self.value = value
        self.done.set()


@dataclass(frozen=True)
class StopRequested:
    """SIGTERM, SIGINT or ``atroposd stop``."""

    reason: str


@dataclass(frozen=True)
class ReloadRequested:
    """SIGHUP or ``atroposd reload``; the answer goes to ``reply``."""

    reply: Reply = field(default_factory=Reply)


@dataclass(frozen=True)
class UnitChanged:
    """A child changed state."""

    unit: Unit


@dataclass(frozen=True)
class TrainerEnded:
    """The in-process trainer returned: its outcome decides the exit code."""

    outcome: TrainerOutcome


@dataclass(frozen=True)
class StallUnresolved:
    """The trainer made no step for twice ``stall_timeout``: the job ends with exit 1 (SPEC §4)."""

    reason: str


Event = StopRequested | ReloadRequested | UnitChanged | TrainerEnded | StallUnresolved

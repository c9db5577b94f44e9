"""The trainer group's supervisor (SPEC §12.1, §15): one loop over a typed fault.

A trainer of several ranks is a group: rank 0 here, ranks 1..N-1 in processes the daemon runs on
this machine and on the others (the :class:`Fleet`). The group is in one :class:`GroupState` at a
time, and moves only along :data:`TRANSITIONS` (an illegal move raises :class:`IllegalTransition`)::

    forming  → training, faulted, forming (a rollback), stopped
    training → faulted, forming (a rollback), stopped
    faulted  → backoff, stopped (past the restart budget, or a group that never trained)
    backoff  → forming, stopped
    stopped    (final)

What breaks a group arrives as a value (:data:`Fault`) on the fleet's one stream: a rank exited
(:class:`RankExited`: which, on which node, how), a node was lost (:class:`NodeLost`); and from
rank 0's own work, a collective that failed or timed out (:class:`CollectiveFailed`). The
monitor reads the stream for the whole run and cancels the generation's training (the scope of
:meth:`GroupSupervisor.training`) at its first fault.

:meth:`GroupSupervisor.run` has the shape of torchelastic's ``_invoke_run``: start a generation's
ranks (:meth:`GroupSupervisor.form`) and train it (``attempt``), then look at how it ended — an
outcome stops the group; a fault stops the ranks and restarts them within ``trainer.max_restarts``
per ``trainer.restart_window`` after a backoff (1 s doubling to 60 s; a restart while a
rank-holding node is missing is not counted, SPEC §12.3), or ends the job past them; a collapse
rolls back (SPEC §15) and forms the group again.
"""

from __future__ import annotations

import contextlib
import enum
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import anyio
import structlog

from atroposd.restarts import RestartBudget

if TYPE_CHECKING:
    from atroposd.trainer.group import GroupStore
    from atroposd.trainer.health import Collapse

if sys.version_info < (3, 11):  # pragma: no cover - exercised only on 3.10
    from exceptiongroup import BaseExceptionGroup

__all__ = [
    "TRANSITIONS",
    "CollectiveFailed",
    "Fault",
    "Fleet",
    "GroupFault",
    "GroupState",
    "GroupSupervisor",
    "IllegalTransition",
    "NodeLost",
    "RankExited",
    "root_cause",
]

log = structlog.get_logger("trainer", component="trainer")

T = TypeVar("T")

# Backoff before a trainer group restarts (SPEC §4's schedule).
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
# After a failed collective, how long to wait for the fleet to say which rank exited (the reason).
RANK_EXIT_GRACE_S = 1.0
# Faults of one generation kept to name (each restarts the group anyway): the last ones.
MAX_SEEN = 64


class GroupState(str, enum.Enum):
    FORMING = "forming"  # waiting for the nodes, starting the ranks, joining, loading the model
    TRAINING = "training"
    FAULTED = "faulted"  # a rank, a node or a collective failed: the group is being torn down
    BACKOFF = "backoff"  # waiting before the next generation forms
    STOPPED = "stopped"  # finished, stopped, or failed for good


TRANSITIONS: dict[GroupState, frozenset[GroupState]] = {
    GroupState.FORMING: frozenset({GroupState.TRAINING, GroupState.FAULTED, GroupState.FORMING, GroupState.STOPPED}),
    GroupState.TRAINING: frozenset({GroupState.FAULTED, GroupState.FORMING, GroupState.STOPPED}),
    GroupState.FAULTED: frozenset({GroupState.BACKOFF, GroupState.STOPPED}),
    GroupState.BACKOFF: frozenset({GroupState.FORMING, GroupState.STOPPED}),
    GroupState.STOPPED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


# ---------------------------------------------------------------------------- faults


@dataclass(frozen=True)
class RankExited:
    """Trainer rank ``rank`` (``trainer-1``) exited without being asked to; ``node``: the node it
    ran on (None: this one); ``how``: ``killed by SIGKILL``, ``exited with code 1``."""

    rank: str
    how: str
    node: int | None = None

    def __str__(self) -> str:
        where = f" on node {self.node}" if self.node is not None else ""
        return f"{self.rank}{where} {self.how}"


@dataclass(frozen=True)
class NodeLost:
    """A node holding trainer ranks was lost (its ranks are gone with it)."""

    node: int
    reason: str

    def __str__(self) -> str:
        return f"node {self.node} lost ({self.reason})"


@dataclass(frozen=True)
class CollectiveFailed:
    """A collective (or the group's join) of rank 0 failed or timed out."""

    error: str
    timed_out: bool = False

    def __str__(self) -> str:
        return f"a collective failed: {self.error}"


Fault = RankExited | NodeLost | CollectiveFailed


class GroupFault(RuntimeError):
    """The trainer group failed: restart it. ``fault``: what broke it; the message may name more
    (the ranks that exited before a collective failed, or the restart budget spent)."""

    def __init__(self, fault: Fault, message: str | None = None) -> None:
        super().__init__(message if message is not None else str(fault))
        self.fault = fault


def root_cause(exc: BaseException) -> BaseException:
    """The one error inside (nested) single-member exception groups of a task group."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def collective_failed(exc: BaseException) -> CollectiveFailed | None:
    """``exc`` as a failed collective (a fenced compute thread, a process group's error), or None."""
    from atroposd.trainer.ranks import Fenced, JoinTimeout, is_group_error

    root = root_cause(exc)
    if not (isinstance(root, Fenced) or is_group_error(root)):
        return None
    text = str(root).lower()
    timed_out = isinstance(root, (TimeoutError, JoinTimeout)) or "timed out" in text or "timeout" in text
    return CollectiveFailed(f"{type(root).__name__}: {str(root)[:300]}", timed_out=timed_out)


# ---------------------------------------------------------------------------- the fleet


class Fleet(Protocol):
    """Every trainer rank other than rank 0, here and on the other nodes, as one object (the
    daemon's, ``atroposd.daemon.ranks.Fleet``)."""

    @property
    def store(self) -> GroupStore:
        """The store the group meets through."""
        ...

    async def start(self) -> str:
        """A new generation: (re)start ranks 1..N-1 as fresh processes on every node; returns the
        generation's store prefix."""
        ...

    async def stop(self) -> None:
        """Stop every rank process; returns once each is gone (or its node is)."""
        ...

    async def ready(self, on_wait: Callable[[list[int]], None]) -> None:
        """Until every rank-holding node is ready; ``on_wait`` is told the nodes waited for."""
        ...

    def missing(self) -> list[int]:
        """Rank-holding nodes not ready (lost or joining)."""
        ...

    def faults(self) -> AsyncIterator[Fault]:
        """The stream of faults: a rank that exited on its own, a node lost."""
        ...


# ---------------------------------------------------------------------------- the supervisor


class GroupSupervisor:
    """Runs the trainer group's generations; ``fleet`` None: one rank (no group)."""

    def __init__(
        self,
        fleet: Fleet | None,
        *,
        budget: RestartBudget,
        restart_window: float,
        on_move: Callable[[GroupState], None] = lambda state: None,
    ) -> None:
        self.fleet = fleet
        self.budget = budget
        self.restart_window = restart_window
        self._training: anyio.CancelScope | None = None  # the running generation's training
        self._forming: anyio.CancelScope | None = None  # a generation being formed (a stop cancels it)
        self.on_move = on_move  # told each new state
        self.state = GroupState.FORMING
        self.stopping = False  # a stop was requested: ranks leave on purpose
        self.fault: Fault | None = None  # the current generation's first fault
        self.seen: list[Fault] = []  # and every fault of it
        self._seen_event: anyio.Event | None = None  # set at a fault while a failed collective waits for one
        self.restarts = 0
        self.last_fault: str | None = None
        self.waiting_nodes: list[int] = []  # several machines: the nodes a forming group waits for

    # ------------------------------------------------------------------ state

    def move(self, new: GroupState, reason: str = "") -> None:
        old = self.state
        if new not in TRANSITIONS[old]:
            raise IllegalTransition(f"trainer group: {old.value} → {new.value} ({reason})")
        self.state = new
        self.on_move(new)
        log.debug("trainer group", old=old.value, new=new.value, reason=reason)

    def stop(self) -> None:
        """A stop was requested: ranks leave on purpose from now on, and a generation being
        formed (waiting for a lost node, say) is not waited for."""
        self.stopping = True
        if self._forming is not None:
            self._forming.cancel()

    # ------------------------------------------------------------------ faults

    def on_fault(self, fault: Fault) -> None:
        """A fault of the group: the generation ends (unless it stops or ended: ranks leave on
        purpose then)."""
        if self.fleet is None or self.stopping or self.state == GroupState.STOPPED:
            return
        self.seen = [*self.seen[-(MAX_SEEN - 1) :], fault]
        if self._seen_event is not None:
            self._seen_event.set()
        if self.fault is None:
            self.fault = fault
            log.error("a trainer rank exited; the group restarts", fault=str(fault), kind=type(fault).__name__)
        if self._training is not None:
            self._training.cancel()

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """The generation trains within: its first fault (one already seen included) cancels it;
        :meth:`check` afterwards raises the fault."""
        with anyio.CancelScope() as scope:
            self._training = scope
            if self.fault is not None:
                scope.cancel()
            try:
                yield
            finally:
                self._training = None

    def check(self) -> None:
        """Raise the generation's fault, if any (not while stopping)."""
        if self.fault is not None and not self.stopping:
            raise GroupFault(self.fault)

    def as_fault(self, exc: BaseException) -> GroupFault | None:
        """A failure of the group (not of the trainer itself) as a fault to restart from."""
        if self.fleet is None or self.stopping:
            return None
        if self.fault is not None:
            return GroupFault(self.fault)
        failed = collective_failed(exc)
        return GroupFault(failed) if failed is not None else None

    async def _monitor(self, fleet: Fleet) -> None:
        async for fault in fleet.faults():
            self.on_fault(fault)

    # ------------------------------------------------------------------ a generation

    async def form(self, on_wait: Callable[[list[int]], None]) -> str | None:
        """Several ranks: once every node is ready, start a new generation's ranks; returns its
        store prefix (None: a stop came first)."""
        assert self.fleet is not None
        if self.stopping:
            return None
        with anyio.CancelScope() as scope:
            self._forming = scope
            try:
                on_wait([])  # the group forms: waiting for its ranks
                await self.fleet.ready(on_wait)  # several machines: a lost node is back
                self.fault, self.seen = None, []
                return await self.fleet.start()
            finally:
                self._forming = None
        return None

    async def run(
        self,
        attempt: Callable[[str | None], Awaitable[T]],
        *,
        started: Callable[[], bool],
        halt: Callable[[], Awaitable[None]],
        collapsed: Callable[[Collapse], Awaitable[None]],
        stopped: Callable[[], T],
        on_wait: Callable[[list[int]], None] = lambda nodes: None,
    ) -> T:
        """Run generations until one ends with an outcome. Each generation: with several ranks,
        the supervisor starts its ranks (:meth:`form`, ``on_wait`` told the nodes it waits for),
        then ``attempt(prefix)`` joins and trains them (one rank: ``attempt(None)``). ``halt``
        stops rank 0's own part of a faulted one (the supervisor stops the fleet's ranks);
        ``collapsed`` plans a rollback; ``stopped`` is the outcome of a stop while forming."""
        failure: Exception | None = None
        outcome: T | None = None

        async def generation() -> T:
            if self.fleet is None:
                return await attempt(None)
            prefix = await self.form(on_wait)
            return stopped() if prefix is None else await attempt(prefix)

        async with anyio.create_task_group() as tg:
            if self.fleet is not None:
                tg.start_soon(self._monitor, self.fleet)
            try:
                outcome = await self._invoke(generation, started, halt, collapsed)
            except Exception as exc:  # raised outside the task group: not wrapped in a group
                failure = exc
            tg.cancel_scope.cancel()
        if self.state != GroupState.STOPPED:
            self.move(GroupState.STOPPED, "failed" if failure is not None else "ended")
        if failure is not None:
            raise failure
        assert outcome is not None
        return outcome

    async def _invoke(
        self,
        attempt: Callable[[], Awaitable[T]],
        started: Callable[[], bool],
        halt: Callable[[], Awaitable[None]],
        collapsed: Callable[[Collapse], Awaitable[None]],
    ) -> T:
        from atroposd.trainer.health import Collapse

        while True:
            try:
                return await self._attempt(attempt)
            except GroupFault as fault:
                self.move(GroupState.FAULTED, str(fault))
                if not started():
                    raise  # a group that never trained: the start fails
                await self._restart(fault, halt)
            except Collapse as collapse:
                self.move(GroupState.FORMING, "a rollback")
                await collapsed(collapse)

    async def _attempt(self, attempt: Callable[[], Awaitable[T]]) -> T:
        from atroposd.trainer.health import Collapse

        try:
            return await attempt()
        except (GroupFault, Collapse):
            raise
        except Exception as exc:
            root = root_cause(exc)
            if isinstance(root, Collapse):
                raise root from None
            fault = self.as_fault(exc)
            if fault is not None:
                raise fault from exc
            raise

    async def _restart(self, fault: GroupFault, halt: Callable[[], Awaitable[None]]) -> None:
        """Stop every rank, wait the backoff; raise past max_restarts."""
        missing = self.fleet.missing() if self.fleet is not None else []
        # A restart while a rank-holding node is lost or joining is not counted (SPEC §12.3):
        # the group waits for the node instead.
        self.budget.record(time.monotonic(), counted=not missing)
        self.restarts += 1
        if self.fault is None and self.fleet is not None:
            # A collective failed: name the rank whose exit broke it, once the fleet has told.
            if not self.seen:
                self._seen_event = anyio.Event()
                with anyio.move_on_after(RANK_EXIT_GRACE_S):
                    await self._seen_event.wait()
                self._seen_event = None
            if self.seen:
                fault = GroupFault(fault.fault, f"{', '.join(map(str, self.seen))}: {fault}")
        self.last_fault = str(fault)
        if self.fleet is not None:
            await self.fleet.stop()  # every other rank, here and on the other nodes
        await halt()
        if self.budget.exhausted:
            raise GroupFault(
                fault.fault,
                f"{self.budget.count} trainer group restarts within {self.restart_window:g} s "
                f"(trainer.max_restarts = {self.budget.max_restarts}); last: {fault}",
            )
        self.move(GroupState.BACKOFF, str(fault))
        delay = self.budget.backoff()
        log.error(
            "trainer group failed; restarting from the last complete checkpoint",
            reason=str(fault),
            restarts=self.restarts,
            backoff_s=delay,
        )
        with anyio.move_on_after(delay):
            while not self.stopping:  # noqa: ASYNC110 - a stop request ends the wait early
                await anyio.sleep(0.1)
        self.move(GroupState.FORMING, "after the backoff")

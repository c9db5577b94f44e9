"""The trainer ranks of a job other than rank 0 (SPEC §12.1, §12.3), as one object: the fleet.

Every daemon holds a :class:`Fleet`. Its units are this node's ``trainer-<r>`` units, made from
``specs.trainer_rank_specs`` (never rank 0, which runs in the head's daemon). A rank that exits
without being asked to becomes a typed fault (``trainer.supervisor.RankExited``) on the fleet's
one stream, as does (on the head) a rank exit another node reports and a node that is lost
(``NodeLost``). Who reads the stream: the head's trainer group supervisor; on another node its
link to the head, which forwards the node's rank exits.

On the head (or a lone daemon) the fleet is what the trainer group needs of its host
(``trainer.supervisor.Fleet``): the group's store, a new generation started on every node, every
rank stopped, the nodes missing. The other nodes are reached through :class:`OtherNodes` (the
head's link); on one machine there are none. On another node, :meth:`Fleet.follow` starts the
node's ranks for the generation the head started.
"""

from __future__ import annotations

import collections
import datetime
import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import anyio

from atroposd.daemon import specs
from atroposd.logs import get_logger
from atroposd.process.unit import State, Unit
from atroposd.trainer.supervisor import Fault, RankExited

if TYPE_CHECKING:
    from pathlib import Path

    from torch.distributed import Store

    from atroposd.daemon.specs import SpecInputs
    from atroposd.process.unit import UnitSpec
    from atroposd.trainer.group import GroupStore

__all__ = ["FaultStream", "Fleet", "OtherNodes", "UnitHost", "exit_of"]

log = get_logger("atroposd.daemon")

# The store client's timeout for a node's join check (the check itself is one key lookup).
JOIN_CHECK_TIMEOUT_S = 5.0
# Faults waiting for their reader (it reads them at once; a daemon with no reader drops past this).
MAX_FAULTS = 1024


def exit_of(unit: Unit) -> str:
    """How a unit ended: ``killed by SIGKILL``, ``exited with code 1``, or its state."""
    return unit.last_exit.describe() if unit.last_exit else unit.state.value


class UnitHost(Protocol):
    """What the fleet uses of the daemon (:class:`atroposd.daemon.core.Daemon`): its units."""

    @property
    def units(self) -> Mapping[str, Unit]: ...
    def spec_inputs(self) -> SpecInputs: ...
    def add_unit(self, spec: UnitSpec) -> Unit: ...
    async def stop_units(self, units: list[Unit]) -> None: ...


class OtherNodes(Protocol):
    """The other nodes' trainer ranks, as the head reaches them (``daemon.cluster.HeadLink``)."""

    async def group_store(self, world: int) -> GroupStore: ...
    async def wait_nodes(self, on_wait: Callable[[list[int]], None]) -> None: ...
    async def start_ranks(self, generation: int) -> None: ...
    async def stop_ranks(self) -> None: ...
    def missing(self) -> list[int]: ...


class FaultStream:
    """The fleet's faults in arrival order, for one reader (``async for``); at most ``limit`` wait."""

    def __init__(self, limit: int = MAX_FAULTS) -> None:
        self.limit = limit
        self._queue: collections.deque[Fault] = collections.deque()
        self._waiter: anyio.Event | None = None

    def put(self, fault: Fault) -> bool:
        """Queue ``fault``; False (dropped) when ``limit`` faults wait already."""
        if len(self._queue) >= self.limit:
            return False
        self._queue.append(fault)
        if self._waiter is not None:
            self._waiter.set()
        return True

    def get_nowait(self) -> Fault | None:
        return self._queue.popleft() if self._queue else None

    def __aiter__(self) -> FaultStream:
        return self

    async def __anext__(self) -> Fault:
        while not self._queue:
            self._waiter = anyio.Event()
            await self._waiter.wait()
        return self._queue.popleft()


class Fleet:
    """Every trainer rank other than rank 0: this node's units and, on the head, the other nodes'."""

    def __init__(self, host: UnitHost, *, store_dir: Path | None = None, secret: str = "") -> None:
        self.host = host
        self.nodes: OtherNodes | None = None  # the head of several machines: the other nodes
        self.store_dir = store_dir  # one machine: where the group's store file goes
        self.secret = secret  # one machine: the store's secret (the daemon's nonce)
        self._store: GroupStore | None = None
        self._client: Store | None = None  # another node: its client of the head's store
        self._faults = FaultStream()

    # ------------------------------------------------------------------ faults

    def fault(self, fault: Fault) -> None:
        """A fault of the trainer group, onto the stream."""
        if not self._faults.put(fault):
            log.warning("a trainer group fault dropped: nothing reads the fleet's faults", fault=str(fault))

    def faults(self) -> FaultStream:
        """The stream of faults (one reader: the head's trainer group, or a node's link)."""
        return self._faults

    def unit_changed(self, unit: Unit) -> None:
        """A unit of this daemon changed: a rank that exited on its own is a fault."""
        how = self.exit_of(unit) if unit.kind == "trainer" else None
        if how is not None:
            self.fault(RankExited(unit.name, how))

    # ------------------------------------------------------------------ this node's units

    def units(self) -> list[Unit]:
        return [u for u in self.host.units.values() if u.kind == "trainer"]

    def exited(self) -> list[str]:
        """This node's ranks that exited without being asked to (``trainer-1 killed by SIGKILL``)."""
        return [
            f"{u.name} {exit_of(u)}"
            for u in self.units()
            if u.state in (State.FAILED, State.STOPPED) and not u.stop_requested
        ]

    def exit_of(self, unit: Unit) -> str | None:
        """How ``unit``, the current unit of a rank, ended on its own; None while it runs, once
        it was asked to stop, or for a unit replaced since."""
        if unit.state not in (State.FAILED, State.STOPPED) or unit.stop_requested:
            return None
        if self.host.units.get(unit.name) is not unit:
            return None
        return exit_of(unit)

    def _start_here(self, *, address: str, secret: str, key: bytes, joined: Callable[[int], bool]) -> list[Unit]:
        """A fresh unit for each of this node's ranks, meeting at ``address``."""
        return [
            self.host.add_unit(spec)
            for spec in specs.trainer_rank_specs(
                self.host.spec_inputs(), store_address=address, secret=secret, key=key, joined=joined
            )
        ]

    async def stop_here(self) -> None:
        """Stop this node's rank units still running; returns once each is gone."""
        await self.host.stop_units([u for u in self.units() if not u.done.is_set()])

    async def follow(self, address: str, *, secret: str, key: bytes, generation: int, connect_timeout: float) -> None:
        """Another node: (re)start this node's ranks for the head's ``generation`` of the group
        whose store is at ``address`` (``secret``, ``key``: the head's launch's)."""
        from atroposd.trainer.group import connect_store, joined

        await self.stop_here()
        if self._client is None:
            client = await anyio.to_thread.run_sync(connect_store, address, connect_timeout)
            client.set_timeout(datetime.timedelta(seconds=JOIN_CHECK_TIMEOUT_S))
            self._client = client
        check = functools.partial(joined, self._client, secret, generation)
        self._start_here(address=address, secret=secret, key=key, joined=check)

    # ------------------------------------------------------------------ the group (the head's)

    @property
    def store(self) -> GroupStore:
        """The trainer group's store (opened by :meth:`open`)."""
        if self._store is None:
            raise RuntimeError("the trainer group's store is not open")
        return self._store

    async def open(self, world: int) -> GroupStore:
        """The store a group of ``world`` ranks meets through: on one machine a file in a private
        directory under ``store_dir``; with several, the head's (``OtherNodes.group_store``)."""
        from atroposd.trainer.group import GroupStore

        if self.nodes is not None:
            self._store = await self.nodes.group_store(world)
        else:
            secret, store_dir = self.secret, self.store_dir
            self._store = await anyio.to_thread.run_sync(
                lambda: GroupStore(secret=secret, world=world, directory=store_dir)
            )
        return self._store

    async def start(self) -> str:
        """A new generation: every rank 1..N-1 (re)started as a fresh process (a new unit per
        generation), on this node and each other one; returns the generation's store prefix."""
        s = self.store
        prefix = s.next_generation()
        await self.stop()
        self._start_here(address=s.address, secret=s.secret, key=s.key, joined=s.joined)
        if self.nodes is not None:
            await self.nodes.start_ranks(s.generation)
        return prefix

    async def stop(self) -> None:
        """Stop every rank, here and on the other nodes; returns once each is gone."""
        await self.stop_here()
        if self.nodes is not None:
            await self.nodes.stop_ranks()

    async def ready(self, on_wait: Callable[[list[int]], None]) -> None:
        """Several machines: until every node is ready (the group forms with all its ranks)."""
        if self.nodes is not None:
            await self.nodes.wait_nodes(on_wait)

    def missing(self) -> list[int]:
        """Rank-holding nodes not ready (lost or joining): a restart for them is not counted."""
        return self.nodes.missing() if self.nodes is not None else []

"""The trainer ranks a daemon runs on its own machine (SPEC §12.1, §12.3), in one place for the
head and the other nodes.

:class:`LocalRanks` starts this node's ``trainer-<r>`` units from ``specs.trainer_rank_specs``
(never rank 0, which runs in the head's daemon), stops them, names those that exited without
being asked to, and tells a rank's exit from a stop. The head's :class:`RankHost` (what the
trainer needs of its host, ``trainer.host.RankHost``) uses it for its own ranks and the cluster
role for the other nodes'; a node's link uses it when the head starts or stops its group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from atroposd.daemon import specs
from atroposd.process.unit import State, Unit

if TYPE_CHECKING:
    from atroposd.daemon.roles import ClusterRole, RoleHost

__all__ = ["LocalRanks", "RankHost", "exit_of"]


def exit_of(unit: Unit) -> str:
    """How a unit ended: ``killed by SIGKILL``, ``exited with code 1``, or its state."""
    return unit.last_exit.describe() if unit.last_exit else unit.state.value


class LocalRanks:
    """This node's trainer-rank units (every rank of the node other than global rank 0)."""

    def __init__(self, host: RoleHost) -> None:
        self.host = host

    def units(self) -> list[Unit]:
        return [u for u in self.host.units.values() if u.kind == "trainer"]

    def start(self, *, store_address: str, secret: str, key: bytes, joined: Callable[[int], bool]) -> list[Unit]:
        """A fresh unit for each of this node's ranks, meeting at ``store_address``."""
        return [
            self.host.add_unit(spec)
            for spec in specs.trainer_rank_specs(
                self.host.spec_inputs(), store_address=store_address, secret=secret, key=key, joined=joined
            )
        ]

    async def stop(self) -> None:
        """Stop every rank unit still running; returns once each is gone."""
        await self.host.stop_units([u for u in self.units() if not u.done.is_set()])

    def exited(self) -> list[str]:
        """The ranks that exited without being asked to (``trainer-1 killed by SIGKILL``)."""
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


class RankHost:
    """The head's side of the trainer ranks, as the trainer service sees it (``trainer.host.RankHost``):
    its own rank units and, through the cluster role, the other nodes'."""

    def __init__(self, host: RoleHost, store: Any, role: ClusterRole) -> None:
        self.ranks = LocalRanks(host)
        self.store = store
        self.role = role

    async def start_ranks(self) -> None:
        """(Re)start every rank 1..N-1 as a fresh process (a new unit per group generation); with
        several machines, once every node is ready, each node starts its own ranks."""
        await self.stop_ranks()
        s = self.store
        self.ranks.start(store_address=s.address, secret=s.secret, key=s.key, joined=s.joined)
        await self.role.start_ranks(s.generation)

    async def wait_nodes(self, on_wait: Callable[[list[int]], None]) -> None:
        """Several machines: until every node is ready (the group forms with all its ranks)."""
        await self.role.wait_nodes(on_wait)

    def exited(self) -> list[str]:
        """The ranks that exited without being asked to ("trainer-1 killed by SIGKILL"), and the
        rank-holding nodes lost."""
        return self.ranks.exited() + self.role.exited()

    def nodes_missing(self) -> list[int]:
        """Rank-holding nodes not ready (lost or joining): a restart for them is not counted."""
        return self.role.missing()

    async def stop_ranks(self) -> None:
        await self.ranks.stop()
        await self.role.stop_ranks()

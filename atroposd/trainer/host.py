"""What the trainer needs from its host, the daemon (SPEC §12.1): the protocols the daemon's
objects implement, so that the trainer never asks an object what it happens to have.

``TrainerService`` is handed a :class:`RankHost` when the trainer has several ranks: the daemon's
side of the group — the store it hosts (:class:`~atroposd.trainer.group.GroupStore`: the
generations, the group's key, the join check), the rank processes it starts and stops on this
machine and, with several machines, on the others through the cluster role (on one machine
``wait_nodes`` returns at once and ``nodes_missing`` is empty). ``atroposd.daemon.ranks.RankHost``
implements it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from atroposd.trainer.group import GroupStore

__all__ = ["RankHost"]


class RankHost(Protocol):
    """The daemon's side of the trainer ranks: the store it hosts and the rank processes."""

    store: GroupStore

    async def start_ranks(self) -> None:
        """(Re)start ranks 1..N-1 as fresh processes for the store's current generation."""
        ...

    async def stop_ranks(self) -> None:
        """Stop every rank process; returns once each is gone."""
        ...

    async def wait_nodes(self, on_wait: Callable[[list[int]], None]) -> None:
        """Until every rank-holding node is ready (several machines); ``on_wait`` is told the
        nodes waited for. Returns at once on one machine."""
        ...

    def exited(self) -> list[str]:
        """The ranks that exited without being asked to, and the rank-holding nodes lost."""
        ...

    def nodes_missing(self) -> list[int]:
        """Rank-holding nodes not ready (lost or joining): a restart for them is not counted."""
        ...

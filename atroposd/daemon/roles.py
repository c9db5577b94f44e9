"""The daemon's place in a job (SPEC §12.3): one role object, asked instead of "am I the head?".

The daemon always holds a :class:`ClusterRole`: :class:`Standalone` on one machine (every
method a no-op), :class:`~atroposd.daemon.cluster.HeadLink` on node 0 of several, and
:class:`~atroposd.daemon.cluster.NodeLink` on every other node. Each place where the daemon's
behaviour depends on its place calls the role:

- ``run`` opens the role's link before any child starts and runs it until ``close`` (the head's
  endpoint; a node's join, then its heartbeats); it is started once open;
- ``report`` hands this node's components to the link every half second;
- ``status`` is the role's part of ``status --json``, ``dropped`` its messages dropped for
  ``/metrics`` (None: no link);
- ``close`` runs after this node's children stopped.

What one role alone does is not the role's: the daemon calls it on that link — the head's
``stop_nodes`` (before its children stop) and ``remote_replicas`` (the other nodes' replicas its
sentinel checks), a node's ``replica_restarted`` (the head pushes weights to the restarted
replica through this node's first rank).

The trainer ranks are not the role's: the daemon's :class:`~atroposd.daemon.ranks.Fleet` holds
them (the head's link reaches the other nodes' for it; a node's link forwards its rank exits).

:class:`RoleHost` is what a role uses of the daemon: a stand-in implementing it runs a role in a
test without a daemon.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.abc

from atroposd.exitcodes import Exit

if TYPE_CHECKING:
    from atroposd.config import Config
    from atroposd.daemon.ranks import Fleet
    from atroposd.daemon.specs import SpecInputs
    from atroposd.paths import Paths
    from atroposd.process.unit import Unit, UnitSpec
    from atroposd.systemd import Notifier
    from atroposd.trainer.service import TrainerService

__all__ = ["ClusterRole", "RoleHost", "Standalone"]


class RoleHost(Protocol):
    """What a role uses of the daemon (:class:`atroposd.daemon.core.Daemon`)."""

    cfg: Config
    nonce: str
    trainer: TrainerService | None
    stopped: anyio.Event
    notifier: Notifier
    paths: Paths
    fleet: Fleet

    @property
    def units(self) -> Mapping[str, Unit]: ...
    def spawn(self, fn: Callable[..., Awaitable[object]], *args: object) -> None: ...
    def set_status(self, text: str) -> None: ...
    def spec_inputs(self) -> SpecInputs: ...
    def add_unit(self, spec: UnitSpec, **kw: object) -> Unit: ...
    async def stop_units(self, units: list[Unit]) -> None: ...
    def request_stop(self, reason: str, code: Exit = Exit.OK, *, by: float | None = None) -> None: ...
    async def restart_replica(self, replica: int, reason: str) -> bool: ...


class ClusterRole(Protocol):
    """The daemon's place in a job: standalone, the head, or another node."""

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None: ...
    def report(self) -> None: ...
    def status(self) -> dict[str, Any]: ...
    def dropped(self) -> dict[str, int] | None: ...
    async def close(self) -> None: ...


class Standalone:
    """One machine: no link, no other node."""

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()

    def report(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {}

    def dropped(self) -> dict[str, int] | None:
        return None

    async def close(self) -> None:
        pass

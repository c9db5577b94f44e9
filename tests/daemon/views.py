"""Stand-ins for the daemon that status and metrics read (``DaemonView``): the code under test
assembles its answers from these, with no daemon process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from atroposd.config import Config
from atroposd.daemon.replicas import ReplicaHealth
from atroposd.daemon.roles import ClusterRole, Standalone
from atroposd.daemon.state import DaemonState
from atroposd.process.unit import Unit


@dataclass
class Trainer:
    """The trainer service as status and /metrics read it."""

    values: dict[str, Any]
    last: dict[str, Any] = field(default_factory=dict)

    def status(self) -> dict[str, Any]:
        return dict(self.values)

    def metrics_view(self) -> dict[str, Any]:
        return {
            "last": self.last,
            "seconds": {"data_wait": 1.5, "compute": 2.0, "sync": 0.25, "gather": 0.125},
            "tokens_total": 99,
            "rejected_reasons": ["too_long", "token_out_of_range"],
        }


@dataclass
class View:
    """The daemon as status and /metrics read it."""

    cfg: Config
    trainer: Trainer | None = None
    state: DaemonState = DaemonState.RUNNING
    units: dict[str, Unit] = field(default_factory=dict)
    pid: int = 4242
    nonce: str = "abcdef012345"
    start_error: str | None = None
    watchdog: None = None
    replica_health: ReplicaHealth | None = None
    cluster: ClusterRole = field(default_factory=lambda: Standalone())
    uptime_s: float = 81.23456

    def uptime(self) -> float:
        return self.uptime_s

"""Reload as a diff of two configs into a plan (SPEC §6): a pure function, no process touched.

Environment changes apply live: added environments start, removed ones stop, changed ones
restart.  A change to any other key (``[daemon]``, ``[api]``, ``[inference]``,
``[trainer]``) needs a restart of the daemon: the plan then refuses, naming the keys, and
nothing changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from atroposd.config import Config, EnvConfig


def _sections(cfg: Config) -> list[str]:
    """The config's sections other than ``[[env]]`` (its internal fields aside)."""
    return [f.name for f in dataclasses.fields(cfg) if f.name != "env" and not f.metadata.get("internal")]


def restart_keys(old: Config, new: Config) -> list[str]:
    """Keys outside ``[[env]]`` whose value differs (those need a restart of the daemon)."""
    out = []
    for section in _sections(old):
        a, b = dataclasses.asdict(getattr(old, section)), dataclasses.asdict(getattr(new, section))
        out += [f"{section}.{k}" for k in a if a[k] != b.get(k)]
    return out


@dataclass(frozen=True)
class ReloadPlan:
    """What a reload does: refuse (``refused`` names the keys), or change these environments."""

    refused: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.refused

    @property
    def stop(self) -> frozenset[str]:
        """Environments whose replicas stop (removed or changed)."""
        return frozenset((*self.removed, *self.changed))

    @property
    def start(self) -> tuple[str, ...]:
        """Environments whose replicas start from the new config (added or changed)."""
        return (*self.added, *self.changed)

    def refusal(self) -> str:
        return (
            "reload refused: these keys need a restart of the daemon: "
            + ", ".join(self.refused)
            + "; nothing was changed"
        )


def plan_reload(old: Config, new: Config) -> ReloadPlan:
    """The plan that takes a daemon running ``old`` to ``new``."""
    refused = restart_keys(old, new)
    if refused:
        return ReloadPlan(refused=tuple(refused))
    old_envs = {e.name: e for e in old.env}
    new_envs = {e.name: e for e in new.env}
    return ReloadPlan(
        added=tuple(n for n in new_envs if n not in old_envs),
        removed=tuple(n for n in old_envs if n not in new_envs),
        changed=tuple(n for n in new_envs if n in old_envs and new_envs[n] != old_envs[n]),
    )


def env_of(unit_name: str, envs: Iterable[EnvConfig], node_rank: int = 0) -> str | None:
    """The ``[[env]]`` whose replica ``unit_name`` is on node ``node_rank``, if any."""
    for e in envs:
        if unit_name in e.replica_names(node_rank):
            return e.name
    return None

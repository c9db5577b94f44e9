"""Removal of a job's objects: kill, then remove, every container at once, within a deadline.

A container whose first process ignores SIGTERM takes the engine's stop timeout (10 s) to go
when removed one at a time; here each is sent SIGKILL first and all are removed in parallel,
so removing a hundred takes about as long as removing one.  Only objects carrying every label
asked for are touched (the engine's filter, checked again here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import anyio

from atroposd.logs import get_logger
from atroposd.sandbox.engine import Engine, EngineError

log = get_logger("atroposd.sandbox")

PARALLEL = 64  # removals in flight at once


@dataclass
class Swept:
    """What one sweep removed, and what it could not within its deadline."""

    containers: int = 0
    volumes: int = 0
    networks: int = 0
    left: list[str] = field(default_factory=list)
    seconds: float = 0.0


async def _kill_remove(engine: Engine, cid: str) -> bool:
    try:
        await engine.kill(cid)  # a 404 or 409 (not running) is fine: the remove decides
        return await engine.remove(cid)
    except EngineError as exc:
        log.warning("container removal failed", container=cid[:12], error=str(exc))
        return False


async def remove_containers(engine: Engine, ids: list[str], within: float) -> tuple[int, list[str]]:
    """Kill then remove ``ids`` in parallel within ``within`` seconds: (removed, left)."""
    done: set[str] = set()
    limiter = anyio.CapacityLimiter(PARALLEL)

    async def one(cid: str) -> None:
        async with limiter:
            if await _kill_remove(engine, cid):
                done.add(cid)

    with anyio.move_on_after(within):
        async with anyio.create_task_group() as tg:
            for cid in ids:
                tg.start_soon(one, cid)
    return len(done), [c for c in ids if c not in done]


async def sweep(engine: Engine, labels: list[str], within: float, *, containers_only: bool = False) -> Swept:
    """Remove every container (then volume and network, unless ``containers_only``) carrying all
    of ``labels``, within ``within`` seconds."""
    start = time.monotonic()
    out = Swept()
    with anyio.move_on_after(within) as scope:
        found = await engine.containers(labels)
        ids = [str(c["Id"]) for c in found if isinstance(c.get("Id"), str)]
        out.containers, out.left = await remove_containers(engine, ids, max(0.1, within - (time.monotonic() - start)))
        if not containers_only:
            for v in await engine.volumes(labels):
                if isinstance(v.get("Name"), str) and await engine.remove_volume(v["Name"]):
                    out.volumes += 1
            for n in await engine.networks(labels):
                ref = n.get("Id") or n.get("Name")
                if isinstance(ref, str) and await engine.remove_network(ref):
                    out.networks += 1
    if scope.cancelled_caught:
        out.left.append("(the deadline passed)")
    out.seconds = time.monotonic() - start
    return out

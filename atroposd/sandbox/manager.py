"""What the daemon holds with ``[sandbox] engine`` set (SPEC §16): one proxy per environment
replica, the removals, the live counts that status and /metrics show.

    prepare()        at start: the engine answers, and what earlier launches of this job left
                     (a crash, ``kill -9`` of the daemon) is removed          reason "crash"
    attach(name)     an environment replica's socket, bound before it starts; its unit's
                     ``on_exit`` removes its containers before any restart    reason "restart"
                     (or when it stops for good)                              reason "stop"
    run()            every POLL_S: live counts; containers past max_age go    reason "max_age"
    close()          at stop: every object labelled with the job            reason "stop"

A container the environment removes itself counts under "client".  Every removal kills, then
removes, in parallel, within ``[daemon] stop_timeout``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from atroposd.logs import get_logger
from atroposd.sandbox.engine import Engine, EngineError
from atroposd.sandbox.labels import ENV, JOB, REPLICA, Owner, engine_path, job_id, socket_path
from atroposd.sandbox.policy import Policy, parse_memory
from atroposd.sandbox.proxy import ReplicaProxy
from atroposd.sandbox.reaper import sweep

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from atroposd.config import Config

log = get_logger("atroposd.sandbox")

POLL_S = 2.0
REASONS = ("restart", "stop", "crash", "max_age", "client")
REFUSALS = (
    "max_containers",
    "privileged",
    "host_namespace",
    "capabilities",
    "devices",
    "security_opt",
    "bind_mount",
    "engine_socket",
    "network",
    "not_owned",
    "not_served",
    "bad_body",
)


class SandboxUnavailable(Exception):
    """The engine cannot be used at start; the message says why."""


class Sandbox:
    def __init__(self, cfg: Config, *, runtime_dir: Path, state_dir: Path, launch: str) -> None:
        s = cfg.sandbox
        self.engine_url = s.engine
        self.job = job_id(state_dir)
        self.launch = launch
        self.runtime_dir = runtime_dir
        self.max_containers = s.max_containers
        self.max_age = s.max_age
        self.stop_timeout = cfg.daemon.stop_timeout
        self.engine = Engine(engine_path(s.engine))
        self.policy = Policy(
            allow_privileged=s.allow_privileged, memory=parse_memory(s.memory), engine_socket=engine_path(s.engine)
        )
        self.proxies: dict[str, ReplicaProxy] = {}
        self.live: dict[str, int] = {}  # replica (NAME-i) → its containers, as last seen
        self.envs: dict[str, str] = {}  # replica → its [[env]] name
        self.removals: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()
        self.created_total = 0
        self.engine_error: str | None = None

    @property
    def labels(self) -> list[str]:
        return [f"{JOB}={self.job}"]

    # ------------------------------------------------------------------ lifecycle

    async def prepare(self) -> None:
        """The engine answers, and nothing of an earlier launch of this job is left."""
        try:
            await self.engine.ping()
            swept = await sweep(self.engine, self.labels, self.stop_timeout)
        except EngineError as exc:
            raise SandboxUnavailable(f"[sandbox] engine {self.engine_url}: {exc}") from None
        self._count("crash", swept.containers)
        if swept.containers or swept.volumes or swept.networks:
            log.warning(
                "removed what an earlier launch of this job left on the container engine",
                containers=swept.containers,
                volumes=swept.volumes,
                networks=swept.networks,
                seconds=round(swept.seconds, 3),
            )

    def attach(self, name: str, spawn: Callable[..., Any]) -> Callable[[bool], Awaitable[None]]:
        """Bind the replica ``name``'s socket now and serve it from the daemon's task group; the
        answer is its unit's ``on_exit``, which removes its containers."""
        env, _, index = name.rpartition("-")
        owner = Owner(job=self.job, env=env, replica=int(index), launch=self.launch)
        old = self.proxies.pop(name, None)
        if old is not None:
            spawn(old.close)
        proxy = ReplicaProxy(
            owner,
            socket_path(self.runtime_dir, name),
            engine=self.engine,
            policy=self.policy,
            max_containers=self.max_containers,
            stats=self,
        )
        proxy.bind()
        self.proxies[name] = proxy
        self.envs[name] = env
        self.live.setdefault(name, 0)
        spawn(proxy.start)
        return self._on_exit(owner)

    async def detach(self, name: str) -> None:
        """A replica removed for good (``reload``): its socket closes (its containers went when
        its unit stopped)."""
        proxy = self.proxies.pop(name, None)
        self.live.pop(name, None)
        if proxy is not None:
            await proxy.close()

    def _on_exit(self, owner: Owner) -> Callable[[bool], Awaitable[None]]:
        async def on_exit(restarting: bool) -> None:
            await self.remove_replica(owner, "restart" if restarting else "stop")

        return on_exit

    async def remove_replica(self, owner: Owner, reason: str) -> None:
        """Every container of the replica (any launch), killed then removed within stop_timeout."""
        labels = [*self.labels, f"{ENV}={owner.env}", f"{REPLICA}={owner.replica}"]
        try:
            swept = await sweep(self.engine, labels, self.stop_timeout, containers_only=True)
        except EngineError as exc:
            log.error("removing an environment's containers failed", unit=owner.unit, error=str(exc))
            return
        self._count(reason, swept.containers)
        self.live[owner.unit] = 0
        proxy = self.proxies.get(owner.unit)
        if proxy is not None:
            proxy.containers.clear()
            proxy.execs.clear()
        if swept.containers or swept.left:
            log.info(
                "removed an environment's containers",
                unit=owner.unit,
                reason=reason,
                removed=swept.containers,
                left=swept.left,
                seconds=round(swept.seconds, 3),
            )

    async def run(self) -> None:
        """Live counts, and containers past max_age removed, every POLL_S."""
        while True:
            await anyio.sleep(POLL_S)
            try:
                await self.poll()
            except EngineError as exc:
                if self.engine_error is None:
                    log.error("the container engine does not answer", error=str(exc))
                self.engine_error = str(exc)

    async def poll(self) -> None:
        found = await self.engine.containers(self.labels)
        self.engine_error = None
        counts: Counter[str] = Counter()
        old: list[str] = []
        now = time.time()
        for c in found:
            labels = c.get("Labels") or {}
            counts[f"{labels.get(ENV)}-{labels.get(REPLICA)}"] += 1
            created = c.get("Created")
            if isinstance(created, (int, float)) and now - created > self.max_age and isinstance(c.get("Id"), str):
                old.append(c["Id"])
        self.live = {unit: counts.get(unit, 0) for unit in self.proxies} | dict(counts)
        if old:
            from atroposd.sandbox.reaper import remove_containers

            removed, left = await remove_containers(self.engine, old, self.stop_timeout)
            self._count("max_age", removed)
            log.warning("removed containers past [sandbox] max_age", removed=removed, left=len(left))

    async def close(self) -> None:
        """Stop: the proxies close, every object labelled with the job is removed."""

        async def close_one(proxy: ReplicaProxy) -> None:
            try:
                await proxy.close()
            except Exception:
                log.exception("closing an environment's engine socket failed", unit=proxy.owner.unit)

        async with anyio.create_task_group() as tg:
            for proxy in list(self.proxies.values()):
                tg.start_soon(close_one, proxy)
        try:
            swept = await sweep(self.engine, self.labels, self.stop_timeout)
            self._count("stop", swept.containers)
            if swept.containers or swept.volumes or swept.networks or swept.left:
                log.info(
                    "removed the job's containers",
                    containers=swept.containers,
                    volumes=swept.volumes,
                    networks=swept.networks,
                    left=swept.left,
                    seconds=round(swept.seconds, 3),
                )
        except EngineError as exc:
            log.error("removing the job's containers failed", error=str(exc))
        finally:
            await self.engine.close()
        try:
            (self.runtime_dir / "sandbox").rmdir()
        except OSError:
            pass

    # ------------------------------------------------------------------ counts (proxy → here)

    def _count(self, reason: str, n: int) -> None:
        if n:
            self.removals[reason] += n

    def created(self, owner: Owner, cid: str) -> None:
        self.created_total += 1
        self.live[owner.unit] = self.live.get(owner.unit, 0) + 1

    def removed(self, owner: Owner, cid: str) -> None:
        self.removals["client"] += 1
        self.live[owner.unit] = max(0, self.live.get(owner.unit, 0) - 1)

    def refused(self, owner: Owner, reason: str) -> None:
        self.refusals[reason] += 1

    # ------------------------------------------------------------------ status and metrics

    def by_env(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for unit, n in self.live.items():
            env = self.envs.get(unit, unit.rpartition("-")[0])
            out[env] = out.get(env, 0) + n
        return out

    def status(self) -> dict[str, Any]:
        return {
            "engine": self.engine_url,
            "job": self.job,
            "engine_error": self.engine_error,
            "containers": dict(self.live),
            "containers_by_env": self.by_env(),
            "created": self.created_total,
            "removed": {r: self.removals.get(r, 0) for r in dict.fromkeys([*REASONS, *self.removals])},
            "refused": {r: n for r, n in self.refusals.items() if n},
        }

    def families(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        live = GaugeMetricFamily(
            "atroposd_sandbox_containers", "Live containers of each environment (all its replicas)", labels=["env"]
        )
        for env, n in self.by_env().items():
            live.add_metric([env], float(n))
        yield live
        removed = CounterMetricFamily(
            "atroposd_sandbox_removed",
            "Containers removed, by reason (restart, stop, crash: an earlier launch's, max_age, client)",
            labels=["reason"],
        )
        for reason in dict.fromkeys([*REASONS, *self.removals]):
            removed.add_metric([reason], float(self.removals.get(reason, 0)))
        yield removed
        refused = CounterMetricFamily(
            "atroposd_sandbox_refused",
            "Requests on the environments' engine sockets refused, by reason",
            labels=["reason"],
        )
        for reason in dict.fromkeys([*REFUSALS, *self.refusals]):
            refused.add_metric([reason], float(self.refusals.get(reason, 0)))
        yield refused

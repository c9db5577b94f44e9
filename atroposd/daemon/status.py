"""Status and metrics: ``status --json`` (SPEC §2), the sd_notify line and Prometheus gauges.

Everything here reads the daemon through :class:`DaemonView` — what it is, not how it runs —
so these are assembled the same way from the live daemon or from a test's stand-in.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.abc

from atroposd.config import Config
from atroposd.daemon.specs import api_headers
from atroposd.daemon.state import DaemonState
from atroposd.process.probes import get_ok
from atroposd.process.unit import State, Unit

if TYPE_CHECKING:
    import aiohttp
    from prometheus_client.metrics_core import Metric

    from atroposd.daemon.watchdog import StallWatchdog

PROBE_TIMEOUT = 1.5


class TrainerView(Protocol):
    def status(self) -> dict[str, Any]: ...


class DaemonView(Protocol):
    """What status and metrics read of the daemon."""

    @property
    def cfg(self) -> Config: ...
    @property
    def units(self) -> Mapping[str, Unit]: ...
    @property
    def trainer(self) -> TrainerView | None: ...
    @property
    def state(self) -> DaemonState: ...
    @property
    def pid(self) -> int: ...
    @property
    def nonce(self) -> str: ...
    @property
    def start_error(self) -> str | None: ...
    @property
    def watchdog(self) -> StallWatchdog | None: ...
    def uptime(self) -> float: ...


def trainer_status(d: DaemonView) -> dict[str, Any] | None:
    """The trainer's status, ``stalled`` (with ``stalled_for_s`` and the stage) while a stall lasts."""
    if d.trainer is None:
        return None
    st = d.trainer.status()
    return d.watchdog.annotate(st) if d.watchdog is not None else st


def _session(timeout: float) -> aiohttp.ClientSession:
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout))


async def status(d: DaemonView) -> dict[str, Any]:
    """The object of ``status --json`` (SPEC §2)."""
    cfg = d.cfg
    components: list[dict[str, Any]] = []
    async with _session(PROBE_TIMEOUT) as session:
        for kind, enabled, url in (("api", cfg.api.enabled, f"{cfg.api_url}/info"),
                                   ("inference", cfg.inference.enabled, f"{cfg.inference_url}/health")):
            if enabled:
                rows = [u.status() for u in d.units.values() if u.kind == kind]
                if kind == "inference":
                    await _replica_health(cfg, session, rows)
                components += rows
                continue
            # External components are probed, not supervised.
            ok = await get_ok(session, url, api_headers(cfg) if kind == "api" else None)
            components.append({"name": kind, "kind": kind, "external": True,
                               "state": "ready" if ok else "unreachable", "pid": None, "restarts": 0,
                               "last_exit": None, "since_s": None, "url": url})
        components += [u.status() for u in d.units.values() if u.kind == "env"]
        queue = await _queue(cfg, session)
    return {"state": d.state.value, "pid": d.pid, "uptime_s": round(d.uptime(), 3),
            "config": cfg.source, "instance": d.nonce, "components": components,
            "trainer": trainer_status(d), "queue": queue,
            "start_error": d.start_error}


def replica_index(name: str) -> int:
    """The replica index of an inference component: ``inference`` is 0, ``inference-<i>`` is i."""
    _, _, tail = name.partition("-")
    return int(tail) if tail.isdigit() else 0


async def _replica_health(cfg: Config, session: aiohttp.ClientSession, rows: list[dict[str, Any]]) -> None:
    """Each inference replica's URL, the weight_version it serves and the generations it
    answered (its ``/health``; None when it does not answer), asked of all at once."""
    import aiohttp

    urls = cfg.inference_urls

    async def one(row: dict[str, Any]) -> None:
        i = replica_index(row["name"])
        url = urls[i] if i < len(urls) else urls[0]
        row.update(url=url, weight_version=None, generations=None)
        try:
            async with session.get(f"{url}/health") as resp:
                data = await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return
        if isinstance(data, dict):
            row.update(weight_version=data.get("weight_version"), generations=data.get("generations"))

    async with anyio.create_task_group() as tg:
        for row in rows:
            tg.start_soon(one, row)


async def _queue(cfg: Config, session: aiohttp.ClientSession) -> dict[str, Any] | None:
    import aiohttp

    try:
        async with session.get(f"{cfg.api_url}/status", headers=api_headers(cfg)) as resp:
            if resp.status != 200:
                return None
            data = await resp.json(content_type=None)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return {"sequences": data.get("queued_sequences", data.get("queue_size")),
            "capacity": data.get("capacity") if cfg.api.enabled else None}


def status_line(d: DaemonView) -> str:
    """One line for systemd's STATUS=."""
    units = list(d.units.values())
    ready = sum(u.state == State.READY for u in units)
    text = f"{d.state.value}: {ready}/{len(units)} components ready"
    st = trainer_status(d)
    if st is not None:
        text += f"; trainer {st.get('state')} step {st.get('step')}/{st.get('total_steps')}"
        if st.get("state") == "stalled":
            text += f" for {st.get('stalled_for_s')}s at {st.get('stage')}"
    return text


# ----------------------------------------------------------------------------- metrics

_TRAINER_GAUGES = (("step", "Optimizer steps done"), ("weight_version", "Weights served"),
                   ("reward_mean", "Mean reward of the last batch"),
                   ("accuracy", "Exact-match accuracy of the last batch"),
                   ("loss", "Loss of the last step"), ("steps_per_s", "Optimizer steps per second"))


class DaemonCollector:
    """Component states, restarts and trainer progress as Prometheus gauges."""

    def __init__(self, daemon: DaemonView) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        d = self.daemon
        up = GaugeMetricFamily("atroposd_uptime_seconds", "Seconds since the daemon started")
        up.add_metric([], d.uptime())
        yield up
        state = GaugeMetricFamily("atroposd_component_state", "1 for the state each component is in",
                                  labels=["component", "kind", "state"])
        restarts = CounterMetricFamily("atroposd_component_restarts", "Restarts of each component",
                                       labels=["component", "kind"])
        dropped = CounterMetricFamily("atroposd_component_log_dropped_bytes",
                                      "Output a component wrote faster than its log could take",
                                      labels=["component", "kind"])
        for u in list(d.units.values()):
            for st in State:
                state.add_metric([u.name, u.kind, st.value], 1.0 if u.state == st else 0.0)
            restarts.add_metric([u.name, u.kind], u.restarts)
            dropped.add_metric([u.name, u.kind], u.status()["log_dropped_bytes"])
        yield state
        yield restarts
        yield dropped
        hung = CounterMetricFamily("atroposd_component_hung", "Times each component was stopped as hung",
                                   labels=["component", "kind"])
        for u in list(d.units.values()):
            hung.add_metric([u.name, u.kind], u.hung_count)
        yield hung
        t = trainer_status(d)
        if t is not None:
            for key, help_text in _TRAINER_GAUGES:
                if isinstance(t.get(key), (int, float)):
                    g = GaugeMetricFamily(f"atroposd_trainer_{key}", help_text)
                    g.add_metric([], float(t[key]))
                    yield g
            from atroposd.daemon.watchdog import STAGES

            stalled = GaugeMetricFamily("atroposd_trainer_stalled_seconds",
                                        "Seconds the trainer has made no step, by the stage that is stuck "
                                        "(0 while it advances)", labels=["stage"])
            for stage in STAGES:
                stalled.add_metric([stage], float(t.get("stalled_for_s") or 0.0) if t.get("stage") == stage else 0.0)
            yield stalled


async def serve_metrics(d: DaemonView, port: int, *,
                        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Prometheus text on 127.0.0.1:``port``, read from the live state at each scrape."""
    from aiohttp import web
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(d))

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        task_status.started()
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            await runner.cleanup()

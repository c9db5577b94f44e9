"""The daemon's background poll of every inference replica's ``/health``, against real HTTP servers
on loopback: the latest generations and weight_version of each, the last known values of a
replica that stopped answering (None before its first answer), bounded by the poll's timeout;
and the same values on the whole job's ``/metrics``, one series per replica."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from atroposd.config import parse_config
from atroposd.daemon.metrics import exposition
from atroposd.daemon.replicas import ReplicaHealth
from tests.daemon.views import Trainer, View
from tests.support import free_port, free_port_pair


@asynccontextmanager
async def replica(port: int, body: dict[str, Any], *, hang: bool = False) -> AsyncIterator[dict[str, Any]]:
    """A real /health on loopback answering ``body`` (changed in place by the test), or never."""

    async def health(_: web.Request) -> web.Response:
        if hang:
            await anyio.sleep(30)
        return web.json_response(body)

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        yield body
    finally:
        await runner.cleanup()


def _cfg(port: int, replicas: int = 2) -> Any:
    return parse_config(
        {
            "inference": {"replicas": replicas, "port": port},
            "api": {"port": port + replicas},
            "trainer": {"enabled": False},
        }
    )


def test_names_and_urls_follow_the_components() -> None:
    port = free_port_pair()
    health = ReplicaHealth.of(_cfg(port))
    assert [(r.name, r.url) for r in health.replicas] == [
        ("inference-0", f"http://127.0.0.1:{port}"),
        ("inference-1", f"http://127.0.0.1:{port + 1}"),
    ]
    one = ReplicaHealth.of(_cfg(port, replicas=1))
    assert [r.name for r in one.replicas] == ["inference"]
    assert health.generations() == [None, None]  # nothing known before the first answer
    with pytest.raises(ValueError, match="2 replica names for 1 URLs"):
        ReplicaHealth(["a", "b"], ["http://127.0.0.1:1"])


def test_latest_values_and_the_last_known_of_a_replica_that_went_quiet() -> None:
    import aiohttp

    port = free_port_pair()
    health = ReplicaHealth.of(_cfg(port), timeout=0.5)

    async def main() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        async with aiohttp.ClientSession() as session:
            async with replica(port, {"status": "ok", "weight_version": 3, "generations": 5}) as zero:
                async with replica(port + 1, {"status": "ok", "weight_version": 3, "generations": 7}):
                    await health.poll(session)
                    seen["both"] = health.generations()
                    zero["generations"], zero["weight_version"] = 9, 4
                    await health.poll(session)
                    seen["later"] = health.generations()
                # replica 1 is gone: it keeps its last count, and is marked down
                await health.poll(session)
                seen["one_gone"] = (health.generations(), [r.up for r in health.replicas])
            # replica 0 hangs: the poll is bounded by its timeout
            async with replica(port, {}, hang=True):
                start = time.monotonic()
                await health.poll(session)
                seen["took"] = time.monotonic() - start
        return seen

    seen = anyio.run(main)
    assert seen["both"] == [5, 7]
    assert seen["later"] == [9, 7]
    assert seen["one_gone"] == ([9, 7], [True, False])
    assert seen["took"] < 2.0
    assert health.generations() == [9, 7] and [r.weight_version for r in health.replicas] == [4, 3]
    assert health.polls == 4


def test_run_polls_in_the_background_until_cancelled() -> None:
    port = free_port_pair()
    health = ReplicaHealth.of(_cfg(port), interval=0.05, timeout=0.5)

    async def until(count: int) -> None:
        with anyio.fail_after(5):
            while health.generations()[0] != count:  # noqa: ASYNC110 - watching another task's state
                await anyio.sleep(0.02)

    async def main() -> None:
        async with replica(port, {"generations": 2, "weight_version": 1}) as zero:
            async with anyio.create_task_group() as tg:
                tg.start_soon(health.run)
                await until(2)
                zero["generations"] = 6
                await until(6)
                tg.cancel_scope.cancel()

    anyio.run(main)
    assert health.generations() == [6, None]


def test_metrics_has_each_replicas_generations_and_weight_version_and_the_gather_time() -> None:
    import aiohttp

    port = free_port_pair()
    cfg = parse_config(
        {
            "inference": {"replicas": 2, "port": port, "enabled": True},
            "api": {"enabled": False, "url": f"http://127.0.0.1:{free_port()}"},
            "trainer": {"enabled": False},
        }
    )
    health = ReplicaHealth.of(cfg, timeout=0.5)
    trainer = Trainer(
        {"state": "training", "step": 3, "total_steps": 10},
        last={"batch_wait_s": 0.1, "compute_s": 0.2, "sync_s": 0.05, "gather_s": 0.02},
    )

    async def main() -> str:
        async with replica(port, {"weight_version": 4, "generations": 11}):
            async with aiohttp.ClientSession() as session:
                await health.poll(session)  # replica 1 never answered
        view = View(cfg, trainer=trainer, replica_health=health)
        return (await exposition(view, deadline_s=0.5)).decode()

    text = anyio.run(main)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("atroposd_replica_generations_total", (("component", "inference-0"),))] == 11
    assert samples[("atroposd_replica_weight_version", (("component", "inference-0"),))] == 4
    assert samples[("atroposd_replica_generations_total", (("component", "inference-1"),))] == 0
    assert (
        samples[("atroposd_replica_weight_version", (("component", "inference-1"),))]
        != samples[("atroposd_replica_weight_version", (("component", "inference-1"),))]
    )  # NaN: never answered
    assert samples[("atroposd_trainer_last_gather_seconds", (("component", "trainer"),))] == 0.02
    assert samples[("atroposd_trainer_gather_seconds_total", (("component", "trainer"),))] == 0.125
    # gather is inside the sync part, not a part of its own: the split still sums to the step
    assert ("atroposd_trainer_step_seconds_total", (("component", "trainer"), ("part", "gather"))) not in samples

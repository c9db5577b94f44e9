"""The whole job's /metrics, gathered from a view of the daemon and real HTTP children on loopback."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from atroposd.config import parse_config
from atroposd.daemon.metrics import exposition
from tests.daemon.views import Trainer, View
from tests.support import free_port

CHILD_TEXT = """# HELP atroposd_api_refused_total Submissions refused
# TYPE atroposd_api_refused_total counter
atroposd_api_refused_total{reason="full"} 3.0
atroposd_api_refused_total{reason="spool"} 0.0
# HELP atroposd_api_queue_sequences Sequences held
# TYPE atroposd_api_queue_sequences gauge
atroposd_api_queue_sequences 12.0
# HELP process_open_fds Number of open file descriptors.
# TYPE process_open_fds gauge
process_open_fds 7.0
"""


@asynccontextmanager
async def child(port: int, *, hang: bool = False) -> AsyncIterator[None]:
    """A real HTTP server on loopback serving CHILD_TEXT (or never answering)."""
    from aiohttp import web

    async def metrics(_: web.Request) -> web.Response:
        if hang:
            await anyio.sleep(30)
        return web.Response(text=CHILD_TEXT, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        yield
    finally:
        await runner.cleanup()


def _view(api_port: int, inference_port: int, trainer: Trainer | None = None) -> View:
    cfg = parse_config({"api": {"enabled": False, "url": f"http://127.0.0.1:{api_port}"},
                        "inference": {"enabled": False, "url": f"http://127.0.0.1:{inference_port}"},
                        "trainer": {"enabled": False}})
    return View(cfg, trainer=trainer, uptime_s=12.5)


def _parse(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _samples(families: dict[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}


def test_children_merged_with_component_labels_and_a_silent_child_is_down() -> None:
    api_port, inference_port = free_port(), free_port()
    trainer = Trainer({"state": "training", "step": 3, "total_steps": 10, "loss": 0.5,
                       "rejected_groups": {"too_long": 2}, "skipped_steps": 1},
                      last={"batch_wait_s": 0.1, "compute_s": 0.2, "sync_s": 0.05, "mean_kl": 0.01})

    async def main() -> tuple[str, float]:
        async with child(api_port), child(inference_port, hang=True):
            start = time.monotonic()
            body = await exposition(_view(api_port, inference_port, trainer), deadline_s=0.5)
            return body.decode(), time.monotonic() - start

    text, took = anyio.run(main)
    assert took < 2.0  # the silent child costs its deadline, no more
    families = _parse(text)  # a valid exposition: one TYPE per family, or the parser refuses it
    assert text.count("# TYPE atroposd_component_up gauge") == 1
    samples = _samples(families)
    assert samples[("atroposd_component_up", (("component", "api"),))] == 1.0
    assert samples[("atroposd_component_up", (("component", "inference"),))] == 0.0
    assert samples[("atroposd_component_up", (("component", "trainer"),))] == 1.0
    # a child's families: prefixed, labelled with the component
    assert samples[("atroposd_api_refused_total", (("component", "api"), ("reason", "full")))] == 3.0
    assert samples[("atroposd_process_open_fds", (("component", "api"),))] == 7.0
    # the trainer: the step split, rejected groups by reason (every known reason from 0)
    assert samples[("atroposd_trainer_last_step_seconds", (("component", "trainer"), ("part", "sync")))] == 0.05
    assert samples[("atroposd_trainer_step_seconds_total", (("component", "trainer"), ("part", "compute")))] == 2.0
    assert samples[("atroposd_trainer_rejected_groups_total", (("component", "trainer"), ("reason", "too_long")))] == 2
    assert samples[("atroposd_trainer_rejected_groups_total",
                    (("component", "trainer"), ("reason", "token_out_of_range")))] == 0
    assert samples[("atroposd_trainer_kl", (("component", "trainer"),))] == 0.01
    assert samples[("atroposd_trainer_skipped_steps_total", (("component", "trainer"),))] == 1
    assert samples[("atroposd_trainer_state", (("component", "trainer"), ("state", "training")))] == 1
    assert samples[("atroposd_daemon_state", (("component", "daemon"), ("state", "running")))] == 1
    # every series names its component
    assert all("component" in s.labels for f in families.values() for s in f.samples)


def test_no_child_answering_still_gives_a_valid_page() -> None:
    view = _view(free_port(), free_port())
    text = anyio.run(exposition, view).decode()
    samples = _samples(_parse(text))
    assert samples[("atroposd_component_up", (("component", "api"),))] == 0.0
    assert samples[("atroposd_component_up", (("component", "inference"),))] == 0.0
    assert samples[("atroposd_uptime_seconds", (("component", "daemon"),))] == 12.5


@pytest.mark.parametrize("route", ["generate"])
def test_inference_metrics_start_at_zero_for_each_route(route: str) -> None:
    from atroposd.inference.metrics import InferenceMetrics

    text = InferenceMetrics(lambda: None).render().decode()
    samples = _samples(_parse(text))
    assert samples[("atroposd_inference_requests_total", (("outcome", "ok"), ("route", route)))] == 0.0
    assert samples[("atroposd_inference_engine_ready", ())] == 0.0

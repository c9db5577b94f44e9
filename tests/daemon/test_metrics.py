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
    cfg = parse_config(
        {
            "api": {"enabled": False, "url": f"http://127.0.0.1:{api_port}"},
            "inference": {"enabled": False, "url": f"http://127.0.0.1:{inference_port}"},
            "trainer": {"enabled": False},
        }
    )
    return View(cfg, trainer=trainer, uptime_s=12.5)


def _parse(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _samples(families: dict[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}


def test_children_merged_with_component_labels_and_a_silent_child_is_down() -> None:
    api_port, inference_port = free_port(), free_port()
    trainer = Trainer(
        {
            "state": "training",
            "step": 3,
            "total_steps": 10,
            "loss": 0.5,
            "rejected_groups": {"too_long": 2},
            "skipped_steps": 1,
        },
        last={"batch_wait_s": 0.1, "compute_s": 0.2, "sync_s": 0.05, "mean_kl": 0.01},
    )

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
    assert (
        samples[
            ("atroposd_trainer_rejected_groups_total", (("component", "trainer"), ("reason", "token_out_of_range")))
        ]
        == 0
    )
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


# ---------------------------------------------------------------------------- what a scrape may cost, who may read it


@asynccontextmanager
async def counting_child(
    port: int, hits: list[str], *, body: bytes | None = None, chunked: bool = False, delay: float = 0.0
) -> AsyncIterator[None]:
    """A real child on loopback that counts its scrapes (the Authorization header each sent)."""
    from aiohttp import web

    async def metrics(request: web.Request) -> web.StreamResponse:
        hits.append(request.headers.get("Authorization", ""))
        await anyio.sleep(delay)
        data = CHILD_TEXT.encode() if body is None else body
        if not chunked:
            return web.Response(body=data, content_type="text/plain")
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(0, len(data), 1 << 14):
            await resp.write(data[i : i + (1 << 14)])
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        yield
    finally:
        await runner.cleanup()


@asynccontextmanager
async def daemon_metrics(view: View, port: int) -> AsyncIterator[None]:
    from atroposd.daemon.metrics import serve_metrics

    async with anyio.create_task_group() as tg:
        await tg.start(serve_metrics, view, port)
        try:
            yield
        finally:
            tg.cancel_scope.cancel()


async def _get(port: int, headers: dict[str, str] | None = None) -> tuple[int, str]:
    import aiohttp

    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/metrics", headers=headers or {}) as resp,
    ):
        return resp.status, await resp.text()


def _token_view(api_port: int, inference_port: int, *, metrics_token: str = "") -> View:
    cfg = parse_config(
        {
            "daemon": {"metrics_token": metrics_token},
            "api": {"enabled": False, "url": f"http://127.0.0.1:{api_port}", "token": "a" * 24},
            "inference": {"enabled": False, "url": f"http://127.0.0.1:{inference_port}"},
            "trainer": {"enabled": False},
        }
    )
    return View(cfg)


def test_a_scrape_storm_makes_one_fetch_of_the_children() -> None:
    """50 scrapes at once while the children answer slowly: one fetch of each child, one page for
    all; the page is kept a second, then gathered again."""
    from atroposd.daemon.metrics import CACHE_S

    api_port, inference_port, port = free_port(), free_port(), free_port()
    api_hits: list[str] = []
    inference_hits: list[str] = []

    async def main() -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
        async with (
            counting_child(api_port, api_hits, delay=0.3),
            counting_child(inference_port, inference_hits, delay=0.3),
            daemon_metrics(_view(api_port, inference_port), port),
        ):
            storm: list[tuple[int, str]] = []

            async def one() -> None:
                storm.append(await _get(port))

            async with anyio.create_task_group() as tg:
                for _ in range(50):
                    tg.start_soon(one)
            again = [await _get(port)]  # within the cache
            await anyio.sleep(CACHE_S + 0.1)
            again.append(await _get(port))
            return storm, again

    storm, again = anyio.run(main)
    assert len(storm) == 50 and {status for status, _ in storm} == {200}
    assert len({text for _, text in storm}) == 1 and len(again) == 2
    samples = _samples(_parse(storm[0][1]))
    assert samples[("atroposd_component_up", (("component", "api"),))] == 1.0
    assert len(api_hits) == len(inference_hits) == 2  # the storm's one fetch, then the one after the cache


def test_childrens_text_is_parsed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from atroposd.daemon import metrics

    api_port, inference_port = free_port(), free_port()
    threads: list[threading.Thread] = []
    real = metrics._parse_child

    def spy(component: str, text: bytes | None) -> Any:
        threads.append(threading.current_thread())
        return real(component, text)

    monkeypatch.setattr(metrics, "_parse_child", spy)

    async def main() -> threading.Thread:
        async with counting_child(api_port, []), counting_child(inference_port, []):
            await exposition(_view(api_port, inference_port))
        return threading.current_thread()

    loop_thread = anyio.run(main)
    assert len(threads) == 2 and all(t is not loop_thread for t in threads)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_child_over_the_size_cap_counts_as_down(monkeypatch: pytest.MonkeyPatch, chunked: bool) -> None:
    from atroposd.daemon import metrics

    monkeypatch.setattr(metrics, "MAX_CHILD_BYTES", 64 << 10)
    api_port, inference_port = free_port(), free_port()
    big = CHILD_TEXT.encode() + b"".join(b"atroposd_pad_%d 1.0\n" % i for i in range(8000))  # ~150 KB

    async def main() -> str:
        async with counting_child(api_port, [], body=big, chunked=chunked), counting_child(inference_port, []):
            return (await exposition(_view(api_port, inference_port))).decode()

    samples = _samples(_parse(anyio.run(main)))
    assert samples[("atroposd_component_up", (("component", "api"),))] == 0.0
    assert samples[("atroposd_component_up", (("component", "inference"),))] == 1.0
    assert not any(name.startswith("atroposd_pad") for name, _ in samples)


def test_only_this_hosts_names_are_answered() -> None:
    """DNS rebinding: a page that renamed an attacker's host to 127.0.0.1 sends its own Host."""
    port = free_port()

    async def main() -> list[int]:
        async with daemon_metrics(_view(free_port(), free_port()), port):
            return [
                (await _get(port, {"Host": host}))[0]
                for host in (
                    "evil.example",
                    "evil.example:80",
                    f"localhost:{port}",
                    f"127.0.0.1:{port}",
                    f"[::1]:{port}",
                )
            ]

    assert anyio.run(main) == [421, 421, 200, 200, 200]


def test_token_protected_series_need_the_metrics_token() -> None:
    """The API has a token: its series are re-served only with [daemon] metrics_token (not even
    fetched without); a wrong token is refused; without a metrics_token they are always left out."""
    api_port, inference_port, port = free_port(), free_port(), free_port()
    api_hits: list[str] = []

    async def main(view: View) -> list[tuple[int, str]]:
        async with counting_child(api_port, api_hits), counting_child(inference_port, []), daemon_metrics(view, port):
            return [
                await _get(port),
                await _get(port, {"Authorization": "Bearer " + "m" * 24}),
                await _get(port, {"Authorization": "Bearer wrong"}),
            ]

    (plain, good, wrong) = anyio.run(main, _token_view(api_port, inference_port, metrics_token="m" * 24))
    assert plain[0] == 200 and 'component="api",' not in plain[1]
    samples = _samples(_parse(plain[1]))
    assert samples[("atroposd_component_withheld", (("component", "api"),))] == 1.0
    assert ("atroposd_component_up", (("component", "api"),)) not in samples
    assert samples[("atroposd_process_open_fds", (("component", "inference"),))] == 7.0  # no token: served
    assert good[0] == 200 and 'atroposd_api_refused_total{component="api",reason="full"} 3.0' in good[1]
    assert wrong[0] == 401
    assert api_hits == ["Bearer " + "a" * 24]  # fetched once, with the API's token, for the good scrape

    async def good_first(view: View) -> list[tuple[int, str]]:
        async with counting_child(api_port, []), counting_child(inference_port, []), daemon_metrics(view, port):
            return [await _get(port, {"Authorization": "Bearer " + "m" * 24}), await _get(port)]

    # within the cache's second: the page gathered for the token is not the one a plain scrape gets
    good, plain = anyio.run(good_first, _token_view(api_port, inference_port, metrics_token="m" * 24))
    assert 'component="api",' in good[1] and plain[0] == 200 and 'component="api",' not in plain[1]

    api_hits.clear()
    plain, good, wrong = anyio.run(main, _token_view(api_port, inference_port))
    assert plain[0] == 200 and 'component="api",' not in plain[1]
    assert good[0] == wrong[0] == 401 and api_hits == []

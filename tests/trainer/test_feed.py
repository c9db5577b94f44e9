"""The feed's reading of ``/batch`` answers it cannot take at face value (a real HTTP server on
loopback): NaN literals reach batch preparation, a body that is not JSON is "no batch"."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from atroposd.trainer.feed import BatchFeed
from tests.support import free_port

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def batch_server(body: bytes) -> AsyncIterator[str]:
    async def batch(_request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/batch", batch)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _fetch(body: bytes) -> list[dict[str, object]] | None:
    async with batch_server(body) as url:
        feed = BatchFeed(url, dict, max_ahead=0)
        try:
            return await feed.fetch_once()
        finally:
            await feed.aclose()


async def test_nan_literals_reach_batch_preparation() -> None:
    body = b'{"batch": [{"tokens": [[1, 5, 2]], "masks": [[-100, 5, 2]], "scores": [NaN]}, {"scores": [Infinity]}]}'
    batch = await _fetch(body)
    assert batch is not None and len(batch) == 2
    assert math.isnan(batch[0]["scores"][0])  # type: ignore[index]


@pytest.mark.parametrize("body", [b"<html>502 Bad Gateway</html>", b'{"batch": [' * 100_000])
async def test_a_body_that_is_not_json_is_no_batch(body: bytes) -> None:
    assert await _fetch(body) is None


def _g(scores: list[float]) -> dict[str, object]:
    return {"tokens": [[1, 5, 2]] * len(scores), "masks": [[-100, 5, 2]] * len(scores), "scores": scores}


@asynccontextmanager
async def batches_server(
    batches: list[list[dict[str, object]]], then: list[dict[str, object]] | None
) -> AsyncIterator[str]:
    """/batch answers each of ``batches`` once, then ``then`` forever (None: no batch)."""
    import json

    async def batch(_request: web.Request) -> web.Response:
        body = batches.pop(0) if batches else then
        return web.Response(text=json.dumps({"batch": body}), content_type="application/json")

    app = web.Application()
    app.router.add_get("/batch", batch)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_filter_groups_fills_the_batch_from_further_fetches_and_passes_the_dropped_on() -> None:
    import anyio

    from atroposd.trainer.feed import GroupFilter

    eq, a, b, c = _g([1.0, 1.0]), _g([1.0, 0.0]), _g([0.5, 0.0]), _g([0.2, 0.3])
    reasons: list[str | None] = []
    async with batches_server([[eq, a], [eq, eq], [b, c]], None) as url:
        feed = BatchFeed(url, dict, max_ahead=0, group_filter=GroupFilter(4), on_wait=reasons.append)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(feed.run)
                got = await feed.next(data_timeout=30, envs_alive=lambda: True)
                tg.cancel_scope.cancel()
        finally:
            await feed.aclose()
    assert got == [a, b] and feed.last_filtered == [eq, eq, eq]
    assert feed.group_filter is not None and feed.group_filter.pending == [c]


async def test_only_equal_groups_make_the_trainer_wait_for_filtered() -> None:
    import anyio

    from atroposd.trainer.feed import GroupFilter

    reasons: list[str | None] = []
    async with batches_server([], [_g([0.0, 0.0])]) as url:
        feed = BatchFeed(url, dict, max_ahead=0, group_filter=GroupFilter(4), on_wait=reasons.append)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(feed.run)
                with anyio.move_on_after(1.5):
                    await feed.next(data_timeout=30, envs_alive=lambda: True)
                    raise AssertionError("a batch of groups that train nothing was delivered")
                tg.cancel_scope.cancel()
        finally:
            await feed.aclose()
    assert "filtered" in reasons and feed.group_filter is not None and feed.group_filter.filtered > 3


async def test_a_run_cancelled_while_polling_gives_its_slot_back() -> None:
    """The trainer group's restart cancels the feed's run and starts another: three restarts
    while no batch came must not use up the slots (max_staleness 2: three of them)."""
    import anyio

    batches: list[list[dict[str, object]]] = []
    async with batches_server(batches, None) as url:
        feed = BatchFeed(url, dict, max_ahead=2)
        try:
            for _ in range(3):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(feed.run)
                    await anyio.sleep(0.2)  # polling an API that has no batch
                    tg.cancel_scope.cancel()
            batches.append([_g([1.0, 0.0])])
            async with anyio.create_task_group() as tg:
                tg.start_soon(feed.run)
                with anyio.fail_after(10):
                    got = await feed.next(data_timeout=30, envs_alive=lambda: True)
                tg.cancel_scope.cancel()
        finally:
            await feed.aclose()
    assert got == [_g([1.0, 0.0])]

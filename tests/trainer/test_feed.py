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

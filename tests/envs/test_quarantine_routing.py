"""The built-in environments' client routes around a replica the sentinel quarantined (SPEC §15):
its 503 sends the request to another replica at once, and while its /info says ``quarantined``
the recheck does not take it back."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import anyio
import pytest
from aiohttp import web

from atroposd.envs.generate import RECHECK_S, InferenceClient
from tests.envs.conftest import FakeInference, start_fake_inference
from tests.support import free_port, stop_process

pytestmark = pytest.mark.anyio

PROMPT = [1, 6, 14, 7, 17]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeInference]:
    server = start_fake_inference(tmp_path)
    try:
        yield server
    finally:
        stop_process(server.proc)


@pytest.fixture
async def quarantined() -> AsyncIterator[tuple[str, dict[str, int]]]:
    """A replica as a quarantined inference server answers: 503 on /generate, /info quarantined."""
    hits = {"generate": 0, "info": 0}

    async def generate(_: web.Request) -> web.Response:
        hits["generate"] += 1
        return web.json_response({"error": "this replica is quarantined: drift"}, status=503)

    async def info(_: web.Request) -> web.Response:
        hits["info"] += 1
        return web.json_response({"ready": True, "awaiting_weights": False, "quarantined": True})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/info", info)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", hits
    finally:
        await runner.cleanup()


async def test_a_quarantined_replica_is_routed_around_and_not_taken_back(
    fake: FakeInference, quarantined: tuple[str, dict[str, int]]
) -> None:
    url, hits = quarantined
    async with aiohttp.ClientSession() as session:
        client = InferenceClient(session, [url, fake.url])
        with anyio.fail_after(30):
            for _ in range(4):
                await client.generate(PROMPT, n=1, max_tokens=4, temperature=1.0)
            assert hits["generate"] <= 1  # its 503 marked it down: the others went to the fake
            await anyio.sleep(RECHECK_S + 0.2)
            for _ in range(4):
                await client.generate(PROMPT, n=1, max_tokens=4, temperature=1.0)
    assert hits["info"] >= 1  # it was asked again, and stayed out while quarantined
    assert hits["generate"] <= 1, hits
    assert client.served() == [0, 8]

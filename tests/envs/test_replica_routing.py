"""The built-in environments' inference client with several replicas (SPEC §12.2), against real
stand-in servers (tests/envs/fake_inference.py) on loopback: each generation goes to the ready
replica with the fewest requests in flight; a replica killed -9 is skipped, and used again once
it is back."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import anyio
import pytest

from atroposd.envs.generate import InferenceClient
from tests.envs.conftest import FakeInference, start_fake_inference
from tests.support import stop_process

pytestmark = pytest.mark.anyio

PROMPT = [1, 6, 14, 7, 17]  # "2+3=" in the stand-in's vocabulary


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def two_fakes(tmp_path: Path) -> Iterator[list[FakeInference]]:
    servers: list[FakeInference] = []
    try:
        servers.append(start_fake_inference(tmp_path))
        servers.append(start_fake_inference(tmp_path))
        yield servers
    finally:
        for s in servers:
            stop_process(s.proc)


async def _generate(client: InferenceClient) -> int | None:
    gen = await client.generate(PROMPT, n=2, max_tokens=4, temperature=1.0)
    assert len(gen.completions) == 2
    return gen.weight_version


async def test_both_replicas_serve_counted_per_replica(two_fakes: list[FakeInference]) -> None:
    async with aiohttp.ClientSession() as session:
        client = InferenceClient(session, [s.url for s in two_fakes])
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for _ in range(24):
                    tg.start_soon(_generate, client)
    served = [s.stats()["requests"] for s in two_fakes]
    assert sum(served) == 24 and min(served) >= 6, served  # both serve, about evenly
    assert client.served() == served


async def test_a_busy_replica_gets_no_new_request_until_the_other_is_as_busy(two_fakes: list[FakeInference]) -> None:
    a, b = two_fakes
    a.post("/hold")  # a's requests wait: it has one in flight
    async with aiohttp.ClientSession() as session:
        client = InferenceClient(session, [a.url, b.url])
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_generate, client)
                while a.stats()["in_flight"] != 1:  # noqa: ASYNC110 - a remote server's state
                    await anyio.sleep(0.01)
                for _ in range(5):  # one at a time: b has 0 in flight, a has 1
                    await _generate(client)
                assert (a.stats()["requests"], b.stats()["requests"]) == (1, 5)
                a.post("/release")
    assert client.served() == [1, 5]


async def test_a_killed_replica_is_skipped_then_used_again(tmp_path: Path, two_fakes: list[FakeInference]) -> None:
    a, b = two_fakes
    port = int(a.url.rsplit(":", 1)[1])
    async with aiohttp.ClientSession() as session:
        client = InferenceClient(session, [a.url, b.url])
        with anyio.fail_after(60):
            for _ in range(4):
                await _generate(client)
            assert client.served() == [2, 2]
            os.kill(a.proc.pid, signal.SIGKILL)
            a.proc.wait(10)
            for _ in range(6):  # generation goes on through b, none lost
                await _generate(client)
            assert client.served() == [2, 8]
            assert client.replicas[0].down
            two_fakes[0] = back = start_fake_inference(tmp_path, port=port)
            # once it answers ready again (checked at most every second), it takes work again
            while back.stats()["requests"] == 0:
                await _generate(client)
    assert not client.replicas[0].down


async def test_one_url_waits_for_its_server_as_before(tmp_path: Path) -> None:
    """With one replica nothing is skipped: a server that is down is waited for (backoff)."""
    from tests.support import free_port

    port = free_port()
    async with aiohttp.ClientSession() as session:
        client = InferenceClient(session, f"http://127.0.0.1:{port}/v1")
        server: FakeInference | None = None
        try:
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_generate, client)
                    while client.retries == 0:  # noqa: ASYNC110
                        await anyio.sleep(0.01)
                    server = start_fake_inference(tmp_path, port=port)
            assert client.served() == [1] and server.stats()["requests"] == 1
        finally:
            if server is not None:
                stop_process(server.proc)

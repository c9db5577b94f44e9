"""Real servers for the trainer's integration tests: atroposlib's run-api as a subprocess, an
inference stand-in that answers ``GET /info`` on loopback, and a rollout producer that posts
scored groups the way an environment does."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
from aiohttp import web

from tests.support import free_port, spawn, stop_process, wait_http
from tests.trainer.conftest import make_group

RUN_API = Path(sys.executable).parent / "run-api"


@contextmanager
def run_api(log: Path, port: int | None = None) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """atroposlib's reference run-api on a free loopback port."""
    port = port or free_port()
    proc = spawn([str(RUN_API), "--host", "127.0.0.1", "--port", str(port)], log=log)
    try:
        wait_http(f"http://127.0.0.1:{port}/info", timeout=60, proc=proc)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        stop_process(proc)


@asynccontextmanager
async def info_server(tokenizer: dict[str, Any], port: int) -> AsyncIterator[str]:
    """An inference stand-in: ``GET /info`` with the given tokenizer fingerprint."""
    async def info(_request: web.Request) -> web.Response:
        return web.json_response({"model": "stand-in", "engine": "test", "weight_version": 0,
                                  "tokenizer": tokenizer, "awaiting_weights": False})

    app = web.Application()
    app.router.add_get("/info", info)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def produce(api_url: str, group_size: int = 8, max_queue: int = 4, seed: int = 0,
                  accuracy: float | None = 0.25) -> None:
    """Register as an environment (once the trainer has started) and keep the queue topped up."""
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as http:
        env_id = None
        while env_id is None:
            body = {"max_token_length": 64, "desired_name": "stand-in", "weight": 1.0,
                    "group_size": group_size, "min_batch_allocation": None}
            async with http.post(f"{api_url}/register-env", json=body) as resp:
                data = await resp.json()
            if data.get("status") == "success":
                env_id = data["env_id"]
            else:
                await anyio.sleep(0.02)
        while True:
            async with http.get(f"{api_url}/status") as resp:
                queued = (await resp.json())["queue_size"]
            if queued < max_queue:
                group = make_group(rng, size=group_size, accuracy=accuracy, version=0)
                group["env_id"] = env_id
                async with http.post(f"{api_url}/scored_data", json=group) as resp:
                    assert resp.status == 200, await resp.text()
            else:
                await anyio.sleep(0.005)

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
        return web.json_response(
            {
                "model": "stand-in",
                "engine": "test",
                "weight_version": 0,
                "tokenizer": tokenizer,
                "awaiting_weights": False,
            }
        )

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


async def produce(
    api_url: str,
    group_size: int = 8,
    max_queue: int = 4,
    seed: int = 0,
    accuracy: float | None = 0.25,
    first: list[dict[str, Any]] | None = None,
) -> None:
    """Register as an environment (once the trainer has started) and keep the queue topped up;
    ``first``: groups posted as they are (with the env_id) before the generated ones."""
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as http:
        env_id = None
        while env_id is None:
            body = {
                "max_token_length": 64,
                "desired_name": "stand-in",
                "weight": 1.0,
                "group_size": group_size,
                "min_batch_allocation": None,
            }
            async with http.post(f"{api_url}/register-env", json=body) as resp:
                data = await resp.json()
            if data.get("status") == "success":
                env_id = data["env_id"]
            else:
                await anyio.sleep(0.02)
        for group in first or []:
            async with http.post(f"{api_url}/scored_data", json={**group, "env_id": env_id}) as resp:
                assert resp.status == 200, await resp.text()
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


async def produce_rollouts(api_url: str, inference_url: str, group_size: int = 8, seed: int = 0) -> None:
    """An environment stand-in with real rollouts: ``/generate`` on the inference server, a
    reward for a small digit task, ``weight_version`` reported as the built-in envs do."""
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as http:
        env_id = None
        while env_id is None:
            body = {
                "max_token_length": 64,
                "desired_name": "rollouts",
                "weight": 1.0,
                "group_size": group_size,
                "min_batch_allocation": None,
            }
            async with http.post(f"{api_url}/register-env", json=body) as resp:
                data = await resp.json()
            if data.get("status") == "success":
                env_id = data["env_id"]
            else:
                await anyio.sleep(0.02)
        while True:
            async with http.get(f"{api_url}/status") as resp:
                if (await resp.json())["queue_size"] >= 2:
                    await anyio.sleep(0.005)
                    continue
            d = rng.randrange(10)
            prompt = [1, 4 + d, 17]  # [BOS] d =
            req = {
                "prompt": {"prompt_token_ids": prompt},
                "n": group_size,
                "max_tokens": 2,
                "temperature": 1.0,
                "logprobs": 0,
            }
            async with http.post(f"{inference_url}/generate", json=req) as resp:
                assert resp.status == 200, await resp.text()
                out = await resp.json()
            tokens, masks, lps, scores = [], [], [], []
            for ids, lp in zip(out["token_ids"], out["logprobs"], strict=True):
                tokens.append(prompt + ids)
                masks.append([-100] * len(prompt) + ids)
                lps.append([1.0] * len(prompt) + [next(iter(e[0].values())) for e in lp])
                scores.append(1.0 if ids and ids[0] == 4 + (d + 1) % 10 else 0.0)
            group = {
                "tokens": tokens,
                "masks": masks,
                "scores": scores,
                "inference_logprobs": lps,
                "env_id": env_id,
                "group_overrides": {"atroposd": {"weight_version": out["weight_version"]}},
            }
            async with http.post(f"{api_url}/scored_data", json=group) as resp:
                assert resp.status == 200, await resp.text()


def wait_ok(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    """Wait until GET url answers 200 (a loading server answers 503); fail if ``proc`` exits."""
    import urllib.error
    import urllib.request

    from tests.support import wait_for

    def ok() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} before {url} was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    wait_for(ok, timeout=timeout, what=f"{url} to answer 200")

"""The inference servers' bearer token (SPEC §12.3): with one configured, every TCP route answers
401 to a request without it; the daemon's probes and the built-in environments send it.

A real aiohttp server on loopback (the front every engine shares); its engine is a stand-in
that answers ``/health`` and ``/generate`` — the model is not what these tests are about."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from atroposd.config import parse_toml
from atroposd.daemon.replicas import fetch_health
from atroposd.daemon.specs import inference_headers
from atroposd.envs.generate import GenerateError, InferenceClient
from atroposd.inference.server import _Front, build_tcp_app
from atroposd.process.probes import get_ok
from tests.support import free_port

pytestmark = pytest.mark.anyio

TOKEN = "an-inference-token-of-this-job"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _Engine:
    """Answers /health and a one-token /generate (vLLM's shape)."""

    name = "stand-in"
    weight_version = 4
    max_model_len = 64
    vocab_size = 32

    async def check_health(self) -> None:
        return None

    async def weight_info(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version, "awaiting_weights": False}

    async def generate(self, request: Any, *, bypass_pause: bool = False) -> dict[str, Any]:
        return {
            "logprobs": [[[{"7": -0.5}]]],
            "finish_reasons": ["length"],
            "token_ids": [[7]],
            "weight_version": self.weight_version,
        }


@asynccontextmanager
async def server(token: str) -> AsyncIterator[tuple[str, web.Application]]:
    front = _Front(
        model_name="m", max_model_len=64, engine=_Engine(), token=token, info={"model": "m", "tokenizer": {}}
    )
    app = build_tcp_app(front)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        await runner.cleanup()


def _paths(app: web.Application) -> list[tuple[str, str]]:
    out = []
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if path and route.method in ("GET", "POST"):
            out.append((route.method, path))
    return out


async def test_every_route_refuses_a_request_without_the_token_with_401() -> None:
    async with server(TOKEN) as (url, app), aiohttp.ClientSession() as session:
        routes = _paths(app)
        assert ("POST", "/generate") in routes and ("GET", "/health") in routes and len(routes) >= 7
        wrong = [
            {},
            {"Authorization": "Bearer not-the-token"},
            {"Authorization": f"Basic {TOKEN}"},
            {"Authorization": TOKEN},
            {"Authorization": f"Bearer {TOKEN}x"},
        ]
        for method, path in [*routes, ("GET", "/no-such-route")]:
            for headers in wrong:
                async with session.request(method, url + path, json={}, headers=headers) as resp:
                    assert resp.status == 401, (method, path, headers, resp.status)
                    assert resp.headers.get("WWW-Authenticate") == "Bearer"
        # with it, each route does its own work (an empty body is its own 400, never a 401)
        for method, path in routes:
            async with session.request(
                method, url + path, json={}, headers={"Authorization": f"Bearer {TOKEN}"}
            ) as resp:
                assert resp.status != 401, (method, path)
        async with session.get(url + "/health", headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 200 and (await resp.json())["weight_version"] == 4


async def test_without_a_token_configured_the_routes_are_open() -> None:
    async with server("") as (url, _), aiohttp.ClientSession() as session:
        async with session.get(url + "/health") as resp:
            assert resp.status == 200


async def test_the_daemons_probes_and_the_builtin_environments_send_it(tmp_path: Path) -> None:
    token_file = tmp_path / "inference.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    cfg = parse_toml(f'[inference]\ntoken_file = "{token_file}"\n')
    cfg.inference.token = cfg.inference_token()  # what the daemon does at start
    headers = inference_headers(cfg)
    assert headers == {"Authorization": f"Bearer {TOKEN}"}
    async with server(TOKEN) as (url, _), aiohttp.ClientSession() as session:
        # the readiness and liveness probes, the replicas' /health poll and status
        assert await get_ok(session, url + "/health", headers)
        assert not await get_ok(session, url + "/health", {})
        assert (await fetch_health(session, url, headers) or {}).get("weight_version") == 4
        assert await fetch_health(session, url) is None
        # a built-in environment's client: its readiness check and its generations
        client = InferenceClient(session, [url, url], token=cfg.inference.token)
        assert await client._ready(url)
        generation = await client.generate([1, 2], n=1, max_tokens=1, temperature=1.0)
        assert generation.completions[0].token_ids == [7]
        anonymous = InferenceClient(session, url)
        assert not await anonymous._ready(url)
        with pytest.raises(GenerateError, match="401"):
            await anonymous.generate([1, 2], n=1, max_tokens=1, temperature=1.0)


def test_the_daemon_hands_the_token_to_its_probes_and_children_never_on_a_command_line(tmp_path: Path) -> None:
    from atroposd.config import parse_config
    from atroposd.daemon.specs import SpecInputs, env_specs, inference_spec
    from atroposd.paths import Paths
    from atroposd.process.liveness import InferenceLiveCheck
    from atroposd.process.probes import InferenceProbe

    cfg = parse_config(
        {
            "daemon": {"runtime_dir": str(tmp_path / "run"), "state_dir": str(tmp_path / "state")},
            "env": [{"name": "ext", "command": ["serve", "--openai.api_key", "{inference_token}"]}],
        }
    )
    cfg.inference.token = TOKEN
    ins = SpecInputs(cfg=cfg, paths=Paths.of(cfg), nonce="n0", model="/m", tokenizer="/t", base_env={}, python="py")
    spec = inference_spec(ins)
    assert isinstance(spec.probe, InferenceProbe) and isinstance(spec.live_check, InferenceLiveCheck)
    assert spec.probe.headers == spec.live_check.headers == {"Authorization": f"Bearer {TOKEN}"}
    assert spec.env["ATROPOSD_INFERENCE_TOKEN"] == TOKEN and TOKEN not in " ".join(spec.argv)
    (env,) = env_specs(ins, cfg.env[0])
    assert env.argv[-1] == TOKEN and env.env["ATROPOSD_INFERENCE_TOKEN"] == TOKEN  # {inference_token}

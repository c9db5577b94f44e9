"""``status --json`` with several inference replicas: one component each, with its URL and what
its ``/health`` says (the weight_version it serves, the generations it answered)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
from aiohttp import web

from atroposd.config import parse_config
from atroposd.daemon.status import replica_index, status
from tests.daemon.views import View
from tests.support import free_port_pair


@dataclass
class StubUnit:
    name: str
    kind: str = "inference"

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "external": False, "state": "ready", "pid": 1}


def test_replica_index() -> None:
    assert [replica_index(n) for n in ("inference", "inference-0", "inference-3")] == [0, 0, 3]


def test_every_replica_is_a_component_with_its_health() -> None:
    port = free_port_pair()
    cfg = parse_config(
        {"inference": {"replicas": 2, "port": port}, "api": {"port": port + 2}, "trainer": {"enabled": False}}
    )
    view = View(cfg, units={n: StubUnit(n) for n in ("inference-0", "inference-1")})  # type: ignore[misc]

    async def main() -> dict[str, Any]:
        async def health(_: web.Request) -> web.Response:
            return web.json_response({"status": "ok", "weight_version": 7, "generations": 3})

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()  # replica 0 answers, replica 1 does not
        try:
            return await status(view)
        finally:
            await runner.cleanup()

    st = anyio.run(main)
    rows = [c for c in st["components"] if c["kind"] == "inference"]
    assert [(c["name"], c["url"], c["weight_version"], c["generations"]) for c in rows] == [
        ("inference-0", f"http://127.0.0.1:{port}", 7, 3),
        ("inference-1", f"http://127.0.0.1:{port + 1}", None, None),
    ]


def test_the_human_form_shows_each_replicas_weights_and_load() -> None:
    from atroposd.commands import _render_status

    rows = [
        {
            "name": f"inference-{i}",
            "kind": "inference",
            "state": "ready",
            "pid": 10 + i,
            "restarts": i,
            "last_exit": None,
            "weight_version": 7 - i,
            "generations": 30 + i,
        }
        for i in range(2)
    ]
    text = _render_status(
        {
            "state": "running",
            "pid": 1,
            "uptime_s": 3.0,
            "config": "/x.toml",
            "components": rows,
            "trainer": None,
            "queue": None,
        }
    )
    assert "inference-0" in text and "inference-1" in text
    assert "replicas: inference-0 weights v7, 30 generations, inference-1 weights v6, 31 generations" in text

"""The daemon's pause asks each replica for what ``[trainer] inflight`` says (SPEC §7): keep
(with ``inflight_kv``'s clear_cache) or drain; a replica whose engine only drains is paused
that way, once with a warning, and stays so."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from atroposd.inference.server import _Front, _start_unix_site, build_control_app
from atroposd.weights.replicas import Replicas, pause_request

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _Engine:
    """Records the pauses the control route passes on; ``modes``: its ``pause_modes`` (None: drain only)."""

    weight_version = 0

    def __init__(self, modes: tuple[str, ...] | None) -> None:
        self.name = "torch"
        self.pause_modes = modes or ("wait",)
        self.calls: list[dict[str, Any]] = []

    async def pause(self, **kw: Any) -> dict[str, Any]:
        self.calls.append(kw)
        return {"paused": True, "weight_version": self.weight_version}


@asynccontextmanager
async def site(path: Path, engine: _Engine) -> AsyncIterator[None]:
    runner = web.AppRunner(build_control_app(_Front(model_name="m", max_model_len=64, engine=engine)))
    await runner.setup()
    try:
        await _start_unix_site(runner, path)
        yield
    finally:
        await runner.cleanup()


def test_pause_request_of_the_config_keys() -> None:
    assert pause_request("drain", "recompute") is None
    assert pause_request() == {"mode": "keep", "clear_cache": True}
    assert pause_request("keep", "keep") == {"mode": "keep", "clear_cache": False}
    with pytest.raises(ValueError, match="inflight"):
        pause_request("freeze", "keep")


async def test_each_replica_is_paused_as_configured_or_drained(short_tmp: Path) -> None:
    keeps, drains = _Engine(("wait", "keep")), _Engine(None)
    a, b = short_tmp / "a.sock", short_tmp / "b.sock"
    async with site(a, keeps), site(b, drains):
        reps = Replicas([a, b], deadline=10)
        reps.pause_body = pause_request("keep", "keep")
        for _ in range(2):
            assert await reps.each(reps, lambda r: reps.pause(r, 1)) == [True, True]
        assert keeps.calls == [{"mode": "keep", "clear_cache": False}] * 2
        assert drains.calls == [{}, {}]  # refused keep once (400), drained since
        assert [r.drain_only for r in reps] == [False, True]
        reps.pause_body = None  # inflight = "drain"
        await reps.pause(reps[0], 2)
        assert keeps.calls[-1] == {}

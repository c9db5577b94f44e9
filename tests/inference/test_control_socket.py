"""The weight-control socket: served only to its own user (SO_PEERCRED), never started over
something that is not a stale socket of ours, and its answers sent within a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from atroposd.inference.server import (
    ControlSocketInUse,
    _Front,
    _start_unix_site,
    build_control_app,
)
from atroposd.weights.client import WeightControlClient, WeightControlError

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _Engine:
    """Just enough of an engine for the control routes."""

    weight_version = 3

    async def weight_info(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version, "paused": False}


@asynccontextmanager
async def control_site(
    path: Path, *, extra: Callable[[web.Application], None] | None = None, engine: Any = None, **kw: Any
) -> AsyncIterator[None]:
    front = _Front(model_name="m", max_model_len=64, engine=engine if engine is not None else _Engine())
    app = build_control_app(front, **kw)
    if extra is not None:
        extra(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await _start_unix_site(runner, path)
        yield
    finally:
        await runner.cleanup()


async def test_own_user_is_served_and_others_are_refused(short_tmp: Path) -> None:
    sock = short_tmp / "c.sock"
    async with control_site(sock):
        client = WeightControlClient(sock, timeout=10)
        try:
            assert (await client.weight_info())["weight_version"] == 3
        finally:
            await client.close()
    sock.unlink()
    # A socket that serves some other uid only: this process's requests are refused.
    async with control_site(sock, allowed_uids=frozenset({os.geteuid() + 1})):
        client = WeightControlClient(sock, timeout=10)
        try:
            with pytest.raises(WeightControlError) as err:
                await client.weight_info()
            assert err.value.status == 403 and "only its own user" in str(err.value)
        finally:
            await client.close()


async def test_start_removes_only_a_stale_socket_of_ours(short_tmp: Path) -> None:
    path = short_tmp / "c.sock"
    # A stale socket (its server is gone): removed, and the new server serves on it.
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    async with control_site(path):
        # A live server's socket is left alone: the second start fails naming it.
        with pytest.raises(ControlSocketInUse, match="served by another live process"):
            async with control_site(path):
                pass
        client = WeightControlClient(path, timeout=10)
        try:
            assert (await client.weight_info())["weight_version"] == 3  # the first server still serves
        finally:
            await client.close()
    path.unlink()
    # Whatever else the path names is never removed.
    path.write_text("precious")
    with pytest.raises(ControlSocketInUse, match="not a socket"):
        async with control_site(path):
            pass
    assert path.read_text() == "precious"
    path.unlink()
    target = short_tmp / "target"
    target.write_text("x")
    path.symlink_to(target)
    with pytest.raises(ControlSocketInUse, match="not a socket"):
        async with control_site(path):
            pass
    assert path.is_symlink() and target.read_text() == "x"


async def test_an_answer_nobody_reads_does_not_hold_the_server(short_tmp: Path) -> None:
    path = short_tmp / "c.sock"

    def big(app: web.Application) -> None:
        async def handler(_: web.Request) -> web.Response:
            return web.Response(body=b"x" * (32 * 1024 * 1024))

        app.router.add_get("/big", handler)

    async with control_site(path, extra=big, send_timeout=0.5):
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            raw.connect(str(path))
            raw.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            client = WeightControlClient(path, timeout=10)
            try:
                assert (await client.weight_info())["weight_version"] == 3  # others are served meanwhile
            finally:
                await client.close()
            # Nothing is read: the server must drop the connection once its deadline passes.
            poller = select.poll()
            poller.register(raw, select.POLLRDHUP)
            deadline = time.monotonic() + 20
            while not any(ev & (select.POLLRDHUP | select.POLLHUP) for _, ev in poller.poll(0)):
                assert time.monotonic() < deadline, "the stalled answer still holds its connection"
                await asyncio.sleep(0.05)
            raw.setblocking(False)
            received = 0
            with contextlib.suppress(BlockingIOError, ConnectionError):
                while chunk := raw.recv(1 << 20):
                    received += len(chunk)
            assert received < 32 * 1024 * 1024, "the whole answer arrived: the send was not cut off"
        finally:
            raw.close()


class _PausingEngine(_Engine):
    """Records how the pause route calls it; ``modes``: its ``pause_modes`` (None: drain only)."""

    def __init__(self, modes: tuple[str, ...] | None) -> None:
        self.name = "vllm" if modes else "torch"
        self.pause_modes = modes or ("wait",)
        self.calls: list[dict[str, Any]] = []

    async def pause(self, **kw: Any) -> dict[str, Any]:
        self.calls.append(kw)
        return {"paused": True}


async def test_pause_mode_reaches_only_an_engine_that_serves_it(short_tmp: Path) -> None:
    """POST /pause with no body drains on every engine; a mode or clear_cache reaches an engine
    that lists it in pause_modes, and any other is a 400 naming the modes served."""
    sock = short_tmp / "c.sock"
    for modes, body, called in (
        (None, None, {}),
        (None, {"mode": "wait"}, {}),
        (("wait", "keep"), None, {}),
        (("wait", "keep"), {"mode": "keep"}, {"mode": "keep", "clear_cache": None}),
        (("wait", "keep"), {"clear_cache": False}, {"mode": "wait", "clear_cache": False}),
        (None, {"mode": "keep"}, "pauses with mode wait only"),
        (None, {"clear_cache": True}, "pauses with mode wait only"),
        (("wait", "keep"), {"mode": "abort"}, "mode wait or keep only"),
    ):
        engine = _PausingEngine(modes)
        async with control_site(sock, engine=engine):
            client = WeightControlClient(sock, timeout=10)
            try:
                if isinstance(called, str):
                    with pytest.raises(WeightControlError, match=called) as err:
                        await client.request("POST", "/pause", body)
                    assert err.value.status == 400 and not engine.calls
                else:
                    assert (await client.request("POST", "/pause", body))["paused"]
                    assert engine.calls == [called], (modes, body)
            finally:
                await client.close()
        sock.unlink()

"""Client of the inference server's weight-control Unix socket (HTTP over a Unix socket).

Routes (docs/ARCHITECTURE.md): ``POST /pause``, ``POST /resume {"weight_version"}``,
``POST /update_weights {...}``, ``POST /load {...}``, ``GET /weight_info``. A non-2xx answer
raises :class:`WeightControlError` with the server's message.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import orjson

__all__ = ["WeightControlClient", "WeightControlError"]


class WeightControlError(RuntimeError):
    """The inference server refused or failed a weight-control request."""

    def __init__(self, message: str, status: int | None = None, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.timed_out = timed_out  # no answer within the client's deadline (status None)


class WeightControlClient:
    """One aiohttp session over the control socket; ``close()`` when done."""

    def __init__(self, socket_path: Path, *, timeout: float = 300.0) -> None:
        self.socket_path = Path(socket_path)
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def _ensure(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.UnixConnector(path=str(self.socket_path))
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                json_serialize=lambda o: orjson.dumps(o).decode(),
            )
        return self._session

    async def request(self, method: str, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        session = await self._ensure()
        try:
            async with session.request(method, f"http://inference{route}", json=body) as resp:
                raw = await resp.read()
        except aiohttp.ClientConnectionError as exc:
            raise WeightControlError(
                f"{method} {route}: inference control socket {self.socket_path} is not reachable ({exc})"
            ) from exc
        except (TimeoutError, asyncio.TimeoutError) as exc:
            # Bounded by its own deadline: a server that does not answer counts as unreachable.
            raise WeightControlError(
                f"{method} {route}: the inference server did not answer within {self.timeout:g}s", timed_out=True
            ) from exc
        try:
            data = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            data = {"error": raw.decode(errors="replace")[:500]}
        if resp.status >= 300:
            msg = data.get("error") or data.get("message") or data if isinstance(data, dict) else data
            raise WeightControlError(f"{method} {route} answered {resp.status}: {msg}", resp.status)
        return data if isinstance(data, dict) else {"result": data}

    async def pause(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """``body``: ``{"mode": "keep" | "wait", "clear_cache"?}`` (none: drain, on every engine)."""
        return await self.request("POST", "/pause", body)

    async def resume(self, weight_version: int) -> dict[str, Any]:
        return await self.request("POST", "/resume", {"weight_version": weight_version})

    async def update_weights(
        self, manifest: Path, mode: str, weight_version: int, digest: bool = False
    ) -> dict[str, Any]:
        """``digest``: a bucket's answer carries the sha256 of each tensor it copied (tests' bit-for-bit check)."""
        body: dict[str, Any] = {"manifest": str(manifest), "mode": mode, "weight_version": weight_version}
        if digest:
            body["digest"] = True
        return await self.request("POST", "/update_weights", body)

    async def load(self, path: Path, weight_version: int) -> dict[str, Any]:
        return await self.request("POST", "/load", {"path": str(path), "weight_version": weight_version})

    async def broadcast(self, body: dict[str, Any]) -> dict[str, Any]:
        """``weight_sync = "broadcast"``: join, receive, finish or leave (``atroposd.weights.broadcast``)."""
        return await self.request("POST", "/broadcast", body)

    async def weight_info(self) -> dict[str, Any]:
        return await self.request("GET", "/weight_info")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

"""The daemon's own small client of the container engine (Docker Engine API over a Unix socket):
what the reaper and the proxy's ownership checks need, nothing more."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import aiohttp

CONNECT_TIMEOUT = 10.0
CALL_TIMEOUT = 30.0


class EngineError(Exception):
    """The engine refused a call or could not be reached; the message says which and why."""


class Engine:
    """One connection pool to the engine's socket, shared by every replica's proxy."""

    def __init__(self, socket: str) -> None:
        self.socket = socket
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.UnixConnector(path=self.socket, limit=0)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(
        self, method: str, path: str, *, params: Mapping[str, str] | None = None, body: object = None
    ) -> tuple[int, Any]:
        """``(status, decoded JSON or None)``; EngineError when the engine cannot be reached."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            async with self.session.request(
                method,
                f"http://engine{path}",
                params=params,
                data=data,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT),
            ) as resp:
                raw = await resp.read()
                try:
                    return resp.status, json.loads(raw) if raw else None
                except ValueError:
                    return resp.status, raw.decode(errors="replace")
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise EngineError(f"the container engine at {self.socket} cannot be reached: {exc}") from exc

    async def ping(self) -> None:
        status, body = await self.call("GET", "/_ping")
        if status != 200:
            raise EngineError(f"the container engine at {self.socket} answered /_ping with {status}: {body}")

    async def containers(self, labels: list[str]) -> list[dict[str, Any]]:
        """Every container (running or not) carrying all of ``labels`` (``key=value``)."""
        status, body = await self.call(
            "GET", "/containers/json", params={"all": "1", "filters": json.dumps({"label": labels})}
        )
        if status != 200 or not isinstance(body, list):
            raise EngineError(f"listing containers failed ({status}): {body}")
        return [c for c in body if isinstance(c, dict) and _has(c.get("Labels"), labels)]

    async def inspect(self, kind: str, ref: str) -> dict[str, Any] | None:
        """``kind`` containers | volumes | networks | exec: the object, or None if there is none."""
        suffix = "/json" if kind in ("containers", "exec") else ""
        status, body = await self.call("GET", f"/{kind}/{quote(ref, safe='')}{suffix}")
        if status == 404:
            return None
        if status != 200 or not isinstance(body, dict):
            raise EngineError(f"inspecting {kind} {ref!r} failed ({status}): {body}")
        return body

    async def kill(self, cid: str) -> None:
        await self.call("POST", f"/containers/{cid}/kill", params={"signal": "SIGKILL"})

    async def remove(self, cid: str) -> bool:
        """Remove a container (forced, with its anonymous volumes); True once it is gone."""
        status, _ = await self.call("DELETE", f"/containers/{cid}", params={"force": "1", "v": "1"})
        return status in (200, 204, 404)

    async def volumes(self, labels: list[str]) -> list[dict[str, Any]]:
        status, body = await self.call("GET", "/volumes", params={"filters": json.dumps({"label": labels})})
        if status != 200 or not isinstance(body, dict):
            raise EngineError(f"listing volumes failed ({status}): {body}")
        return [v for v in body.get("Volumes") or [] if isinstance(v, dict) and _has(v.get("Labels"), labels)]

    async def remove_volume(self, name: str) -> bool:
        status, _ = await self.call("DELETE", f"/volumes/{quote(name, safe='')}", params={"force": "1"})
        return status in (200, 204, 404)

    async def networks(self, labels: list[str]) -> list[dict[str, Any]]:
        status, body = await self.call("GET", "/networks", params={"filters": json.dumps({"label": labels})})
        if status != 200 or not isinstance(body, list):
            raise EngineError(f"listing networks failed ({status}): {body}")
        return [n for n in body if isinstance(n, dict) and _has(n.get("Labels"), labels)]

    async def remove_network(self, ref: str) -> bool:
        status, _ = await self.call("DELETE", f"/networks/{quote(ref, safe='')}")
        return status in (200, 204, 404)


def _has(labels: object, wanted: list[str]) -> bool:
    """Whether ``labels`` carries every ``key=value`` of ``wanted`` (checked here as well as by
    the engine's filter: nothing without the job's labels is ever touched)."""
    if not isinstance(labels, dict):
        return False
    return all(labels.get(k) == v for k, _, v in (w.partition("=") for w in wanted))

"""Readiness probes: each ``wait(unit)`` returns once the child is ready, or raises ProbeError.

The unit races the probe against the child's exit and its ``ready_timeout`` deadline, so a
probe only has to poll its condition; it never needs to know whether the child is alive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from atroposd.logs import get_logger

if TYPE_CHECKING:
    import aiohttp

log = get_logger("atroposd.probes")

POLL_INTERVAL = 0.1
REQUEST_TIMEOUT = 5.0


class ProbeError(Exception):
    """The probe itself decided the child cannot become ready (a wrong answer, not a slow one)."""


class Unit(Protocol):
    """What a probe reads of the unit it waits on (``process.unit.Unit`` has it)."""

    @property
    def name(self) -> str: ...

    def tree_pids(self) -> set[int]: ...


class Probe(Protocol):
    @property
    def description(self) -> str: ...

    async def wait(self, unit: Unit) -> None: ...


@dataclass
class StartedProbe:
    """Ready once the child has stayed alive for ``seconds``."""

    seconds: float

    @property
    def description(self) -> str:
        return f"alive for {self.seconds:g}s"

    async def wait(self, unit: Unit) -> None:
        await anyio.sleep(self.seconds)


@dataclass
class ConditionProbe:
    """Ready once ``check()`` is true (polled; e.g. a trainer rank that joined its process group)."""

    what: str
    check: Callable[[], bool]

    @property
    def description(self) -> str:
        return self.what

    async def wait(self, unit: Unit) -> None:
        while not self.check():  # noqa: ASYNC110 - polling a condition outside this loop
            await anyio.sleep(POLL_INTERVAL)


def _session(timeout: float = REQUEST_TIMEOUT) -> aiohttp.ClientSession:
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout))


@dataclass
class HttpProbe:
    """Ready once ``GET url`` answers 200."""

    url: str
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def description(self) -> str:
        return f"GET {self.url} answers 200"

    async def wait(self, unit: Unit) -> None:
        async with _session() as session:
            while not await get_ok(session, self.url, self.headers):  # noqa: ASYNC110 - polling a remote
                await anyio.sleep(POLL_INTERVAL)


async def get_ok(session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> bool:
    import aiohttp

    try:
        async with session.get(url, headers=headers or {}) as resp:
            await resp.read()
            return bool(resp.status == 200)
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


@dataclass
class InferenceProbe:
    """Ready once ``/health`` answers 200 and one real generation succeeds.

    The generation goes through ``POST /probe_generate`` on the weight-control socket, which
    bypasses the pause a server started with ``--await-weights`` is in.
    """

    url: str
    control_socket: Path
    headers: dict[str, str] = field(default_factory=dict)  # the inference token, if any

    @property
    def description(self) -> str:
        return f"GET {self.url}/health answers 200 and one generation succeeds"

    async def wait(self, unit: Unit) -> None:
        from atroposd.weights.client import WeightControlClient, WeightControlError

        async with _session() as session:
            while not await get_ok(session, f"{self.url}/health", self.headers):  # noqa: ASYNC110 - polling a remote
                await anyio.sleep(POLL_INTERVAL)
        client = WeightControlClient(self.control_socket, timeout=60.0)
        try:
            while True:
                try:
                    await client.request("POST", "/probe_generate", {})
                    return
                except WeightControlError as exc:
                    if exc.status is not None and exc.status < 500 and exc.status != 404:
                        raise ProbeError(f"probe generation refused: {exc}") from exc
                    log.debug("probe generation not yet possible", component=unit.name, error=str(exc))
                await anyio.sleep(POLL_INTERVAL)
        finally:
            await client.close()


@dataclass
class RegisteredProbe:
    """Ready once the API credits a ``/register-env`` to this component (SPEC §4).

    Credited when the registration's client pid is the child or one of its descendants, or
    when its ``desired_name`` is the component's name (or the environment's, for a single
    replica).  An API without ``/atroposd/registrations`` (another wire-compatible server)
    cannot tell: then the probe falls back to ``fallback`` (alive for ``start_seconds``).
    """

    api_url: str
    names: tuple[str, ...]
    fallback: StartedProbe
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def description(self) -> str:
        return f"registered with the API at {self.api_url}"

    async def wait(self, unit: Unit) -> None:
        url = f"{self.api_url}/atroposd/registrations"
        async with _session() as session:
            while True:
                regs = await self._fetch(session, url)
                if regs is None:
                    log.info("API lists no registrations; readiness falls back to started", component=unit.name)
                    await self.fallback.wait(unit)
                    return
                pids = unit.tree_pids()
                if any(self._credits(r, pids) for r in regs):
                    return
                await anyio.sleep(POLL_INTERVAL)

    def _credits(self, reg: dict[str, Any], pids: set[int]) -> bool:
        return reg.get("peer_pid") in pids or reg.get("desired_name") in self.names

    async def _fetch(self, session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]] | None:
        import aiohttp

        try:
            async with session.get(url, headers=self.headers) as resp:
                if resp.status == 404:
                    return None
                if resp.status != 200:
                    return []
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return []
        regs = data.get("registrations") if isinstance(data, dict) else None
        return [r for r in regs if isinstance(r, dict)] if isinstance(regs, list) else []

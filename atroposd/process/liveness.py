"""Liveness: is a running child still doing its job? (SPEC §4, Liveness)

A readiness probe (:mod:`.probes`) answers once, at start; a liveness check answers every
``live_interval`` seconds for as long as the child runs.  ``check(unit, tick)`` returns None
when the child showed a sign of life, or a short text saying what failed.  The unit counts
consecutive failures; at ``live_failures`` it declares the child hung, logs what failed,
stops it (TERM → KILL) and restarts it under its policy, its ``last_exit`` saying ``hung``.

- :class:`HttpLiveCheck`: the API's ``GET /info`` answers 200 within ``live_timeout``.
- :class:`InferenceLiveCheck`: ``GET /health`` within ``live_timeout`` at every tick, and every
  ``generate_every`` ticks one tiny real generation (``/probe_generate`` on the control
  socket) within ``generate_every × live_timeout`` — an engine can answer ``/health`` while
  its generation loop is stuck.  The generation runs beside the ticks; its failures count
  on their own (``live_failures`` in a row), so a healthy ``/health`` cannot hide them.
- :class:`HeartbeatLiveCheck`: a built-in environment's beat (:mod:`atroposd.heartbeat`) came
  within ``live_timeout``.
- :class:`ActivityLiveCheck`: a ``command`` environment used CPU, sent a beat, or registered
  with the API since the last check.

:class:`HeartbeatBoard` receives the beats on the daemon's datagram socket.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.abc
import psutil

from atroposd.heartbeat import MAX_BEAT_BYTES, Beat, decode
from atroposd.logs import get_logger

if TYPE_CHECKING:
    import aiohttp


class Unit(Protocol):
    """What a liveness check reads of the unit it checks (``process.unit.Unit`` is one)."""

    name: str
    since: float  # monotonic time of its last state change
    launched_monotonic: float  # monotonic time of its current process's start

    def tree_pids(self) -> set[int]: ...
    def live_task(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> None: ...


log = get_logger("atroposd.liveness")

# A command environment with no CPU use, heartbeat or registration this long starts failing its checks.
COMMAND_QUIET_S = 60.0

__all__ = [
    "ActivityLiveCheck",
    "HeartbeatBoard",
    "HeartbeatLiveCheck",
    "HttpLiveCheck",
    "InferenceLiveCheck",
    "LiveCheck",
    "LiveSettings",
]


@dataclass(frozen=True)
class LiveSettings:
    """``live_interval``, ``live_timeout``, ``live_failures`` of one component; 0 turns it off."""

    interval: float
    timeout: float
    failures: int

    @property
    def on(self) -> bool:
        return self.interval > 0 and self.failures > 0

    def describe(self) -> str:
        return f"{self.failures} consecutive failures, every {self.interval:g}s"


class LiveCheck(Protocol):
    @property
    def description(self) -> str: ...

    async def check(self, unit: Unit, tick: int) -> str | None: ...

    def reset(self) -> None:
        """A new attempt of the child begins: forget the last one's state."""


def _session(timeout: float) -> aiohttp.ClientSession:
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout))


async def _get(url: str, headers: dict[str, str], deadline: float) -> str | None:
    """None if ``GET url`` answered 200 within ``deadline`` s, else what happened."""
    timeout = deadline
    import aiohttp

    try:
        with anyio.fail_after(timeout):
            async with _session(timeout + 1) as session, session.get(url, headers=headers) as resp:
                await resp.read()
                if resp.status == 200:
                    return None
                return f"GET {url} answered {resp.status}"
    except TimeoutError:
        return f"GET {url} did not answer within {timeout:g}s"
    except (aiohttp.ClientError, OSError) as exc:
        return f"GET {url} failed: {type(exc).__name__}: {exc}"


@dataclass
class HttpLiveCheck:
    """Alive while ``GET url`` answers 200 within ``timeout``."""

    url: str
    timeout: float
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def description(self) -> str:
        return f"GET {self.url}"

    async def check(self, unit: Unit, tick: int) -> str | None:
        return await _get(self.url, self.headers, self.timeout)

    def reset(self) -> None:
        pass


@dataclass
class InferenceLiveCheck:
    """``/health`` at every tick; one tiny generation every ``generate_every`` ticks."""

    url: str
    control_socket: Path
    timeout: float
    generate_every: int
    failures: int
    generation_failures: int = 0
    last_generation_error: str | None = None
    _generating: bool = False
    headers: dict[str, str] = field(default_factory=dict)  # the inference token, if any

    @property
    def description(self) -> str:
        gen = f" and a generation every {self.generate_every} probes" if self.generate_every else ""
        return f"GET {self.url}/health{gen}"

    @property
    def generation_timeout(self) -> float:
        return self.timeout * max(1, self.generate_every)

    async def check(self, unit: Unit, tick: int) -> str | None:
        if self.generate_every and tick % self.generate_every == 0 and not self._generating:
            self._generating = True
            unit.live_task(self._generate)
        if self.generation_failures >= self.failures:
            return f"{self.last_generation_error} ({self.generation_failures} generation probes in a row)"
        return await _get(f"{self.url}/health", self.headers, self.timeout)

    async def _generate(self) -> None:
        from atroposd.weights.client import WeightControlClient, WeightControlError

        client = WeightControlClient(self.control_socket, timeout=self.generation_timeout + 1)
        error: str | None = None
        try:
            with anyio.fail_after(self.generation_timeout):
                await client.request("POST", "/probe_generate", {})
        except TimeoutError:
            error = f"a one-token generation did not return within {self.generation_timeout:g}s"
        except WeightControlError as exc:
            error = f"a one-token generation failed: {exc}"
        finally:
            self._generating = False
            with anyio.CancelScope(shield=True):
                await client.close()
        if error is None:
            self.generation_failures, self.last_generation_error = 0, None
        else:
            self.generation_failures += 1
            self.last_generation_error = error
            log.warning("generation probe failed", error=error, consecutive=self.generation_failures)

    def reset(self) -> None:
        self.generation_failures, self.last_generation_error, self._generating = 0, None, False


MAX_BOARD = 4096  # beats kept per map of the HeartbeatBoard


def _trim(board: dict[Any, Beat]) -> None:
    if len(board) > MAX_BOARD:
        for key, _ in sorted(board.items(), key=lambda kv: kv[1].at)[: len(board) // 2]:
            del board[key]


class HeartbeatBoard:
    """The daemon's end of the heartbeat socket: the newest beat per component name and pid."""

    def __init__(self) -> None:
        self.by_name: dict[str, Beat] = {}
        self.by_pid: dict[int, Beat] = {}
        self.received = 0
        self.path: Path | None = None

    def record(self, beat: Beat) -> None:
        self.received += 1
        self.by_name[beat.name] = beat
        self.by_pid[beat.pid] = beat
        # Any local process may send beats under any name or pid: both maps are bounded, the
        # oldest half dropped past MAX_BOARD (children long gone, or names no child has).
        _trim(self.by_pid)
        _trim(self.by_name)

    def latest(self, unit: Unit) -> Beat | None:
        """The newest beat from this unit's current process tree or carrying its name."""
        beats = [b for b in (self.by_name.get(unit.name),) if b is not None and b.at >= unit.launched_monotonic]
        beats += [b for pid in unit.tree_pids() if (b := self.by_pid.get(pid)) is not None]
        return max(beats, key=lambda b: b.at) if beats else None

    async def serve(self, path: Path, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Receive beats on ``path`` (mode 0600) until cancelled; removes the socket after."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sock = await anyio.create_unix_datagram_socket(local_path=path, local_mode=0o600)
        self.path = path
        task_status.started()
        try:
            async with sock:
                while True:
                    raw, _addr = await sock.receive()
                    if len(raw) <= MAX_BEAT_BYTES and (beat := decode(raw)) is not None:
                        self.record(beat)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@dataclass
class HeartbeatLiveCheck:
    """Alive while a beat came within ``timeout`` seconds (a built-in environment)."""

    board: HeartbeatBoard
    timeout: float

    @property
    def description(self) -> str:
        return "heartbeat"

    async def check(self, unit: Unit, tick: int) -> str | None:
        beat = self.board.latest(unit)
        ready_at = unit.since  # the unit is READY: its last state change
        since = ready_at if beat is None else max(beat.at, ready_at)
        age = time.monotonic() - since
        if age <= self.timeout:
            return None
        return f"no heartbeat for {age:.1f}s" if beat is not None else f"no heartbeat since it was ready {age:.1f}s ago"

    def reset(self) -> None:
        pass


@dataclass
class ActivityLiveCheck:
    """Alive while the child's processes use CPU, it sends beats, or it registers with the API
    (a ``command`` environment, which need not know of heartbeats).

    A program may wait on a slow generation without using any CPU, so a check fails only once
    the child has shown none of these for ``quiet`` seconds (``COMMAND_QUIET_S``); then
    ``live_failures`` such checks in a row make it hung.
    """

    board: HeartbeatBoard | None  # None: no heartbeats are received (a child started elsewhere)
    api_url: str
    timeout: float
    headers: dict[str, str] = field(default_factory=dict)
    quiet: float = COMMAND_QUIET_S
    _cpu: float | None = None
    _checked: float = field(default_factory=time.time, compare=False)
    _active: float = field(default_factory=time.time, compare=False)

    @property
    def description(self) -> str:
        return "CPU use, heartbeats or registrations with the API"

    async def check(self, unit: Unit, tick: int) -> str | None:
        now = time.time()
        since, self._checked = self._checked, now
        if await self._active_since(unit, since):
            self._active = now
            return None
        idle = now - self._active
        if idle < self.quiet:
            return None
        return f"no CPU use, heartbeat or registration with the API for {idle:.1f}s"

    async def _active_since(self, unit: Unit, since: float) -> bool:
        cpu = _cpu_seconds(unit.tree_pids())
        previous, self._cpu = self._cpu, cpu
        if previous is None or cpu > previous:
            return True
        beat = self.board.latest(unit) if self.board is not None else None
        if beat is not None and time.monotonic() - beat.at <= self.timeout:
            return True
        return await self._registered_since(unit, since)

    def reset(self) -> None:
        self._cpu, self._checked, self._active = None, time.time(), time.time()

    async def _registered_since(self, unit: Unit, since: float) -> bool:
        import aiohttp

        try:
            with anyio.fail_after(self.timeout):
                async with (
                    _session(self.timeout + 1) as session,
                    session.get(f"{self.api_url}/atroposd/registrations", headers=self.headers) as resp,
                ):
                    if resp.status != 200:
                        return False
                    data = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return False
        regs = data.get("registrations") if isinstance(data, dict) else None
        if not isinstance(regs, list):
            return False
        pids = unit.tree_pids()
        return any(
            isinstance(r, dict)
            and isinstance(r.get("at"), (int, float))
            and r["at"] >= since
            and (r.get("peer_pid") in pids or r.get("desired_name") == unit.name)
            for r in regs
        )


def _cpu_seconds(pids: set[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except (psutil.Error, OSError):
            continue
        total += t.user + t.system
    return total

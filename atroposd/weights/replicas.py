"""The inference replicas as every weight sync mode reaches them (SPEC §7, §12.2).

:class:`Replicas` is the one object that talks to the replicas' weight-control sockets: pause,
resume, an update (pause → ``update_weights`` or ``load`` → resume), a call fanned out over
every target in parallel, and what each replica holds (:class:`Replica`: current or not, the
version it was last resumed with). Each mode (:mod:`atroposd.weights.sync`) holds one and adds
only what is its own.

A sync goes to each replica in parallel and waits for every one it reaches. A replica that is
down (no answer, past the deadline, or 503: its engine still loading) is skipped with a warning
and marked not current: the restarted server starts paused (``--await-weights``) and gets the
current weights from the mode's ``reattach`` before it serves again. Any other refusal is
raised. Each control request has its own deadline (:func:`sync_deadline`); one that passes it
counts in ``sync_timeouts`` (the daemon's watchdog restarts the server).

In-flight updates (SPEC §7): ``pause_body`` is what every pause asks for (:func:`pause_request`
of ``[trainer] inflight`` and ``inflight_kv``): with ``inflight = "keep"`` a replica freezes its
running generations instead of draining them. A replica whose engine pauses only by draining
(a 400 naming its modes) is paused that way, once with a warning.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, overload

import anyio

from atroposd.logs import get_logger
from atroposd.weights.client import WeightControlClient, WeightControlError

__all__ = [
    "DEFAULT_DEADLINE",
    "MIN_DEADLINE",
    "Cadence",
    "OnReplicas",
    "Replica",
    "Replicas",
    "SyncReport",
    "pause_request",
    "sockets_of",
    "sync_deadline",
    "unpaused",
]

log = get_logger("atroposd.weights.sync")
_T = TypeVar("_T")

DEFAULT_DEADLINE = 300.0
MIN_DEADLINE = 30.0

#: What one sync did, as the trainer records it (metrics.jsonl): ``seconds`` always; the
#: replicas' pause and the transfer apart (``sync_pause_s``, ``sync_transfer_s``) where the
#: mode measures them; ``buckets``, ``bytes``, ``gather_s``, ``staging_bytes``, ... per mode.
SyncReport = dict[str, float]


def sync_deadline(stall_timeout: float) -> float:
    """A weight-control request's deadline: half the trainer's stall_timeout (the daemon then
    still has time to restart the server within the stall), at least ``MIN_DEADLINE``; without
    a stall_timeout, 300 s."""
    return max(MIN_DEADLINE, stall_timeout / 2) if stall_timeout > 0 else DEFAULT_DEADLINE


def pause_request(inflight: str = "keep", inflight_kv: str = "recompute") -> dict[str, Any] | None:
    """The weight-control ``/pause`` body of ``[trainer] inflight`` / ``inflight_kv`` (None: drain)."""
    if inflight == "drain":
        return None
    if inflight != "keep" or inflight_kv not in ("recompute", "keep"):
        raise ValueError(
            f"inflight must be keep or drain and inflight_kv recompute or keep, got {inflight!r}, {inflight_kv!r}"
        )
    return {"mode": "keep", "clear_cache": inflight_kv == "recompute"}


def _unreachable(exc: WeightControlError) -> bool:
    """The server is not there to take weights now: dead (no answer), or answering 503 (its engine
    still loading, or shutting down). It gets the current weights when it is ready again."""
    return exc.status is None or exc.status == 503


@dataclass(eq=False)
class Replica:
    """One inference replica as the weight sync sees it: its control socket and what it holds."""

    index: int
    socket: Path
    #: holds the trainer's current weights and serves with them
    current: bool = False
    #: the weight_version it was last resumed with (None: never reached)
    version: int | None = None
    conn: WeightControlClient | None = field(default=None, repr=False)
    #: its engine pauses only by draining (it refused a keep-pause)
    drain_only: bool = False


class Replicas(Sequence[Replica]):
    """Every inference replica of a sync (replica 0 first) and the weight-control calls to them."""

    def __init__(self, sockets: Sequence[Path | str] = (), *, deadline: float = DEFAULT_DEADLINE) -> None:
        self._replicas = [Replica(i, Path(s)) for i, s in enumerate(sockets)]
        #: each control request's own deadline: past it the replica counts as unreachable (the
        #: update is skipped and ``sync_timeouts`` counts it)
        self.deadline = deadline
        self.sync_timeouts = 0
        #: the /pause body of every pause (None: drain); :func:`pause_request`
        self.pause_body: dict[str, Any] | None = None

    @overload
    def __getitem__(self, i: int) -> Replica: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Replica]: ...
    def __getitem__(self, i: int | slice) -> Replica | Sequence[Replica]:
        return self._replicas[i]

    def __len__(self) -> int:
        return len(self._replicas)

    def __iter__(self) -> Iterator[Replica]:
        return iter(self._replicas)

    def set_sockets(self, sockets: Sequence[Path | str]) -> None:
        """Replace the replicas (none of them current)."""
        self._replicas = [Replica(i, Path(s)) for i, s in enumerate(sockets)]

    @property
    def current(self) -> bool:
        """Every replica holds the trainer's current weights."""
        return bool(self._replicas) and all(r.current for r in self._replicas)

    def versions(self) -> list[int | None]:
        """The weight_version each replica was last resumed with (None: not reached yet)."""
        return [r.version for r in self._replicas]

    def targets(self, replica: int | None) -> list[Replica]:
        """Replica ``replica`` (None: every one)."""
        if replica is None:
            return list(self._replicas)
        return [r for r in self._replicas if r.index == replica]

    # ------------------------------------------------------------------------ calls

    @asynccontextmanager
    async def connected(self, r: Replica) -> AsyncIterator[None]:
        """One connection for a sequence of calls (pause → update → resume): a sync pays
        for one connection set-up per replica, not three."""
        if r.conn is not None:
            yield
            return
        r.conn = WeightControlClient(r.socket, timeout=self.deadline)
        try:
            yield
        finally:
            conn, r.conn = r.conn, None
            with anyio.CancelScope(shield=True):
                await conn.close()

    async def call(self, method: str, *args: object, replica: Replica) -> dict[str, Any]:
        """One control request (``method`` of :class:`WeightControlClient`) to ``replica``; one
        past its deadline is logged and counted, and raised like any other failure."""
        try:
            return await self._call_once(method, *args, replica=replica)
        except WeightControlError as exc:
            if exc.timed_out:
                self.sync_timeouts += 1
                log.error(
                    "weight sync did not return within its deadline",
                    request=method,
                    replica=replica.index,
                    deadline_s=self.deadline,
                    timeouts=self.sync_timeouts,
                )
            raise

    async def _call_once(self, method: str, *args: object, replica: Replica) -> dict[str, Any]:
        if replica.conn is not None:
            result: dict[str, Any] = await getattr(replica.conn, method)(*args)
            return result
        client = WeightControlClient(replica.socket, timeout=self.deadline)
        try:
            result = await getattr(client, method)(*args)
            return result
        finally:
            await client.close()

    async def each(self, targets: Sequence[Replica], fn: Callable[[Replica], Awaitable[_T]]) -> list[_T]:
        """``fn`` on every target in parallel; the results in the targets' order. A failure is
        raised (the first, by replica) once every call has ended: never an exception group."""
        if len(targets) == 1:
            return [await fn(targets[0])]
        results: dict[int, _T] = {}
        errors: dict[int, BaseException] = {}

        async def one(i: int, r: Replica) -> None:
            try:
                results[i] = await fn(r)
            except Exception as exc:
                errors[i] = exc

        async with anyio.create_task_group() as tg:
            for i, r in enumerate(targets):
                tg.start_soon(one, i, r)
        if errors:
            raise errors[min(errors)]
        return [results[i] for i in range(len(targets))]

    async def reached(
        self, r: Replica, version: int, method: str, *args: object, answers: list[dict[str, Any]] | None = None
    ) -> bool:
        """One control call to ``r``; False when the replica is not there to take weights (dead,
        past the deadline, or 503): it is marked not current, with a warning, and gets the
        weights from ``reattach`` when it is back. Any other refusal is raised. ``answers``
        collects the replica's answer."""
        try:
            answer = await self.call(method, *args, replica=r)
            if answers is not None:
                answers.append(answer)
            return True
        except WeightControlError as exc:
            if not _unreachable(exc):
                raise
            log.warning(
                "inference server unreachable; it gets the weights when it is back",
                request=method,
                replica=r.index,
                weight_version=version,
                error=str(exc),
            )
            r.current = False
            return False

    async def pause(self, r: Replica, version: int) -> bool:
        """``r`` admits no new generation and no forward pass runs: its in-flight generations
        finished (drain) or frozen (``pause_body`` keep); False: not reached."""
        body = None if r.drain_only else self.pause_body
        if body is None:
            return await self.reached(r, version, "pause")
        try:
            return await self.reached(r, version, "pause", body)
        except WeightControlError as exc:
            if exc.status != 400:
                raise
            r.drain_only = True
            log.warning(
                "inference replica does not keep generations in flight through a sync; it drains them",
                replica=r.index,
                error=str(exc),
            )
            return await self.reached(r, version, "pause")

    async def resume(self, r: Replica, version: int) -> bool:
        """``r`` generates again, with ``version``; it holds the current weights."""
        if not await self.reached(r, version, "resume", version):
            return False
        r.version = version
        r.current = True
        return True

    async def update(
        self,
        r: Replica,
        version: int,
        fallback: int,
        method: str,
        *args: object,
        timed: Callable[[float, float], None] | None = None,
    ) -> bool:
        """Pause ``r``, give it ``version`` (``method``: update_weights or load), resume it. A
        refused update touched nothing: the replica resumes with what it had (its own version,
        else ``fallback``) and the refusal is raised. ``timed(pause_s, transfer_s)`` gets the
        replica's pause and its update apart."""
        t0 = time.perf_counter()
        if not await self.pause(r, version):
            return False
        t1 = time.perf_counter()
        try:
            if not await self.reached(r, version, method, *args):
                return False
        except WeightControlError:
            with anyio.CancelScope(shield=True):
                await self.resume(r, r.version if r.version is not None else fallback)
            raise
        finally:
            if timed is not None:
                timed(t1 - t0, time.perf_counter() - t1)
        return await self.resume(r, version)


class OnReplicas:
    """What every mode shows of its :class:`Replicas` (``self.replicas``), forwarded: the
    deadline, the timed-out requests, whether every replica is current, their versions."""

    replicas: Replicas

    @property
    def deadline(self) -> float:
        return self.replicas.deadline

    @deadline.setter
    def deadline(self, seconds: float) -> None:
        self.replicas.deadline = seconds

    @property
    def sync_timeouts(self) -> int:
        return self.replicas.sync_timeouts

    @property
    def server_current(self) -> bool:
        """Every replica holds the trainer's current weights."""
        return self.replicas.current

    @property
    def control_socket(self) -> Path | None:
        """Replica 0's socket (the one-replica view)."""
        return self.replicas[0].socket if self.replicas else None

    @control_socket.setter
    def control_socket(self, path: Path | None) -> None:
        self.replicas.set_sockets([path] if path is not None else [])

    def replica_versions(self) -> list[int | None]:
        """The weight_version each replica was last resumed with (None: not reached yet)."""
        return self.replicas.versions()


def sockets_of(control_socket: Path | None, control_sockets: Sequence[Path] | None) -> list[Path]:
    """The replicas' sockets from a mode's ``control_sockets`` or one-replica ``control_socket``."""
    if control_sockets is not None:
        return list(control_sockets)
    return [control_socket] if control_socket is not None else []


class Cadence:
    """Every ``sync_every`` steps: :meth:`due` counts a step and says whether a sync is due;
    :meth:`done` starts the count again once a sync reached every replica (one that did not
    is tried again at the next step)."""

    def __init__(self, sync_every: int = 1) -> None:
        self.sync_every = max(1, sync_every)
        self.since = 0

    def due(self) -> bool:
        self.since += 1
        return self.since >= self.sync_every

    def done(self) -> None:
        self.since = 0


@asynccontextmanager
async def unpaused(new_version: int | None = None) -> AsyncIterator[None]:
    """``paused`` of a mode whose replicas never compute on the trainer's memory: nothing to do."""
    yield

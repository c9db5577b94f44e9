"""The trainer's side of the trajectory API: register, then fetch batches ahead of the step.

``POST /register`` (ATROPOS-PROTOCOL.md §1.2), then ``GET /batch?wait=2``: atroposd's API holds
the request until a batch can be formed (a long-poll: the batch reaches the trainer as soon as
its last group is queued); an API that answers ``{"batch": null}`` at once (run-api) is polled
with a short back-off. At most ``max_staleness`` batches are held
beyond the one being trained: a slot is taken before each fetch and given back when the loop
has finished the step that used the batch (``release``), so rollouts are never more than
``max_staleness`` steps older than needed.

The feed survives the API going away (connection refused while it restarts: it waits, with
``waiting_for = "api"``) and an API that lost its registration (it answers
``{"status": "error"}``: it registers again). Waiting for data is visible — a log line every
``LOG_EVERY_S`` — and bounded by ``data_timeout`` only when no environment is alive
(SPEC §4).

With ``filter_groups`` (SPEC §14, DAPO's dynamic sampling) a :class:`GroupFilter` sits between
the API and the step: a group whose scores are all equal (it would train nothing) is dropped
as it arrives, unless it carries its own ``advantages`` or distillation fields, and batches are
fetched until ``batch_size`` sequences are kept; groups beyond that wait for the next batch.
The dropped groups go with the batch they were dropped for (``last_filtered``), so the step's
``reward_mean`` and ``accuracy`` still cover every group received. While the groups coming are
dropped (every one since the last batch, or a batch's worth in a row behind kept groups too few
for a batch), the trainer waits with ``waiting_for = "filtered"``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import anyio
import orjson
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from atroposd.timeline import rollout_timing

__all__ = ["BatchFeed", "DataTimeout", "GroupFilter", "trains_nothing"]

log = structlog.get_logger("trainer", component="trainer")  # lazy: bound at first use

POLL_MIN_S = 0.005
POLL_MAX_S = 0.25
LONG_POLL_S = 2.0  # GET /batch?wait=: atroposd's API answers as soon as a batch can be formed
LOG_EVERY_S = 10.0
REQUEST_TIMEOUT_S = 30.0


class DataTimeout(RuntimeError):
    pass


def trains_nothing(group: object) -> bool:
    """Whether ``filter_groups`` drops ``group``: its scores are all equal (finite numbers), and
    it carries neither its own ``advantages`` nor distillation fields. A malformed group is not
    dropped here: batch preparation rejects it by reason."""
    if not isinstance(group, Mapping):
        return False
    scores = group.get("scores")
    if not isinstance(scores, list) or not scores:
        return False
    if not all(type(s) in (int, float) and math.isfinite(s) for s in scores):
        return False
    if any(group.get(k) is not None for k in ("advantages", "distill_token_ids", "distill_logprobs")):
        return False
    return bool(max(scores) == min(scores))


def _sequences(group: object) -> int:
    tokens = group.get("tokens") if isinstance(group, Mapping) else None
    return len(tokens) if isinstance(tokens, list) else 1


class GroupFilter:
    """Drops the groups that train nothing and fills batches of ``batch_size`` sequences from
    the rest (whole groups, in arrival order)."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.pending: list[dict[str, Any]] = []  # kept, not yet in a batch
        self.dropped: list[dict[str, Any]] = []  # dropped since the last batch was formed
        self.filtered = 0  # groups dropped since this process started
        self._dropped_run = 0  # sequences in the groups dropped since the last one kept

    def add(self, groups: list[dict[str, Any]]) -> None:
        for group in groups:
            if trains_nothing(group):
                self.dropped.append(group)
                self.filtered += 1
                self._dropped_run += _sequences(group)
            else:
                self.pending.append(group)
                self._dropped_run = 0

    @property
    def starved(self) -> bool:
        """The filter is why the trainer waits: every group received since the last batch was
        dropped, or the last batch's worth of groups in a row was (the groups kept before them,
        too few for a batch, wait for more that may not come)."""
        if not self.dropped:
            return False
        return not self.pending or self._dropped_run >= self.batch_size

    def take(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
        """(a full batch, the groups dropped while it filled), or None while too few are kept."""
        if sum(_sequences(g) for g in self.pending) < self.batch_size:
            return None
        batch: list[dict[str, Any]] = []
        rest: list[dict[str, Any]] = []
        n = 0
        for group in self.pending:
            k = _sequences(group)
            if n + k <= self.batch_size:
                batch.append(group)
                n += k
            else:
                rest.append(group)
        if not batch:  # a group larger than a batch: alone, as the API would send it
            batch, rest = rest[:1], rest[1:]
        self.pending = rest
        dropped, self.dropped = self.dropped, []
        return batch, dropped


class BatchFeed:
    """registration() gives the ``/register`` body (its ``starting_step`` is the current step at
    each call). on_wait(reason | None) reports what it waits for."""

    def __init__(
        self,
        api_url: str,
        registration: Callable[[], dict[str, Any]],
        *,
        max_ahead: int,
        token: str = "",
        on_wait: Callable[[str | None], None] = lambda _r: None,
        group_filter: GroupFilter | None = None,
    ) -> None:
        self.api_url = api_url.rstrip("/")
        self.registration = registration
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.on_wait = on_wait
        self.slots = anyio.Semaphore(max(0, max_ahead) + 1)
        # each batch with the rollout side of its timeline (atroposd.timeline)
        send, receive = anyio.create_memory_object_stream[_Arrival](math.inf)
        self._send: MemoryObjectSendStream[_Arrival] = send
        self._receive: MemoryObjectReceiveStream[_Arrival] = receive
        #: the rollout side of the timeline of the batch ``next`` returned last
        self.last_timeline: dict[str, float | None] = {}
        #: the groups filter_groups dropped for the batch ``next`` returned last
        self.last_filtered: list[dict[str, Any]] = []
        self.group_filter = group_filter
        self._waiting = False  # next() is waiting for a batch
        self._fetch_s = 0.0
        self._session: aiohttp.ClientSession | None = None
        self._wait_scope: anyio.CancelScope | None = None
        self.last_data = time.monotonic()
        self.registrations = 0
        self.fetched = 0

    # ------------------------------------------------------------------ HTTP

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S), headers=self.headers
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._send.close()
        self._receive.close()

    async def register(self) -> None:
        """``POST /register`` until the API answers (it may be starting or restarting)."""
        delay = 0.05
        while True:
            try:
                request = self.registration()
                async with self._http().post(f"{self.api_url}/register", json=request) as resp:
                    body = await resp.read()
                    if resp.status == 200:
                        self.registrations += 1
                        self.on_wait(None)
                        log.info(
                            "registered with the API",
                            url=self.api_url,
                            uuid=_field(body, "uuid"),
                            batch_size=request["batch_size"],
                            starting_step=request["starting_step"],
                        )
                        return
                    raise _ApiHttpError(f"/register answered {resp.status}: {body[:200]!r}")
            except (aiohttp.ClientError, OSError, TimeoutError, _ApiHttpError) as exc:
                self.on_wait("api")
                log.debug("API not reachable for registration", error=str(exc))
            await anyio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def fetch_once(self, wait: float = 0.0) -> list[dict[str, Any]] | None:
        """One ``GET /batch``: the groups, or None when the API has none (or is unreachable).

        ``wait`` > 0: atroposd's API holds the request until a batch can be formed, for up to
        ``wait`` s (``?wait=``; another API answers at once)."""
        url = f"{self.api_url}/batch" + (f"?wait={wait:g}" if wait > 0 else "")
        try:
            started = time.perf_counter()
            async with self._http().get(url) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise _ApiHttpError(f"/batch answered {resp.status}: {body[:200]!r}")
            self._fetch_s = time.perf_counter() - started
        except (aiohttp.ClientError, OSError, TimeoutError, _ApiHttpError) as exc:
            self.on_wait("api")
            log.debug("API not reachable for /batch", error=str(exc))
            return None
        data = _parse(body)
        if isinstance(data, dict) and data.get("status") == "error":
            # The API restarted without our registration: register again (same body, same step).
            log.warning("the API lost the trainer's registration; registering again", message=data.get("message"))
            await self.register()
            return None
        batch = data.get("batch") if isinstance(data, dict) else None
        if not batch:
            return None
        if not isinstance(batch, list):
            log.warning("ignoring a malformed batch from the API", type=type(batch).__name__)
            return None
        return batch

    # ------------------------------------------------------------------ prefetch

    async def prime(self) -> None:
        """The first ``GET /batch`` (it opens the API to the environments); keeps what it gets."""
        await self.slots.acquire()
        batch = await self.fetch_once()
        taken = self._filtered(batch) if batch is not None else None
        if taken is None:
            self.slots.release()
        else:
            await self._deliver(*taken)

    async def run(self) -> None:
        """Fetch ahead forever (a task): take a slot, poll until a batch comes, hand it over."""
        while True:
            await self.slots.acquire()
            delivered = False
            try:
                delay = POLL_MIN_S
                while True:
                    asked = time.monotonic()
                    if (batch := await self.fetch_once(LONG_POLL_S)) is not None:
                        if (taken := self._filtered(batch)) is not None:
                            break
                        delay = POLL_MIN_S  # groups were dropped: fill the batch from the queue
                        continue
                    if time.monotonic() - asked >= LONG_POLL_S / 2:
                        delay = POLL_MIN_S  # a long-poll that ran out: ask again at once
                        continue
                    await anyio.sleep(delay)  # answered at once: an API that does not long-poll
                    delay = min(delay * 2, POLL_MAX_S)
                await self._deliver(*taken)
                delivered = True
            finally:
                # Cancelled while polling (the trainer group restarts and starts a new run):
                # the slot goes back, or each restart would leave one fewer until none is left.
                if not delivered:
                    self.slots.release()

    def _filtered(self, batch: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
        """The batch to deliver and the groups dropped for it (without a filter: as it came)."""
        f = self.group_filter
        if f is None:
            return batch, []
        f.add(batch)
        taken = f.take()
        if taken is None and f.starved and self._waiting:
            self.on_wait("filtered")  # every group so far trains nothing: say so, not "data"
        return taken

    async def _deliver(self, batch: list[dict[str, Any]], dropped: list[dict[str, Any]] | None = None) -> None:
        self.fetched += 1
        timeline = {**rollout_timing(batch, time.time()), "fetch_s": self._fetch_s}
        await self._send.send((batch, timeline, dropped or []))

    def release(self) -> None:
        """The step that used a batch is over: one more batch may be fetched."""
        self.slots.release()

    def cancel_wait(self) -> None:
        if self._wait_scope is not None:
            self._wait_scope.cancel()

    async def next(self, *, data_timeout: float, envs_alive: Callable[[], bool]) -> list[dict[str, Any]] | None:
        """The next batch; None if the wait was cancelled (stop requested).

        Raises DataTimeout after ``data_timeout`` without data while no environment is alive.
        """
        try:
            batch, self.last_timeline, self.last_filtered = self._receive.receive_nowait()
            self.last_data = time.monotonic()
            return batch
        except anyio.WouldBlock:
            pass
        started = time.monotonic()
        self.on_wait(self._wait_reason())
        self._waiting = True
        with anyio.CancelScope() as scope:
            self._wait_scope = scope
            try:
                while True:
                    with anyio.move_on_after(min(LOG_EVERY_S, data_timeout)):
                        batch, self.last_timeline, self.last_filtered = await self._receive.receive()
                        self.on_wait(None)
                        self.last_data = time.monotonic()
                        return batch
                    self.on_wait(self._wait_reason())
                    quiet = time.monotonic() - self.last_data
                    alive = envs_alive()
                    extra = (
                        {}
                        if self.group_filter is None
                        else {
                            "filtered_since_last_batch": len(self.group_filter.dropped),
                            "kept_sequences": sum(_sequences(g) for g in self.group_filter.pending),
                        }
                    )
                    log.info(
                        "waiting for data",
                        waited_s=round(time.monotonic() - started, 1),
                        since_last_batch_s=round(quiet, 1),
                        environments_alive=alive,
                        **extra,
                    )
                    if quiet >= data_timeout and not alive:
                        raise DataTimeout(
                            f"no data for {quiet:.0f} s (trainer.data_timeout = {data_timeout:g}) "
                            "and no environment is alive or restartable"
                        )
            finally:
                self._wait_scope = None
                self._waiting = False
        return None

    def _wait_reason(self) -> str:
        """``filtered`` while every group received since the last batch was dropped, else ``data``."""
        return "filtered" if self.group_filter is not None and self.group_filter.starved else "data"


_Arrival = tuple[list[dict[str, Any]], dict[str, float | None], list[dict[str, Any]]]


class _ApiHttpError(Exception):
    pass


def _field(body: bytes, key: str) -> object:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return data.get(key) if isinstance(data, dict) else None


def _parse(body: bytes) -> object:
    """A ``/batch`` answer. NaN and Infinity literals (Python's json writes them; orjson refuses
    them) are read too, so that batch preparation judges each group instead of the whole batch
    being lost; a body that is not JSON at all is logged and read as "no batch"."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        log.warning("ignoring a /batch answer that is not JSON", error=str(exc)[:200], body=body[:200])
        return None

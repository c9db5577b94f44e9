"""An Atropos environment's side of the trajectory API (ATROPOS-PROTOCOL.md §1.1, §1.3).

``AtroposEnvClient`` registers (riding the "wait for trainer to start" gate), reads
``/status-env``, submits scored groups and disconnects. Unlike atroposlib's env loop it never
drops an accepted-for-sending group: a 503 (the API is full) is retried after its
``Retry-After``, a 5xx or a lost connection (the API restarting) is retried with backoff until
the API takes the group, and after a lost connection the registration is checked and renewed
if the API forgot it. Only a 4xx, which no retry can fix, rejects a group, and that is logged
as an error with the API's message.

``QueueGate`` is the cooperative throttle: it admits a new group only while this
environment's groups queued at the API plus those in flight stay under its weight's share
of ``max_batches_offpolicy`` trainer batches, which bounds how stale a rollout can be when
the trainer takes it and makes batches follow the environments' weights.
"""

from __future__ import annotations

import gzip
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anyio
import orjson
from structlog.typing import FilteringBoundLogger

from atroposd.envs.retry import CONNECTION_ERRORS, Backoff, Retry, retry_after
from atroposd.logs import get_logger

# Bodies from 1 KiB up are gzip-compressed, as atroposlib's environments send them.
GZIP_MIN_BYTES = 1024
# Status older than this is fetched again before a decision.
STATUS_MAX_AGE = 0.1
# A held-back environment's /status-env long-poll lasts at most this long (atroposd's API).
LONG_POLL_S = 1.0
# The "wait for trainer to start" gate is asked again this often.
REGISTER_POLL = 0.5


class ApiError(RuntimeError):
    """The API answered in a way no retry can fix."""


class GroupRejected(ApiError):
    """``/scored_data`` answered 4xx: the group itself is invalid."""


@dataclass(frozen=True)
class EnvRegistration:
    """The body of ``POST /register-env``."""

    desired_name: str
    group_size: int
    max_token_length: int
    weight: float = 1.0
    min_batch_allocation: float | None = None

    def body(self) -> dict[str, Any]:
        return {
            "max_token_length": self.max_token_length,
            "desired_name": self.desired_name,
            "weight": self.weight,
            "group_size": self.group_size,
            "min_batch_allocation": self.min_batch_allocation,
        }


@dataclass(frozen=True)
class Registration:
    """What the API assigned, plus the trainer's ``/info``."""

    env_id: int
    wandb_name: str
    starting_step: int
    num_steps: int
    batch_size: int
    max_token_len: int


@dataclass(frozen=True)
class EnvStatus:
    """``GET /status-env``: ``queue_size`` counts groups of this environment's size."""

    current_step: int
    queue_size: int
    at: float  # anyio.current_time() when fetched
    #: this environment's own groups in the queue (an API without the field: ``queue_size``)
    self_queue_size: int = 0
    #: this environment's share of each batch by the registered weights (``env_weight``), 0..1
    env_weight: float = 1.0
    #: how many of this environment's groups left the API's queue so far (an atroposd API's
    #: answer to a long-poll; None: the API does not long-poll)
    dequeued: int | None = None


@dataclass
class ClientStats:
    submitted_groups: int = 0
    submit_retries: int = 0
    refused_503: int = 0
    rejected_groups: int = 0
    registrations: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class AtroposEnvClient:
    """One environment's connection to the trajectory API."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        api_url: str,
        registration: EnvRegistration,
        *,
        token: str = "",
        log: FilteringBoundLogger | None = None,
    ) -> None:
        self._session = session
        self._url = api_url.rstrip("/")
        self._reg_body = registration
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._log = log or get_logger("envs.client")
        self.registration: Registration | None = None
        self.stats = ClientStats()
        # Set by a lost connection: the API may have restarted and forgotten our env_id.
        self._check_registration = False
        # Groups accepted since the last /status-env answer (the gate counts them as queued).
        self.accepted_since_status = 0
        self._registration_lock = anyio.Lock()

    # ------------------------------------------------------------------ registration

    async def register(self) -> Registration:
        """Register, waiting as long as it takes for the API to be up and the trainer to have
        started (the API answers "wait for trainer to start" until its first ``GET /batch``)."""
        backoff = Backoff(self._log, "register-env")
        while True:
            try:
                answer = await self._request("POST", "/register-env", self._reg_body.body())
                if answer.get("status") != "success":
                    raise Retry(f"API says {answer.get('status', answer)!r}", delay=REGISTER_POLL)
                info = await self._request("GET", "/info")
                break
            except Retry as retry:
                await backoff.wait(retry)
        backoff.done()
        reg = Registration(
            env_id=int(answer["env_id"]),
            wandb_name=str(answer.get("wandb_name", "")),
            starting_step=int(answer.get("starting_step") or 0),
            num_steps=int(answer.get("num_steps") or 0),
            batch_size=int(info.get("batch_size", -1)),
            max_token_len=int(info.get("max_token_len", -1)),
        )
        self.registration = reg
        self.stats.registrations += 1
        self._check_registration = False
        self._log.info(
            "registered",
            env_id=reg.env_id,
            name=reg.wandb_name,
            batch_size=reg.batch_size,
            max_token_len=reg.max_token_len,
            starting_step=reg.starting_step,
            num_steps=reg.num_steps,
        )
        return reg

    async def disconnect(self) -> None:
        """``POST /disconnect-env``, once, best effort: a stopping environment does not wait
        for an API that is gone."""
        if self.registration is None:
            return
        try:
            await self._request("POST", "/disconnect-env", {"env_id": self.registration.env_id})
            self._log.info("disconnected", env_id=self.registration.env_id)
        except (Retry, ApiError) as exc:
            self._log.warning("disconnect-env failed", error=str(exc))

    # ------------------------------------------------------------------ status

    async def status(self, *, wait_s: float = 0.0, dequeued: int | None = None) -> EnvStatus:
        """``GET /status-env`` (a GET with a JSON body), retried until it answers; an API that no
        longer knows this environment gets it registered again first.

        ``wait_s`` > 0 (atroposd's API): a long-poll, answered once this environment's
        ``dequeued`` count is no longer ``dequeued`` (its groups left the queue: room opened), the
        environments changed, or after ``wait_s``. Any API answers the first request (no
        ``dequeued`` yet) at once; one that does not long-poll answers every request at once
        and without ``dequeued``."""
        backoff = Backoff(self._log, "status-env")
        while True:
            try:
                await self._ensure_registered()
                assert self.registration is not None
                # Groups accepted while this request is under way may or may not be counted in
                # its answer: keep counting them (an overestimate only throttles a little early).
                counted = self.accepted_since_status
                body: dict[str, Any] = {"env_id": self.registration.env_id}
                if wait_s > 0:
                    body.update(wait_s=wait_s if dequeued is not None else 0.0, dequeued=dequeued)
                answer = await self._request("GET", "/status-env", body)
                break
            except Retry as retry:
                await backoff.wait(retry)
        backoff.done()
        self.accepted_since_status -= counted
        queue_size = int(answer.get("queue_size", 0))
        share = float(answer.get("env_weight", 1.0))
        taken = answer.get("dequeued")
        return EnvStatus(
            current_step=int(answer.get("current_step", 0)),
            queue_size=queue_size,
            at=anyio.current_time(),
            self_queue_size=int(answer.get("self_queue_size", queue_size)),
            env_weight=min(1.0, share) if math.isfinite(share) and share > 0 else 1.0,
            dequeued=taken if isinstance(taken, int) and not isinstance(taken, bool) else None,
        )

    # ------------------------------------------------------------------ submission

    async def submit(self, group: dict[str, Any]) -> dict[str, Any]:
        """``POST /scored_data`` until the API accepts the group; ``env_id`` is filled in.

        Raises GroupRejected on a 4xx (logged with the API's message)."""
        backoff = Backoff(self._log, "scored_data")
        while True:
            try:
                await self._ensure_registered()
                assert self.registration is not None
                answer = await self._request(
                    "POST", "/scored_data", {**group, "env_id": self.registration.env_id}, scored=True
                )
                break
            except Retry as retry:
                self.stats.submit_retries += 1
                await backoff.wait(retry)
        backoff.done()
        self.stats.submitted_groups += 1
        self.accepted_since_status += 1
        return answer

    async def _ensure_registered(self) -> None:
        """After a lost connection, ask the API whether it still knows our env_id (an API
        restarted with its spool does; a fresh one does not) and register again if not."""
        if self.registration is not None and not self._check_registration:
            return
        # One task checks or renews the registration; the others wait and then use its result
        # (several registering at once would leave stray environments at the API).
        async with self._registration_lock:
            if self.registration is not None and not self._check_registration:
                return
            await self._renew_registration()

    async def _renew_registration(self) -> None:
        if self.registration is not None:
            try:
                await self._request("GET", "/status-env", {"env_id": self.registration.env_id}, probe=True)
                self._check_registration = False
                return
            except ApiError as exc:
                self.registration_lost(str(exc))
        await self.register()

    # ------------------------------------------------------------------ HTTP

    async def _request(
        self, method: str, path: str, body: object = None, *, scored: bool = False, probe: bool = False
    ) -> dict[str, Any]:
        """One request. Transient failures raise Retry; permanent ones ApiError/GroupRejected.

        ``probe``: any answer but 200 raises ApiError (the API does not know this environment;
        a restarted run-api answers 500, atroposd's API 404)."""
        headers = dict(self._headers)
        data: bytes | None = None
        if body is not None:
            data = orjson.dumps(body)
            headers["Content-Type"] = "application/json"
            if len(data) >= GZIP_MIN_BYTES:
                data = gzip.compress(data, compresslevel=1)
                headers["Content-Encoding"] = "gzip"
        try:
            async with self._session.request(method, self._url + path, data=data, headers=headers) as resp:
                text = await resp.text()
                status, retry_header = resp.status, resp.headers.get("Retry-After")
        except CONNECTION_ERRORS as exc:
            self._check_registration = True
            raise Retry(f"{type(exc).__name__}: {exc}".rstrip(": "), connection=True) from exc
        if status == 200:
            try:
                answer = orjson.loads(text)
            except orjson.JSONDecodeError as exc:
                raise Retry(f"{path} answered 200 with a body that is not JSON: {text[:200]!r}") from exc
            return answer if isinstance(answer, dict) else {"value": answer}
        if probe:
            raise ApiError(f"{path} answered {status}: {text[:200]}")
        if status == 404 and path == "/status-env":
            self.registration_lost(f"{path} answered 404: {text[:200]}")
            raise Retry("the API does not know this environment")
        if status >= 500:
            if status == 503 and scored:
                self.stats.refused_503 += 1
            raise Retry(f"{path} answered {status}: {text[:200]}", delay=retry_after(retry_header))
        message = f"{method} {path} answered {status}: {text[:500]}"
        if scored:
            self.stats.rejected_groups += 1
            self._log.error(
                "group rejected by the API (not retried: a 4xx means the group is invalid)",
                status=status,
                message=text[:500],
            )
            raise GroupRejected(message)
        raise ApiError(message)

    def registration_lost(self, reason: str) -> None:
        """Forget the env_id: the next call registers again."""
        if self.registration is not None:
            self._log.warning("registration lost; registering again", env_id=self.registration.env_id, reason=reason)
        self.registration = None


class QueueGate:
    """Admits a new group only while this environment's queued and in-flight groups stay under
    its share of ``limit`` (``max_batches_offpolicy`` batches' worth of groups).

    The share is the API's ``env_weight`` (this environment's ``[[env]] weight`` over all the
    connected ones'): each environment keeps at most its share of the off-policy budget
    waiting, so batches are made of the environments' groups in the proportion of their
    weights. Alone, an environment's share is 1: the whole budget. The shares of every
    environment add up to the budget, so the queue can always reach a full batch.

    While held back it learns that room opened without polling: against atroposd's API it
    long-polls ``/status-env`` (answered when this environment's groups leave the queue), so the
    next group starts as soon as the trainer took a batch; against any other API it asks again
    every ``STATUS_MAX_AGE``. The count stays exact: the gate long-polls only on an answer that
    was asked and received while none of this environment's groups was being posted
    (``posting``/``posted`` tell it), so the groups it counts as queued are exactly those posted
    before it; an answer that overlapped a post is asked again once the posts are answered.
    """

    def __init__(self, client: AtroposEnvClient, *, limit: int, log: FilteringBoundLogger | None = None) -> None:
        self._client = client
        self.limit = max(1, limit)
        self._log = log or get_logger("envs.gate")
        self._status: EnvStatus | None = None
        self.throttled = False
        self.throttled_s = 0.0
        self._throttled_since = 0.0
        self._posting = 0
        self._posts_started = 0
        self._posted = anyio.Event()  # set when no post is under way
        self._posted.set()
        self._long_poll: anyio.CancelScope | None = None
        self._exact = False  # the status was asked and answered while no post was under way
        self.long_polls = 0

    @property
    def status(self) -> EnvStatus | None:
        return self._status

    def posting(self) -> None:
        """A group of this environment is about to be posted (a long-poll under way goes on: its
        answer will not count as exact)."""
        self._posting += 1
        self._posts_started += 1
        if self._posting == 1:
            self._posted = anyio.Event()

    def posted(self) -> None:
        """A post ended (accepted, rejected or abandoned)."""
        self._posting -= 1
        if self._posting == 0:
            self._posted.set()

    def nudge(self) -> None:
        """A group ended without reaching the queue (its room is free again): look again instead
        of waiting for the API."""
        if self._long_poll is not None:
            self._long_poll.cancel()

    async def wait_for_room(self, in_flight: Callable[[], int]) -> EnvStatus:
        """Return once one more group fits: queued + accepted since the status + ``in_flight()``
        (the groups being generated or submitted, not counting the new one) < limit."""
        while True:
            status = self._status
            if status is None or anyio.current_time() - status.at > STATUS_MAX_AGE:
                status = await self._fetch(wait_s=LONG_POLL_S)
            queued = status.self_queue_size + self._client.accepted_since_status
            busy = in_flight()
            limit = self.limit_for(status)
            if queued + busy < limit:
                self._set_throttled(False, queued, busy, limit)
                return status
            self._set_throttled(True, queued, busy, limit)
            if status.dequeued is None:
                await anyio.sleep(STATUS_MAX_AGE)  # an API that does not long-poll: ask again
                continue
            if not self._exact:
                # Groups accepted while that answer was on its way may be counted twice: wait
                # for the posts, ask again, and long-poll only on an exact count.
                with anyio.move_on_after(STATUS_MAX_AGE):
                    await self._posted.wait()
                self._status = None
                continue
            with anyio.CancelScope() as scope:
                self._long_poll = scope
                try:
                    self.long_polls += 1
                    await self._fetch(wait_s=LONG_POLL_S, dequeued=status.dequeued)
                finally:
                    self._long_poll = None
            if scope.cancelled_caught:
                self._status = None  # a group ended without reaching the queue: ask again

    async def _fetch(self, *, wait_s: float, dequeued: int | None = None) -> EnvStatus:
        """A fresh status; ``_exact`` says whether no post was under way while it was asked and
        answered."""
        before = self._posts_started
        quiet = self._posting == 0
        self._exact = False
        status = self._status = await self._client.status(wait_s=wait_s, dequeued=dequeued)
        self._exact = quiet and self._posting == 0 and self._posts_started == before
        return status

    def limit_for(self, status: EnvStatus) -> int:
        """Groups this environment may have queued or in flight: its share of the limit."""
        return max(1, math.ceil(self.limit * status.env_weight - 1e-9))

    def _set_throttled(self, on: bool, queued: int, in_flight: int, limit: int) -> None:
        if on == self.throttled:
            return
        now = anyio.current_time()
        self.throttled = on
        # Debug level: in steady state the gate closes and opens with every trainer step; the
        # progress line reports the time spent throttled.
        if on:
            self._throttled_since = now
            self._log.debug(
                "throttled: the API holds enough of this environment's groups",
                queued_groups=queued,
                in_flight=in_flight,
                limit=limit,
            )
        else:
            self.throttled_s += now - self._throttled_since
            self._log.debug(
                "resumed",
                queued_groups=queued,
                in_flight=in_flight,
                limit=limit,
                throttled_s=round(now - self._throttled_since, 2),
            )

    def throttled_total(self) -> float:
        """Seconds spent throttled so far, the current spell included."""
        extra = anyio.current_time() - self._throttled_since if self.throttled else 0.0
        return self.throttled_s + extra

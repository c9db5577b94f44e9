"""The loop of a built-in environment, shared by every task.

Register with the API (waiting through the "wait for trainer to start" gate), then keep up to
``concurrency`` groups in flight — each one ``/generate`` request of ``n = group_size``
followed by ``POST /scored_data`` — so that rollouts overlap with training, while the
``QueueGate`` keeps this environment's queued plus in-flight groups under
``max_batches_offpolicy`` trainer batches.

The environment does not exit by itself when the API's step counter reaches the trainer's
``num_steps`` (atroposlib environments do): a resumed trainer may still need data, and the
daemon stops environments when the job ends.

Stop (SIGTERM or SIGINT): no new group starts; generations in flight are abandoned (nothing of
them was accepted anywhere); groups already scored get ``stop_grace`` seconds to reach the
API, and any cut off is logged as dropped; then ``/disconnect-env`` and exit 0. A second
signal skips the grace. Exit 1 on a failure no retry can fix (a 4xx from ``/generate``, an API
that refuses the registration), exit 2 when the job cannot fit the task (sequences longer than
the trainer's ``max_token_len``, a group larger than its batch).
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import aiohttp
import anyio
from anyio.abc import TaskGroup
from structlog.typing import FilteringBoundLogger

from atroposd.envs.client import (
    ApiError,
    AtroposEnvClient,
    EnvRegistration,
    GroupRejected,
    QueueGate,
    Registration,
)
from atroposd.envs.generate import GenerateError, InferenceClient
from atroposd.exitcodes import Exit
from atroposd.heartbeat import HeartbeatSender
from atroposd.logs import get_logger
from atroposd.timeline import stamp_timing

DISCONNECT_TIMEOUT = 3.0


@dataclass
class ScoredGroup:
    """One group ready for ``POST /scored_data`` (without ``env_id``), with its summary."""

    payload: dict[str, Any]
    scores: list[float]
    correct: list[bool]
    weight_version: int | None
    #: seconds at the gate, generating (and scoring), posting; set by the runner once accepted
    timing: tuple[float, float, float] | None = None

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct)


#: a task's item: what one group is rolled out from (the arithmetic task's: a problem)
Item = TypeVar("Item")


class EnvTask(Protocol[Item]):
    """What the runner needs from a task."""

    @property
    def max_sequence_len(self) -> int: ...

    def describe(self) -> dict[str, Any]: ...

    def next_item(self) -> Item: ...

    async def rollout(self, item: Item, infer: InferenceClient, group_size: int) -> ScoredGroup: ...


class UsageError(Exception):
    """The environment cannot run with this job's settings (exit 2)."""


@dataclass(frozen=True)
class RunnerSettings:
    name: str
    api_url: str
    inference_url: str
    group_size: int
    max_token_length: int
    concurrency: int
    max_batches_offpolicy: int
    weight: float = 1.0
    api_token: str = ""
    inference_token: str = ""  # the inference servers' bearer token ("" = none)
    stop_grace: float = 5.0
    report_every: float = 10.0
    #: every inference replica (generations go to the least busy ready one); empty: inference_url alone
    inference_urls: tuple[str, ...] = ()


@dataclass
class _Window:
    """Rollout statistics since the last progress line."""

    groups: int = 0
    sequences: int = 0
    reward_sum: float = 0.0
    exact: int = 0
    versions: set[int] = field(default_factory=set)
    started: float = 0.0
    #: summed seconds at the gate, generating, posting (the groups' timelines)
    timing: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])

    def add(self, group: ScoredGroup) -> None:
        self.groups += 1
        self.sequences += len(group.scores)
        self.reward_sum += sum(group.scores)
        self.exact += sum(group.correct)
        if group.weight_version is not None:
            self.versions.add(group.weight_version)
        if group.timing is not None:
            for i, seconds in enumerate(group.timing):
                self.timing[i] += seconds


class EnvRunner(Generic[Item]):
    def __init__(
        self, task: EnvTask[Item], settings: RunnerSettings, *, log: FilteringBoundLogger | None = None
    ) -> None:
        self.task = task
        self.settings = settings
        self.log = log or get_logger("envs", env=settings.name)
        # Created in run(): anyio primitives need the running event loop.
        self._slots: anyio.Semaphore | None = None
        self._front: anyio.CancelScope | None = None
        self._groups_scope: anyio.CancelScope | None = None
        self._generating: set[anyio.CancelScope] = set()
        self._generation_started: dict[int, float] = {}  # id(scope) → when its generation began
        self._stopping = False
        self._fatal: tuple[int, str] | None = None
        self._window = _Window()
        self.totals = _Window()
        self.dropped_at_stop = 0
        self._throttled_at_window = 0.0
        self.api: AtroposEnvClient | None = None
        self.infer: InferenceClient | None = None
        self.gate: QueueGate | None = None

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        """Run until stopped; returns the exit code."""
        s = self.settings
        self._slots = anyio.Semaphore(s.concurrency)
        self._front = anyio.CancelScope()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)
        async with aiohttp.ClientSession(timeout=timeout) as session, anyio.create_task_group() as tg:
            tg.start_soon(self._watch_signals)
            tg.start_soon(self._report_loop)
            # Liveness (SPEC §4): a beat every second tells the daemon this loop runs, and what it waits on.
            tg.start_soon(HeartbeatSender.from_environ(s.name, state=self.heartbeat_state).run)
            registration = EnvRegistration(
                desired_name=s.name, group_size=s.group_size, max_token_length=s.max_token_length, weight=s.weight
            )
            self.api = AtroposEnvClient(session, s.api_url, registration, token=s.api_token, log=self.log)
            infer = InferenceClient(session, s.inference_urls or s.inference_url, log=self.log, token=s.inference_token)
            self.infer = infer
            self.log.info(
                "environment starting",
                api=s.api_url,
                inference=",".join(s.inference_urls or (s.inference_url,)),
                group_size=s.group_size,
                concurrency=s.concurrency,
                **self.task.describe(),
            )
            await self._serve(self.api, infer)
            with anyio.CancelScope(shield=True), anyio.move_on_after(DISCONNECT_TIMEOUT):
                await self.api.disconnect()
            tg.cancel_scope.cancel()
        self._report(final=True)
        if self._fatal is not None:
            code, message = self._fatal
            self.log.error("environment failed", error=message, exit_code=code)
            return code
        self.log.info("environment stopped")
        return Exit.OK

    def request_stop(self, *, now: bool = False) -> None:
        """Stop starting groups, abandon generations, give scored groups ``stop_grace`` (or, with
        ``now``, no time) to reach the API."""
        first = not self._stopping
        self._stopping = True
        if self._front is not None:
            self._front.cancel()
        for scope in list(self._generating):
            scope.cancel()
        if self._groups_scope is not None:
            grace = 0.0 if now or not first else self.settings.stop_grace
            deadline = anyio.current_time() + grace
            self._groups_scope.deadline = min(self._groups_scope.deadline, deadline)

    def _fail(self, code: int, message: str) -> None:
        if self._fatal is None:
            self._fatal = (code, message)
        self.request_stop(now=True)

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                self.log.info("stop requested", signal=signal.Signals(signum).name, again=self._stopping)
                self.request_stop(now=self._stopping)

    # ------------------------------------------------------------------ the loop

    async def _serve(self, api: AtroposEnvClient, infer: InferenceClient) -> None:
        async with anyio.create_task_group() as groups:
            self._groups_scope = groups.cancel_scope
            assert self._front is not None
            with self._front:
                try:
                    registration = await api.register()
                    self._check_fits(registration)
                except UsageError as exc:
                    self._fail(Exit.USAGE, str(exc))
                    return
                except ApiError as exc:
                    self._fail(Exit.RUNTIME, str(exc))
                    return
                self.gate = QueueGate(api, limit=self._queue_limit(registration), log=self.log)
                self._window.started = self.totals.started = anyio.current_time()
                await self._dispatch(groups, self.gate, api, infer)

    async def _dispatch(
        self, groups: TaskGroup, gate: QueueGate, api: AtroposEnvClient, infer: InferenceClient
    ) -> None:
        """Start a group whenever a concurrency slot is free and the API has room for it."""
        slots = self._slots
        assert slots is not None
        while True:
            await slots.acquire()
            try:
                # The groups in flight besides the one about to start.
                wanted = anyio.current_time()
                await gate.wait_for_room(lambda: self.settings.concurrency - slots.value - 1)
            except BaseException:
                slots.release()
                raise
            groups.start_soon(self._one_group, self.task.next_item(), api, infer, anyio.current_time() - wanted)

    async def _one_group(self, item: Item, api: AtroposEnvClient, infer: InferenceClient, gate_s: float = 0.0) -> None:
        settled = False  # accepted by the API, or rejected by it for good
        accepted = False
        group: ScoredGroup | None = None
        try:
            with anyio.CancelScope() as generation:
                self._generating.add(generation)
                started = self._generation_started[id(generation)] = anyio.current_time()
                try:
                    group = await self.task.rollout(item, infer, self.settings.group_size)
                finally:
                    self._generating.discard(generation)
                    self._generation_started.pop(id(generation), None)
            if group is None:
                return  # abandoned at stop; nothing of it reached the API
            posting = anyio.current_time()
            stamp_timing(group.payload, gate_s=gate_s, generate_s=posting - started)
            gate = self.gate
            if gate is not None:
                gate.posting()
            try:
                await api.submit(group.payload)
            except GroupRejected:
                settled = True  # logged with the API's message by the client
                return
            finally:
                if gate is not None:
                    gate.posted()
            settled = accepted = True
            group.timing = (gate_s, posting - started, anyio.current_time() - posting)
            self._window.add(group)
            self.totals.add(group)
        except GenerateError as exc:
            self._fail(Exit.RUNTIME, str(exc))
        except ApiError as exc:
            self._fail(Exit.RUNTIME, str(exc))
        finally:
            assert self._slots is not None
            self._slots.release()
            if not accepted and self.gate is not None:
                self.gate.nudge()  # its room was not taken by a queued group: look again
            if group is not None and not settled and self._stopping:
                self.dropped_at_stop += 1
                self.log.warning(
                    "scored group dropped at stop: the API did not take it within the grace",
                    grace_s=self.settings.stop_grace,
                )

    # ------------------------------------------------------------------ checks and reports

    def heartbeat_state(self) -> dict[str, Any]:
        """What a heartbeat carries: generations in flight and how long the oldest has waited."""
        now = anyio.current_time()
        starts = list(self._generation_started.values())
        return {
            "generating": len(starts),
            "oldest_generation_s": round(now - min(starts), 3) if starts else 0.0,
            "groups": self.totals.groups,
            "throttled": bool(self.gate.throttled) if self.gate else False,
        }

    def _check_fits(self, reg: Registration) -> None:
        s = self.settings
        if reg.max_token_len > 0 and self.task.max_sequence_len > reg.max_token_len:
            raise UsageError(
                f"sequences of up to {self.task.max_sequence_len} tokens do not fit the trainer's "
                f"max_token_len {reg.max_token_len} (lower options.max_tokens or max_operand)"
            )
        if reg.batch_size > 0 and s.group_size > reg.batch_size:
            raise UsageError(f"group_size {s.group_size} is larger than the trainer's batch of {reg.batch_size}")

    def _queue_limit(self, reg: Registration) -> int:
        batch = reg.batch_size if reg.batch_size > 0 else self.settings.group_size
        return max(1, self.settings.max_batches_offpolicy * math.ceil(batch / self.settings.group_size))

    async def _report_loop(self) -> None:
        while True:
            await anyio.sleep(self.settings.report_every)
            self._report()

    def _report(self, final: bool = False) -> None:
        """One progress line: this window's rollouts (or, at the end, the totals), and the share
        of the time the gate held generation back (high: the trainer is the bottleneck)."""
        if self.gate is None:
            return  # not registered yet: the registration's own retries are logged
        w = self._window if not final else self.totals
        now = anyio.current_time()
        elapsed = max(now - w.started, 1e-9)
        throttled = self.gate.throttled_total()
        api = self.api
        fields: dict[str, Any] = {
            "groups": w.groups,
            "sequences": w.sequences,
            "reward_mean": round(w.reward_sum / w.sequences, 4) if w.sequences else None,
            "accuracy": round(w.exact / w.sequences, 4) if w.sequences else None,
            "groups_per_s": round(w.groups / elapsed, 2),
            "weight_versions": [min(w.versions), max(w.versions)] if w.versions else None,
            "throttled": round((throttled - (0.0 if final else self._throttled_at_window)) / elapsed, 3),
            "throttled_now": self.gate.throttled,
        }
        if w.groups:  # a group's mean timeline: at the gate, generating, posting
            fields.update(
                {
                    f"{part}_s": round(total / w.groups, 4)
                    for part, total in zip(("gate", "generate", "post"), w.timing, strict=True)
                }
            )
        if api is not None:
            fields.update(
                submit_retries=api.stats.submit_retries,
                refused_503=api.stats.refused_503,
                rejected=api.stats.rejected_groups,
                registrations=api.stats.registrations,
            )
        if self.infer is not None and len(self.infer.replicas) > 1:
            fields["generations_per_replica"] = self.infer.served()  # since the start
        if final:
            fields["dropped_at_stop"] = self.dropped_at_stop
        self.log.info("rollouts (total)" if final else "rollouts", **fields)
        if not final:
            self._window = _Window(started=now)
            self._throttled_at_window = throttled

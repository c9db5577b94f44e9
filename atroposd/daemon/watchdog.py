"""The trainer's forward-progress watchdog (SPEC §4, Liveness; §2 ``stalled``).

Every child has its own liveness checks (:mod:`atroposd.process.liveness`); this is the
second line: when the trainer's step has not advanced for ``[trainer] stall_timeout``, the
watchdog names the stage that is stuck, shows it in ``status`` and ``/metrics``, logs it, and
restarts the child to blame:

============== ========================================== =====================
stage          meaning                                    restarted
============== ========================================== =====================
``api``        no data from the API (it does not answer,  the API
               or holds a batch it does not hand over)
``environments`` the API waiting on environments          the environments
``inference``  environments waiting on inference          the inference server
``weight_sync`` a weight sync that does not return        the inference server
``trainer``    the trainer's own step (compute)           nothing: no child to blame
``ranks``      the trainer group re-forming after a fault nothing: the trainer restarts its ranks
============== ========================================== =====================

A stall not resolved within twice ``stall_timeout`` ends the job (exit 1; the next start
resumes from the last checkpoint). The clock stops while the trainer checkpoints (SPEC §12.1:
checkpoint time never counts; periodic ones are written in the background, training goes on),
and while the trainer group forms or re-forms
(``waiting_for = "ranks"``, and ``"model"`` with several ranks: bounded by ``join_timeout`` and
``max_restarts``) and, with several
ranks, while the trainer's step is inside ``collective_timeout``: a stuck collective is the
group's to end (it restarts from the last checkpoint), never pre-empted by this watchdog
(SPEC §12.1). Past ``collective_timeout`` in one step the clock runs again.  Independently of any stall, a
weight-control request
that passed its own deadline (``sync_timeouts`` of the weight sync) restarts the inference
server, which gets the current weights from ``reattach`` before it serves again.

:class:`WatchedSync` wraps the trainer's weight sync so that the watchdog sees a sync in
flight without the trainer knowing about it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from atroposd.config import Config
from atroposd.logs import get_logger
from atroposd.process.liveness import HeartbeatBoard
from atroposd.process.unit import State, Unit

if TYPE_CHECKING:
    import torch

    from atroposd.trainer.loop import Progress
    from atroposd.weights.sync import WeightSync

log = get_logger("atroposd.watchdog")

STAGES = {
    "api": "no data from the API",
    "environments": "the API waiting on environments",
    "inference": "environments waiting on inference",
    "weight_sync": "a weight sync that does not return",
    "trainer": "the trainer's own step (compute)",
    "ranks": "the trainer group re-forming after a fault",
}
API_STATUS_TIMEOUT = 3.0


class WatchedSync:
    """A weight sync that records which call is in flight and since when (``busy``)."""

    def __init__(self, inner: WeightSync) -> None:
        self.inner = inner
        self.mode: str = inner.mode
        self.busy: tuple[str, float] | None = None

    def __getattr__(self, name: str) -> object:  # server_current, sync_timeouts, arena, ...
        return getattr(self.inner, name)

    @property
    def sync_timeouts(self) -> int:
        return int(getattr(self.inner, "sync_timeouts", 0))

    @asynccontextmanager
    async def _busy(self, what: str) -> AsyncIterator[None]:
        self.busy = (what, time.monotonic())
        try:
            yield
        finally:
            self.busy = None

    async def attach(self, model: torch.nn.Module, version: int) -> None:
        async with self._busy("attach"):
            await self.inner.attach(model, version)

    async def reattach(self, model: torch.nn.Module, version: int, replica: int | None = None) -> None:
        async with self._busy("reattach"):
            await self.inner.reattach(model, version, replica)

    def replica_versions(self) -> list[int | None]:
        return list(self.inner.replica_versions())

    async def after_step(self, model: torch.nn.Module, version: int) -> dict[str, float] | None:
        async with self._busy("after_step"):
            report: dict[str, float] | None = await self.inner.after_step(model, version)
            return report

    @asynccontextmanager
    async def paused(self, new_version: int | None = None) -> AsyncIterator[None]:
        """The pause before the body and the resume after it count as sync; the body does not."""
        cm = self.inner.paused(new_version)
        async with self._busy("pause"):
            await cm.__aenter__()
        try:
            yield
        except BaseException as exc:
            async with self._busy("resume"):
                if not await cm.__aexit__(type(exc), exc, exc.__traceback__):
                    raise
        else:
            async with self._busy("resume"):
                await cm.__aexit__(None, None, None)

    def close(self) -> None:
        self.inner.close()


class TrainerHandle(Protocol):
    @property
    def progress(self) -> Progress: ...


@dataclass
class Stall:
    since: float  # monotonic: the last step
    stage: str
    blamed: tuple[str, ...]
    acted: frozenset[str] = frozenset()

    def as_dict(self, now: float) -> dict[str, Any]:
        return {
            "stalled_for_s": round(now - self.since, 1),
            "stage": self.stage,
            "stage_text": STAGES[self.stage],
            "blamed": list(self.blamed),
        }


class StallWatchdog:
    """Watches the trainer's step; see the module's docstring."""

    def __init__(
        self,
        cfg: Config,
        *,
        trainer: TrainerHandle,
        units: Mapping[str, Unit],
        board: HeartbeatBoard,
        weights: WatchedSync | None,
        on_unresolved: Callable[[str], None],
    ) -> None:
        self.cfg = cfg
        self.stall_timeout = cfg.trainer.stall_timeout
        self.trainer = trainer
        self.units = units
        self.board = board
        self.weights = weights
        self.on_unresolved = on_unresolved
        self.stall: Stall | None = None
        self.stalls = 0  # stall episodes so far
        self._last_step: int | None = None
        self._last_progress = time.monotonic()
        # The stopped clock (SPEC §12.1): seconds since the last step that do not count, the
        # last tick, and since when the trainer has computed in this step (several ranks).
        self._stopped = 0.0
        self._last_tick: float | None = None
        self._compute_since: float | None = None
        self._sync_timeouts = 0  # one that timed out before the watchdog started counts too
        self._ended = False
        self._scope: anyio.CancelScope | None = None

    @property
    def period(self) -> float:
        return min(5.0, max(0.1, self.stall_timeout / 10)) if self.stall_timeout > 0 else 1.0

    async def run(self) -> None:
        self._last_progress = time.monotonic()
        self._stopped, self._last_tick = 0.0, None
        with anyio.CancelScope() as self._scope:
            if self._ended:
                return
            while True:
                await anyio.sleep(self.period)
                await self.tick()

    def stop(self) -> None:
        """The job is stopping: a checkpoint or a child's stop is not a stall."""
        self._ended = True
        self.stall = None
        if self._scope is not None:
            self._scope.cancel()

    async def tick(self) -> None:
        self._check_sync_timeouts()
        if self.stall_timeout <= 0 or self._ended:
            return
        p = self.trainer.progress
        now = time.monotonic()
        if p.state in ("finished", "stopped", "failed"):
            self._resolved(now)
            return
        if p.step != self._last_step:
            self._last_step = p.step
            self._last_progress = now
            self._stopped, self._compute_since = 0.0, None
        self._run_clock(p, now)
        quiet = now - self._last_progress - self._stopped
        if quiet < self.stall_timeout:
            self._resolved(now)
            return
        stage = await self._diagnose(p)
        blamed = self._blame(stage)
        if self.stall is None or self.stall.stage != stage:
            first = self.stall is None
            self.stall = Stall(
                since=now - quiet, stage=stage, blamed=blamed, acted=self.stall.acted if self.stall else frozenset()
            )
            if first:
                self.stalls += 1
            log.error(
                "trainer stalled",
                step=p.step,
                stalled_for_s=round(quiet, 1),
                stage=stage,
                stage_text=STAGES[stage],
                restarting=list(blamed) or None,
            )
        self.stall.since = now - quiet  # the stopped clock's seconds left out
        self._act(self.stall, quiet)
        if quiet >= 2 * self.stall_timeout:
            self._ended = True
            reason = (
                f"the trainer made no step for {quiet:.0f}s (twice stall_timeout = {self.stall_timeout:g}s); "
                f"stuck stage: {STAGES[stage]}"
            )
            log.error("stall not resolved: the job ends", reason=reason)
            self.on_unresolved(reason)

    def clock_stopped(self, p: Progress, now: float) -> bool:
        """Whether the stall clock stands still now: the group forms or re-forms, or (several
        ranks) the step computes within ``collective_timeout``, which bounds its collectives."""
        t = self.cfg.trainer
        if p.state == "checkpointing":
            # SPEC §12.1: checkpoint time never counts (a periodic one is written in the
            # background; this is the copy between two steps, or the wait for the previous one)
            self._compute_since = None
            return True
        if p.state == "waiting" and (p.waiting_for == "ranks" or (t.ranks > 1 and p.waiting_for == "model")):
            # forming, or (several ranks) every rank loading its checkpoint as the group re-forms
            self._compute_since = None
            return True
        if t.ranks > 1 and p.state == "training":
            if self._compute_since is None:
                self._compute_since = now
            return now - self._compute_since <= t.collective_timeout
        self._compute_since = None
        return False

    def _run_clock(self, p: Progress, now: float) -> None:
        """Count the time since the last tick as stopped when the clock stood still."""
        last, self._last_tick = self._last_tick, now
        if self.clock_stopped(p, now) and last is not None:
            self._stopped += max(0.0, now - max(last, self._last_progress))

    def annotate(self, status: dict[str, Any]) -> dict[str, Any]:
        """Turn the trainer's status into SPEC §2's ``stalled`` one while a stall lasts."""
        if self.stall is not None and status.get("state") not in ("finished", "stopped", "failed"):
            status["state"] = "stalled"
            status.update(self.stall.as_dict(time.monotonic()))
        else:
            status.setdefault("stalled_for_s", None)
            status.setdefault("stage", None)
        status["stalls"] = self.stalls
        return status

    # ------------------------------------------------------------------ diagnosis

    async def _diagnose(self, p: Progress) -> str:
        if self.weights is not None and self.weights.busy is not None:
            return "weight_sync"
        if p.state != "waiting":
            return "trainer"  # training (its own compute) or checkpointing
        if p.waiting_for == "ranks":
            return "ranks"
        if p.waiting_for == "api":
            return "api"
        queued = await self._api_queued()
        if queued is None or queued >= self.cfg.trainer.batch_size:
            return "api"  # not answering, or holding a batch it does not hand over
        limit = max(1.0, min(self.stall_timeout / 2, 60.0))
        for u in self._units("env"):
            beat = self.board.latest(u)
            if beat is not None and beat.oldest_generation_s >= limit:
                return "inference"
        return "environments"

    async def _api_queued(self) -> int | None:
        import aiohttp

        from atroposd.daemon.specs import api_headers

        try:
            with anyio.fail_after(API_STATUS_TIMEOUT):
                async with (
                    aiohttp.ClientSession() as session,
                    session.get(f"{self.cfg.api_url}/status", headers=api_headers(self.cfg)) as resp,
                ):
                    data = await resp.json(content_type=None) if resp.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return None
        value = data.get("queued_sequences") if isinstance(data, dict) else None
        return int(value) if isinstance(value, int) else None

    def _units(self, kind: str) -> list[Unit]:
        return [u for u in self.units.values() if u.kind == kind]

    def _blame(self, stage: str) -> tuple[str, ...]:
        kind = {"api": "api", "environments": "env", "inference": "inference", "weight_sync": "inference"}.get(stage)
        return tuple(u.name for u in self._units(kind)) if kind else ()

    def _act(self, stall: Stall, quiet: float) -> None:
        """Restart the children to blame, once per stall and stage."""
        if stall.stage in stall.acted:
            return
        stall.acted = stall.acted | {stall.stage}
        for name in stall.blamed:
            unit = self.units.get(name)
            if unit is not None and unit.state == State.READY:
                unit.declare_hung(f"blamed for a trainer stall of {quiet:.0f}s: {STAGES[stall.stage]}")

    def _resolved(self, now: float) -> None:
        if self.stall is not None:
            log.info(
                "trainer stall resolved",
                stage=self.stall.stage,
                lasted_s=round(now - self.stall.since, 1),
                step=self.trainer.progress.step,
            )
            self.stall = None

    def _check_sync_timeouts(self) -> None:
        """A weight-control request passed its deadline: restart the server; it gets the weights back."""
        if self.weights is None:
            return
        count = self.weights.sync_timeouts
        if count > self._sync_timeouts:
            self._sync_timeouts = count
            for u in self._units("inference"):
                if u.declare_hung("a weight sync did not return within its deadline"):
                    log.error("restarting the inference server: a weight sync did not return", unit=u.name)

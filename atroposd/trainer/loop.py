"""The training loop: one flat, ordered loop (fetch → prepare → loss → step → sync → log →
checkpoint). Modes are the strategies it was handed — the learner's objective and reference,
the weight-sync object — never flags tested here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from atroposd.trainer.batch import BatchError, RolloutBatch, prepare_batch
from atroposd.trainer.checkpoint import CheckpointError
from atroposd.trainer.compute import ComputeThread
from atroposd.trainer.feed import BatchFeed
from atroposd.trainer.health import Collapse, DropRule, HealthMonitor, Trip, clip_acts
from atroposd.trainer.learner import Learner, StepResult
from atroposd.trainer.metrics import MetricsWriter
from atroposd.trainer.ranks import is_group_error
from atroposd.trainer.setup import Checkpointer
from atroposd.trainer.state import TrainerState

if TYPE_CHECKING:
    from atroposd.config import HealthConfig, TrainerConfig
    from atroposd.trainer.sentinel import Sentinel
    from atroposd.weights.sync import WeightSync

__all__ = ["Progress", "TrainerError", "TrainingLoop"]

log = structlog.get_logger("trainer", component="trainer")  # lazy: bound at first use

# This many non-finite steps in a row means the run is broken, not unlucky: stop it.
MAX_CONSECUTIVE_SKIPS = 50
# steps_per_s is measured over this recent window (SPEC §4): a stalled run shows 0.
STEPS_WINDOW_S = 30.0


class TrainerError(RuntimeError):
    pass


@dataclass
class Progress:
    """What the status and the metrics know about the run (the event loop's view)."""

    total_steps: int
    step: int = 0
    weight_version: int = 0
    skipped_steps: int = 0
    state: TrainerState = TrainerState.WAITING
    waiting_for: str | None = "model"
    last: dict[str, Any] = field(default_factory=dict)
    last_checkpoint: str | None = None
    checkpoint_error: str | None = None
    checkpoint_failures: int = 0  # failed or abandoned checkpoint writes (training went on)
    checkpoint_writing: int | None = None  # the step of a checkpoint being written in the background
    # groups rejected by batch preparation since this process started, by reason (SPEC §13)
    rejected_groups: dict[str, int] = field(default_factory=dict)
    # groups filter_groups dropped (all scores equal) since this process started (SPEC §14)
    filtered_groups: int = 0
    error: str | None = None
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=50))
    # seconds spent since this process started, per part of a step (the per-step split summed)
    seconds: dict[str, float] = field(
        default_factory=lambda: {"data_wait": 0.0, "compute": 0.0, "sync": 0.0, "gather": 0.0}
    )  # gather: within sync
    tokens_total: int = 0  # tokens trained on since this process started
    # SPEC §15: rollbacks within the job (kept in the checkpoints), the last step's health ("ok" or
    # the detector that tripped), the last rollback, the newest known-good checkpoint ("start":
    # the starting weights), groups dropped after rollbacks, the learning rate's scale
    rollbacks: int = 0
    health: str = "ok"
    last_rollback: dict[str, Any] | None = None
    known_good: str | None = "start"
    dropped_groups: int = 0
    lr_scale: float = 1.0
    drop: DropRule | None = None  # the last rollback's: queued groups it still drops
    canary_prompts: list[list[int]] | None = None  # the sentinel's, once chosen from the environments

    def health_record(self) -> dict[str, Any]:
        """What a checkpoint keeps of the run's health (restored at the next start)."""
        d = self.drop
        return {
            "rollbacks": self.rollbacks,
            "lr_scale": self.lr_scale,
            "last_rollback": self.last_rollback,
            "dropped_groups": self.dropped_groups,
            "drop": None
            if d is None
            else {"good_version": d.good_version, "resync_version": d.resync_version, "resync_time": d.resync_time},
            **({"canary_prompts": self.canary_prompts} if self.canary_prompts else {}),
        }

    @property
    def steps_per_s(self) -> float | None:
        """Steps per second over the last ``STEPS_WINDOW_S`` (0 when no step came in it)."""
        times = list(self.step_times)
        if not times:
            return None
        now = time.monotonic()
        recent = [t for t in times if now - t <= STEPS_WINDOW_S]
        if not recent:
            return 0.0
        if len(recent) < len(times):  # steps before the window: it is covered in full
            return len(recent) / STEPS_WINDOW_S
        span = now - recent[0]  # every known step is in the window: from the first one to now
        return (len(recent) - 1) / span if len(recent) > 1 and span > 0 else None


class TrainingLoop:
    def __init__(
        self,
        *,
        tcfg: TrainerConfig,
        feed: BatchFeed,
        learner: Learner,
        weights: WeightSync,
        metrics: MetricsWriter,
        checkpointer: Checkpointer,
        progress: Progress,
        envs_alive: Callable[[], bool],
        lock: anyio.Lock,
        progress_every: int = 10,
        compute: ComputeThread | None = None,
        replica_generations: Callable[[], list[int | None]] | None = None,
        health: HealthConfig | None = None,
        drop: DropRule | None = None,
    ) -> None:
        self.t = tcfg
        self.feed = feed
        self.learner = learner
        self.weights = weights
        self.metrics = metrics
        self.checkpointer = checkpointer
        self.progress = progress
        self.envs_alive = envs_alive
        self.lock = lock  # held around the step + sync; the inference-restart re-attach takes it too
        self.progress_every = progress_every
        self.stop_requested = False
        # Every step's work runs here, in order (SPEC §12.1): prepare, compute, apply, checkpoint.
        self.compute = compute if compute is not None else ComputeThread()
        self.vocab_size = learner.policy.vocab_size  # token ids at or above it are rejected
        self.replica_generations = replica_generations  # each replica's count, last known (never waits)
        # SPEC §15: the collapse detectors, the checkpoints waiting to become known-good, and
        # the rule that drops groups sampled between a collapse and its rollback
        self.hcfg = health
        self.monitor = HealthMonitor(
            max_nonfinite_steps=health.max_nonfinite_steps if health else 3,
            clip_acts=clip_acts(tcfg.loss, tcfg.rollout_correction, tcfg.optimizer_steps_per_batch),
        )
        self.pending_good: list[tuple[int, Path]] = []
        self.drop = drop
        # SPEC §15: the replica sentinel (atroposd.trainer.sentinel; None: canary_every = 0)
        self.sentinel: Sentinel | None = None
        # SPEC §12.1: the checkpoint being written in the background (its step and outcome)
        self._writing: tuple[int, concurrent.futures.Future[Path]] | None = None
        checkpointer.on_fence = self._fencing  # an optimizer step waiting for a writer is checkpoint time

    def request_stop(self) -> None:
        self.stop_requested = True
        self.feed.cancel_wait()

    async def run(self) -> TrainerState:
        """Train until ``steps`` ("finished") or a stop request ("stopped")."""
        p, t = self.progress, self.t
        consecutive_skips = 0
        while p.step < p.total_steps and not self.stop_requested:
            # fetch: prefetched up to max_staleness ahead; waits visibly
            wait_start = time.perf_counter()
            groups = await self.feed.next(data_timeout=t.data_timeout, envs_alive=self.envs_alive)
            if groups is None:
                break  # stop requested while waiting
            filtered = list(self.feed.last_filtered)  # dropped by filter_groups
            if self.drop is not None:
                groups = self._drop_sampled_before_rollback(groups)
                if not groups:  # every group came from the weights that collapsed: the next batch
                    self.feed.release()
                    continue
            p.filtered_groups += len(filtered)
            batch_wait = time.perf_counter() - wait_start
            p.state, p.waiting_for = TrainerState.TRAINING, None
            step_start = time.perf_counter()
            try:
                # prepare: validate groups, advantages per group, pad micro-batches
                try:
                    batch = await self.compute.run(self._prepare, groups, filtered)
                except BatchError as exc:
                    self._count_rejected(exc.rejected)
                    log.warning("batch skipped", reason=str(exc))
                    continue
                except Exception as exc:  # a defect past the per-group checks: the batch, not the job
                    self._count_rejected({"error": len(groups)})
                    log.error(
                        "batch skipped: its preparation failed",
                        error=f"{type(exc).__name__}: {exc}",
                        groups=len(groups),
                        exc_info=True,
                    )
                    continue
                self._count_rejected(batch.rejected_by_reason)
                if self.sentinel is not None and self.sentinel.offer(groups):
                    p.canary_prompts = [list(x) for x in self.sentinel.prompts]  # kept in the checkpoints
                timeline = {
                    "prepare_s": time.perf_counter() - step_start,
                    **self.feed.last_timeline,
                }  # the rollout side
                # loss + backward + clip (worker thread; the event loop stays responsive)
                multi = self.learner.steps_per_batch > 1
                if multi:
                    # several optimizer steps on the batch (SPEC §14): every one of them changes the
                    # weights, so in shared mode the server is paused for all of them
                    async with self.lock, self.weights.paused(p.weight_version + 1):
                        apply_start = time.perf_counter()
                        result = await self.compute.run(self.learner.train, batch, p.step + 1)
                        timeline["optimizer_s"] = time.perf_counter() - apply_start
                else:
                    result = await self.compute.run(self.learner.compute, batch)
                if not result.finite:
                    # never step on NaN/inf: in shared mode the server computes on these weights
                    if not multi:
                        await self.compute.run(self.learner.discard)
                    p.skipped_steps += 1
                    consecutive_skips += 1
                    log.warning(
                        "step skipped: non-finite loss or gradient norm",
                        step=p.step + 1,
                        loss=result.loss,
                        grad_norm=result.grad_norm,
                        skipped_steps=p.skipped_steps,
                    )
                    self._on_trip(self.monitor.skipped())
                    if consecutive_skips >= MAX_CONSECUTIVE_SKIPS:
                        raise TrainerError(
                            f"{consecutive_skips} consecutive steps had a non-finite loss or gradient norm"
                        )
                    continue
                consecutive_skips = 0
                # step + sync: shared mode pauses generation only around optimizer.step
                sync_start = time.perf_counter()
                async with self.lock:
                    if not multi:
                        pause_start = time.perf_counter()
                        async with self.weights.paused(p.weight_version + 1):
                            apply_start = time.perf_counter()
                            await self.compute.run(self._apply)
                            timeline["optimizer_s"] = time.perf_counter() - apply_start
                        timeline["pause_s"] = time.perf_counter() - pause_start
                    p.weight_version += 1
                    p.step += 1
                    # the sync's report when this step synced (None: it did not)
                    report = await self.weights.after_step(self.learner.policy.model, p.weight_version)
                    if self.sentinel is not None and p.weight_version in self.weights.replica_versions():
                        # the canary checks of this sync, between steps (SPEC §15)
                        await self.sentinel.after_sync(self.weights, self.learner.policy.model, p.weight_version)
                gather_s = float(report.get("gather_s", 0.0)) if report is not None else 0.0
                if report is not None:
                    # push / broadcast: the replicas' pause before the first byte and the transfer, apart
                    for key in ("sync_pause_s", "sync_transfer_s"):
                        if key in report:
                            timeline[key] = float(report[key])
                sync_s = time.perf_counter() - sync_start
            finally:
                self.feed.release()
            # log (the collapse detectors see the row first: its "health" says what they found)
            trip = self._record(batch, result, batch_wait, time.perf_counter() - step_start, sync_s, timeline, gather_s)
            self._on_trip(trip)
            self._mark_known_good()
            self._collect_checkpoint()  # a background write that completed meanwhile
            # checkpoint: every checkpoint_every (in the background: training goes on while it is
            # written) and at the last step (at once, with the Hugging Face layout)
            if p.step == p.total_steps:
                path = await self.checkpoint(consolidate=True)
                if path is not None:
                    self.pending_good.append((p.step, path))
                    self._mark_known_good()
            elif p.step % t.checkpoint_every == 0:
                await self.checkpoint(background=True)
        return TrainerState.FINISHED if p.step >= p.total_steps else TrainerState.STOPPED

    def _apply(self) -> None:
        """The optimizer step of ``progress.step + 1`` (on the compute thread)."""
        self.learner.apply()

    def _prepare(self, groups: list[dict[str, Any]], filtered: list[dict[str, Any]] | None = None) -> RolloutBatch:
        t = self.t
        return prepare_batch(
            groups,
            keep_rows=self.learner.steps_per_batch > 1,
            micro_batch_size=t.micro_batch_size,
            micro_batch_tokens=t.micro_batch_tokens,
            max_token_len=t.max_token_len,
            adv_std_floor=t.adv_std_floor,
            use_distill=t.distill_coef > 0,
            vocab_size=self.vocab_size,
            advantage=t.advantage,
            overlong=t.overlong,
            filtered=filtered or (),
        )

    def _drop_sampled_before_rollback(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """After a rollback: the groups sampled by the weights that collapsed go (counted)."""
        assert self.drop is not None
        kept = [g for g in groups if not self.drop.drops(g)]
        if len(kept) < len(groups):
            self.progress.dropped_groups += len(groups) - len(kept)
            log.info(
                "groups sampled before the rollback dropped",
                dropped=len(groups) - len(kept),
                dropped_total=self.progress.dropped_groups,
            )
        return kept

    def _on_trip(self, trip: Trip | None) -> None:
        """A collapse: shown, and with ``[health] rollback`` raised for the service to roll back."""
        p = self.progress
        if trip is None:
            if p.health != "ok" and self.monitor.healthy_steps > 0:
                p.health = "ok"
            return
        p.health = trip.detector
        self.pending_good.clear()  # checkpoints written since the last trip never become known-good
        if self.hcfg is None or not self.hcfg.rollback:
            log.error(
                "collapse detected (health.rollback = false: training goes on)",
                step=p.step,
                detector=trip.detector,
                reason=trip.reason,
            )
            return
        raise Collapse(trip, p.step)

    def _mark_known_good(self) -> None:
        """A checkpoint followed by ``known_good_after`` healthy steps is known-good (SPEC §15)."""
        if self.hcfg is None or not self.pending_good:
            return
        from atroposd.trainer.checkpoint import mark_known_good

        p = self.progress
        while self.pending_good:
            step, path = self.pending_good[0]
            if p.step - step < self.hcfg.known_good_after or self.monitor.healthy_steps < p.step - step:
                return
            self.pending_good.pop(0)
            if not path.is_dir():
                continue  # pruned meanwhile
            try:
                mark_known_good(
                    path, {"step": step, "healthy_steps": p.step - step, "marked_at_step": p.step, "time": time.time()}
                )
            except OSError as exc:
                log.error("checkpoint not marked known-good", path=str(path), error=str(exc))
                continue
            p.known_good = str(path)
            log.info("checkpoint is known-good", path=str(path), healthy_steps=p.step - step)

    def _count_rejected(self, by_reason: dict[str, int]) -> None:
        counts = self.progress.rejected_groups
        for reason, n in by_reason.items():
            counts[reason] = counts.get(reason, 0) + n

    async def checkpoint(
        self, *, deadline_s: float | None = None, background: bool = False, consolidate: bool = False
    ) -> Path | None:
        """Write a checkpoint of the current step; a failure is logged and shown, training goes on.

        A checkpoint still being written is waited for first (logged). ``background``: the files
        are written while training goes on (``_collect_checkpoint`` takes the outcome); returns
        None then. Otherwise returns the complete directory (None: failed or abandoned)."""
        p = self.progress
        previous = p.state
        p.state = TrainerState.CHECKPOINTING
        path = None
        try:
            with anyio.move_on_after(deadline_s):
                # abandon_on_cancel: past the deadline the thread's temporary directory is left
                # behind (and ignored at resume); the previous checkpoint stays the newest.
                if self._writing is not None:
                    if not self._writing[1].done():
                        log.info(
                            "a checkpoint is still being written: this one waits for it",
                            writing=self._writing[0],
                            step=p.step,
                        )
                    await asyncio.wrap_future(self._writing[1])
                    written = self._collect_checkpoint()
                    if written is not None and written.name == f"step-{p.step}":
                        return written  # the one in flight was of this step
                if background:
                    future = await self.compute.run(
                        self.checkpointer.start, p.step, p.weight_version, p.skipped_steps, background=True
                    )
                    self._writing = (p.step, future)
                    p.checkpoint_writing = p.step
                    return None
                path = await self.compute.run(
                    self.checkpointer.save, p.step, p.weight_version, p.skipped_steps, consolidate=consolidate
                )
            if path is None:
                p.checkpoint_failures += 1
                p.checkpoint_error = f"checkpoint of step {p.step} not finished within {deadline_s} s"
                log.error("checkpoint abandoned", step=p.step, deadline_s=deadline_s)
            else:
                p.last_checkpoint, p.checkpoint_error = str(path), None
                log.info("checkpoint written", step=p.step, path=str(path))
        except Exception as exc:  # any failure to write (a full disk included) is not the job's end
            self._checkpoint_failed(p.step, exc)
        finally:
            p.state = previous
        return path

    def _checkpoint_failed(self, step: int, exc: BaseException) -> None:
        p = self.progress
        cause = exc.__cause__ if isinstance(exc, CheckpointError) else exc
        if self.learner.ranks.world > 1 and cause is not None and is_group_error(cause):
            raise cause from None  # the trainer group broke while it wrote: it restarts
        p.checkpoint_failures += 1
        p.checkpoint_error = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        log.error(
            "checkpoint failed; training goes on",
            step=step,
            error=p.checkpoint_error,
            failures=p.checkpoint_failures,
            exc_info=not isinstance(exc, CheckpointError),
        )

    def _collect_checkpoint(self) -> Path | None:
        """The outcome of the background write, once it is done (nothing while it is written):
        its directory (shown, and a candidate for known-good) or its failure (counted)."""
        if self._writing is None or not self._writing[1].done():
            return None
        (step, future), self._writing = self._writing, None
        p = self.progress
        p.checkpoint_writing = None
        try:
            path: Path = future.result()
        except Exception as exc:
            self._checkpoint_failed(step, exc)
            return None
        p.last_checkpoint, p.checkpoint_error = str(path), None
        log.info("checkpoint written", step=step, path=str(path), background=True)
        self.pending_good.append((step, path))
        self._mark_known_good()
        return path

    def _fencing(self, waiting: bool) -> None:
        """The compute thread's optimizer step waits (True) or waited (False) for the checkpoint
        being written to read the weights: shown as checkpointing (the watchdog's clock stops)."""
        p = self.progress
        if waiting and p.state == TrainerState.TRAINING:
            p.state = TrainerState.CHECKPOINTING
        elif not waiting and p.state == TrainerState.CHECKPOINTING:
            p.state = TrainerState.TRAINING

    async def finish_checkpoint(self) -> None:
        """Wait for the checkpoint being written in the background, and take its outcome."""
        if self._writing is not None:
            await asyncio.wrap_future(self._writing[1])
            self._collect_checkpoint()

    def abandon_checkpoint(self) -> None:
        """The trainer group restarts: a write still in flight is never installed."""
        if self._writing is not None:
            self.checkpointer.abandon()
            self._writing = None
            self.progress.checkpoint_writing = None

    def _record(
        self,
        batch: RolloutBatch,
        r: StepResult,
        batch_wait: float,
        step_s: float,
        sync_s: float = 0.0,
        timeline: dict[str, float | None] | None = None,
        gather_s: float = 0.0,
    ) -> Trip | None:
        p = self.progress
        p.seconds["data_wait"] += batch_wait
        p.seconds["compute"] += r.compute_s
        p.seconds["sync"] += sync_s
        p.seconds["gather"] += gather_s
        p.tokens_total += int(r.tokens)
        versions = batch.weight_versions
        record: dict[str, Any] = {
            "step": p.step,
            "time": time.time(),
            "loss": r.loss,
            "reward_mean": batch.reward_mean,
            "reward_std": batch.reward_std,
            "accuracy": batch.accuracy,
            "weight_version": p.weight_version,
            # trained from version (weight_version - 1); rollouts were sampled at min(versions)
            "staleness": (p.weight_version - 1 - min(versions)) if versions else None,
            "mean_ratio": r.mean_ratio,
            "clipped_fraction": r.clipped_fraction,
            "mean_kl": r.mean_kl,
            "grad_norm": r.grad_norm,
            "lr": self.learner.lr,
            "tokens": r.tokens,
            "sequences": batch.sequences,
            "batch_wait_s": batch_wait,
            "step_s": step_s,
            "compute_s": r.compute_s,
            "sync_s": sync_s,
            "gather_s": gather_s,
            **(timeline or {}),  # the step's timeline (atroposd.timeline)
            "skipped_steps": p.skipped_steps,
            "rejected_groups": dict(p.rejected_groups),
            "missing_logprobs": batch.missing_logprobs,
            "logprob_diff_abs_mean": r.logprob_diff_abs_mean,
            # SPEC §14: reward over the trained groups only; groups filter_groups dropped for this
            # step; the share of tokens a rollout correction truncated or masked
            "reward_mean_trained": batch.reward_mean_trained,
            "filtered_groups": batch.filtered_groups,
            "rollout_corrected": r.rollout_corrected,
            # SPEC §7: the share of the trained completion tokens sampled after a weight swap
            "swapped_token_share": (batch.swapped_tokens / batch.completion_tokens) if batch.completion_tokens else 0.0,
            "entropy": r.entropy,  # the policy's mean entropy per completion token (SPEC §14)
            # SPEC §14: optimizer steps the weights have taken in all (ppo_epochs × mini_batches a batch)
            "optimizer_steps": self.learner.optimizer_steps,
        }
        if self.replica_generations is not None:
            record["replica_generations"] = self.replica_generations()
        if self.sentinel is not None:  # each replica's last canary drift (SPEC §15)
            record["replica_drift"] = self.sentinel.replica_drift()
        if r.distill_token_count or self.t.distill_coef > 0:
            record["distill_loss"] = r.distill_loss
            record["distill_token_count"] = r.distill_token_count
        trip = self.monitor.step(record)
        # SPEC §15: "ok" or the detector that tripped at this step; rollbacks within the job
        record["health"] = "ok" if trip is None else trip.detector
        record["rollbacks"] = p.rollbacks
        record["dropped_groups"] = p.dropped_groups
        self.metrics.write(record)
        p.last = record
        p.step_times.append(time.monotonic())
        if p.step % self.progress_every == 0 or p.step == p.total_steps or p.step == 1:
            log.info(
                "step",
                step=p.step,
                of=p.total_steps,
                reward=round(batch.reward_mean, 3),
                accuracy=None if batch.accuracy is None else round(batch.accuracy, 3),
                loss=round(r.loss, 4),
                kl=round(r.mean_kl, 4),
                clipped=round(r.clipped_fraction, 3),
                staleness=record["staleness"],
                steps_per_s=_round(p.steps_per_s),
                wait_s=round(batch_wait, 3),
            )
        return trip


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)

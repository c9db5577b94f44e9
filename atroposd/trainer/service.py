"""The daemon-facing handle of the in-process trainer (docs/ARCHITECTURE.md, "Trainer").

``run`` sets up in this order (SPEC §4, start order): load the model and tokenizer (and
resume from the newest complete checkpoint) → compare the tokenizer with the inference
server's → attach the weights (the server now computes with the trainer's weights and
version) → build the optimizer (after attach: in shared mode the parameters have moved into
shared memory) and restore its state → ``POST /register`` → the first ``GET /batch`` →
``task_status.started()`` → the training loop. Compute runs in worker threads.

The daemon owns ``weights`` and calls ``weights.close()`` once the inference server is gone.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import structlog
from anyio.abc import TaskStatus

from atroposd.config import Config
from atroposd.paths import Paths
from atroposd.restarts import RestartBudget
from atroposd.trainer.host import RankHost
from atroposd.trainer.state import TrainerState

if TYPE_CHECKING:
    from pathlib import Path

    from atroposd.trainer.health import Collapse
    from atroposd.trainer.ranks import Ranks
    from atroposd.trainer.sentinel import RemoteReplica
    from atroposd.weights.source import TensorSource
    from atroposd.weights.sync import WeightSync

if sys.version_info < (3, 11):  # pragma: no cover - exercised only on 3.10
    from exceptiongroup import BaseExceptionGroup

__all__ = ["GroupFault", "RankHost", "TrainerOutcome", "TrainerService"]

log = structlog.get_logger("trainer", component="trainer")  # lazy: bound at first use

INFO_TIMEOUT_S = 10.0
PROGRESS_EVERY = 10
# Backoff before a trainer group restarts (SPEC §4's schedule).
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
# After a failed collective, how long to wait for the daemon to see which rank exited (the reason).
RANK_EXIT_GRACE_S = 1.0
# Before the trainer group closes, how long a checkpoint still being written may take to finish.
CHECKPOINT_FINISH_S = 300.0
# How often the sentinel's wait for a replica's restart looks for a stop request.
STOP_POLL_S = 0.2


@dataclass(frozen=True)
class _Rollback:
    """A collapse to roll back from (SPEC §15): where to (a known-good checkpoint, or the starting
    weights), the step and version to go on from, and whether the job then ends (exit 6)."""

    target: Path | str
    step: int
    weight_version: int
    skipped_steps: int
    give_up: bool
    reason: str


class GroupFault(RuntimeError):
    """The trainer group failed (a rank exited, a collective failed or timed out): restart it."""


@dataclass(frozen=True)
class TrainerOutcome:
    """How ``run`` ended: ``finished`` (all steps), ``stopped`` (requested) or ``failed``."""

    state: TrainerState
    step: int
    weight_version: int
    error: str | None = None

    @property
    def exit_code(self) -> int:
        from atroposd.exitcodes import Exit

        if self.state == TrainerState.COLLAPSED:  # past [health] max_rollbacks (SPEC §2, §15)
            return int(Exit.COLLAPSED)
        return 1 if self.state == TrainerState.FAILED else 0


class TrainerService:
    def __init__(
        self,
        cfg: Config,
        *,
        instance: str,
        weights: WeightSync,
        envs_alive: Callable[[], bool],
        rank_host: RankHost | None = None,
        replica_generations: Callable[[], list[int | None]] | None = None,
        restart_replica: Callable[[int, str], Awaitable[bool]] | None = None,
        remote_replicas: Callable[[], Sequence[RemoteReplica]] | None = None,
    ) -> None:
        from atroposd.trainer.compute import ComputeThread
        from atroposd.trainer.loop import Progress

        self.cfg = cfg
        self.instance = instance
        self.weights = weights
        self.envs_alive = envs_alive
        self.paths = Paths.of(cfg)
        self.progress = Progress(total_steps=cfg.trainer.steps)
        self._lock = anyio.Lock()
        self._loop: Any = None
        self._policy: Any = None
        self._source: tuple[Any, TensorSource] | None = None  # (model, the source its sync reads)
        self._metrics: Any = None
        self._stop = False
        # Cancelled by a stop request that comes before training starts (waits for the
        # inference server or the API must not hold up the daemon's stop).
        self._setup_scope = anyio.CancelScope()
        self.outcome: TrainerOutcome | None = None  # set when run() returns
        # Rank 0's one compute thread: every step's work, in order (SPEC §12.1).
        self.compute = ComputeThread()
        self.rank_host = rank_host
        self.replica_generations = replica_generations  # each replica's generations served, last known
        self.remote_replicas = remote_replicas  # several machines: the other nodes' replicas (the sentinel's)
        self._feed: Any = None
        self._wandb: Any = None
        self._ranks: Any = None
        self._ranks_generation = 0
        self._rank_lost: str | None = None
        self._attempt_scope: anyio.CancelScope | None = None
        t = cfg.trainer
        self._restarts = RestartBudget(t.max_restarts, t.restart_window, first=BACKOFF_FIRST_S, cap=BACKOFF_MAX_S)
        self.group_restarts = 0
        self.last_fault: str | None = None
        self.waiting_nodes: list[int] = []  # several machines: the nodes a re-forming group waits for
        self._started = False  # task_status.started() was called
        self._rollback: _Rollback | None = None  # a collapse the next attempt rolls back from
        self._sentinel: Any = None  # SPEC §15: the replica sentinel, made once per job
        # The daemon's restart of inference replica i (returns once it serves the current weights
        # again: True, or failed: False); the replicas the sentinel restarts now.
        self.restart_replica = restart_replica
        self._sentinel_restarting: set[int] = set()
        self._unlocked_reattach: anyio.Event | None = None  # the reattach that goes ahead under its lock

    # ------------------------------------------------------------------ daemon interface

    def request_stop(self) -> None:
        """Finish (or abandon) the current step, checkpoint within checkpoint_timeout, return."""
        self._stop = True
        if self._loop is not None:
            self._loop.request_stop()
        else:
            self._setup_scope.cancel()

    def status(self) -> dict[str, Any]:
        """SPEC §2's ``trainer`` object."""
        p, last = self.progress, self.progress.last
        return {
            "state": p.state.value,
            "waiting_for": p.waiting_for if p.state == TrainerState.WAITING else None,
            "step": p.step,
            "total_steps": p.total_steps,
            "weight_version": p.weight_version,
            "reward_mean": last.get("reward_mean"),
            "accuracy": last.get("accuracy"),
            "loss": last.get("loss"),
            "mean_kl": last.get("mean_kl"),
            "clipped_fraction": last.get("clipped_fraction"),
            "staleness": last.get("staleness"),
            "grad_norm": last.get("grad_norm"),
            "steps_per_s": p.steps_per_s,
            "skipped_steps": p.skipped_steps,
            "last_checkpoint": p.last_checkpoint,
            "checkpoint_error": p.checkpoint_error,
            "error": p.error,
            "metrics_dropped": self._metrics.dropped if self._metrics is not None else 0,
            "checkpoint_failures": p.checkpoint_failures,
            "checkpoint_writing": p.checkpoint_writing,  # the step written in the background, if any
            # groups the trainer refused since this process started, by reason (SPEC §13)
            "rejected_groups": dict(p.rejected_groups),
            # groups filter_groups dropped since this process started (SPEC §14)
            "filtered_groups": p.filtered_groups,
            # trainer ranks (SPEC §12.1): N, and the group's restarts after faults
            "ranks": self.cfg.trainer.ranks,
            "group_restarts": self.group_restarts,
            # bytes the trainer group's store holds on disk (one machine; null: none, or in memory)
            "group_store_bytes": self._group_store_bytes(),
            "last_fault": self.last_fault,
            "waiting_for_nodes": list(self.waiting_nodes) if p.waiting_for == "ranks" else [],
            # SPEC §15: the last step's health ("ok" or the detector that tripped), rollbacks within
            # the job, the last one (what tripped, to where, the learning rate after it), the newest
            # known-good checkpoint ("start": the starting weights), groups dropped by rollbacks
            "health": p.health,
            "rollbacks": p.rollbacks,
            "max_rollbacks": self.cfg.health.max_rollbacks,
            "last_rollback": p.last_rollback,
            "known_good": p.known_good,
            "dropped_groups": p.dropped_groups,
            "lr": p.last.get("lr"),
            # SPEC §15: each replica's canary drift, quarantines, resyncs, the time per check
            "sentinel": self._sentinel.status() if self._sentinel is not None else None,
        }

    def _group_store_bytes(self) -> int | None:
        try:
            store = getattr(self.rank_host, "store", None) if self.rank_host is not None else None
            size = store.size_bytes() if store is not None else None
        except Exception:  # no store yet, or one being replaced: nothing to show this time
            return None
        return size if isinstance(size, int) else None

    def metrics_view(self) -> dict[str, Any]:
        """What /metrics reads beyond the status: the last metrics row and the running totals."""
        from atroposd.trainer.batch import REASONS

        p = self.progress
        return {
            "last": dict(p.last),
            "seconds": dict(p.seconds),
            "tokens_total": p.tokens_total,
            "rejected_reasons": list(REASONS),
        }

    async def on_inference_restarted(self, replica: int | None = None) -> None:
        """A restarted inference replica (None: every one) gets the current weights before it
        serves rollouts."""
        if self._policy is None or self.progress.waiting_for == "ranks":
            return  # a group being re-formed gives every replica its weights when it attaches
        if replica is not None and replica in self._sentinel_restarting:
            # The sentinel restarted it from within a step's sync, which holds the lock and waits
            # for this replica to serve again (and for this reattach, should it stop waiting):
            # nothing else touches the weights meanwhile.
            done = self._unlocked_reattach = anyio.Event()
            try:
                await self.weights.reattach(self._policy.model, self.progress.weight_version, replica)
            finally:
                done.set()
        else:
            async with self._lock:
                await self.weights.reattach(self._policy.model, self.progress.weight_version, replica)
        log.info(
            "weights re-attached to the restarted inference server",
            replica=replica,
            weight_version=self.progress.weight_version,
        )

    async def on_remote_replica_restarted(self, what: str) -> None:
        """Several machines: a replica of another node restarted. A push with no replica of this
        node as a target still gathers every bucket, and that node's first rank feeds its own."""
        from atroposd.weights.sync import REMOTE_ONLY

        if self._policy is None or self.progress.waiting_for == "ranks":
            return  # a group being formed pushes to every node when it attaches
        async with self._lock:
            await self.weights.reattach(self._policy.model, self.progress.weight_version, REMOTE_ONLY)
        log.info(
            "weights pushed for a restarted replica of another node",
            replica=what,
            weight_version=self.progress.weight_version,
        )

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> TrainerOutcome:
        from atroposd.trainer.health import Collapse

        p = self.progress
        try:
            while True:
                try:
                    outcome = await self._attempt(task_status)
                    self.outcome = outcome
                    return outcome
                except GroupFault as fault:
                    if not self._started:
                        raise  # a group that never trained: the start fails
                    await self._after_fault(fault)
                except Collapse as collapse:
                    await self._after_collapse(collapse)
        except Exception as group:  # any failure ends the job: state failed, exit 1 (SPEC §4)
            exc = _root_cause(group)
            p.state, p.error = TrainerState.FAILED, f"{type(exc).__name__}: {exc}"
            log.error("trainer failed", step=p.step, error=p.error, exc_info=not _expected(exc))
            if not self._started:
                self._started = True
                task_status.started()
            self.outcome = TrainerOutcome(TrainerState.FAILED, p.step, p.weight_version, p.error)
            return self.outcome
        finally:
            with anyio.CancelScope(shield=True):
                if self._feed is not None:
                    await self._feed.aclose()
                await self._close_group()
            if self._metrics is not None:
                self._metrics.close()
            if self._wandb is not None:
                await anyio.to_thread.run_sync(self._wandb.close, abandon_on_cancel=True)
            self.compute.close()

    async def _attempt(self, task_status: TaskStatus[None]) -> TrainerOutcome:
        """One trainer group, from its forming (several ranks) to the end of training; a failure
        of the group (not of the trainer) is raised as a :class:`GroupFault`."""
        from atroposd.trainer.health import Collapse

        try:
            return await self._attempt_once(task_status)
        except (GroupFault, Collapse):
            raise
        except Exception as exc:
            root = _root_cause(exc)
            if isinstance(root, Collapse):
                raise root from None
            fault = self._as_fault(exc)
            if fault is not None:
                raise fault from exc
            raise

    async def _attempt_once(self, task_status: TaskStatus[None]) -> TrainerOutcome:
        from atroposd.trainer.feed import BatchFeed, GroupFilter
        from atroposd.trainer.loop import TrainingLoop
        from atroposd.trainer.metrics import MetricsWriter
        from atroposd.trainer.setup import build_learner, load_for_training

        p = self.progress
        plan = self._rollback
        restart = self.group_restarts > 0 or plan is not None
        self._loop = None
        self._setup_scope = anyio.CancelScope()
        if self._stop:
            self._setup_scope.cancel()
        with self._setup_scope:
            ranks = await self._form_group()
            p.state, p.waiting_for = TrainerState.WAITING, "model"
            setup = await self.compute.run(
                load_for_training, self.cfg, ranks, pick=plan.target if plan is not None else None
            )
            self._policy = setup.policy
            self._attach_source(setup)
            good_version = setup.weight_version  # a rollback: the version of the known-good weights
            p.step, p.skipped_steps = setup.step, setup.skipped_steps
            p.weight_version = setup.weight_version
            if not self._started:
                self._restore_health(setup)
            setup.lr_scale = p.lr_scale  # this process's own (halved at each rollback)
            if plan is not None:
                # The step counter and weight_version keep increasing (SPEC §15).
                p.step, p.skipped_steps = plan.step, plan.skipped_steps
                p.weight_version = max(p.weight_version, plan.weight_version)
            if restart:
                # Versions never go backwards: the replicas may hold weights trained after the
                # checkpoint this group restarted from.
                held = [v for v in self.weights.replica_versions() if v is not None]
                p.weight_version = max([setup.weight_version, *held]) + 1
            p.last_checkpoint = str(setup.restored_from) if setup.restored_from else None
            if not restart:
                p.waiting_for = "inference"
                await self._check_inference_tokenizer(setup.tokenizer_fingerprint)
            # The server computes with (shared) or loads (push/reload) the trainer's weights
            # and version before any rollout — also the restored ones after a resume. One rank:
            # the optimizer is built on the attached parameters (shared memory in shared and push
            # mode). Several: the other ranks build theirs (collectives, when resuming) first.
            if ranks.world > 1:
                learner = await self.compute.run(build_learner, self.cfg, setup)
            await self.weights.attach(setup.policy.model, p.weight_version)
            if ranks.world == 1:
                learner = await self.compute.run(build_learner, self.cfg, setup)
            if self._metrics is None:
                self._metrics = MetricsWriter(self.paths.metrics_file)
                if self.cfg.wandb.enabled:
                    self._wandb = self._start_wandb(self._metrics)
            if setup.restored_from is not None and plan is None:
                self._metrics.truncate_after(p.step)
            if self._feed is None:
                p.waiting_for = "api"
                t = self.cfg.trainer
                feed = BatchFeed(
                    self.cfg.api_url,
                    self._registration,
                    max_ahead=t.max_staleness,
                    token=self.cfg.api.token,
                    on_wait=self._on_wait,
                    group_filter=GroupFilter(t.batch_size) if t.filter_groups else None,
                )
                self._feed = feed
                await feed.register()
                await feed.prime()  # the first GET /batch lets environments register
            self._loop = TrainingLoop(
                tcfg=self.cfg.trainer,
                feed=self._feed,
                learner=learner,
                weights=self.weights,
                metrics=self._metrics,
                checkpointer=setup.checkpointer(learner),
                progress=p,
                envs_alive=self.envs_alive,
                lock=self._lock,
                compute=self.compute,
                replica_generations=self.replica_generations,
                # every 10 steps (on a terminal, `atroposd run` keeps a live
                # progress line below the log)
                progress_every=PROGRESS_EVERY,
                health=self.cfg.health,
                drop=p.drop,
            )
            self._loop.checkpointer.health = p.health_record
            if self._sentinel is None:
                from atroposd.trainer.sentinel import make_sentinel

                self._sentinel = make_sentinel(
                    self.cfg,
                    self.weights,
                    self.compute.run,
                    learner.policy.vocab_size,
                    ranks=self._current_ranks,
                    restart=self._sentinel_restart if self.restart_replica else None,
                    kept=p.canary_prompts,
                    remote=self.remote_replicas,
                )
            self._loop.sentinel = self._sentinel
            if plan is not None:
                outcome = await self._finish_rollback(plan, good_version)
                if outcome is not None:
                    return outcome
        loop = self._loop
        if self._setup_scope.cancelled_caught or loop is None:
            # stopped before training began: nothing new to checkpoint
            p.state, p.waiting_for = TrainerState.STOPPED, None
            log.info("trainer stopped before training began", step=p.step)
            if not self._started:
                self._started = True
                task_status.started()
            return TrainerOutcome(TrainerState.STOPPED, p.step, p.weight_version)
        if self._stop:
            loop.request_stop()
        p.state, p.waiting_for = TrainerState.WAITING, "data"
        if not self._started:
            self._started = True
            task_status.started()
        elif restart:
            log.info(
                "trainer group restarted", step=p.step, weight_version=p.weight_version, restarts=self.group_restarts
            )
        async with anyio.create_task_group() as tg:
            self._attempt_scope = tg.cancel_scope
            assert self._feed is not None
            tg.start_soon(self._feed.run)
            result = await loop.run()
            tg.cancel_scope.cancel()
        self._raise_if_rank_lost()
        if result == "stopped" and p.last_checkpoint != str(self.paths.checkpoints_dir / f"step-{p.step}"):
            await loop.checkpoint(deadline_s=self.cfg.daemon.checkpoint_timeout)
        self._raise_if_rank_lost()
        p.state = result
        log.info("trainer " + result, step=p.step, weight_version=p.weight_version)
        return TrainerOutcome(result, p.step, p.weight_version)

    # ------------------------------------------------------------------ the sentinel (SPEC §15)

    def _current_ranks(self) -> Any:
        return self._loop.learner.ranks if self._loop is not None else None

    async def _sentinel_restart(self, replica: int) -> bool:
        """Restart replica ``replica`` for the sentinel (which holds the step's lock): the ready
        hook's reattach goes ahead without the lock (:meth:`on_inference_restarted`)."""
        assert self.restart_replica is not None
        restart = self.restart_replica
        ready = False
        self._sentinel_restarting.add(replica)
        try:
            async with anyio.create_task_group() as tg:

                async def run() -> None:
                    nonlocal ready
                    ready = await restart(
                        replica, "the sentinel: its canary drift stayed over drift_limit after a resync"
                    )
                    tg.cancel_scope.cancel()

                async def stop_requested() -> None:
                    # a stop does not wait for the restart: the step ends and the trainer checkpoints
                    while not self._stop:  # noqa: ASYNC110
                        await anyio.sleep(STOP_POLL_S)
                    log.info("stop requested: the step no longer waits for the replica's restart", replica=replica)
                    tg.cancel_scope.cancel()

                tg.start_soon(run)
                tg.start_soon(stop_requested)
        finally:
            self._sentinel_restarting.discard(replica)
            if self._unlocked_reattach is not None:  # begun under the sentinel's lock: it ends first
                with anyio.CancelScope(shield=True):
                    await self._unlocked_reattach.wait()
                self._unlocked_reattach = None
        return ready

    # ------------------------------------------------------------------ rollback (SPEC §15)

    def _restore_health(self, setup: Any) -> None:
        """At the start: the rollbacks, the learning rate's scale and the known-good marks the
        checkpoints kept."""
        from atroposd.trainer.checkpoint import newest_known_good

        p, h = self.progress, setup.health
        p.rollbacks = int(h.get("rollbacks", 0))
        p.lr_scale = float(h.get("lr_scale", 1.0))
        p.dropped_groups = int(h.get("dropped_groups", 0))
        kept = h.get("canary_prompts")
        if isinstance(kept, list) and all(isinstance(x, list) for x in kept):
            p.canary_prompts = [list(x) for x in kept]  # checked against the vocabulary by make_sentinel
        last = h.get("last_rollback")
        p.last_rollback = dict(last) if isinstance(last, dict) else None
        drop = h.get("drop")
        if isinstance(drop, dict):  # the queue may still hold groups of the weights that collapsed
            from atroposd.trainer.health import DropRule

            p.drop = DropRule(int(drop["good_version"]), int(drop["resync_version"]), float(drop["resync_time"]))
        good = newest_known_good(self.paths.checkpoints_dir)
        p.known_good = str(good) if good is not None else "start"
        if p.rollbacks:
            log.info(
                "health restored from the checkpoint",
                rollbacks=p.rollbacks,
                lr_scale=p.lr_scale,
                known_good=p.known_good,
            )

    async def _after_collapse(self, collapse: Collapse) -> None:
        """A detector tripped: plan the rollback to the newest known-good weights (the next attempt
        loads them), with the learning rate halved; past max_rollbacks the job then ends (exit 6)."""
        from atroposd.trainer.checkpoint import newest_known_good
        from atroposd.trainer.setup import START

        p, h = self.progress, self.cfg.health
        good = newest_known_good(self.paths.checkpoints_dir)
        p.rollbacks += 1
        p.lr_scale /= 2
        give_up = p.rollbacks > h.max_rollbacks
        target = good if good is not None else START
        p.last_rollback = {
            "step": collapse.step,
            "detector": collapse.trip.detector,
            "reason": collapse.trip.reason,
            "to": str(target),
            "lr": self.cfg.trainer.lr * p.lr_scale,
            "time": time.time(),
            "final": give_up,
        }
        p.state, p.waiting_for = TrainerState.WAITING, "model"
        log.error(
            "collapse detected: rolling back to the newest known-good weights",
            step=collapse.step,
            detector=collapse.trip.detector,
            reason=collapse.trip.reason,
            to=str(target),
            rollbacks=p.rollbacks,
            max_rollbacks=h.max_rollbacks,
            lr=self.cfg.trainer.lr * p.lr_scale,
            **({"then": "the job ends (exit 6)"} if give_up else {}),
        )
        self._rollback = _Rollback(target, p.step, p.weight_version, p.skipped_steps, give_up, str(collapse))
        await self._close_group()  # several ranks: every rank loads the known-good checkpoint afresh

    async def _finish_rollback(self, plan: _Rollback, good_version: int) -> TrainerOutcome | None:
        """The known-good weights are loaded and every replica has them: write them as a checkpoint
        of the current step (known-good, carrying the count), drop what the collapsed weights
        sampled; past max_rollbacks end here (exit 6)."""
        from atroposd.trainer.checkpoint import mark_known_good
        from atroposd.trainer.health import DropRule

        p = self.progress
        assert self._loop is not None
        self._rollback = None
        p.drop = self._loop.drop = DropRule(good_version, p.weight_version, time.time())
        path = await self._loop.checkpoint()
        if path is not None:
            mark_known_good(
                path, {"step": p.step, "rollback": p.rollbacks, "from": str(plan.target), "time": time.time()}
            )
            p.known_good = str(path)
        if p.last_rollback is not None:
            p.last_rollback["weight_version"] = p.weight_version
        p.health = "ok"
        log.warning(
            "rolled back",
            step=p.step,
            weight_version=p.weight_version,
            to=str(plan.target),
            checkpoint=str(path) if path else None,
            rollbacks=p.rollbacks,
            lr=self.cfg.trainer.lr * p.lr_scale,
        )
        if not plan.give_up:
            return None
        p.state = TrainerState.FAILED
        p.error = (
            f"the run collapsed past health.max_rollbacks = {self.cfg.health.max_rollbacks} "
            f"({p.rollbacks} collapses); last: {plan.reason}"
        )
        log.error("trainer ends: " + p.error, step=p.step, known_good=p.known_good)
        return TrainerOutcome(TrainerState.COLLAPSED, p.step, p.weight_version, p.error)

    # ------------------------------------------------------------------ trainer ranks (SPEC §12.1)

    async def _form_group(self) -> Ranks:
        """One rank: the trainer alone. Several: start ranks 1..N-1 and form the process group."""
        from atroposd.trainer.ranks import GroupRanks, OneRank

        t = self.cfg.trainer
        if t.ranks == 1 or self.rank_host is None:
            return OneRank()
        p = self.progress
        p.state, p.waiting_for = TrainerState.WAITING, "ranks"
        host = self.rank_host
        # Several machines: the group forms once every node is ready (a lost node is back).
        await host.wait_nodes(self._waiting_for_nodes)
        self._rank_lost = None
        prefix = host.store.next_generation()
        await host.start_ranks()
        generation = self.compute.generation
        from atroposd.devices import resolve_torch

        device, _ = await anyio.to_thread.run_sync(resolve_torch, t.devices()[0], self.cfg.inference.dtype)
        try:
            ranks: GroupRanks = await self.compute.run(
                GroupRanks.join,
                host.store.store,
                prefix=prefix,
                key=host.store.key,
                rank=0,
                world=t.ranks,
                device=device,
                join_timeout=t.join_timeout,
                collective_timeout=t.collective_timeout,
                cancelled=lambda: self._stop or self.compute.generation != generation or self._rank_lost is not None,
                commands=host.store.commands(),
            )
        except Exception as exc:
            if self._rank_lost is not None and not self._stop:
                raise GroupFault(self._rank_lost) from exc
            raise
        self._ranks = ranks
        self._ranks_generation = generation
        return ranks

    def _waiting_for_nodes(self, nodes: list[int]) -> None:
        p = self.progress
        p.state, p.waiting_for = TrainerState.WAITING, "ranks"
        self.waiting_nodes = list(nodes)

    def _attach_source(self, setup: Any) -> None:
        """With several ranks the weight sync reads the weights gathered on the compute thread."""
        self._source = None
        if setup.ranks.world == 1:
            return
        from atroposd.trainer.sharded_source import ShardedSource

        model = setup.policy.model
        self._source = (model, ShardedSource(model, setup.ranks, self.compute, setup.tensor_specs, setup.tied))

    def weight_source(self, model: Any) -> TensorSource:
        """The tensors the weight sync sends of ``model`` (its ``source_for``): with several ranks
        the full weights gathered from every rank on the compute thread, else the model's own."""
        if self._source is not None and self._source[0] is model:
            return self._source[1]
        from atroposd.weights.source import ModelSource

        return ModelSource(model)

    def on_rank_exit(self, name: str, how: str) -> None:
        """The daemon saw trainer rank ``name`` exit: the group restarts (unless the trainer is
        stopping or done, when ranks leave on purpose)."""
        if self._stop or self.outcome is not None or self.cfg.trainer.ranks == 1:
            return
        if self._rank_lost is None:
            self._rank_lost = f"{name} {how}"
            log.error("a trainer rank exited; the group restarts", rank=name, exit=how)
        if self._attempt_scope is not None:
            self._attempt_scope.cancel()
        if self._loop is not None:
            self._loop.request_stop()

    def _raise_if_rank_lost(self) -> None:
        if self._rank_lost is not None and not self._stop:
            raise GroupFault(self._rank_lost)

    def _as_fault(self, exc: BaseException) -> GroupFault | None:
        """A failure of the group (not of the trainer itself) as a fault to restart from."""
        if self.cfg.trainer.ranks == 1 or self._stop:
            return None
        root = _root_cause(exc)
        if self._rank_lost is not None:
            return GroupFault(self._rank_lost)
        from atroposd.trainer.ranks import Fenced, is_group_error

        if isinstance(root, Fenced) or is_group_error(root):
            return GroupFault(f"a collective failed: {type(root).__name__}: {str(root)[:300]}")
        return None

    async def _after_fault(self, fault: GroupFault) -> None:
        """Stop every rank, fence the compute thread, wait the backoff; raise past max_restarts."""
        t = self.cfg.trainer
        p = self.progress
        p.state, p.waiting_for = TrainerState.WAITING, "ranks"
        now = time.monotonic()
        missing = self.rank_host.nodes_missing() if self.rank_host is not None else []
        # A restart while a rank-holding node is lost or joining is not counted (SPEC §12.3):
        # the group waits for the node instead.
        self._restarts.record(now, counted=not missing)
        self.group_restarts += 1
        if self._rank_lost is None and self.rank_host is not None:
            # A collective failed: name the rank whose exit broke it, once its unit has seen it.
            with anyio.move_on_after(RANK_EXIT_GRACE_S):
                while not self.rank_host.exited():  # noqa: ASYNC110 - the units notice exits by polling
                    await anyio.sleep(0.05)
            exited = self.rank_host.exited()
            if exited:
                fault = GroupFault(f"{', '.join(exited)}: {fault}")
        self.last_fault = str(fault)
        if self._loop is not None:  # a checkpoint still being written is never installed now
            self._loop.abandon_checkpoint()
        self.compute.fence()
        await self._close_group()
        if self._restarts.exhausted:
            raise GroupFault(
                f"{self._restarts.count} trainer group restarts within {t.restart_window:g} s "
                f"(trainer.max_restarts = {t.max_restarts}); last: {fault}"
            )
        delay = self._restarts.backoff()
        log.error(
            "trainer group failed; restarting from the last complete checkpoint",
            reason=str(fault),
            restarts=self.group_restarts,
            backoff_s=delay,
        )
        with anyio.move_on_after(delay):
            while not self._stop:  # noqa: ASYNC110 - a stop request ends the wait early
                await anyio.sleep(0.1)

    async def _close_group(self) -> None:
        """Tell the other ranks to stop (a group still intact), stop their processes, close ours."""
        from atroposd.trainer.group import Stop

        ranks, self._ranks = self._ranks, None
        intact = self._rank_lost is None and self.compute.generation == self._ranks_generation
        if intact and self._loop is not None:
            # A checkpoint being written finishes first (any rank count): its writer reads the live
            # weights, which a rollback's re-attach releases, and the next attempt's start removes
            # incomplete checkpoints.
            with anyio.move_on_after(CHECKPOINT_FINISH_S):
                try:
                    await self._loop.finish_checkpoint()
                except Exception as exc:
                    log.warning("the checkpoint being written did not finish", error=f"{type(exc).__name__}: {exc}")
        if ranks is not None and intact:
            with anyio.move_on_after(5):
                try:
                    await self.compute.run(ranks.command, Stop())
                except Exception as exc:
                    log.warning("trainer ranks not told to stop", error=f"{type(exc).__name__}: {exc}")
        if self.rank_host is not None and self.cfg.trainer.ranks > 1:
            await self.rank_host.stop_ranks()
        if ranks is not None:
            # A group whose peer died may hang in its teardown: never on the event loop, bounded.
            with anyio.move_on_after(5):
                await anyio.to_thread.run_sync(ranks.close, abandon_on_cancel=True)

    # ------------------------------------------------------------------ helpers

    def _on_wait(self, reason: str | None) -> None:
        p = self.progress
        if p.state in (TrainerState.WAITING, TrainerState.TRAINING):
            p.state, p.waiting_for = (TrainerState.WAITING, reason) if reason else (TrainerState.TRAINING, None)

    def _start_wandb(self, metrics: Any) -> Any:
        """W&B logging of every metrics row (its own thread; a failure is a warning)."""
        from atroposd.config import to_dict
        from atroposd.trainer.wandb_sink import WandbSink

        config = to_dict(self.cfg)
        if config["api"].get("token"):
            config["api"]["token"] = "<set>"  # never a secret in the run's config
        sink = WandbSink.start(self.cfg, config)
        metrics.sinks.append(sink.log)
        return sink

    def _registration(self) -> dict[str, Any]:
        t = self.cfg.trainer
        # Atropos environments read the group and project from the API (/wandb_info) to group
        # their own W&B runs with the trainer's.
        from atroposd.trainer.wandb_sink import wandb_group

        w = self.cfg.wandb
        return {
            "wandb_group": wandb_group(self.cfg),
            "wandb_project": w.project if w.enabled else "",
            "batch_size": t.batch_size,
            "max_token_len": t.max_token_len,
            "checkpoint_dir": str(self.paths.checkpoints_dir),
            "save_checkpoint_interval": t.checkpoint_every,
            "starting_step": self.progress.step,
            "num_steps": t.steps,
        }

    async def _check_inference_tokenizer(self, local: dict[str, Any]) -> None:
        """Compare the inference server's tokenizer (``GET /info``) with the trainer's."""
        import aiohttp
        import orjson

        from atroposd.trainer.model import check_tokenizers

        url = f"{self.cfg.inference_url}/info"
        token = self.cfg.inference.token  # the inference servers' bearer token, if any (SPEC §12.3)
        auth = {"Authorization": f"Bearer {token}"} if token else {}
        deadline = time.monotonic() + max(INFO_TIMEOUT_S, self.cfg.inference.ready_timeout)
        delay = 0.05
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=INFO_TIMEOUT_S)) as session:
            while True:
                try:
                    async with session.get(url, headers=auth) as resp:
                        body = await resp.read()
                        status = resp.status
                    break
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"inference server at {self.cfg.inference_url} not reachable: {exc}"
                        ) from exc
                await anyio.sleep(delay)
                delay = min(delay * 2, 1.0)
        if status == 404:
            log.warning("the inference server has no /info; its tokenizer cannot be compared", url=url)
            return
        info = orjson.loads(body) if status == 200 else None
        remote = info.get("tokenizer") if isinstance(info, dict) else None
        if not isinstance(info, dict) or not isinstance(remote, dict):
            log.warning("the inference server's /info has no tokenizer fingerprint", url=url, status=status)
            return
        check_tokenizers(
            local,
            remote,
            local_name=str(self._policy.source),
            remote_name=f"{info.get('model')} at {self.cfg.inference_url}",
        )


def _root_cause(exc: BaseException) -> BaseException:
    """The one error inside (nested) single-member exception groups of the loop's task group."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _expected(exc: BaseException) -> bool:
    from atroposd.devices import DeviceError
    from atroposd.trainer.checkpoint import CheckpointError
    from atroposd.trainer.feed import DataTimeout
    from atroposd.trainer.model import ModelLoadError
    from atroposd.trainer.optim import OptimizerError
    from atroposd.trainer.setup import ResumeError

    return isinstance(exc, (DataTimeout, DeviceError, ModelLoadError, OptimizerError, CheckpointError, ResumeError))

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

import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import structlog
from anyio.abc import TaskStatus

from atroposd.config import Config
from atroposd.paths import Paths
from atroposd.restarts import RestartBudget
from atroposd.trainer.rollback import Rollback, finish_rollback, plan_rollback, restore_health
from atroposd.trainer.startup import check_inference_tokenizer, expected_failure, registration, start_wandb
from atroposd.trainer.state import TrainerState
from atroposd.trainer.supervisor import (
    BACKOFF_FIRST_S,
    BACKOFF_MAX_S,
    Fleet,
    GroupFault,
    GroupState,
    GroupSupervisor,
    root_cause,
)

if TYPE_CHECKING:
    import torch

    from atroposd.trainer.feed import BatchFeed
    from atroposd.trainer.health import Collapse
    from atroposd.trainer.loop import TrainingLoop
    from atroposd.trainer.metrics import MetricsWriter
    from atroposd.trainer.model import Policy
    from atroposd.trainer.ranks import Ranks
    from atroposd.trainer.sentinel import RemoteReplica, Sentinel
    from atroposd.trainer.setup import Setup
    from atroposd.trainer.wandb_sink import WandbSink
    from atroposd.weights.source import TensorSource
    from atroposd.weights.sync import WeightSync

__all__ = ["Fleet", "GroupFault", "TrainerOutcome", "TrainerService"]

log = structlog.get_logger("trainer", component="trainer")  # lazy: bound at first use

PROGRESS_EVERY = 10  # steps
CHECKPOINT_FINISH_S = 300.0  # before the trainer group closes: a checkpoint being written may finish
STOP_POLL_S = 0.2  # how often the sentinel's wait for a replica's restart looks for a stop request


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
        fleet: Fleet | None = None,
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
        self._loop: TrainingLoop | None = None
        self._policy: Policy | None = None
        self._source: tuple[Any, TensorSource] | None = None  # (model, the source its sync reads)
        self._metrics: MetricsWriter | None = None
        # Cancelled by a stop request that comes before training starts (waits for the
        # inference server or the API must not hold up the daemon's stop).
        self._setup_scope = anyio.CancelScope()
        self.outcome: TrainerOutcome | None = None  # set when run() returns
        # Rank 0's one compute thread: every step's work, in order (SPEC §12.1).
        self.compute = ComputeThread()
        self.fleet = fleet if cfg.trainer.ranks > 1 else None  # ranks 1..N-1, here and on the other nodes
        self.replica_generations = replica_generations  # each replica's generations served, last known
        self.remote_replicas = remote_replicas  # several machines: the other nodes' replicas (the sentinel's)
        self._feed: BatchFeed | None = None
        self._wandb: WandbSink | None = None
        self._ranks: Ranks | None = None
        self._ranks_generation = 0
        t = cfg.trainer
        self.group = GroupSupervisor(
            self.fleet,
            budget=RestartBudget(t.max_restarts, t.restart_window, first=BACKOFF_FIRST_S, cap=BACKOFF_MAX_S),
            restart_window=t.restart_window,
            on_move=self._on_group_move,
        )
        self._started = False  # task_status.started() was called
        self._rollback: Rollback | None = None  # a collapse the next attempt rolls back from
        self._sentinel: Sentinel | None = None  # SPEC §15: the replica sentinel, made once per job
        # The daemon's restart of inference replica i (returns once it serves the current weights
        # again: True, or failed: False); the replicas the sentinel restarts now.
        self.restart_replica = restart_replica
        self._sentinel_restarting: set[int] = set()
        self._unlocked_reattach: anyio.Event | None = None  # the reattach that goes ahead under its lock

    # ------------------------------------------------------------------ daemon interface

    def request_stop(self) -> None:
        """Finish (or abandon) the current step, checkpoint within checkpoint_timeout, return."""
        self.group.stop()
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
            "group_restarts": self.group.restarts,
            # bytes the trainer group's store holds on disk (one machine; null: none, or in memory)
            "group_store_bytes": self._group_store_bytes(),
            "last_fault": self.group.last_fault,
            "waiting_for_nodes": list(self.group.waiting_nodes) if p.waiting_for == "ranks" else [],
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
            store = self.fleet.store if self.fleet is not None else None
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
        p = self.progress
        try:
            self.outcome = await self.group.run(
                lambda prefix: self._attempt_once(task_status, prefix),
                started=lambda: self._started,
                halt=self._halt,
                collapsed=self._after_collapse,
                stopped=lambda: self._stopped_before_training(task_status),
                on_wait=self._waiting_for_nodes,
            )
            return self.outcome
        except Exception as group:  # any failure ends the job: state failed, exit 1 (SPEC §4)
            exc = root_cause(group)
            p.state, p.error = TrainerState.FAILED, f"{type(exc).__name__}: {exc}"
            log.error("trainer failed", step=p.step, error=p.error, exc_info=not expected_failure(exc))
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

    async def _attempt_once(self, task_status: TaskStatus[None], prefix: str | None) -> TrainerOutcome:
        """One generation: join the ranks started under ``prefix`` (None: one rank), load, train."""
        from atroposd.trainer.feed import BatchFeed, GroupFilter
        from atroposd.trainer.loop import TrainingLoop
        from atroposd.trainer.metrics import MetricsWriter
        from atroposd.trainer.setup import build_learner, load_for_training

        p = self.progress
        plan = self._rollback
        restart = self.group.restarts > 0 or plan is not None
        self._loop = None
        self._setup_scope = anyio.CancelScope()
        if self.group.stopping:
            self._setup_scope.cancel()
        with self._setup_scope:
            ranks = await self._join_group(prefix)
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
                restore_health(self.progress, setup.health, self.paths.checkpoints_dir)
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
                await check_inference_tokenizer(self.cfg, setup.tokenizer_fingerprint, str(self._policy.source))
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
                    self._wandb = start_wandb(self.cfg, self._metrics)
            if setup.restored_from is not None and plan is None:
                self._metrics.truncate_after(p.step)
            if self._feed is None:
                p.waiting_for = "api"
                t = self.cfg.trainer
                feed = BatchFeed(
                    self.cfg.api_url,
                    functools.partial(registration, self.cfg, self.paths.checkpoints_dir, p),
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
            return self._stopped_before_training(task_status)
        if self.group.stopping:
            loop.request_stop()
        p.state, p.waiting_for = TrainerState.WAITING, "data"
        self.group.move(GroupState.TRAINING, "the group formed")
        if not self._started:
            self._started = True
            task_status.started()
        elif restart:
            log.info(
                "trainer group restarted", step=p.step, weight_version=p.weight_version, restarts=self.group.restarts
            )
        with self.group.training():  # cancelled at the group's first fault
            async with anyio.create_task_group() as tg:
                assert self._feed is not None
                tg.start_soon(self._feed.run)
                result = await loop.run()
                tg.cancel_scope.cancel()
        self.group.check()
        if result == "stopped" and p.last_checkpoint != str(self.paths.checkpoints_dir / f"step-{p.step}"):
            await loop.checkpoint(deadline_s=self.cfg.daemon.checkpoint_timeout)
        self.group.check()
        p.state = result
        log.info("trainer " + result, step=p.step, weight_version=p.weight_version)
        return TrainerOutcome(result, p.step, p.weight_version)

    # ------------------------------------------------------------------ the sentinel (SPEC §15)

    def _current_ranks(self) -> Ranks | None:
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
                    while not self.group.stopping:  # noqa: ASYNC110
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

    async def _after_collapse(self, collapse: Collapse) -> None:
        """A detector tripped: plan the rollback (the next generation loads the known-good weights)."""
        self._rollback = plan_rollback(self.cfg, self.progress, collapse, self.paths.checkpoints_dir)
        await self._close_group()  # several ranks: every rank loads the known-good checkpoint afresh

    async def _finish_rollback(self, plan: Rollback, good_version: int) -> TrainerOutcome | None:
        """The known-good weights are loaded: checkpoint them; past max_rollbacks end here (exit 6)."""
        assert self._loop is not None
        self._rollback = None
        error = await finish_rollback(self.cfg, self.progress, self._loop, plan, good_version)
        if error is None:
            return None
        p = self.progress
        return TrainerOutcome(TrainerState.COLLAPSED, p.step, p.weight_version, error)

    # ------------------------------------------------------------------ trainer ranks (SPEC §12.1)

    def _stopped_before_training(self, task_status: TaskStatus[None]) -> TrainerOutcome:
        """A stop before the generation trained: nothing new to checkpoint."""
        p = self.progress
        p.state, p.waiting_for = TrainerState.STOPPED, None
        log.info("trainer stopped before training began", step=p.step)
        if not self._started:
            self._started = True
            task_status.started()
        return TrainerOutcome(TrainerState.STOPPED, p.step, p.weight_version)

    async def _join_group(self, prefix: str | None) -> Ranks:
        """One rank (``prefix`` None): the trainer alone. Several: the process group formed with
        the generation of ranks 1..N-1 the supervisor started under ``prefix``."""
        from atroposd.devices import resolve_torch
        from atroposd.trainer.ranks import GroupRanks, OneRank

        t = self.cfg.trainer
        if self.fleet is None:
            return OneRank()
        assert prefix is not None, "the supervisor starts a generation's ranks before its attempt"
        generation = self.compute.generation
        device, _ = await anyio.to_thread.run_sync(resolve_torch, t.devices()[0], self.cfg.inference.dtype)
        group, store = self.group, self.fleet.store
        if store.store is None:
            raise RuntimeError("the trainer group's store is closed")
        ranks: GroupRanks = await self.compute.run(
            GroupRanks.join,
            store.store,
            prefix=prefix,
            key=store.key,
            rank=0,
            world=t.ranks,
            device=device,
            join_timeout=t.join_timeout,
            collective_timeout=t.collective_timeout,
            cancelled=lambda: group.stopping or self.compute.generation != generation or group.fault is not None,
            commands=store.commands(),
        )
        self._ranks = ranks
        self._ranks_generation = generation
        return ranks

    def _waiting_for_nodes(self, nodes: list[int]) -> None:
        p = self.progress
        p.state, p.waiting_for = TrainerState.WAITING, "ranks"
        self.group.waiting_nodes = list(nodes)

    def _attach_source(self, setup: Setup) -> None:
        """With several ranks the weight sync reads the weights gathered on the compute thread."""
        self._source = None
        if setup.ranks.world == 1:
            return
        from atroposd.trainer.sharded_source import ShardedSource

        model = setup.policy.model
        self._source = (model, ShardedSource(model, setup.ranks, self.compute, setup.tensor_specs, setup.tied))

    def weight_source(self, model: torch.nn.Module) -> TensorSource:
        """The tensors the weight sync sends of ``model`` (its ``source_for``): with several ranks
        the full weights gathered from every rank on the compute thread, else the model's own."""
        if self._source is not None and self._source[0] is model:
            return self._source[1]
        from atroposd.weights.source import ModelSource

        return ModelSource(model)

    def _on_group_move(self, state: GroupState) -> None:
        if state == GroupState.FAULTED:
            self.progress.state, self.progress.waiting_for = TrainerState.WAITING, "ranks"

    async def _halt(self) -> None:
        """Rank 0's part of a faulted generation (the supervisor stops the others): its checkpoint
        being written never installed, the compute thread fenced, its end of the group closed."""
        if self._loop is not None:
            self._loop.abandon_checkpoint()
        self.compute.fence()
        await self._close_group(fleet=False)

    async def _close_group(self, *, fleet: bool = True) -> None:
        """Tell the other ranks to stop (a group intact), stop their processes (``fleet``), close ours."""
        from atroposd.trainer.group import Stop

        ranks, self._ranks = self._ranks, None
        intact = self.group.fault is None and self.compute.generation == self._ranks_generation
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
        if fleet and self.fleet is not None:
            await self.fleet.stop()
        if ranks is not None:
            # A group whose peer died may hang in its teardown: never on the event loop, bounded.
            with anyio.move_on_after(5):
                await anyio.to_thread.run_sync(ranks.close, abandon_on_cancel=True)

    # ------------------------------------------------------------------ helpers

    def _on_wait(self, reason: str | None) -> None:
        p = self.progress
        if p.state in (TrainerState.WAITING, TrainerState.TRAINING):
            p.state, p.waiting_for = (TrainerState.WAITING, reason) if reason else (TrainerState.TRAINING, None)

"""The daemon's lifecycle: start order, the main loop, signals, stop (SPEC §4).

``Daemon.main()`` in order:

    lock the pidfile → child subreaper → clean up after a crashed daemon → control socket
      → start: API → inference (health + one generation) → trainer (first /batch) → environments
      → READY → serve events (stop, reload, component changes, trainer end) → stop in reverse

Signal handlers, control requests and the units only put an event (:mod:`.state`) on one
queue; the main task applies them.  SIGTERM and ``atroposd stop`` take the same path.  Every
child is a :class:`~atroposd.process.unit.Unit` built from :mod:`.specs`; the daemon never
signals a process it did not start.  The rest lives beside this module: runtime files and
ports (:mod:`.runtime`), crash recovery (:mod:`.recovery`), status and metrics
(:mod:`.status`), the reload plan (:mod:`.reload`).
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from atroposd import gpuenv, heartbeat
from atroposd.config import ClusterError, Config, ConfigError, TokenError, load_config
from atroposd.control import ANSWER_LIMIT, ControlServer
from atroposd.daemon import runtime, specs
from atroposd.daemon import status as status_mod
from atroposd.daemon.ranks import Fleet
from atroposd.daemon.recovery import RecoveryRecord, recover
from atroposd.daemon.reload import env_of, plan_reload
from atroposd.daemon.replicas import ReplicaHealth
from atroposd.daemon.roles import ClusterRole, Standalone
from atroposd.daemon.runtime import StartFailed
from atroposd.daemon.specs import API_READY_TIMEOUT, SpecInputs
from atroposd.daemon.state import (
    DaemonState,
    Event,
    ReloadRequested,
    Reply,
    StallUnresolved,
    StopRequested,
    TrainerEnded,
    UnitChanged,
)
from atroposd.daemon.watchdog import StallWatchdog, WatchedSync
from atroposd.exitcodes import Exit
from atroposd.logs import get_logger
from atroposd.paths import Paths
from atroposd.pids import start_ticks
from atroposd.process import reaper
from atroposd.process.liveness import HeartbeatBoard
from atroposd.process.logfiles import LogHub
from atroposd.process.unit import State, Unit, UnitSpec
from atroposd.systemd import Notifier

if TYPE_CHECKING:
    import torch

    from atroposd.daemon.cluster import HeadLink, NodeLink
    from atroposd.sandbox.manager import Sandbox
    from atroposd.trainer.group import GroupStore
    from atroposd.trainer.service import TrainerOutcome, TrainerService
    from atroposd.weights.shmspace import ShmVerdict
    from atroposd.weights.source import TensorSource
    from atroposd.weights.sync import WeightSync

log = get_logger("atroposd.daemon")

TRACK_INTERVAL = 0.5
STATUS_INTERVAL = 5.0
MODEL_RESOLVE_TIMEOUT = 600.0  # building builtin:tiny or reading a large model on a first start


class Daemon:
    def __init__(self, cfg: Config, *, notifier: Notifier | None = None) -> None:
        self.cfg = cfg
        self.paths = Paths.of(cfg)
        self.nonce = secrets.token_hex(6)
        self.notifier = notifier or Notifier()
        self._state = DaemonState.STARTING
        self.pid = os.getpid()
        # Identity (pid + boot-relative start): what `stop` and recovery compare, exactly.
        self.start_time: int = start_ticks(self.pid) or 0
        self.started_at = time.time()  # wall clock: compared with file times only
        self._t0 = time.monotonic()
        self.units: dict[str, Unit] = {}
        self.trainer: TrainerService | None = None
        self.weights: WeightSync | None = None
        self.group_store: GroupStore | None = None  # trainer ranks' store (several ranks)
        self.model_path: str = cfg.inference.model
        self.tokenizer_path: str = cfg.inference.tokenizer or cfg.inference.model
        self.start_error: str | None = None
        self._events_send, self._events = anyio.create_memory_object_stream[Event](math.inf)
        self._stop_requested = False
        self._stop_code = Exit.OK  # the exit code of a requested stop (1: a node lost its head)
        self._stop_by: float | None = None  # a requested stop's deadline for every child, if any
        # Several machines (SPEC §12.3): the head's link to the other nodes, or a node's to its head
        # (``cluster`` is the one this daemon has, as a role; standalone without either).
        self.head: HeadLink | None = None
        self.node_link: NodeLink | None = None
        self._standalone = Standalone()
        # Every trainer rank but rank 0 (this node's units; on the head, the other nodes' too).
        self.fleet = Fleet(self, store_dir=self.paths.runtime_dir, secret=self.nonce)
        self.stopped = anyio.Event()  # every child of this node is gone (set by _stop_all)
        self._start_scope: anyio.CancelScope | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._hub: LogHub | None = None
        self._trainer_done = anyio.Event()
        self._preloaded = anyio.Event()  # the trainer's imports are done (or were never started)
        self._trainer_scope: anyio.CancelScope | None = None
        self._trainer_outcome: TrainerOutcome | None = None
        self._reaper = reaper.OrphanReaper()
        # Liveness (SPEC §4): environments' heartbeats, and the trainer's forward-progress watchdog.
        self.board = HeartbeatBoard()
        self.watchdog: StallWatchdog | None = None
        # Each inference replica's /health in the background: generations served and weight_version,
        # read by the trainer's metrics rows and /metrics without waiting on a replica.
        self.replica_health = ReplicaHealth.of(cfg)
        self._stall_exit: str | None = None
        self._record = RecoveryRecord(
            self.paths, nonce=self.nonce, pid=self.pid, start_time=self.start_time, started_at=self.started_at
        )
        # NCCL's error handling before this process builds any group (rank 0 and the broadcast
        # groups live here, whatever the rank count), over the environment (SPEC §12.1).
        gpuenv.apply(os.environ)
        # Children start from the environment the daemon was given (before any narrowing of
        # CUDA_VISIBLE_DEVICES for the in-process trainer).
        self._base_env = specs.child_base_env(os.environ)
        # SPEC §16: the environments' engine sockets and their containers ([sandbox] engine set).
        self.sandbox: Sandbox | None = None

    # ------------------------------------------------------------------ state

    @property
    def cluster(self) -> ClusterRole:
        """This daemon's place in the job: the head's link, a node's, or standalone."""
        if self.head is not None:
            return self.head
        return self.node_link if self.node_link is not None else self._standalone

    @property
    def state(self) -> DaemonState:
        return self._state

    def _move(self, new: DaemonState, reason: str) -> None:
        """The one place the daemon's state changes: a legal move, logged old → new."""
        old = self._state
        old.check_move(new)
        self._state = new
        log.info("daemon state", old=old.value, new=new.value, reason=reason)

    def _resolve_api_token(self) -> None:
        """The API's token from ``token_file`` or ``$ATROPOSD_API_TOKEN`` into the config, once:
        the children read it from their 0600 config file, the daemon's own requests (probes,
        trainer) and the built-in environments send it — never on a command line."""
        try:
            self.cfg.api.token = self.cfg.api.bearer_token()
            self.cfg.inference.token = self.cfg.inference_token()  # SPEC §12.3: sent, never on a command line
        except (TokenError, ClusterError) as exc:
            raise StartFailed(str(exc)) from None

    def _resolve_node_rank(self) -> None:
        """Several machines: this node's rank (``-1`` resolved from the environment or the host
        name) into the config, so that every child sees the same."""
        if not self.cfg.cluster.enabled:
            return
        try:
            self.cfg.cluster.node_rank = self.cfg.cluster.resolve_node_rank()
        except ClusterError as exc:
            raise StartFailed(str(exc)) from None
        log.info(
            "cluster node",
            node_rank=self.cfg.node_rank,
            nodes=self.cfg.cluster.nodes,
            head=self.cfg.cluster.head,
            role="head" if self.cfg.is_head else "node",
        )

    def _check_checkpoint_dir(self) -> None:
        """The trainer resumes from what is in checkpoint_dir: ours and writable by no one else."""
        from atroposd.paths import UnsafeDirError, check_checkpoint_dir

        if self.cfg.trainer.enabled:
            try:
                check_checkpoint_dir(self.paths.checkpoints_dir)
            except UnsafeDirError as exc:
                raise StartFailed(str(exc)) from None

    def uptime(self) -> float:
        return time.monotonic() - self._t0

    def spawn(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Run ``fn(*args)`` in the daemon's task group (a failure is logged, never raised)."""

        async def guarded() -> None:
            try:
                await fn(*args)
            except Exception:
                log.exception("background task failed", task=getattr(fn, "__qualname__", str(fn)))

        if self._tg is not None:
            self._tg.start_soon(guarded)

    # ------------------------------------------------------------------ entry

    async def main(self) -> int:
        """Run the job until it ends; the exit code of SPEC §2."""
        runtime.prepare_dirs(self.paths)
        pid_fd = runtime.lock_pidfile(self.paths.pidfile)
        try:
            reaper.set_child_subreaper()
            recover(self.paths)
            self._record.update(())
            self._hub = LogHub(
                self.paths.logs_dir, max_bytes=self.cfg.daemon.log_max_bytes, backups=self.cfg.daemon.log_backups
            )
            try:
                self._resolve_node_rank()
                self._check_checkpoint_dir()
                runtime.check_ports(self.cfg)  # before anything binds (the metrics server included)
                self._resolve_api_token()
                self._open_sandbox()
            except StartFailed as exc:
                log.error("start failed", reason=str(exc))
                return Exit.RUNTIME
            self._write_child_config()
            control = ControlServer(self.paths.control_socket, self._control, socket_group=self.cfg.daemon.socket_group)
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._signals)
                await tg.start(control.serve)
                await tg.start(self.board.serve, self.paths.runtime_dir / heartbeat.SOCKET_NAME)
                tg.start_soon(self._track_loop)
                tg.start_soon(self._status_loop)
                tg.start_soon(self.replica_health.run)
                tg.start_soon(self.notifier.watchdog_loop)
                if self.cfg.daemon.metrics_port:
                    await tg.start(self._serve_metrics)
                if self.sandbox is not None:
                    tg.start_soon(self.sandbox.run)
                code = await self._lifecycle()
                if self.trainer is not None and not self._trainer_done.is_set():
                    self._exit_without_trainer(code, pid_fd)  # its compute thread does not return
                tg.cancel_scope.cancel()
            log.info("daemon exits", code=int(code))
            return code
        finally:
            if self._hub is not None:
                self._hub.close()
            self._clean_files()
            self._close_events()
            os.close(pid_fd)

    def _close_events(self) -> None:
        self._events_send.close()
        self._events.close()

    async def _serve_metrics(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        from atroposd.daemon.metrics import serve_metrics

        await serve_metrics(self, self.cfg.daemon.metrics_port, task_status=task_status)

    async def _lifecycle(self) -> Exit:
        code = Exit.RUNTIME
        try:
            with anyio.CancelScope() as scope:
                self._start_scope = scope
                await self._start_all()
            self._start_scope = None
            if scope.cancelled_caught:
                log.info("start abandoned: stop requested")
                code = self._stop_code
            else:
                self._move(DaemonState.RUNNING, "every component started")
                self.notifier.ready(status_mod.status_line(self))
                log.info("READY", seconds=round(self.uptime(), 3), instance=self.nonce)
                self._start_watchdog()
                code = await self._serve()
        except StartFailed as exc:
            self.start_error = str(exc)
            log.error("start failed", reason=str(exc))
            code = Exit.RUNTIME
        except Exception as exc:
            # A bug or an unexpected environment problem: stop everything cleanly, exit 1.
            self.start_error = f"{type(exc).__name__}: {exc}"
            log.exception("start failed", reason=self.start_error)
            code = Exit.RUNTIME
        finally:
            with anyio.CancelScope(shield=True):
                await self._stop_all()
        return code

    # ------------------------------------------------------------------ start

    def spec_inputs(self) -> SpecInputs:
        return SpecInputs(
            cfg=self.cfg,
            paths=self.paths,
            nonce=self.nonce,
            model=self.model_path,
            tokenizer=self.tokenizer_path,
            base_env=self._base_env,
            board=self.board,
        )

    def _open_sandbox(self) -> None:
        if not self.cfg.sandbox.engine:
            return
        from atroposd.sandbox.manager import Sandbox

        self.sandbox = Sandbox(
            self.cfg, runtime_dir=self.paths.runtime_dir, state_dir=self.paths.state_dir, launch=self.nonce
        )

    async def _start_all(self) -> None:
        head = self.cfg.is_head
        if self.sandbox is not None:
            # what an earlier launch of this job left on the engine goes before anything starts
            from atroposd.sandbox.manager import SandboxUnavailable

            try:
                await self.sandbox.prepare()
            except SandboxUnavailable as exc:
                raise StartFailed(str(exc)) from None
        if self.cfg.cluster.enabled:
            await self._open_cluster()
        if self.cfg.inference.enabled or self.cfg.trainer.enabled:
            await self._resolve_model()
            self._write_child_config()
        if self.cfg.trainer.enabled and head:
            # Seconds of imports (torch, transformers, the model's module) while the API and the
            # inference server start in their own processes, instead of after them.
            rank0 = self.cfg.trainer.devices()[0]
            if rank0.startswith("GPU-"):
                # Rank 0 runs in this process: its GPU, named by UUID, becomes device 0 here
                # (before anything, an import included, initialises CUDA; the children keep the
                # original list).
                os.environ["CUDA_VISIBLE_DEVICES"] = rank0
            self.spawn(self._preload_trainer)
            # after CUDA_VISIBLE_DEVICES is narrowed (the check may ask torch about CUDA)
            await self._check_shm()
        else:
            self._preloaded.set()
        ins = self.spec_inputs()
        if self.cfg.api.enabled and head:  # the other nodes' environments post to the head's API
            self.notifier.extend_timeout(API_READY_TIMEOUT + 10)
            await self._until_ready(self.add_unit(specs.api_spec(ins)))
        if self.cfg.inference.enabled:
            # Every replica starts at once; READY waits for each (its health and one generation).
            self.notifier.extend_timeout(self.cfg.inference.ready_timeout + 10)
            replicas = [
                self.add_unit(spec, on_ready=self._inference_ready(i))
                for i, spec in enumerate(specs.inference_specs(ins))
            ]
            for unit in replicas:
                await self._until_ready(unit)
        if self.cfg.trainer.enabled and head:
            await self._start_trainer()
        # (another node's trainer ranks start when the head forms its group: NodeLink)
        envs = [self.add_unit(spec) for e in self.cfg.env for spec in specs.env_specs(ins, e)]
        if envs:
            self.notifier.extend_timeout(max(u.spec.ready_timeout for u in envs) + 10)
        for unit in envs:
            await unit.settled.wait()

    async def _open_cluster(self) -> None:
        """Head: open the cluster endpoint before any child. Another node: wait for the head and
        join it, then heartbeat for as long as the node runs (SPEC §12.3)."""
        from atroposd.daemon.cluster import HeadLink, NodeLink

        assert self._tg is not None
        if self.cfg.is_head:
            self.head = HeadLink(self)
            self.fleet.nodes = self.head  # the head reaches the other nodes' ranks through its link
        else:
            self.node_link = NodeLink(self)
        await self._tg.start(self.cluster.run, name="cluster link")

    async def _resolve_model(self) -> None:
        from atroposd.models.resolve import resolve_model, resolve_tokenizer

        self.set_status("resolving the model")
        self.notifier.extend_timeout(MODEL_RESOLVE_TIMEOUT)
        try:
            model = await anyio.to_thread.run_sync(resolve_model, self.cfg)
            tokenizer = await anyio.to_thread.run_sync(resolve_tokenizer, self.cfg)
        except ValueError as exc:
            raise StartFailed(str(exc)) from None
        except Exception as exc:  # a full disk or an unwritable state_dir while building builtin:tiny
            raise StartFailed(
                f"cannot prepare the model under {self.cfg.state_dir}: {type(exc).__name__}: {exc}"
            ) from None
        self.model_path, self.tokenizer_path = str(model), str(tokenizer)

    async def _check_shm(self) -> None:
        """/dev/shm must hold what the weight sync puts there (a container's is 64 MB unless
        given more): refused when it never can, warned about when only its free space is short."""
        from atroposd.weights.shmspace import check_shm, shm_need

        def verdict_of() -> ShmVerdict | None:
            need = shm_need(self.cfg, Path(self.model_path))
            return check_shm(need) if need is not None else None

        try:
            verdict = await anyio.to_thread.run_sync(verdict_of)
        except ValueError as exc:  # a device that cannot be used here: the trainer says so too
            log.warning("/dev/shm's room for the weight sync not checked", reason=str(exc))
            return
        if verdict is None:
            return
        if verdict.level == "refuse":
            raise StartFailed(verdict.message)
        log.warning("/dev/shm is short", problem=verdict.message)

    async def _until_ready(self, unit: Unit) -> None:
        self.set_status(f"starting {unit.name}")
        await unit.wait_until(lambda u: u.state in (State.READY, State.FAILED, State.STOPPED) and u.settled.is_set())
        if unit.state != State.READY:
            raise StartFailed(f"{unit.name} did not become ready: {unit.last_error or unit.state.value}")

    async def _preload_trainer(self) -> None:
        try:
            await anyio.to_thread.run_sync(_preload_trainer, self.model_path, abandon_on_cancel=True)
        finally:
            self._preloaded.set()

    async def _start_trainer(self) -> None:
        await self._preloaded.wait()
        from atroposd.trainer.service import TrainerService
        from atroposd.weights.sync import make_weight_sync

        self.set_status("starting the trainer")
        self.notifier.extend_timeout(self.cfg.inference.ready_timeout + API_READY_TIMEOUT)
        inf = self.cfg.inference
        socks = [self.paths.inference_socket(inf.port + i) for i in range(inf.replicas)] if inf.enabled else []
        # Watched: the stall watchdog sees a weight sync in flight (the stage "weight_sync").
        t = self.cfg.trainer
        # Several ranks: the weights stream bucket by bucket from rank 0's gathers (SPEC §12.1).
        self.weights = WatchedSync(
            make_weight_sync(
                self.cfg,
                nonce=self.nonce,
                control_sockets=socks,
                bucketed=t.ranks > 1,
                bucket_bytes=t.sync_bucket_mb << 20,
                source_for=self._weight_source,
            )
        )
        fleet = None
        if self.cfg.trainer.ranks > 1:
            fleet = await self._open_fleet()
        self.trainer = TrainerService(
            self.cfg,
            instance=self.nonce,
            weights=self.weights,
            envs_alive=self.envs_alive,
            fleet=fleet,
            replica_generations=self.replica_health.generations,
            restart_replica=self.restart_replica if inf.enabled else None,
            # several machines: the head's sentinel reaches the other nodes' replicas
            remote_replicas=self.head.remote_replicas if self.head is not None else None,
        )
        assert self._tg is not None
        await self._tg.start(self._run_trainer, self.trainer)
        status = self.trainer.status()
        if status.get("state") == "failed":
            raise StartFailed(f"trainer: {status.get('error')}")

    def _weight_source(self, model: torch.nn.Module) -> TensorSource:
        """What the weight sync sends of ``model``: the trainer's source (with several ranks the
        weights gathered from every rank; :meth:`TrainerService.weight_source`)."""
        assert self.trainer is not None
        return self.trainer.weight_source(model)

    async def _open_fleet(self) -> Fleet:
        """Trainer ranks 1..N-1 (SPEC §12.1): the store the group meets through (on a socket bound
        here, loopback) and the rank processes, started and stopped by the trainer."""
        # NCCL's variables set, overriding the environment; gloo's interface only defaulted.
        os.environ.update(specs.trainer_group_env(self.cfg, os.environ))
        # Several machines: on the head's cluster.port + 1, every node's ranks connect to it.
        self.group_store = await self.fleet.open(self.cfg.trainer.ranks)
        return self.fleet

    async def _run_trainer(
        self, trainer: TrainerService, *, task_status: anyio.abc.TaskStatus[Any] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            with anyio.CancelScope() as scope:
                self._trainer_scope = scope
                outcome = await trainer.run(task_status=task_status)
                self._trainer_outcome = outcome
                self._events_send.send_nowait(TrainerEnded(outcome))
        finally:
            self._trainer_done.set()

    def _inference_ready(self, replica: int) -> Callable[[Unit, bool], Awaitable[None]]:
        """The ready hook of inference replica ``replica``."""

        async def hook(unit: Unit, restarted: bool) -> None:
            # A restarted replica (--await-weights) gets the trainer's current weights before it serves.
            if restarted and self.trainer is not None:
                await self.trainer.on_inference_restarted(replica)
            elif restarted and self.node_link is not None:
                self.node_link.replica_restarted(replica)  # a node's: the head pushes through its first rank

        return hook

    async def restart_replica(self, replica: int, reason: str) -> bool:
        """Restart inference replica ``replica`` (the sentinel's, SPEC §15) and return once it is
        ready again — its ready hook gave it the trainer's current weights first — (True), or
        once it failed, stopped or took longer than its ready timeout or half of stall_timeout
        (False)."""
        unit = self.units.get(specs.inference_name(self.cfg, replica))
        if unit is None:
            return False
        before = unit.restarts
        if not unit.declare_hung(reason):
            log.warning("replica not restarted: it is not running and ready", unit=unit.name, state=unit.state.value)
            return False

        def settled(u: Unit) -> bool:
            return (u.restarts > before and u.state == State.READY) or u.state in (State.FAILED, State.STOPPED)

        limit = self.cfg.daemon.stop_timeout + self.cfg.inference.ready_timeout + 60.0
        if self.cfg.trainer.stall_timeout > 0:
            # the step waits for it: never long enough for the stall watchdog to end the job (a
            # replica ready later gets the weights from its ready hook all the same)
            limit = min(limit, self.cfg.trainer.stall_timeout / 2)
        with anyio.move_on_after(limit):
            await unit.wait_until(settled)
        ready = unit.state == State.READY and unit.restarts > before
        log.info(
            "replica restarted" if ready else "replica not back after its restart",
            unit=unit.name,
            replica=replica,
            state=unit.state.value,
        )
        return ready

    def envs_alive(self) -> bool:
        """Any environment alive or still restartable (the trainer's data_timeout rule)."""
        return any(u.kind == "env" and u.state not in (State.FAILED, State.STOPPED) for u in self.units.values())

    def add_unit(self, spec: UnitSpec, **kw: Any) -> Unit:
        assert self._hub is not None and self._tg is not None
        if self.sandbox is not None and spec.kind == "env":
            spec.on_exit = self.sandbox.attach(spec.name, self.spawn)  # its socket exists before it starts
        unit = Unit(spec, logs=self._hub, on_change=self._unit_changed, **kw)
        self.units[spec.name] = unit
        self._tg.start_soon(unit.supervise, name=f"unit {spec.name}")
        return unit

    def _unit_changed(self, unit: Unit) -> None:
        self._events_send.send_nowait(UnitChanged(unit))

    # ------------------------------------------------------------------ running

    async def _serve(self) -> Exit:
        """The reconciler: apply events until the job ends; returns the exit code."""
        async for event in self._events:
            if isinstance(event, StopRequested):
                log.info("stopping", reason=event.reason)
                return self._stop_code
            if isinstance(event, TrainerEnded):
                code = Exit(event.outcome.exit_code)
                log.info("trainer ended", state=str(event.outcome.state), code=int(code))
                return code
            if isinstance(event, ReloadRequested):
                event.reply.set(await self._reload())
                continue
            if isinstance(event, StallUnresolved):
                self._stall_exit = event.reason
                log.error("job fails: the trainer's stall was not resolved", reason=event.reason)
                return Exit.RUNTIME
            unit = event.unit
            if unit.kind == "trainer":
                self.fleet.unit_changed(unit)  # a rank's exit: a fault on the fleet's stream
                continue  # a rank's exit restarts the trainer group: the trainer's state shows it
            if unit.kind in ("api", "inference") and unit.state == State.FAILED and self.units.get(unit.name) is unit:
                log.error("job fails: a required component failed", unit=unit.name, error=unit.last_error)
                return Exit.RUNTIME
            self._update_degraded()
        return Exit.RUNTIME

    def _update_degraded(self) -> None:
        if self.state.serving:
            failed = [u.name for u in self.units.values() if u.state == State.FAILED and u.kind != "trainer"]
            new = DaemonState.DEGRADED if failed else DaemonState.RUNNING
            if new != self.state:
                self._move(new, f"failed: {', '.join(failed)}" if failed else "no component failed")
            self.notifier.status(status_mod.status_line(self))

    def request_stop(self, reason: str, code: Exit = Exit.OK, *, by: float | None = None) -> None:
        """Desired state: stopped.  SIGTERM, SIGINT and ``atroposd stop`` all come here; a node
        that lost its head stops with ``code`` 1, every child gone ``by`` then (``time.monotonic()``;
        each child's stop_timeout shortened to what is left)."""
        if not self._stop_requested:
            self._stop_requested = True
            self._stop_code = code
            self._stop_by = by
            if self._start_scope is not None:
                self._start_scope.cancel()
        self._events_send.send_nowait(StopRequested(reason))

    async def _signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                name = reaper.signal_name(signum)
                log.info("signal received", signal=name)
                if signum == signal.SIGHUP:
                    self._events_send.send_nowait(ReloadRequested())
                else:
                    self.request_stop(name)

    async def _track_loop(self) -> None:
        """Every 0.5 s: record descendants, reap adopted orphans, update the recovery record."""
        while True:
            units = list(self.units.values())
            # a scan of the process table (tens of ms on a busy machine) in a worker thread: the
            # loop meanwhile serves the control socket, the environments' engine sockets, probes
            roots = [u.pid for u in units if u.pid is not None]
            tree = await anyio.to_thread.run_sync(reaper.descendant_map, roots)
            for unit in units:
                unit.rescan(tree.get(unit.pid, []) if unit.pid is not None else [])
            own = {u.pid for u in self.units.values() if u.pid is not None}
            adopted = {pid for u in self.units.values() for pid in u.tracked}
            for pid, status in self._reaper.reap(own=own, adopted=adopted):
                log.debug("reaped an adopted orphan", pid=pid, status=status)
            self._record.update(self.units.values())
            self.cluster.report()
            await anyio.sleep(TRACK_INTERVAL)

    async def _status_loop(self) -> None:
        while True:
            await anyio.sleep(STATUS_INTERVAL)
            if self.state.serving:
                self.notifier.status(status_mod.status_line(self))

    def _start_watchdog(self) -> None:
        if self.trainer is None or self._tg is None:
            return
        weights = self.weights if isinstance(self.weights, WatchedSync) else None
        self.watchdog = StallWatchdog(
            self.cfg,
            trainer=self.trainer,
            units=self.units,
            board=self.board,
            weights=weights,
            on_unresolved=self._stall_unresolved,
        )
        self._tg.start_soon(self.watchdog.run, name="stall watchdog")

    def _stall_unresolved(self, reason: str) -> None:
        self._events_send.send_nowait(StallUnresolved(reason))

    def _exit_without_trainer(self, code: int, pid_fd: int) -> None:
        """The trainer's compute thread never returned (a stall the daemon could not resolve):
        no thread can be cancelled, so the process ends here, its files cleaned up first."""
        log.error("the trainer's compute thread does not return; the daemon exits without it", code=int(code))
        if self._hub is not None:
            self._hub.close()
        self._clean_files()
        for path in (self.paths.control_socket, self.paths.runtime_dir / heartbeat.SOCKET_NAME):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        log.info("daemon exits", code=int(code))
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os.close(pid_fd)
        os._exit(int(code))

    def set_status(self, text: str) -> None:
        log.info(text)
        self.notifier.status(text)

    # ------------------------------------------------------------------ reload

    async def _reload(self) -> dict[str, Any]:
        """SPEC §6: environments change live; anything else is refused and nothing changes."""
        source = self.cfg.source
        if source.startswith("<"):
            return {
                "ok": False,
                "code": int(Exit.USAGE),
                "error": "the daemon runs on the built-in defaults: no config file to re-read",
            }
        try:
            new = await anyio.to_thread.run_sync(load_config, source)
        except ConfigError as exc:
            log.error("reload refused: invalid config; the running config is kept", error=str(exc))
            return {"ok": False, "code": int(Exit.USAGE), "error": f"{exc}\nthe running configuration is kept"}
        try:
            new.api.token = new.api.bearer_token()  # compared as in force, like the running one
            new.inference.token = new.inference_token()
        except (TokenError, ClusterError) as exc:
            return {"ok": False, "code": int(Exit.USAGE), "error": f"{exc}\nthe running configuration is kept"}
        plan = plan_reload(self.cfg, new)
        if not plan.ok:
            log.error("reload refused", keys=list(plan.refused))
            return {"ok": False, "code": int(Exit.USAGE), "error": plan.refusal()}
        old_envs = self.cfg.env
        self.cfg = new
        self._write_child_config()
        rank = self.cfg.node_rank
        gone = [u for u in self.units.values() if u.kind == "env" and env_of(u.name, old_envs, rank) in plan.stop]
        await self.stop_units(gone)
        for u in gone:
            if self.units.get(u.name) is u:
                del self.units[u.name]
            if self.sandbox is not None:
                await self.sandbox.detach(u.name)  # its engine socket goes with it
        ins = self.spec_inputs()
        new_envs = {e.name: e for e in new.env}
        for name in plan.start:
            for spec in specs.env_specs(ins, new_envs[name]):
                self.add_unit(spec)
        added, removed, changed = list(plan.added), list(plan.removed), list(plan.changed)
        log.info("reloaded", added=added, removed=removed, changed=changed)
        self._update_degraded()
        return {"ok": True, "added": added, "removed": removed, "changed": changed}

    # ------------------------------------------------------------------ control

    async def _control(self, request: dict[str, Any]) -> dict[str, Any]:
        cmd = request.get("cmd")
        if cmd == "status":
            node = request.get("node")
            if node is not None and (not isinstance(node, int) or isinstance(node, bool) or node < 0):
                return {"ok": False, "error": f"node must be a node rank (an integer >= 0), got {node!r}"}
            # cut to what the control frame carries, with a note (SPEC §13)
            return {"ok": True, "status": status_mod.fit_status(await self.status(), ANSWER_LIMIT, node=node)}
        if cmd == "stop":
            self.request_stop("stop command")
            return {"ok": True, "pid": self.pid, "start_time": self.start_time}
        if cmd == "reload":
            event = ReloadRequested(Reply())
            self._events_send.send_nowait(event)
            await event.reply.done.wait()
            return event.reply.value
        if cmd == "ping":
            return {"ok": True, "pid": self.pid, "start_time": self.start_time, "state": self.state.value}
        return {"ok": False, "error": f"unknown command {cmd!r}"}

    async def status(self) -> dict[str, Any]:
        """The object of ``status --json`` (SPEC §2)."""
        return await status_mod.status(self)

    # ------------------------------------------------------------------ stop

    async def _stop_all(self) -> None:
        """Trainer (checkpoint), then environments, inference, API: each bounded by its timeout."""
        self._move(DaemonState.STOPPING, "start failed" if self.start_error else "stop")
        if self.watchdog is not None:
            self.watchdog.stop()
        c = self.cfg.daemon
        self.notifier.stopping("stopping")
        self.notifier.extend_timeout(c.checkpoint_timeout + 3 * c.stop_timeout + 10)
        if self.trainer is not None and not self._trainer_done.is_set():
            self.trainer.request_stop()
            # A stalled trainer cannot write a checkpoint: the last complete one is where the
            # next start resumes.
            with anyio.move_on_after(5 if self._stall_exit else c.checkpoint_timeout + 5):
                await self._trainer_done.wait()
            if not self._trainer_done.is_set() and self._trainer_scope is not None:
                log.error("trainer did not stop within checkpoint_timeout; abandoning it")
                self._trainer_scope.cancel()
                with anyio.move_on_after(5):
                    await self._trainer_done.wait()
        # The head: every other node stops (its ranks, environments, replicas) and confirms.
        if self.head is not None:
            await self.head.stop_nodes()
        for kind in ("trainer", "env", "inference", "api"):
            await self.stop_units([u for u in self.units.values() if u.kind == kind])
            if kind == "env" and self.sandbox is not None:
                await self.sandbox.close()  # every object labelled with the job (SPEC §16)
        self.stopped.set()
        await self.cluster.close()
        if self.group_store is not None:
            self.group_store.close()
        if self.weights is not None:
            try:
                self.weights.close()
            except Exception:
                log.exception("weight sync close failed")
        self._remove_own_segments()

    def _remove_own_segments(self) -> None:
        """What a child killed before its own clean-up left of this launch (another node's first
        trainer rank, stopped with SIGTERM, owns its staging buffer): every child is gone now,
        and a segment something still maps is kept."""
        from atroposd.weights.shm import cleanup_stale

        try:
            removed = cleanup_stale(self.paths.runtime_dir, lambda nonce: nonce != self.nonce)
        except Exception:
            log.exception("removing this launch's left-over weight segments failed")
            return
        if removed:
            log.info("removed weight segments and manifests this launch's children left", removed=removed)

    async def stop_units(self, units: list[Unit]) -> None:
        for u in units:
            u.request_stop(by=self._stop_by)
        for u in units:
            await u.done.wait()

    def _write_child_config(self) -> None:
        runtime.write_child_config(self.paths, self.nonce, self.cfg)

    def _clean_files(self) -> None:
        runtime.remove_child_config(self.paths, self.nonce)
        if all(u.done.is_set() for u in self.units.values()):
            self._record.remove()


def run_foreground(cfg: Config, notifier: Notifier) -> int:
    """``atroposd run``: the daemon in this process until the job ends."""
    daemon = Daemon(cfg, notifier=notifier)
    return int(anyio.run(daemon.main))


def _preload_trainer(model_path: str | None) -> None:
    """Import what the trainer's start needs (in a worker thread); nothing is loaded or checked."""
    import atroposd.trainer.loop
    import atroposd.trainer.service
    import atroposd.weights.sync  # noqa: F401

    if model_path:
        from atroposd.trainer.model import preload

        preload(Path(model_path))

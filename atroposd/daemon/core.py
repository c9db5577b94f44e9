"""The daemon: desired state, one reconciler, start order, signals, status (SPEC §4).

``Daemon.main()`` in order:

    lock the pidfile → child subreaper → clean up after a crashed daemon → control socket
      → start: API → inference (health + one generation) → trainer (first /batch) → environments
      → READY → serve events (stop, reload, component changes, trainer end) → stop in reverse

Signal handlers and control requests only put events on one queue (``_events``); the main task
applies them.  SIGTERM and ``atroposd stop`` take the same path.  Every child is a
:class:`~atroposd.process.unit.Unit`; the daemon never signals a process it did not start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import math
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import psutil

from atroposd.config import (
    Config,
    ConfigError,
    EnvConfig,
    dump_toml,
    fill_placeholders,
    load_config,
)
from atroposd.control import ControlServer
from atroposd.logs import get_logger
from atroposd.paths import Paths
from atroposd.pids import identity
from atroposd.process import reaper
from atroposd.process.logfiles import LogHub
from atroposd.process.probes import (
    HttpProbe,
    InferenceProbe,
    Probe,
    RegisteredProbe,
    StartedProbe,
    get_ok,
)
from atroposd.process.unit import State, Unit, UnitSpec
from atroposd.systemd import Notifier

log = get_logger("atroposd.daemon")

TRACK_INTERVAL = 0.5
SEGMENT_SCAN_TICKS = 10  # the children's /dev/shm mappings are recorded every 10 ticks (5 s)
STATUS_INTERVAL = 5.0
API_READY_TIMEOUT = 60.0
EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_ALREADY_RUNNING = 0, 1, 2, 4
_SYSTEMD_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")
_RESTARTABLE_SECTIONS = ("daemon", "api", "inference", "trainer")


class AlreadyRunning(Exception):
    def __init__(self, pidfile: Path, pid: int | None) -> None:
        self.pid = pid
        super().__init__(f"a daemon is already running for this config (pid {pid or '?'}, pidfile {pidfile})")


class StartFailed(Exception):
    """The job could not start; the message says which component and why."""


@dataclass
class _Event:
    kind: str  # stop | reload | unit | trainer
    payload: Any = None
    reply: Any = None  # a _Reply for reload


class _Reply:
    def __init__(self) -> None:
        self.done = anyio.Event()
        self.value: dict[str, Any] = {}

    def set(self, value: dict[str, Any]) -> None:
        self.value = value
        self.done.set()


# ----------------------------------------------------------------------------- pidfile


def lock_pidfile(path: Path) -> int:
    """An exclusive lock on ``path`` held for the daemon's life; raises AlreadyRunning."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            text = os.read(fd, 64).decode().strip()
        finally:
            os.close(fd)
        raise AlreadyRunning(path, int(text) if text.isdigit() else None) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def read_pidfile(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


# ----------------------------------------------------------------------------- ports


def port_owner(port: int) -> str:
    """Who listens on ``port``, as far as this user can see ('' if unknown)."""
    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.Error, OSError):
        return ""
    for c in conns:
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
            try:
                proc = psutil.Process(c.pid)
                return f"pid {c.pid} ({' '.join(proc.cmdline())[:120] or proc.name()})"
            except psutil.Error:
                return f"pid {c.pid}"
    return ""


def check_port(host: str, port: int, what: str) -> None:
    """Raise StartFailed if ``host:port`` cannot be bound (never touches whoever holds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise StartFailed(f"{what}: cannot bind {host}:{port}: {exc.strerror or exc}") from None
            owner = port_owner(port)
            raise StartFailed(f"{what}: port {port} on {host} is already in use"
                              + (f" by {owner}" if owner else " (owner not visible to this user)")) from None


# ----------------------------------------------------------------------------- the daemon


class Daemon:
    def __init__(self, cfg: Config, *, notifier: Notifier | None = None) -> None:
        self.cfg = cfg
        self.paths = Paths.of(cfg)
        self.nonce = secrets.token_hex(6)
        self.notifier = notifier or Notifier()
        self.state = "starting"
        self.pid = os.getpid()
        self.start_time = psutil.Process().create_time()
        self._t0 = time.monotonic()
        self.units: dict[str, Unit] = {}
        self.trainer: Any = None
        self.weights: Any = None
        self.model_path: str = cfg.inference.model
        self.tokenizer_path: str = cfg.inference.tokenizer or cfg.inference.model
        self.start_error: str | None = None
        self._events_send, self._events = anyio.create_memory_object_stream[_Event](math.inf)
        self._stop_requested = False
        self._start_scope: anyio.CancelScope | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._hub: LogHub | None = None
        self._trainer_done = anyio.Event()
        self._trainer_scope: anyio.CancelScope | None = None
        self._trainer_outcome: Any = None
        self._reaper = reaper.OrphanReaper()
        self._record_key: tuple[tuple[int, float], ...] = ()
        self._record_segments: tuple[str, ...] = ()
        self._segment_ticks = 0
        self._identities: dict[int, psutil.Process] = {}
        # Children start from the environment the daemon was given (before any narrowing of
        # CUDA_VISIBLE_DEVICES for the in-process trainer).
        self._base_env = {k: v for k, v in os.environ.items() if k not in _SYSTEMD_VARS}

    # ------------------------------------------------------------------ entry

    async def main(self) -> int:
        """Run the job until it ends; the exit code of SPEC §2."""
        self._prepare_dirs()
        pid_fd = lock_pidfile(self.paths.pidfile)
        try:
            reaper.set_child_subreaper()
            self._recover()
            self._write_record()
            self._write_child_config()
            self._hub = LogHub(self.paths.logs_dir, max_bytes=self.cfg.daemon.log_max_bytes,
                               backups=self.cfg.daemon.log_backups)
            try:
                self._check_ports()  # before anything binds (the metrics server included)
            except StartFailed as exc:
                log.error("start failed", reason=str(exc))
                return EXIT_RUNTIME
            control = ControlServer(self.paths.control_socket, self._control, socket_group=self.cfg.daemon.socket_group)
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._signals)
                await tg.start(control.serve)
                tg.start_soon(self._track_loop)
                tg.start_soon(self._status_loop)
                tg.start_soon(self.notifier.watchdog_loop)
                if self.cfg.daemon.metrics_port:
                    await tg.start(self._serve_metrics)
                code = await self._lifecycle()
                tg.cancel_scope.cancel()
            log.info("daemon exits", code=code)
            return code
        finally:
            if self._hub is not None:
                self._hub.close()
            self._clean_files()
            os.close(pid_fd)

    def _prepare_dirs(self) -> None:
        rt = self.paths.runtime_dir
        rt.mkdir(mode=0o700, parents=True, exist_ok=True)
        if rt.stat().st_uid == os.getuid():
            rt.chmod(0o700)
        for d in (self.paths.state_dir, self.paths.logs_dir, self.paths.recovery_dir):
            d.mkdir(parents=True, exist_ok=True)

    async def _lifecycle(self) -> int:
        code = EXIT_RUNTIME
        try:
            with anyio.CancelScope() as scope:
                self._start_scope = scope
                await self._start_all()
            self._start_scope = None
            if scope.cancelled_caught:
                log.info("start abandoned: stop requested")
                code = EXIT_OK
            else:
                self._set_state("running")
                self.notifier.ready(self._status_line())
                log.info("READY", seconds=round(time.monotonic() - self._t0, 3), instance=self.nonce)
                code = await self._serve()
        except StartFailed as exc:
            self.start_error = str(exc)
            log.error("start failed", reason=str(exc))
            code = EXIT_RUNTIME
        except Exception as exc:
            # A bug or an unexpected environment problem: stop everything cleanly, exit 1.
            self.start_error = f"{type(exc).__name__}: {exc}"
            log.exception("start failed", reason=self.start_error)
            code = EXIT_RUNTIME
        finally:
            with anyio.CancelScope(shield=True):
                await self._stop_all()
        return code

    # ------------------------------------------------------------------ start

    async def _start_all(self) -> None:
        if self.cfg.inference.enabled or self.cfg.trainer.enabled:
            await self._resolve_model()
            self._write_child_config()
        if self.cfg.api.enabled:
            self.notifier.extend_timeout(API_READY_TIMEOUT + 10)
            await self._until_ready(self._add_unit(self._api_spec()))
        if self.cfg.inference.enabled:
            self.notifier.extend_timeout(self.cfg.inference.ready_timeout + 10)
            await self._until_ready(self._add_unit(self._inference_spec(), on_ready=self._inference_ready))
        if self.cfg.trainer.enabled:
            await self._start_trainer()
        envs = [self._add_unit(spec) for e in self.cfg.env for spec in self._env_specs(e)]
        if envs:
            self.notifier.extend_timeout(max(u.spec.ready_timeout for u in envs) + 10)
        for unit in envs:
            await unit.settled.wait()

    def _check_ports(self) -> None:
        c = self.cfg
        if c.api.enabled:
            check_port(c.api.host, c.api.port, "api.port")
        if c.inference.enabled:
            check_port(c.inference.host, c.inference.port, "inference.port")
        if c.daemon.metrics_port:
            check_port("127.0.0.1", c.daemon.metrics_port, "daemon.metrics_port")
        for i, e in enumerate(c.env):
            if e.port_base:
                for r in range(e.replicas):
                    check_port("127.0.0.1", e.port_base + r, f"env[{i}].port_base")

    async def _resolve_model(self) -> None:
        from atroposd.models.resolve import resolve_model, resolve_tokenizer

        self._set_status("resolving the model")
        # Building builtin:tiny or reading a large model can take minutes on a first start.
        self.notifier.extend_timeout(600)
        try:
            model = await anyio.to_thread.run_sync(resolve_model, self.cfg)
            tokenizer = await anyio.to_thread.run_sync(resolve_tokenizer, self.cfg)
        except ValueError as exc:
            raise StartFailed(str(exc)) from None
        except Exception as exc:  # a full disk or an unwritable state_dir while building builtin:tiny
            raise StartFailed(f"cannot prepare the model under {self.cfg.state_dir}: "
                              f"{type(exc).__name__}: {exc}") from None
        self.model_path, self.tokenizer_path = str(model), str(tokenizer)

    async def _until_ready(self, unit: Unit) -> None:
        self._set_status(f"starting {unit.name}")
        await unit.wait_until(lambda u: u.state in (State.READY, State.FAILED, State.STOPPED) and u.settled.is_set())
        if unit.state != State.READY:
            raise StartFailed(f"{unit.name} did not become ready: {unit.last_error or unit.state.value}")

    async def _start_trainer(self) -> None:
        from atroposd.trainer.service import TrainerService
        from atroposd.weights.sync import make_weight_sync

        self._set_status("starting the trainer")
        if self.cfg.trainer.device.startswith("GPU-"):
            # The trainer runs in this process: its GPU, named by UUID, becomes device 0 here
            # (before anything initialises CUDA; the children keep the original list).
            os.environ["CUDA_VISIBLE_DEVICES"] = self.cfg.trainer.device
        self.notifier.extend_timeout(self.cfg.inference.ready_timeout + API_READY_TIMEOUT)
        sock = self.paths.inference_socket(self.cfg.inference.port) if self.cfg.inference.enabled else None
        self.weights = make_weight_sync(self.cfg, nonce=self.nonce, control_socket=sock)
        self.trainer = TrainerService(self.cfg, instance=self.nonce, weights=self.weights,
                                      envs_alive=self.envs_alive)
        assert self._tg is not None
        await self._tg.start(self._run_trainer)
        status = self.trainer.status()
        if status.get("state") == "failed":
            raise StartFailed(f"trainer: {status.get('error')}")

    async def _run_trainer(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            with anyio.CancelScope() as scope:
                self._trainer_scope = scope
                outcome = await self.trainer.run(task_status=task_status)
                self._trainer_outcome = outcome
                self._events_send.send_nowait(_Event("trainer", outcome))
        finally:
            self._trainer_done.set()

    async def _inference_ready(self, unit: Unit, restarted: bool) -> None:
        # A restarted server (--await-weights) gets the trainer's current weights before it serves.
        if restarted and self.trainer is not None:
            await self.trainer.on_inference_restarted()

    def envs_alive(self) -> bool:
        """Any environment alive or still restartable (the trainer's data_timeout rule)."""
        return any(u.kind == "env" and u.state not in (State.FAILED, State.STOPPED) for u in self.units.values())

    # ------------------------------------------------------------------ specs

    def _child_env(self, values: dict[str, str]) -> dict[str, str]:
        env = dict(self._base_env)
        env.update({f"ATROPOSD_{k.upper()}": v for k, v in values.items()})
        env["ATROPOSD_INSTANCE"] = self.nonce
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _values(self, *, name: str = "", replica: int = 0, env: EnvConfig | None = None) -> dict[str, str]:
        c = self.cfg
        return {
            "api_url": c.api_url, "inference_url": c.inference_url, "openai_url": c.inference_url + "/v1",
            "model": self.model_path, "tokenizer": self.tokenizer_path,
            "group_size": str(env.group_size if env else 0), "max_token_len": str(c.trainer.max_token_len),
            "steps": str(c.trainer.steps), "name": name, "replica": str(replica),
            "seed": str(c.trainer.seed + replica),
            "replica_port": str(env.port_base + replica) if env and env.port_base else "",
        }

    def _atroposd(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "atroposd", *args]

    @property
    def _child_config(self) -> str:
        return str(self.paths.child_config(self.nonce))

    def _api_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.cfg.api.token}"} if self.cfg.api.token else {}

    def _api_spec(self) -> UnitSpec:
        c = self.cfg
        values = self._values(name="api")
        if c.api.command:
            argv = fill_placeholders(c.api.command, {**values, "port": str(c.api.port)})
        else:
            argv = self._atroposd("api", "-c", self._child_config)
        values.pop("group_size")
        return UnitSpec(name="api", kind="api", argv=argv, env=self._child_env(values),
                        probe=HttpProbe(f"{c.api_url}/info", self._api_headers()), ready_timeout=API_READY_TIMEOUT,
                        stop_timeout=c.daemon.stop_timeout)

    def _inference_spec(self) -> UnitSpec:
        c = self.cfg
        sock = self.paths.inference_socket(c.inference.port)
        argv = self._atroposd("inference", "-c", self._child_config, "--control-socket", str(sock))
        if c.trainer.enabled and c.weight_sync in ("shared", "push"):
            argv.append("--await-weights")
        env = self._child_env(self._values(name="inference"))
        if c.inference.device.startswith(("GPU-", "MIG-")):
            # A GPU named by UUID is device 0 in the child (cuda:N keeps the daemon's numbering).
            env["CUDA_VISIBLE_DEVICES"] = c.inference.device
        # SIGTERM on the daemon's death: the server shuts its engine (and its process group) down.
        return UnitSpec(name="inference", kind="inference", argv=argv, env=env,
                        probe=InferenceProbe(c.inference_url, sock), ready_timeout=c.inference.ready_timeout,
                        stop_timeout=c.daemon.stop_timeout, death_signal=signal.SIGTERM)

    def _env_specs(self, e: EnvConfig) -> list[UnitSpec]:
        specs = []
        sig = e.stop_signal.upper()
        stop_signal = signal.Signals[sig if sig.startswith("SIG") else "SIG" + sig]
        for i, name in enumerate(e.replica_names()):
            values = self._values(name=name, replica=i, env=e)
            if e.command:
                argv = fill_placeholders(e.command, values)
            else:
                argv = self._atroposd("env", e.builtin, "-c", self._child_config, "--name", name, "--replica", str(i))
            probe: Probe = StartedProbe(e.start_seconds)
            if e.ready == "registered":
                names = (name, e.name) if e.replicas == 1 else (name,)
                probe = RegisteredProbe(self.cfg.api_url, names, fallback=StartedProbe(e.start_seconds),
                                        headers=self._api_headers())
            specs.append(UnitSpec(name=name, kind="env", argv=argv, env=self._child_env(values), probe=probe,
                                  ready_timeout=e.ready_timeout, stop_timeout=self.cfg.daemon.stop_timeout,
                                  stop_signal=stop_signal, restart=e.restart, max_restarts=e.max_restarts,
                                  restart_window=e.restart_window))
        return specs

    def _add_unit(self, spec: UnitSpec, **kw: Any) -> Unit:
        assert self._hub is not None and self._tg is not None
        unit = Unit(spec, logs=self._hub, on_change=self._unit_changed, **kw)
        self.units[spec.name] = unit
        self._tg.start_soon(unit.supervise, name=f"unit {spec.name}")
        return unit

    def _unit_changed(self, unit: Unit) -> None:
        self._events_send.send_nowait(_Event("unit", unit))

    # ------------------------------------------------------------------ running

    async def _serve(self) -> int:
        """The reconciler: apply events until the job ends; returns the exit code."""
        async for event in self._events:
            if event.kind == "stop":
                log.info("stopping", reason=event.payload)
                return EXIT_OK
            if event.kind == "trainer":
                code = int(getattr(event.payload, "exit_code", EXIT_RUNTIME))
                log.info("trainer ended", state=getattr(event.payload, "state", None), code=code)
                return code
            if event.kind == "reload":
                event.reply.set(await self._reload())
                continue
            unit: Unit = event.payload
            if unit.kind in ("api", "inference") and unit.state == State.FAILED and self.units.get(unit.name) is unit:
                log.error("job fails: a required component failed", unit=unit.name, error=unit.last_error)
                return EXIT_RUNTIME
            self._update_degraded()
        return EXIT_RUNTIME

    def _update_degraded(self) -> None:
        if self.state in ("running", "degraded"):
            failed = any(u.state == State.FAILED for u in self.units.values())
            new = "degraded" if failed else "running"
            if new != self.state:
                self._set_state(new)
            self.notifier.status(self._status_line())

    def request_stop(self, reason: str) -> None:
        """Desired state: stopped.  SIGTERM, SIGINT and ``atroposd stop`` all come here."""
        if not self._stop_requested:
            self._stop_requested = True
            if self._start_scope is not None:
                self._start_scope.cancel()
        self._events_send.send_nowait(_Event("stop", reason))

    async def _signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                name = reaper.signal_name(signum)
                log.info("signal received", signal=name)
                if signum == signal.SIGHUP:
                    self._events_send.send_nowait(_Event("reload", reply=_Reply()))
                else:
                    self.request_stop(name)

    async def _track_loop(self) -> None:
        """Every 0.5 s: record descendants, reap adopted orphans, update the recovery record."""
        while True:
            units = list(self.units.values())
            tree = reaper.descendant_map(u.pid for u in units if u.pid is not None)
            for unit in units:
                unit.rescan(tree.get(unit.pid, []) if unit.pid is not None else [])
            own = {u.pid for u in self.units.values() if u.pid is not None}
            adopted = {pid for u in self.units.values() for pid in u.tracked}
            for pid, status in self._reaper.reap(own=own, adopted=adopted):
                log.debug("reaped an adopted orphan", pid=pid, status=status)
            self._write_record()
            await anyio.sleep(TRACK_INTERVAL)

    async def _status_loop(self) -> None:
        while True:
            await anyio.sleep(STATUS_INTERVAL)
            if self.state in ("running", "degraded"):
                self.notifier.status(self._status_line())

    # ------------------------------------------------------------------ stop

    async def _stop_all(self) -> None:
        """Trainer (checkpoint), then environments, inference, API: each bounded by its timeout."""
        self._set_state("stopping")
        c = self.cfg.daemon
        self.notifier.stopping("stopping")
        self.notifier.extend_timeout(c.checkpoint_timeout + 3 * c.stop_timeout + 10)
        if self.trainer is not None and not self._trainer_done.is_set():
            self.trainer.request_stop()
            with anyio.move_on_after(c.checkpoint_timeout + 5):
                await self._trainer_done.wait()
            if not self._trainer_done.is_set() and self._trainer_scope is not None:
                log.error("trainer did not stop within checkpoint_timeout; abandoning it")
                self._trainer_scope.cancel()
                with anyio.move_on_after(5):
                    await self._trainer_done.wait()
        for kind in ("env", "inference", "api"):
            await self._stop_units([u for u in self.units.values() if u.kind == kind])
        if self.weights is not None:
            try:
                self.weights.close()
            except Exception:
                log.exception("weight sync close failed")

    async def _stop_units(self, units: list[Unit]) -> None:
        for u in units:
            u.request_stop()
        for u in units:
            await u.done.wait()

    def _clean_files(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.paths.child_config(self.nonce).unlink()
        if all(u.done.is_set() for u in self.units.values()):
            with contextlib.suppress(FileNotFoundError):
                (self.paths.recovery_dir / "instance.json").unlink()

    # ------------------------------------------------------------------ recovery

    def _recover(self) -> None:
        """Before anything else: terminate what a crashed daemon left, remove its files."""
        record = reaper.recover_dead_instance(self.paths.recovery_dir / "instance.json")
        rt = self.paths.runtime_dir
        # We hold the pidfile lock: every socket and child config here belongs to a dead daemon.
        for path in [*rt.glob("inference-*.sock"), *rt.glob("config-*.toml")]:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        if record is not None:
            dead = record.nonce
            seg_dir = Path("/dev/shm")
            has_segments = any(p.name.startswith(f"atroposd-{dead}-") for p in seg_dir.glob("atroposd-*"))
            if has_segments or (rt / "weights").is_dir():
                from atroposd.weights.shm import cleanup_stale

                removed = cleanup_stale(rt, lambda nonce: nonce != dead)
                if removed:
                    log.info("removed a dead daemon's weight segments and manifests", nonce=dead, removed=removed)

    def _write_record(self) -> None:
        entries: list[tuple[int, float]] = []
        for unit in self.units.values():
            procs = list(unit.tracked.values())
            if unit.pid is not None:
                proc = self._identities.get(unit.pid)
                if proc is None or proc.pid != unit.pid:
                    proc = identity(unit.pid)
                    if proc is not None:
                        self._identities[unit.pid] = proc
                if proc is not None:
                    procs.append(proc)
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    entries.append((p.pid, p.create_time()))
        key = tuple(sorted(set(entries)))
        # The segments the children map: read from /proc every few seconds (and when the set of
        # processes changes), not every tick: an engine's maps run to thousands of lines.
        self._segment_ticks = (self._segment_ticks + 1) % SEGMENT_SCAN_TICKS
        if key != self._record_key or self._segment_ticks == 0:
            mapped = reaper.mapped_shm(pids=[pid for pid, _ in key])
            segments = tuple(sorted(n for n in mapped if not n.startswith(reaper.OWN_SEGMENT_PREFIX)))
        else:
            segments = self._record_segments
        if (key, segments) == (self._record_key, self._record_segments) and \
                self.paths.recovery_dir.joinpath("instance.json").exists():
            return
        self._record_key, self._record_segments = key, segments
        reaper.write_record(self.paths.recovery_dir / "instance.json",
                            reaper.InstanceRecord(self.nonce, self.pid, self.start_time, list(key), list(segments)))

    def _write_child_config(self) -> None:
        path = self.paths.child_config(self.nonce)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(dump_toml(self.cfg))
        os.replace(tmp, path)

    # ------------------------------------------------------------------ reload

    async def _reload(self) -> dict[str, Any]:
        """SPEC §6: environments change live; anything else is refused and nothing changes."""
        source = self.cfg.source
        if source.startswith("<"):
            return {"ok": False, "code": EXIT_USAGE, "error": "the daemon runs on the built-in defaults: no "
                                                                 "config file to re-read"}
        try:
            new = await anyio.to_thread.run_sync(load_config, source)
        except ConfigError as exc:
            log.error("reload refused: invalid config; the running config is kept", error=str(exc))
            return {"ok": False, "code": EXIT_USAGE, "error": f"{exc}\nthe running configuration is kept"}
        fixed = _changed_keys(self.cfg, new)
        if fixed:
            msg = ("reload refused: these keys need a restart of the daemon: " + ", ".join(fixed)
                   + "; nothing was changed")
            log.error("reload refused", keys=fixed)
            return {"ok": False, "code": EXIT_USAGE, "error": msg}
        old_envs = {e.name: e for e in self.cfg.env}
        new_envs = {e.name: e for e in new.env}
        added = [n for n in new_envs if n not in old_envs]
        removed = [n for n in old_envs if n not in new_envs]
        changed = [n for n in new_envs if n in old_envs and new_envs[n] != old_envs[n]]
        self.cfg = new
        self._write_child_config()
        gone = [u for u in self.units.values() if u.kind == "env" and _env_of(u.name, old_envs) in {*removed, *changed}]
        await self._stop_units(gone)
        for u in gone:
            if self.units.get(u.name) is u:
                del self.units[u.name]
        for name in [*added, *changed]:
            for spec in self._env_specs(new_envs[name]):
                self._add_unit(spec)
        log.info("reloaded", added=added, removed=removed, changed=changed)
        self._update_degraded()
        return {"ok": True, "added": added, "removed": removed, "changed": changed}

    # ------------------------------------------------------------------ control

    async def _control(self, request: dict[str, Any]) -> dict[str, Any]:
        cmd = request.get("cmd")
        if cmd == "status":
            return {"ok": True, "status": await self.status()}
        if cmd == "stop":
            self.request_stop("stop command")
            return {"ok": True, "pid": self.pid, "start_time": self.start_time}
        if cmd == "reload":
            reply = _Reply()
            self._events_send.send_nowait(_Event("reload", reply=reply))
            await reply.done.wait()
            return reply.value
        if cmd == "ping":
            return {"ok": True, "pid": self.pid, "start_time": self.start_time, "state": self.state}
        return {"ok": False, "error": f"unknown command {cmd!r}"}

    async def status(self) -> dict[str, Any]:
        """The object of ``status --json`` (SPEC §2)."""
        components: list[dict[str, Any]] = []
        async with _session(1.5) as session:
            for kind, enabled, url in (("api", self.cfg.api.enabled, f"{self.cfg.api_url}/info"),
                                       ("inference", self.cfg.inference.enabled, f"{self.cfg.inference_url}/health")):
                if enabled:
                    components += [u.status() for u in self.units.values() if u.kind == kind]
                    continue
                # External components are probed, not supervised.
                ok = await get_ok(session, url, self._api_headers() if kind == "api" else None)
                components.append({"name": kind, "kind": kind, "external": True,
                                   "state": "ready" if ok else "unreachable", "pid": None, "restarts": 0,
                                   "last_exit": None, "since_s": None, "url": url})
            components += [u.status() for u in self.units.values() if u.kind == "env"]
            queue = await self._queue(session)
        return {"state": self.state, "pid": self.pid, "uptime_s": round(time.monotonic() - self._t0, 3),
                "config": self.cfg.source, "instance": self.nonce, "components": components,
                "trainer": self.trainer.status() if self.trainer is not None else None, "queue": queue,
                "start_error": self.start_error}

    async def _queue(self, session: Any) -> dict[str, Any] | None:
        import aiohttp

        try:
            async with session.get(f"{self.cfg.api_url}/status", headers=self._api_headers()) as resp:
                if resp.status != 200:
                    return None
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return None
        if not isinstance(data, dict):
            return None
        return {"sequences": data.get("queued_sequences", data.get("queue_size")),
                "capacity": data.get("capacity") if self.cfg.api.enabled else None}

    # ------------------------------------------------------------------ metrics

    async def _serve_metrics(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Prometheus text on 127.0.0.1:metrics_port, read from the live state at each scrape."""
        from aiohttp import web
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_DaemonCollector(self))

        async def metrics(_request: web.Request) -> web.Response:
            return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", self.cfg.daemon.metrics_port)
            await site.start()
            task_status.started()
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await runner.cleanup()

    # ------------------------------------------------------------------ state

    def _set_state(self, new: str) -> None:
        if new != self.state:
            log.info("daemon state", old=self.state, new=new)
            self.state = new

    def _set_status(self, text: str) -> None:
        log.info(text)
        self.notifier.status(text)

    def _status_line(self) -> str:
        ready = sum(u.state == State.READY for u in self.units.values())
        text = f"{self.state}: {ready}/{len(self.units)} components ready"
        if self.trainer is not None:
            st = self.trainer.status()
            text += f"; trainer {st.get('state')} step {st.get('step')}/{st.get('total_steps')}"
        return text


class _DaemonCollector:
    """Component states, restarts and trainer progress as Prometheus gauges."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        d = self.daemon
        up = GaugeMetricFamily("atroposd_uptime_seconds", "Seconds since the daemon started")
        up.add_metric([], time.monotonic() - d._t0)
        yield up
        state = GaugeMetricFamily("atroposd_component_state", "1 for the state each component is in",
                                  labels=["component", "kind", "state"])
        restarts = CounterMetricFamily("atroposd_component_restarts", "Restarts of each component",
                                       labels=["component", "kind"])
        dropped = CounterMetricFamily("atroposd_component_log_dropped_bytes",
                                      "Output a component wrote faster than its log could take",
                                      labels=["component", "kind"])
        for u in list(d.units.values()):
            for st in State:
                state.add_metric([u.name, u.kind, st.value], 1.0 if u.state == st else 0.0)
            restarts.add_metric([u.name, u.kind], u.restarts)
            dropped.add_metric([u.name, u.kind], u.status()["log_dropped_bytes"])
        yield state
        yield restarts
        yield dropped
        if d.trainer is not None:
            t = d.trainer.status()
            for key, help_text in (("step", "Optimizer steps done"), ("weight_version", "Weights served"),
                                   ("reward_mean", "Mean reward of the last batch"),
                                   ("accuracy", "Exact-match accuracy of the last batch"),
                                   ("loss", "Loss of the last step"), ("steps_per_s", "Optimizer steps per second")):
                if isinstance(t.get(key), (int, float)):
                    g = GaugeMetricFamily(f"atroposd_trainer_{key}", help_text)
                    g.add_metric([], float(t[key]))
                    yield g


def _session(timeout: float) -> Any:
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout))


def _env_of(unit_name: str, envs: dict[str, EnvConfig]) -> str | None:
    for name, e in envs.items():
        if unit_name in e.replica_names():
            return name
    return None


def _changed_keys(old: Config, new: Config) -> list[str]:
    """Keys outside [[env]] whose value differs (those need a restart)."""
    out = []
    for section in _RESTARTABLE_SECTIONS:
        a, b = dataclasses.asdict(getattr(old, section)), dataclasses.asdict(getattr(new, section))
        out += [f"{section}.{k}" for k in a if a[k] != b.get(k)]
    return out


def run_foreground(cfg: Config, notifier: Notifier) -> int:
    """``atroposd run``: the daemon in this process until the job ends."""
    daemon = Daemon(cfg, notifier=notifier)
    return int(anyio.run(daemon.main))


__all__ = ["AlreadyRunning", "Daemon", "StartFailed", "check_port", "lock_pidfile", "read_pidfile",
           "run_foreground"]

"""One managed child: its state machine, start-until-ready, stop, and restart policy (SPEC §4).

``Unit.supervise()`` is the whole lifecycle as one flat loop:

    launch → wait for readiness (probe vs exit vs deadline) → ready → wait for exit or stop
      → terminate the group and tracked descendants → classify the exit → backoff → again

Every state change goes through ``_transition``, which checks the move is legal and logs
old → new with the pid and the reason.  Stopping is TERM to the process group → grace →
KILL to the group and every tracked descendant → reap, shielded from cancellation and bounded
by ``stop_timeout``; the same clean-up runs when a child exits by itself, before any backoff.
"""

from __future__ import annotations

import enum
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import psutil

from atroposd.exitcodes import Exit
from atroposd.logs import get_logger
from atroposd.pids import is_alive
from atroposd.process import reaper
from atroposd.process.liveness import LiveCheck, LiveSettings
from atroposd.process.logfiles import LogHub, tail
from atroposd.process.probes import Probe, ProbeError
from atroposd.restarts import RestartBudget
from atroposd.shmscan import boot_seconds

log = get_logger("atroposd.unit")

LAUNCHER = str(Path(__file__).with_name("launch.py"))
BACKOFF_FIRST = 1.0
BACKOFF_MAX = 30.0
BACKOFF_JITTER = 0.2
# How long the log pump may keep draining a closed child's pipe before it is cut off.
PUMP_DRAIN = 1.0
DESCENDANT_POLL = 0.02
# The least a stop bounded by ``request_stop(by=...)`` gives a child: its TERM, then the KILL.
MIN_STOP = 0.5


class State(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    BACKOFF = "backoff"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


_LEGAL: dict[State, set[State]] = {
    State.STOPPED: {State.STARTING},
    State.STARTING: {State.READY, State.BACKOFF, State.FAILED, State.STOPPING, State.STOPPED},
    State.READY: {State.BACKOFF, State.FAILED, State.STOPPING, State.STOPPED},
    State.BACKOFF: {State.STARTING, State.STOPPED, State.FAILED},
    State.STOPPING: {State.STOPPED, State.FAILED, State.BACKOFF},  # BACKOFF: after a hung child
    State.FAILED: set(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass(frozen=True)
class ExitInfo:
    """How a child ended: ``code`` is the return code (negative: killed by that signal);
    ``reason`` is ``"hung"`` when the daemon stopped it for failing its liveness checks."""

    code: int
    at: float = field(default_factory=time.time)
    reason: str | None = None

    @property
    def signal(self) -> str | None:
        return reaper.signal_name(-self.code) if self.code < 0 else None

    def describe(self) -> str:
        if self.reason is not None:
            return f"{self.reason}: {self._describe_code()}"
        return self._describe_code()

    def _describe_code(self) -> str:
        if self.code < 0:
            text = f"killed by {self.signal}"
            return text + " (possibly the out-of-memory killer)" if self.code == -signal.SIGKILL else text
        return f"exited with code {self.code}"

    def as_dict(self) -> dict[str, Any]:
        at = datetime.fromtimestamp(self.at, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {"code": self.code, "signal": self.signal, "at": at, "reason": self.reason}


@dataclass
class UnitSpec:
    """Everything needed to run one child; built by the daemon from the config."""

    name: str
    kind: str  # api | inference | env
    argv: list[str]
    env: dict[str, str]
    probe: Probe
    ready_timeout: float
    stop_timeout: float
    stop_signal: int = signal.SIGTERM
    death_signal: int = signal.SIGKILL
    restart: str = "always"  # on-failure | always | never
    max_restarts: int = 5
    restart_window: float = 60.0
    cwd: str | None = None
    live: LiveSettings | None = None  # liveness while it runs (SPEC §4); None or 0s: off
    live_check: LiveCheck | None = None
    # Awaited after each exit, once the child and its descendants are gone, before any backoff:
    # with True when it will be restarted, False when it stops for good (the daemon's clean-up of
    # what the child left outside its process tree: its containers, SPEC §16). Bounded by its owner.
    on_exit: Callable[[bool], Awaitable[None]] | None = None


# Called with (unit, restarted) once the probe passed, before the unit is marked ready.
ReadyHook = Callable[["Unit", bool], Awaitable[None]]


class Unit:
    """One managed child process and its whole lifecycle."""

    def __init__(
        self,
        spec: UnitSpec,
        *,
        logs: LogHub,
        on_ready: ReadyHook | None = None,
        on_change: Callable[[Unit], None] | None = None,
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.kind = spec.kind
        self.state = State.STOPPED
        self.pid: int | None = None
        self.restarts = 0
        self.last_exit: ExitInfo | None = None
        self.last_error: str | None = None
        self.ever_ready = False
        self.since = time.monotonic()
        self._backoff_done_s = 0.0  # seconds spent in finished backoffs
        self.launched_at = time.time()  # wall clock
        self.launched_boot = boot_seconds()  # seconds since boot: compared with file times at the check
        self.tracked: dict[int, psutil.Process] = {}
        self.settled = anyio.Event()  # the first attempt is over: ready, or it failed
        self.done = anyio.Event()  # supervise() returned
        self._stop = anyio.Event()
        self._changed = anyio.Event()
        self._budget = RestartBudget(
            spec.max_restarts, spec.restart_window, first=BACKOFF_FIRST, cap=BACKOFF_MAX, jitter=BACKOFF_JITTER
        )
        self._sink = logs.sink(spec.name)
        self._on_ready = on_ready
        self._on_change = on_change
        self.log_path = self._sink.path
        # Liveness (SPEC §4): the current attempt's checks; see _watch_running.
        self.launched_monotonic = time.monotonic()
        self.live_since = time.monotonic()  # the last sign of life (ready, or a passed check)
        self.live_failures = 0
        self.live_error: str | None = None
        self.hung_reason: str | None = None  # set when the current attempt is declared hung
        self.last_hung: dict[str, Any] | None = None
        self.hung_count = 0
        self._hung = anyio.Event()
        self._live_tg: anyio.abc.TaskGroup | None = None
        self._stop_by: float | None = None  # request_stop's bound on the stop, if any

    # ------------------------------------------------------------------ public

    def request_stop(self, *, by: float | None = None) -> None:
        """Ask the unit to stop its child and end ``supervise()`` (idempotent). ``by``
        (``time.monotonic()``): the child is killed by then at the latest, however long its
        ``stop_timeout`` (a node that lost its head has until the head finds it lost)."""
        if by is not None:
            self._stop_by = by if self._stop_by is None else min(self._stop_by, by)
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    async def wait_until(self, predicate: Callable[[Unit], bool]) -> None:
        while not predicate(self):
            await self._changed.wait()

    def status(self) -> dict[str, Any]:
        """This component's entry in ``status --json`` (SPEC §2).

        ``since_s``: for a ready child with liveness checks, the time since its last sign of
        life; otherwise the time since its last state change.
        """
        now = time.monotonic()
        checked = self.state == State.READY and self._live_on
        since = max(self.live_since, self.since) if checked else self.since
        return {
            "name": self.name,
            "kind": self.kind,
            "external": False,
            "state": self.state.value,
            "pid": self.pid,
            "restarts": self.restarts,
            "last_exit": self.last_exit.as_dict() if self.last_exit else None,
            "since_s": round(now - since, 3),
            "log": str(self.log_path),
            "error": self.last_error,
            "log_dropped_bytes": self._sink.dropped_bytes,
            "live": self.live_status(),
        }

    @property
    def _live_on(self) -> bool:
        return self.spec.live is not None and self.spec.live.on and self.spec.live_check is not None

    def live_status(self) -> dict[str, Any]:
        """``ok`` | ``failing`` (some checks failed) | ``hung`` (being stopped) | ``off``; and the last hang."""
        if self.hung_reason is not None:
            state = "hung"
        elif not self._live_on:
            state = "off"
        elif self.state != State.READY:
            state = "unknown"
        else:
            state = "failing" if self.live_failures else "ok"
        return {"state": state, "failures": self.live_failures, "error": self.live_error, "last_hung": self.last_hung}

    def declare_hung(self, reason: str) -> bool:
        """Stop the running child as hung (TERM → KILL) and restart it under its policy.

        Called by the liveness checks, and by the daemon for a child to blame for a stall.
        False when the child is not running and ready (nothing to do).
        """
        if self.state != State.READY or self.hung_reason is not None or self._stop.is_set():
            return False
        self.hung_reason = reason
        self.hung_count += 1
        self.last_hung = {
            "reason": reason,
            "pid": self.pid,
            "at": datetime.now(tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        log.error("hung", unit=self.name, kind=self.kind, pid=self.pid, reason=reason)
        self._hung.set()
        return True

    def live_task(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``fn`` beside the liveness loop of the current attempt (cancelled with it)."""
        if self._live_tg is not None:
            self._live_tg.start_soon(fn)

    @property
    def backoff_s(self) -> float:
        """Seconds this component has spent waiting to be restarted (the current wait included)."""
        current = time.monotonic() - self.since if self.state == State.BACKOFF else 0.0
        return self._backoff_done_s + current

    def tree_pids(self) -> set[int]:
        """The child and its known descendants (for crediting API registrations)."""
        pids = set(self.tracked)
        if self.pid is not None:
            pids.add(self.pid)
            pids.update(p.pid for p in reaper.descendants(self.pid))
        return pids

    def rescan(self, current: list[psutil.Process] | None = None) -> None:
        """Record the child's descendants (``current``, else scanned now), forget the dead ones.

        The daemon calls it every 0.5 s with one shared scan of the process table.
        """
        if self.pid is not None:
            for proc in current if current is not None else reaper.descendants(self.pid):
                self.tracked.setdefault(proc.pid, proc)
        for pid, proc in list(self.tracked.items()):
            if not is_alive(proc):
                del self.tracked[pid]

    async def supervise(self) -> None:
        """Run the child until a stop is requested or the restart policy gives up."""
        try:
            while not self._stop.is_set():
                exit_info = await self._run_once()
                delay = self._after_exit(exit_info) if exit_info is not None else None
                if self.spec.on_exit is not None:
                    with anyio.CancelScope(shield=True):
                        await self.spec.on_exit(delay is not None and not self._stop.is_set())
                if delay is None:
                    break
                with anyio.move_on_after(delay):
                    await self._stop.wait()
                if not self._stop.is_set():
                    self.restarts += 1
        except Exception as exc:
            # A bug here must not take the daemon down: this component fails, visibly.
            log.exception("supervision failed", unit=self.name)
            self.last_error = f"internal error: {type(exc).__name__}: {exc}"
            if State.FAILED in _LEGAL[self.state]:
                self._transition(State.FAILED, self.last_error)
        finally:
            if self.state not in (State.STOPPED, State.FAILED):
                self._transition(State.STOPPED, "stop requested")
            self.settled.set()
            self.done.set()
            self._sink.close()

    # ------------------------------------------------------------------ one attempt

    async def _run_once(self) -> ExitInfo | None:
        """One launch; returns how the child ended, or None if it was stopped on request."""
        self._transition(State.STARTING, "restart" if self.restarts else "start")
        self.hung_reason, self._hung = None, anyio.Event()
        self.live_failures, self.live_error = 0, None
        try:
            proc = await self._launch()
        except (OSError, ValueError) as exc:
            self.last_error = f"cannot start: {exc}"
            return ExitInfo(code=Exit.EXEC_FAILED)
        exited = anyio.Event()
        codes: list[int] = []
        requested = True
        outcome = "stop"
        try:
            async with anyio.create_task_group() as tg:
                pump_done = anyio.Event()
                tg.start_soon(self._pump, proc, pump_done)
                tg.start_soon(self._wait_exit, proc, exited, codes)
                outcome = await self._wait_ready(exited)
                if outcome == "ready":
                    outcome = await self._become_ready(exited)
                    if outcome == "ready":
                        await self._watch_running(exited)
                requested = self._stop.is_set() and not exited.is_set()
                hung = self.hung_reason is not None and not requested and not exited.is_set()
                if requested:
                    self._transition(State.STOPPING, "stop requested")
                elif hung:
                    self._transition(State.STOPPING, f"hung: {self.hung_reason}")
                await self._terminate(proc, requested=requested)
                with anyio.move_on_after(PUMP_DRAIN):
                    await pump_done.wait()
                tg.cancel_scope.cancel()
        finally:
            # Cancelled or failed on the way: the child is still stopped and reaped first.
            with anyio.CancelScope(shield=True):
                if proc.returncode is None:
                    await self._terminate(proc, requested=True)
                self._sink.sync()
        self.pid = None
        code = proc.returncode if proc.returncode is not None else (codes[0] if codes else -signal.SIGKILL)
        exit_info = ExitInfo(code=code, reason="hung" if self.hung_reason is not None else None)
        self.last_exit = exit_info
        if requested:
            return None
        if self.hung_reason is not None:
            self.last_error = f"hung: {self.hung_reason}"
        if outcome not in ("ready", "exited", "stop"):
            self.last_error = outcome
        elif outcome == "exited":
            self.last_error = f"{exit_info.describe()} while starting; last log lines:\n{tail(self.log_path)}"
        return exit_info

    async def _launch(self) -> anyio.abc.Process:
        argv = [
            sys.executable,
            "-I",
            "-S",
            LAUNCHER,
            str(int(self.spec.death_signal)),
            str(os.getpid()),
            "--",
            *self.spec.argv,
        ]
        self._sink.write(f"=== atroposd: starting {self.name}: {' '.join(self.spec.argv)}\n".encode())
        # start_new_session: own session and process group; the launcher adds the death signal.
        self.launched_at = time.time()
        self.launched_boot = boot_seconds()  # left-over segments are those created since (clock steps aside)
        proc = await anyio.open_process(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.spec.env,
            cwd=self.spec.cwd,
            start_new_session=True,
        )
        self.pid = proc.pid
        self.since = self.launched_monotonic = time.monotonic()
        log.info("launched", unit=self.name, pid=proc.pid, argv=self.spec.argv)
        return proc

    async def _pump(self, proc: anyio.abc.Process, done: anyio.Event) -> None:
        assert proc.stdout is not None
        try:
            async for chunk in proc.stdout:
                self._sink.write(chunk)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass
        finally:
            done.set()

    async def _wait_exit(self, proc: anyio.abc.Process, exited: anyio.Event, codes: list[int]) -> None:
        codes.append(await proc.wait())
        exited.set()

    async def _wait_ready(self, exited: anyio.Event) -> str:
        """'ready', 'exited', 'stop', or the reason the probe failed."""
        outcome = "exited"
        async with anyio.create_task_group() as tg:

            async def probe() -> None:
                nonlocal outcome
                try:
                    with anyio.fail_after(self.spec.ready_timeout):
                        await self.spec.probe.wait(self)
                    outcome = "ready"
                except TimeoutError:
                    self._sink.sync()
                    outcome = (
                        f"not ready after {self.spec.ready_timeout:g}s ({self.spec.probe.description}); "
                        f"last log lines:\n{tail(self.log_path)}"
                    )
                except ProbeError as exc:
                    outcome = f"readiness probe failed: {exc}"
                tg.cancel_scope.cancel()

            async def watch(event: anyio.Event, result: str) -> None:
                nonlocal outcome
                await event.wait()
                outcome = result
                tg.cancel_scope.cancel()

            tg.start_soon(probe)
            tg.start_soon(watch, exited, "exited")
            tg.start_soon(watch, self._stop, "stop")
        if outcome not in ("ready", "exited", "stop"):
            log.error("not ready", unit=self.name, pid=self.pid, reason=outcome.splitlines()[0])
        return outcome

    async def _become_ready(self, exited: anyio.Event) -> str:
        if self._on_ready is not None:
            try:
                await self._on_ready(self, self.ever_ready)
            except Exception as exc:
                log.exception("ready hook failed", unit=self.name, pid=self.pid)
                return f"ready hook failed: {exc}"
        if exited.is_set():
            return "exited"
        if self._stop.is_set():
            return "stop"
        self.ever_ready = True
        self.last_error = None
        self._transition(State.READY, self.spec.probe.description)
        return "ready"

    # ------------------------------------------------------------------ liveness

    async def _watch_running(self, exited: anyio.Event) -> None:
        """While the child runs: its liveness checks, until it exits, a stop, or it is hung."""
        self.live_since = time.monotonic()
        live, check = self.spec.live, self.spec.live_check
        if live is None or check is None or not live.on:
            await _first_of(exited, self._stop, self._hung)
            return
        check.reset()
        async with anyio.create_task_group() as tg:
            self._live_tg = tg
            tg.start_soon(self._live_loop, live, check)
            await _first_of(exited, self._stop, self._hung)
            self._live_tg = None
            tg.cancel_scope.cancel()

    async def _live_loop(self, live: LiveSettings, check: LiveCheck) -> None:
        """A check every ``live.interval`` s; ``live.failures`` failures in a row: hung."""
        tick = 0
        next_at = time.monotonic() + live.interval
        while True:
            await anyio.sleep(max(0.0, next_at - time.monotonic()))
            next_at = max(next_at + live.interval, time.monotonic())
            tick += 1
            error: str | None
            try:
                with anyio.fail_after(2 * max(live.timeout, live.interval) + 1):
                    error = await check.check(self, tick)
            except TimeoutError:
                error = f"{check.description}: no answer"
            except Exception as exc:  # a bug in a check must not pass for a hung child, nor kill the unit
                log.exception("liveness check failed to run", unit=self.name)
                error = f"liveness check error: {type(exc).__name__}: {exc}"
            if error is None:
                if self.live_failures:
                    log.info("alive again", unit=self.name, pid=self.pid, after_failures=self.live_failures)
                self.live_failures, self.live_error = 0, None
                self.live_since = time.monotonic()
                continue
            self.live_failures += 1
            self.live_error = error
            log.warning(
                "liveness check failed",
                unit=self.name,
                kind=self.kind,
                pid=self.pid,
                failures=f"{self.live_failures}/{live.failures}",
                error=error,
            )
            if self.live_failures >= live.failures:
                self.declare_hung(
                    f"{error} ({self.live_failures} liveness checks in a row failed: {check.description})"
                )
                return

    # ------------------------------------------------------------------ termination

    async def _terminate(self, proc: anyio.abc.Process, *, requested: bool) -> None:
        """TERM the group and tracked descendants → grace → KILL → reap; within stop_timeout."""
        with anyio.CancelScope(shield=True):
            t0 = time.monotonic()
            timeout = self.spec.stop_timeout
            if requested and self._stop_by is not None:
                timeout = max(MIN_STOP, min(timeout, self._stop_by - t0))
            grace = max(0.0, timeout - min(2.0, timeout * 0.25))
            self.rescan()
            # What the processes map now: what they leave in /dev/shm if killed before their cleanup.
            mapped = reaper.mapped_shm(pids=[*self.tracked, *([proc.pid] if proc.returncode is None else [])])
            first = self.spec.stop_signal if proc.returncode is None else signal.SIGTERM
            reaper.signal_group(proc.pid, first)
            reaper.signal_all(self.tracked.values(), first)
            if proc.returncode is None:
                # As systemd does: a stopped child (SIGSTOP, a debugger; often a hung one) sees the
                # TERM at once instead of only the KILL after the grace.
                reaper.signal_group(proc.pid, signal.SIGCONT)
                reaper.signal_all(self.tracked.values(), signal.SIGCONT)
            with anyio.move_on_after(grace):
                await proc.wait()
                await self._descendants_gone()
            escalated = [p.pid for p in self.tracked.values() if is_alive(p)]
            if proc.returncode is None:
                escalated.insert(0, proc.pid)
            reaper.signal_group(proc.pid, signal.SIGKILL)
            reaper.signal_all(self.tracked.values(), signal.SIGKILL)
            with anyio.move_on_after(max(0.2, timeout - (time.monotonic() - t0))):
                await proc.wait()
                await self._descendants_gone()
            elapsed = round(time.monotonic() - t0, 3)
            if escalated:
                log.warning(
                    "escalated to SIGKILL", unit=self.name, pid=proc.pid, grace_s=round(grace, 3), pids=escalated
                )
            left = [p.pid for p in self.tracked.values() if is_alive(p)]
            if left or proc.returncode is None:
                log.error(
                    "processes survived SIGKILL", unit=self.name, pids=left, main_exited=proc.returncode is not None
                )
            self.tracked.clear()
            if requested or escalated:
                log.info("terminated", unit=self.name, pid=proc.pid, seconds=elapsed)
            if mapped:
                removed = await anyio.to_thread.run_sync(
                    functools.partial(reaper.unlink_orphaned_segments, mapped, since_boot=self.launched_boot)
                )
                if removed:
                    log.info(
                        "removed shared-memory segments the component's processes left",
                        unit=self.name,
                        segments=removed,
                    )

    async def _descendants_gone(self) -> None:
        # Tracked descendants are not our children (no wait possible): poll them.
        while any(is_alive(p) for p in self.tracked.values()):  # noqa: ASYNC110
            await anyio.sleep(DESCENDANT_POLL)

    # ------------------------------------------------------------------ restart policy

    def _after_exit(self, exit_info: ExitInfo) -> float | None:
        """Classify an exit (SPEC §4): the backoff before the next start, or None when final."""
        exits = self._budget.record()
        what = exit_info.describe()
        if exit_info.code == Exit.USAGE and not self.ever_ready:
            self.last_error = (
                f"{what} before it was ever ready: a usage or config error; last log lines:\n{tail(self.log_path)}"
            )
            self._transition(State.FAILED, f"{what} before it was ever ready: usage or config error, not restarted")
            return None
        clean = exit_info.code == 0 and exit_info.reason is None  # a hung child is a failure
        if self.spec.restart == "never" or (self.spec.restart == "on-failure" and clean):
            if clean:
                self._transition(State.STOPPED, f"{what}: finished")
            else:
                self._transition(State.FAILED, f"{what}; restart = never")
            return None
        if self._budget.exhausted:
            reason = (
                f"{what}; {exits} exits within {self.spec.restart_window:g}s (max_restarts = {self.spec.max_restarts})"
            )
            self.last_error = self.last_error or reason
            self._transition(State.FAILED, reason)
            return None
        delay = self._budget.backoff()
        self._transition(State.BACKOFF, f"{what}; restarting in {delay:.1f}s")
        return delay

    # ------------------------------------------------------------------ state machine

    def _transition(self, new: State, reason: str) -> None:
        old = self.state
        if new not in _LEGAL[old]:
            raise IllegalTransition(f"{self.name}: {old.value} → {new.value} ({reason})")
        self.state = new
        now = time.monotonic()
        if old == State.BACKOFF:
            self._backoff_done_s += now - self.since
        self.since = now
        level = "error" if new == State.FAILED else "warning" if new == State.BACKOFF else "info"
        getattr(log, level)(
            "state", unit=self.name, kind=self.kind, old=old.value, new=new.value, pid=self.pid, reason=reason
        )
        if old == State.STARTING:
            self.settled.set()
        changed, self._changed = self._changed, anyio.Event()
        changed.set()
        if self._on_change is not None:
            self._on_change(self)


async def _first_of(*events: anyio.Event) -> None:
    """Return as soon as any of ``events`` is set."""
    if any(e.is_set() for e in events):
        return
    async with anyio.create_task_group() as tg:

        async def wait(event: anyio.Event) -> None:
            await event.wait()
            tg.cancel_scope.cancel()

        for e in events:
            tg.start_soon(wait, e)

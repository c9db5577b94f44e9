"""The process unit against real misbehaving children (tests/child_scripts)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import psutil
import pytest

from atroposd.process.logfiles import LogHub
from atroposd.process.probes import HttpProbe, StartedProbe
from atroposd.process.unit import State, Unit
from tests.process.conftest import make_spec, script, supervise
from tests.support import free_port


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def _ready(unit: Unit) -> None:
    await unit.wait_until(lambda u: u.state == State.READY)


async def _wait_file(path: Path) -> str:
    apath = anyio.Path(path)
    while not await apath.exists():  # noqa: ASYNC110 - a file another process writes
        await anyio.sleep(0.02)
    return await apath.read_text()


def _stop_stubborn(
    hub: LogHub, tmp_path: Path, stop_timeout: float, stop: Callable[[Unit, float], None]
) -> tuple[Unit, dict[str, float]]:
    """A child that ignores its TERM, with a setsid grandchild: ``stop(unit, t0)`` once both are
    tracked; the time until the unit is done, and the two pids."""
    pidfile = tmp_path / "pids"
    measured: dict[str, float] = {}

    async def body(unit: Unit) -> None:
        await _ready(unit)
        child, grandchild = map(int, (await _wait_file(pidfile)).split())
        measured["child"], measured["grandchild"] = child, grandchild
        assert child == unit.pid
        while grandchild not in unit.tracked:  # the tracker saw it while it was a descendant
            unit.rescan()
            await anyio.sleep(0.02)
        t0 = time.monotonic()
        stop(unit, t0)
        await unit.done.wait()
        measured["stop_s"] = time.monotonic() - t0

    unit = supervise(make_spec("stubborn", script("stubborn.py", str(pidfile)), stop_timeout=stop_timeout), hub, body)
    return unit, measured


def test_stubborn_child_and_setsid_grandchild_are_gone_within_stop_timeout(hub: LogHub, tmp_path: Path) -> None:
    stop_timeout = 2.0
    unit, measured = _stop_stubborn(hub, tmp_path, stop_timeout, lambda unit, t0: unit.request_stop())
    assert unit.state == State.STOPPED
    assert measured["stop_s"] <= stop_timeout + 0.5, measured
    assert not _alive(int(measured["child"])) and not _alive(int(measured["grandchild"]))


def test_a_stop_with_a_deadline_kills_a_stubborn_child_by_then_whatever_its_stop_timeout(
    hub: LogHub, tmp_path: Path
) -> None:
    """A node that lost its head stops with a deadline (``request_stop(by=...)``): a child that
    ignores its TERM is killed by then, not after its 20 s stop_timeout; its grandchild too."""

    def stop(unit: Unit, t0: float) -> None:
        unit.request_stop(by=t0 + 1.0)
        unit.request_stop()  # a later stop without one keeps the deadline

    unit, measured = _stop_stubborn(hub, tmp_path, 20.0, stop)
    assert unit.state == State.STOPPED
    assert 0.5 <= measured["stop_s"] <= 1.0 + 0.5, measured
    assert not _alive(int(measured["child"])) and not _alive(int(measured["grandchild"]))


def test_cooperative_child_stops_at_once(hub: LogHub, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    measured: dict[str, float] = {}

    async def body(unit: Unit) -> None:
        await _ready(unit)
        await _wait_file(marker)  # its SIGTERM handler is installed
        t0 = time.monotonic()
        unit.request_stop()
        await unit.done.wait()
        measured["stop_s"] = time.monotonic() - t0

    unit = supervise(make_spec("coop", script("cooperative.py", str(marker)), stop_timeout=10.0), hub, body)
    assert unit.state == State.STOPPED
    assert unit.last_exit is not None and unit.last_exit.code == 0  # its own exit, no escalation
    assert measured["stop_s"] < 5.0, measured


def test_crash_loop_fails_after_max_restarts(hub: LogHub) -> None:
    async def body(unit: Unit) -> None:
        await unit.wait_until(lambda u: u.state == State.FAILED)

    t0 = time.monotonic()
    unit = supervise(make_spec("crash", script("crashloop.py", "1"), max_restarts=2), hub, body)
    elapsed = time.monotonic() - t0
    assert unit.state == State.FAILED
    assert unit.restarts == 2
    assert unit.last_exit is not None and unit.last_exit.code == 1
    # backoff 1 s then 2 s (+ jitter ≤ 20 %): exponential, not immediate, not stuck
    assert 3.0 <= elapsed < 8.0, elapsed
    assert "crashloop: exiting with 1" in unit.log_path.read_text()


def test_exit_code_2_before_ready_fails_at_once(hub: LogHub) -> None:
    async def body(unit: Unit) -> None:
        await unit.wait_until(lambda u: u.state == State.FAILED)

    # A probe that cannot pass before the exit, however slow the interpreter starts under load.
    unit = supervise(
        make_spec("usage", script("crashloop.py", "2"), max_restarts=5, probe=StartedProbe(30.0)), hub, body
    )
    assert unit.state == State.FAILED and unit.restarts == 0
    assert unit.last_error and "usage or config error" in unit.last_error


def test_child_dying_during_readiness_fails_the_wait_at_once_with_its_log(hub: LogHub) -> None:
    port = free_port()

    async def body(unit: Unit) -> None:
        await unit.settled.wait()

    t0 = time.monotonic()
    unit = supervise(
        make_spec(
            "dies",
            script("die_during_ready.py"),
            ready_timeout=60.0,
            restart="never",
            probe=HttpProbe(f"http://127.0.0.1:{port}/info"),
        ),
        hub,
        body,
    )
    assert time.monotonic() - t0 < 5.0
    assert unit.state == State.FAILED
    assert unit.last_error is not None
    assert "exited with code 3 while starting" in unit.last_error
    assert "cannot open the thing it needs" in unit.last_error


def test_slow_child_becomes_ready_when_its_probe_passes(hub: LogHub) -> None:
    port = free_port()
    seen: dict[str, float] = {}

    async def body(unit: Unit) -> None:
        t0 = time.monotonic()
        await unit.settled.wait()
        seen["ready_s"] = time.monotonic() - t0
        assert unit.state == State.READY

    supervise(
        make_spec("slow", script("slow_ready.py", str(port), "1.0"), probe=HttpProbe(f"http://127.0.0.1:{port}/info")),
        hub,
        body,
    )
    assert seen["ready_s"] >= 0.9


def test_readiness_deadline_kills_and_counts_the_attempt(hub: LogHub) -> None:
    port = free_port()

    async def body(unit: Unit) -> None:
        await unit.wait_until(lambda u: u.state == State.FAILED)

    unit = supervise(
        make_spec(
            "never-ready",
            script("cooperative.py"),
            ready_timeout=0.5,
            max_restarts=0,
            probe=HttpProbe(f"http://127.0.0.1:{port}/info"),
        ),
        hub,
        body,
    )
    assert unit.state == State.FAILED
    assert unit.last_error and "not ready after 0.5s" in unit.last_error


def test_flooding_child_never_blocks_the_loop_and_logs_rotate(tmp_path: Path) -> None:
    hub = LogHub(tmp_path / "logs", max_bytes=256 * 1024, backups=2, buffer_bytes=512 * 1024)
    lags: list[float] = []

    async def body(unit: Unit) -> None:
        await _ready(unit)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            await anyio.sleep(0.01)
            lags.append(time.monotonic() - t0 - 0.01)

    try:
        unit = supervise(make_spec("flood", script("flood.py"), stop_timeout=3.0), hub, body)
    finally:
        hub.close()
    assert unit.state == State.STOPPED
    lags.sort()
    assert lags[len(lags) // 2] < 0.05, lags[-5:]
    logs = tmp_path / "logs"
    assert (logs / "flood.log.1").exists()
    assert not (logs / "flood.log.3").exists()
    for f in logs.glob("flood.log*"):
        assert f.stat().st_size <= 256 * 1024 + 8192


def test_unexpected_exit_restarts_and_reports_last_exit(hub: LogHub) -> None:
    async def body(unit: Unit) -> None:
        await _ready(unit)
        first = unit.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        await unit.wait_until(lambda u: u.state == State.READY and u.pid != first)
        assert unit.restarts == 1
        assert unit.last_exit is not None and unit.last_exit.code == -9
        assert unit.last_exit.as_dict()["signal"] == "SIGKILL"

    supervise(make_spec("victim", script("cooperative.py")), hub, body)


def test_finished_environment_is_stopped_not_restarted(hub: LogHub) -> None:
    async def body(unit: Unit) -> None:
        await unit.wait_until(lambda u: u.state == State.STOPPED and u.last_exit is not None)

    unit = supervise(
        make_spec("done", script("crashloop.py", "0"), restart="on-failure", probe=StartedProbe(0.0)), hub, body
    )
    assert unit.state == State.STOPPED and unit.restarts == 0


@pytest.mark.parametrize("sig", [signal.SIGKILL])
def test_parent_death_signal_is_set(hub: LogHub, sig: int) -> None:
    async def body(unit: Unit) -> None:
        await _ready(unit)
        assert unit.pid is not None
        status = await anyio.Path(f"/proc/{unit.pid}/status").read_text()
        assert "python" in " ".join(psutil.Process(unit.pid).cmdline())
        # the launcher exec'd in place: the pid we hold is the child's, in its own session
        assert os.getsid(unit.pid) == unit.pid and os.getpgid(unit.pid) == unit.pid
        assert status

    supervise(make_spec("pdeath", script("cooperative.py"), death_signal=sig), hub, body)


def test_cancelling_the_supervisor_still_stops_and_reaps_the_child(hub: LogHub) -> None:
    """Cancellation (the daemon's task group ending) never leaves the child running."""
    seen: dict[str, int] = {}

    async def main() -> None:
        unit = Unit(make_spec("cancelled", script("cooperative.py")), logs=hub)
        async with anyio.create_task_group() as tg:
            tg.start_soon(unit.supervise)
            with anyio.fail_after(30):
                await _ready(unit)
            assert unit.pid is not None
            seen["pid"] = unit.pid
            tg.cancel_scope.cancel()
        assert unit.done.is_set()

    anyio.run(main)
    assert not _alive(seen["pid"])


def test_a_command_that_cannot_be_executed_is_an_exit_not_a_crash(hub: LogHub, tmp_path: Path) -> None:
    async def body(unit: Unit) -> None:
        await unit.wait_until(lambda u: u.state == State.FAILED)

    unit = supervise(
        make_spec("missing", [str(tmp_path / "no-such-binary")], restart="never", probe=StartedProbe(30.0)), hub, body
    )
    assert unit.last_exit is not None and unit.last_exit.code == 127
    assert unit.last_error and "cannot execute" in unit.last_error

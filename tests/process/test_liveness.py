"""Liveness checks of a running unit against real children (SPEC §4, Liveness)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import anyio
import psutil

from atroposd import heartbeat
from atroposd.process.liveness import (
    ActivityLiveCheck,
    HeartbeatBoard,
    HeartbeatLiveCheck,
    HttpLiveCheck,
    InferenceLiveCheck,
    LiveSettings,
)
from atroposd.process.logfiles import LogHub
from atroposd.process.probes import HttpProbe
from atroposd.process.unit import ExitInfo, State, Unit
from tests.process.conftest import make_spec, script, supervise
from tests.support import free_port

FAST = LiveSettings(interval=0.2, timeout=0.5, failures=3)


async def _ready(unit: Unit, *, pid_not: int | None = None) -> None:
    await unit.wait_until(lambda u: u.state == State.READY and u.pid is not None and u.pid != pid_not)


def _kill_if_alive(pid: int | None) -> None:
    if pid is not None and psutil.pid_exists(pid):
        os.kill(pid, signal.SIGKILL)


def test_a_stopped_http_child_is_declared_hung_killed_and_restarted(hub: LogHub) -> None:
    exits: list[ExitInfo | None] = []
    port = free_port()
    url = f"http://127.0.0.1:{port}/info"
    seen: dict[str, object] = {}

    async def body(unit: Unit) -> None:
        await _ready(unit)
        assert unit.status()["live"]["state"] == "ok"
        pid = unit.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            while unit.live_failures == 0 and unit.state == State.READY:  # noqa: ASYNC110 - checks run beside
                await anyio.sleep(0.01)
            seen["failing"] = unit.status()["live"]["state"]
            await _ready(unit, pid_not=pid)
            seen["restart_s"] = time.monotonic() - t0
            exits.append(unit.last_exit)
        finally:
            _kill_if_alive(pid)
        seen["pid"] = pid

    spec = make_spec(
        "api",
        script("fake_api.py", str(port)),
        kind="api",
        probe=HttpProbe(url),
        live=FAST,
        live_check=HttpLiveCheck(url, FAST.timeout),
    )
    unit = supervise(spec, hub, body)
    assert seen["failing"] in ("failing", "hung"), seen
    assert unit.restarts == 1
    assert exits[0] is not None and exits[0].reason == "hung"
    assert exits[0].as_dict()["reason"] == "hung"
    assert unit.last_hung is not None and unit.last_hung["pid"] == seen["pid"]
    assert "did not answer" in unit.last_hung["reason"]
    # interval × failures + the probe's timeout + the stop (TERM after CONT: at once)
    # (and the backoff, a start of the child: generous on a loaded machine)
    assert float(seen["restart_s"]) < FAST.interval * FAST.failures + FAST.timeout + 10.0, seen  # type: ignore[arg-type]


def test_liveness_off_leaves_a_stopped_child_alone(hub: LogHub) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/info"

    async def body(unit: Unit) -> None:
        await _ready(unit)
        pid = unit.pid
        os.kill(pid, signal.SIGSTOP)  # type: ignore[arg-type]
        try:
            await anyio.sleep(1.5)  # ample time for FAST's three checks: none runs
            assert unit.state == State.READY and unit.pid == pid and unit.status()["live"]["state"] == "off"
        finally:
            os.kill(pid, signal.SIGCONT)  # type: ignore[arg-type]

    off = LiveSettings(interval=0.0, timeout=0.5, failures=3)
    spec = make_spec(
        "api",
        script("fake_api.py", str(port)),
        kind="api",
        probe=HttpProbe(url),
        live=off,
        live_check=HttpLiveCheck(url, 0.5),
    )
    unit = supervise(spec, hub, body)
    assert unit.restarts == 0


def test_generation_probe_finds_an_engine_whose_health_still_answers(hub: LogHub, tmp_path: Path) -> None:
    """/health answers 200 throughout; only the generation probe can tell the engine is stuck."""
    exits: list[ExitInfo | None] = []
    port = free_port()
    sock = tmp_path / "inf.sock"
    check = InferenceLiveCheck(f"http://127.0.0.1:{port}", sock, timeout=0.3, generate_every=2, failures=2)

    async def body(unit: Unit) -> None:
        await _ready(unit)
        first = unit.pid
        await _ready(unit, pid_not=first)
        exits.append(unit.last_exit)

    spec = make_spec(
        "inference",
        script("stuck_generation.py", str(port), str(sock)),
        kind="inference",
        probe=HttpProbe(f"http://127.0.0.1:{port}/health"),
        live=LiveSettings(interval=0.2, timeout=0.3, failures=2),
        live_check=check,
    )
    unit = supervise(spec, hub, body)
    assert exits[0] is not None and exits[0].reason == "hung"
    assert unit.last_hung is not None and "generation" in unit.last_hung["reason"], unit.last_hung


def test_heartbeats_keep_a_child_live_and_their_absence_restarts_it(hub: LogHub, tmp_path: Path) -> None:
    exits: list[ExitInfo | None] = []
    board = HeartbeatBoard()
    path = tmp_path / heartbeat.SOCKET_NAME
    seen: dict[str, float] = {}

    async def body(unit: Unit) -> None:
        await _ready(unit)
        with anyio.fail_after(10):
            while board.latest(unit) is None:  # noqa: ASYNC110 - beats from another process
                await anyio.sleep(0.05)
        await anyio.sleep(FAST.interval * (FAST.failures + 2))
        assert unit.state == State.READY and unit.live_failures == 0  # beating: live
        pid = unit.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            await _ready(unit, pid_not=pid)
            seen["restart_s"] = time.monotonic() - t0
            exits.append(unit.last_exit)
        finally:
            _kill_if_alive(pid)

    env = {**os.environ, heartbeat.ENV_SOCKET: str(path)}
    spec = make_spec(
        "env-0", script("beating.py", "env-0"), env=env, live=FAST, live_check=HeartbeatLiveCheck(board, FAST.timeout)
    )

    async def with_board(unit: Unit) -> None:  # the board serves beside the unit
        async with anyio.create_task_group() as tg:
            await tg.start(board.serve, path)
            await body(unit)
            tg.cancel_scope.cancel()

    unit = supervise(spec, hub, with_board)
    assert unit.restarts == 1 and exits[0] is not None and exits[0].reason == "hung"
    assert unit.last_hung is not None and "no heartbeat" in unit.last_hung["reason"]
    assert not path.exists()
    assert seen["restart_s"] < 10, seen


def test_a_command_environment_is_live_while_it_uses_cpu(hub: LogHub, tmp_path: Path) -> None:
    exits: list[ExitInfo | None] = []
    board = HeartbeatBoard()
    api = f"http://127.0.0.1:{free_port()}"  # nothing listens: no registration can count

    async def body(unit: Unit) -> None:
        await _ready(unit)
        await anyio.sleep(FAST.interval * (FAST.failures + 2))
        assert unit.state == State.READY and unit.restarts == 0  # spinning: live
        pid = unit.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            await _ready(unit, pid_not=pid)
            exits.append(unit.last_exit)
        finally:
            _kill_if_alive(pid)

    spin = [
        sys.executable,
        "-c",
        "import signal,sys\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\nwhile True: pass",
    ]
    spec = make_spec("cmd-0", spin, live=FAST, live_check=ActivityLiveCheck(board, api, FAST.timeout, quiet=0.0))
    unit = supervise(spec, hub, body)
    assert exits[0] is not None and exits[0].reason == "hung"
    assert unit.last_hung is not None and "no CPU use" in unit.last_hung["reason"]


def test_a_declared_hang_is_a_failure_even_when_the_child_exits_0(hub: LogHub) -> None:
    """A hung child that exits 0 on TERM is still restarted under on-failure (not 'finished')."""
    exits: list[ExitInfo | None] = []
    port = free_port()
    url = f"http://127.0.0.1:{port}/info"

    async def body(unit: Unit) -> None:
        await _ready(unit)
        pid = unit.pid
        assert unit.declare_hung("blamed for a test stall")
        assert not unit.declare_hung("twice")  # once per attempt
        await _ready(unit, pid_not=pid)
        exits.append(unit.last_exit)

    spec = make_spec("api", script("fake_api.py", str(port)), kind="api", probe=HttpProbe(url), restart="on-failure")
    unit = supervise(spec, hub, body)
    assert unit.restarts == 1
    assert exits[0] is not None and exits[0].reason == "hung" and exits[0].code == 0

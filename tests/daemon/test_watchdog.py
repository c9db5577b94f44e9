"""The trainer's forward-progress watchdog: which stage it names, whom it restarts, when the job
ends (SPEC §4, Liveness), and the weight sync's own deadline. Real sockets and a real stand-in
API child; the trainer's progress is its real ``Progress`` record."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from atroposd.config import Config, parse_config
from atroposd.daemon.watchdog import StallWatchdog, WatchedSync
from atroposd.heartbeat import Beat
from atroposd.process.liveness import HeartbeatBoard
from atroposd.process.logfiles import LogHub
from atroposd.process.probes import HttpProbe, StartedProbe
from atroposd.process.unit import State, Unit, UnitSpec
from atroposd.trainer.loop import Progress
from atroposd.weights.client import WeightControlError
from atroposd.weights.sync import SharedSync
from tests.support import free_port, spawn, wait_for

STALL = 0.2


class _Trainer:
    def __init__(self) -> None:
        self.progress = Progress(total_steps=100, state="training", waiting_for=None)


def _cfg(api_port: int) -> Config:
    return parse_config(
        {"api": {"port": api_port}, "trainer": {"stall_timeout": STALL, "batch_size": 8, "micro_batch_size": 8}}
    )


def _units(hub: LogHub) -> dict[str, Unit]:
    out = {}
    for name, kind in (("api", "api"), ("inference", "inference"), ("arithmetic-0", "env")):
        spec = UnitSpec(
            name=name, kind=kind, argv=["true"], env={}, probe=StartedProbe(0.1), ready_timeout=1, stop_timeout=1
        )
        out[name] = Unit(spec, logs=hub)
    return out


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[LogHub]:
    h = LogHub(tmp_path / "logs", max_bytes=1 << 20, backups=1)
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def fake_api() -> Iterator[int]:
    """The stand-in API (tests/child_scripts/fake_api.py): /status holds 3 sequences."""
    import sys

    port = free_port()
    script = Path(__file__).resolve().parent.parent / "child_scripts" / "fake_api.py"
    proc = spawn([sys.executable, str(script), str(port)])
    try:
        import urllib.request

        def up() -> bool:
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/info", timeout=1).status == 200
            except OSError:
                return False

        wait_for(up, timeout=20, what="the stand-in API")
        yield port
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _watchdog(
    cfg: Config,
    trainer: _Trainer,
    units: dict[str, Unit],
    board: HeartbeatBoard,
    ended: list[str],
    weights: WatchedSync | None = None,
) -> StallWatchdog:
    return StallWatchdog(cfg, trainer=trainer, units=units, board=board, weights=weights, on_unresolved=ended.append)


async def _stalled_tick(w: StallWatchdog) -> None:
    await anyio.sleep(STALL * 1.1)
    await w.tick()


def test_a_stall_in_the_trainers_own_step_is_named_and_ends_the_job_at_twice_the_timeout(hub: LogHub) -> None:
    trainer, ended = _Trainer(), []  # type: ignore[var-annotated]
    w = _watchdog(_cfg(free_port()), trainer, _units(hub), HeartbeatBoard(), ended)

    async def main() -> None:
        await w.tick()
        assert w.annotate(trainer_status())["state"] == "training"
        await _stalled_tick(w)
        st = w.annotate(trainer_status())
        assert st["state"] == "stalled" and st["stage"] == "trainer" and st["blamed"] == []
        assert st["stalled_for_s"] >= STALL * 0.9
        assert ended == []
        await _stalled_tick(w)
        assert len(ended) == 1 and "twice stall_timeout" in ended[0]
        await _stalled_tick(w)
        assert len(ended) == 1  # once

    def trainer_status() -> dict[str, Any]:
        p = trainer.progress
        return {"state": p.state, "step": p.step}

    anyio.run(main)


def test_a_step_resolves_the_stall(hub: LogHub) -> None:
    trainer, ended = _Trainer(), []  # type: ignore[var-annotated]
    w = _watchdog(_cfg(free_port()), trainer, _units(hub), HeartbeatBoard(), ended)

    async def main() -> None:
        await w.tick()
        await _stalled_tick(w)
        assert w.stall is not None
        trainer.progress.step += 1
        await w.tick()
        assert w.stall is None and w.annotate({"state": "training"})["state"] == "training"
        assert w.stalls == 1

    anyio.run(main)


def test_waiting_for_data_names_the_api_environments_or_inference(hub: LogHub, fake_api: int) -> None:
    board = HeartbeatBoard()
    units = _units(hub)

    async def stage(cfg: Config) -> tuple[str, tuple[str, ...]]:
        trainer, ended = _Trainer(), []  # type: ignore[var-annotated]
        trainer.progress.state, trainer.progress.waiting_for = "waiting", "data"
        w = _watchdog(cfg, trainer, units, board, ended)
        await w.tick()
        await _stalled_tick(w)
        assert w.stall is not None
        return w.stall.stage, w.stall.blamed

    async def main() -> None:
        # The API does not answer: no data from the API.
        assert await stage(_cfg(free_port())) == ("api", ("api",))
        # It answers and holds less than a batch (3 < 8): it waits on the environments.
        assert await stage(_cfg(fake_api)) == ("environments", ("arithmetic-0",))
        # An environment's heartbeat says its generation has waited long: inference is to blame.
        board.record(Beat(name="arithmetic-0", pid=os.getpid(), data={"oldest_generation_s": 120.0}))
        assert await stage(_cfg(fake_api)) == ("inference", ("inference",))

    anyio.run(main)


def test_a_weight_sync_that_does_not_return_is_bounded_named_and_counted(hub: LogHub, tmp_path: Path) -> None:
    """A server that accepts on its control socket and never answers: the pause is given up at
    its deadline (the step goes on), the watchdog names ``weight_sync`` meanwhile, and restarts
    the server (here a stand-in child) for the timed-out request."""
    import sys

    sock = tmp_path / "inf.sock"
    inner = SharedSync(nonce="test", weights_dir=tmp_path / "w", control_socket=sock)
    inner.deadline = 1.0
    watched = WatchedSync(inner)
    trainer, ended = _Trainer(), []  # type: ignore[var-annotated]
    port = free_port()
    script = Path(__file__).resolve().parent.parent / "child_scripts" / "fake_api.py"
    server = Unit(
        UnitSpec(
            name="inference",
            kind="inference",
            argv=[sys.executable, str(script), str(port)],
            env=dict(os.environ),
            probe=HttpProbe(f"http://127.0.0.1:{port}/info"),
            ready_timeout=20,
            stop_timeout=3,
        ),
        logs=hub,
    )
    w = _watchdog(_cfg(free_port()), trainer, {"inference": server}, HeartbeatBoard(), ended, weights=watched)
    held: list[Any] = []

    async def main() -> None:
        listener = await anyio.create_unix_listener(sock)
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(server.supervise)
            with anyio.fail_after(30):
                await server.wait_until(lambda u: u.state == State.READY)
            first = server.pid

            async def hold() -> None:
                async def keep(conn: Any) -> None:
                    held.append(conn)
                    await anyio.sleep_forever()

                await listener.serve(keep)

            tg.start_soon(hold)
            await w.tick()
            stepped = anyio.Event()

            async def step() -> None:
                async with watched.paused(1):
                    stepped.set()

            t0 = time.monotonic()
            tg.start_soon(step)
            await _stalled_tick(w)
            assert w.stall is not None and w.stall.stage == "weight_sync" and w.stall.blamed == ("inference",)
            with anyio.fail_after(10):
                await stepped.wait()
            assert 0.9 <= time.monotonic() - t0 < 5
            assert watched.busy is None or watched.busy[0] == "resume"
            assert watched.sync_timeouts == 1 and inner.server_current is False
            await w.tick()  # the timed-out request restarts the server
            with anyio.fail_after(30):
                await server.wait_until(lambda u: u.state == State.READY and u.pid != first)
            assert server.last_exit is not None and server.last_exit.reason == "hung"
            assert server.last_hung is not None and "weight sync" in server.last_hung["reason"]
            server.request_stop()
            with anyio.fail_after(30):
                await server.done.wait()
            tg.cancel_scope.cancel()
        for conn in held:
            await conn.aclose()

    anyio.run(main)


def test_a_timed_out_control_request_is_an_unreachable_server(tmp_path: Path) -> None:
    from atroposd.weights.client import WeightControlClient

    sock = tmp_path / "c.sock"

    async def main() -> None:
        listener = await anyio.create_unix_listener(sock)
        conns: list[Any] = []
        async with listener, anyio.create_task_group() as tg:

            async def keep(conn: Any) -> None:
                conns.append(conn)
                await anyio.sleep_forever()

            tg.start_soon(listener.serve, keep)
            client = WeightControlClient(sock, timeout=0.3)
            try:
                with pytest.raises(WeightControlError) as info:
                    await client.pause()
            finally:
                await client.close()
            assert info.value.timed_out and info.value.status is None
            assert "did not answer within 0.3s" in str(info.value)
            tg.cancel_scope.cancel()
        for conn in conns:
            await conn.aclose()

    anyio.run(main)


def test_steps_per_s_is_measured_over_a_recent_window() -> None:
    from atroposd.trainer.loop import STEPS_WINDOW_S

    p = Progress(total_steps=100)
    assert p.steps_per_s is None  # no step yet
    now = time.monotonic()
    p.step_times.extend([now - STEPS_WINDOW_S - 20 + i * 0.1 for i in range(10)])  # fast, long ago
    assert p.steps_per_s == 0.0  # nothing moved in the window: 0, not the old 10 steps/s
    p.step_times.extend([now - 2.0, now - 1.0])
    assert p.steps_per_s == pytest.approx(2 / STEPS_WINDOW_S)  # the window is covered in full
    q = Progress(total_steps=100)
    q.step_times.extend([now - 2.0, now - 1.5, now - 1.0])
    assert q.steps_per_s == pytest.approx(2 / 2.0, rel=0.05)  # from its first step to now


def _ranks_cfg(ranks: int, stall: float) -> Config:
    # the defaults' ratio: collective_timeout = 2 × stall_timeout (600 s and 300 s)
    return parse_config(
        {
            "trainer": {
                "stall_timeout": stall,
                "collective_timeout": 2 * stall,
                "device": ["cpu"] * ranks,
                "weight_sync": "push",
                "batch_size": 8,
                "micro_batch_size": 4,
            }
        }
    )


async def _hold(w: StallWatchdog, seconds: float) -> None:
    """Tick the watchdog at its own period for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await anyio.sleep(w.period)
        await w.tick()


def test_the_clock_stops_across_a_group_restart(hub: LogHub) -> None:
    """A stuck collective runs to collective_timeout, the group re-forms for longer than twice
    stall_timeout, and training goes on: the watchdog never ends the job; with one rank (no group
    timeout to wait for) the same silence ends it."""
    stall = 0.2

    async def restart_sequence(w: StallWatchdog, trainer: _Trainer) -> None:
        p = trainer.progress
        await w.tick()
        await _hold(w, 2 * stall * 0.95)  # a collective stuck until the group's timeout fires
        p.state, p.waiting_for = "waiting", "ranks"  # the group restarts
        await _hold(w, 3 * stall)
        p.state, p.waiting_for = "training", None  # re-formed: the step from the checkpoint
        await _hold(w, stall / 3)
        p.step += 1
        await w.tick()

    ended: list[str] = []
    trainer = _Trainer()
    w = _watchdog(_ranks_cfg(2, stall), trainer, _units(hub), HeartbeatBoard(), ended)
    anyio.run(restart_sequence, w, trainer)
    assert ended == [] and w.stall is None and w.stalls == 0
    assert w.annotate({"state": "training"})["state"] == "training"

    one: list[str] = []
    trainer = _Trainer()
    w = _watchdog(_ranks_cfg(1, stall), trainer, _units(hub), HeartbeatBoard(), one)
    anyio.run(restart_sequence, w, trainer)
    assert len(one) == 1 and "twice stall_timeout" in one[0]


def test_past_collective_timeout_the_clock_runs_again(hub: LogHub) -> None:
    stall = 0.2
    ended: list[str] = []
    trainer = _Trainer()
    w = _watchdog(_ranks_cfg(2, stall), trainer, _units(hub), HeartbeatBoard(), ended)

    async def main() -> None:
        await w.tick()
        await _hold(w, 2 * stall * 0.9)  # inside collective_timeout: not a stall
        assert w.stall is None and ended == []
        await _hold(w, 2 * stall + 1.5 * stall)  # past it: stalled in the trainer, then the end
        assert w.stalls == 1 and len(ended) == 1 and "the trainer's own step" in ended[0]

    anyio.run(main)


def test_checkpoint_time_never_counts_as_a_stall(hub: LogHub) -> None:
    """SPEC §12.1: a checkpoint that takes three times stall_timeout (one rank: no group timeout
    stops the clock) is not a stall; the same silence in training is."""
    stall = 0.2
    ended: list[str] = []
    trainer = _Trainer()
    w = _watchdog(_ranks_cfg(1, stall), trainer, _units(hub), HeartbeatBoard(), ended)

    async def main() -> None:
        p = trainer.progress
        p.state = "checkpointing"
        await w.tick()
        await _hold(w, 3 * stall)
        assert w.stall is None and ended == [] and w.stalls == 0
        p.state = "training"
        await _hold(w, 2.5 * stall)
        assert w.stalls == 1 and len(ended) == 1

    anyio.run(main)


@pytest.mark.slow
def test_a_stuck_collective_restarts_the_group_under_the_watchdog(short_tmp: Path) -> None:
    """A real job with two gloo ranks and stall_timeout : collective_timeout in the defaults'
    ratio (1 : 2): rank 1 stopped with SIGSTOP holds a collective past collective_timeout; the
    group restarts from its checkpoint and training goes on — the watchdog, whose 2 × stall_timeout
    equals collective_timeout, does not end the job meanwhile."""
    import signal

    from tests.e2e.jobs import component, daemon_env, replica_job_config, status
    from tests.support import atroposd

    stall = 8.0
    cfg = replica_job_config(
        short_tmp,
        replicas=1,
        steps=100_000,
        daemon={"stop_timeout": 5.0},
        trainer={
            "device": ["cpu", "cpu"],
            "batch_size": 16,
            "micro_batch_size": 4,
            "join_timeout": 120.0,
            "checkpoint_every": 3,
            "restart_window": 600.0,
            "stall_timeout": stall,
            "collective_timeout": 2 * stall,
        },
    )
    res = atroposd("start", "-c", str(cfg), env=daemon_env(), timeout=300)
    try:
        assert res.returncode == 0, f"start exited {res.returncode}: {res.stderr[-3000:]}"
        wait_for(
            lambda: status(cfg)["trainer"]["last_checkpoint"] is not None,
            timeout=180,
            interval=0.5,
            what="a checkpoint",
        )
        st = status(cfg)
        rank1, before = component(st, "trainer-1"), st["trainer"]["step"]
        os.kill(rank1["pid"], signal.SIGSTOP)
        wait_for(
            lambda: status(cfg)["trainer"]["group_restarts"] >= 1,
            timeout=120,
            interval=0.5,
            what="the trainer group to restart after a stuck collective",
        )
        wait_for(
            lambda: status(cfg)["trainer"]["step"] > before + 1,
            timeout=180,
            interval=0.5,
            what="training past the pre-stop step",
        )
        st = status(cfg)
        assert st["state"] == "running", st["trainer"]
        log = (short_tmp / "state" / "logs" / "daemon.log").read_text(errors="replace")
        assert "stall not resolved" not in log
        assert not [line for line in log.splitlines() if "trainer stalled" in line and '"stage":"trainer"' in line]
    finally:
        atroposd("stop", "-c", str(cfg), env=daemon_env(), timeout=120)

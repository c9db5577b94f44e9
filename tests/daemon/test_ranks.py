"""This node's trainer-rank units (``daemon/ranks.py``, ``Fleet``) over real child processes:
a rank that exits on its own is named with how it ended; one the daemon stopped, or one whose
unit was replaced by a newer group's, is not."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from atroposd.daemon.ranks import Fleet
from atroposd.process.logfiles import LogHub
from atroposd.process.probes import StartedProbe
from atroposd.process.unit import State, Unit, UnitSpec
from atroposd.trainer.supervisor import RankExited

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[LogHub]:
    h = LogHub(tmp_path / "logs", max_bytes=1 << 20, backups=1)
    yield h
    h.close()


class Host:
    """A stand-in daemon: real units supervised in a task group (what ``Fleet`` uses)."""

    def __init__(self, hub: LogHub, tg: anyio.abc.TaskGroup) -> None:
        self.hub, self.tg = hub, tg
        self.units: dict[str, Unit] = {}

    def add_unit(self, spec: UnitSpec, **kw: Any) -> Unit:
        unit = Unit(spec, logs=self.hub, on_change=lambda u: None)
        self.units[spec.name] = unit
        self.tg.start_soon(unit.supervise)
        return unit

    async def stop_units(self, units: list[Unit]) -> None:
        for u in units:
            u.request_stop()
        for u in units:
            await u.done.wait()


def rank_spec(name: str, code: str) -> UnitSpec:
    return UnitSpec(
        name=name,
        kind="trainer",
        argv=[sys.executable, "-c", code],
        env=dict(os.environ),
        probe=StartedProbe(0.2),
        ready_timeout=20.0,
        stop_timeout=3.0,
        restart="never",
    )


async def test_a_rank_that_exits_on_its_own_is_named_one_stopped_is_not(hub: LogHub) -> None:
    async with anyio.create_task_group() as tg:
        host = Host(hub, tg)
        ranks = Fleet(host)  # type: ignore[arg-type]
        crashed = host.add_unit(rank_spec("trainer-1", "import time, sys; time.sleep(0.5); sys.exit(3)"))
        killed = host.add_unit(rank_spec("trainer-2", "import time; time.sleep(60)"))
        stopped = host.add_unit(rank_spec("trainer-3", "import time; time.sleep(60)"))
        other = host.add_unit(UnitSpec(**{**vars(rank_spec("env-0", "import time; time.sleep(60)")), "kind": "env"}))
        with anyio.fail_after(20):
            await killed.wait_until(lambda u: u.pid is not None and u.state == State.READY)
            await stopped.wait_until(lambda u: u.state == State.READY)
            assert ranks.exit_of(killed) is None  # running
            os.kill(killed.pid, signal.SIGKILL)  # type: ignore[arg-type]
            await crashed.done.wait()
            await killed.done.wait()
        assert ranks.exit_of(crashed) == "exited with code 3"
        assert ranks.exit_of(killed) == "killed by SIGKILL (possibly the out-of-memory killer)"
        assert sorted(ranks.exited()) == [
            "trainer-1 exited with code 3",
            "trainer-2 killed by SIGKILL (possibly the out-of-memory killer)",
        ]
        assert [u.name for u in ranks.units()] == ["trainer-1", "trainer-2", "trainer-3"]  # no env
        # each exit on its own is a typed fault on the fleet's one stream, in order
        for unit in (crashed, killed, other):
            ranks.unit_changed(unit)
        assert [ranks.faults().get_nowait(), ranks.faults().get_nowait(), ranks.faults().get_nowait()] == [
            RankExited("trainer-1", "exited with code 3"),
            RankExited("trainer-2", "killed by SIGKILL (possibly the out-of-memory killer)"),
            None,  # not a rank
        ]
        with anyio.fail_after(20):
            await ranks.stop()  # the ranks still running: trainer-3 only
        assert stopped.done.is_set() and not other.done.is_set()
        assert ranks.exit_of(stopped) is None and "trainer-3" not in " ".join(ranks.exited())
        ranks.unit_changed(stopped)  # asked to stop: no fault
        assert ranks.faults().get_nowait() is None
        # a newer group's unit under the same name: the old one's exit is no longer news
        host.units["trainer-1"] = stopped
        assert ranks.exit_of(crashed) is None
        await host.stop_units([other])

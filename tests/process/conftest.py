"""Fixtures for process-unit tests: a log hub in a temporary directory and a runner that
supervises a unit in a task group and always stops it."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from atroposd.process.logfiles import LogHub
from atroposd.process.probes import Probe, StartedProbe
from atroposd.process.unit import Unit, UnitSpec

SCRIPTS = Path(__file__).resolve().parent.parent / "child_scripts"


def script(name: str, *args: str) -> list[str]:
    return [sys.executable, str(SCRIPTS / name), *args]


def make_spec(name: str, argv: list[str], *, probe: Probe | None = None, **kw: Any) -> UnitSpec:
    import os

    base: dict[str, Any] = dict(
        kind="env",
        env=dict(os.environ),
        ready_timeout=20.0,
        stop_timeout=3.0,
        restart="always",
        max_restarts=5,
        restart_window=60.0,
    )
    base.update(kw)
    return UnitSpec(name=name, argv=argv, probe=probe or StartedProbe(0.2), **base)


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[LogHub]:
    h = LogHub(tmp_path / "logs", max_bytes=1 << 20, backups=2)
    try:
        yield h
    finally:
        h.close()


def supervise(spec: UnitSpec, hub: LogHub, body: Callable[[Unit], Awaitable[None]], **kw: Any) -> Unit:
    """Run ``body(unit)`` while the unit is supervised; then stop it and wait for the end."""
    unit = Unit(spec, logs=hub, **kw)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(unit.supervise)
            try:
                with anyio.fail_after(60):
                    await body(unit)
            finally:
                unit.request_stop()
                with anyio.CancelScope(shield=True), anyio.fail_after(30):
                    await unit.done.wait()

    anyio.run(main)
    return unit

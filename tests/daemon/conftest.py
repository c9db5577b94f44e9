"""Fixtures for daemon tests: a job whose children are purpose-built scripts (trainer and
inference disabled), run through the real CLI; the daemon is always stopped at teardown."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support import atroposd, free_port, wait_for, write_config

SCRIPTS = Path(__file__).resolve().parent.parent / "child_scripts"


def script(name: str, *args: str) -> list[str]:
    return [sys.executable, str(SCRIPTS / name), *args]


def env(name: str, command: list[str], **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"name": name, "command": command, "ready": "started", "start_seconds": 0.2}
    base.update(kw)
    return base


@dataclass
class Job:
    dir: Path
    config: Path
    sections: dict[str, Any] = field(default_factory=dict)

    @property
    def runtime_dir(self) -> Path:
        return self.dir / "run"

    @property
    def state_dir(self) -> Path:
        return self.dir / "state"

    def write(self, **over: Any) -> Path:
        self.sections.update(over)
        write_config(self.config, self.sections)
        return self.config

    def cli(self, *args: str, timeout: float = 60, **kw: Any) -> Any:
        return atroposd(*args, "-c", str(self.config), timeout=timeout, **kw)

    def status(self) -> dict[str, Any]:
        r = self.cli("status", "--json")
        assert r.returncode == 0, r.stderr
        return dict(json.loads(r.stdout))

    def component(self, name: str) -> dict[str, Any]:
        return next(c for c in self.status()["components"] if c["name"] == name)

    def daemon_pid(self) -> int | None:
        try:
            text = (self.runtime_dir / "atroposd.pid").read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def wait_state(self, name: str, state: str, timeout: float = 30) -> dict[str, Any]:
        return dict(
            wait_for(
                lambda: (c := self.component(name))["state"] == state and c, timeout=timeout, what=f"{name} {state}"
            )
        )


def base_sections(d: Path, envs: list[dict[str, Any]], **over: Any) -> dict[str, Any]:
    sections: dict[str, Any] = {
        "daemon": {
            "runtime_dir": str(d / "run"),
            "state_dir": str(d / "state"),
            "stop_timeout": 3.0,
            "log_format": "json",
            "checkpoint_timeout": 5.0,
        },
        "api": {"enabled": False, "url": f"http://127.0.0.1:{free_port()}"},
        "inference": {"enabled": False, "url": f"http://127.0.0.1:{free_port()}"},
        "trainer": {"enabled": False},
        "env": envs,
    }
    for k, v in over.items():
        sections[k] = {**sections.get(k, {}), **v} if isinstance(v, dict) else v
    return sections


@pytest.fixture
def job(short_tmp: Path) -> Iterator[Job]:
    j = Job(short_tmp, short_tmp / "atroposd.toml")
    try:
        yield j
    finally:
        _teardown(j)


def _teardown(j: Job) -> None:
    if not j.config.exists():
        return
    pid = j.daemon_pid()
    if pid is None or not psutil.pid_exists(pid):
        return
    r = j.cli("stop", "--timeout", "20", timeout=30)
    if r.returncode not in (0, 3):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

"""A real container engine per test module (podman's Docker-compatible service, stopped by its
pid at the end), and jobs whose environments reach it through the daemon's sockets."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.conftest import Job, _teardown, base_sections
from tests.sandbox.engine import IMAGE, Podman, missing

SLEEPER = [sys.executable, "-c", "import time\nwhile True: time.sleep(1)"]


@pytest.fixture(scope="module")
def podman() -> Iterator[Podman]:
    why = missing()
    if why is not None:
        pytest.skip(f"no container engine here: {why}")
    d = Path(tempfile.mkdtemp(prefix="apd-pm-", dir="/tmp"))
    engine = Podman(d)
    try:
        engine.start()
    except Exception as exc:
        engine.stop()
        pytest.skip(f"no container engine here: podman's service did not start: {exc}")
    try:
        yield engine
    finally:
        engine.stop()


def sandbox_env(name: str, command: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": name,
        "command": command or SLEEPER,
        "ready": "started",
        "start_seconds": 0.2,
        "restart": "always",
        "live_interval": 0,  # the test drives its socket while the environment sleeps
    }
    base.update(kw)
    return base


def sandbox_job(d: Path, podman: Podman, envs: list[dict[str, Any]], **sandbox: Any) -> Job:
    job = Job(d, d / "atroposd.toml")
    job.write(**base_sections(d, envs, sandbox={"engine": podman.url, **sandbox}))
    return job


def socket_of(job: Job, unit: str) -> str:
    return f"unix://{job.runtime_dir / 'sandbox' / f'{unit}.sock'}"


@pytest.fixture
def sandbox_tmp() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="apd-sb-", dir="/tmp"))
    job = Job(d, d / "atroposd.toml")
    try:
        yield d
    finally:
        _teardown(job)
        shutil.rmtree(d, ignore_errors=True)


__all__ = ["IMAGE", "SLEEPER", "sandbox_env", "sandbox_job", "socket_of"]

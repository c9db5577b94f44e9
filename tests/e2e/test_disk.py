"""A full disk under state_dir is a clear error naming it, not a traceback; nothing is left running."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.jobs import daemon_env, job_config
from tests.support import atroposd


@pytest.fixture
def tiny_disk(short_tmp: Path) -> Iterator[Path]:
    """A 400 KiB tmpfs: too small for the built-in model's weights."""
    mnt = short_tmp / "disk"
    mnt.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mnt)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_is_a_clear_start_error(short_tmp: Path, tiny_disk: Path) -> None:
    cfg = job_config(
        short_tmp, daemon={"state_dir": str(tiny_disk / "state"), "log_format": "console"}, prebuilt_model=False
    )
    res = atroposd("run", "-c", str(cfg), env=daemon_env(), timeout=180)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-3000:]
    assert "No space left on device" in out and str(tiny_disk / "state") in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert not (short_tmp / "run" / "control.sock").exists()

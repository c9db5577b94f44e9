"""The package's own programs start with the working directory off ``sys.path``: a stray
module there never shadows the real one (PYTHONPATH still works)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from atroposd import __version__
from atroposd.exitcodes import Exit
from atroposd.pyexec import python_module

REPO = Path(__file__).resolve().parent.parent


def _poisoned(tmp_path: Path) -> tuple[Path, Path]:
    """A working directory whose ``atroposd`` package leaves a marker when imported."""
    cwd, marker = tmp_path / "cwd", tmp_path / "imported-from-cwd"
    (cwd / "atroposd").mkdir(parents=True)
    (cwd / "atroposd" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n__version__ = 'fake'\n")
    (cwd / "atroposd" / "__main__.py").write_text("raise SystemExit(99)\n")
    return cwd, marker


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_python_module_keeps_the_working_directory_off_the_path(tmp_path: Path) -> None:
    cwd, marker = _poisoned(tmp_path)
    plain = subprocess.run(
        [sys.executable, "-m", "atroposd", "--version"],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert plain.returncode == 99 and marker.exists()  # what `python -m` does: the cwd wins
    marker.unlink()
    r = subprocess.run(
        [*python_module("atroposd"), "--version"],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0 and r.stdout.strip() == f"atroposd {__version__}", r.stderr
    assert not marker.exists()


def test_start_runs_the_daemon_without_the_working_directory(tmp_path: Path) -> None:
    """`atroposd start` from a directory holding a stray package: the daemon it starts is the
    real one (here it refuses a symlinked runtime_dir at once, so nothing keeps running)."""
    cwd, marker = _poisoned(tmp_path)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "run").symlink_to(tmp_path / "elsewhere")
    cfg = tmp_path / "a.toml"
    cfg.write_text(f'[daemon]\nruntime_dir = "{tmp_path}/run"\nstate_dir = "{tmp_path}/state"\n')
    r = subprocess.run(
        [*python_module("atroposd"), "start", "-c", str(cfg)],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == Exit.RUNTIME, r.stderr
    assert "failed to start (exit 1)" in r.stderr and "symlink" in r.stderr
    assert not marker.exists()

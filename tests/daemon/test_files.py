"""The files a job writes are its user's (SPEC §9, §12.1): state, logs and recovery directories
created 0700, the daemon's umask private whatever the caller's, and a checkpoint_dir that
another user could write refused at start."""

from __future__ import annotations

import argparse
import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from atroposd.config import parse_config
from atroposd.paths import Paths, UnsafeDirError, check_checkpoint_dir


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_state_dirs_are_created_0700_whatever_the_umask(tmp_path: Path) -> None:
    paths = Paths(runtime_dir=tmp_path / "run", state_dir=tmp_path / "state")
    with _umask(0):
        paths.ensure_state_dirs()
    assert [_mode(d) for d in (paths.state_dir, paths.logs_dir, paths.recovery_dir)] == [0o700] * 3
    paths.logs_dir.chmod(0o750)  # one that exists is left as it is
    paths.ensure_state_dirs()
    assert _mode(paths.logs_dir) == 0o750


def test_a_checkpoint_dir_others_can_write_is_refused(tmp_path: Path) -> None:
    fresh = tmp_path / "a" / "checkpoints"
    with _umask(0):
        check_checkpoint_dir(fresh)
    assert _mode(fresh) == 0o700
    fresh.chmod(0o755)
    check_checkpoint_dir(fresh)  # ours, readable by others, writable by us only: fine
    for mode, who in ((0o775, "group"), (0o757, "others"), (0o777, "group and others")):
        fresh.chmod(mode)
        with pytest.raises(UnsafeDirError, match=f"trainer.checkpoint_dir: .* writable by {who}:"):
            check_checkpoint_dir(fresh)
    fresh.chmod(0o1777)  # sticky or not: anyone may add a step directory
    with pytest.raises(UnsafeDirError, match="chmod go-w"):
        check_checkpoint_dir(fresh)
    if os.geteuid() == 0:
        fresh.chmod(0o700)
        os.chown(fresh, 65534, 65534)
        with pytest.raises(UnsafeDirError, match="belongs to uid 65534"):
            check_checkpoint_dir(fresh)


def test_run_makes_the_umask_private_before_writing_the_daemon_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``atroposd run`` outside systemd: what it and its children create is the user's only, as
    under the unit's UMask=0077 (the run itself is replaced: only its start is under test)."""
    import atroposd.daemon.core
    import atroposd.logs
    from atroposd import commands

    cfg = parse_config({"daemon": {"runtime_dir": str(tmp_path / "run"), "state_dir": str(tmp_path / "state")}})
    seen: list[int] = []

    def run_foreground(cfg: object, notifier: object) -> int:
        mask = os.umask(0o077)
        os.umask(mask)
        seen.append(mask)
        return 0

    monkeypatch.setattr(atroposd.daemon.core, "run_foreground", run_foreground)
    streams: list[Any] = []  # the session's logging stays as it is
    monkeypatch.setattr(atroposd.logs, "configure_logging", lambda *a, stream, **k: streams.append(stream))
    with _umask(0o002):
        assert commands.run(cfg, argparse.Namespace()) == 0
    streams[0]._file.close()
    assert seen == [0o077]
    log = Paths.of(cfg).log_file("daemon")
    assert _mode(log.parent) == 0o700 and _mode(tmp_path / "state") == 0o700
    assert log.exists() and _mode(log) & 0o077 == 0


def test_the_daemon_refuses_a_group_writable_checkpoint_dir(short_tmp: Path) -> None:
    """A real ``atroposd run``: exit 1 before anything starts, the key and the fix named."""
    from tests.support import atroposd

    ckpts = short_tmp / "ckpts"
    ckpts.mkdir()
    ckpts.chmod(0o775)
    cfg = short_tmp / "atroposd.toml"
    cfg.write_text(
        f'[daemon]\nruntime_dir = "{short_tmp}/run"\nstate_dir = "{short_tmp}/state"\n'
        f'[trainer]\ncheckpoint_dir = "{ckpts}"\n'
    )
    done = atroposd("run", "-c", str(cfg), timeout=60)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "trainer.checkpoint_dir" in out and "writable by group" in out, out
    assert not (short_tmp / "state" / "logs" / "api.log").exists()  # nothing started

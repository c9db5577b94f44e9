"""runtime_dir is ours and private before anything goes in it; systemd's directories are
the defaults; files there are opened without following links (SPEC §13)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from atroposd.config import (
    default_runtime_dir,
    default_state_dir,
    fallback_runtime_dir,
    parse_config,
)
from atroposd.exitcodes import Exit
from atroposd.paths import Paths, RuntimeDirError, ensure_runtime_dir, open_nofollow
from tests.support import atroposd


def test_missing_runtime_dir_is_created_0700(tmp_path: Path) -> None:
    rt = tmp_path / "a" / "run"
    ensure_runtime_dir(rt, fallback=True)
    assert rt.is_dir() and (rt.stat().st_mode & 0o777) == 0o700


def test_a_loose_fallback_is_refused_a_loose_configured_one_tightened(tmp_path: Path) -> None:
    rt = tmp_path / "run"
    rt.mkdir(mode=0o755)
    rt.chmod(0o755)
    with pytest.raises(RuntimeDirError, match="mode 0755, not 0700"):
        ensure_runtime_dir(rt, fallback=True)
    assert (rt.stat().st_mode & 0o777) == 0o755  # refused, left alone
    ensure_runtime_dir(rt)
    assert (rt.stat().st_mode & 0o777) == 0o700
    ensure_runtime_dir(rt, fallback=True)  # ours with 0700: fine


def test_a_symlink_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "run").symlink_to(target)
    for fallback in (True, False):
        with pytest.raises(RuntimeDirError, match="symlink"):
            ensure_runtime_dir(tmp_path / "run", fallback=fallback)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory owned by another user")
def test_another_users_directory_is_refused(tmp_path: Path) -> None:
    rt = tmp_path / "run"
    rt.mkdir(mode=0o700)
    os.chown(rt, 65534, 65534)
    for fallback in (True, False):
        with pytest.raises(RuntimeDirError, match="belongs to uid 65534"):
            ensure_runtime_dir(rt, fallback=fallback)


def test_only_the_tmp_fallback_is_checked_strictly(tmp_path: Path) -> None:
    assert Paths.of(parse_config({"daemon": {"runtime_dir": str(fallback_runtime_dir())}})).runtime_dir_is_fallback
    assert not Paths.of(parse_config({"daemon": {"runtime_dir": str(tmp_path)}})).runtime_dir_is_fallback


def test_systemd_directories_are_the_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RUNTIME_DIRECTORY", f"{tmp_path}/rt:/run/other")
    monkeypatch.setenv("STATE_DIRECTORY", f"{tmp_path}/state")
    assert default_runtime_dir() == tmp_path / "rt"
    assert default_state_dir() == tmp_path / "state"
    cfg = parse_config({})
    assert cfg.runtime_dir == tmp_path / "rt" and cfg.state_dir == tmp_path / "state"
    monkeypatch.setenv("RUNTIME_DIRECTORY", "relative")  # not systemd's: ignored
    monkeypatch.delenv("STATE_DIRECTORY")
    assert default_runtime_dir() != Path("relative") and default_state_dir() != tmp_path / "state"


def test_open_nofollow_refuses_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "atroposd.pid").symlink_to(victim)
    with pytest.raises(OSError) as exc:
        open_nofollow(tmp_path / "atroposd.pid", os.O_RDWR | os.O_CREAT)
    assert exc.value.errno == errno.ELOOP
    assert victim.read_text() == "keep"
    os.close(open_nofollow(tmp_path / "fresh", os.O_RDWR | os.O_CREAT | os.O_EXCL))
    assert (tmp_path / "fresh").stat().st_mode & 0o777 == 0o600


def test_run_refuses_an_untrusted_runtime_dir(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "run").symlink_to(target)
    cfg = tmp_path / "a.toml"
    cfg.write_text(f'[daemon]\nruntime_dir = "{tmp_path}/run"\nstate_dir = "{tmp_path}/state"\n')
    r = atroposd("run", "-c", str(cfg), timeout=60)
    assert r.returncode == Exit.RUNTIME and "symlink" in r.stderr
    assert list(target.iterdir()) == []  # nothing was put there


@pytest.mark.parametrize("name", ["../secret", "../../etc/passwd", "/etc/passwd", "a/b", ".hidden", "..", ""])
def test_logs_refuses_a_name_that_is_a_path(tmp_path: Path, name: str) -> None:
    secret = tmp_path / "secret.log"
    secret.write_text("not a component's log\n")
    with pytest.raises(ValueError, match="not a component name"):
        Paths(tmp_path / "run", tmp_path / "state").log_file(name)
    cfg = tmp_path / "a.toml"
    cfg.write_text(f'[daemon]\nruntime_dir = "{tmp_path}/run"\nstate_dir = "{tmp_path}/state"\n')
    (tmp_path / "state" / "logs").mkdir(parents=True, exist_ok=True)
    r = atroposd("logs", "-c", str(cfg), "--", name, timeout=60)
    if name:  # an empty name means the daemon's log
        assert r.returncode == Exit.USAGE and "not a component name" in r.stderr
    assert "not a component's log" not in r.stdout


def test_component_names_are_log_names(tmp_path: Path) -> None:
    paths = Paths(tmp_path / "run", tmp_path / "state")
    for name in ("daemon", "api", "inference", "trainer", "gsm8k.v2-0", "my_env-12"):
        assert paths.log_file(name) == tmp_path / "state" / "logs" / f"{name}.log"


def test_socket_group_opens_the_runtime_dir_to_its_members_for_traversal_only(tmp_path: Path) -> None:
    import grp

    group = grp.getgrgid(os.getgid()).gr_name
    rt = tmp_path / "rt"
    ensure_runtime_dir(rt, group=group)
    st = os.stat(rt)
    assert stat.S_IMODE(st.st_mode) == 0o710 and st.st_gid == os.getgid()
    ensure_runtime_dir(rt)  # without the group again: back to private
    assert stat.S_IMODE(os.stat(rt).st_mode) == 0o700
    with pytest.raises(RuntimeDirError, match="no such group"):
        ensure_runtime_dir(rt, group="no-such-group-atroposd")

"""Runtime files and ports: the pidfile lock, links refused, the children's config, the ports checked."""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

import pytest

from atroposd.config import parse_config, parse_toml
from atroposd.daemon.runtime import (
    AlreadyRunning,
    StartFailed,
    check_port,
    lock_pidfile,
    ports_to_check,
    read_pidfile,
    remove_dead_runtime_files,
    write_child_config,
)
from atroposd.paths import Paths


def test_pidfile_lock_is_exclusive_and_names_the_holder(tmp_path: Path) -> None:
    path = tmp_path / "atroposd.pid"
    fd = lock_pidfile(path)
    try:
        assert read_pidfile(path) == os.getpid()
        with pytest.raises(AlreadyRunning) as info:
            lock_pidfile(path)
        assert info.value.pid == os.getpid() and str(path) in str(info.value)
    finally:
        os.close(fd)
    os.close(lock_pidfile(path))  # released with the descriptor


def test_a_link_planted_at_the_pidfile_is_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    path = tmp_path / "atroposd.pid"
    path.symlink_to(victim)
    with pytest.raises(OSError) as info:
        lock_pidfile(path)
    assert info.value.errno == errno.ELOOP
    assert victim.read_text() == "precious\n"
    victim.write_text("1234\n")
    assert read_pidfile(path) is None  # nor when reading it
    assert read_pidfile(tmp_path / "missing") is None


def test_child_config_is_private_atomic_and_replaces_a_planted_link(tmp_path: Path) -> None:
    cfg = parse_config({"daemon": {"runtime_dir": str(tmp_path)}, "trainer": {"steps": 9}})
    paths = Paths.of(cfg)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    target = paths.child_config("n0nce")
    target.symlink_to(victim)
    write_child_config(paths, "n0nce", cfg)
    assert victim.read_text() == "precious\n"
    st = target.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert parse_toml(target.read_text()).trainer.steps == 9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config-n0nce.toml", "victim"]  # no temporary left


def test_a_dead_daemons_runtime_files_are_removed_and_nothing_else(tmp_path: Path) -> None:
    for name in (
        "inference-9001.sock",
        "config-abc.toml",
        ".config-abc.toml.12.34.tmp",
        "control.sock",
        "atroposd.pid",
        "other.toml",
    ):
        (tmp_path / name).write_text("")
    remove_dead_runtime_files(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atroposd.pid", "control.sock", "other.toml"]


def test_ports_checked_are_every_port_the_job_binds() -> None:
    cfg = parse_config(
        {
            "api": {"port": 8100, "host": "0.0.0.0"},
            "inference": {"port": 9100},
            "daemon": {"metrics_port": 9200},
            "env": [
                {"name": "a", "builtin": "arithmetic"},
                {"name": "b", "builtin": "arithmetic", "replicas": 2, "port_base": 7000},
            ],
        }
    )
    assert ports_to_check(cfg) == [
        ("0.0.0.0", 8100, "api.port"),
        ("127.0.0.1", 9100, "inference.port"),
        ("127.0.0.1", 9200, "daemon.metrics_port"),
        ("127.0.0.1", 7000, "env[1].port_base"),
        ("127.0.0.1", 7001, "env[1].port_base"),
    ]
    external = parse_config(
        {
            "api": {"enabled": False, "url": "http://10.0.0.5:8000"},
            "inference": {"enabled": False, "url": "http://10.0.0.6:9001"},
            "trainer": {"enabled": False},
        }
    )
    assert ports_to_check(external) == []


def test_a_port_in_use_names_the_key_and_its_owner() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(
            StartFailed, match=rf"api.port: port {port} on 127.0.0.1 is already in use by pid {os.getpid()}"
        ):
            check_port("127.0.0.1", port, "api.port")
    check_port("127.0.0.1", port, "api.port")  # free again


def test_the_recovery_record_names_this_daemon_and_is_rewritten_when_missing(tmp_path: Path) -> None:
    import time

    from atroposd.daemon.recovery import RecoveryRecord, record_path
    from atroposd.pids import start_ticks
    from atroposd.process.reaper import read_record, record_alive

    cfg = parse_config({"daemon": {"runtime_dir": str(tmp_path / "run"), "state_dir": str(tmp_path / "state")}})
    paths = Paths.of(cfg)
    paths.recovery_dir.mkdir(parents=True)
    ticks = start_ticks(os.getpid())
    assert isinstance(ticks, int)
    record = RecoveryRecord(paths, nonce="n0nce", pid=os.getpid(), start_time=ticks, started_at=time.time())
    record.update(())
    got = read_record(record_path(paths))
    assert got is not None and (got.nonce, got.pid, got.descendants) == ("n0nce", os.getpid(), [])
    # The identity survives the round trip exactly (boot-relative ticks, no wall clock): alive.
    assert got.start_time == ticks and isinstance(got.start_time, int) and record_alive(got)
    got_other = read_record(record_path(paths))
    assert got_other is not None
    got_other.start_time = ticks + 1  # one tick off is another process
    assert not record_alive(got_other)
    assert stat.S_IMODE(record_path(paths).stat().st_mode) == 0o600
    record_path(paths).unlink()
    record.update(())  # nothing changed, but the file is gone: written again
    assert read_record(record_path(paths)) == got
    record.remove()
    assert not record_path(paths).exists()
    record.remove()  # twice is fine
    assert list(paths.recovery_dir.iterdir()) == []

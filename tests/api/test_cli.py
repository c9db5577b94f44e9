"""`atroposd api` as a process: config and flags, exit codes, a clean SIGTERM, and no torch."""

from __future__ import annotations

import socket
from pathlib import Path

import psutil

from atroposd.api.ingest import helper_wanted
from tests.api.conftest import group, start_atroposd
from tests.support import REPO, atroposd, free_port, stop_process, write_config

HEAVY = ("torch", "transformers", "vllm")


def test_running_api_has_no_torch_mapped(tmp_path: Path) -> None:
    """SPEC §1: the API child never imports torch, transformers or vllm (checked on the live
    processes, the API and its parse helper: no file of theirs is mapped)."""
    server = start_atroposd(tmp_path)
    try:
        procs = [server.proc.pid, *(p.pid for p in psutil.Process(server.proc.pid).children())]
        assert len(procs) == (2 if helper_wanted() else 1), "the API and its parse helper (two or more CPUs)"
        for pid in procs:
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert not [line for line in maps.splitlines() if any(f"/{h}/" in line for h in HEAVY)]
    finally:
        assert stop_process(server.proc) == 0  # SIGTERM is a clean stop


def test_config_file_and_flag_overrides(tmp_path: Path) -> None:
    port = free_port()
    cfg = write_config(
        tmp_path / "atroposd.toml",
        {
            "daemon": {"state_dir": str(tmp_path / "state"), "runtime_dir": str(tmp_path / "run")},
            "api": {"port": port, "max_queued_sequences": 32, "full_wait": 0.1},
            "env": [],
        },
    )
    server = start_atroposd(tmp_path, "-c", str(cfg), port=port)
    try:
        assert server.api.ok("GET", "/status")["capacity"] == 32
        server.api.start(batch_size=8)
        server.api.ok("POST", "/scored_data", group(4))
        spool = tmp_path / "state" / "spool" / f"api-{port}"
        assert list(spool.glob("seg-*.log")), "the spool defaults to {state_dir}/spool/api-{port}"
    finally:
        stop_process(server.proc)
    server = start_atroposd(tmp_path, "-c", str(cfg), "--max-queued-sequences", "64", "--no-spool", port=port)
    try:
        status = server.api.ok("GET", "/status")
        assert status["capacity"] == 64 and status["queued_sequences"] == 0  # no spool: nothing replayed
    finally:
        stop_process(server.proc)


def test_without_config_nothing_is_spooled(tmp_path: Path) -> None:
    server = start_atroposd(tmp_path, env={"XDG_STATE_HOME": str(tmp_path / "xdg")})
    try:
        server.api.start(batch_size=8)
        server.api.ok("POST", "/scored_data", group(4))
        assert not (tmp_path / "xdg").exists()
        text = server.log.read_text()
        assert '"spool":null' in text or "spool=None" in text
    finally:
        stop_process(server.proc)


def test_port_in_use_is_exit_1_naming_it() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = atroposd("api", "--port", str(port), timeout=60)
    assert r.returncode == 1
    assert "port already in use" in r.stderr and str(port) in r.stderr


def test_bad_values_are_exit_2() -> None:
    r = atroposd("api", "--max-queued-sequences", "0", timeout=60)
    assert r.returncode == 2 and "--max-queued-sequences" in r.stderr
    r = atroposd("api", "--port", "notaport", timeout=60)
    assert r.returncode == 2


def test_api_package_imports_no_daemon_layer() -> None:
    """The API package sits below the CLI and the daemon: importing every module of it (and
    running its flag parsing) loads none of atroposd.cli/commands/daemon/process, and it keeps
    no copy of is_loopback of its own (atroposd.net has the one)."""
    import subprocess
    import sys

    code = (
        "import argparse, pkgutil, importlib, sys\n"
        "import atroposd.api as p\n"
        "for m in pkgutil.iter_modules(p.__path__): importlib.import_module('atroposd.api.' + m.name)\n"
        "from atroposd.api import cli\n"
        "ap = argparse.ArgumentParser(); ap.add_argument('-c', dest='config'); cli.add_arguments(ap)\n"
        "cli.settings_from(ap.parse_args(['--port', '9']))\n"
        "bad = [m for m in ('atroposd.cli', 'atroposd.commands', 'atroposd.daemon', 'atroposd.process')\n"
        "       if m in sys.modules]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    for path in (REPO / "atroposd" / "api").glob("*.py"):
        assert "def is_loopback" not in path.read_text() and "def _is_loopback" not in path.read_text(), path

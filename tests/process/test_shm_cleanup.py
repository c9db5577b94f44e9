"""Shared memory a component's processes leave when they are killed before their own cleanup
(vLLM's ``psm_*`` message queues) is removed once they are gone, and nothing else is: not a
segment another process still maps, not one older than the component, not atroposd's own
weight segments (their owner unlinks them)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

import anyio

from atroposd.process import reaper
from atroposd.process.logfiles import LogHub
from atroposd.process.unit import State, Unit
from tests.process.conftest import make_spec, script, supervise
from tests.support import spawn, wait_for


def _exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def _create(name: str) -> None:
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)


def _unlink(*names: str) -> None:
    for n in names:
        try:
            os.unlink(f"/dev/shm/{n}")
        except FileNotFoundError:
            pass


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def test_only_unmapped_recent_foreign_segments_are_removed(tmp_path: Path) -> None:
    tag = secrets.token_hex(4)
    old, a, b, own = f"psm_t{tag}_old", f"psm_t{tag}_a", f"psm_t{tag}_b", f"atroposd-t{tag}-0"
    _create(old)
    time.sleep(0.05)
    since = time.time()
    holders: list[subprocess.Popen[bytes]] = []
    try:
        holders.append(spawn(script("shm_holder.py", str(tmp_path / "m1"), old, a, b, own)))
        holders.append(spawn(script("shm_holder.py", str(tmp_path / "m2"), b)))
        wait_for(lambda: (tmp_path / "m1").exists() and (tmp_path / "m2").exists(), what="holders ready")
        mapped = reaper.mapped_shm(pids=[holders[0].pid])
        assert {old, a, b, own} <= set(mapped), mapped
        assert mapped[a] == {holders[0].pid}
        _kill(holders[0])
        assert reaper.unlink_orphaned_segments(mapped, since=since) == [a]
        assert not _exists(a)
        assert _exists(b), "still mapped by another process"
        assert _exists(old), "older than the processes that mapped it"
        assert _exists(own), "atroposd's weight segments are their owner's to unlink"
        # A process about to exit may clean up what only it still maps.
        mapped = reaper.mapped_shm(pids=[holders[1].pid])
        assert reaper.unlink_orphaned_segments(mapped, since=since, ignore_pids=[holders[1].pid]) == [b]
    finally:
        for h in holders:
            _kill(h)
        _unlink(old, a, b, own)


def test_a_stopped_component_leaves_no_segments(hub: LogHub, tmp_path: Path) -> None:
    """The child and its grandchild map segments and ignore SIGTERM: the stop kills them, then
    removes what they mapped (and keeps a segment that predates the component)."""
    tag = secrets.token_hex(4)
    old, a, b = f"psm_t{tag}_old", f"psm_t{tag}_a", f"psm_t{tag}_b"
    marker = tmp_path / "marker"
    _create(old)
    time.sleep(0.05)

    async def body(unit: Unit) -> None:
        await unit.wait_until(lambda u: u.state == State.READY)
        while not marker.exists():  # noqa: ASYNC110 - a file another process writes
            await anyio.sleep(0.02)
        while not unit.tracked:  # the grandchild, seen while it is a descendant
            unit.rescan()
            await anyio.sleep(0.02)
        assert _exists(a) and _exists(b)
        unit.request_stop()
        await unit.done.wait()

    try:
        unit = supervise(
            make_spec(
                "holder",
                script("shm_holder.py", "--grandchild", str(marker), old, a, b),
                stop_timeout=2.0,
                restart="never",
            ),
            hub,
            body,
        )
        assert unit.state == State.STOPPED
        assert not _exists(a) and not _exists(b), "segments left by the stopped component"
        assert _exists(old)
    finally:
        _unlink(old, a, b)


SEMAPHORE_HOLDER = """
import multiprocessing, os, sys, time
lock = multiprocessing.get_context("spawn").Lock()  # a named semaphore, /dev/shm/sem.mp-*
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(lock._semlock.name)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)
"""


def test_a_semaphore_counts_as_mapped_and_is_removed_once_its_holders_are_gone(tmp_path: Path) -> None:
    """multiprocessing's named semaphores (``sem.mp-*``) are mapped under a deleted temporary
    name (glibc's sem_open): they count as mapped by the processes that hold them, and one
    whose holders were killed — its resource tracker with them, as a group kill does — is
    removed."""
    import sys

    since = time.time()
    out = tmp_path / "name"
    holder = spawn([sys.executable, "-c", SEMAPHORE_HOLDER, str(out)])
    name = ""
    try:
        wait_for(out.exists, what="semaphore created")
        name = "sem." + out.read_text().lstrip("/")
        assert _exists(name)
        mapped = reaper.mapped_shm(pids=[holder.pid])
        assert mapped.get(name) == {holder.pid}, mapped
        assert reaper.unlink_orphaned_segments([name], since=since) == [], "its holder lives"
        _kill(holder)
        assert reaper.unlink_orphaned_segments(mapped, since=since) == [name]
        assert not _exists(name)
    finally:
        _kill(holder)
        if name:
            _unlink(name)

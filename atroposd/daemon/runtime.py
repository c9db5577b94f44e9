"""The daemon's runtime files and ports: pidfile lock, port checks, the children's config file.

Every runtime file is opened without following a link (``O_NOFOLLOW``): a link planted in
the runtime directory fails the open instead of redirecting it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
from pathlib import Path

import psutil

from atroposd.config import Config, dump_toml
from atroposd.fsutil import write_atomic
from atroposd.net import is_loopback
from atroposd.paths import Paths, open_nofollow


class AlreadyRunning(Exception):
    def __init__(self, pidfile: Path, pid: int | None) -> None:
        self.pid = pid
        super().__init__(f"a daemon is already running for this config (pid {pid or '?'}, pidfile {pidfile})")


class StartFailed(Exception):
    """The job could not start; the message says which component and why."""


# ----------------------------------------------------------------------------- directories


def prepare_dirs(paths: Paths) -> None:
    """The runtime directory (0700 when it is ours), the state, log and recovery directories."""
    paths.ensure_runtime_dir()  # RuntimeDirError: a link, not a directory, or not ours
    paths.ensure_state_dirs()  # 0700 when created


# ----------------------------------------------------------------------------- pidfile


def lock_pidfile(path: Path) -> int:
    """An exclusive lock on ``path`` held for the daemon's life; raises AlreadyRunning."""
    fd = open_nofollow(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            text = os.read(fd, 64).decode().strip()
        finally:
            os.close(fd)
        raise AlreadyRunning(path, int(text) if text.isdigit() else None) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def read_pidfile(path: Path) -> int | None:
    try:
        fd = open_nofollow(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        text = os.read(fd, 64).decode(errors="replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    return int(text) if text.isdigit() else None


# ----------------------------------------------------------------------------- ports


def port_owner(port: int) -> str:
    """Who listens on ``port``, as far as this user can see ('' if unknown)."""
    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.Error, OSError):
        return ""
    for c in conns:
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
            try:
                proc = psutil.Process(c.pid)
                return f"pid {c.pid} ({' '.join(proc.cmdline())[:120] or proc.name()})"
            except psutil.Error:
                return f"pid {c.pid}"
    return ""


def check_port(host: str, port: int, what: str) -> None:
    """Raise StartFailed if ``host:port`` cannot be bound (never touches whoever holds it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise StartFailed(f"{what}: cannot bind {host}:{port}: {exc.strerror or exc}") from None
            owner = port_owner(port)
            raise StartFailed(
                f"{what}: port {port} on {host} is already in use"
                + (f" by {owner}" if owner else " (owner not visible to this user)")
            ) from None


def ports_to_check(cfg: Config) -> list[tuple[str, int, str]]:
    """``(host, port, config key)`` of every port the job binds."""
    out: list[tuple[str, int, str]] = []
    if cfg.api.enabled and cfg.is_head:  # another node's environments use the head's API
        out.append((cfg.api.host, cfg.api.port, "api.port"))
    if cfg.cluster.enabled and cfg.is_head:
        bind = cfg.cluster.head if is_loopback(cfg.cluster.head) else "0.0.0.0"
        out += [
            (bind, cfg.cluster.port, "cluster.port"),
            (bind, cfg.cluster.port + 1, "cluster.port (+ 1: the trainer ranks' store)"),
        ]
    if cfg.inference.enabled:
        inf = cfg.inference
        out += [
            (inf.host, inf.port + r, "inference.port" if inf.replicas == 1 else f"inference.port (replica {r})")
            for r in range(inf.replicas)
        ]
    if cfg.daemon.metrics_port:
        out.append(("127.0.0.1", cfg.daemon.metrics_port, "daemon.metrics_port"))
    for i, e in enumerate(cfg.env):
        if e.port_base:
            first = cfg.node_rank * e.replicas
            out += [("127.0.0.1", e.port_base + r, f"env[{i}].port_base") for r in range(first, first + e.replicas)]
    return out


def check_ports(cfg: Config) -> None:
    """Raise StartFailed naming the first port of the job that cannot be bound."""
    for host, port, what in ports_to_check(cfg):
        check_port(host, port, what)


# ----------------------------------------------------------------------------- child config


def write_child_config(paths: Paths, nonce: str, cfg: Config) -> None:
    """The resolved config the built-in children read, replaced atomically (0600)."""
    write_atomic(paths.child_config(nonce), dump_toml(cfg))


def remove_child_config(paths: Paths, nonce: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        paths.child_config(nonce).unlink()


def remove_dead_runtime_files(runtime_dir: Path) -> None:
    """Sockets and child configs of a daemon that died (the caller holds the pidfile lock)."""
    for path in [
        *runtime_dir.glob("inference-*.sock"),
        *runtime_dir.glob("config-*.toml"),
        *runtime_dir.glob(".config-*.tmp"),
    ]:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

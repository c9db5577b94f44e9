"""Fixtures for the cluster endpoint: a token file, a free port, peers in their own processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from atroposd.cluster.messages import Hello, Join, Message, Welcome
from atroposd.cluster.wire import (
    Session,
    auth_key,
    join_key,
    new_challenge,
    node_session,
    open_unsigned,
    session_keys,
)
from atroposd.config import ClusterConfig
from tests.support import REPO, free_port, free_port_pair, stop_process

PEER = Path(__file__).resolve().parent.parent / "child_scripts" / "cluster_peer.py"
HEARTBEAT_TIMEOUT = 2.0  # short for the tests, long enough for a busy 2-core machine


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.token"
    path.write_text("the-shared-secret-of-this-job\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def cfg(token_file: Path) -> ClusterConfig:
    return ClusterConfig(
        nodes=3,
        head="127.0.0.1",
        port=free_port_pair(),
        token_file=str(token_file),
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        join_timeout=30.0,
    )


class Peer:
    """A ``cluster_peer.py`` process: its events (stdout JSON lines) collected by a thread, its
    log (stderr) kept."""

    def __init__(self, argv: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        self.events: list[dict[str, Any]] = []
        self.log: list[str] = []
        self._threads = [
            threading.Thread(target=self._read_events, daemon=True),
            threading.Thread(target=self._read_log, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read_events(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.append(json.loads(line))

    def _read_log(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line.decode(errors="replace"))

    def event(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e["event"] == name), None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> int:
        try:
            os.kill(self.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        code = stop_process(self.proc)
        for t in self._threads:
            t.join(5)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        return code


@pytest.fixture
def peers() -> Iterator[Callable[..., Peer]]:
    started: list[Peer] = []

    def start(
        role: str,
        cfg: ClusterConfig,
        rank: int = 0,
        *,
        token_file: str | None = None,
        child: bool = False,
        join_timeout: float | None = None,
    ) -> Peer:
        argv = [
            role,
            cfg.head,
            str(cfg.port),
            token_file or cfg.token_file,
            str(cfg.nodes),
            str(rank),
            str(cfg.heartbeat_timeout),
            str(join_timeout if join_timeout is not None else cfg.join_timeout),
        ]
        if child:
            argv.append("--child")
        p = Peer(argv)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


async def until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``predicate`` on the event loop until it is truthy; AssertionError after ``timeout``."""
    import anyio

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await anyio.sleep(0.02)


class RawNode:
    """A node's side of the protocol by hand, over a raw loopback socket: the handshake, then any
    line at all (a recorded one, an edited one, one of the other direction)."""

    def __init__(self, reader: Any, writer: Any, token: bytes) -> None:
        self.reader, self.writer, self.auth = reader, writer, auth_key(token)
        self.session: Session | None = None
        self.keys: dict[str, bytes] = {}
        self.last = b""  # the last line written (a test's to replay)

    @classmethod
    async def connect(cls, port: int, token: bytes) -> RawNode:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer, token)

    async def hello(self, timeout: float = 5.0) -> str:
        """The head's challenge on this connection."""
        msg = open_unsigned(await asyncio.wait_for(self.reader.readline(), timeout))
        assert isinstance(msg, Hello), msg
        return msg.challenge

    def join_line(self, challenge: str, rank: int, **fields: Any) -> bytes:
        """A join for ``challenge`` (this connection's session made for it)."""
        nonce = new_challenge()
        self.keys = session_keys(self.auth, challenge, nonce)  # both directions' (to forge with)
        self.session = node_session(self.auth, challenge, nonce)
        values: dict[str, Any] = {
            "node_rank": rank,
            "host": f"raw-{rank}",
            "pid": os.getpid(),
            "instance": f"raw{rank}",
            "units": {},
            "components": [],
            "ready": False,
            "rejoin": False,
            "head_instance": "",
            **fields,
        }
        return self.session.seal(Join(challenge=challenge, nonce=nonce, **values), key=join_key(self.auth, challenge))

    async def join(self, rank: int, **fields: Any) -> Welcome:
        """The whole handshake: the head's welcome."""
        self.write(self.join_line(await self.hello(), rank, **fields))
        msg = await self.read()
        assert isinstance(msg, Welcome), msg
        return msg

    def seal(self, msg: Message) -> bytes:
        assert self.session is not None
        return self.session.seal(msg)

    def write(self, line: bytes) -> None:
        self.writer.write(line)
        self.last = line

    async def read(self, timeout: float = 5.0) -> Message:
        """The next message of the session (every check passed)."""
        assert self.session is not None
        return self.session.open(await asyncio.wait_for(self.reader.readline(), timeout))

    def abort(self) -> None:
        self.writer.transport.abort()


class Relay:
    """A TCP relay from a node to the head (the network in between) that records every line in
    each direction and can write a line of its own into the running connection, towards either
    side. ``cut`` drops every connection through it; with ``silent`` set it accepts and relays
    nothing, as a frozen head or a path that black-holes its packets."""

    def __init__(self, head_port: int) -> None:
        self.head_port = head_port
        self.to_head: list[bytes] = []  # what the node sent
        self.to_node: list[bytes] = []  # what the head sent
        self._up: asyncio.StreamWriter | None = None
        self._down: asyncio.StreamWriter | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self.silent = False

    async def start(self) -> None:
        self.port = free_port()
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.silent:
            self._writers.append(writer)  # held open, never answered
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.head_port)
        self._up, self._down = up_writer, writer
        self._writers += [writer, up_writer]
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer, self.to_head)),
            asyncio.create_task(self._pump(up_reader, writer, self.to_node)),
        ]
        self._tasks.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for w in (writer, up_writer):
            w.transport.abort()

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, record: list[bytes]) -> None:
        with contextlib.suppress(ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            while line := await reader.readline():
                record.append(line)
                writer.write(line)
                await writer.drain()

    def line_to_head(self, kind: str, start: int = 0) -> bytes:
        """The first line of type ``kind`` the node sent (from index ``start``)."""
        return next(x for x in self.to_head[start:] if f'"t":"{kind}"'.encode() in x)

    async def inject_to_head(self, line: bytes) -> None:
        assert self._up is not None
        self._up.write(line)
        await self._up.drain()

    async def inject_to_node(self, line: bytes) -> None:
        assert self._down is not None
        self._down.write(line)
        await self._down.drain()

    def cut(self) -> None:
        for w in self._writers:
            w.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.cut()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

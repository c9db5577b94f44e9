"""The cluster endpoint against strangers and against what a node sends (SPEC §12.3, §13): a
bounded number of connections that have not joined, a bounded line before the join and a few
seconds to send it, refusals logged at a bounded rate, a welcomed node that takes only signed
refusals, nodes stopped all at once, and a node's strings cleaned where they arrive."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from atroposd.cluster import ClusterNode, ClusterStartError
from atroposd.cluster.head import bind_address
from atroposd.cluster.membership import MAX_REPORT_ROWS, MAX_TEXT
from atroposd.cluster.messages import Ack, Beat, Hello, Refused, Welcome
from atroposd.cluster.wire import (
    MAX_JOIN_BYTES,
    Channel,
    auth_key,
    encode_unsigned,
    new_challenge,
    open_join,
)
from atroposd.config import ClusterConfig
from tests.cluster.conftest import Peer, RawNode, until
from tests.cluster.test_endpoint import READY_REPLICA, TOKEN, running_head, running_node

pytestmark = pytest.mark.anyio

MiB = 1024 * 1024


async def _closed_by_peer(reader: asyncio.StreamReader, timeout: float) -> bool:
    """The other end closed (or reset) the connection within ``timeout``."""
    try:
        while await asyncio.wait_for(reader.read(65536), timeout):
            pass
    except (ConnectionError, OSError):
        return True
    except asyncio.TimeoutError:
        return False
    return True


async def _flood(port: int, payload: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
        await asyncio.wait_for(writer.drain(), 3)
    return reader, writer


async def test_a_hundred_unauthenticated_connections_do_not_grow_the_head(
    cfg: ClusterConfig, peers: Callable[..., Peer]
) -> None:
    """Each stranger sends 1 MiB that never ends a line: the head holds at most twice the node
    count of them, each with at most 64 KiB, and closes every one (before: +100 MiB held)."""
    head = peers("head", cfg)
    await until(lambda: head.event("listening"), 30, "the head to listen")
    proc = psutil.Process(head.pid)
    before = proc.memory_info().rss
    conns = await asyncio.gather(*(_flood(cfg.port, b"x" * MiB) for _ in range(100)))
    grown = proc.memory_info().rss - before
    try:
        assert grown < 24 * MiB, f"the head grew by {grown / MiB:.0f} MiB for 100 strangers"
        closed = await asyncio.gather(*(_closed_by_peer(r, 10) for r, _ in conns))
        assert all(closed), f"{closed.count(False)} strangers still connected"
    finally:
        for _, w in conns:
            w.transport.abort()
    # an honest node joins once the strangers are gone
    node = peers("node", dataclasses.replace(cfg, node_rank=1), 1)
    await until(lambda: node.event("joined"), 30, "an honest node to join")
    assert any("too many connections have not joined yet" in line for line in head.log), head.log[-5:]


async def test_a_line_before_the_join_is_bounded_and_silence_has_a_deadline(
    cfg: ClusterConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running_head(cfg, join_deadline=0.5) as head:
        assert head.max_pending == 6  # twice the node count
        # a line longer than 64 KiB before the join: refused (unsigned: it proved no token) and closed
        reader, writer = await _flood(head.port, b"y" * (MAX_JOIN_BYTES + 10))
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert answer.startswith(b"- ") and b"longer than 65536 bytes" in answer
        # ten silent connections: four over the cap closed at once, six after the join deadline
        t0 = time.monotonic()
        silent = [await asyncio.open_connection("127.0.0.1", head.port) for _ in range(10)]
        ends = await asyncio.gather(*(_closed_by_peer(r, 5) for r, _ in silent))
        took = time.monotonic() - t0
        for _, w in silent:
            w.close()
        assert all(ends) and 0.4 < took < 4, (ends, took)
        assert head.refused == 11
        # an honest node still joins
        async with running_node(cfg, 1) as (node, _):
            node.report([READY_REPLICA])
            await until(lambda: head.nodes()[1]["state"] == "ready", 5, "node 1 ready")
    out = capsys.readouterr().out
    # the refusals are logged at a bounded rate: one line per kind within the interval
    assert out.count("closed a connection that did not join in time") == 1, out
    assert out.count("too many connections have not joined yet") == 1, out


async def test_a_welcomed_node_takes_no_unsigned_refusal(cfg: ClusterConfig) -> None:
    """A node reconnecting to its head is not ended by an unsigned "refused" (anyone on the path
    could send one): it tries again, and rejoins the same head (before: it gave up, lost)."""
    key = auth_key(TOKEN)
    conns: list[asyncio.StreamWriter] = []
    welcome = Welcome(head_instance="the-head", head_host="h", nodes=3, interval=0.3)

    async def fake_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(writer)
        n = len(conns)
        ch = Channel(reader, writer)
        challenge = new_challenge()
        await ch.send_unsigned(Hello(challenge=challenge))
        ch.session, _ = open_join(key, challenge, await ch.readline())  # the join
        if n == 2:  # the reconnection: a forged fatal refusal
            writer.write(encode_unsigned(Refused(reason="forged", fatal=True)))
        else:
            await ch.send(welcome)
        await writer.drain()
        if n <= 2:
            writer.close()  # the first connection breaks: the node reconnects
            return
        while msg := await ch.recv():
            if isinstance(msg, Beat):
                await ch.send(Ack(beat=ch.session.recv_seq))

    server = await asyncio.start_server(fake_head, "127.0.0.1", cfg.port)
    try:
        node = ClusterNode(cfg, token=TOKEN, node_rank=1, host="host-1")
        await node.join()
        task = asyncio.create_task(node.run())
        await until(lambda: len(conns) >= 3, 5, "the node to reconnect after the forged refusal")
        await asyncio.sleep(0.3)
        assert not task.done() and not node._lost_reason, node._lost_reason
        await node.leave("test over")
        assert await asyncio.wait_for(task, 5) == "left"
    finally:
        server.close()
        for w in conns:
            w.transport.abort()
        await server.wait_closed()


async def _stuck_node(port: int, rank: int) -> RawNode:
    """A node that joins by hand, then never reads (its socket's buffers fill)."""
    node = await RawNode.connect(port, TOKEN)
    node.writer.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await node.join(rank, host="stuck", instance="s", ready=True)
    return node


async def test_the_head_stops_every_node_at_once(cfg: ClusterConfig) -> None:
    """A node that does not read never delays another node's stop (before: one after another,
    each send waiting up to two heartbeat intervals)."""
    cfg = dataclasses.replace(cfg, heartbeat_timeout=6.0)  # interval 1 s: a serial stop waits 2 s
    async with running_head(cfg) as head:
        stuck = await _stuck_node(head.port, 1)
        await until(lambda: head.connected() == [1], 5, "the stuck node to join")
        # the head's send to it blocks: its socket is full
        blocked = asyncio.create_task(head.send(1, Refused(reason="z" * (8 * MiB), fatal=False)))
        await asyncio.sleep(0.2)
        stopped_at: list[float] = []
        async with running_node(cfg, 2, on_stop=lambda: stopped_at.append(time.monotonic())) as _:
            await until(lambda: head.connected() == [1, 2], 5, "node 2 to join")
            t0 = time.monotonic()
            await head.stop_all(timeout=1.5)
            assert stopped_at and stopped_at[0] - t0 < 0.9, [t - t0 for t in stopped_at]
        blocked.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await blocked
        stuck.abort()


async def test_a_nodes_strings_are_bounded_and_cleaned_where_they_arrive(cfg: ClusterConfig) -> None:
    rows: list[dict[str, Any]] = [
        {
            "name": f"env-{i}\x1b[31m",
            "kind": "env",
            "state": "ready\x07",
            "note": "n" * 1000,
            "deep": {"a": {"b": {"c": {"d": {"e": 1}}}}},
        }
        for i in range(2000)
    ]
    async with (
        running_head(cfg) as head,
        running_node(cfg, 1, host="evil\x1b]0;pwned\x07host\x1b[2J\x9b1m", units={"trainer_ranks": "\x1b[5m9"}) as (
            node,
            _,
        ),
    ):
        row = head.nodes()[1]
        assert row["host"] == "evilhost" and row["units"] == {"trainer_ranks": "9"}
        node.report(rows)
        await until(lambda: head.nodes()[1]["components"], 5, "node 1's report")
        comps = head.nodes()[1]["components"]
        assert len(comps) == MAX_REPORT_ROWS
        assert comps[3]["name"] == "env-3" and comps[3]["state"] == "ready"
        assert len(comps[3]["note"]) == MAX_TEXT and comps[3]["note"].endswith("…")
        assert comps[3]["deep"] == {"a": {"b": {"c": None}}}  # four levels under the row


async def test_the_endpoint_binds_cluster_bind_never_every_interface(cfg: ClusterConfig) -> None:
    """[cluster] bind, else the address head resolves to on this host (before: a head given by
    name or by a non-loopback address listened on every interface)."""
    async with running_head(dataclasses.replace(cfg, bind="127.0.0.3")) as head:
        assert head.bind_host == "127.0.0.3"
        with pytest.raises(OSError):  # not on another address of the host
            await asyncio.open_connection("127.0.0.1", head.port)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # sends nothing: the address of this host's default route
        own = probe.getsockname()[0]
    if not own.startswith("127."):
        async with running_head(dataclasses.replace(cfg, head=own)) as head:
            assert head._server is not None
            assert {s.getsockname()[0] for s in head._server.sockets} == {own}
    # this host's name: its address, unless it resolves to loopback here (/etc/hosts' 127.0.1.1),
    # where the other nodes could not connect: then an error naming cluster.bind
    name = socket.gethostname()
    resolved = socket.getaddrinfo(name, cfg.port, type=socket.SOCK_DGRAM)[0][4][0]
    if resolved.startswith("127.") or resolved == "::1":
        with pytest.raises(ClusterStartError, match=r"resolves to the loopback address .* set cluster.bind"):
            bind_address(dataclasses.replace(cfg, head=name))
    else:
        assert bind_address(dataclasses.replace(cfg, head=name)) == resolved


async def test_the_trainer_ranks_store_binds_the_endpoints_address(token_file: Path, tmp_path: Path) -> None:
    """The head's trainer-group store (``cluster.port + 1``) listens where the endpoint does —
    ``[cluster] bind``, by default the address ``head`` resolves to on this host — never on every
    interface (before: every interface whenever the head was not a loopback address)."""
    import anyio

    from atroposd.daemon.cluster import HeadLink
    from tests.cluster.test_links import Host, node_config
    from tests.support import free_port_pair

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # sends nothing: the address of this host's default route
        except OSError:
            pytest.skip("this host has no address but loopback")
        own = probe.getsockname()[0]
    if own.startswith("127."):
        pytest.skip("this host has no address but loopback")
    port = free_port_pair()
    cfg = node_config(token_file, tmp_path, port, 0)
    cfg.cluster = dataclasses.replace(cfg.cluster, head=own)  # a head others reach, [cluster] bind unset
    async with anyio.create_task_group() as tg:
        store = await HeadLink(Host(cfg, tg)).group_store(world=2)
        try:
            listening = {
                (c.laddr.ip, c.laddr.port)
                for c in psutil.Process().net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port + 1
            }
            assert listening == {(own, port + 1)}, listening
            with pytest.raises(OSError):  # not on loopback: not every interface
                await asyncio.open_connection("127.0.0.1", port + 1)
        finally:
            store.close()


async def test_the_trainer_ranks_store_forms_on_a_bind_other_than_the_heads_name(
    token_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``[cluster] bind`` set to another address than ``head`` resolves to on the head (a head
    whose name is 127.0.1.1 in its own /etc/hosts): the store listens there only, and the head
    and its own ranks reach it there (before: the store's own client dialled ``head`` and the
    start hung until the store's timeout)."""
    import anyio

    from atroposd.daemon.cluster import HeadLink
    from atroposd.trainer import group
    from tests.cluster.test_links import Host, node_config
    from tests.support import free_port_pair

    monkeypatch.setattr(group, "STORE_TIMEOUT_S", 10.0)  # a store that cannot reach itself fails soon
    port = free_port_pair()
    cfg = node_config(token_file, tmp_path, port, 0)  # head = 127.0.0.1
    cfg.cluster = dataclasses.replace(cfg.cluster, bind="127.0.0.3")
    async with anyio.create_task_group() as tg:
        store = await HeadLink(Host(cfg, tg)).group_store(world=2)
        try:
            assert store.address == f"127.0.0.3:{port + 1}"
            listening = {
                (c.laddr.ip, c.laddr.port)
                for c in psutil.Process().net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port + 1
            }
            assert listening == {("127.0.0.3", port + 1)}, listening
        finally:
            store.close()


async def test_a_nodes_rank_exits_arrive_cleaned(token_file: Path, tmp_path: Path) -> None:
    """A node reports its trainer ranks' exits: each reaches the head's fleet as a fault cleaned of
    terminal escapes and cut, whatever the node sends."""
    from atroposd.trainer.supervisor import RankExited
    from tests.cluster.test_links import linked

    async with linked(token_file, tmp_path) as job:
        for i in range(100):  # one at a time: the head's fleet has them in arrival order
            job.node_host.fleet.fault(RankExited(f"trainer-{i}\x1b[2J\x1b]0;t\x07", "killed \x9b1m" + "z" * 1000))
            await until(lambda n=i + 1: len(job.head_host.faults()) == n, 5, f"exit {i} at the head")
        faults = job.head_host.faults()
        assert all(isinstance(f, RankExited) and f.node == 1 for f in faults)
        assert str(faults[0]).startswith("trainer-0") and str(faults[-1]).startswith("trainer-99 on node 1 killed ")
        for f in faults:
            line = str(f)
            assert not any(ch in line for ch in "\x1b\x9b\x07") and len(line) < 400, line[:80]
        last = faults[-1]
        assert isinstance(last, RankExited) and last.how.startswith("killed ") and len(last.how) <= 256

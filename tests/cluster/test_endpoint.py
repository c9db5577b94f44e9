"""The head's endpoint and the node client over real loopback sockets; nodes and heads in their
own processes where a process must stop, freeze or die (SPEC §12.3)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from atroposd.cluster import (
    LOST,
    READY,
    ClusterHead,
    ClusterJoinTimeout,
    ClusterNode,
    ClusterRefused,
    ClusterStartError,
)
from atroposd.config import ClusterConfig
from tests.cluster.conftest import HEARTBEAT_TIMEOUT, Peer, Relay, until

pytestmark = pytest.mark.anyio

TOKEN = b"the-shared-secret-of-this-job"
READY_REPLICA = {"name": "inference", "kind": "inference", "state": "ready"}


@contextlib.asynccontextmanager
async def running_head(cfg: ClusterConfig, **kw: Any) -> AsyncIterator[ClusterHead]:
    head = ClusterHead(cfg, token=TOKEN, host="head-host", **kw)
    await head.start()
    head.report([READY_REPLICA])
    try:
        yield head
    finally:
        await head.close()


@contextlib.asynccontextmanager
async def running_node(
    cfg: ClusterConfig, rank: int = 1, **kw: Any
) -> AsyncIterator[tuple[ClusterNode, asyncio.Task[str]]]:
    node = ClusterNode(cfg, token=kw.pop("token", TOKEN), node_rank=rank, host=kw.pop("host", f"host-{rank}"), **kw)
    await node.join()
    task = asyncio.create_task(node.run())
    try:
        yield node, task
    finally:
        if not task.done():
            await node.leave("test over")
        await asyncio.wait_for(task, 5)


def row(head: ClusterHead, rank: int) -> dict[str, Any]:
    return head.nodes()[rank]


async def test_nodes_join_report_and_show_in_the_nodes_view(cfg: ClusterConfig) -> None:
    async with (
        running_head(cfg, units={"trainer_ranks": 1}) as head,
        running_node(cfg, 1, units={"trainer_ranks": 1}) as (n1, _),
    ):
        assert row(head, 1)["state"] == "joining"  # joined; its replica is not ready yet
        assert row(head, 2) == {**row(head, 2), "state": "joining", "host": None, "reason": "not joined yet"}
        n1.report([{**READY_REPLICA, "state": "starting", "pid": 11}])
        await until(lambda: row(head, 1)["components"], 5, "node 1's report")
        assert row(head, 1)["state"] == "joining"
        n1.report([{**READY_REPLICA, "pid": 11}, {"name": "arithmetic-1", "kind": "env", "state": "ready"}])
        await until(lambda: row(head, 1)["state"] == READY, 5, "node 1 ready")
        assert not await head.wait_all_ready(0.2)  # node 2 is missing
        async with running_node(cfg, 2) as (n2, _):
            n2.report([READY_REPLICA])
            assert await head.wait_all_ready(5)
            nodes = head.nodes()
            assert [(r["node_rank"], r["host"], r["state"]) for r in nodes] == [
                (0, "head-host", READY),
                (1, "host-1", READY),
                (2, "host-2", READY),
            ]
            assert nodes[1]["units"] == {"trainer_ranks": 1} and nodes[1]["address"] == "127.0.0.1"
            assert [c["name"] for c in nodes[1]["components"]] == ["inference", "arithmetic-1"]
            assert nodes[0]["components"] == [READY_REPLICA]
            assert nodes[1]["last_heartbeat_s"] < HEARTBEAT_TIMEOUT
            assert n1.store_secret == n2.store_secret == head.store_secret
            assert n1.store_key == n2.store_key == head.store_key
        await until(lambda: row(head, 2)["state"] == LOST, 5, "node 2 gone")
        assert row(head, 2)["reason"] == "left: test over"
        # heartbeats keep a quiet node in: nothing reported for several timeouts, still ready
        await asyncio.sleep(HEARTBEAT_TIMEOUT * 1.5)
        assert row(head, 1)["state"] == READY


async def test_a_node_with_a_wrong_token_is_refused_and_says_so(
    cfg: ClusterConfig, tmp_path: Path, peers: Callable[..., Peer]
) -> None:
    wrong = tmp_path / "wrong.token"
    wrong.write_text("another-secret-of-another-job\n")
    async with running_head(cfg) as head:
        p = peers("node", cfg, 1, token_file=str(wrong))
        await until(lambda: p.proc.poll() is not None, 15, "the refused node to exit")
        assert p.proc.returncode == 2
        refused = p.event("refused")
        assert refused is not None and "wrong cluster token" in refused["reason"], p.events
        assert any("refused by the head" in line and "wrong cluster token" in line for line in p.log), p.log
        assert row(head, 1)["state"] == "joining" and row(head, 1)["host"] is None  # never admitted
        # in-process, the same refusal is an exception naming the cause
        node = ClusterNode(cfg, token=b"another-secret-of-another-job", node_rank=1)
        with pytest.raises(ClusterRefused, match=r"refused node 1: wrong cluster token"):
            await node.join()


async def test_a_node_started_before_the_head_waits_for_it(cfg: ClusterConfig, peers: Callable[..., Peer]) -> None:
    p = peers("node", cfg, 1)
    await until(lambda: any("waiting for the head" in line for line in p.log), 15, "the node's progress log")
    assert p.event("joined") is None and p.proc.poll() is None
    async with running_head(cfg) as head:
        await until(lambda: row(head, 1)["state"] == READY, 15, "the early node to join")
        assert p.event("joined") is not None


async def test_no_head_within_join_timeout_is_an_error_naming_it(cfg: ClusterConfig) -> None:
    node = ClusterNode(dataclasses.replace(cfg, join_timeout=0.6), token=TOKEN, node_rank=1)
    t0 = time.monotonic()
    with pytest.raises(
        ClusterJoinTimeout,
        match=rf"the head at 127.0.0.1:{cfg.port} did not answer within "
        r"cluster.join_timeout \(0.6 s\)",
    ):
        await node.join()
    assert time.monotonic() - t0 < 3


async def test_a_frozen_node_is_lost_by_its_heartbeats(cfg: ClusterConfig, peers: Callable[..., Peer]) -> None:
    """SIGSTOP keeps the node's connection open: only the missing heartbeats find it."""
    async with running_head(cfg) as head:
        p = peers("node", cfg, 1)
        await until(lambda: row(head, 1)["state"] == READY, 15, "node 1 ready")
        p.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        await until(lambda: row(head, 1)["state"] == LOST, HEARTBEAT_TIMEOUT + 3, "node 1 lost")
        took = time.monotonic() - t0
        assert row(head, 1)["reason"] == f"no heartbeat for {HEARTBEAT_TIMEOUT:g} s"
        assert HEARTBEAT_TIMEOUT * 0.6 < took < HEARTBEAT_TIMEOUT + 2, took
        # woken up, it finds its head silent for too long and exits 1, as the daemon will
        p.signal(signal.SIGCONT)
        await until(lambda: p.proc.poll() is not None, 10, "the thawed node to exit")
        assert p.proc.returncode == 1
        lost = p.event("lost")
        assert lost is not None and "heartbeat_timeout" in lost["reason"], p.events


async def test_a_head_killed_9_ends_every_node_within_heartbeat_timeout(
    cfg: ClusterConfig, peers: Callable[..., Peer]
) -> None:
    head = peers("head", cfg)
    await until(lambda: head.event("listening"), 15, "the head's endpoint")
    nodes = [peers("node", cfg, r, child=True) for r in (1, 2)]
    await until(lambda: all(n.event("joined") for n in nodes), 15, "both nodes joined")
    children = [psutil.Process(n.event("child")["pid"]) for n in nodes]  # type: ignore[index]
    killed_at = time.time()
    head.signal(signal.SIGKILL)
    await until(lambda: all(n.proc.poll() is not None for n in nodes), HEARTBEAT_TIMEOUT + 5, "the nodes' exit")
    assert [n.proc.returncode for n in nodes] == [1, 1]
    for n in nodes:
        lost = n.event("lost")
        # the head's endpoint refused the reconnections: lost then, not after heartbeat_timeout's silence
        assert lost is not None and "refuses connections" in lost["reason"], n.events
        # on_lost_head ran (its children stopped) within heartbeat_timeout of the kill, and the
        # node's stop had the rest of it (stop_by: heartbeat_timeout after the head last spoke)
        assert lost["at"] - killed_at < HEARTBEAT_TIMEOUT, lost["at"] - killed_at
        assert 0 < lost["stop_by_in"] <= HEARTBEAT_TIMEOUT, lost
    for c in children:  # the node's on_lost_head stopped its children
        assert not c.is_running() or c.status() == psutil.STATUS_ZOMBIE


async def test_stop_all_returns_when_every_node_confirmed(cfg: ClusterConfig, peers: Callable[..., Peer]) -> None:
    async with running_head(cfg) as head:
        nodes = [peers("node", cfg, r, child=True) for r in (1, 2)]
        assert await head.wait_all_ready(15)
        children = [psutil.Process(n.event("child")["pid"]) for n in nodes]  # type: ignore[index]
        assert await head.stop_all(10) == {}
        for c in children:  # confirmed means gone
            assert not c.is_running() or c.status() == psutil.STATUS_ZOMBIE
        await until(lambda: all(n.proc.poll() is not None for n in nodes), 5, "the nodes' exit")
        assert [n.proc.returncode for n in nodes] == [0, 0]
        assert all(n.event("stopping") for n in nodes)
        assert [r["state"] for r in head.nodes()[1:]] == [LOST, LOST]
        assert [r["reason"] for r in head.nodes()[1:]] == ["stopped", "stopped"]
        # a stopping job takes no more nodes
        late = ClusterNode(cfg, token=TOKEN, node_rank=1)
        with pytest.raises(ClusterRefused, match="the job is stopping"):
            await late.join()


async def test_stop_all_names_the_nodes_that_did_not_confirm(cfg: ClusterConfig) -> None:
    release = asyncio.Event()

    async def slow_stop() -> None:
        await release.wait()

    async with running_head(cfg) as head, running_node(cfg, 1, on_stop=slow_stop) as (n1, task):
        n1.report([READY_REPLICA])
        await until(lambda: row(head, 1)["state"] == READY, 5, "node 1 ready")
        t0 = time.monotonic()
        assert await head.stop_all(HEARTBEAT_TIMEOUT * 1.5) == {
            1: f"did not confirm within {HEARTBEAT_TIMEOUT * 1.5:g} s"
        }
        # the node kept heartbeating while its children stopped: still in, and not lost
        assert row(head, 1)["state"] == READY and time.monotonic() - t0 >= HEARTBEAT_TIMEOUT * 1.5
        release.set()
        assert await asyncio.wait_for(task, 5) == "stopped"


async def test_a_node_killed_9_is_lost_and_rejoins_when_started_again(
    cfg: ClusterConfig, peers: Callable[..., Peer]
) -> None:
    async with running_head(cfg) as head:
        first = peers("node", cfg, 1)
        await until(lambda: row(head, 1)["state"] == READY, 15, "node 1 ready")
        first_pid = row(head, 1)["pid"]
        first.signal(signal.SIGKILL)
        await until(lambda: row(head, 1)["state"] == LOST, 3, "node 1 lost")
        assert row(head, 1)["reason"] == "connection closed"
        again = peers("node", cfg, 1)
        await until(lambda: row(head, 1)["state"] == READY, 15, "node 1 back")
        assert row(head, 1)["pid"] == again.pid != first_pid and row(head, 1)["joins"] == 2


async def test_a_rank_held_by_a_live_node_on_another_host_is_refused(cfg: ClusterConfig) -> None:
    async with running_head(cfg) as head, running_node(cfg, 1, host="a"):
        impostor = ClusterNode(cfg, token=TOKEN, node_rank=1, host="b")
        with pytest.raises(ClusterRefused, match=r"node_rank 1 is already held by a \(pid \d+\), which is alive"):
            await impostor.join()
        # the same host with a new instance is that node restarted: it takes the place over
        async with running_node(cfg, 1, host="a") as _restarted:
            await until(lambda: row(head, 1)["joins"] == 2, 5, "the restarted node")
            assert head.nodes()[1]["state"] != LOST


async def test_the_daemon_may_refuse_a_join(cfg: ClusterConfig) -> None:
    def check(join: Any) -> str | None:
        ranks = join.units.get("trainer_ranks")
        return None if ranks == 2 else f"trainer ranks per node differ: the head has 2, this node {ranks}"

    async with running_head(cfg, check_join=check):
        node = ClusterNode(cfg, token=TOKEN, node_rank=2, units={"trainer_ranks": 1})
        with pytest.raises(ClusterRefused, match="trainer ranks per node differ: the head has 2, this node 1"):
            await node.join()
        async with running_node(cfg, 1, units={"trainer_ranks": 2}):
            pass


async def test_a_broken_connection_is_mended_but_a_restarted_head_is_lost(cfg: ClusterConfig) -> None:
    lost: list[str] = []
    async with running_head(cfg) as head, running_node(cfg, 1, on_lost_head=lost.append) as (_, task):
        head._channels[1].abort()  # the connection drops; the same head is still there
        await until(lambda: row(head, 1)["joins"] == 2, 5, "the node to reconnect")
        assert not task.done() and not lost
        await head.close()
        async with running_head(cfg) as head2:  # another instance on the same port
            assert await asyncio.wait_for(task, HEARTBEAT_TIMEOUT + 3) == "lost"
            assert len(lost) == 1 and "this head restarted since the node joined" in lost[0], lost
            assert row(head2, 1)["state"] == "joining" and row(head2, 1)["host"] is None


async def test_a_head_gone_from_its_port_is_lost_at_once_an_unreachable_one_after_give_up_after(
    cfg: ClusterConfig,
) -> None:
    """A node that lost its connection finds its head gone as soon as the port refuses it for a
    heartbeat interval (a head closes its endpoint only at its end); a head it cannot reach at
    all (a relay that answers nothing) is lost after ``give_up_after``. Either way the daemon's
    stop has until ``stop_by``, heartbeat_timeout after the head last spoke."""
    loop = asyncio.get_running_loop()
    lost: list[str] = []
    async with running_head(cfg) as head, running_node(cfg, 1, on_lost_head=lost.append) as (node, task):
        await head.close()
        t0 = loop.time()
        assert await asyncio.wait_for(task, HEARTBEAT_TIMEOUT + 3) == "lost"
        took = loop.time() - t0
        assert len(lost) == 1 and "refuses connections: its endpoint is closed" in lost[0], lost
        assert node.interval <= took < node.give_up_after, took
        assert node.stop_by > loop.time()  # what is left of heartbeat_timeout is the stop's

    relay = Relay(cfg.port)
    await relay.start()
    through = dataclasses.replace(cfg, port=relay.port)
    lost.clear()
    try:
        async with running_head(cfg) as head, running_node(through, 1, on_lost_head=lost.append) as (node, task):
            relay.silent = True  # from now on nothing reaches the head
            relay.cut()
            t0 = loop.time()
            assert await asyncio.wait_for(task, HEARTBEAT_TIMEOUT + 3) == "lost"
            took = loop.time() - t0
            assert len(lost) == 1 and "has been unreachable for" in lost[0], lost
            assert node.give_up_after - node.interval <= took <= HEARTBEAT_TIMEOUT + 1, took
            await until(lambda: row(head, 1)["state"] == LOST, HEARTBEAT_TIMEOUT + 3, "the head to find node 1 lost")
    finally:
        await relay.close()


async def test_a_port_in_use_is_an_error_naming_it(cfg: ClusterConfig) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", cfg.port))
        s.listen()
        with pytest.raises(ClusterStartError, match=rf"cluster.port: .*127.0.0.1:{cfg.port}: already in use"):
            await ClusterHead(cfg, token=TOKEN).start()


async def test_a_stranger_on_the_port_is_turned_away(cfg: ClusterConfig) -> None:
    async with running_head(cfg) as head:
        reader, writer = await asyncio.open_connection("127.0.0.1", head.port)
        writer.write(b"GET / HTTP/1.0\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert answer.startswith(b"- ") and b"not a message of the cluster protocol" in answer
        assert [r["state"] for r in head.nodes()[1:]] == ["joining", "joining"]

"""Recorded cluster messages cannot be replayed (SPEC §12.3): a real head and a real node over
loopback, with a recording relay between them that can also put a line of its own on either
side of the running session.

A join recorded on one connection and replayed on another is refused (the challenge differs)
and the real node keeps its slot; a rank exit or a resync replayed inside the session (an old
sequence number) is dropped and counted, and the head's handler never sees it; a line of one
direction reflected back is dropped; an edited line fails its signature; a connection that
keeps delivering bad lines is closed, and the node comes back in a new session.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import pytest

from atroposd.cluster import LOST, READY, ClusterHead
from atroposd.cluster.head import MAX_DROPPED
from atroposd.cluster.messages import Message, RankExit, Ranks, Refused, Resync
from atroposd.cluster.wire import open_unsigned
from atroposd.config import ClusterConfig
from tests.cluster.conftest import HEARTBEAT_TIMEOUT, RawNode, Relay, until
from tests.cluster.test_endpoint import READY_REPLICA, TOKEN, running_head, running_node

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def relayed_job(cfg: ClusterConfig) -> AsyncIterator[tuple[ClusterHead, Any, Relay, list[Message]]]:
    """A head, node 1 joined through a relay and ready, and what reached the head's handler."""
    seen: list[Message] = []
    async with running_head(cfg, on_message=lambda rank, msg: seen.append(msg)) as head:
        relay = Relay(head.port)
        await relay.start()
        try:
            async with running_node(dataclasses.replace(cfg, port=relay.port), 1) as (node, task):
                node.report([READY_REPLICA])
                await until(lambda: head.nodes()[1]["state"] == READY, 5, "node 1 ready")
                yield head, node, relay, seen
                assert not task.done()
        finally:
            await relay.close()


async def test_a_recorded_join_replayed_on_a_new_connection_is_refused(cfg: ClusterConfig) -> None:
    """Before sessions, the same join line took node 1's slot over from the real node."""
    async with relayed_job(cfg) as (head, node, relay, _):
        recorded = relay.line_to_head("join")
        held = head._channels[1]
        replayer = await RawNode.connect(head.port, TOKEN)
        try:
            await replayer.hello()  # a fresh challenge: the recorded join was signed for another
            replayer.write(recorded)
            answer = open_unsigned(await asyncio.wait_for(replayer.reader.readline(), 5))
            assert isinstance(answer, Refused) and "another connection's challenge" in answer.reason, answer
            assert await asyncio.wait_for(replayer.reader.read(), 5) == b""  # closed
        finally:
            replayer.abort()
        assert head.dropped["challenge"] == 1
        # the real node keeps its slot, its connection and its heartbeats
        await asyncio.sleep(HEARTBEAT_TIMEOUT / 2)
        row = head.nodes()[1]
        assert (row["state"], row["joins"], row["host"]) == (READY, 1, "host-1")
        assert head._channels[1] is held and not node._lost_reason


async def test_replayed_rank_exit_and_resync_lines_are_dropped_and_counted(cfg: ClusterConfig) -> None:
    async with relayed_job(cfg) as (head, node, relay, seen):
        assert await node.send(RankExit(name="trainer-1", how="exited 1"))
        assert await node.send(Resync(replica=0))
        await until(lambda: len(seen) == 2, 5, "the rank exit and the resync")
        rank_exit, resync = relay.line_to_head("rank_exit"), relay.line_to_head("resync")
        for _ in range(3):  # the same lines, in the same session: old sequence numbers
            await relay.inject_to_head(rank_exit)
            await relay.inject_to_head(resync)
        await until(lambda: head.dropped["sequence"] == 6, 5, "the replays dropped")
        # a later honest message still goes through: the session is intact, nothing else was acted on
        assert await node.send(Resync(replica=1))
        await until(lambda: len(seen) == 3, 5, "the next resync")
        assert seen == [RankExit(name="trainer-1", how="exited 1"), Resync(replica=0), Resync(replica=1)]
        assert head.nodes()[1]["state"] == READY
        assert sum(head.dropped.values()) == 6


async def test_a_message_reflected_back_to_its_sender_is_dropped(cfg: ClusterConfig) -> None:
    """Each direction has its own key: the head's line sent back to the head (and the node's to
    the node) verifies under the other key only, and is dropped as of the wrong direction."""
    got: list[Message] = []
    async with relayed_job(cfg) as (head, node, relay, seen):
        node.on_message = got.append
        assert await head.send(1, Ranks(op="stop"))
        await until(lambda: got, 5, "the head's ranks message")
        await relay.inject_to_head(next(x for x in relay.to_node if b'"t":"ranks"' in x))
        await until(lambda: head.dropped["direction"] == 1, 5, "the head dropping its own line")
        await relay.inject_to_node(relay.line_to_head("beat"))
        await until(lambda: node.dropped["direction"] == 1, 5, "the node dropping its own line")
        assert got == [Ranks(op="stop")] and seen == []
        assert head.nodes()[1]["state"] == READY and not node._lost_reason


async def test_an_edited_line_fails_its_signature(cfg: ClusterConfig) -> None:
    async with relayed_job(cfg) as (head, node, relay, seen):
        assert await node.send(Resync(replica=0))
        await until(lambda: seen, 5, "the resync")
        line = relay.line_to_head("resync")
        seq = int(line.split(b'"seq":')[1].split(b",")[0])
        edited = line.replace(b'"replica":0', b'"replica":7')
        assert edited != line
        await relay.inject_to_head(edited)
        # raising the sequence number to pass for a new message breaks the signature as well
        await relay.inject_to_head(line.replace(f'"seq":{seq},'.encode(), f'"seq":{seq + 1000},'.encode()))
        await until(lambda: head.dropped["mac"] == 2, 5, "both edited lines dropped")
        assert seen == [Resync(replica=0)]
        assert head.nodes()[1]["state"] == READY


async def test_a_connection_that_keeps_sending_bad_lines_is_closed_and_the_node_comes_back(cfg: ClusterConfig) -> None:
    async with relayed_job(cfg) as (head, _node, relay, _seen):
        first = head._channels[1]
        beat = relay.line_to_head("beat")
        for _ in range(MAX_DROPPED):
            await relay.inject_to_head(beat)
        await until(
            lambda: head._channels.get(1) is not first and head.nodes()[1]["state"] == READY,
            10,
            "the node back on a new connection",
        )
        assert head.dropped["sequence"] == MAX_DROPPED
        assert head.nodes()[1]["joins"] == 2 and head.nodes()[1]["state"] != LOST
        assert len(relay.line_to_head("join", 1)) > 0  # it joined again: a new challenge, a new session

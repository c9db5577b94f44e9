"""The daemon's two cluster roles against each other: the head's link (``HeadLink``) and a node's
(``NodeLink``), each hosted by a stand-in daemon (``Host``: the role's host side, ``RoleHost``,
recording what the link asks of it), over a real loopback socket with the real wire and
messages.

A node joins (its join signed for the head's challenge) and heartbeats; a rank exit a node's
fleet reports reaches the head's fleet as a typed fault, and a resync the head's trainer; the
head's request to stop the ranks returns once the node confirmed it; the head's stop reaches the
node's daemon and its confirmation the head; a node that leaves is a fault of the trainer group;
a rank exit replayed in the session and a join replayed on another connection are refused,
counted, and never acted on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from atroposd.cluster.messages import CHALLENGE, SEQUENCE, Refused
from atroposd.cluster.node import LinkState
from atroposd.cluster.wire import open_unsigned
from atroposd.config import Config, parse_toml
from atroposd.daemon.cluster import HeadLink, NodeLink
from atroposd.daemon.metrics import cluster_families
from atroposd.daemon.ranks import Fleet
from atroposd.daemon.roles import Standalone
from atroposd.exitcodes import Exit
from atroposd.process.unit import Unit
from atroposd.systemd import Notifier
from atroposd.trainer.supervisor import Fault, NodeLost, RankExited
from tests.cluster.conftest import HEARTBEAT_TIMEOUT, RawNode, Relay, until
from tests.support import free_port_pair

pytestmark = pytest.mark.anyio

TOKEN = b"the-shared-secret-of-this-job"  # token_file's (conftest)


class Trainer:
    """The head's trainer service as the head's link calls it."""

    def __init__(self) -> None:
        self.resyncs: list[str] = []

    async def on_remote_replica_restarted(self, what: str) -> None:
        self.resyncs.append(what)


class Host:
    """A stand-in daemon: what a role uses of the daemon (``roles.RoleHost``), no children."""

    def __init__(self, cfg: Config, tg: anyio.abc.TaskGroup, trainer: Trainer | None = None) -> None:
        self.cfg = cfg
        self.nonce = secrets.token_hex(6)
        self.trainer: Any = trainer
        self.stopped = anyio.Event()
        self.notifier = Notifier()
        self.units: dict[str, Unit] = {}
        self.statuses: list[str] = []
        self.stops: list[tuple[str, Exit]] = []
        self.stop_by: float | None = None
        self.stopped_units: list[list[Unit]] = []
        self._tg = tg
        self.fleet = Fleet(self)  # type: ignore[arg-type]  # no unit is started here
        self.seen: list[Fault] = []

    def faults(self) -> list[Fault]:
        """The faults on this daemon's fleet stream so far (the head's: what its trainer group reads)."""
        while (fault := self.fleet.faults().get_nowait()) is not None:
            self.seen.append(fault)
        return self.seen

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        self._tg.start_soon(fn, *args)

    def set_status(self, text: str) -> None:
        self.statuses.append(text)

    def spec_inputs(self) -> Any:
        raise AssertionError("these tests start no trainer rank")

    def add_unit(self, spec: Any, **kw: Any) -> Unit:
        raise AssertionError("these tests start no trainer rank")

    async def stop_units(self, units: list[Unit]) -> None:
        self.stopped_units.append(list(units))

    def request_stop(self, reason: str, code: Exit = Exit.OK, *, by: float | None = None) -> None:
        self.stops.append((reason, code))
        self.stop_by = by


def node_config(token_file: Path, tmp_path: Path, port: int, rank: int) -> Config:
    return parse_toml(
        f'[cluster]\nnodes = 2\nnode_rank = {rank}\nhead = "127.0.0.1"\nport = {port}\n'
        f'token_file = "{token_file}"\nheartbeat_timeout = {HEARTBEAT_TIMEOUT}\njoin_timeout = 30.0\n'
        f'[trainer]\ncheckpoint_dir = "{tmp_path / "shared-ckpt"}"\n'
    )


@dataclasses.dataclass
class Job:
    head: HeadLink
    head_host: Host
    trainer: Trainer
    node: NodeLink
    node_host: Host
    port: int


@contextlib.asynccontextmanager
async def linked(
    token_file: Path, tmp_path: Path, *, via: Callable[[int], Awaitable[int]] | None = None
) -> AsyncIterator[Job]:
    """A head link and node 1's link, each in its stand-in daemon, node 1 joined; ``via``: the
    port node 1 dials instead of the head's (a relay to it)."""
    port = free_port_pair()
    async with anyio.create_task_group() as tg:
        trainer = Trainer()
        head_host = Host(node_config(token_file, tmp_path, port, 0), tg, trainer)
        head = HeadLink(head_host)
        await tg.start(head.run)
        dial = await via(port) if via is not None else port
        node_cfg = node_config(token_file, tmp_path, port, 1)
        node_cfg.cluster = dataclasses.replace(node_cfg.cluster, port=dial)
        node_host = Host(node_cfg, tg)
        node = NodeLink(node_host)
        await tg.start(node.run)
        try:
            yield Job(head, head_host, trainer, node, node_host, port)
        finally:
            node_host.stopped.set()
            with anyio.fail_after(10):
                await node.close()
                await head.close()
            tg.cancel_scope.cancel()


def row(job: Job) -> dict[str, Any]:
    return job.head.status()["nodes"][1]


async def test_a_node_link_joins_the_head_link_and_heartbeats(token_file: Path, tmp_path: Path) -> None:
    async with linked(token_file, tmp_path) as job:
        assert job.node.state == LinkState.JOINED
        assert job.node_host.statuses == [f"waiting for the head at 127.0.0.1:{job.port}"]
        # no rank unit here: a node with no replica is ready at once
        await until(lambda: row(job)["state"] == "ready", 5, "node 1 ready")
        r = row(job)
        assert (r["host"], r["joins"], r["units"]["trainer_ranks"]) == (job.node.node.host, 1, 1)
        view = job.node.status()
        assert view == {
            "cluster": {
                "node_rank": 1,
                "head": f"127.0.0.1:{job.port}",
                "state": "joined",
                "dropped": dict.fromkeys(view["cluster"]["dropped"], 0),
            }
        }
        # heartbeats keep it: past heartbeat_timeout the node is still ready, heard from lately
        await anyio.sleep(HEARTBEAT_TIMEOUT * 1.5)
        r = row(job)
        assert r["state"] == "ready" and r["joins"] == 1
        assert r["last_heartbeat_s"] < HEARTBEAT_TIMEOUT / 2
        assert job.head.missing() == [] and job.head_host.faults() == []
        assert not any(job.head.dropped().values()) and not any(job.node.dropped().values())
        assert job.node_host.stops == []


async def test_a_rank_exit_and_a_resync_of_a_node_reach_the_head(token_file: Path, tmp_path: Path) -> None:
    async with linked(token_file, tmp_path) as job:
        job.node_host.fleet.fault(RankExited("trainer-1", "killed by SIGKILL"))  # a unit of node 1 exited
        await until(job.head_host.faults, 5, "the rank exit on the head's fleet")
        assert job.head_host.faults() == [RankExited("trainer-1", "killed by SIGKILL", node=1)]
        assert str(job.head_host.faults()[0]) == "trainer-1 on node 1 killed by SIGKILL"
        job.node.replica_restarted(0)
        await until(lambda: job.trainer.resyncs, 5, "the resync at the head's trainer")
        assert job.trainer.resyncs == ["node 1 replica 0"]
        # the head's own replicas are its trainer's: the head's link has nothing to send for them
        assert not hasattr(job.head, "replica_restarted")


async def test_a_node_that_lost_its_head_stops_with_code_1_by_heartbeat_timeout(
    token_file: Path, tmp_path: Path
) -> None:
    """The head's endpoint gone (its end): the node's daemon stops with exit code 1, every child
    gone by heartbeat_timeout after the head last spoke — when the head would find it lost."""
    async with linked(token_file, tmp_path) as job:
        await until(lambda: row(job)["state"] == "ready", 5, "node 1 ready")
        await job.head.close()
        await until(lambda: job.node_host.stops, HEARTBEAT_TIMEOUT + 3, "the node's daemon asked to stop")
        asked_at = time.monotonic()
        [(reason, code)] = job.node_host.stops
        assert code == Exit.RUNTIME and reason.startswith("lost the head: the head at 127.0.0.1:"), reason
        by = job.node_host.stop_by
        assert by is not None and asked_at < by <= asked_at + HEARTBEAT_TIMEOUT, (asked_at, by)
        assert job.node.outcome == LinkState.LOST


async def test_the_heads_stop_ranks_returns_once_the_node_confirmed(token_file: Path, tmp_path: Path) -> None:
    async with linked(token_file, tmp_path) as job:
        bound = job.head_host.cfg.daemon.stop_timeout + 10  # what it waits for a node that never confirms
        t0 = time.monotonic()
        await job.head.stop_ranks()
        took = time.monotonic() - t0
        assert took < min(3.0, bound / 2), took
        assert job.node_host.stopped_units == [[]]  # the node stopped its (no) rank units


async def test_the_heads_stop_reaches_the_node_and_its_confirmation_the_head(token_file: Path, tmp_path: Path) -> None:
    async with linked(token_file, tmp_path) as job:
        await until(lambda: row(job)["state"] == "ready", 5, "node 1 ready")
        async with anyio.create_task_group() as tg:
            tg.start_soon(job.head.stop_nodes)
            await until(lambda: job.node_host.stops, 5, "the node's daemon asked to stop")
            assert job.node_host.stops == [("the head stops the job", Exit.OK)]
            await anyio.sleep(0.3)
            assert row(job)["state"] == "ready"  # the head waits until the node's children are gone
            job.node_host.stopped.set()
            with anyio.fail_after(5):
                await job.node._done.wait()
        assert job.node.outcome == LinkState.STOPPED and job.node.status()["cluster"]["state"] == "stopped"
        assert (row(job)["state"], row(job)["reason"]) == ("lost", "stopped")
        assert job.head_host.faults() == [NodeLost(1, "stopped")]


async def test_a_node_that_leaves_is_a_fault_of_the_trainer_group(token_file: Path, tmp_path: Path) -> None:
    async with linked(token_file, tmp_path) as job:
        await until(lambda: row(job)["state"] == "ready", 5, "node 1 ready")
        await job.node.close()  # stopped on its own: it leaves
        assert job.node.outcome == LinkState.LEFT
        await until(lambda: row(job)["state"] == "lost", 5, "node 1 lost")
        assert job.head.missing() == [1]
        assert job.head_host.faults() == [NodeLost(1, "left: stopped on its own")]
        assert str(job.head_host.faults()[0]) == "node 1 lost (left: stopped on its own)"


async def test_replayed_lines_are_refused_counted_and_never_acted_on(token_file: Path, tmp_path: Path) -> None:
    relay: Relay | None = None

    async def via(port: int) -> int:
        nonlocal relay
        relay = Relay(port)
        await relay.start()
        return relay.port

    try:
        async with linked(token_file, tmp_path, via=via) as job:
            assert relay is not None
            await until(lambda: row(job)["state"] == "ready", 5, "node 1 ready")
            job.node_host.fleet.fault(RankExited("trainer-1", "killed by SIGKILL"))
            await until(job.head_host.faults, 5, "the rank exit on the head's fleet")
            # the same line again, in the same session: its sequence number is not new
            await relay.inject_to_head(relay.line_to_head("rank_exit"))
            await until(lambda: job.head.dropped()[SEQUENCE], 5, "the replay counted")
            assert job.head.dropped()[SEQUENCE] == 1
            # the node's recorded join, on a connection of its own: signed for another challenge
            raw = await RawNode.connect(job.port, TOKEN)
            await raw.hello()
            raw.write(relay.line_to_head("join"))
            answer = open_unsigned(await raw.reader.readline())
            raw.abort()
            assert isinstance(answer, Refused) and "challenge" in answer.reason
            assert job.head.dropped()[CHALLENGE] == 1
            assert job.head.status()["cluster"]["refused_connections"] == 1
            (family,) = cluster_families(job.head.dropped())
            counted = {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")}
            assert (counted[SEQUENCE], counted[CHALLENGE]) == (1.0, 1.0)
            # neither was acted on: one rank exit, node 1 still holds its slot in its session
            await anyio.sleep(0.3)
            assert job.head_host.faults() == [RankExited("trainer-1", "killed by SIGKILL", node=1)]
            assert (row(job)["state"], row(job)["joins"]) == ("ready", 1)
            assert job.node.state == LinkState.JOINED
    finally:
        if relay is not None:
            await relay.close()


def test_standalone_is_a_role_with_no_link() -> None:
    role = Standalone()
    assert role.status() == {} and role.dropped() is None
    # what one role alone does is that link's, not every role's
    assert not any(hasattr(role, name) for name in ("remote_replicas", "stop_nodes", "replica_restarted"))

"""The daemon's side of several machines (SPEC §12.3): the head's link to the other nodes, and a
node's link to its head.

Head (node 0): :class:`HeadLink` opens the cluster endpoint before any child starts, reports
the head's own components, hosts the trainer ranks' store on ``cluster.port + 1`` (in
:mod:`.core`), and drives the other nodes' trainer ranks: every (re)formed group waits until
every node is ``ready`` (``waiting_for = "ranks"``; bounded by ``data_timeout``), then tells each
node to start its ranks for the new generation. A node's rank that exits, and a node that is
lost, are faults of the trainer group; a node's restarted inference replica asks for a push.
The head's replica sentinel (SPEC §15) reaches every node's replicas (:class:`RemoteReplica`):
a node's replica generates the canary (``CanaryAsk`` → ``CanaryAnswer``; the node scores
nothing), and a drifting one is quarantined, released or restarted by its own node at the
head's word (``Care`` → ``Cared``).

Node i > 0: :class:`NodeLink` waits for the head (``join_timeout``), joins, heartbeats, reports
its components, starts and stops its trainer ranks when the head says so, and stops the node
when the head asks (``stop``) or when the head is lost (exit 1, so that its launcher starts it
again and it rejoins).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import anyio
import anyio.abc

from atroposd.cluster import (
    LOST,
    READY,
    ClusterHead,
    ClusterJoinTimeout,
    ClusterNode,
    ClusterRefused,
    ClusterStartError,
    ranks_key,
    store_secret,
)
from atroposd.cluster.membership import NodeState, clean_text
from atroposd.cluster.messages import (
    CanaryAnswer,
    CanaryAsk,
    Care,
    Cared,
    Join,
    Message,
    RankExit,
    Ranks,
    RanksStopped,
    Resync,
)
from atroposd.cluster.node import LinkState
from atroposd.config import ClusterError
from atroposd.daemon.runtime import StartFailed
from atroposd.exitcodes import Exit
from atroposd.logs import get_logger
from atroposd.process.unit import Unit
from atroposd.trainer.supervisor import NodeLost, RankExited

if TYPE_CHECKING:
    from pathlib import Path

    from atroposd.daemon.roles import RoleHost as Daemon
    from atroposd.trainer.group import GroupStore


__all__ = ["HeadLink", "NodeLink", "RemoteReplica", "store_address"]

log = get_logger("atroposd.daemon")

RANKS_STOP_GRACE_S = 10.0
# The sentinel's requests to a node: at most this many canary prompts, ids per prompt, tokens each.
MAX_CANARY_PROMPTS, MAX_CANARY_IDS, MAX_CANARY_TOKENS = 64, 4096, 256
# How often a waiting head logs which nodes its trainer group waits for.
WAIT_LOG_EVERY_S = 10.0


def _token(daemon: Daemon) -> bytes:
    try:
        return daemon.cfg.cluster.read_token()
    except ClusterError as exc:
        raise StartFailed(str(exc)) from None


def store_address(daemon: Daemon) -> str:
    """Where every node's trainer ranks meet: the head's ``cluster.port + 1``."""
    c = daemon.cfg.cluster
    host = f"[{c.head}]" if ":" in c.head else c.head
    return f"{host}:{c.port + 1}"


def _units(daemon: Daemon) -> dict[str, Any]:
    cfg = daemon.cfg
    return {
        "trainer_ranks": cfg.trainer.local_ranks if cfg.trainer.enabled else 0,
        "replicas": cfg.inference.replicas if cfg.inference.enabled else 0,
    }


def _rows(units: list[Unit]) -> list[dict[str, Any]]:
    return [u.status() for u in units]


class RemoteReplica:
    """Inference replica ``replica`` of node ``node``, for the head's sentinel (the protocol of
    :class:`atroposd.trainer.sentinel.RemoteReplica`): requests over the node's signed link,
    answered by its node."""

    def __init__(self, link: HeadLink, node: int, replica: int) -> None:
        self.link, self.node, self.replica = link, node, replica
        self.label = f"node {node} replica {replica}"

    def __str__(self) -> str:
        return self.label

    async def canary(self, bodies: Sequence[dict[str, Any]], within: float) -> list[dict[str, Any]]:
        from atroposd.weights.client import WeightControlError

        prompts = [{"ids": list(b["prompt"]["prompt_token_ids"])} for b in bodies]
        max_tokens = int(bodies[0]["max_tokens"]) if bodies else 1
        ask = CanaryAsk(request=0, replica=self.replica, prompts=prompts, max_tokens=max_tokens)
        answer = await self.link.ask(self.node, ask, within)
        if not isinstance(answer, CanaryAnswer):
            raise WeightControlError(f"{self.label}: no canary answer within {within:g} s", timed_out=True)
        if answer.error:
            raise WeightControlError(f"{self.label}: {clean_text(answer.error, 300)}")
        return [_canary_row(row, max_tokens) for row in answer.answers[: len(bodies)]]

    async def care(self, op: str, reason: str, within: float) -> bool:
        assert op in ("quarantine", "release", "restart")
        care = Care(request=0, replica=self.replica, op=op, reason=clean_text(reason, 300))  # type: ignore[arg-type]
        answer = await self.link.ask(self.node, care, within)
        if not isinstance(answer, Cared):
            log.warning("a node did not answer the sentinel", replica=self.label, op=op, waited_s=within)
            return False
        if not answer.ok:
            log.warning("a node could not do what the sentinel asked", replica=self.label, op=op, detail=answer.detail)
        return answer.ok


def _canary_row(row: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """A node's canary row as a ``POST /canary`` answer (what the sentinel reads), checked: at most
    ``max_tokens`` integer ids, as many finite logprobs; WeightControlError otherwise."""
    import math

    from atroposd.weights.client import WeightControlError

    tokens, lps, version = row.get("tokens"), row.get("logprobs"), row.get("weight_version")
    ok = (
        isinstance(tokens, list)
        and isinstance(lps, list)
        and len(tokens) == len(lps) <= max_tokens
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in lps)
        and (version is None or (isinstance(version, int) and not isinstance(version, bool)))
    )
    if not ok:
        raise WeightControlError("a node's canary answer does not check")
    assert isinstance(tokens, list) and isinstance(lps, list)
    return {"logprobs": [[[{str(t): float(x)}] for t, x in zip(tokens, lps, strict=True)]], "weight_version": version}


class HeadLink:
    """Node 0's link to the others."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        cfg = daemon.cfg
        token = _token(daemon)
        self.store_secret = store_secret(token)
        self.store_key = ranks_key(token)
        self.head = ClusterHead(
            cfg.cluster,
            token=token,
            instance=daemon.nonce,
            units=_units(daemon),
            check_join=self._check_join,
            on_change=self._on_change,
            on_message=self._on_message,
        )
        self._ranks_stopped: dict[int, anyio.Event] = {}
        self.holds_ranks = cfg.trainer.enabled and cfg.trainer.local_ranks > 0
        # the sentinel's requests in flight: request id → (node, the answer once it came)
        self._requests = 0
        self._answers: dict[int, tuple[int, anyio.Event, list[Message]]] = {}

    def remote_replicas(self) -> list[RemoteReplica]:
        """Every other node's inference replicas (as many as each node said it runs when it joined)."""
        out: list[RemoteReplica] = []
        for r, m in sorted(self.head.membership.members.items()):
            if r == 0:
                continue
            n = m.units.get("replicas", 0)
            count = n if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= 256 else 0
            out.extend(RemoteReplica(self, r, i) for i in range(count))
        return out

    async def ask(self, node: int, msg: CanaryAsk | Care, timeout: float) -> Message | None:  # noqa: ASYNC109
        """Send ``msg`` (its request id set here) to ``node`` and wait up to ``timeout`` for the
        node's answer of the same request; None when it did not come."""
        self._requests += 1
        request = self._requests
        msg = dataclasses.replace(msg, request=request)
        event = anyio.Event()
        box: list[Message] = []
        self._answers[request] = (node, event, box)
        try:
            if not await self.head.send(node, msg):
                return None
            with anyio.move_on_after(timeout):
                await event.wait()
            return box[0] if box else None
        finally:
            self._answers.pop(request, None)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Open the cluster endpoint (before any child), the head's own components reported, and
        serve it until ``close``; started once it is open."""
        self.report()
        try:
            await self.head.serve(task_status=task_status)
        except ClusterStartError as exc:
            raise StartFailed(str(exc)) from None

    def report(self) -> None:
        self.head.report(_rows(list(self.daemon.units.values())))

    def nodes(self) -> list[dict[str, Any]]:
        return self.head.nodes()

    def status(self) -> dict[str, Any]:
        """The head's part of ``status --json``: every node (``nodes``) and its endpoint (``cluster``)."""
        return {"nodes": self.nodes(), "cluster": self.view()}

    def view(self) -> dict[str, Any]:
        """The head's ``cluster`` of ``status --json``: the messages its endpoint dropped, by reason,
        and the connections of strangers it refused."""
        return {"node_rank": 0, "role": "head", "dropped": self.head.dropped, "refused_connections": self.head.refused}

    def dropped(self) -> dict[str, int]:
        return self.head.dropped

    async def group_store(self, world: int) -> GroupStore:
        """The trainer group's store on ``cluster.port + 1`` of ``[cluster] bind`` (as the endpoint,
        never every interface): every node's ranks connect to it."""
        from atroposd.cluster.head import bind_address
        from atroposd.trainer.group import GroupStore

        c = self.daemon.cfg.cluster
        bind = bind_address(c)
        # this node reaches it where it listens (``head`` may resolve elsewhere here: to 127.0.1.1)
        here = c.head if bind in ("0.0.0.0", "::") else bind
        secret, key, launch = self.store_secret, self.store_key, self.daemon.nonce
        return await anyio.to_thread.run_sync(
            lambda: GroupStore(
                secret=secret, world=world, host=bind, port=c.port + 1, advertise=here, key=key, launch=launch
            )
        )

    def _check_join(self, msg: Join) -> str | None:
        ours = _units(self.daemon)
        theirs = msg.units
        if theirs.get("trainer_ranks") != ours["trainer_ranks"]:
            return (
                f"this node runs {clean_text(theirs.get('trainer_ranks'), 32)} trainer rank(s) and the head "
                f"{ours['trainer_ranks']}: trainer.device must list as many devices on every node"
            )
        return None

    def missing(self) -> list[int]:
        """The nodes (other than the head) that are not ``ready``."""
        return [r for r, m in self.head.membership.members.items() if r and m.state != READY]

    def _on_change(self, rank: int, old: NodeState, new: NodeState, reason: str) -> None:
        if new == LOST and rank and self.holds_ranks:
            # Its ranks are gone with it: the group restarts once the node is back.
            self.daemon.fleet.fault(NodeLost(rank, reason))

    def _on_message(self, rank: int, msg: Message) -> None:
        trainer = self.daemon.trainer
        if isinstance(msg, RankExit):
            # a node's strings, cleaned where they arrive (SPEC §13): bounded, no terminal escapes
            self.daemon.fleet.fault(RankExited(clean_text(msg.name, 128), clean_text(msg.how, 256), node=rank))
        elif isinstance(msg, RanksStopped):
            self._ranks_stopped.setdefault(rank, anyio.Event()).set()
        elif isinstance(msg, Resync) and trainer is not None:
            # A replica of that node restarted: a full push reaches it through its node's first rank.
            self.daemon.spawn(trainer.on_remote_replica_restarted, f"node {rank} replica {msg.replica}")
        elif isinstance(msg, (CanaryAnswer, Cared)):
            waiting = self._answers.get(msg.request)
            if waiting is not None and waiting[0] == rank and not waiting[2]:  # the node asked, once
                waiting[2].append(msg)
                waiting[1].set()

    async def stop_nodes(self) -> None:
        """Every other node stops (its ranks, environments, replicas) and confirms."""
        c = self.daemon.cfg.daemon
        await self.head.stop_all(3 * c.stop_timeout + 15)

    async def wait_nodes(self, on_wait: Callable[[list[int]], None]) -> None:
        """Wait until every node is ready (bounded by ``data_timeout``): a trainer group forms
        only with all of its ranks."""
        t = self.daemon.cfg.trainer
        last_log = 0.0
        with anyio.move_on_after(t.data_timeout):
            while missing := self.missing():
                on_wait(missing)
                now = time.monotonic()
                if now - last_log >= WAIT_LOG_EVERY_S:
                    last_log = now
                    log.info("the trainer group waits for nodes", nodes=missing, waited_for="ready")
                await anyio.sleep(0.1)
        missing = self.missing()
        if missing:
            on_wait(missing)
            raise RuntimeError(
                f"node(s) {', '.join(map(str, missing))} not ready within trainer.data_timeout "
                f"({t.data_timeout:g} s): the trainer group cannot form"
            )

    async def start_ranks(self, generation: int) -> None:
        """Tell every node to start its trainer ranks for ``generation``."""
        self._ranks_stopped = {}
        # the head's launch nonce: the nodes' ranks use this launch's store prefix and command key
        reached = await self.head.broadcast(Ranks(op="start", generation=generation, launch=self.daemon.nonce))
        log.info("nodes asked to start their trainer ranks", nodes=reached, generation=generation)

    async def stop_ranks(self) -> None:
        """Every node stops its trainer ranks; returns once each confirmed (or is gone)."""
        targets = self.head.connected()
        for r in targets:
            self._ranks_stopped[r] = anyio.Event()
        await self.head.broadcast(Ranks(op="stop"))
        with anyio.move_on_after(self.daemon.cfg.daemon.stop_timeout + RANKS_STOP_GRACE_S):
            for r in targets:
                event = self._ranks_stopped[r]
                while not event.is_set() and r in self.head.connected():
                    with anyio.move_on_after(0.2):
                        await event.wait()

    async def close(self) -> None:
        await self.head.close()


class NodeLink:
    """A node's link to its head (node_rank > 0)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        cfg = daemon.cfg
        token = _token(daemon)
        self.store_secret = store_secret(token)
        self.store_key = ranks_key(token)
        self.node = ClusterNode(
            cfg.cluster,
            token=token,
            node_rank=cfg.node_rank,
            instance=daemon.nonce,
            units=_units(daemon),
            on_lost_head=self._lost_head,
            on_stop=self._stop,
            on_message=self._on_message,
        )
        self._ranks_lock = anyio.Lock()
        self.state = LinkState.JOINING
        self.outcome: LinkState | None = None
        self._asked_to_stop = False
        self._done = anyio.Event()

    async def join(self) -> None:
        self.daemon.set_status(f"waiting for the head at {self.node.head_address}")
        try:
            await self.node.join()
        except (ClusterRefused, ClusterJoinTimeout) as exc:
            raise StartFailed(str(exc)) from None
        self.state = LinkState.JOINED

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Join the head (before any child), then heartbeat until the job ends for this node."""
        self.daemon.notifier.extend_timeout(self.daemon.cfg.cluster.join_timeout + 10)
        await self.join()
        self.report()
        task_status.started()
        self.daemon.spawn(self._forward_faults)  # until the daemon's end
        try:
            self.outcome = await self.node.run()
            self.state = self.outcome
        finally:
            self._done.set()

    async def _forward_faults(self) -> None:
        """This node's ranks that exited on their own: the head restarts the group."""
        async for fault in self.daemon.fleet.faults():
            if isinstance(fault, RankExited):
                self.daemon.spawn(self.node.send, RankExit(name=fault.rank, how=fault.how))

    def report(self) -> None:
        self.node.report(_rows(list(self.daemon.units.values())))

    def view(self) -> dict[str, Any]:
        """The node's ``cluster`` of ``status --json``: its head, its link's state, and the messages
        from the head it dropped, by reason."""
        return {
            "node_rank": self.daemon.cfg.node_rank,
            "head": self.node.head_address,
            "state": self.state.value,
            "dropped": self.node.dropped,
        }

    def status(self) -> dict[str, Any]:
        """A node's part of ``status --json``: its link (``cluster``)."""
        return {"cluster": self.view()}

    def dropped(self) -> dict[str, int]:
        return self.node.dropped

    def _lost_head(self, reason: str) -> None:
        # the head starts its trainer group again without this node once it finds it lost:
        # this node's ranks are gone by then
        self.daemon.request_stop(f"lost the head: {reason}", code=Exit.RUNTIME, by=self.node.stop_by)

    async def _stop(self) -> None:
        self._asked_to_stop = True
        self.daemon.request_stop("the head stops the job")
        await self.daemon.stopped.wait()

    def _on_message(self, msg: Message) -> None:
        if isinstance(msg, CanaryAsk):
            self.daemon.spawn(self._canary, msg)
            return
        if isinstance(msg, Care):
            self.daemon.spawn(self._care, msg)
            return
        if not isinstance(msg, Ranks):
            return
        if msg.op == "start":
            self.daemon.spawn(self._start_ranks, msg.generation, msg.launch)
        elif msg.op == "stop":
            self.daemon.spawn(self._stop_ranks)

    def _socket(self, replica: int) -> Path | None:
        inf = self.daemon.cfg.inference
        if not inf.enabled or not 0 <= replica < inf.replicas:
            return None
        return self.daemon.paths.inference_socket(inf.port + replica)

    async def _canary(self, msg: CanaryAsk) -> None:
        """The head's sentinel: this node's replica generates the canary; the tokens go back."""
        import asyncio

        from atroposd.trainer.sentinel import _completion, canary_body
        from atroposd.weights.client import WeightControlClient, WeightControlError

        sock = self._socket(msg.replica)
        prompts = [p.get("ids") for p in msg.prompts]
        if sock is None:
            error = f"no inference replica {msg.replica} on node {self.daemon.cfg.node_rank}"
        elif not (
            0 < len(prompts) <= MAX_CANARY_PROMPTS
            and 0 < msg.max_tokens <= MAX_CANARY_TOKENS
            and all(
                isinstance(p, list)
                and 0 < len(p) <= MAX_CANARY_IDS
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p)
                for p in prompts
            )
        ):
            error = "the canary request does not check"
        else:
            error = ""
        answers: list[dict[str, Any]] = []
        if sock is not None and not error:
            client = WeightControlClient(sock, timeout=60.0)
            try:
                bodies = [canary_body(cast("list[int]", p), msg.max_tokens) for p in prompts]  # checked above
                replies = await asyncio.gather(*(client.request("POST", "/canary", b) for b in bodies))
                for ans in replies:
                    tokens, lps = _completion(ans)
                    version = ans.get("weight_version")
                    answers.append(
                        {
                            "tokens": tokens,
                            "logprobs": lps,
                            "weight_version": version if isinstance(version, int) else None,
                        }
                    )
            except (WeightControlError, ValueError, TypeError, KeyError) as exc:
                error, answers = f"replica {msg.replica}: {type(exc).__name__}: {exc}"[:300], []
            finally:
                await client.close()
        await self.node.send(CanaryAnswer(request=msg.request, replica=msg.replica, answers=answers, error=error))

    async def _care(self, msg: Care) -> None:
        """The head's sentinel's word on this node's replica: quarantine, release or restart it."""
        from atroposd.weights.client import WeightControlClient, WeightControlError

        sock = self._socket(msg.replica)
        ok, detail = False, ""
        reason = clean_text(msg.reason, 300)
        if sock is None:
            detail = f"no inference replica {msg.replica} on node {self.daemon.cfg.node_rank}"
        elif msg.op == "restart":
            log.warning("the head's sentinel restarts a replica of this node", replica=msg.replica, reason=reason)
            ok = await self.daemon.restart_replica(msg.replica, f"the head's sentinel: {reason}")
            detail = "" if ok else "the replica was not back ready after its restart"
        else:
            on = msg.op == "quarantine"
            client = WeightControlClient(sock, timeout=60.0)
            try:
                await client.request("POST", "/quarantine", {"quarantine": on, "reason": reason})
                ok = True
                log.warning(
                    "replica quarantined at the head's word" if on else "replica back in rotation at the head's word",
                    replica=msg.replica,
                    reason=reason,
                )
            except WeightControlError as exc:
                detail = str(exc)[:300]
            finally:
                await client.close()
        await self.node.send(Cared(request=msg.request, replica=msg.replica, ok=ok, detail=detail))

    def replica_restarted(self, replica: int) -> None:
        """An inference replica of this node restarted: the head pushes through this node's first rank."""
        self.daemon.spawn(self.node.send, Resync(replica=replica))

    async def _start_ranks(self, generation: int, launch: str = "") -> None:
        from atroposd.trainer.group import launch_key, launch_secret

        async with self._ranks_lock:
            await self.daemon.fleet.follow(
                store_address(self.daemon),
                secret=launch_secret(self.store_secret, launch),
                key=launch_key(self.store_key, launch),
                generation=generation,
                connect_timeout=self.daemon.cfg.trainer.join_timeout,
            )
            log.info("trainer ranks started for the head", generation=generation, launch=launch)

    async def _stop_ranks(self) -> None:
        async with self._ranks_lock:
            await self.daemon.fleet.stop_here()
        await self.node.send(RanksStopped())

    async def close(self) -> None:
        """After this node's children stopped: leave (a stop of this node alone: its ranks leave,
        the trainer waits), or let the head hear that its stop is done; bounded."""
        if self.outcome is None and not self._asked_to_stop and self.state != LinkState.JOINING:
            await self.node.leave("stopped on its own")
        if self.state != LinkState.JOINING:
            with anyio.move_on_after(5):
                await self._done.wait()

"""The head's cluster endpoint (node 0): joins, heartbeats, reports, stop (SPEC §12.3).

The head opens it before it starts any child (``start``). A node connects, joins with its
node rank, host and units, then sends a heartbeat every ``heartbeat_interval`` (each one is
answered) and a report whenever its components change; the head answers ``stop`` to it when
the job stops (``stop_all``). Each connection is one session (``wire``): the head sends a fresh
challenge, the join is signed for it, and every later message carries the session id, its
direction and a rising sequence number under a key of that session and direction. A peer with
another token is refused with a reason it can log, and the head logs it as well; a join
recorded on another connection is refused (``challenge``). A message that fails a check (its
signature, direction, session, sequence number or fields) is dropped, never acted on, and
counted by reason (``dropped``, in ``status --json`` and ``/metrics``); a connection that has
sent ``MAX_DROPPED`` of them is closed.

A node is lost when its heartbeats stop for ``heartbeat_timeout`` (its connection is then
dropped, so it must join again), when its connection closes, or when it leaves.

Strangers (SPEC §12.3, §13): a connection that has not joined yet may buffer at most
``MAX_JOIN_BYTES`` and must join within ``join_deadline`` seconds; at most ``max_pending``
(twice the node count, at least 4) such connections are held at once, and one past that is
closed at once. Refusals of strangers are logged at most once per ``REFUSAL_LOG_EVERY_S``
(with the count of those not logged). What a node sends is cleaned where it arrives
(``membership.clean_*``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from atroposd.cluster.membership import (
    LOST,
    ChangeCallback,
    Member,
    Membership,
    NodeState,
    clean_rows,
    clean_text,
    clean_value,
    replicas_ready,
)
from atroposd.cluster.messages import (
    CHALLENGE,
    FIELDS,
    FRAMING,
    MAC,
    N2H,
    REASONS,
    Ack,
    BadMessage,
    Beat,
    Hello,
    Join,
    Leave,
    LineTooLong,
    Message,
    Refused,
    Replaced,
    Report,
    Stop,
    Stopped,
    Welcome,
    WrongToken,
    decode,
)
from atroposd.cluster.wire import (
    MAX_JOIN_BYTES,
    MAX_MESSAGE_BYTES,
    Channel,
    auth_key,
    new_challenge,
    open_join,
    ranks_key,
    store_secret,
)
from atroposd.logs import get_logger
from atroposd.net import BindError, address_towards

if TYPE_CHECKING:
    from atroposd.config import ClusterConfig, Config

__all__ = [
    "JOIN_DEADLINE_S",
    "MAX_DROPPED",
    "ClusterHead",
    "ClusterStartError",
    "Drops",
    "JoinCheck",
    "bind_address",
    "heartbeat_interval",
    "max_pending",
]

log = get_logger("atroposd.cluster")

# Seconds a new connection has to send its join (a node sends it at once).
JOIN_DEADLINE_S = 5.0
# At most one log line per kind of refused stranger in this many seconds.
REFUSAL_LOG_EVERY_S = 10.0
# Messages dropped on one connection before it is closed (a peer that keeps sending them is
# broken or hostile; one bad line alone never ends a session).
MAX_DROPPED = 16


def max_pending(nodes: int) -> int:
    """Connections that have not joined held at once: twice the node count, at least 4."""
    return max(4, 2 * nodes)


def bind_address(cfg: ClusterConfig) -> str:
    """The address every listening port of a node binds (SPEC §12.3): ``[cluster] bind``, else
    the address of this host that ``head`` is reached through — on the head, the address
    ``head`` resolves to; on a loopback head, that loopback address (``net.address_towards``).
    ClusterStartError naming cluster.bind when there is none."""
    if cfg.bind:
        return cfg.bind
    if not cfg.head:
        return "127.0.0.1"
    try:
        return address_towards(cfg.head, cfg.port)
    except BindError as exc:
        raise ClusterStartError(
            f"cluster.head: {exc}: set cluster.bind to this host's address on the network between the nodes"
        ) from None


class _RefusalLog:
    """Warnings about refused strangers, at most one per kind every ``every`` seconds."""

    def __init__(self, every: float = REFUSAL_LOG_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.every, self.clock = every, clock
        self.refused = 0  # every refusal, logged or not
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def __call__(self, kind: str, message: str, **fields: object) -> None:
        self.refused += 1
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.every:
            self._quiet[kind] = self._quiet.get(kind, 0) + 1
            return
        self._last[kind] = now
        quiet = self._quiet.pop(kind, 0)
        log.warning(message, **fields, **({"not_logged_since_last": quiet} if quiet else {}))


class Drops:
    """Messages dropped (never acted on), by reason (``messages.REASONS``); a warning per reason
    at most once per ``REFUSAL_LOG_EVERY_S``, with the count of those not logged."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.counts: dict[str, int] = dict.fromkeys(REASONS, 0)
        self._log = _RefusalLog(clock=clock)

    def __call__(self, reason: str, error: str, **fields: object) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self._log(
            f"dropped-{reason}", "dropped a cluster message", reason=reason, error=clean_text(error, 200), **fields
        )

    def view(self) -> dict[str, int]:
        return dict(self.counts)


# A join the daemon wants to refuse (ranks per node differ, ...): the reason, or None to accept.
JoinCheck = Callable[[Join], "str | None"]


def heartbeat_interval(heartbeat_timeout: float) -> float:
    """Seconds between heartbeats: six fit in ``heartbeat_timeout`` (bounded to 0.05..5 s)."""
    return min(5.0, max(0.05, heartbeat_timeout / 6))


class ClusterStartError(Exception):
    """The endpoint could not be opened (the port is taken, the address is not ours)."""


class ClusterHead:
    """Node 0's endpoint. ``start`` → (children run) → ``stop_all`` → ``close``."""

    def __init__(
        self,
        cfg: ClusterConfig,
        *,
        token: bytes,
        host: str | None = None,
        bind_host: str | None = None,
        units: Mapping[str, Any] | None = None,
        instance: str | None = None,
        check_join: JoinCheck | None = None,
        on_change: ChangeCallback | None = None,
        on_message: Callable[[int, Message], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        join_deadline: float = JOIN_DEADLINE_S,
    ) -> None:
        if cfg.nodes < 1:
            raise ValueError("cluster.nodes must be ≥ 1")
        self.cfg = cfg
        self._auth = auth_key(token)
        self.store_secret = store_secret(token)
        self.store_key = ranks_key(token)  # the trainer ranks' command key
        self.host = host or socket.gethostname()
        # [cluster] bind, else the address head resolves to here (never every interface): found
        # in start, where a head that does not resolve is a ClusterStartError.
        self.bind_host = bind_host
        self.join_deadline = join_deadline
        self.max_pending = max_pending(cfg.nodes)
        self._pending: set[Channel] = set()  # connections that have not joined yet
        self._refusals = _RefusalLog()
        self._drops = Drops()
        self.instance = instance or uuid.uuid4().hex
        self.interval = heartbeat_interval(cfg.heartbeat_timeout)
        self.check_join = check_join
        self.membership = Membership(cfg.nodes, cfg.heartbeat_timeout, clock=clock, on_change=self._changed)
        self._user_on_change = on_change
        self._on_message = on_message
        self._server: asyncio.base_events.Server | None = None
        # accepted connections, handed from the server's callback to serve's group of handlers
        self._accepted: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
        self._close_asked = asyncio.Event()
        self._served = asyncio.Event()  # serve has returned (set while it never ran)
        self._served.set()
        self._runner: asyncio.Task[None] | None = None  # start's (a caller without a task group)
        self._channels: dict[int, Channel] = {}  # the admitted connection of each node
        self._open: set[Channel] = set()  # every connection, admitted or not
        self._stopped: dict[int, asyncio.Event] = {}
        self._stopping = False
        self._closing = False
        self._changed_event = asyncio.Event()
        self.membership.join(0, host=self.host, pid=os.getpid(), instance=self.instance, units=units, ready=False)

    @classmethod
    def from_config(cls, cfg: Config, **kwargs: Any) -> ClusterHead:
        """The head of ``cfg``: its token read from ``[cluster] token_file`` (ClusterError if not)."""
        return cls(cfg.cluster, token=cfg.cluster.read_token(), **kwargs)

    # ------------------------------------------------------------------ lifecycle

    @property
    def port(self) -> int:
        """The port bound (``cluster.port``)."""
        if self._server is None or not self._server.sockets:
            return self.cfg.port
        return int(self._server.sockets[0].getsockname()[1])

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Open the endpoint (ClusterStartError naming the port when it cannot) and serve it until
        ``close``: the heartbeat watchdog and each connection's handler are tasks of this one's
        groups, none outlives it. Started once the endpoint accepts connections."""
        await self._bind()
        await self._run(task_status.started)

    async def start(self) -> None:
        """``serve`` for a caller without a task group: returns once the endpoint is open, serving
        on in a task that ``close`` ends and waits for."""
        await self._bind()
        opened = asyncio.Event()
        self._runner = asyncio.create_task(self._run(opened.set), name="cluster-endpoint")
        await opened.wait()

    async def _bind(self) -> None:
        if self.bind_host is None:
            self.bind_host = bind_address(self.cfg)
        where = f"{self.bind_host}:{self.cfg.port}"
        try:
            self._server = await asyncio.start_server(
                self._accept,
                self.bind_host,
                self.cfg.port,
                limit=MAX_JOIN_BYTES,
                reuse_address=True,
                start_serving=False,
            )
        except OSError as exc:
            why = "already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
            raise ClusterStartError(f"cluster.port: cannot open the cluster endpoint on {where}: {why}") from None
        self._served.clear()

    async def _run(self, started: Callable[[], None]) -> None:
        server = self._server
        assert server is not None
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._watchdog, name="cluster-watchdog")
                async with anyio.create_task_group() as connections:
                    tasks.start_soon(self._handle_accepted, connections, name="cluster-accept")
                    await server.start_serving()
                    log.info(
                        "cluster endpoint open",
                        address=f"{self.bind_host}:{self.cfg.port}",
                        nodes=self.cfg.nodes,
                        instance=self.instance,
                    )
                    started()
                    await self._close_asked.wait()
                    # close() aborted every connection: a handler still running in 2 s is cancelled
                    connections.cancel_scope.deadline = anyio.current_time() + 2.0
                tasks.cancel_scope.cancel()
        finally:
            server.close()
            while not self._accepted.empty():  # accepted as the endpoint closed: never handled
                self._accepted.get_nowait()[1].transport.abort()
            try:
                with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
                    await server.wait_closed()
            finally:
                self._server = None
                self._served.set()

    async def close(self) -> None:
        """Close the endpoint and every connection (nodes then find their head gone)."""
        self._closing = True
        self._close_asked.set()
        if self._server is not None:
            self._server.close()
        for ch in list(self._open):
            ch.abort()
        await self._served.wait()
        if self._runner is not None:
            await self._runner
            self._runner = None

    # ------------------------------------------------------------------ what the daemon asks

    def nodes(self) -> list[dict[str, Any]]:
        """The ``nodes`` of ``status --json``: node_rank, host, state, components, ... per node."""
        return self.membership.view()

    def report(self, components: Sequence[Mapping[str, Any]], ready: bool | None = None) -> None:
        """The head's own components (node 0's row); ready by default once its replicas are."""
        self.membership.report(0, components, replicas_ready(components) if ready is None else ready)

    async def wait_all_ready(self, timeout: float) -> bool:  # noqa: ASYNC109 - the answer is whether within it
        """Wait until every node is ``ready`` (node 0 included); False after ``timeout``."""
        with anyio.move_on_after(timeout):
            while True:
                self._changed_event.clear()  # before the check: a change after it wakes the wait
                if self.membership.all_ready():
                    return True
                await self._changed_event.wait()
        return self.membership.all_ready()

    @property
    def refused(self) -> int:
        """Connections of strangers refused so far (over the cap, silent, wrong token, garbage)."""
        return self._refusals.refused

    @property
    def dropped(self) -> dict[str, int]:
        """Messages dropped so far, by reason (every reason, zeros included)."""
        return self._drops.view()

    def connected(self) -> list[int]:
        """The nodes (other than the head) with an admitted connection that is not lost."""
        return sorted(r for r in self._channels if self.membership.members[r].state != LOST)

    async def send(self, rank: int, msg: Message) -> bool:
        """One message to node ``rank``; False when it has no connection or the send failed."""
        ch = self._channels.get(rank)
        if ch is None or self.membership.members[rank].state == LOST:
            return False
        return await ch.try_send(msg, self.interval * 2)

    async def broadcast(self, msg: Message) -> list[int]:
        """``msg`` to every connected node; the nodes it reached."""
        targets = self.connected()
        reached: list[int] = []

        async def one(rank: int) -> None:
            if await self.send(rank, msg):
                reached.append(rank)

        async with anyio.create_task_group() as tg:  # all at once: a node that does not read delays no other
            for r in targets:
                tg.start_soon(one, r)
        return sorted(reached)

    async def stop_all(self, timeout: float) -> dict[int, str]:  # noqa: ASYNC109 - the answer names it
        """Ask every connected node to stop, and wait (up to ``timeout``) until each says its
        processes are gone. Joins are refused from now on. Returns the nodes that did not
        confirm, each with the reason (empty: every node confirmed, or none was connected)."""
        self._stopping = True
        targets = {r: ch for r, ch in self._channels.items() if self.membership.members[r].state != LOST}
        for r in targets:
            self._stopped.setdefault(r, asyncio.Event())
        # All at once: a node that does not read never delays another's stop. A failed send
        # means its connection is gone: the wait below sees it lost.
        async with anyio.create_task_group() as tg:
            for ch in targets.values():
                tg.start_soon(ch.try_send, Stop(), self.interval * 2)
        log.info("asked the nodes to stop", nodes=sorted(targets))

        def pending() -> list[int]:
            return [r for r in targets if not self._stopped[r].is_set() and self.membership.members[r].state != LOST]

        with anyio.move_on_after(timeout):
            while True:
                self._changed_event.clear()
                if not pending():
                    break
                with anyio.move_on_after(self.interval):
                    await self._changed_event.wait()
        out: dict[int, str] = {}
        for r in targets:
            if self._stopped[r].is_set():
                continue
            m = self.membership.members[r]
            out[r] = (
                f"lost before it confirmed ({m.reason})" if m.state == LOST else f"did not confirm within {timeout:g} s"
            )
        if out:
            log.warning("nodes did not confirm their stop", nodes=out)
        return out

    # ------------------------------------------------------------------ internals

    def _changed(self, rank: int, old: NodeState, new: NodeState, reason: str) -> None:
        log.info("cluster node state", node_rank=rank, state=new.value, was=old.value, reason=reason or None)
        self._changed_event.set()
        if self._user_on_change is not None:
            self._user_on_change(rank, old, new, reason)

    def _lose(self, rank: int, reason: str, ch: Channel | None = None) -> None:
        if ch is not None and self._channels.get(rank) is not ch:
            return  # an older connection of a node that joined again
        if self._closing:  # the endpoint closes: its connections end, the nodes are not lost for that
            self._channels.pop(rank, None)
            return
        self.membership.lose(rank, reason)
        self._changed_event.set()
        old = self._channels.pop(rank, None)
        if old is not None:
            old.abort()

    async def _watchdog(self) -> None:
        while True:
            await anyio.sleep(self.interval / 2)
            for rank in self.membership.silent():
                self._lose(rank, f"no heartbeat for {self.cfg.heartbeat_timeout:g} s")

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A new connection (the server's callback): handed to serve's group of handlers."""
        if self._closing:
            writer.transport.abort()
            return
        self._accepted.put_nowait((reader, writer))

    async def _handle_accepted(self, connections: anyio.abc.TaskGroup) -> None:
        """Each accepted connection's handler, a task of ``connections``, until the endpoint closes."""
        while True:
            reader, writer = await self._accepted.get()
            if self._closing:
                writer.transport.abort()
                continue
            connections.start_soon(self._serve, reader, writer, name="cluster-connection")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ch = Channel(reader, writer, limit=MAX_JOIN_BYTES)
        if len(self._pending) >= self.max_pending:
            self._refusals(
                "refused-full",
                "refused a connection: too many connections have not joined yet",
                peer=ch.peer,
                pending=len(self._pending),
                max_pending=self.max_pending,
            )
            ch.abort()
            return
        self._open.add(ch)
        self._pending.add(ch)
        try:
            await self._session(ch)
        except (OSError, asyncio.IncompleteReadError):
            pass
        except Exception as exc:  # one connection's defect ends that connection, never the endpoint
            asyncio.get_running_loop().call_exception_handler(
                {"message": f"a cluster connection's handler failed (peer {ch.peer})", "exception": exc}
            )
        finally:
            self._open.discard(ch)
            self._pending.discard(ch)
            ch.abort()
            for rank in [r for r, c in self._channels.items() if c is ch]:
                # it broke on a send: the node went away (after its confirmed stop, or not)
                self._lose(rank, "stopped" if self._confirmed(rank) else "connection closed", ch)

    def _confirmed(self, rank: int) -> bool:
        """Node ``rank`` said its processes are gone (after the head's stop)."""
        event = self._stopped.get(rank)
        return event is not None and event.is_set()

    async def _refuse(self, ch: Channel, reason: str, *, fatal: bool = True) -> None:
        """A refusal: signed in the connection's session, unsigned when its join did not verify."""
        msg = Refused(reason=reason, fatal=fatal)
        with contextlib.suppress(OSError, TimeoutError), anyio.fail_after(2.0):
            await (ch.send(msg) if ch.session is not None else ch.send_unsigned(msg))

    async def _session(self, ch: Channel) -> None:
        challenge = new_challenge()
        try:
            with anyio.fail_after(2.0):
                await ch.send_unsigned(Hello(challenge=challenge))
            with anyio.fail_after(self.join_deadline):
                line = await ch.readline()
            if not line:
                return
            ch.session, values = open_join(self._auth, challenge, line)
        except TimeoutError:
            self._refusals(
                "refused-silent",
                "closed a connection that did not join in time",
                peer=ch.peer,
                join_deadline_s=self.join_deadline,
            )
            return
        except WrongToken:
            self._drops(MAC, "a join not signed with this cluster's token", peer=ch.peer)
            self._refusals(
                "refused-token", "refused a node: its messages are not signed with this cluster's token", peer=ch.peer
            )
            await self._refuse(
                ch, "wrong cluster token: this node's cluster.token_file does not hold the head's secret"
            )
            return
        except BadMessage as exc:
            self._drops(exc.reason, str(exc), peer=ch.peer)
            if exc.reason == CHALLENGE:
                self._refusals(
                    "refused-replay", "refused a join signed for another connection (a replayed join)", peer=ch.peer
                )
                await self._refuse(ch, f"{exc}: a join is good on the connection it was made for only")
                return
            self._refusals(
                "refused-garbage",
                "refused a connection that does not speak the cluster protocol",
                peer=ch.peer,
                error=clean_text(exc, 200),
            )
            await self._refuse(ch, f"not a message of the cluster protocol ({clean_text(exc, 200)})")
            return
        try:
            join = decode(Join.TYPE, values, N2H)
        except BadMessage as exc:
            self._drops(FIELDS, str(exc), peer=ch.peer)
            log.warning("refused a node: its join does not check", peer=ch.peer, error=clean_text(exc, 200))
            await self._refuse(ch, f"a join the head cannot read: {clean_text(exc, 200)}")
            return
        assert isinstance(join, Join)
        rank = await self._admit(ch, join)
        if rank is None:
            return
        self._pending.discard(ch)
        ch.limit = MAX_MESSAGE_BYTES
        while True:
            try:
                msg = await ch.recv()
            except LineTooLong as exc:
                self._drops(FRAMING, str(exc), node_rank=rank)
                log.warning("dropping a node's connection: bad message", node_rank=rank, error=str(exc))
                self._lose(rank, f"bad message: {exc}", ch)
                return
            except BadMessage as exc:
                self._drops(exc.reason, str(exc), node_rank=rank)
                if ch.dropped >= MAX_DROPPED:
                    log.warning(
                        "dropping a node's connection: too many bad messages", node_rank=rank, dropped=ch.dropped
                    )
                    self._lose(
                        rank, f"{ch.dropped} messages dropped on its connection (the last: {clean_text(exc, 200)})", ch
                    )
                    return
                continue
            if msg is None:
                if self._confirmed(rank):
                    self._lose(rank, "stopped", ch)
                else:
                    self._lose(rank, "connection closed", ch)
                return
            if self._channels.get(rank) is not ch:
                return  # replaced by a newer connection, or lost: this one is done
            self.membership.seen(rank)
            if isinstance(msg, Beat):
                assert ch.session is not None
                await ch.send(Ack(beat=ch.session.recv_seq))
            elif isinstance(msg, Report):
                self.membership.report(rank, clean_rows(msg.components), msg.ready)
            elif isinstance(msg, Stopped):
                self._stopped.setdefault(rank, asyncio.Event()).set()
                self._changed_event.set()
                log.info("node stopped", node_rank=rank)
            elif isinstance(msg, Leave):
                self._lose(rank, f"left: {clean_text(msg.reason or 'stopped on its own')}", ch)
                return
            elif self._on_message is not None:
                self._on_message(rank, msg)  # the daemon's own messages (trainer ranks, resyncs)

    async def _admit(self, ch: Channel, msg: Join) -> int | None:
        """Check a join; register the node and answer ``welcome``, or refuse. Its rank or None."""
        rank = msg.node_rank
        host = clean_text(msg.host, 255)
        instance = clean_text(msg.instance, 64)
        if not 0 < rank < self.cfg.nodes:
            shown = clean_text(repr(rank), 64)
            reason = (
                f"node_rank {shown} is the head's"
                if rank == 0
                else f"node_rank {shown} is not one of 1..{self.cfg.nodes - 1} (cluster.nodes = {self.cfg.nodes})"
            )
            log.warning("refused a node", peer=ch.peer, reason=reason)
            await self._refuse(ch, reason)
            return None
        if self._stopping:
            await self._refuse(ch, "the job is stopping")
            return None
        if self.check_join is not None:
            problem = self.check_join(msg)
            if problem:
                log.warning("refused a node", node_rank=rank, host=host, reason=problem)
                await self._refuse(ch, problem)
                return None
        m: Member = self.membership.members[rank]
        held = self._channels.get(rank)
        if held is not None and m.state != LOST and m.instance != instance and m.host != host:
            reason = (
                f"node_rank {rank} is already held by {m.host} (pid {m.pid}), which is alive; "
                "check cluster.node_rank on both"
            )
            log.warning("refused a node", node_rank=rank, host=host, reason=reason)
            await self._refuse(ch, reason)
            return None
        if msg.rejoin and msg.head_instance != self.instance:
            await self._refuse(
                ch, "this head restarted since the node joined (another instance): the node must restart and join again"
            )
            return None
        if msg.rejoin and m.joins and m.instance != instance:
            reason = f"node_rank {rank} was taken over by a newer start of this node (pid {m.pid})"
            log.warning("refused a node", node_rank=rank, host=host, reason=reason)
            await self._refuse(ch, reason)
            return None
        if held is not None:
            # The same node, restarted (a new instance: the old one is told) or reconnected.
            self._channels.pop(rank, None)
            if m.instance != instance:
                with contextlib.suppress(OSError, TimeoutError), anyio.fail_after(1.0):
                    await held.send(Replaced(by_pid=msg.pid))
            held.abort()
        comps = clean_rows(msg.components)
        units = clean_value(msg.units)
        pid = msg.pid
        peer = ch.writer.get_extra_info("peername")
        address = peer[0] if isinstance(peer, tuple) else ""
        again = m.joins > 0 and m.instance == instance
        self._channels[rank] = ch
        self.membership.join(
            rank, host=host, address=address, pid=pid, instance=instance, units=units, components=comps, ready=msg.ready
        )
        self._changed_event.set()
        await ch.send(
            Welcome(head_instance=self.instance, head_host=self.host, nodes=self.cfg.nodes, interval=self.interval)
        )
        log.info(
            "node reconnected" if again else "node joined",
            node_rank=rank,
            host=host,
            address=address,
            pid=pid,
            units=units,
        )
        return rank

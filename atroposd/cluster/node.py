"""A node's side of the cluster endpoint (node_rank > 0; SPEC §12.3).

``join`` waits for the head up to ``join_timeout`` (progress logged), then joins with the
node's rank, host and units; a refusal (wrong token, a rank held by another machine, a job
that is stopping) raises ClusterRefused with the head's reason. ``run`` then heartbeats, sends
the node's components whenever ``report`` changes them, and returns when the job is over for
this node:

- ``"stopped"``: the head asked every node to stop; ``on_stop`` ran (the daemon stops its
  children there) and the head was told once it returned;
- ``"lost"``: nothing came from the head for ``give_up_after`` (``heartbeat_timeout`` less one
  heartbeat interval, so that the daemon's children are stopped within ``heartbeat_timeout``),
  or its endpoint refused every reconnection for one heartbeat interval (the head exited: a
  head closes its endpoint only at its end), or it restarted, or it refused a rejoin;
  ``on_lost_head`` ran first — the daemon stops its children there, by ``stop_by``, and exits
  1, so that its launcher starts it again and it rejoins;
- ``"left"``: this node stopped on its own (``leave``).

A connection that breaks is re-established within ``give_up_after`` when the same head
instance is still there; a head that restarted meanwhile counts as lost (this node's place in
the old trainer group is gone with it).

Each connection is one session (``wire``): the node signs its join for the head's challenge and
takes only messages of that session, in the head's direction, with rising sequence numbers.
Anything else is dropped, never acted on, and counted by reason (``dropped``); a connection
that has delivered ``MAX_DROPPED`` of them is given up and mended like a broken one.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import orjson

from atroposd.cluster.head import MAX_DROPPED, Drops, heartbeat_interval
from atroposd.cluster.membership import replicas_ready
from atroposd.cluster.messages import (
    FRAMING,
    Beat,
    CanaryAsk,
    Care,
    Hello,
    Join,
    Leave,
    LineTooLong,
    Message,
    Ranks,
    Refused,
    Replaced,
    Report,
    Stop,
    Stopped,
    Welcome,
)
from atroposd.cluster.wire import (
    MAX_JOIN_BYTES,
    UNSIGNED,
    BadMessage,
    Channel,
    WrongToken,
    auth_key,
    join_key,
    new_challenge,
    node_session,
    open_unsigned,
    ranks_key,
    store_secret,
)
from atroposd.logs import get_logger

if TYPE_CHECKING:
    from atroposd.config import ClusterConfig, Config

__all__ = ["LEFT", "LOST", "STOPPED", "ClusterJoinTimeout", "ClusterNode", "ClusterRefused", "LinkState"]

log = get_logger("atroposd.cluster")


class LinkState(str, enum.Enum):
    """A node's link to its head (its ``cluster.state`` in ``status --json``: the value):
    ``joining`` until the head welcomed it, ``joined`` while it runs, then how ``run`` ended."""

    JOINING = "joining"
    JOINED = "joined"
    STOPPED = "stopped"  # the head asked every node to stop
    LOST = "lost"  # the head went silent, restarted, or refused a rejoin
    LEFT = "left"  # this node stopped on its own

    def __str__(self) -> str:
        return self.value


STOPPED, LOST, LEFT = LinkState.STOPPED, LinkState.LOST, LinkState.LEFT
_JOIN_LOG_EVERY = 10.0

Callback = Callable[..., "Awaitable[None] | None"]


class ClusterRefused(Exception):
    """The head turned this node away; the message is its reason."""


class ClusterJoinTimeout(Exception):
    """The head did not answer within ``join_timeout``."""


async def _call(cb: Callback | None, *args: object) -> None:
    if cb is None:
        return
    result = cb(*args)
    if inspect.isawaitable(result):
        await result


class ClusterNode:
    def __init__(
        self,
        cfg: ClusterConfig,
        *,
        token: bytes,
        node_rank: int,
        host: str | None = None,
        units: Mapping[str, Any] | None = None,
        instance: str | None = None,
        on_lost_head: Callable[[str], Awaitable[None] | None] | None = None,
        on_stop: Callable[[], Awaitable[None] | None] | None = None,
        on_message: Callable[[Message], None] | None = None,
    ) -> None:
        if not cfg.head:
            raise ValueError("cluster.head is required for a node to join")
        if not 0 < node_rank < cfg.nodes:
            raise ValueError(f"node_rank {node_rank} is not one of 1..{cfg.nodes - 1}")
        self.cfg, self.node_rank = cfg, node_rank
        self._auth = auth_key(token)
        self._drops = Drops()
        self.store_secret = store_secret(token)
        self.store_key = ranks_key(token)  # the trainer ranks' command key
        self.host = host or socket.gethostname()
        self.units = dict(units or {})
        self.instance = instance or uuid.uuid4().hex
        self.on_lost_head, self.on_stop = on_lost_head, on_stop
        self.on_message = on_message
        self.interval = heartbeat_interval(cfg.heartbeat_timeout)
        # The head finds a node lost after heartbeat_timeout; a node gives up on its head one
        # interval earlier, which leaves that interval to stop its children (SPEC §12.3: a node
        # cut off from its head is gone within heartbeat_timeout).
        self.give_up_after = cfg.heartbeat_timeout - self.interval
        self.head_instance = ""
        self._ch: Channel | None = None
        self._components: list[dict[str, Any]] = []
        self._ready = False
        self._dirty = False
        self._wake = asyncio.Event()
        self._last_heard = 0.0
        self._lost_reason = ""
        self._tasks: anyio.abc.TaskGroup | None = None  # run's: the heartbeats, the stop
        self._stopping = False  # the head asked this node to stop
        self._stop_done = asyncio.Event()
        self._leaving = False

    @classmethod
    def from_config(cls, cfg: Config, **kwargs: Any) -> ClusterNode:
        """The node of ``cfg``: rank resolved (ClusterError if it cannot be), token read."""
        c = cfg.cluster
        return cls(c, token=c.read_token(), node_rank=c.resolve_node_rank(), **kwargs)

    @property
    def head_address(self) -> str:
        return f"{self.cfg.head}:{self.cfg.port}"

    def _loop_time(self) -> float:
        return asyncio.get_running_loop().time()

    @property
    def stop_by(self) -> float:
        """When a node that lost its head must have stopped its children (``time.monotonic()``,
        the event loop's clock): ``heartbeat_timeout`` after the head was last heard, when the
        head finds this node lost and may start its trainer group again without it."""
        return self._last_heard + self.cfg.heartbeat_timeout

    # ------------------------------------------------------------------ joining

    @property
    def dropped(self) -> dict[str, int]:
        """Messages from the head dropped so far, by reason (every reason, zeros included)."""
        return self._drops.view()

    def _join_msg(self, challenge: str, nonce: str) -> Join:
        # The head reads at most MAX_JOIN_BYTES before a join: components that would not fit
        # follow in the report sent right after the welcome.
        comps = self._components if len(orjson.dumps(self._components)) <= MAX_JOIN_BYTES // 2 else []
        return Join(
            challenge=challenge,
            nonce=nonce,
            node_rank=self.node_rank,
            host=self.host,
            pid=os.getpid(),
            instance=self.instance,
            units=self.units,
            components=comps,
            ready=self._ready,
            rejoin=bool(self.head_instance),
            head_instance=self.head_instance,
        )

    async def _connect(self) -> Channel:
        reader, writer = await asyncio.open_connection(self.cfg.head, self.cfg.port)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return Channel(reader, writer)

    async def _handshake(self, ch: Channel) -> Welcome | None:
        """Read the head's challenge, send the join signed for it; the head's welcome, or None
        when it closed without one (retry). Raises ClusterRefused on a fatal refusal.

        Before its first welcome a node takes an unsigned refusal (the head's answer to a
        wrong token: nothing signed could reach it). Once welcomed, it knows its head signs
        with its token: an unsigned or foreign answer is not its head's, and only a signed
        refusal ends it (anything else is a failed attempt, retried)."""
        welcomed = bool(self.head_instance)
        with anyio.fail_after(self.cfg.heartbeat_timeout):
            line = await ch.readline()
        if not line:
            return None
        hello = open_unsigned(line)
        if not isinstance(hello, Hello):
            raise BadMessage(f"expected the head's hello, got {hello.TYPE!r}")
        nonce = new_challenge()
        ch.session = node_session(self._auth, hello.challenge, nonce)
        await ch.send(self._join_msg(hello.challenge, nonce), key=join_key(self._auth, hello.challenge))
        with anyio.fail_after(self.cfg.heartbeat_timeout):
            line = await ch.readline()
        if not line:
            return None
        try:
            if line.startswith(UNSIGNED + b" ") and not welcomed:
                msg: Message = open_unsigned(line)
            else:
                msg = ch.session.open(line)
        except WrongToken:
            if welcomed:
                raise BadMessage(f"an answer from {self.head_address} not signed with this cluster's token") from None
            raise ClusterRefused(
                f"the head at {self.head_address} signs with another cluster token "
                "(cluster.token_file differs between the nodes)"
            ) from None
        if isinstance(msg, Refused):
            reason = msg.reason or "no reason given"
            if msg.fatal:
                raise ClusterRefused(f"the head at {self.head_address} refused node {self.node_rank}: {reason}")
            log.info("the head asked this node to retry its join", head=self.head_address, reason=reason)
            return None
        if not isinstance(msg, Welcome):
            raise BadMessage(f"expected welcome, got {msg.TYPE!r}")
        return msg

    async def join(self) -> Welcome:
        """Wait for the head (up to ``join_timeout``) and join; returns the head's welcome.
        Raises ClusterRefused (logged) or ClusterJoinTimeout."""
        start = self._loop_time()
        deadline = start + self.cfg.join_timeout
        backoff, last_log = 0.1, -float("inf")
        while True:
            left = deadline - self._loop_time()
            if left <= 0:
                raise ClusterJoinTimeout(
                    f"the head at {self.head_address} did not answer within "
                    f"cluster.join_timeout ({self.cfg.join_timeout:g} s)"
                )
            error = ""
            try:
                with anyio.fail_after(min(left, 5.0)):
                    ch = await self._connect()
            except (OSError, TimeoutError) as exc:
                error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                try:
                    welcome = await self._handshake(ch)
                except ClusterRefused as exc:
                    await ch.close()
                    log.error("refused by the head", head=self.head_address, node_rank=self.node_rank, reason=str(exc))
                    raise
                except (OSError, BadMessage, TimeoutError) as exc:
                    await ch.close()
                    error = f"{type(exc).__name__}: {exc}"
                else:
                    if welcome is not None:
                        self._welcomed(ch, welcome)
                        log.info(
                            "joined the cluster",
                            head=self.head_address,
                            node_rank=self.node_rank,
                            waited_s=round(self._loop_time() - start, 3),
                        )
                        return welcome
                    await ch.close()
                    error = "the head closed the connection"
            now = self._loop_time()
            if now - last_log >= _JOIN_LOG_EVERY:
                last_log = now
                log.info(
                    "waiting for the head",
                    head=self.head_address,
                    node_rank=self.node_rank,
                    waited_s=round(now - start, 1),
                    join_timeout=self.cfg.join_timeout,
                    error=error,
                )
            await anyio.sleep(min(backoff, max(0.0, deadline - now)))
            backoff = min(backoff * 2, 2.0)

    def _welcomed(self, ch: Channel, welcome: Welcome) -> None:
        self._ch = ch
        self.head_instance = welcome.head_instance
        self._last_heard = self._loop_time()
        self._dirty = True  # a report at once: the join may not have carried the components
        self._wake.set()

    # ------------------------------------------------------------------ running

    def report(self, components: Sequence[Mapping[str, Any]], ready: bool | None = None) -> None:
        """This node's components (as in ``status --json``) for the head's ``nodes`` view; the
        node is ready once ``ready`` (default: once every inference replica is ``ready``)."""
        self._components = [dict(c) for c in components]
        self._ready = replicas_ready(components) if ready is None else bool(ready)
        self._dirty = True
        self._wake.set()

    async def run(self) -> LinkState:
        """Heartbeat until the job ends for this node: ``"stopped"``, ``"lost"`` (after
        ``on_lost_head`` ran) or ``"left"``. Call after ``join``."""
        if self._ch is None:
            raise RuntimeError("join() first")
        try:
            # the heartbeats, and the stop once the head asks for it, are tasks of this group:
            # none outlives run
            async with anyio.create_task_group() as tasks:
                self._tasks = tasks
                tasks.start_soon(self._beat_loop, name="cluster-heartbeat")
                outcome = await self._receive_loop()
                tasks.cancel_scope.cancel()
        finally:
            self._tasks = None
            if self._ch is not None:
                await self._ch.close()
        if outcome == LOST:
            log.error("lost the head", head=self.head_address, node_rank=self.node_rank, reason=self._lost_reason)
            await _call(self.on_lost_head, self._lost_reason)
        return outcome

    async def send(self, msg: Message) -> bool:
        """One message to the head; False when there is no connection or the send failed."""
        ch = self._ch
        if ch is None or self._leaving:
            return False
        return await ch.try_send(msg, self.interval * 2)

    async def leave(self, reason: str = "stopped on its own") -> None:
        """Tell the head this node stops on its own (its ranks leave); ``run`` returns ``"left"``."""
        self._leaving = True
        ch = self._ch
        if ch is not None:
            with contextlib.suppress(OSError, TimeoutError), anyio.fail_after(self.interval * 2):
                await ch.send(Leave(reason=reason))
            await ch.close()

    def _lost(self, reason: str) -> None:
        if not self._lost_reason:
            self._lost_reason = reason
        if self._ch is not None:
            self._ch.abort()

    async def _beat_loop(self) -> None:
        while True:
            with anyio.move_on_after(self.interval):
                await self._wake.wait()
            self._wake.clear()
            if not self._stopping and not self._leaving and self._loop_time() - self._last_heard > self.give_up_after:
                self._lost(
                    f"nothing from the head at {self.head_address} for {self.give_up_after:g} s "
                    f"(cluster.heartbeat_timeout = {self.cfg.heartbeat_timeout:g} s)"
                )
                return
            ch = self._ch
            if ch is None or self._leaving:
                continue
            try:
                if self._dirty:
                    self._dirty = False
                    with anyio.fail_after(self.interval):
                        await ch.send(Report(components=self._components, ready=self._ready))
                with anyio.fail_after(self.interval):
                    await ch.send(Beat())
            except (OSError, TimeoutError):
                pass  # a broken connection is the receiver's to notice; silence is checked above

    async def _receive_loop(self) -> LinkState:
        while True:
            ch = self._ch
            assert ch is not None
            try:
                msg = await ch.recv()
            except LineTooLong as exc:
                self._drops(FRAMING, str(exc), head=self.head_address)
                self._lost(f"the head sent a bad message: {exc}")
                msg = None
            except BadMessage as exc:
                self._drops(exc.reason, str(exc), head=self.head_address)
                if ch.dropped < MAX_DROPPED:
                    continue
                log.warning(
                    "giving up a connection to the head: too many bad messages",
                    head=self.head_address,
                    dropped=ch.dropped,
                )
                ch.abort()  # mended like a broken connection (a new session)
                msg = None
            except OSError:
                msg = None
            if msg is not None:
                now = self._loop_time()
                if not self._stopping and not self._leaving and now - self._last_heard > self.give_up_after:
                    # Arrived after a silence longer than the head allows (this process was
                    # frozen: these lines waited in the socket): the head has found this node
                    # lost meanwhile, whatever the buffered lines say.
                    self._lost(
                        f"nothing from the head at {self.head_address} for {now - self._last_heard:.1f} s "
                        f"(cluster.heartbeat_timeout = {self.cfg.heartbeat_timeout:g} s)"
                    )
                    continue
                self._last_heard = now
                if isinstance(msg, Replaced):
                    self._lost(f"a newer start of this node (pid {msg.by_pid}) joined in its place")
                elif isinstance(msg, Stop):
                    if not self._stopping and self._tasks is not None:
                        log.info("the head asked this node to stop", node_rank=self.node_rank)
                        self._stopping = True
                        self._tasks.start_soon(self._stop, name="cluster-stop")
                elif isinstance(msg, (Ranks, CanaryAsk, Care)) and self.on_message is not None:
                    self.on_message(msg)  # the daemon's own messages (trainer ranks, the head's sentinel)
                continue
            # the connection ended
            if self._stopping:
                await self._stop_done.wait()
                return STOPPED
            if self._leaving:
                return LEFT
            if self._lost_reason or not await self._reconnect():
                return LOST

    async def _stop(self) -> None:
        try:
            await _call(self.on_stop)
        finally:
            ch = self._ch
            if ch is not None:
                with contextlib.suppress(OSError, TimeoutError), anyio.fail_after(self.interval * 2):
                    await ch.send(Stopped())
                await ch.close()
            self._stop_done.set()

    async def _reconnect(self) -> bool:
        """Join the same head again before ``give_up_after`` runs out; False (the reason set)
        when it cannot, or when the head is another instance now."""
        if self._ch is not None:
            self._ch.abort()
            self._ch = None
        deadline = self._last_heard + self.give_up_after
        log.warning(
            "connection to the head broken; reconnecting",
            head=self.head_address,
            within_s=round(max(0.0, deadline - self._loop_time()), 1),
        )
        backoff = 0.05
        refused_since: float | None = None
        while not self._lost_reason:
            left = deadline - self._loop_time()
            if left <= 0:
                self._lost(
                    f"the head at {self.head_address} has been unreachable for {self.give_up_after:g} s "
                    f"(cluster.heartbeat_timeout = {self.cfg.heartbeat_timeout:g} s)"
                )
                return False
            try:
                with anyio.fail_after(min(left, 2.0)):
                    ch = await self._connect()
            except (OSError, TimeoutError) as exc:
                now = self._loop_time()
                if not isinstance(exc, ConnectionRefusedError):
                    refused_since = None
                else:
                    # Nothing listens there: a head closes its endpoint only at its end (killed,
                    # crashed). Refused for an interval (not one blip of a proxy in between): lost
                    # now, which leaves the children the rest of heartbeat_timeout to stop.
                    refused_since = now if refused_since is None else refused_since
                    if now - refused_since >= self.interval:
                        self._lost(
                            f"the head at {self.head_address} refuses connections: its endpoint is closed "
                            "(the head exited or was killed)"
                        )
                        return False
                await anyio.sleep(min(backoff, max(0.0, deadline - now)))
                backoff = min(backoff * 2, 1.0)
                continue
            try:
                with anyio.fail_after(max(0.01, deadline - self._loop_time())):
                    welcome = await self._handshake(ch)
            except ClusterRefused as exc:
                await ch.close()
                self._lost(f"rejoin refused: {exc}")
                return False
            except (OSError, BadMessage, TimeoutError):
                await ch.close()
                continue
            if welcome is None:
                await ch.close()
                continue
            if welcome.head_instance != self.head_instance:
                await ch.close()
                self._lost(
                    f"the head at {self.head_address} restarted (another instance): this node must "
                    "restart and join again"
                )
                return False
            self._welcomed(ch, welcome)
            self._dirty = True
            log.info("reconnected to the head", head=self.head_address, node_rank=self.node_rank)
            return True
        return False

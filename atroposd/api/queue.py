"""The API's state: registrations, the queue, per-environment buffers, formed batches, room.

Semantics follow run-api (ATROPOS-PROTOCOL.md §1.1) with its failures fixed:

- Memory is bounded: ``held`` counts every sequence in the queue, the mixed-size buffers and
  formed-but-unserved batches, and never exceeds ``capacity``. A submission first reserves room
  (``reserve``): it waits, first come first served, up to ``full_wait`` seconds, then is refused
  (the server answers 503). Reserved room is converted by ``submit``.
- A batch leaves memory only once its response was written (``delivered``); a failed write puts
  it back on top of the formed stack (``undeliver``), so it is served next and never lost.
- Every change that must survive a restart goes to the spool *before* memory changes, so a
  submission the spool cannot keep is refused, not half-accepted.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from atroposd import pids
from atroposd.api.batching import find_groups_summing_to_target, grab_exact, grab_with_minimums
from atroposd.api.schema import (
    MAX_ENVS,
    EnvRegistration,
    Group,
    InvalidRequest,
    TrainerRegistration,
)
from atroposd.logs import get_logger

if TYPE_CHECKING:
    from atroposd.api.spool import Spool, SpoolState

__all__ = ["QueueFull", "TrajectoryStore"]

MIN_ENV_WEIGHT = 0.01  # upstream: an environment's weight never drops below this share
BYTES_PER_SEQUENCE = 64 << 10  # default byte budget per sequence of the cap (4096 tokens with logprobs)
MAX_WAITING = 256  # submissions waiting for room; beyond it a 503 at once
GONE_CHECK_INTERVAL_S = 1.0  # /status-env looks for environments whose process died at most this often


log = get_logger("api.queue")


class QueueFull(Exception):
    """No room for a submission within its wait; ``too_large`` when it can never fit."""

    def __init__(self, message: str, *, too_large: bool = False, reason: str = "full") -> None:
        super().__init__(message)
        self.too_large = too_large
        self.reason = reason


class TrajectoryStore:
    def __init__(
        self,
        capacity: int,
        *,
        spool: Spool | None = None,
        capacity_bytes: int | None = None,
        max_waiting: int = MAX_WAITING,
    ) -> None:
        self._gone_checked_at = 0.0
        self.capacity = capacity
        # Groups are held in their compact form; passthrough fields (messages, ...) count too.
        self.capacity_bytes = capacity_bytes if capacity_bytes is not None else capacity * BYTES_PER_SEQUENCE
        self.max_waiting = max_waiting
        self.held_bytes = 0
        self._reserved_bytes = 0
        self.spool = spool
        self.registration: TrainerRegistration | None = None
        self.requesters = 0
        self.started = False
        self.step = 0  # upstream's status_dict["step"]: batches formed (+ starting_step)
        self.served_step = 0  # batches delivered (+ starting_step): what a restart resumes from
        self.envs: list[EnvRegistration] = []
        self.queue: list[Group] = []
        self.buffers: dict[int, list[Group]] = {}
        self.formed: list[list[Group]] = []  # upstream's curr_batch (a stack)
        self.latest: Group | None = None
        self.held = 0  # sequences in queue + buffers + formed
        self._reserved = 0
        self._waiters: deque[tuple[int, int, asyncio.Future[None]]] = deque()
        self._next_seq = 0
        self._next_qpos = 0
        self.epoch = 0  # bumped by reset: a batch taken before a reset is neither acked nor put back
        self.acked_batch_ids: list[str] = []  # shared-memory batches acknowledged before a restart
        # Long-polls (GET /batch?wait=, /status-env with "wait_s") waiting for the queue to change.
        self._changed: list[asyncio.Future[None]] = []
        # Per env_id: how many of its groups left the queue (formed into batches, or cleared). An
        # environment's room opens only when this moves, so its gate long-polls on it.
        self.dequeued: dict[int, int] = {}
        self.env_version = 0  # bumped when environments register, disconnect or are reset

    # ------------------------------------------------------------------ restore

    def restore(self, state: SpoolState) -> None:
        """Adopt what the spool replayed (called once, before serving)."""
        self.registration = state.registration
        self.started = state.started
        self.step = self.served_step = state.step
        self.envs = [e for e in state.envs]
        for e in self.envs:
            e.group_size = min(e.group_size, self.capacity)
        self.queue = state.queue
        self.buffers = state.buffers
        self._next_seq = state.next_seq
        self._next_qpos = state.next_qpos
        self.held = sum(g.n for g in self.queue) + sum(g.n for b in self.buffers.values() for g in b)
        self.held_bytes = sum(g.nbytes for g in self.queue) + sum(g.nbytes for b in self.buffers.values() for g in b)
        self.latest = self.queue[-1] if self.queue else None
        self.acked_batch_ids = state.acked_batch_ids
        self._disconnect_gone_envs()

    def _disconnect_gone_envs(self) -> None:
        """An environment whose registering process no longer runs (killed and restarted under
        a new registration, or the whole daemon restarted) will not post again: it no longer
        counts in /status-env weights or minimum allocations, so the living environments' shares
        fill a batch again (a dead one's share would hold it back for good). Its queued groups
        are still served. Checked at a restart, at each registration, and at most once a second
        from /status-env."""
        self._gone_checked_at = time.monotonic()
        gone = [
            e
            for e in self.envs
            if e.connected
            and e.peer_pid is not None
            and e.peer_start is not None
            and pids.same_process(e.peer_pid, e.peer_start) is None
        ]
        for e in gone:
            e.connected = False
            log.info(
                "environment process is gone; marked disconnected",
                env_id=e.registered_id,
                name=e.real_name,
                peer_pid=e.peer_pid,
            )
            self._save_env(e)
        if gone:
            self._envs_changed()

    # ------------------------------------------------------------------ registrations

    @property
    def max_token_len(self) -> int | None:
        return self.registration.max_token_len if self.registration else None

    def register(self, reg: TrainerRegistration) -> int:
        """``POST /register``: the first registration sets the run up; later ones (a restarted
        trainer) change nothing but get a uuid, as upstream."""
        if self.registration is None:
            self.registration = reg
            self.step = self.served_step = reg.starting_step
            self.started = False
            self._save_state(rollback=self._forget_registration)
        self.requesters += 1
        return uuid.uuid4().int

    def register_env(self, req: dict[str, Any], *, peer: tuple[int, int | float] | None = None) -> dict[str, Any]:
        """``POST /register-env``; ``peer`` = (pid, start time) of the registering process."""
        self._disconnect_gone_envs()
        if not self.started or self.registration is None:
            return {"status": "wait for trainer to start"}
        if req["group_size"] > self.capacity:
            raise InvalidRequest(
                f"group_size {req['group_size']} can never fit: max_queued_sequences is {self.capacity}",
                422,
                "invalid_registration",
            )
        if len(self.envs) >= MAX_ENVS:
            raise InvalidRequest(
                f"at most {MAX_ENVS} environments may register (reset_data starts again)", 422, "too_many_envs"
            )
        name = req["desired_name"]
        real_name = f"{name}_{sum(1 for e in self.envs if e.desired_name == name)}"
        env = EnvRegistration(
            max_context_len=req["max_token_length"],
            weight=req["weight"],
            desired_name=name,
            real_name=real_name,
            registered_id=len(self.envs),
            group_size=req["group_size"],
            min_batch_allocation=req["min_batch_allocation"],
            last_update=time.time(),
            peer_pid=peer[0] if peer else None,
            peer_start=peer[1] if peer else None,
        )
        self.envs.append(env)
        self._save_env(env, rollback=lambda: self.envs.pop())
        self._envs_changed()  # every environment's share changed
        reg = self.registration
        return {
            "status": "success",
            "env_id": env.registered_id,
            "wandb_name": real_name,
            "checkpoint_dir": reg.checkpoint_dir,
            "starting_step": self.step,
            "checkpoint_interval": reg.save_checkpoint_interval,
            "num_steps": reg.num_steps,
        }

    def _forget_registration(self) -> None:
        self.registration = None
        self.step = self.served_step = 0

    def disconnect_env(self, env_id: int) -> dict[str, Any]:
        if not 0 <= env_id < len(self.envs):
            return {"status": "failure", "error": "list index out of range"}
        self.envs[env_id].connected = False
        self._save_env(self.envs[env_id])
        self._envs_changed()
        return {"status": "success"}

    def reset(self) -> None:
        """``GET /reset_data``: forget everything, the spool included."""
        self.registration = None
        self.requesters = 0
        self.started = False
        self.step = self.served_step = 0
        self.envs = []
        self.queue, self.buffers, self.formed = [], {}, []
        self.latest = None
        self.held = self.held_bytes = 0
        self.epoch += 1
        if self.spool is not None:
            self.spool.reset(self.snapshot())
        self._wake()
        self.dequeued = {}
        self._envs_changed()  # held /status-env answers go out (their environments are gone)

    def snapshot(self) -> dict[str, Any]:
        """What the spool keeps besides groups."""
        return {
            "registration": self.registration.to_json() if self.registration else None,
            "started": self.started,
            "step": self.served_step,
            "envs": [e.to_json() for e in self.envs],
        }

    def _save_state(self, rollback: Callable[[], Any] | None = None) -> None:
        if self.spool is None:
            return
        try:
            self.spool.write_state(self.snapshot())
        except OSError:
            if rollback is not None:
                rollback()
            raise

    def _save_env(self, env: EnvRegistration, rollback: Callable[[], Any] | None = None) -> None:
        """One registration's change: one spool record, not all of them again."""
        if self.spool is None:
            return
        try:
            self.spool.write_env(env.registered_id, env.to_json())
        except OSError:
            if rollback is not None:
                rollback()
            raise

    # ------------------------------------------------------------------ room

    async def reserve(self, n: int, timeout: float, nbytes: int = 0) -> None:
        """Wait (FIFO) until ``n`` more sequences (and ``nbytes`` more bytes) fit, for at most
        ``timeout`` s; QueueFull if not. The caller must ``submit`` (or ``release``) exactly that
        without awaiting in between. A caller cancelled while waiting (its client went away)
        keeps nothing."""
        if n > self.capacity:
            raise QueueFull(f"{n} sequences can never fit: max_queued_sequences is {self.capacity}", too_large=True)
        if nbytes > self.capacity_bytes:
            raise QueueFull(
                f"{nbytes} bytes of groups can never fit: the byte budget is {self.capacity_bytes}", too_large=True
            )
        if not self._waiters and self._fits(n, nbytes):
            self._reserved += n
            self._reserved_bytes += nbytes
            return
        if len(self._waiters) >= self.max_waiting:
            raise QueueFull(
                f"the queue is full ({self.held} of {self.capacity} sequences held) and "
                f"{len(self._waiters)} submissions already wait for room",
                reason="waiting",
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, nbytes, fut)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            if fut.done():
                return  # room was granted as the wait ran out
            self._waiters.remove(entry)
            self._wake()
            raise QueueFull(
                f"the queue is full ({self.held} of {self.capacity} sequences held); no room within {timeout:g} s"
            ) from None
        except BaseException:
            if fut.done():
                self._reserved -= n
                self._reserved_bytes -= nbytes
            else:
                self._waiters.remove(entry)
            self._wake()
            raise

    def _fits(self, n: int, nbytes: int) -> bool:
        return (
            self.held + self._reserved + n <= self.capacity
            and self.held_bytes + self._reserved_bytes + nbytes <= self.capacity_bytes
        )

    def release(self, n: int, nbytes: int = 0) -> None:
        """Give back a reservation that was not used."""
        self._reserved -= n
        self._reserved_bytes -= nbytes
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, nbytes, fut = self._waiters[0]
            if fut.done():  # cancelled waiter
                self._waiters.popleft()
                continue
            if not self._fits(n, nbytes):
                return
            self._waiters.popleft()
            self._reserved += n
            self._reserved_bytes += nbytes
            fut.set_result(None)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    # ------------------------------------------------------------------ long-polls

    async def wait_changed(self, timeout: float) -> None:
        """Return once groups entered or left the queue, a batch went back, or the environments
        changed — or after ``timeout`` s. The caller checks its own condition again."""
        if timeout <= 0:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._changed.append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            if not fut.done():
                fut.cancel()
            try:
                self._changed.remove(fut)
            except ValueError:
                pass

    def _notify(self) -> None:
        waiters, self._changed = self._changed, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _envs_changed(self) -> None:
        self.env_version += 1
        self._notify()

    def dequeued_of(self, env_id: int) -> int:
        return self.dequeued.get(env_id, 0)

    # ------------------------------------------------------------------ submission

    def submit(self, groups: Sequence[Group]) -> list[dict[str, Any]]:
        """Accept reserved, validated groups; one upstream answer per group. Raises OSError
        (nothing accepted) when the spool cannot keep them."""
        n_total = sum(g.n for g in groups)
        b_total = sum(g.nbytes for g in groups)
        for g in groups:
            g.seq, self._next_seq = self._next_seq, self._next_seq + 1
            g.qpos = -1
        if self.spool is not None:
            try:
                self.spool.write_groups(groups)
            except OSError:
                self.release(n_total, b_total)
                raise
        self._reserved -= n_total
        self._reserved_bytes -= b_total
        self.held += n_total
        self.held_bytes += b_total
        entered: list[Group] = []
        answers = [self._place(g, entered) for g in groups]
        if entered and self.spool is not None:
            self.spool.write_queued(entered)
        if entered:
            self._notify()
        return answers

    def _place(self, g: Group, entered: list[Group]) -> dict[str, Any]:
        env = self.envs[g.env_id] if g.env_id is not None and 0 <= g.env_id < len(self.envs) else None
        if env is None or g.n == env.group_size:
            self._enqueue(g, entered)
            return {"status": "received"}
        # A mixed-size group waits until buffered groups of this env add up to its group size.
        buffer = self.buffers.setdefault(env.registered_id, [])
        buffer.append(g)
        picked = find_groups_summing_to_target([b.n for b in buffer], env.group_size)
        if picked:
            chosen = set(picked)
            for i in picked:
                self._enqueue(buffer[i], entered)
            buffer[:] = [b for i, b in enumerate(buffer) if i not in chosen]
        return {"status": "buffered", "buffer_size": sum(b.n for b in buffer)}

    def _enqueue(self, g: Group, entered: list[Group]) -> None:
        g.qpos, self._next_qpos = self._next_qpos, self._next_qpos + 1
        self.queue.append(g)
        self.latest = g
        entered.append(g)

    # ------------------------------------------------------------------ batches

    def take_batch(self) -> list[Group] | None:
        """``GET /batch``: the top formed batch, forming as many as the queue allows when none
        is left (upstream: LIFO within one formation, step += batches formed)."""
        self.started_by_batch()
        if not self.formed:
            self._form_batches()
        return self.formed.pop() if self.formed else None

    def started_by_batch(self) -> None:
        if not self.started:
            self.started = True
            self._save_state()

    def _form_batches(self) -> None:
        assert self.registration is not None
        size = self.registration.batch_size
        minimums = {
            e.registered_id: e.min_batch_allocation
            for e in self.envs
            if e.connected and e.min_batch_allocation is not None
        }
        min_mode = any(e.min_batch_allocation is not None for e in self.envs)
        formed: list[list[Group]] = []
        while True:
            sizes = [g.n for g in self.queue]
            if min_mode:
                picked = grab_with_minimums(sizes, [g.env_id for g in self.queue], size, minimums)
            else:
                picked = grab_exact(sizes, size)
            if picked is None:
                break
            chosen = set(picked)
            formed.append([self.queue[i] for i in picked])
            self.queue = [g for i, g in enumerate(self.queue) if i not in chosen]
        self.step += len(formed)
        self.formed.extend(formed)
        if formed:
            for batch in formed:
                for g in batch:
                    if g.env_id is not None:
                        self.dequeued[g.env_id] = self.dequeued.get(g.env_id, 0) + 1
            self._notify()

    def delivered(self, batch: list[Group], epoch: int, batch_id: str | None = None) -> None:
        """The batch's response was fully written (or, ``batch_id``, its shared-memory segment
        acknowledged): acknowledge it and free its room."""
        if epoch != self.epoch:
            return  # taken before a reset, which already forgot it
        self.served_step += 1
        if self.spool is not None:
            self.spool.write_ack(batch, self.served_step, batch_id)
        self.held -= sum(g.n for g in batch)
        self.held_bytes -= sum(g.nbytes for g in batch)
        self._wake()

    def undeliver(self, batch: list[Group], epoch: int) -> None:
        """Writing the batch failed: it is served next."""
        if epoch == self.epoch:
            self.formed.append(batch)
            self._notify()

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        return {
            "current_step": self.step,
            "queue_size": len(self.queue),
            "queued_sequences": self.held,
            "capacity": self.capacity,
            "registered": self.registration is not None,
            "started": self.started,
            "buffered_sequences": sum(g.n for b in self.buffers.values() for g in b),
            "formed_batches": len(self.formed),
            "waiting_submissions": len(self._waiters),
            "queued_bytes": self.held_bytes,
            "capacity_bytes": self.capacity_bytes,
        }

    def status_env(self, env_id: int) -> dict[str, Any]:
        """``GET /status-env``, computed as upstream; an unknown env_id is a 404 (upstream: 500)
        and a total weight of 0 gives every connected env an equal share (upstream: 500)."""
        if not 0 <= env_id < len(self.envs):
            raise InvalidRequest(
                f"unknown env_id {env_id}: {len(self.envs)} environments registered", 404, "unknown_env"
            )
        if time.monotonic() - self._gone_checked_at >= GONE_CHECK_INTERVAL_S:
            self._disconnect_gone_envs()
        me = self.envs[env_id]
        connected = [e for e in self.envs if e.connected]
        total = sum(e.max_context_len * max(0.0, e.weight) for e in connected)
        if total > 0:
            env_weight = me.max_context_len * me.weight / total
        else:
            env_weight = 1.0 / max(1, len(connected))
        env_weight = max(MIN_ENV_WEIGHT, env_weight)
        with_min = [e for e in connected if e.min_batch_allocation is not None]
        unallocated = 1.0 - min(sum(e.min_batch_allocation or 0.0 for e in with_min), 1.0)

        max_group_size, own = 1, 0
        others: dict[int | None, int] = {}
        group_size = me.group_size
        for g in self.queue:
            n = g.n
            max_group_size = max(max_group_size, n)
            if g.env_id == env_id:
                group_size = max(group_size, n)
                own += n
            else:
                others[g.env_id] = others.get(g.env_id, 0) + n
        me.group_size = group_size
        batch_size = self.registration.batch_size if self.registration else 0
        minimum = {e.registered_id: int(batch_size * (e.min_batch_allocation or 0.0)) for e in with_min}
        available = 0
        if max_group_size > 1:
            for other, count in others.items():
                packed = -(-count // max_group_size) * max_group_size
                available += max(0, packed - (minimum.get(other, 0) if other is not None else 0))
        group_size = max(group_size, 1)
        return {
            "current_step": self.step,
            "queue_size": (own + available) // group_size,
            "unallocated_fraction": unallocated,
            "self_queue_size": own // group_size,
            "max_group_size": max_group_size,
            "env_weight": env_weight,
            "queued_sequences": self.held,
            "capacity": self.capacity,
        }

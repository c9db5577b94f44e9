"""Trainer ranks (SPEC §12.1): the strategy that lets one loop, loss and learner serve 1 and N ranks.

``OneRank`` is the in-process trainer alone. ``GroupRanks`` is one member of a torch.distributed
process group (gloo on the CPU, NCCL on GPUs): rank 0 is the in-process trainer and *drives* —
before every operation that carries collectives it tells the other ranks which one comes next
(``command``) — and ranks 1..N-1 (``atroposd trainer-rank``, :mod:`atroposd.trainer.follower`)
receive those commands and run the same code. Every collective of rank 0 is issued from its one
compute thread (:class:`ComputeThread`), in order.

What a step does with N ranks, so that it equals a step with one rank on the same batch:

* rank 0 prepares the whole batch and deals its micro-batches round-robin (``share``); every rank
  runs the same number of passes (a rank short of data runs a zero-weight pass on a copy of one);
* each pass's loss is normalised by the completion tokens of the *whole* batch and multiplied by
  N before backward: FSDP2 averages gradients over ranks (gloo has no custom divide factor), so
  the average of N sums is the one sum a single rank computes;
* the loss and statistics are summed over ranks, the gradient norm is the global one, so every
  rank takes the same decision to skip a non-finite step.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from atroposd.logs import get_logger
from atroposd.trainer.batch import MicroBatch
from atroposd.trainer.compute import ComputeThread, Fenced
from atroposd.trainer.fsdp import (
    checkpoint_activations,
    decoder_layers,
    full_tensor,
    gather_full,
    shard_model,
)
from atroposd.trainer.group import (
    COMMANDS_KEPT,
    BadCommand,
    Command,
    command_key,
    decode_command,
    encode_command,
    store_keys,
)
from atroposd.trainer.sharded_source import ShardedSource
from atroposd.trainer.share import MAX_HEADER_BYTES, Share, deal, decode_share, encode_share

# Rank strategies live here; what they use lives beside them and is importable from here too:
# ``share`` (a step's share on the wire), ``fsdp`` (sharding, gathering), ``compute`` (rank 0's
# compute thread), ``sharded_source`` (the weight sync's view of the sharded model).
__all__ = [
    "ComputeThread",
    "Fenced",
    "GroupRanks",
    "JoinTimeout",
    "OneRank",
    "Ranks",
    "ShardedSource",
    "Share",
    "checkpoint_activations",
    "deal",
    "decode_share",
    "decoder_layers",
    "encode_share",
    "full_tensor",
    "gather_full",
    "is_group_error",
    "poisons_device",
    "store_keys",
]

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store, Work

    from atroposd.trainer.group import CommandBox

log = get_logger(__name__)

# How often rank 0 looks for the other ranks' arrival while they start.
JOIN_POLL_S = 0.05
# A follower waits for the next command in waits of this length (rank 0 may wait long for data).
COMMAND_WAIT_S = 30.0
# A value at the next command's key that is not rank 0's (forged, replayed) is read again for
# this long, in case rank 0's own write replaces it; then the rank gives up (the group restarts).
BAD_COMMAND_GRACE_S = 5.0
BAD_COMMAND_POLL_S = 0.05
# The checkpoints' process group waits this long at least in one collective: writing a rank's
# shards of a large model takes longer than a training collective.
CHECKPOINT_GROUP_TIMEOUT_S = 3600.0


class JoinTimeout(RuntimeError):
    """A rank did not join the process group within ``[trainer] join_timeout``."""


class Ranks(Protocol):
    rank: int
    world: int
    checkpoint_group: Any  # the checkpoints' own process group (several ranks); None alone

    def command(self, command: Command) -> None: ...
    def broadcast(self, value: Any) -> Any: ...
    def share(self, micro: Sequence[MicroBatch], denom: int, distill_positions: int) -> Share: ...
    def sum(self, values: Sequence[float]) -> list[float]: ...
    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor: ...
    def shard(self, model: torch.nn.Module, *, mixed_precision: bool) -> None: ...
    def barrier(self) -> None: ...
    def settle(self) -> None: ...
    def close(self) -> None: ...


class OneRank:
    """The trainer alone: no collectives."""

    rank = 0
    world = 1
    checkpoint_group = None

    def command(self, command: Command) -> None:
        pass

    def broadcast(self, value: Any) -> Any:
        return value

    def share(self, micro: Sequence[MicroBatch], denom: int, distill_positions: int) -> Share:
        return Share(list(micro), len(micro), None, denom, distill_positions)

    def sum(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def shard(self, model: torch.nn.Module, *, mixed_precision: bool) -> None:
        pass

    def barrier(self) -> None:
        pass

    def settle(self) -> None:
        pass

    def close(self) -> None:
        pass


class GroupRanks:
    """One member of the trainer's process group (``rank`` of ``world``)."""

    def __init__(
        self,
        rank: int,
        world: int,
        device: torch.device,
        store: Any = None,  # a torch Store (it takes bytes values) or a CommandBox
        *,
        key: bytes = b"",
        prefix: str = "",
    ) -> None:
        self.rank = rank
        self.world = world
        self.device = device
        self.store = store  # this generation's scoped store: the command doorbell
        self._key = key  # the group's command key (from the daemon, never from the store)
        self._prefix = prefix
        self._seq = 0
        self.refused = 0  # store values at a command's key that were not rank 0's
        self.collective_timeout = 600.0
        self.checkpoint_group: ProcessGroup | None = None  # the checkpoints' process group (gloo)

    @classmethod
    def join(
        cls,
        store: Store,
        *,
        prefix: str,
        key: bytes,
        rank: int,
        world: int,
        device: torch.device,
        join_timeout: float,
        collective_timeout: float,
        cancelled: Callable[[], bool] = lambda: False,
        commands: CommandBox | None = None,
    ) -> GroupRanks:
        """Join the group through ``store`` under ``prefix``.

        Every rank marks its arrival first; rank 0 waits up to ``join_timeout`` for all of them
        (naming the missing ones), so that the process group itself is formed at once and its
        ``collective_timeout`` bounds every collective after that."""
        import torch.distributed as dist

        if dist.is_initialized():  # the previous generation's group, if its teardown did not finish
            dist.destroy_process_group()
        scoped = dist.PrefixStore(prefix, store)
        scoped.set(f"arrived/{rank}", str(time.time()))
        if rank == 0:
            deadline = time.monotonic() + join_timeout
            keys = [f"arrived/{r}" for r in range(1, world)]
            while True:
                missing = [r for r, k in zip(range(1, world), keys, strict=True) if not scoped.check([k])]
                if not missing:
                    break
                if cancelled():
                    raise Fenced("the trainer group was abandoned while it formed")
                if time.monotonic() > deadline:
                    names = ", ".join(f"trainer-{r}" for r in missing)
                    raise JoinTimeout(
                        f"trainer rank(s) {names} did not join the process group within "
                        f"trainer.join_timeout ({join_timeout:g} s); see their logs"
                    )
                time.sleep(JOIN_POLL_S)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # Until every rank has loaded its model (``settle``), a collective may wait as long as a
        # join may take: a rank still loading is not a stuck one.
        dist.init_process_group(
            backend,
            store=scoped,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=max(join_timeout, collective_timeout)),
            device_id=device if device.type == "cuda" else None,
        )
        # The checkpoints' own group (gloo, every rank): a checkpoint written in the background
        # meets the other ranks there, never among the training's collectives.
        checkpoint_group = dist.new_group(
            backend="gloo",
            timeout=datetime.timedelta(seconds=max(join_timeout, collective_timeout, CHECKPOINT_GROUP_TIMEOUT_S)),
        )
        scoped.set(f"joined/{rank}", "1")
        log.info("joined the trainer group", rank=rank, world=world, backend=backend)
        # rank 0's commands: the store under the prefix, or (one machine) their own files (CommandBox)
        ranks = cls(rank, world, device, scoped if commands is None else commands, key=key, prefix=prefix)
        ranks.collective_timeout = collective_timeout
        ranks.checkpoint_group = checkpoint_group
        return ranks

    # ---------------------------------------------------------------- commands (rank 0 → the others)
    # Through the store, not a collective: a follower may wait for the next command as long as
    # rank 0 waits for data (longer than collective_timeout); the collectives that follow a
    # command start together.

    def command(self, command: Command) -> None:
        assert self.rank == 0, "only rank 0 drives the group"
        self._seq += 1
        self.store.set(
            command_key(self._seq), encode_command(command, key=self._key, prefix=self._prefix, seq=self._seq)
        )
        if self._seq > COMMANDS_KEPT:
            self.store.delete_key(command_key(self._seq - COMMANDS_KEPT))

    def receive(self) -> Command:
        """A follower: the next command of rank 0 (waits for it; raises when the store is gone).

        The value is checked (:func:`~atroposd.trainer.group.decode_command`): one that is not
        rank 0's is counted and read again for ``BAD_COMMAND_GRACE_S`` (rank 0's own write
        replaces it), then :class:`BadCommand` ends this rank — never is it run."""
        store = self.store
        if store is None:
            raise RuntimeError("this trainer rank has no store to receive rank 0's commands from")
        self._seq += 1
        key = command_key(self._seq)
        while True:
            try:
                store.wait([key], datetime.timedelta(seconds=COMMAND_WAIT_S))
                break
            except Exception as exc:  # the store says "timeout" for a wait that ran out
                if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                    raise
        deadline = time.monotonic() + BAD_COMMAND_GRACE_S
        last = None
        while True:
            value = store.get(key)
            try:
                return decode_command(value, key=self._key, prefix=self._prefix, seq=self._seq)
            except BadCommand as exc:
                if value != last:  # each value once
                    self.refused += 1
                    log.warning(
                        "refused a store value at a command key",
                        rank=self.rank,
                        seq=self._seq,
                        error=str(exc),
                        refused=self.refused,
                    )
                last = value
                if time.monotonic() > deadline:
                    raise
                time.sleep(BAD_COMMAND_POLL_S)

    # ---------------------------------------------------------------- a step's collectives

    def _wire_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def share(self, micro: Sequence[MicroBatch], denom: int, distill_positions: int) -> Share:
        """Rank 0: deal the batch and send every rank its share as tensors (a JSON header of
        dtypes and shapes, then the bytes); returns rank 0's own."""
        import torch.distributed as dist

        shares = deal(micro, self.world, denom, distill_positions)
        dev = self._wire_device()
        for r in range(1, self.world):
            header, data = encode_share(shares[r])
            sizes = torch.tensor([len(header), data.numel()], dtype=torch.int64, device=dev)
            self._point(dist.isend(sizes, dst=r))
            self._point(dist.isend(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(dev), dst=r))
            if data.numel():
                self._point(dist.isend(data.to(dev), dst=r))
        return shares[0]

    def _point(self, work: Work | None) -> None:
        """Wait for one send or receive within ``collective_timeout``. A plain ``dist.send`` to a
        rank that does not receive (stopped, hung) waits for the group's join-time timeout
        instead: gloo bounds a point-to-point wait by the timeout its connections were made
        with, not by the one :meth:`settle` sets."""
        if work is None:
            raise RuntimeError("a send or receive of a rank outside the trainer group")
        work.wait(timeout=datetime.timedelta(seconds=self.collective_timeout))

    def receive_share(self) -> Share:
        """A follower: its share from rank 0, checked (:func:`decode_share`); nothing unpickled."""
        import torch.distributed as dist

        dev = self._wire_device()
        sizes = torch.zeros(2, dtype=torch.int64, device=dev)
        self._point(dist.irecv(sizes, src=0))
        n_header, n_data = (int(v) for v in sizes.cpu().tolist())
        if not 0 < n_header <= MAX_HEADER_BYTES or n_data < 0:
            raise BadCommand(f"a share's sizes out of range ({n_header}, {n_data})")
        header = torch.empty(n_header, dtype=torch.uint8, device=dev)
        self._point(dist.irecv(header, src=0))
        data = torch.empty(n_data, dtype=torch.uint8, device=dev)
        if n_data:
            self._point(dist.irecv(data, src=0))
        return decode_share(bytes(header.cpu().numpy().tobytes()), data.cpu())

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` (JSON data: None, numbers, strings, lists, objects) on every rank
        (every rank calls it at the same point); sent as the JSON's bytes, never pickled."""
        import torch.distributed as dist

        dev = self._wire_device()
        body = json.dumps(value).encode() if self.rank == 0 else b""
        size = torch.tensor([len(body)], dtype=torch.int64, device=dev)
        dist.broadcast(size, src=0)
        n = int(size.item())
        if not 0 < n <= MAX_HEADER_BYTES:
            raise BadCommand(f"a broadcast value's size out of range ({n})")
        buf = (
            torch.frombuffer(bytearray(body), dtype=torch.uint8).to(dev)
            if self.rank == 0
            else torch.empty(n, dtype=torch.uint8, device=dev)
        )
        dist.broadcast(buf, src=0)
        if self.rank == 0:
            return value
        try:
            return json.loads(buf.cpu().numpy().tobytes())
        except ValueError as exc:
            raise BadCommand("a broadcast value is not JSON") from exc

    def sum(self, values: Sequence[float]) -> list[float]:
        import torch.distributed as dist

        t = torch.tensor(
            [float(v) for v in values], dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu"
        )
        dist.all_reduce(t)
        return [float(v) for v in t.cpu().tolist()]

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (on the CPU) summed over the ranks, on the CPU (every rank calls it)."""
        import torch.distributed as dist

        out = t.to(self._wire_device())
        dist.all_reduce(out)
        return out.cpu()

    def shard(self, model: torch.nn.Module, *, mixed_precision: bool) -> None:
        """FSDP2 (:func:`~atroposd.trainer.fsdp.shard_model`)."""
        shard_model(model, mixed_precision=mixed_precision)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def settle(self) -> None:
        """Every rank has its model and optimizer: from now on a collective that runs longer than
        ``collective_timeout`` fails (SPEC §12.1)."""
        from torch.distributed.distributed_c10d import _set_pg_timeout

        self.barrier()
        _set_pg_timeout(datetime.timedelta(seconds=self.collective_timeout))

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a group whose peer died: nothing more to release here
                log.warning("the trainer group did not close cleanly", error=f"{type(exc).__name__}: {exc}")


def is_group_error(exc: BaseException) -> bool:
    """A failure of the process group itself (a peer gone, a collective timed out or failed), as
    torch.distributed reports it — not a failure of the trainer's own code."""
    import torch.distributed as dist

    if poisons_device(exc):
        return False  # the daemon's CUDA context is unusable: the job ends, systemd restarts it
    if isinstance(exc, (dist.DistError, JoinTimeout, Fenced)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        marker in text
        for marker in (
            "gloo",
            "nccl",
            "connection reset",
            "connection closed",
            "broken pipe",
            "timed out",
            "timeout",
            "pair closure",
            "process group",
        )
    )


def poisons_device(exc: BaseException) -> bool:
    """A CUDA error that leaves this process's context unusable (SPEC §12.1: the daemon then
    exits 1 after its children stop, and the next start resumes)."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return "CUDA error" in text or "cudaError" in text or "CUBLAS_STATUS" in text

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

import asyncio
import concurrent.futures
import dataclasses
import datetime
import functools
import itertools
import json
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from atroposd.logs import get_logger
from atroposd.trainer.batch import MicroBatch
from atroposd.trainer.group import (
    COMMANDS_KEPT,
    BadCommand,
    Command,
    Gather,
    Push,
    Reload,
    command_key,
    decode_command,
    encode_command,
    store_keys,
)

__all__ = [
    "ComputeThread",
    "Fenced",
    "GroupRanks",
    "JoinTimeout",
    "OneRank",
    "Ranks",
    "ShardedSource",
    "Share",
    "decode_share",
    "decoder_layers",
    "encode_share",
    "full_tensor",
    "gather_full",
    "is_group_error",
    "poisons_device",
    "store_keys",
]

log = get_logger(__name__)
_T = TypeVar("_T")

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


class Fenced(RuntimeError):
    """Work of an earlier trainer group generation: its result is discarded."""


@dataclass
class Share:
    """One rank's part of a step: its micro-batches and what the whole batch is normalised by."""

    micro: list[MicroBatch]
    passes: int  # every rank runs this many; passes past len(micro) run on ``pad`` with weight 0
    pad: MicroBatch | None
    denom: int  # completion tokens of the whole batch
    distill_positions: int  # distillation positions of the whole batch

    def passes_with_weight(self) -> list[tuple[MicroBatch, float]]:
        out = [(mb, 1.0) for mb in self.micro]
        if len(out) < self.passes:
            assert self.pad is not None, "a zero-weight pass needs a micro-batch to run on"
            out += [(self.pad, 0.0)] * (self.passes - len(out))
        return out


def deal(micro: Sequence[MicroBatch], world: int, denom: int, distill_positions: int) -> list[Share]:
    """Round-robin micro-batches over ``world`` ranks; every rank gets the same number of passes."""
    parts = [list(micro[r::world]) for r in range(world)]
    passes = max((len(p) for p in parts), default=0)
    pad = micro[0] if micro else None
    return [Share(p, passes, pad if len(p) < passes else None, denom, distill_positions) for p in parts]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter; a collective for a DTensor."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def gather_full(model: torch.nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The full tensors ``names`` of a sharded model, on every rank (collectives, in the same
    order on every rank). Each FSDP2 unit that holds one of them is unsharded once — one
    all-gather for the whole unit, not one per tensor — its tensors copied out, then resharded."""
    from torch.distributed.fsdp import FSDPModule

    from atroposd.trainer.model import ROOT_ATTR

    units = sorted(
        ((prefix + ".", m) for prefix, m in model.named_modules() if prefix and isinstance(m, FSDPModule)),
        key=lambda u: -len(u[0]),
    )
    root = model.__dict__.get(ROOT_ATTR)
    by_unit: dict[int, tuple[Any, list[str]]] = {}
    order: list[int] = []
    for name in names:
        unit = next((m for prefix, m in units if name.startswith(prefix)), root)
        key = id(unit)
        if key not in by_unit:
            by_unit[key] = (unit, [])
            order.append(key)
        by_unit[key][1].append(name)
    out: dict[str, torch.Tensor] = {}
    for key in order:
        unit, members = by_unit[key]
        if isinstance(unit, FSDPModule):
            unit.unshard()
        try:
            for name in members:
                out[name] = full_tensor(_named_tensor(model, name).detach()).clone()
        finally:
            if isinstance(unit, FSDPModule):
                unit.reshard()
    return out


def _named_tensor(model: torch.nn.Module, name: str) -> torch.Tensor:
    try:
        return model.get_parameter(name)
    except AttributeError:
        return model.get_buffer(name)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM (``model.model.layers`` and the like)."""
    base: Any = model
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        base = get_decoder() or model
    layers = getattr(base, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers):
        return list(layers)
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    return list(lists[0]) if lists else []


def checkpoint_activations(layers: Sequence[torch.nn.Module]) -> None:
    """Recompute each layer's activations in the backward pass (the layer's names unchanged)."""
    from torch.utils.checkpoint import checkpoint

    for layer in layers:
        forward = layer.forward

        def wrapped(*args: Any, _forward: Callable[..., Any] = forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = wrapped


class Ranks(Protocol):
    rank: int
    world: int

    def command(self, command: Command) -> None: ...
    def broadcast(self, value: Any) -> Any: ...
    def share(self, micro: Sequence[MicroBatch], denom: int, distill_positions: int) -> Share: ...
    def sum(self, values: Sequence[float]) -> list[float]: ...
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
        self, rank: int, world: int, device: torch.device, store: Any = None, *, key: bytes = b"", prefix: str = ""
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
        self.checkpoint_group: Any = None  # the checkpoints' process group (gloo)

    @classmethod
    def join(
        cls,
        store: Any,
        *,
        prefix: str,
        key: bytes,
        rank: int,
        world: int,
        device: torch.device,
        join_timeout: float,
        collective_timeout: float,
        cancelled: Callable[[], bool] = lambda: False,
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
        ranks = cls(rank, world, device, scoped, key=key, prefix=prefix)
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
        self._seq += 1
        key = command_key(self._seq)
        while True:
            try:
                self.store.wait([key], datetime.timedelta(seconds=COMMAND_WAIT_S))
                break
            except Exception as exc:  # the store says "timeout" for a wait that ran out
                if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                    raise
        deadline = time.monotonic() + BAD_COMMAND_GRACE_S
        last = None
        while True:
            value = self.store.get(key)
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

    def _point(self, work: Any) -> None:
        """Wait for one send or receive within ``collective_timeout``. A plain ``dist.send`` to a
        rank that does not receive (stopped, hung) waits for the group's join-time timeout
        instead: gloo bounds a point-to-point wait by the timeout its connections were made
        with, not by the one :meth:`settle` sets."""
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

    def shard(self, model: torch.nn.Module, *, mixed_precision: bool) -> None:
        """FSDP2: ``fully_shard`` per decoder layer, then the root (mixed precision on a GPU).

        The root unit is the model's :class:`~atroposd.trainer.model.LogprobModule`: the trainer
        calls the decoder and the head itself (never the full logits), so the hooks that gather
        the embedding, norm and head must surround that whole call."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from atroposd.trainer.model import LogprobModule

        kw: dict[str, Any] = {}
        if mixed_precision:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in decoder_layers(model):
            fully_shard(layer, **kw)
        root = LogprobModule(model)
        fully_shard(root, **kw)
        root.install()

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


# The largest JSON header (a share's, a broadcast value) a rank accepts.
MAX_HEADER_BYTES = 1 << 24
# The dtypes a share's tensors may have.
_SHARE_DTYPES = {
    str(d): d
    for d in (
        torch.int64,
        torch.int32,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.bool,
        torch.uint8,
    )
}


def _micro_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(MicroBatch)]


def encode_share(share: Share) -> tuple[bytes, torch.Tensor]:
    """A share as a JSON header (its numbers; each micro-batch's tensors as dtype and shape, in
    field order) and one flat uint8 tensor of the tensors' bytes (on the CPU)."""
    parts: list[torch.Tensor] = []

    def micro(mb: MicroBatch) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in _micro_fields():
            t = getattr(mb, name)
            if t is None:
                out[name] = None
                continue
            t = t.detach().cpu().contiguous()
            out[name] = [str(t.dtype), list(t.shape)]
            parts.append(t.reshape(-1).view(torch.uint8))
        return out

    header = {
        "passes": share.passes,
        "denom": share.denom,
        "distill_positions": share.distill_positions,
        "micro": [micro(mb) for mb in share.micro],
        "pad": None if share.pad is None else micro(share.pad),
    }
    data = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return json.dumps(header, separators=(",", ":")).encode(), data


def _count(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise BadCommand(f"a share's {what} must be a count")
    return v


def decode_share(header: bytes, data: torch.Tensor) -> Share:
    """The share in a header and its bytes, checked: the fields a micro-batch has, known dtypes,
    shapes of counts, and exactly as many bytes as they take. :class:`BadCommand` otherwise."""
    try:
        h = json.loads(header)
    except ValueError as exc:
        raise BadCommand("a share's header is not JSON") from exc
    if not isinstance(h, dict) or set(h) != {"passes", "denom", "distill_positions", "micro", "pad"}:
        raise BadCommand("a share's header is malformed")
    if not isinstance(h["micro"], list):
        raise BadCommand("a share's micro-batches must be a list")
    names = _micro_fields()
    offset = 0
    flat = data.reshape(-1)

    def micro(spec: Any) -> MicroBatch:
        nonlocal offset
        if not isinstance(spec, dict) or set(spec) != set(names):
            raise BadCommand("a share's micro-batch has other fields than a micro-batch")
        values: dict[str, torch.Tensor | None] = {}
        for name in names:
            item = spec[name]
            if item is None:
                values[name] = None
                continue
            if not (
                isinstance(item, list) and len(item) == 2 and item[0] in _SHARE_DTYPES and isinstance(item[1], list)
            ):
                raise BadCommand(f"a share's tensor {name}: bad dtype or shape")
            dtype, shape = _SHARE_DTYPES[item[0]], [_count(d, "shape") for d in item[1]]
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if offset + n > flat.numel():
                raise BadCommand("a share has fewer bytes than its tensors take")
            values[name] = flat[offset : offset + n].clone().view(dtype).reshape(shape)
            offset += n
        if any(values[n] is None for n in names[:6]):
            raise BadCommand("a share's micro-batch lacks a required tensor")
        return MicroBatch(**values)  # type: ignore[arg-type]

    micros = [micro(m) for m in h["micro"]]
    pad = None if h["pad"] is None else micro(h["pad"])
    if offset != flat.numel():
        raise BadCommand("a share has more bytes than its tensors take")
    passes = _count(h["passes"], "passes")
    if passes < len(micros) or (passes > len(micros) and pad is None):
        raise BadCommand("a share's passes do not match its micro-batches")
    return Share(micros, passes, pad, _count(h["denom"], "denom"), _count(h["distill_positions"], "distill_positions"))


class ComputeThread:
    """Rank 0's one compute thread (SPEC §12.1): every step's work runs here, in order, with the
    device set on it. A group restart ``fence``s it: a thread stuck in a collective is left
    behind (its late result is discarded, :class:`Fenced`) and a new one serves the next group.
    A daemon thread: one that never returns must not hold up the process's exit."""

    _ids = itertools.count(1)

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.generation = 0
        self._queue = self._start()

    def _start(self) -> queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None]:
        q: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None] = queue.SimpleQueue()
        threading.Thread(target=self._serve, args=(q,), name=f"atroposd-compute-{next(self._ids)}", daemon=True).start()
        return q

    def _serve(self, q: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None]) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            item = q.get()
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the awaiting task
                future.set_exception(exc)

    async def run(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """``fn(*args)`` on the compute thread; its result, unless the thread was fenced meanwhile."""
        generation = self.generation
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        self._queue.put((functools.partial(fn, *args, **kwargs), future))
        result = await asyncio.wrap_future(future)
        if generation != self.generation:
            raise Fenced("the trainer group was restarted while this work ran")
        return result

    def fence(self) -> None:
        """Abandon the current thread (it may be stuck): later work goes to a fresh one."""
        self.generation += 1
        old, self._queue = self._queue, self._start()
        _drain(old)

    def close(self) -> None:
        _drain(self._queue)


def _drain(q: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None]) -> None:
    """Cancel the work still queued and tell the thread to end once its current work returns."""
    while True:
        try:
            item = q.get_nowait()
        except queue.Empty:
            break
        if item is not None:
            item[1].cancel()
    q.put(None)


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


class ShardedSource:
    """The weight sync's view of a sharded model (SPEC §12.1; a ``weights.source.TensorSource``):
    full tensors gathered on rank 0's compute thread, every rank taking part (``gather``
    command), one bucket at a time. ``specs`` and ``tied`` were taken before sharding."""

    def __init__(
        self, model: torch.nn.Module, ranks: Ranks, compute: ComputeThread, specs: dict[str, Any], tied: dict[str, str]
    ) -> None:
        self.model = model
        self.ranks = ranks
        self.compute = compute
        self._specs = specs
        self._tied = tied
        self._next: dict[str, int] | None = None

    def specs(self) -> dict[str, Any]:
        return dict(self._specs)

    def announce(self, index: int, count: int, version: int) -> None:
        """The next gather is bucket ``index`` of ``count`` of a push of ``version``: the other
        nodes' first ranks feed their own replicas from it (SPEC §12.3, Weights)."""
        self._next = {"index": index, "count": count, "version": version}

    def tied(self) -> dict[str, str]:
        return dict(self._tied)

    def lora(self) -> dict[str, Any] | None:
        return None  # LoRA is refused with several ranks (config check)

    async def announce_reload(self, path: Any, version: int) -> None:
        """A ``reload`` wrote ``version`` at ``path`` (on the shared file system): the other nodes'
        first ranks have their own replicas load it."""
        await self.compute.run(self.ranks.command, Reload(str(path), version))

    def _gather(self, names: Sequence[str], push: dict[str, int] | None) -> dict[str, torch.Tensor]:
        self.ranks.command(Gather(tuple(names), None if push is None else Push(**push)))
        return gather_full(self.model, names)

    async def gather(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        push, self._next = self._next, None
        return await self.compute.run(self._gather, list(names), push)

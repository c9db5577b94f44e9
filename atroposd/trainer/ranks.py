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
import datetime
import functools
import itertools
import pickle
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from atroposd.logs import get_logger
from atroposd.trainer.batch import MicroBatch

__all__ = [
    "ComputeThread",
    "Fenced",
    "GroupRanks",
    "JoinTimeout",
    "OneRank",
    "Ranks",
    "ShardedSource",
    "Share",
    "decoder_layers",
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
# Command keys left in the store (older ones are deleted: a long run does not fill it).
COMMANDS_KEPT = 8


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

    units = sorted(((prefix + ".", m) for prefix, m in model.named_modules() if prefix and isinstance(m, FSDPModule)),
                   key=lambda u: -len(u[0]))
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

    def command(self, op: str, arg: Any = None) -> None: ...
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

    def command(self, op: str, arg: Any = None) -> None:
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


def store_keys(secret: str, generation: int) -> str:
    """The store prefix of one group generation (every (re)formed group has a fresh one)."""
    return f"{secret}/g{generation}/"


class GroupRanks:
    """One member of the trainer's process group (``rank`` of ``world``)."""

    def __init__(self, rank: int, world: int, device: torch.device, store: Any = None) -> None:
        self.rank = rank
        self.world = world
        self.device = device
        self.store = store  # this generation's scoped store: the command doorbell
        self._seq = 0
        self.collective_timeout = 600.0

    @classmethod
    def join(cls, store: Any, *, prefix: str, rank: int, world: int, device: torch.device,
             join_timeout: float, collective_timeout: float,
             cancelled: Callable[[], bool] = lambda: False) -> GroupRanks:
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
                    raise JoinTimeout(f"trainer rank(s) {names} did not join the process group within "
                                      f"trainer.join_timeout ({join_timeout:g} s); see their logs")
                time.sleep(JOIN_POLL_S)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # Until every rank has loaded its model (``settle``), a collective may wait as long as a
        # join may take: a rank still loading is not a stuck one.
        dist.init_process_group(backend, store=scoped, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=max(join_timeout, collective_timeout)),
                                device_id=device if device.type == "cuda" else None)
        scoped.set(f"joined/{rank}", "1")
        log.info("joined the trainer group", rank=rank, world=world, backend=backend)
        ranks = cls(rank, world, device, scoped)
        ranks.collective_timeout = collective_timeout
        return ranks

    # ---------------------------------------------------------------- commands (rank 0 → the others)
    # Through the store, not a collective: a follower may wait for the next command as long as
    # rank 0 waits for data (longer than collective_timeout); the collectives that follow a
    # command start together.

    def command(self, op: str, arg: Any = None) -> None:
        assert self.rank == 0, "only rank 0 drives the group"
        self._seq += 1
        self.store.set(f"cmd/{self._seq}", pickle.dumps((op, arg)))
        if self._seq > COMMANDS_KEPT:
            self.store.delete_key(f"cmd/{self._seq - COMMANDS_KEPT}")

    def receive(self) -> tuple[str, Any]:
        """A follower: the next command of rank 0 (waits for it; raises when the store is gone)."""
        self._seq += 1
        key = f"cmd/{self._seq}"
        while True:
            try:
                self.store.wait([key], datetime.timedelta(seconds=COMMAND_WAIT_S))
                break
            except Exception as exc:  # the store says "timeout" for a wait that ran out
                if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                    raise
        op, arg = pickle.loads(self.store.get(key))
        return str(op), arg

    # ---------------------------------------------------------------- a step's collectives

    def share(self, micro: Sequence[MicroBatch], denom: int, distill_positions: int) -> Share:
        """Rank 0: deal the batch and send every rank its share; returns rank 0's own."""
        import torch.distributed as dist

        shares = deal(micro, self.world, denom, distill_positions)
        out: list[Any] = [None]
        dist.scatter_object_list(out, shares, src=0)
        share: Share = out[0]
        return share

    def receive_share(self) -> Share:
        import torch.distributed as dist

        out: list[Any] = [None]
        dist.scatter_object_list(out, None, src=0)
        share: Share = out[0]
        return share

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (every rank calls it at the same point)."""
        import torch.distributed as dist

        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def sum(self, values: Sequence[float]) -> list[float]:
        import torch.distributed as dist

        t = torch.tensor([float(v) for v in values], dtype=torch.float64,
                         device=self.device if self.device.type == "cuda" else "cpu")
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
        threading.Thread(target=self._serve, args=(q,), name=f"atroposd-compute-{next(self._ids)}",
                         daemon=True).start()
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
        marker in text for marker in ("gloo", "nccl", "connection reset", "connection closed", "broken pipe",
                                      "timed out", "timeout", "pair closure", "process group"))


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

    def __init__(self, model: torch.nn.Module, ranks: Ranks, compute: ComputeThread, specs: dict[str, Any],
                 tied: dict[str, str]) -> None:
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
        await self.compute.run(self.ranks.command, "reload", {"path": str(path), "version": version})

    def _gather(self, names: Sequence[str], push: dict[str, int] | None) -> dict[str, torch.Tensor]:
        self.ranks.command("gather", {"names": list(names), "push": push})
        return gather_full(self.model, names)

    async def gather(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        push, self._next = self._next, None
        return await self.compute.run(self._gather, list(names), push)

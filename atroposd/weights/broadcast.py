"""Weights by broadcast (SPEC §7, ``weight_sync = "broadcast"``): the process groups and the
bucket stream, both sides.

The trainer's sending rank (rank 0, in the daemon) forms one torch.distributed process group
with each inference replica's engine workers — gloo on the CPU, NCCL on GPUs — and streams the
weights through it, bucket by bucket. A group is never the trainer group and never a default
group: each is a backend object of its own (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` built on
a store), so it lives beside the trainer's FSDP group and is dropped on its own.

Rendezvous (:class:`BroadcastHub`, trainer side): a c10d FileStore in a private directory
(mode 0700, made for it; the file 0600), like the trainer group's one-machine store — no TCP port
is listened on for it, so only this user (and root) reaches it; its path goes to each replica
over the replica's weight-control socket, and a replica joins only through a store file of this
user in a directory of this user's that no one else may enter (:meth:`JoinRequest.parse`). Each
formation uses a fresh store prefix ``{secret}/bcast/r{replica}/f{n}/`` (the secret is the launch
nonce): a worker of an abandoned formation can never answer for a new one. The replica's side
writes its worker count (``world``) and one ``arrived/{rank}`` key per worker; the hub waits for
them up to the formation deadline (naming what is missing, the list cut), and only then builds
its end of the group, so a peer that never joins costs the deadline and nothing else. Store
values are plain strings: nothing received is unpickled (SPEC §12.1).

What travels (``POST /broadcast`` on the weight-control socket, JSON validated field by field;
the tensors go through the group as raw bytes)::

    {"op": "join", "store": "/run/.../atroposd-bcast-store-XXXX/store", "prefix": "...", "backend": "gloo",
     "deadline_s": 30.0, "timeout_s": 150.0}
        → the replica joins (ranks 1..W of W + 1) and answers {"formation", "world"}
    {"op": "receive", "formation": "...", "weight_version": 17,
     "buckets": [[[name, dtype, [shape...]], ...], ...], "digest": false}
        → the whole plan is checked against the model (every tensor once, same dtype and shape)
          before any byte moves; the replica then receives in the background and answers at once
    {"op": "finish", "formation": "...", "weight_version": 17}
        → waits for the last bucket; {"weight_version", "buckets", "bytes", "seconds",
          "digests"?}; the model holds the new weights (resume makes them served)
    {"op": "leave"}  → drop the group

A bucket is the tensors of one ``plan_buckets`` entry, packed in order into one flat byte buffer
(each tensor 64-byte aligned, as in a staging buffer): one broadcast per bucket and group. The
receiver copies each tensor out of its own buffer (one, sized for the largest bucket, reused).
From its first bucket to its last the model holds a mix of versions (``ReceiverState.buckets``):
the server refuses to resume until a complete set arrived.
"""

from __future__ import annotations

import datetime
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, overload

import torch

from atroposd.logs import get_logger
from atroposd.weights.manifest import (
    ALIGNMENT,
    ALLOWED_DTYPES,
    ManifestError,
    TensorSpec,
    itemsize,
    match_tensors,
)
from atroposd.weights.protocol import WeightUpdateError
from atroposd.weights.tensors import tensor_digest

if TYPE_CHECKING:
    import asyncio

    import torch.distributed as dist

    from atroposd.weights.receiver import ReceiverState

__all__ = [
    "BACKENDS",
    "BroadcastFormTimeout",
    "BroadcastGroup",
    "BroadcastHub",
    "BroadcastReceiver",
    "Layout",
    "layout",
    "pack",
    "tensor_digest",
]

log = get_logger(__name__)

BACKENDS = ("gloo", "nccl")
# How often the hub looks for the replica's workers while a group forms.
FORM_POLL_S = 0.02
STORE_TIMEOUT_S = 600.0
MAX_TENSORS = 1 << 20
STORE_DIR_PREFIX = "atroposd-bcast-store-"  # the hub's private directory
MISSING_NAMED = 8  # worker ranks named in a formation's error; the rest counted


class BroadcastFormTimeout(RuntimeError):
    """A broadcast group did not form within its deadline."""


def _aligned(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class Slot:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """One bucket as it lies in the flat buffer."""

    slots: tuple[Slot, ...]
    size: int


def layout(bucket: Sequence[tuple[str, TensorSpec]]) -> Layout:
    """Offsets of a bucket's tensors in its flat buffer, in order, each 64-byte aligned."""
    slots: list[Slot] = []
    offset = 0
    for name, spec in bucket:
        n = itemsize(spec.dtype) * _numel(spec.shape)
        slots.append(Slot(name, spec.dtype, tuple(spec.shape), offset, n))
        offset += _aligned(n)
    return Layout(tuple(slots), offset)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def pack(lay: Layout, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket's tensors copied into one flat uint8 buffer (``out`` when it is large enough)."""
    device = next(iter(tensors.values())).device
    if out is None or out.numel() < lay.size or out.device != device:
        out = torch.empty(lay.size, dtype=torch.uint8, device=device)
    with torch.no_grad():
        for s in lay.slots:
            t = tensors[s.name].detach().contiguous()
            out[s.offset : s.offset + s.nbytes].copy_(t.reshape(-1).view(torch.uint8))
    return out


# ---------------------------------------------------------------------------- process groups


class _Backend(Protocol):
    """What a formed group's backend object (``ProcessGroupGloo``, ``ProcessGroupNCCL``) is used
    for here; torch's stubs leave ``broadcast`` off their ``Backend`` class."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


class BroadcastGroup:
    """One formed group: rank ``rank`` of ``world``; rank 0 (the trainer) sends."""

    def __init__(
        self, pg: _Backend, *, rank: int, world: int, backend: str, device: torch.device, formation: str
    ) -> None:
        self.pg: _Backend | None = pg  # None once closed
        self.rank = rank
        self.world = world
        self.backend = backend
        self.device = device
        self.formation = formation
        self.closed = False

    @classmethod
    def build(
        cls,
        store: dist.Store,
        *,
        rank: int,
        world: int,
        backend: str,
        device: torch.device,
        timeout_s: float,
        formation: str,
    ) -> BroadcastGroup:
        """The backend object itself (never the default group). gloo is pinned to loopback: the
        store is a file, every member is on this machine."""
        import torch.distributed as dist

        if backend == "gloo":
            opts = getattr(dist.ProcessGroupGloo, "_Options")()  # noqa: B009 - untyped in torch's stubs
            opts._timeout = _timeout(timeout_s)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            pg = cast("_Backend", dist.ProcessGroupGloo(store, rank, world, opts))
        elif backend == "nccl":  # pragma: no cover - needs GPUs (NCCL refuses two ranks on one GPU)
            torch.cuda.set_device(device)
            nopts = dist.ProcessGroupNCCL.Options()
            nopts._timeout = _timeout(timeout_s)
            pg = cast("_Backend", dist.ProcessGroupNCCL(store, rank, world, nopts))
        else:
            raise ValueError(f"unknown broadcast backend {backend!r} (one of {', '.join(BACKENDS)})")
        return cls(pg, rank=rank, world=world, backend=backend, device=device, formation=formation)

    def broadcast(self, buf: torch.Tensor) -> None:
        """Rank 0 sends ``buf``; every other rank receives into it (blocking, bounded by the
        group's timeout)."""
        import torch.distributed as dist

        pg = self.pg
        if self.closed or pg is None:
            raise RuntimeError(f"broadcast group {self.formation} is closed")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        pg.broadcast([buf], opts).wait()
        if self.backend == "nccl":  # pragma: no cover - needs GPUs
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Drop the group: its connections close, so a peer blocked in it fails at once."""
        if self.closed:
            return
        self.closed = True
        pg, self.pg = self.pg, None
        for method in ("abort", "shutdown"):
            fn = getattr(pg, method, None)
            if fn is None:
                continue
            try:
                fn()
                break
            except Exception:  # the next way of closing it is tried
                continue
        del pg


class BroadcastHub:
    """The trainer's side: the store the groups meet through, and each formation.

    The store is a FileStore in a private directory made under ``directory`` (the system's
    temporary directory by default); it goes when the hub closes."""

    def __init__(
        self,
        *,
        secret: str,
        backend: str = "gloo",
        device: torch.device | None = None,
        directory: str | os.PathLike[str] | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown broadcast backend {backend!r} (one of {', '.join(BACKENDS)})")
        self.secret = secret
        self.backend = backend
        self.device = device if device is not None else torch.device("cpu")
        self.directory = directory
        self.path: str | None = None  # the store's file, once made
        self.formations = 0
        self._store: dist.FileStore | None = None
        self._private_dir: str | None = None
        self._lock = threading.Lock()

    def store(self) -> dist.FileStore:
        """The FileStore (a file of mode 0600 in a directory of mode 0700 made for it)."""
        with self._lock:
            if self._store is None:
                import torch.distributed as dist

                if self.directory is not None:  # the daemon's own directory: a killed daemon's store goes now
                    for stale in Path(self.directory).glob(STORE_DIR_PREFIX + "*"):
                        shutil.rmtree(stale, ignore_errors=True)
                private = tempfile.mkdtemp(prefix=STORE_DIR_PREFIX, dir=self.directory)  # 0700
                try:
                    path = os.path.join(private, "store")
                    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # ours, before torch opens it
                    store = dist.FileStore(path, -1)
                    store.set_timeout(_timeout(STORE_TIMEOUT_S))
                except BaseException:
                    shutil.rmtree(private, ignore_errors=True)
                    raise
                self._store, self.path, self._private_dir = store, path, private
            return self._store

    @property
    def address(self) -> str:
        """Where a replica finds the store: its file's path."""
        if self.path is None:
            raise RuntimeError("the broadcast store is not made yet (store())")
        return self.path

    def size(self) -> int:
        """Bytes the store's file holds (0 before it is made)."""
        try:
            return os.stat(self.path).st_size if self.path is not None else 0
        except OSError:
            return 0

    def next_prefix(self, replica: int) -> str:
        """A fresh store prefix for one formation of ``replica``'s group."""
        self.formations += 1
        return f"{self.secret}/bcast/r{replica}/f{self.formations}/"

    def join_request(self, prefix: str, *, deadline_s: float, timeout_s: float) -> dict[str, Any]:
        self.store()
        return {
            "op": "join",
            "store": self.address,
            "prefix": prefix,
            "backend": self.backend,
            "deadline_s": float(deadline_s),
            "timeout_s": float(timeout_s),
        }

    def form(
        self, prefix: str, *, deadline_s: float, timeout_s: float, cancelled: Callable[[], bool] = lambda: False
    ) -> BroadcastGroup:
        """Rank 0 of the formation under ``prefix`` (blocking): wait up to ``deadline_s`` for the
        replica's workers, then build the group (its ops bounded by ``timeout_s``)."""
        import torch.distributed as dist

        scoped = dist.PrefixStore(prefix, self.store())
        deadline = time.monotonic() + deadline_s
        world = 0
        missing: list[int] = []
        while True:
            if not world and scoped.check(["world"]):
                world = _store_int(scoped.get("world"), "world", 2, 1 << 16)
            if world and scoped.check([f"arrived/{r}" for r in range(1, world)]):  # one look at them all
                break
            if cancelled():
                raise BroadcastFormTimeout("the broadcast group was abandoned while it formed")
            if time.monotonic() > deadline:
                missing = [r for r in range(1, world) if not scoped.check([f"arrived/{r}"])]
                named = ", ".join(map(str, missing[:MISSING_NAMED]))
                more = f" and {len(missing) - MISSING_NAMED} more" if len(missing) > MISSING_NAMED else ""
                what = (
                    "the replica never joined"
                    if not world
                    else f"worker rank(s) {named}{more} of {world - 1} never arrived"
                )
                raise BroadcastFormTimeout(f"the broadcast group did not form within {deadline_s:g} s: {what}")
            time.sleep(FORM_POLL_S)
        group = BroadcastGroup.build(
            scoped,
            rank=0,
            world=world,
            backend=self.backend,
            device=self.device,
            timeout_s=timeout_s,
            formation=prefix,
        )
        return group

    def close(self) -> None:
        with self._lock:
            self._store = None
            private, self._private_dir, self.path = self._private_dir, None, None
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)


def _store_int(raw: bytes, what: str, low: int, high: int) -> int:
    try:
        value = int(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise WeightUpdateError(f"broadcast store key {what!r} is not an integer") from None
    if not low <= value <= high:
        raise WeightUpdateError(f"broadcast store key {what!r} = {value} is out of range [{low}, {high}]")
    return value


# ---------------------------------------------------------------------------- requests (validated)


_T = TypeVar("_T")
_U = TypeVar("_U")


@overload
def _get(body: Mapping[str, Any], key: str, typ: type[_T]) -> _T: ...
@overload
def _get(body: Mapping[str, Any], key: str, typ: tuple[type[_T], type[_U]]) -> _T | _U: ...
def _get(body: Mapping[str, Any], key: str, typ: type | tuple[type, ...]) -> object:
    if key not in body:
        raise WeightUpdateError(f"broadcast request is missing {key!r}")
    value = body[key]
    if isinstance(value, bool) and bool not in (typ if isinstance(typ, tuple) else (typ,)):
        raise WeightUpdateError(f"broadcast request field {key!r} has the wrong type")
    if not isinstance(value, typ):
        raise WeightUpdateError(f"broadcast request field {key!r} has the wrong type")
    return value


@dataclass(frozen=True)
class JoinRequest:
    path: str  # the store's file
    prefix: str
    backend: str
    deadline_s: float
    timeout_s: float

    @classmethod
    def parse(cls, body: Mapping[str, Any], *, secret: str) -> JoinRequest:
        store = _get(body, "store", str)
        prefix = _get(body, "prefix", str)
        if not secret or not prefix.startswith(f"{secret}/bcast/") or len(prefix) > 200:
            raise WeightUpdateError("broadcast 'prefix' is not this launch's (a stale or foreign formation)")
        backend = _get(body, "backend", str)
        if backend not in BACKENDS:
            raise WeightUpdateError(f"broadcast 'backend' must be one of {', '.join(BACKENDS)}, got {backend!r}")
        deadline = float(_get(body, "deadline_s", (int, float)))
        timeout = float(_get(body, "timeout_s", (int, float)))
        if not 0 < deadline <= 86400 or not 0 < timeout <= 86400:
            raise WeightUpdateError("broadcast 'deadline_s' and 'timeout_s' must be in (0, 86400]")
        check_store_path(store)  # last: what the file system says
        return cls(store, prefix, backend, deadline, timeout)


def check_store_path(path: str) -> None:
    """A broadcast store a replica may join: an absolute path to a regular file of this user's
    (not a link), in a directory of this user's that no one else may enter or write (0700) —
    the trainer's private store, never one another user could have made or can reach."""
    if not path.startswith("/") or len(path) > 4096:
        raise WeightUpdateError(
            f"broadcast 'store' must be the absolute path of the trainer's store, got {path!r:.200}"
        )
    me = os.geteuid()
    try:
        parent = os.lstat(os.path.dirname(path))
        st = os.lstat(path)
    except OSError as exc:
        raise WeightUpdateError(f"broadcast store {path!r:.200} cannot be read: {exc.strerror}") from None
    if not stat.S_ISDIR(parent.st_mode) or parent.st_uid != me or parent.st_mode & 0o077:
        raise WeightUpdateError(f"broadcast store {path!r:.200} is not in a private directory of this user (0700)")
    if not stat.S_ISREG(st.st_mode) or st.st_uid != me or st.st_mode & 0o077:
        raise WeightUpdateError(f"broadcast store {path!r:.200} is not a private file of this user (0600)")


def parse_plan(body: Mapping[str, Any]) -> list[list[tuple[str, TensorSpec]]]:
    """The ``buckets`` of a receive request: names, dtypes and shapes, checked for form."""
    raw = _get(body, "buckets", list)
    if not raw:
        raise WeightUpdateError("broadcast 'buckets' is empty")
    plan: list[list[tuple[str, TensorSpec]]] = []
    count = 0
    for bucket in raw:
        if not isinstance(bucket, list) or not bucket:
            raise WeightUpdateError("each broadcast bucket must be a non-empty list")
        out: list[tuple[str, TensorSpec]] = []
        for entry in bucket:
            count += 1
            if count > MAX_TENSORS:
                raise WeightUpdateError("broadcast plan names too many tensors")
            if (
                not isinstance(entry, list)
                or len(entry) != 3
                or not isinstance(entry[0], str)
                or not isinstance(entry[1], str)
                or not isinstance(entry[2], list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in entry[2])
            ):
                raise WeightUpdateError(f"broadcast tensor entry must be [name, dtype, [dims...]], got {entry!r:.200}")
            if entry[1] not in ALLOWED_DTYPES:
                raise WeightUpdateError(
                    f"tensor {entry[0]!r}: dtype {entry[1]!r} is not allowed (allowed: {', '.join(ALLOWED_DTYPES)})"
                )
            out.append((entry[0], TensorSpec(entry[1], tuple(entry[2]))))
        plan.append(out)
    return plan


def check_plan(
    plan: Sequence[Sequence[tuple[str, TensorSpec]]], mine: Mapping[str, TensorSpec], tied: Mapping[str, str]
) -> list[dict[str, str]]:
    """Every tensor of the importer's (``mine``, aliases ``tied``) arrives exactly once, with its
    dtype and shape, nothing extra; per bucket, importer name → sent name."""
    sent: dict[str, TensorSpec] = {}
    for bucket in plan:
        for name, spec in bucket:
            if name in sent:
                raise WeightUpdateError(f"tensor {name!r} appears twice in the broadcast plan")
            sent[name] = spec
    try:
        match_tensors(sent, {}, mine, tied)  # the whole model, nothing extra
        return [match_tensors(dict(b), {}, mine, tied, partial=True) for b in plan]
    except ManifestError as exc:
        raise WeightUpdateError(str(exc)) from None


def plan_body(specs: Mapping[str, TensorSpec], plan: Sequence[Sequence[str]]) -> list[list[list[Any]]]:
    """The ``buckets`` field of a receive request for ``plan`` (lists of names)."""
    return [[[n, specs[n].dtype, list(specs[n].shape)] for n in names] for names in plan]


# ---------------------------------------------------------------------------- the replica's side


class BroadcastReceiver:
    """An inference replica's end (the torch engine: one worker, rank 1 of 2)."""

    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.group: BroadcastGroup | None = None
        self._buf: torch.Tensor | None = None
        self.joins = 0
        self.received = 0

    def join(self, body: Mapping[str, Any], device: torch.device, *, rank: int = 1, world: int = 2) -> dict[str, Any]:
        """Join the formation ``body`` names as ``rank`` of ``world`` (blocking; up to its
        deadline). Rank 1 tells the trainer the world's size. gloo receives into host memory
        (copied to the model's device), NCCL into ``device``."""
        import torch.distributed as dist

        req = JoinRequest.parse(body, secret=self.secret)
        if not 1 <= rank < world:
            raise WeightUpdateError(f"broadcast rank {rank} is outside 1..{world - 1}")
        self.leave()
        store = dist.FileStore(req.path, -1)
        store.set_timeout(_timeout(req.deadline_s))
        scoped = dist.PrefixStore(req.prefix, store)
        if rank == 1:
            scoped.set("world", str(world))
        scoped.set(f"arrived/{rank}", str(time.time()))
        self.group = BroadcastGroup.build(
            scoped,
            rank=rank,
            world=world,
            backend=req.backend,
            device=device if req.backend == "nccl" else torch.device("cpu"),
            timeout_s=req.timeout_s,
            formation=req.prefix,
        )
        self.joins += 1
        log.info("joined the broadcast group", formation=req.prefix, backend=req.backend, rank=rank, world=world)
        return {"formation": req.prefix, "world": world}

    def leave(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()

    def check(
        self, body: Mapping[str, Any], model: torch.nn.Module
    ) -> tuple[str, int, list[Layout], list[dict[str, str]], bool]:
        """Validate a receive request against ``model`` before anything moves: the formation is
        the one joined, every tensor of the model arrives exactly once with its dtype and shape.
        Returns (formation, version, layouts, per-bucket importer → sent name, digest)."""
        from atroposd.weights.tensors import model_tensors

        formation = _get(body, "formation", str)
        if self.group is None or self.group.formation != formation:
            raise WeightUpdateError(
                f"broadcast formation {formation!r} is not the group this replica joined "
                f"({self.group.formation if self.group else 'none'}); join again"
            )
        version = _get(body, "weight_version", int)
        if version < 0:
            raise WeightUpdateError("'weight_version' must be non-negative")
        digest = bool(body.get("digest", False))
        plan = parse_plan(body)
        mt = model_tensors(model)
        sources = check_plan(plan, mt.specs(), dict(mt.tied))
        return formation, version, [layout(b) for b in plan], sources, digest

    def receive_views(self, lay: Layout) -> dict[str, torch.Tensor]:
        """One bucket received whole; its tensors as views of the receive buffer (valid until
        the next bucket)."""
        from atroposd.weights.tensors import torch_dtype

        group = self.group
        if group is None:
            raise WeightUpdateError("no broadcast group (join first)")
        if self._buf is None or self._buf.numel() < lay.size or self._buf.device != group.device:
            self._buf = torch.empty(max(lay.size, 1), dtype=torch.uint8, device=group.device)
        buf = self._buf[: lay.size]
        group.broadcast(buf)
        self.received += 1
        return {s.name: buf[s.offset : s.offset + s.nbytes].view(torch_dtype(s.dtype)).view(s.shape) for s in lay.slots}

    def receive(self, lay: Layout, targets: Mapping[str, torch.Tensor], source: Mapping[str, str]) -> int:
        """One bucket: receive it whole, then copy each tensor into ``targets`` (importer names)."""
        views = self.receive_views(lay)
        with torch.no_grad():
            for mine, src in source.items():
                targets[mine].copy_(views[src])
        return lay.size


class BroadcastEndpoint:
    """``POST /broadcast`` of an engine whose model lives in the server process (the torch engine):
    ``join`` and ``leave`` the group, ``receive`` (checked at once, received in the background),
    ``finish`` (waits for the last bucket)."""

    def __init__(self, secret: str) -> None:
        self.receiver = BroadcastReceiver(secret)
        self._task: asyncio.Task[dict[str, Any]] | None = None
        self._key: tuple[str, int] | None = None

    async def handle(
        self,
        body: object,
        *,
        model: torch.nn.Module,
        state: ReceiverState,
        require_paused: Callable[[], None],
        compute: AbstractAsyncContextManager[object],
    ) -> dict[str, Any]:
        import asyncio

        from atroposd.weights.receiver import BucketProgress

        if not isinstance(body, Mapping):
            raise WeightUpdateError("broadcast request must be a JSON object")
        op = _get(body, "op", str)
        if op in ("join", "leave"):
            await self._abandon()
            if op == "leave":
                self.receiver.leave()
                return {"left": True}
            device = next(iter(model.parameters())).device
            return await asyncio.to_thread(self.receiver.join, body, device)
        if op == "receive":
            require_paused()
            if self._task is not None and not self._task.done():
                raise WeightUpdateError("a broadcast is already being received")
            formation, version, layouts, sources, digest = self.receiver.check(body, model)
            if state.segments:
                state.release(model)  # leave shared mode: the model gets its own memory back
            from atroposd.weights.tensors import model_tensors

            targets = model_tensors(model).tensors
            progress = BucketProgress(version, len(layouts))
            state.buckets = progress  # from the first bucket on the model holds a mix until the last
            self._key = (formation, version)

            def run() -> dict[str, Any]:
                t0 = time.perf_counter()
                moved = 0
                try:
                    for lay, source in zip(layouts, sources, strict=True):
                        moved += self.receiver.receive(lay, targets, source)
                        progress.next += 1
                except BaseException:
                    self.receiver.leave()  # the trainer's end fails at once instead of waiting
                    raise
                state.buckets = None
                state.weight_version = version
                out: dict[str, Any] = {
                    "weight_version": version,
                    "buckets": len(layouts),
                    "bytes": moved,
                    "seconds": round(time.perf_counter() - t0, 6),
                }
                if digest:
                    out["digests"] = {n: tensor_digest(t) for n, t in targets.items()}
                return out

            async def guarded() -> dict[str, Any]:
                async with compute:
                    return await asyncio.to_thread(run)

            self._task = asyncio.get_running_loop().create_task(guarded())
            return {"accepted": True, "formation": formation, "weight_version": version, "buckets": len(layouts)}
        if op == "finish":
            formation = _get(body, "formation", str)
            version = _get(body, "weight_version", int)
            if self._task is None or self._key != (formation, version):
                raise WeightUpdateError(f"no broadcast of weight_version {version} under way in {formation!r}")
            task, self._task, self._key = self._task, None, None
            try:
                result: dict[str, Any] = await asyncio.shield(task)
            except WeightUpdateError:
                raise
            except Exception as exc:
                raise WeightUpdateError(
                    f"the broadcast of weight_version {version} failed: {type(exc).__name__}: {str(exc)[:300]}"
                ) from None
            log.info(
                "weights received by broadcast",
                weight_version=version,
                buckets=result["buckets"],
                bytes=result["bytes"],
                seconds=result["seconds"],
            )
            return result
        raise WeightUpdateError(f"unknown broadcast op {op!r} (join, receive, finish, leave)")

    async def _abandon(self) -> None:
        """A receive under way is given up (its group is dropped, so it fails at once)."""
        import asyncio

        task, self._task, self._key = self._task, None, None
        if task is None:
            return
        if not task.done():
            self.receiver.leave()
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=30.0)
        except (Exception, asyncio.TimeoutError):  # its failure is the point
            pass

    def close(self) -> None:
        self.receiver.leave()

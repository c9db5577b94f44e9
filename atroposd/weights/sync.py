"""Trainer-side weight sync strategies: ``shared``, ``push``, ``reload`` and ``broadcast`` (SPEC §7).

``make_weight_sync(cfg, nonce=..., control_sockets=[...])`` picks the strategy from
``cfg.weight_sync``. Every strategy has the same shape, which the training loop uses without
knowing the mode::

    await sync.attach(model, version)        # once, before the optimizer is built
    for step ...:
        loss.backward()
        async with sync.paused(version + 1):  # shared: generation paused around the step
            optimizer.step()
        version += 1
        await sync.after_step(model, version) # push / reload: every sync_every steps
    ...
    await sync.reattach(model, version, i)   # after inference replica i restarted
    sync.close()                             # release everything (segments, manifest, sync dir)

* ``shared``: ``attach`` moves the model's tensors into POSIX shm segments (CUDA buffers on a
  GPU) in place and asks the server to map them; the server computes on the trainer's memory.
  ``paused`` = ``/pause`` (in-flight generations finish, no new one starts) → step →
  ``/resume {weight_version}``, so every response carries exactly one version.
* ``push``: the same exported buffers (the trainer trains in them, so nothing is staged);
  every ``sync_every`` steps the server copies them into its own weights while paused.
* ``reload``: every ``sync_every`` steps the weights are written to ``{state_dir}/sync/`` and
  the server loads them while paused.
* bucketed ``push`` (``BucketPushSync``, several trainer ranks: the parameters are shards, so
  the trainer cannot train in an exported buffer): every replica is paused, then bucket by
  bucket (``sync_bucket_mb``) the weights are gathered from a :class:`TensorSource`, written
  into one staging buffer and copied by every replica; then every replica resumes with the new
  version. The trainer's extra memory is the staging buffer: one bucket, never a second model.
  A bucketed ``reload`` (``ReloadSync(bucket_bytes=...)``) writes the gathered buckets as
  sharded safetensors files.
* ``broadcast`` (``BroadcastSync``, any rank count): the same bucket stream, sent over a
  torch.distributed group the trainer forms with each replica (gloo on the CPU, NCCL on GPUs;
  ``atroposd.weights.broadcast``) instead of through a staging buffer.

Every call goes to every inference replica (SPEC §12.2), in parallel, one connection per
replica; a sync waits for each replica it reaches. ``shared``: the replicas all map the same
exported buffers — one copy for all; ``push``: each copies them; ``reload``: each loads the
one directory. If a replica is unreachable (it died and is being restarted, or its engine
is still loading) its pause, resume or push is skipped with a warning: the restarted server
starts paused (``--await-weights``) and gets the current weights from ``reattach(...,
replica)`` before it serves again.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
import torch

from atroposd.logs import get_logger
from atroposd.weights.arena import DEFAULT_SEGMENT_BYTES, ParameterArena
from atroposd.weights.client import WeightControlClient, WeightControlError
from atroposd.weights.manifest import (
    BucketRef,
    Manifest,
    manifest_path,
    process_start_time,
    staging_manifest_path,
)
from atroposd.weights.source import (
    ModelSource,
    TensorSource,
    bucket_bytes_of,
    check_gathered,
    plan_buckets,
)

if TYPE_CHECKING:
    from atroposd.config import Config
    from atroposd.weights.staging import StagingBuffer

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "REMOTE_ONLY",
    "BroadcastSync",
    "BucketPushSync",
    "PushSync",
    "ReloadSync",
    "Replica",
    "SharedSync",
    "WeightSync",
    "make_weight_sync",
]

log = get_logger(__name__)
_T = TypeVar("_T")

DEFAULT_DEADLINE = 300.0
MIN_DEADLINE = 30.0
# ``[trainer] sync_bucket_mb`` = 512
DEFAULT_BUCKET_BYTES = 512 << 20

SourceFor = Callable[[torch.nn.Module], TensorSource]
# A push replica's path (SPEC §7): ``direct`` from the exported buffers (shm; CUDA IPC on the
# trainer's GPU), or ``host_staging`` from one pinned host shared-memory staging buffer.
PUSH_PATHS = ("direct", "host_staging")
# ``reattach(..., REMOTE_ONLY)``: no replica of this node; every bucket is still gathered, so the
# other nodes' first ranks feed theirs (SPEC §12.3).
REMOTE_ONLY = -1


class WeightSync(Protocol):
    mode: str

    async def attach(self, model: torch.nn.Module, version: int) -> None: ...
    def paused(self, new_version: int | None = None) -> Any: ...
    async def after_step(self, model: torch.nn.Module, version: int) -> None: ...
    async def reattach(self, model: torch.nn.Module, version: int, replica: int | None = None) -> None: ...
    def replica_versions(self) -> list[int | None]: ...
    def close(self) -> None: ...


def make_weight_sync(
    cfg: Config,
    *,
    nonce: str,
    control_socket: Path | None = None,
    control_sockets: Sequence[Path] | None = None,
    bucketed: bool = False,
    bucket_bytes: int | None = None,
    source_for: SourceFor | None = None,
) -> WeightSync:
    """The strategy for ``cfg.weight_sync`` (``auto`` already resolved by the config).

    ``control_sockets``: one weight-control socket per inference replica (replica 0 first);
    ``control_socket`` is the one-replica shorthand. ``bucketed`` (several trainer ranks):
    ``push`` is :class:`BucketPushSync` and ``reload`` writes sharded files, both a bucket of
    ``bucket_bytes`` (default 512 MiB) at a time from ``source_for(model)`` (default
    :class:`ModelSource`); ``shared`` is refused."""
    from atroposd.paths import Paths

    paths = Paths.of(cfg)
    mode = cfg.weight_sync
    sync_every = int(cfg.trainer.sync_every)
    sockets = (
        list(control_sockets)
        if control_sockets is not None
        else ([control_socket] if control_socket is not None else [])
    )
    sync: SharedSync | PushSync | BucketPushSync | ReloadSync | BroadcastSync
    buckets = int(bucket_bytes) if bucket_bytes is not None else DEFAULT_BUCKET_BYTES
    sources = source_for if source_for is not None else ModelSource
    if bucketed and mode == "shared":
        raise ValueError(
            'weight_sync = "shared" needs one trainer rank (the replicas compute on the trainer\'s '
            'own parameter memory); with several ranks use "push" or "reload"'
        )
    if bucketed and mode == "push":
        assert sockets, "push mode needs the inference control socket"
        # one staging buffer for all: on the trainer's GPU (CUDA IPC) only when every replica sees it
        sync = BucketPushSync(
            nonce=nonce,
            weights_dir=paths.weights_dir,
            control_sockets=sockets,
            sync_every=sync_every,
            bucket_bytes=buckets,
            source_for=sources,
            host_staging="host_staging" in push_paths(cfg),
        )
    elif bucketed and mode == "reload":
        sync = ReloadSync(
            sync_dir=paths.sync_dir,
            control_sockets=sockets if cfg.inference.enabled else [],
            sync_every=sync_every,
            bucket_bytes=buckets,
            source_for=sources,
        )
    elif mode == "shared":
        assert sockets, "shared mode needs the inference control socket"
        sync = SharedSync(nonce=nonce, weights_dir=paths.weights_dir, control_sockets=sockets)
    elif mode == "push":
        assert sockets, "push mode needs the inference control socket"
        sync = PushSync(
            nonce=nonce,
            weights_dir=paths.weights_dir,
            control_sockets=sockets,
            sync_every=sync_every,
            paths=push_paths(cfg)[: len(sockets)],
            bucket_bytes=buckets,
        )
    elif mode == "reload":
        sync = ReloadSync(
            sync_dir=paths.sync_dir, control_sockets=sockets if cfg.inference.enabled else [], sync_every=sync_every
        )
    elif mode == "broadcast":
        assert sockets, "broadcast mode needs the inference control sockets"
        from atroposd.devices import resolve_torch

        device, _ = resolve_torch(cfg.trainer.devices()[0], cfg.inference.dtype)
        backend = "nccl" if device.type == "cuda" else "gloo"
        deadline = sync_deadline(float(getattr(cfg.trainer, "stall_timeout", 0.0)))
        sync = BroadcastSync(
            nonce=nonce,
            control_sockets=sockets,
            sync_every=sync_every,
            bucket_bytes=buckets,
            source_for=sources,
            backend=backend,
            device=device,
            form_timeout=min(float(cfg.trainer.join_timeout), deadline),
        )
    else:
        raise ValueError(f"unknown weight_sync mode {mode!r}")
    sync.deadline = sync_deadline(float(getattr(cfg.trainer, "stall_timeout", 0.0)))
    return sync


def push_paths(cfg: Config) -> list[str]:
    """Each replica's ``push`` path (SPEC §7): ``direct`` (the exported buffers: shared memory on
    the CPU, CUDA IPC where the replica computes on exactly the trainer's GPU) or
    ``host_staging`` (another GPU, several GPUs, or ``[trainer] push_path = "host_staging"``).
    GPUs are compared as the daemon numbers them (``cuda`` = ``cuda:0``, ``auto`` = the first)."""
    from atroposd.devices import resolve, same_device

    replicas = cfg.inference_devices()
    if str(getattr(cfg.trainer, "push_path", "auto")) == "host_staging":
        return ["host_staging"] * len(replicas)
    trainer = _gpus(cfg.trainer.devices()[0], cfg.inference.dtype, resolve)
    if not trainer:
        return ["direct"] * len(replicas)

    def direct(entry: str) -> bool:
        gpus = _gpus(entry, cfg.inference.dtype, resolve)
        return len(gpus) == 1 and same_device(trainer[0], gpus[0]) is True

    return ["direct" if direct(entry) else "host_staging" for entry in replicas]


def _gpus(entry: str, dtype: str, resolve: Callable[..., tuple[str, str]]) -> list[str]:
    """The GPUs a device entry names, normalised (``[]``: the CPU)."""
    out = []
    for part in (p.strip() for p in entry.split(",") if p.strip()):
        if part.startswith(("GPU-", "MIG-")):
            out.append(part)
            continue
        name = resolve(part, dtype)[0] if part == "auto" else part
        if name == "cpu":
            continue
        out.append("cuda:0" if name == "cuda" else name)
    return out


def replica_sync_status(sync: Any, replica: int) -> dict[str, Any]:
    """Replica ``replica``'s weight sync as ``status --json`` shows it: the mode it got, and for
    ``push`` its path, for ``broadcast`` its group (formed or not, formations and failures, the
    last transfer)."""
    inner = getattr(sync, "inner", sync)
    describe = getattr(inner, "replica_status", None)
    if describe is not None:
        out: dict[str, Any] = describe(replica)
        return out
    return {"mode": str(getattr(inner, "mode", "?"))}


def sync_deadline(stall_timeout: float) -> float:
    """A weight-control request's deadline: half the trainer's stall_timeout (the daemon then
    still has time to restart the server within the stall), at least ``MIN_DEADLINE``; without
    a stall_timeout, 300 s."""
    return max(MIN_DEADLINE, stall_timeout / 2) if stall_timeout > 0 else DEFAULT_DEADLINE


def _unreachable(exc: WeightControlError) -> bool:
    """The server is not there to take weights now: dead (no answer), or answering 503 (its engine
    still loading, or shutting down). It gets the current weights when it is ready again."""
    return exc.status is None or exc.status == 503


@dataclass(eq=False)
class Replica:
    """One inference replica as the weight sync sees it: its control socket and what it holds."""

    index: int
    socket: Path
    #: holds the trainer's current weights and serves with them
    current: bool = False
    #: the weight_version it was last resumed with (None: never reached)
    version: int | None = None
    conn: WeightControlClient | None = field(default=None, repr=False)


class _ControlMixin:
    """Weight-control calls to every inference replica (SPEC §12.2): a sync goes to each replica
    in parallel and waits for every one it reaches; a replica that is down (or dies during the
    sync) is skipped and gets the current weights from ``reattach`` before it serves again."""

    replicas: list[Replica]
    # Each control request's own deadline: past it the replica counts as unreachable (the
    # update is skipped and ``sync_timeouts`` counts it; the daemon restarts the server, and
    # the restarted one gets the weights from ``reattach``).
    deadline: float = DEFAULT_DEADLINE
    sync_timeouts: int = 0

    def _set_sockets(self, sockets: Sequence[Path | str]) -> None:
        self.replicas = [Replica(i, Path(s)) for i, s in enumerate(sockets)]

    @property
    def control_socket(self) -> Path | None:
        """Replica 0's socket (the one-replica view)."""
        return self.replicas[0].socket if self.replicas else None

    @control_socket.setter
    def control_socket(self, path: Path | None) -> None:
        self._set_sockets([path] if path is not None else [])

    @property
    def server_current(self) -> bool:
        """Every replica holds the trainer's current weights."""
        return bool(self.replicas) and all(r.current for r in self.replicas)

    def replica_versions(self) -> list[int | None]:
        """The weight_version each replica was last resumed with (None: not reached yet)."""
        return [r.version for r in self.replicas]

    def _targets(self, replica: int | None) -> list[Replica]:
        if replica is None:
            return list(self.replicas)
        return [r for r in self.replicas if r.index == replica]

    @asynccontextmanager
    async def _connected(self, r: Replica) -> AsyncIterator[None]:
        """One connection for a sequence of calls (pause → update → resume): a sync pays
        for one connection set-up per replica, not three."""
        if r.conn is not None:
            yield
            return
        r.conn = WeightControlClient(r.socket, timeout=self.deadline)
        try:
            yield
        finally:
            conn, r.conn = r.conn, None
            with anyio.CancelScope(shield=True):
                await conn.close()

    async def _call(self, method: str, *args: Any, replica: Replica) -> dict[str, Any]:
        try:
            return await self._call_once(method, *args, replica=replica)
        except WeightControlError as exc:
            if exc.timed_out:
                self.sync_timeouts += 1
                log.error(
                    "weight sync did not return within its deadline",
                    request=method,
                    replica=replica.index,
                    deadline_s=self.deadline,
                    timeouts=self.sync_timeouts,
                )
            raise

    async def _call_once(self, method: str, *args: Any, replica: Replica) -> dict[str, Any]:
        if replica.conn is not None:
            result: dict[str, Any] = await getattr(replica.conn, method)(*args)
            return result
        client = WeightControlClient(replica.socket, timeout=self.deadline)
        try:
            result = await getattr(client, method)(*args)
            return result
        finally:
            await client.close()

    async def _each(self, targets: Sequence[Replica], fn: Callable[[Replica], Awaitable[_T]]) -> list[_T]:
        """``fn`` on every target in parallel; the results in the targets' order. A failure is
        raised (the first, by replica) once every call has ended: never an exception group."""
        if len(targets) == 1:
            return [await fn(targets[0])]
        results: dict[int, _T] = {}
        errors: dict[int, BaseException] = {}

        async def one(i: int, r: Replica) -> None:
            try:
                results[i] = await fn(r)
            except Exception as exc:
                errors[i] = exc

        async with anyio.create_task_group() as tg:
            for i, r in enumerate(targets):
                tg.start_soon(one, i, r)
        if errors:
            raise errors[min(errors)]
        return [results[i] for i in range(len(targets))]

    async def _reached(
        self, r: Replica, version: int, method: str, *args: Any, answers: list[dict[str, Any]] | None = None
    ) -> bool:
        """One control call to ``r``; False when the replica is not there to take weights (dead,
        past the deadline, or 503): it is marked not current, with a warning, and gets the
        weights from ``reattach`` when it is back. Any other refusal is raised. ``answers``
        collects the replica's answer."""
        try:
            answer = await self._call(method, *args, replica=r)
            if answers is not None:
                answers.append(answer)
            return True
        except WeightControlError as exc:
            if not _unreachable(exc):
                raise
            log.warning(
                "inference server unreachable; it gets the weights when it is back",
                request=method,
                replica=r.index,
                weight_version=version,
                error=str(exc),
            )
            r.current = False
            return False

    async def _pause(self, r: Replica, version: int) -> bool:
        return await self._reached(r, version, "pause")

    async def _resume(self, r: Replica, version: int) -> bool:
        if not await self._reached(r, version, "resume", version):
            return False
        r.version = version
        r.current = True
        return True

    async def _update(self, r: Replica, version: int, fallback: int, method: str, *args: Any) -> bool:
        """Pause ``r``, give it ``version`` (``method``: update_weights or load), resume it. A
        refused update touched nothing: the replica resumes with what it had (its own version,
        else ``fallback``) and the refusal is raised."""
        t0 = time.perf_counter()
        if not await self._pause(r, version):
            return False
        t1 = time.perf_counter()
        try:
            if not await self._reached(r, version, method, *args):
                return False
        except WeightControlError:
            with anyio.CancelScope(shield=True):
                await self._resume(r, r.version if r.version is not None else fallback)
            raise
        finally:
            self._timed(t1 - t0, time.perf_counter() - t1)
        return await self._resume(r, version)

    def _timed(self, pause_s: float, transfer_s: float) -> None:
        """One replica's update timed: its pause and its copy apart (kept by the modes that
        report them in metrics.jsonl)."""


class _ArenaSync(_ControlMixin):
    """Common part of shared and push: the model trains inside exported buffers (one copy, which
    every replica maps (shared) or copies from (push))."""

    mode = "?"
    update_mode = "?"

    def __init__(
        self,
        *,
        nonce: str,
        weights_dir: Path,
        control_socket: Path | None = None,
        control_sockets: Sequence[Path] | None = None,
        max_segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    ) -> None:
        self.nonce = nonce
        self.weights_dir = weights_dir
        self._set_sockets(
            control_sockets if control_sockets is not None else [control_socket] if control_socket is not None else []
        )
        self.max_segment_bytes = max_segment_bytes
        self.manifest_file = manifest_path(weights_dir, nonce)
        self.arena: ParameterArena | None = None
        self.version = 0
        self._next_segment = 0

    async def attach(self, model: torch.nn.Module, version: int) -> None:
        """Export ``model`` (moving it into shared buffers once) and bring every replica to it."""
        await anyio.to_thread.run_sync(self._ensure_arena, model)
        await self._export(version, self.replicas)

    def _ensure_arena(self, model: torch.nn.Module) -> bool:
        """Make sure the model lives in exported buffers; True when they are new ones."""
        if self.arena is not None and self.arena.model is model:
            self.arena.check_bound()
            missing = self.arena.missing_segments()
            if not missing:
                return False
            # The trainer's mapping still works; a server (re)attaching needs the names: export anew.
            log.warning(
                "exported segments were removed from /dev/shm by something else; exporting into new ones",
                segments=missing,
            )
        if self.arena is not None:
            self.arena.release()
            self.arena = None
        self.weights_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.weights_dir, 0o700)
        self.arena = ParameterArena.create(
            model, nonce=self.nonce, max_segment_bytes=self.max_segment_bytes, first_index=self._next_segment
        )
        self._next_segment += len(self.arena.segments)
        return True

    async def _export(self, version: int, targets: Sequence[Replica]) -> bool:
        """Write the manifest for ``version``; each target takes it (attach or copy) while paused,
        all in parallel. True when every target did."""
        assert self.arena is not None, "attach() first"
        arena = self.arena
        manifest = await anyio.to_thread.run_sync(arena.manifest, version)
        manifest.write(self.manifest_file)

        async def one(r: Replica) -> bool:
            async with self._connected(r):
                return await self._send_export(arena, version, r)

        done = await self._each(targets, one)
        self.version = version
        return all(done)

    async def _send_export(self, arena: ParameterArena, version: int, r: Replica) -> bool:
        try:
            return await self._update(
                r, version, self.version, "update_weights", self.manifest_file, self.update_mode, version
            )
        finally:
            if arena.transport == "cuda_ipc":
                from atroposd.weights.cuda_ipc import ipc_collect

                ipc_collect()

    async def reattach(self, model: torch.nn.Module, version: int, replica: int | None = None) -> None:
        """A replica restarted (``replica``; None: every one): export again and let it attach or
        copy before it serves. Buffers exported anew (segments removed behind the trainer) go to
        every replica, since the others compute on (or copy from) the old ones."""
        fresh = await anyio.to_thread.run_sync(self._ensure_arena, model)
        await self._export(version, self.replicas if fresh else self._targets(replica))

    @asynccontextmanager
    async def paused(self, new_version: int | None = None) -> AsyncIterator[None]:
        yield

    async def after_step(self, model: torch.nn.Module, version: int) -> None:
        self.version = version

    def close(self) -> None:
        """Give the model private memory back, unlink every segment, remove the manifest."""
        try:
            if self.arena is not None:
                self.arena.release()
        finally:
            self.arena = None
            try:
                self.manifest_file.unlink()
            except FileNotFoundError:
                pass


class SharedSync(_ArenaSync):
    """``shared``: every replica computes on the trainer's parameter memory (one copy for all)."""

    mode = "shared"
    update_mode = "attach"

    def replica_status(self, replica: int) -> dict[str, Any]:
        """What ``status --json`` shows of ``replica``'s weight sync: the mode and the memory it
        computes on (``shm`` or ``cuda_ipc``)."""
        return {"mode": self.mode, "path": self.arena.transport if self.arena is not None else "direct"}

    @asynccontextmanager
    async def paused(self, new_version: int | None = None) -> AsyncIterator[None]:
        """Pause generation on every replica around the optimizer step; resume with ``new_version``.

        ``new_version`` defaults to the last version + 1. The replicas are resumed even when
        the step raised (their weights may have changed, so they get the new version).
        """
        # A connection per call: the step between pause and resume may outlast a kept-alive one.
        version = new_version if new_version is not None else self.version + 1
        reached = await self._each(self.replicas, lambda r: self._pause(r, version))
        paused = [r for r, ok in zip(self.replicas, reached, strict=True) if ok]
        try:
            yield
        finally:
            self.version = version
            if paused:
                with anyio.CancelScope(shield=True):
                    # On a GPU the step's kernels may still run: the server must not read a mix
                    # of versions, so the device finishes them before generation resumes.
                    if self.arena is not None:
                        await anyio.to_thread.run_sync(self.arena.synchronize)
                    await self._each(paused, lambda r: self._resume(r, version))


class PushSync(_ArenaSync):
    """``push``: every ``sync_every`` steps every replica copies the exported buffers in, in parallel.

    Each replica has a path (``paths``, one per replica; SPEC §7): ``direct`` copies from the
    exported buffers themselves (POSIX shm on the CPU, CUDA IPC where the replica sees the
    trainer's GPU); ``host_staging`` (a replica on another GPU, a tensor-parallel one) copies
    from one staging buffer in pinned host shared memory, which the trainer fills bucket by
    bucket (``bucket_bytes``) once for all such replicas (:class:`BucketPushSync` with
    ``host_staging``). Both kinds are fed in parallel. ``last_sync`` splits a sync into the
    replicas' pause and the transfer (the longest of each over the replicas).
    """

    mode = "push"
    update_mode = "copy"

    def __init__(
        self,
        *,
        sync_every: int = 1,
        paths: Sequence[str] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        digest: bool = False,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.sync_every = max(1, sync_every)
        self._since = 0
        paths = list(paths) if paths is not None else ["direct"] * len(self.replicas)
        if len(paths) != len(self.replicas) or any(p not in PUSH_PATHS for p in paths):
            raise ValueError(f"paths must name one of {PUSH_PATHS} per replica ({len(self.replicas)}), got {paths}")
        self.paths = paths
        self.stager: BucketPushSync | None = None
        if "host_staging" in paths:
            self.stager = BucketPushSync(
                nonce=self.nonce,
                weights_dir=self.weights_dir,
                control_sockets=[],
                bucket_bytes=bucket_bytes,
                host_staging=True,
                digest=digest,
                manifest_file=staging_manifest_path(self.weights_dir, self.nonce),
            )
        #: the last sync: sync_pause_s, sync_transfer_s, seconds (a new dict per sync)
        self.last_sync: dict[str, float] = {}
        self._pauses: list[float] = []
        self._transfers: list[float] = []

    def path_of(self, replica: int) -> str:
        """``direct`` → the arena's transport (``shm`` or ``cuda_ipc``); else ``host_staging``."""
        if self.paths[replica] == "host_staging":
            return "host_staging"
        if self.arena is not None:
            return self.arena.transport
        return "direct"

    def replica_status(self, replica: int) -> dict[str, Any]:
        """What ``status --json`` shows of ``replica``'s weight sync: the mode and its path."""
        return {"mode": self.mode, "path": self.path_of(replica)}

    async def _export(self, version: int, targets: Sequence[Replica]) -> bool:
        staged = [r for r in targets if self.paths[r.index] == "host_staging"]
        direct = [r for r in targets if self.paths[r.index] != "host_staging"]
        start = time.perf_counter()
        self._pauses, self._transfers = [], []
        staged_sync: dict[str, float] = {}

        async def direct_part() -> bool:
            return await super(PushSync, self)._export(version, direct) if direct else True

        async def staged_part() -> bool:
            if not staged:
                return True
            assert self.stager is not None and self.arena is not None
            self.stager.deadline = self.deadline
            try:
                return await self.stager._publish(self.arena.model, version, staged)
            finally:
                staged_sync.update(self.stager.last_sync)

        # both kinds in parallel; a failure is raised once both ended (never an exception group)
        done = [True, True]
        errors: list[Exception] = []

        async def run(i: int, part: Callable[[], Awaitable[bool]]) -> None:
            try:
                done[i] = await part()
            except Exception as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, 0, direct_part)
            tg.start_soon(run, 1, staged_part)
        if errors:
            raise errors[0]
        self.version = version
        pauses = self._pauses + ([staged_sync["sync_pause_s"]] if "sync_pause_s" in staged_sync else [])
        transfers = self._transfers + ([staged_sync["sync_transfer_s"]] if "sync_transfer_s" in staged_sync else [])
        self.last_sync = {
            "sync_pause_s": max(pauses, default=0.0),
            "sync_transfer_s": max(transfers, default=0.0),
            "seconds": time.perf_counter() - start,
        }
        return all(done)

    def _timed(self, pause_s: float, transfer_s: float) -> None:
        self._pauses.append(pause_s)
        self._transfers.append(transfer_s)

    def close(self) -> None:
        try:
            if self.stager is not None:
                self.stager.close()
        finally:
            super().close()

    async def after_step(self, model: torch.nn.Module, version: int) -> None:
        self._since += 1
        if self._since < self.sync_every:
            return
        if self.arena is None or self.arena.model is not model:
            await anyio.to_thread.run_sync(self._ensure_arena, model)
        if await self._export(version, self.replicas):
            self._since = 0


class _PublishSync(_ControlMixin):
    """A sync that sends the whole model from a :class:`TensorSource` to its targets (``_publish``):
    at ``attach``, to one replica at ``reattach``, and every ``sync_every`` steps; no pause
    around the optimizer step (the trainer's memory is never the server's)."""

    sync_every: int = 1
    _since: int = 0
    source_for: SourceFor = ModelSource
    _source: tuple[torch.nn.Module, TensorSource] | None = None

    async def _publish(self, model: torch.nn.Module, version: int, targets: Sequence[Replica]) -> bool:
        raise NotImplementedError

    def source(self, model: torch.nn.Module) -> TensorSource:
        """The tensor source of ``model`` (made once per model)."""
        if self._source is None or self._source[0] is not model:
            self._source = (model, self.source_for(model))
        return self._source[1]

    async def attach(self, model: torch.nn.Module, version: int) -> None:
        await self._publish(model, version, self.replicas)

    async def reattach(self, model: torch.nn.Module, version: int, replica: int | None = None) -> None:
        """Everything again, to ``replica`` only (None: every replica)."""
        await self._publish(model, version, self._targets(replica))

    @asynccontextmanager
    async def paused(self, new_version: int | None = None) -> AsyncIterator[None]:
        yield

    async def after_step(self, model: torch.nn.Module, version: int) -> None:
        self._since += 1
        if self._since < self.sync_every:
            return
        if await self._publish(model, version, self.replicas):
            self._since = 0


class BucketPushSync(_PublishSync):
    """``push`` with several trainer ranks: the weights stream to every replica in buckets.

    A sync (``attach``, ``after_step`` every ``sync_every`` steps, ``reattach``): pause every
    target replica → for each bucket of at most ``bucket_bytes`` (:func:`plan_buckets`):
    ``await source.gather(names)`` → write it into the one staging buffer
    (:class:`~atroposd.weights.staging.StagingBuffer`, sized for the largest bucket, reused for
    every bucket and every sync) → every replica copies that bucket, in parallel (an
    ``update_weights`` whose manifest names the bucket: the served version does not change) →
    next bucket → resume every replica with the new version. The trainer's model stays in its
    own memory (nothing is moved into exported buffers); its extra memory for a sync is the
    staging buffer plus whatever the source allocates for the bucket it gathered.

    Every bucket is gathered even when no replica is left to take it: with several ranks each
    gather is a collective the other ranks take part in, so rank 0 never leaves one out.

    A replica that is down is skipped (``_reached``). A replica that dies or refuses a bucket
    halfway holds a mix of versions: it is marked not current and left paused (its server also
    refuses to resume before a complete set arrived), and it gets every bucket again from the
    next sync or from ``reattach`` before it serves. A refusal is raised once the others
    resumed.
    """

    mode = "push"
    update_mode = "copy"

    def __init__(
        self,
        *,
        nonce: str,
        weights_dir: Path,
        control_socket: Path | None = None,
        control_sockets: Sequence[Path] | None = None,
        sync_every: int = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        source_for: SourceFor = ModelSource,
        host_staging: bool = False,
        manifest_file: Path | None = None,
        digest: bool = False,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.nonce = nonce
        self.weights_dir = weights_dir
        self._set_sockets(
            control_sockets if control_sockets is not None else [control_socket] if control_socket is not None else []
        )
        self.sync_every = max(1, sync_every)
        self.bucket_bytes = bucket_bytes
        self.source_for = source_for
        self.manifest_file = manifest_file if manifest_file is not None else manifest_path(weights_dir, nonce)
        #: stage in pinned host shared memory even when the tensors are on a GPU (replicas that
        #: cannot map the trainer's GPU memory, SPEC §7)
        self.host_staging = host_staging
        #: ask every replica for the sha256 of each tensor it copied (``last_results``; tests)
        self.digest = digest
        #: the last sync's digests of each replica (``digest``), by replica index
        self.last_results: dict[int, dict[str, str]] = {}
        self.staging: StagingBuffer | None = None
        self.version = 0
        self.export_id = 0
        #: the last sync: buckets, bytes, staging_bytes, gather_s (in the source), seconds
        self.last_sync: dict[str, float] = {}
        self._since = 0
        self._source: tuple[torch.nn.Module, TensorSource] | None = None
        start = process_start_time(os.getpid())
        assert start is not None
        self._start_time = start

    def replica_status(self, replica: int) -> dict[str, Any]:
        """What ``status --json`` shows of ``replica``'s weight sync: the mode and the staging
        buffer's path (``host_staging``, or the trainer's ``cuda_ipc`` / ``shm`` buffer)."""
        if self.host_staging:
            path = "host_staging"
        else:
            path = self.staging.transport if self.staging is not None else "staging"
        return {"mode": self.mode, "path": path}

    def _staging_for(self, size: int, device: torch.device) -> StagingBuffer:
        from atroposd.weights.staging import StagingBuffer

        if self.staging is not None and self.staging.fits(size, device, host=self.host_staging):
            return self.staging
        index = 0
        if self.staging is not None:
            index = self.staging.index + 1
            self.staging.close()
            self.staging = None
        self.weights_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.weights_dir, 0o700)
        self.staging = StagingBuffer.create(self.nonce, size, device, index, host=self.host_staging)
        return self.staging

    def _write_bucket(
        self,
        names: Sequence[str],
        tensors: dict[str, torch.Tensor],
        size: int,
        version: int,
        tied: dict[str, str],
        lora: dict[str, Any] | None,
        bucket: BucketRef,
    ) -> None:
        """Write one bucket into the staging buffer and its manifest (on a worker thread)."""
        devices = {t.device for t in tensors.values()}
        if len(devices) != 1:
            raise ValueError(f"a bucket's tensors are on several devices ({sorted(map(str, devices))})")
        staging = self._staging_for(size, devices.pop())
        entries = staging.fill(names, tensors)
        self.export_id += 1
        Manifest(
            nonce=self.nonce,
            exporter_pid=os.getpid(),
            exporter_start_time=self._start_time,
            export_id=self.export_id,
            weight_version=version,
            transport=staging.transport,
            segments=(staging.ref(),),
            tensors=tuple(entries),
            tied=tied,
            lora=lora,
            created_at=time.time(),
            bucket=bucket,
        ).write(self.manifest_file)

    async def _publish(self, model: torch.nn.Module, version: int, targets: Sequence[Replica]) -> bool:
        """Every bucket to ``targets``; True when every target took them all and resumed."""
        start = time.perf_counter()
        source = self.source(model)
        specs, tied, lora = source.specs(), source.tied(), source.lora()
        plan = plan_buckets(specs, self.bucket_bytes)
        if not plan:
            raise ValueError("the model has no tensors to push")
        size = max(bucket_bytes_of(specs, names) for names in plan)
        refused: list[tuple[Replica, WeightControlError]] = []
        gather_s = 0.0
        moved = 0
        async with AsyncExitStack() as stack:
            for r in targets:
                await stack.enter_async_context(self._connected(r))
                self.last_results.pop(r.index, None)
            pause_start = time.perf_counter()
            reached = await self._each(targets, lambda r: self._pause(r, version))
            transfer_start = time.perf_counter()
            live = [r for r, ok in zip(targets, reached, strict=True) if ok]
            for r in live:
                r.current = False  # from its first bucket to its last it holds a mix
            announce = getattr(source, "announce", None)
            for i, names in enumerate(plan):
                t0 = time.perf_counter()
                if announce is not None:  # several nodes: their first ranks feed their replicas too
                    announce(i, len(plan), version)
                tensors = await source.gather(names)
                gather_s += time.perf_counter() - t0
                check_gathered(specs, names, tensors)
                if live:
                    await anyio.to_thread.run_sync(
                        self._write_bucket, names, tensors, size, version, tied, lora, BucketRef(i, len(plan))
                    )
                    moved += sum(t.numel() * t.element_size() for t in tensors.values())
                del tensors  # a gathered bucket is dropped before the next one is gathered
                if live:
                    took = await self._each(live, lambda r: self._copy_bucket(r, version, refused))
                    live = [r for r, ok in zip(live, took, strict=True) if ok]
            transfer_s = time.perf_counter() - transfer_start
            resumed = await self._each(live, lambda r: self._resume(r, version)) if live else []
        self.version = version
        # sync_pause_s / sync_transfer_s: metrics.jsonl's split of the sync (the replicas' pause;
        # every bucket gathered, staged and copied by every replica)
        self.last_sync = {
            "buckets": len(plan),
            "bytes": moved,
            "gather_s": gather_s,
            "staging_bytes": self.staging.size if self.staging is not None else 0,
            "sync_pause_s": transfer_start - pause_start,
            "sync_transfer_s": transfer_s,
            "seconds": time.perf_counter() - start,
        }
        if refused:
            r, exc = refused[0]
            raise WeightControlError(
                f"inference replica {r.index} refused a bucket of weight_version {version}; it "
                f"stays paused until it gets every bucket again: {exc}",
                exc.status,
            )
        return len(resumed) == len(targets) and all(resumed)

    async def _copy_bucket(self, r: Replica, version: int, refused: list[tuple[Replica, WeightControlError]]) -> bool:
        """``r`` copies the bucket in the staging buffer; False when it is gone or refused it
        (recorded in ``refused``): it stays paused and not current."""
        try:
            if not self.digest:
                return await self._reached(r, version, "update_weights", self.manifest_file, self.update_mode, version)
            answers: list[dict[str, Any]] = []
            ok = await self._reached(
                r, version, "update_weights", self.manifest_file, self.update_mode, version, True, answers=answers
            )
            for answer in answers:
                self.last_results.setdefault(r.index, {}).update(answer.get("digests", {}))
            return ok
        except WeightControlError as exc:
            log.error(
                "inference replica refused a bucket; it stays paused until it gets every bucket again",
                replica=r.index,
                weight_version=version,
                error=str(exc),
            )
            r.current = False
            refused.append((r, exc))
            return False
        finally:
            if self.staging is not None and self.staging.transport == "cuda_ipc":
                from atroposd.weights.cuda_ipc import ipc_collect

                ipc_collect()

    def close(self) -> None:
        """Unlink the staging buffer and remove the manifest."""
        try:
            if self.staging is not None:
                self.staging.close()
        finally:
            self.staging = None
            self._source = None
            try:
                self.manifest_file.unlink()
            except FileNotFoundError:
                pass


class ReloadSync(_PublishSync):
    """``reload``: weights written to ``state_dir/sync/v<N>/``; every replica loads them.

    ``bucket_bytes`` (several trainer ranks): written as shards, one bucket at a time from
    ``source_for(model)`` (``reload.write_sharded_sync_dir``); None: one ``model.safetensors``."""

    mode = "reload"

    def __init__(
        self,
        *,
        sync_dir: Path,
        control_socket: Path | None = None,
        control_sockets: Sequence[Path] | None = None,
        sync_every: int = 1,
        bucket_bytes: int | None = None,
        source_for: SourceFor = ModelSource,
    ) -> None:
        if bucket_bytes is not None and bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.sync_dir = sync_dir
        self.bucket_bytes = bucket_bytes
        self.source_for = source_for
        self._source: tuple[torch.nn.Module, TensorSource] | None = None
        self._set_sockets(
            control_sockets if control_sockets is not None else [control_socket] if control_socket is not None else []
        )
        self.sync_every = max(1, sync_every)
        self.version = 0
        self._since = 0
        self.current: Path | None = None

    async def _write(self, model: torch.nn.Module, version: int) -> Path:
        from atroposd.weights.reload import write_sharded_sync_dir, write_sync_dir

        if self.bucket_bytes is None:
            return await anyio.to_thread.run_sync(write_sync_dir, model, self.sync_dir, version)
        return await write_sharded_sync_dir(self.source(model), self.sync_dir, version, self.bucket_bytes, model=model)

    async def _publish(self, model: torch.nn.Module, version: int, targets: Sequence[Replica]) -> bool:
        from atroposd.weights.reload import prune_sync_dirs

        if self.current is None or self.version != version or not self.current.is_dir():
            # A replica catching up on the version already written loads that directory.
            self.current = await self._write(model, version)
        path = self.current
        self.version = version
        announce = getattr(self.source(model), "announce_reload", None)
        if announce is not None:  # several nodes: their first ranks have their replicas load it too
            await announce(path, version)
        if not self.replicas:
            await anyio.to_thread.run_sync(prune_sync_dirs, self.sync_dir, path)
            return True

        async def one(r: Replica) -> bool:
            async with self._connected(r):
                return await self._update(r, version, 0, "load", path, version)

        done = await self._each(targets, one)
        await anyio.to_thread.run_sync(prune_sync_dirs, self.sync_dir, path)
        return all(done)

    def close(self) -> None:
        from atroposd.weights.reload import prune_sync_dirs

        prune_sync_dirs(self.sync_dir, None)
        self.current = None
        self._source = None


class BroadcastSync(_PublishSync):
    """``broadcast``: every replica gets the weights over a torch.distributed group of its own
    (gloo on the CPU, NCCL on GPUs), bucket by bucket (SPEC §7; ``atroposd.weights.broadcast``).

    A sync (``attach``, ``after_step`` every ``sync_every`` steps, ``reattach``): pause every
    target → form the group of each target that has none (fresh store prefix, bounded by
    ``form_timeout``; a group that does not form fails that replica's sync — logged, counted in
    ``form_failures`` — and it resumes with what it had) → each replica checks the whole plan
    (``receive``) → for each bucket: ``await source.gather(names)`` → pack it into one flat
    buffer → broadcast it on every live group, in parallel → next bucket → ``finish`` → resume
    every replica with the new version. The trainer's extra memory: the gathered bucket and its
    packed copy (two buckets), never a second model.

    Every bucket is gathered even when no replica is left (with several ranks each gather is a
    collective). A replica that dies or fails mid-broadcast is dropped from the sync, its group
    closed; it stays paused and not current (its server refuses to resume a mix) and gets every
    bucket again from the next sync or ``reattach``. A failure of the trainer itself (a rank lost
    during a gather) closes every group in flight and is raised; ``attach`` (a (re)formed trainer
    group) forms every replica's group afresh, ``reattach`` the restarted replica's.
    """

    mode = "broadcast"

    def __init__(
        self,
        *,
        nonce: str,
        control_socket: Path | None = None,
        control_sockets: Sequence[Path] | None = None,
        sync_every: int = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        source_for: SourceFor = ModelSource,
        backend: str = "gloo",
        device: torch.device | None = None,
        form_timeout: float = 60.0,
        digest: bool = False,
    ) -> None:
        from atroposd.weights.broadcast import BroadcastHub

        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self._set_sockets(
            control_sockets if control_sockets is not None else [control_socket] if control_socket is not None else []
        )
        self.hub = BroadcastHub(secret=nonce, backend=backend, device=device)
        self.sync_every = max(1, sync_every)
        self.bucket_bytes = bucket_bytes
        self.source_for = source_for
        self.form_timeout = form_timeout
        self.digest = digest  # ask the replicas for each tensor's sha256 (tests, benchmarks)
        self.groups: dict[int, Any] = {}
        self.version = 0
        self.form_failures = 0
        self.send_failures = 0
        self.formations = 0
        #: per replica: formations, form_failures, send_failures, last_transfer_s, last_bytes
        self.per_replica: dict[int, dict[str, float]] = {}
        #: the last sync: buckets, bytes, gather_s, pack_s, send_s, pause_s, seconds
        self.last_sync: dict[str, float] = {}
        #: the last sync's answer of each replica (``finish``), by replica index
        self.last_results: dict[int, dict[str, Any]] = {}
        self._since = 0
        self._source: tuple[torch.nn.Module, TensorSource] | None = None

    def _count(self, replica: int, key: str, add: float = 1.0, *, set_to: float | None = None) -> None:
        row = self.per_replica.setdefault(
            replica,
            {"formations": 0, "form_failures": 0, "send_failures": 0, "last_transfer_s": float("nan"), "last_bytes": 0},
        )
        row[key] = set_to if set_to is not None else row[key] + add

    def replica_status(self, replica: int) -> dict[str, Any]:
        """What ``status --json`` shows of ``replica``'s weight sync."""
        row = self.per_replica.get(replica, {})
        group = self.groups.get(replica)
        transfer = row.get("last_transfer_s", float("nan"))
        return {
            "mode": self.mode,
            "backend": self.hub.backend,
            "group": "formed" if group is not None else "none",
            "formation": group.formation if group is not None else None,
            "formations": int(row.get("formations", 0)),
            "form_failures": int(row.get("form_failures", 0)),
            "send_failures": int(row.get("send_failures", 0)),
            "last_transfer_s": None if transfer != transfer else round(transfer, 6),
        }

    def drop(self, replica: int) -> None:
        """Close ``replica``'s group (it is formed again at its next sync)."""
        group = self.groups.pop(replica, None)
        if group is not None:
            group.close()

    async def attach(self, model: torch.nn.Module, version: int) -> None:
        for i in list(self.groups):  # a (re)formed trainer group: every broadcast group afresh
            self.drop(i)
        await self._publish(model, version, self.replicas)

    async def reattach(self, model: torch.nn.Module, version: int, replica: int | None = None) -> None:
        for r in self._targets(replica):  # a restarted replica: its old group and weights are gone
            self.drop(r.index)
            r.version = None
        await self._publish(model, version, self._targets(replica))

    async def _form(self, r: Replica, version: int) -> bool:
        """``r``'s group, formed now unless it has one; False (logged, counted) when it does not
        form within ``form_timeout`` or the replica refuses to join."""
        if r.index in self.groups:
            return True
        prefix = self.hub.next_prefix(r.index)
        request = await anyio.to_thread.run_sync(
            lambda: self.hub.join_request(prefix, deadline_s=self.form_timeout, timeout_s=self.deadline)
        )
        formed: dict[str, Any] = {}
        joined: dict[str, Any] = {}
        gave_up: list[bool] = []  # the formation's thread stops waiting once this is not empty

        async def form() -> None:
            try:
                formed["group"] = await anyio.to_thread.run_sync(
                    lambda: self.hub.form(
                        prefix, deadline_s=self.form_timeout, timeout_s=self.deadline, cancelled=lambda: bool(gave_up)
                    )
                )
            except Exception as exc:
                formed["error"] = exc
                tg.cancel_scope.cancel()  # the join request is abandoned with it

        async def join() -> None:
            try:
                joined["answer"] = await self._call("broadcast", request, replica=r)
            except WeightControlError as exc:
                joined["error"] = exc
                gave_up.append(True)  # it will not join: the formation is given up

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(form)
                tg.start_soon(join)
        finally:
            gave_up.append(True)
        group = formed.get("group")
        if group is not None and "error" not in joined:
            self.groups[r.index] = group
            self.formations += 1
            self._count(r.index, "formations")
            log.info("broadcast group formed", replica=r.index, formation=prefix, backend=self.hub.backend)
            return True
        if group is not None:
            group.close()
        self.form_failures += 1
        self._count(r.index, "form_failures")
        error = joined.get("error") or formed.get("error") or "cancelled"
        log.error(
            "broadcast group did not form; this replica's sync failed, training goes on",
            replica=r.index,
            weight_version=version,
            deadline_s=self.form_timeout,
            failures=self.form_failures,
            error=str(error),
        )
        r.current = False
        return False

    async def _publish(self, model: torch.nn.Module, version: int, targets: Sequence[Replica]) -> bool:
        """Every bucket to ``targets``; True when every target took them all and resumed."""
        from atroposd.weights.broadcast import layout, pack, plan_body

        start = time.perf_counter()
        source = self.source(model)
        specs = source.specs()
        plan = plan_buckets(specs, self.bucket_bytes)
        if not plan:
            raise ValueError("the model has no tensors to broadcast")
        layouts = [layout([(n, specs[n]) for n in names]) for names in plan]
        gather_s = pack_s = send_s = 0.0
        moved = 0
        self.last_results = {}
        failed: list[Replica] = []
        async with AsyncExitStack() as stack:
            for r in targets:
                await stack.enter_async_context(self._connected(r))
            reached = await self._each(targets, lambda r: self._pause(r, version))
            paused = [r for r, ok in zip(targets, reached, strict=True) if ok]
            pause_s = time.perf_counter() - start
            formed = await self._each(paused, lambda r: self._form(r, version))
            for r, ok in zip(paused, formed, strict=True):
                if not ok:
                    await self._keep(r)
            live = [r for r, ok in zip(paused, formed, strict=True) if ok]
            body = {
                "op": "receive",
                "weight_version": version,
                "buckets": plan_body(specs, plan),
                "digest": self.digest,
            }
            form_s = time.perf_counter() - start - pause_s
            transfer_start = time.perf_counter()
            started = await self._each(live, lambda r: self._start_receive(r, version, body, failed))
            live = [r for r, ok in zip(live, started, strict=True) if ok]
            for r in live:
                r.current = False  # from its first bucket to its last it holds a mix
            buf: torch.Tensor | None = None
            try:
                for names, lay in zip(plan, layouts, strict=True):
                    t0 = time.perf_counter()
                    tensors = await source.gather(names)
                    gather_s += time.perf_counter() - t0
                    check_gathered(specs, names, tensors)
                    if live:
                        t0 = time.perf_counter()
                        buf = await anyio.to_thread.run_sync(pack, lay, tensors, buf)
                        pack_s += time.perf_counter() - t0
                        t0 = time.perf_counter()
                        sent = await self._send_all(live, buf[: lay.size], version, failed)
                        send_s += time.perf_counter() - t0
                        live = [r for r, ok in zip(live, sent, strict=True) if ok]
                        moved += lay.size
                    del tensors  # a gathered bucket is dropped before the next one is gathered
            except BaseException:
                # The trainer failed mid-stream (a rank lost in a gather): every group in flight
                # holds a half-sent sync; closing them frees the replicas' receivers at once.
                for r in live:
                    self.drop(r.index)
                    r.current = False
                raise
            finally:
                buf = None
            finished = await self._each(live, lambda r: self._finish(r, version, failed))
            live = [r for r, ok in zip(live, finished, strict=True) if ok]
            transfer_s = time.perf_counter() - transfer_start
            for r in live:
                self._count(r.index, "last_transfer_s", set_to=transfer_s)
                self._count(r.index, "last_bytes", set_to=moved)
            resumed = await self._each(live, lambda r: self._resume(r, version)) if live else []
        self.version = version
        # sync_pause_s / sync_transfer_s: metrics.jsonl's split of the sync (the replicas' pause
        # before the first byte; the stream from the plan's check to the last replica's finish)
        self.last_sync = {
            "buckets": len(plan),
            "bytes": moved,
            "gather_s": gather_s,
            "pack_s": pack_s,
            "send_s": send_s,
            "pause_s": pause_s,
            "form_s": form_s,
            "transfer_s": transfer_s,
            "sync_pause_s": pause_s,
            "sync_transfer_s": transfer_s,
            "seconds": time.perf_counter() - start,
            "staging_bytes": max(lay.size for lay in layouts),
        }
        return len(resumed) == len(targets) and all(resumed)

    async def _start_receive(self, r: Replica, version: int, body: dict[str, Any], failed: list[Replica]) -> bool:
        try:
            return await self._reached(r, version, "broadcast", {**body, "formation": self.groups[r.index].formation})
        except WeightControlError as exc:
            log.error(
                "inference replica refused a broadcast; it keeps what it had",
                replica=r.index,
                weight_version=version,
                error=str(exc),
            )
            self.drop(r.index)
            failed.append(r)
            with anyio.CancelScope(shield=True):
                await self._keep(r)
            return False

    async def _keep(self, r: Replica) -> None:
        """``r``'s sync failed before any byte moved: it serves what it had, or (it never got
        the trainer's weights: a fresh or restarted server) stays paused until a sync reaches it."""
        if r.version is not None:
            await self._resume(r, r.version)
        r.current = False

    async def _send_all(
        self, live: Sequence[Replica], chunk: torch.Tensor, version: int, failed: list[Replica]
    ) -> list[bool]:
        return await self._each(live, lambda r: self._send(r, chunk, version, failed))

    async def _send(self, r: Replica, buf: torch.Tensor, version: int, failed: list[Replica]) -> bool:
        group = self.groups.get(r.index)
        if group is None:
            return False
        try:
            await anyio.to_thread.run_sync(group.broadcast, buf)
            return True
        except Exception as exc:
            self.send_failures += 1
            self._count(r.index, "send_failures")
            log.warning(
                "broadcast to an inference replica failed; it is skipped and gets the weights when it is back",
                replica=r.index,
                weight_version=version,
                error=f"{type(exc).__name__}: {exc}",
            )
            self.drop(r.index)
            r.current = False
            failed.append(r)
            return False

    async def _finish(self, r: Replica, version: int, failed: list[Replica]) -> bool:
        group = self.groups.get(r.index)
        if group is None:
            return False
        try:
            answer = await self._call(
                "broadcast", {"op": "finish", "formation": group.formation, "weight_version": version}, replica=r
            )
        except WeightControlError as exc:
            log.error(
                "inference replica did not complete a broadcast; it stays paused until it gets every bucket again",
                replica=r.index,
                weight_version=version,
                error=str(exc),
            )
            self.drop(r.index)
            r.current = False
            failed.append(r)
            return False
        self.last_results[r.index] = answer
        return True

    def close(self) -> None:
        for i in list(self.groups):
            self.drop(i)
        self.hub.close()
        self._source = None

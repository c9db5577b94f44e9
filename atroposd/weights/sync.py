"""Trainer-side weight sync: ``shared``, ``push``, ``reload`` and ``broadcast`` (SPEC §7).

``make_weight_sync(cfg, nonce=..., control_sockets=[...], source_for=...)`` picks the mode from
``cfg.weight_sync``. Every mode has the same shape (:class:`WeightSync`), which the training loop
uses without knowing the mode::

    await sync.attach(model, version)        # once, before the optimizer is built
    for step ...:
        loss.backward()
        async with sync.paused(version + 1):  # shared: generation paused around the step
            optimizer.step()
        version += 1
        report = await sync.after_step(model, version)  # push / reload / broadcast: every sync_every steps
    ...
    await sync.reattach(model, version, i)   # after inference replica i restarted
    sync.close()                             # release everything (segments, manifest, sync dir)

``after_step`` returns the sync's report (:data:`~atroposd.weights.replicas.SyncReport`: the
replicas' pause and the transfer apart, bytes, buckets, the gathers' time, ...) when the step
synced, None when it did not; the trainer records it in metrics.jsonl.

Each mode is a small class of its own module that holds one
:class:`~atroposd.weights.replicas.Replicas` (pause, resume, update, the fan-out over every
replica, what each holds) and adds only what is its own:

* ``shared`` (:class:`SharedSync`, :mod:`.sync_arena`): ``attach`` moves the model's tensors
  into POSIX shm segments (CUDA buffers on a GPU) in place and asks every replica to map them;
  the replicas compute on the trainer's memory. ``paused`` = ``/pause`` → step →
  ``/resume {weight_version}``, so every response carries exactly one version.
* ``push`` (:class:`PushSync`, :mod:`.sync_arena`): the same exported buffers (the trainer
  trains in them, so nothing is staged); every ``sync_every`` steps each replica copies them
  into its own weights while paused, directly or through a pinned host staging buffer
  (``push_paths``).
* bucketed ``push`` (:class:`BucketPushSync`, :mod:`.sync_buckets`; several trainer ranks: the
  parameters are shards, so the trainer cannot train in an exported buffer): every replica is
  paused, then bucket by bucket (``sync_bucket_mb``) the weights are gathered from a
  :class:`~atroposd.weights.source.TensorSource`, written into one staging buffer and copied by
  every replica; then every replica resumes with the new version.
* ``reload`` (:class:`ReloadSync`, :mod:`.sync_reload`): every ``sync_every`` steps the weights
  are written to ``{state_dir}/sync/`` (in shards with several ranks) and every replica loads
  them while paused.
* ``broadcast`` (:class:`BroadcastSync`, :mod:`.sync_broadcast`, any rank count): the same
  bucket stream, sent over a torch.distributed group the trainer forms with each replica (gloo
  on the CPU, NCCL on GPUs; :mod:`atroposd.weights.broadcast`).

The tensors the bucketed modes send come from ``source_for(model)``, given to the factory: the
trainer's own function (with several ranks, a source that gathers the shards on every rank).

Every call goes to every inference replica (SPEC §12.2), in parallel, one connection per
replica; a sync waits for each replica it reaches. If a replica is unreachable (it died and is
being restarted, or its engine is still loading) its pause, resume or update is skipped with a
warning: the restarted server starts paused (``--await-weights``) and gets the current weights
from ``reattach(..., replica)`` before it serves again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from atroposd.weights.replicas import (
    DEFAULT_DEADLINE,
    MIN_DEADLINE,
    Replica,
    Replicas,
    SyncReport,
    pause_request,
    sockets_of,
    sync_deadline,
)
from atroposd.weights.source import DEFAULT_BUCKET_BYTES, ModelSource, SourceFor
from atroposd.weights.sync_arena import PUSH_PATHS, PushSync, SharedSync
from atroposd.weights.sync_broadcast import BroadcastSync
from atroposd.weights.sync_buckets import BucketPushSync
from atroposd.weights.sync_reload import ReloadSync

if TYPE_CHECKING:
    from atroposd.config import Config

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_DEADLINE",
    "MIN_DEADLINE",
    "PUSH_PATHS",
    "REMOTE_ONLY",
    "BroadcastSync",
    "BucketPushSync",
    "PushSync",
    "ReloadSync",
    "Replica",
    "Replicas",
    "SharedSync",
    "SourceFor",
    "SyncReport",
    "WeightSync",
    "make_weight_sync",
    "push_paths",
    "replica_sync_status",
    "sync_deadline",
]

# ``reattach(..., REMOTE_ONLY)``: no replica of this node; every bucket is still gathered, so the
# other nodes' first ranks feed theirs (SPEC §12.3).
REMOTE_ONLY = -1


class WeightSync(Protocol):
    mode: str

    async def attach(self, model: torch.nn.Module, version: int) -> None: ...
    def paused(self, new_version: int | None = None) -> AbstractAsyncContextManager[Any]: ...
    async def after_step(self, model: torch.nn.Module, version: int) -> SyncReport | None: ...
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
    ``bucket_bytes`` (default 512 MiB) at a time; ``shared`` is refused. ``source_for``: the
    trainer's function giving a model's :class:`~atroposd.weights.source.TensorSource` (default
    :class:`ModelSource`), what the bucketed modes and ``broadcast`` send."""
    from atroposd.paths import Paths

    paths = Paths.of(cfg)
    mode = cfg.weight_sync
    sync_every = int(cfg.trainer.sync_every)
    sockets = sockets_of(control_socket, control_sockets)
    sync: SharedSync | PushSync | BucketPushSync | ReloadSync | BroadcastSync
    buckets = int(bucket_bytes) if bucket_bytes is not None else DEFAULT_BUCKET_BYTES
    sources = source_for if source_for is not None else ModelSource
    deadline = sync_deadline(float(getattr(cfg.trainer, "stall_timeout", 0.0)))
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
        sync = BroadcastSync(
            nonce=nonce,
            control_sockets=sockets,
            sync_every=sync_every,
            bucket_bytes=buckets,
            source_for=sources,
            backend=backend,
            device=device,
            form_timeout=min(float(cfg.trainer.join_timeout), deadline),
            store_dir=Paths.of(cfg).runtime_dir,
        )
    else:
        raise ValueError(f"unknown weight_sync mode {mode!r}")
    sync.deadline = deadline
    # in-flight updates (SPEC §7): how every replica's pause treats the generations in flight
    sync.replicas.pause_body = pause_request(
        str(getattr(cfg.trainer, "inflight", "keep")), str(getattr(cfg.trainer, "inflight_kv", "recompute"))
    )
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


def replica_sync_status(sync: object, replica: int) -> dict[str, Any]:
    """Replica ``replica``'s weight sync as ``status --json`` shows it: the mode it got, and for
    ``push`` its path, for ``broadcast`` its group (formed or not, formations and failures, the
    last transfer)."""
    inner = getattr(sync, "inner", sync)
    describe = getattr(inner, "replica_status", None)
    if describe is not None:
        out: dict[str, Any] = describe(replica)
        return out
    return {"mode": str(getattr(inner, "mode", "?"))}

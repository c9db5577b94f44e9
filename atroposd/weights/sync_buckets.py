"""The bucketed ``push`` (SPEC §7, §12.1): the weights stream to the replicas a bucket at a time
through one staging buffer (several trainer ranks, and push's ``host_staging`` replicas)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import torch

from atroposd.logs import get_logger
from atroposd.weights.client import WeightControlError
from atroposd.weights.manifest import BucketRef, Manifest, manifest_path, process_start_time
from atroposd.weights.replicas import (
    Cadence,
    OnReplicas,
    Replica,
    Replicas,
    SyncReport,
    sockets_of,
    unpaused,
)
from atroposd.weights.source import (
    DEFAULT_BUCKET_BYTES,
    ModelSource,
    SourceCache,
    SourceFor,
    bucket_bytes_of,
    check_gathered,
    plan_buckets,
)

if TYPE_CHECKING:
    from atroposd.weights.staging import StagingBuffer

__all__ = ["BucketPushSync"]

log = get_logger("atroposd.weights.sync")


class BucketPushSync(OnReplicas):
    """``push`` with several trainer ranks: the weights stream to every replica in buckets.

    A sync (``attach``, ``after_step`` every ``sync_every`` steps, ``reattach``): pause every
    target replica → for each bucket of at most ``bucket_bytes`` (:func:`plan_buckets`):
    ``await source.gather(names)`` → write it into the one staging buffer
    (:class:`~atroposd.weights.staging.StagingBuffer`, sized for the largest bucket, reused for
    every bucket and every sync) → every replica copies that bucket, in parallel (an
    ``update_weights`` whose manifest names the bucket: the served version does not change) →
    next bucket → resume every replica with the new version. The trainer's model stays in its
    own memory (nothing is moved into exported buffers); its extra memory for a sync is the
    staging buffer plus whatever the source allocates for the bucket it gathered. The source is
    ``source_for(model)`` (made once per model).

    Every bucket is gathered even when no replica is left to take it: with several ranks each
    gather is a collective the other ranks take part in, so rank 0 never leaves one out.

    A replica that is down is skipped (``Replicas.reached``). A replica that dies or refuses a
    bucket halfway holds a mix of versions: it is marked not current and left paused (its server
    also refuses to resume before a complete set arrived), and it gets every bucket again from
    the next sync or from ``reattach`` before it serves. A refusal is raised once the others
    resumed.

    ``replicas``: the :class:`Replicas` to feed when they are another mode's (push's
    ``host_staging`` replicas), instead of ``control_sockets``.
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
        replicas: Replicas | None = None,
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
        self.replicas = replicas if replicas is not None else Replicas(sockets_of(control_socket, control_sockets))
        self.cadence = Cadence(sync_every)
        self.bucket_bytes = bucket_bytes
        self.source = SourceCache(source_for)
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
        self.last_sync: SyncReport = {}
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

    async def attach(self, model: torch.nn.Module, version: int) -> None:
        await self.publish(model, version, self.replicas)

    async def reattach(self, model: torch.nn.Module, version: int, replica: int | None = None) -> None:
        """Every bucket again, to ``replica`` only (None: every replica)."""
        await self.publish(model, version, self.replicas.targets(replica))

    def paused(self, new_version: int | None = None) -> AbstractAsyncContextManager[None]:
        return unpaused(new_version)

    async def after_step(self, model: torch.nn.Module, version: int) -> SyncReport | None:
        """Every ``sync_every`` steps: every bucket to every replica; the sync's report."""
        if not self.cadence.due():
            return None
        if await self.publish(model, version, self.replicas):
            self.cadence.done()
        return self.last_sync

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

    def write_bucket(
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

    async def publish(self, model: torch.nn.Module, version: int, targets: Sequence[Replica]) -> bool:
        """Every bucket to ``targets``; True when every target took them all and resumed."""
        reps = self.replicas
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
                await stack.enter_async_context(reps.connected(r))
                self.last_results.pop(r.index, None)
            pause_start = time.perf_counter()
            reached = await reps.each(targets, lambda r: reps.pause(r, version))
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
                        self.write_bucket, names, tensors, size, version, tied, lora, BucketRef(i, len(plan))
                    )
                    moved += sum(t.numel() * t.element_size() for t in tensors.values())
                del tensors  # a gathered bucket is dropped before the next one is gathered
                if live:
                    took = await reps.each(live, lambda r: self.copy_bucket(r, version, refused))
                    live = [r for r, ok in zip(live, took, strict=True) if ok]
            transfer_s = time.perf_counter() - transfer_start
            resumed = await reps.each(live, lambda r: reps.resume(r, version)) if live else []
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

    async def copy_bucket(self, r: Replica, version: int, refused: list[tuple[Replica, WeightControlError]]) -> bool:
        """``r`` copies the bucket in the staging buffer; False when it is gone or refused it
        (recorded in ``refused``): it stays paused and not current."""
        reps = self.replicas
        try:
            if not self.digest:
                return await reps.reached(r, version, "update_weights", self.manifest_file, self.update_mode, version)
            answers: list[dict[str, Any]] = []
            ok = await reps.reached(
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
            self.source.forget()
            try:
                self.manifest_file.unlink()
            except FileNotFoundError:
                pass

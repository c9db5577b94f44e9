"""The first trainer rank of a node other than the head feeds that node's inference replicas
(SPEC §12.3, Weights).

After a gather every rank holds the full tensors of the bucket, so no weights cross the
network for a push: rank 0 announces each bucket of a push (its index, the bucket count and the
new ``weight_version``) with the ``gather`` command, and on every other node the first local
rank does with its copy what rank 0 does on the head (:class:`~atroposd.weights.sync.BucketPushSync`):
bucket 0 pauses the node's replicas, each bucket is written into this process's one staging
buffer and copied by every replica, the last bucket resumes them with the new version. The
buffer, its manifest and its checks are the head's: a replica of this node accepts only the
manifests of its own node's launch (``ATROPOSD_INSTANCE``).

A replica that cannot take a bucket stays paused and not current (its server also refuses to
resume before a complete set), exactly as on the head; a failure here is logged and never
breaks the trainer group's collectives: the node's daemon asks the head for a full push when
a replica restarts.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import anyio
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal

from atroposd.logs import get_logger
from atroposd.weights.client import WeightControlError
from atroposd.weights.manifest import BucketRef, TensorSpec
from atroposd.weights.replicas import Replica
from atroposd.weights.source import bucket_bytes_of, plan_buckets
from atroposd.weights.sync_buckets import BucketPushSync

__all__ = ["NODE_REPLICAS_VAR", "NodeFeed"]

log = get_logger(__name__)

# The node's replicas' weight-control sockets, comma-separated (set by the node's daemon on its
# first local trainer rank only).
NODE_REPLICAS_VAR = "ATROPOSD_NODE_REPLICAS"
SUMMARY_EVERY = 100  # pushes between two summary lines in the log


class NodeFeed:
    """This node's replicas, fed from the buckets this rank gathers anyway."""

    def __init__(
        self,
        *,
        nonce: str,
        weights_dir: Path,
        sockets: Sequence[Path | str],
        specs: Mapping[str, TensorSpec],
        tied: Mapping[str, str],
        bucket_bytes: int,
    ) -> None:
        self.sync = BucketPushSync(
            nonce=nonce, weights_dir=weights_dir, control_sockets=[Path(s) for s in sockets], bucket_bytes=bucket_bytes
        )
        self.tied = dict(tied)
        plan = plan_buckets(specs, bucket_bytes)
        self.size = max(bucket_bytes_of(specs, names) for names in plan) if plan else 0
        self._live: list[Replica] = []
        self._version: int | None = None
        self._portal_cm = start_blocking_portal()
        self.portal: BlockingPortal = self._portal_cm.__enter__()
        self.pushes = 0
        #: seconds each complete push spent here (pause, write, copies, resume; the gathers excluded)
        self.feed_seconds: list[float] = []
        self._spent = 0.0

    @classmethod
    def from_environ(
        cls, weights_dir: Path, specs: Mapping[str, TensorSpec], tied: Mapping[str, str], bucket_bytes: int
    ) -> NodeFeed | None:
        """The feed of this process when its daemon named the node's replicas; else None."""
        sockets = [s for s in os.environ.get(NODE_REPLICAS_VAR, "").split(",") if s]
        nonce = os.environ.get("ATROPOSD_INSTANCE", "")
        if not sockets or not nonce:
            return None
        return cls(
            nonce=nonce, weights_dir=weights_dir, sockets=sockets, specs=specs, tied=tied, bucket_bytes=bucket_bytes
        )

    def replica_versions(self) -> list[int | None]:
        return self.sync.replica_versions()

    def bucket(
        self, names: Sequence[str], tensors: Mapping[str, torch.Tensor], *, index: int, count: int, version: int
    ) -> None:
        """Bucket ``index`` of ``count`` of the push of ``version`` to every replica of this node.
        Never raises: a replica that misses a bucket stays paused until the next full push."""
        t0 = time.perf_counter()
        if index == 0:
            self._spent = 0.0
        try:
            self.portal.call(self._bucket, list(names), dict(tensors), index, count, version)
            self._spent += time.perf_counter() - t0
            if index == count - 1:
                self.feed_seconds.append(self._spent)
                if len(self.feed_seconds) % SUMMARY_EVERY == 0:
                    self._summary()
        except Exception as exc:
            log.error(
                "feeding this node's inference replicas failed; they get the weights again from the next push",
                weight_version=version,
                bucket=index,
                error=f"{type(exc).__name__}: {exc}",
            )
            for r in self._live:
                r.current = False
            self._live = []

    async def _bucket(
        self, names: list[str], tensors: dict[str, torch.Tensor], index: int, count: int, version: int
    ) -> None:
        s, reps = self.sync, self.sync.replicas
        if index == 0 or self._version != version:
            if index != 0:
                log.warning(
                    "a push began without its first bucket; this node's replicas wait for the next one",
                    weight_version=version,
                    bucket=index,
                )
                self._live, self._version = [], version
                return
            self._version = version
            reached = await reps.each(reps, lambda r: reps.pause(r, version))
            self._live = [r for r, ok in zip(reps, reached, strict=True) if ok]
            for r in self._live:
                r.current = False
        if self._live:
            await anyio.to_thread.run_sync(
                s.write_bucket, names, tensors, self.size, version, self.tied, None, BucketRef(index, count)
            )
            refused: list[tuple[Replica, WeightControlError]] = []
            took = await reps.each(self._live, lambda r: s.copy_bucket(r, version, refused))
            self._live = [r for r, ok in zip(self._live, took, strict=True) if ok]
        if index == count - 1:
            if self._live:
                await reps.each(self._live, lambda r: reps.resume(r, version))
                self.pushes += 1
                log.debug(
                    "this node's inference replicas took the weights",
                    weight_version=version,
                    replicas=[r.index for r in self._live],
                )
            self._live, self._version = [], None

    def load(self, path: Path, version: int) -> None:
        """``reload``: every replica of this node loads ``version`` from ``path`` (a directory
        on the shared file system). Never raises."""
        try:
            self.portal.call(self._load, path, version)
        except Exception as exc:
            log.error(
                "this node's inference replicas did not load the weights; they get them from the next sync",
                weight_version=version,
                path=str(path),
                error=f"{type(exc).__name__}: {exc}",
            )

    async def _load(self, path: Path, version: int) -> None:
        reps = self.sync.replicas
        await reps.each(reps, lambda r: reps.update(r, version, 0, "load", path, version))

    def _summary(self) -> None:
        f = self.feed_seconds
        if f:
            log.info(
                "this node's replicas were fed",
                pushes=len(f),
                mean_s=round(statistics.fmean(f), 5),
                median_s=round(statistics.median(f), 5),
                max_s=round(max(f), 5),
                staging_bytes=self.sync.staging.size if self.sync.staging is not None else 0,
            )

    def close(self) -> None:
        """Unlink the staging buffer and the manifest; stop the event loop thread."""
        self._summary()
        try:
            self.sync.close()
        finally:
            self._portal_cm.__exit__(None, None, None)

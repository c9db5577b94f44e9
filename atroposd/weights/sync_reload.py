"""``reload`` (SPEC §7): every ``sync_every`` steps the weights are written to
``{state_dir}/sync/v<N>/`` (:mod:`atroposd.weights.reload`, in the layout of
:mod:`atroposd.weights.syncdir`) and every replica loads that directory while paused."""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import anyio
import torch

from atroposd.weights.replicas import (
    Cadence,
    OnReplicas,
    Replica,
    Replicas,
    SyncReport,
    sockets_of,
    unpaused,
)
from atroposd.weights.source import ModelSource, SourceCache, SourceFor
from atroposd.weights.syncdir import prune_sync_dirs

__all__ = ["ReloadSync"]


class ReloadSync(OnReplicas):
    """``reload``: weights written to ``state_dir/sync/v<N>/``; every replica loads them.

    ``bucket_bytes`` (several trainer ranks): written as shards, one bucket at a time from
    ``source_for(model)`` (``reload.write_sharded_sync_dir``); None: one ``model.safetensors``.
    Without replicas (no inference of this job's own) the directory is still written, for a
    server elsewhere to load."""

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
        self.source = SourceCache(source_for)
        self.replicas = Replicas(sockets_of(control_socket, control_sockets))
        self.cadence = Cadence(sync_every)
        self.version = 0
        self.current: Path | None = None

    def replica_status(self, replica: int) -> dict[str, str]:
        """What ``status --json`` shows of ``replica``'s weight sync: the mode."""
        return {"mode": self.mode}

    async def attach(self, model: torch.nn.Module, version: int) -> None:
        await self.publish(model, version, self.replicas)

    async def reattach(self, model: torch.nn.Module, version: int, replica: int | None = None) -> None:
        """The version written last again, to ``replica`` only (None: every replica)."""
        await self.publish(model, version, self.replicas.targets(replica))

    def paused(self, new_version: int | None = None) -> AbstractAsyncContextManager[None]:
        return unpaused(new_version)

    async def after_step(self, model: torch.nn.Module, version: int) -> SyncReport | None:
        """Every ``sync_every`` steps: write ``version`` and every replica loads it; the sync's
        report (its ``seconds``)."""
        if not self.cadence.due():
            return None
        start = time.perf_counter()
        if await self.publish(model, version, self.replicas):
            self.cadence.done()
        return {"seconds": time.perf_counter() - start}

    async def _write(self, model: torch.nn.Module, version: int) -> Path:
        from atroposd.weights.reload import write_sharded_sync_dir, write_sync_dir

        if self.bucket_bytes is None:
            return await anyio.to_thread.run_sync(write_sync_dir, model, self.sync_dir, version)
        return await write_sharded_sync_dir(self.source(model), self.sync_dir, version, self.bucket_bytes, model=model)

    async def publish(self, model: torch.nn.Module, version: int, targets: Sequence[Replica]) -> bool:
        """Write ``version`` (unless written already) and let ``targets`` load it; True when
        every target did."""
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
        reps = self.replicas

        async def one(r: Replica) -> bool:
            async with reps.connected(r):
                return await reps.update(r, version, 0, "load", path, version)

        done = await reps.each(targets, one)
        await anyio.to_thread.run_sync(prune_sync_dirs, self.sync_dir, path)
        return all(done)

    def close(self) -> None:
        prune_sync_dirs(self.sync_dir, None)
        self.current = None
        self.source.forget()

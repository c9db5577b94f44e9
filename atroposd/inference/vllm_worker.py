"""The vLLM worker extension (``worker_extension_cls``): runs inside each vLLM worker process and
loads the trainer's weights through vLLM's checkpoint-format reload (SPEC §7).

:mod:`atroposd.inference.vllm_engine` names it to vLLM by its qualified name
(``WORKER_EXTENSION``) and reaches it with ``collective_rpc``; only strings cross the RPC.

* a whole export (``atroposd_reload_from_manifest``: shared memory or CUDA IPC, checked against
  the exporter's checksums) or a ``reload`` directory (``atroposd_reload_from_file``): one
  ``reload_weights(..., is_checkpoint_format=True)``;
* a bucketed push (``atroposd_load_bucket``) and a broadcast (``atroposd_broadcast_*``): vLLM's
  streamed layerwise reload, started at bucket 0 and finished at the last one;
* aliases such as a tied ``lm_head`` are pointed at the new tensors after every reload.

The module imports no vLLM at import time.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from atroposd.logs import get_logger

if TYPE_CHECKING:
    from atroposd.weights.manifest import Manifest

__all__ = ["AtroposdWorkerExtension"]

log = get_logger(__name__)


class AtroposdWorkerExtension:
    """Mixed into vLLM's worker class; runs inside the worker process.

    Method names are prefixed so that they never collide with a worker attribute (vLLM
    asserts that). Arguments are JSON strings.
    """

    # The bucketed push this worker is streaming in: (weight_version, buckets, next bucket; -1
    # when only a new push can follow), None when none is under way.
    _atroposd_stream: tuple[int, int, int] | None = None

    def atroposd_reload_from_manifest(self, manifest_json: str) -> str:
        """Read every tensor of an export and reload it in checkpoint format.

        Returns a JSON ``{"tensors": n, "bytes": b}``.
        """
        from atroposd.weights.manifest import Manifest

        manifest = Manifest.from_json(manifest_json.encode())
        manifest.check_layout()
        weights, total = _read_export(manifest)
        self._atroposd_reload(weights)
        weights.clear()
        _release_cuda(manifest)
        return orjson.dumps({"tensors": len(manifest.tensors), "bytes": total}).decode()

    def atroposd_load_bucket(self, manifest_json: str) -> str:
        """Load one bucket of a bucketed push through vLLM's streamed checkpoint-format reload,
        the one its own chunked weight transfer uses: bucket 0 starts it
        (``initialize_layerwise_reload``), each bucket's tensors (copies, read and checked
        before anything is loaded) go through ``model.load_weights``, and the last bucket
        finishes it (``finalize_layerwise_reload``). vLLM keeps, per layer, what arrived until the
        layer has every part, so a fused parameter (``qkv_proj``, ``gate_up_proj``) whose parts
        lie in different buckets is processed once, whole. Between the first and the last bucket
        the layers not yet loaded hold no weights: the engine neither serves nor probes then.

        Returns a JSON ``{"tensors": n, "bytes": b, "complete": bool}``.
        """
        from atroposd.weights.manifest import Manifest

        manifest = Manifest.from_json(manifest_json.encode())
        manifest.check_layout()
        if manifest.bucket is None:
            raise ValueError("not a bucket manifest")
        index, count = manifest.bucket.index, manifest.bucket.count
        push = (manifest.weight_version, count)
        if index > 0 and self._atroposd_stream != (*push, index):
            raise ValueError(
                f"bucket {index} of {count} of weight_version {manifest.weight_version}: this worker "
                f"has no push under way that it continues (it has {self._atroposd_stream}: "
                "(weight_version, buckets, next bucket)); a push starts again from bucket 0"
            )
        weights, total = _read_export(manifest)
        if index == 0:
            self._atroposd_end_stream(abandoned=True)
        # Until this bucket is in, the push cannot continue (a bucket loaded twice would count
        # twice in vLLM's per-layer tally): only a new push, from bucket 0, replaces it.
        self._atroposd_stream = (*push, -1)
        if index == 0:
            self._atroposd_begin_stream()
        self._atroposd_stream_load(weights)
        weights.clear()
        complete = index + 1 == count
        if complete:
            self._atroposd_end_stream(abandoned=False)
        else:
            self._atroposd_stream = (*push, index + 1)
        _release_cuda(manifest)
        return orjson.dumps({"tensors": len(manifest.tensors), "bytes": total, "complete": complete}).decode()

    def atroposd_reload_from_file(self, path: str) -> str:
        """Reload from a ``model.safetensors`` written by the trainer (``reload`` mode), or from
        the shards a ``model.safetensors.index.json`` lists."""
        from atroposd.weights.syncdir import read_tensors

        weights: list[tuple[str, Any]] = list(read_tensors(Path(path)))
        total = sum(t.numel() * t.element_size() for _, t in weights)
        self._atroposd_reload(weights)
        return orjson.dumps({"tensors": len(weights), "bytes": total}).decode()

    def _atroposd_reload(self, weights: list[Any]) -> None:
        """Every tensor of the model at once: vLLM's checkpoint-format reload."""
        self._atroposd_end_stream(abandoned=True)
        runner = self.model_runner  # type: ignore[attr-defined]
        self._atroposd_record_ties(runner.get_model())
        runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        self._atroposd_retie(runner.get_model())

    def _atroposd_begin_stream(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        self._atroposd_record_ties(model)
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            initialize_layerwise_reload(model)

    def _atroposd_stream_load(self, weights: list[Any]) -> None:
        import torch
        from vllm.config import set_current_vllm_config

        try:  # a multi-token-prediction model checks its weights are complete on each load
            from vllm.model_executor.model_loader.mtp_validation import (
                disable_mtp_completeness_check,
            )

            partial: Any = disable_mtp_completeness_check()
        except ImportError:
            partial = contextlib.nullcontext()
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        with set_current_vllm_config(self.vllm_config), partial, torch.no_grad():  # type: ignore[attr-defined]
            model.load_weights(iter(weights))

    def _atroposd_end_stream(self, *, abandoned: bool) -> None:
        """Finish the streamed reload under way, if any. ``abandoned``: its push never completed
        (a new push or a whole reload replaces it); vLLM puts back the layers it did not reach,
        and the caller loads every tensor anew."""
        stream = self._atroposd_stream
        if stream is None:
            return
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if abandoned:
            log.warning(
                "an incomplete bucketed push is abandoned",
                weight_version=stream[0],
                buckets=stream[1],
                arrived=stream[2],
            )
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model()
        self._atroposd_stream = None
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            finalize_layerwise_reload(model, self.vllm_config.model_config)  # type: ignore[attr-defined]
        self._atroposd_retie(model)
        # What vLLM's own reload_weights resets after a reload (state derived from the old weights).
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(runner, reset):
                getattr(runner, reset)()

    def _atroposd_record_ties(self, model: Any) -> None:
        if not hasattr(self, "_atroposd_tied"):
            # Recorded before the first reload, while vLLM's ties (lm_head ↔ embed_tokens) hold.
            self._atroposd_tied = _tied_groups(model)

    def _atroposd_retie(self, model: Any) -> None:
        # The layerwise reload gives every layer new parameters, which unties an alias such
        # as a tied lm_head (it would keep the old weights): point aliases at the new tensor.
        for owners in self._atroposd_tied:
            first_mod, first_attr = owners[0]
            param = first_mod._parameters[first_attr]
            for mod, attr in owners[1:]:
                mod._parameters[attr] = param
                # The alias's kernel state derived from the weight (the CPU backend packs the
                # tied lm_head for its GEMM) must be rebuilt from the new tensor as well.
                method = getattr(mod, "quant_method", None)
                if method is not None and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(mod)

    def atroposd_ping(self) -> str:
        return str(os.getpid())

    # ``weight_sync = "broadcast"`` (atroposd.weights.broadcast): each worker joins the trainer's
    # group (rank 1 + its own rank) and loads the buckets it receives through the same streamed
    # checkpoint-format reload as a bucketed push.

    def atroposd_broadcast_join(self, request_json: str) -> str:
        import torch

        from atroposd.weights.broadcast import BroadcastReceiver

        req = orjson.loads(request_json)
        receiver = getattr(self, "_atroposd_bcast", None)
        if receiver is None:
            receiver = self._atroposd_bcast = BroadcastReceiver(req["secret"])
        rank = 1 + int(getattr(self, "rank", 0))
        device = getattr(self, "device", None)
        out = receiver.join(
            req["join"],
            device if isinstance(device, torch.device) else torch.device("cpu"),
            rank=rank,
            world=int(req["world"]),
        )
        return orjson.dumps(out).decode()

    def atroposd_broadcast_leave(self) -> str:
        receiver = getattr(self, "_atroposd_bcast", None)
        if receiver is not None:
            receiver.leave()
        return "{}"

    def atroposd_broadcast_receive(self, plan_json: str) -> str:
        """Every bucket of one sync (the plan was checked by the engine): received, copied out
        of the receive buffer, streamed into the reload; the last one finishes it."""
        from atroposd.weights.broadcast import layout
        from atroposd.weights.manifest import TensorSpec

        req = orjson.loads(plan_json)
        receiver = getattr(self, "_atroposd_bcast", None)
        if receiver is None or receiver.group is None or receiver.group.formation != req["formation"]:
            raise ValueError(f"this worker is not in broadcast formation {req['formation']!r}")
        plan = [[(n, TensorSpec(d, tuple(shape))) for n, d, shape in bucket] for bucket in req["buckets"]]
        version, count = int(req["weight_version"]), len(plan)
        total = 0
        try:
            self._atroposd_end_stream(abandoned=True)
            for index, bucket in enumerate(plan):
                lay = layout(bucket)
                views = receiver.receive_views(lay)
                weights = [(name, t.clone()) for name, t in views.items()]  # vLLM may hold them until a layer is whole
                del views
                self._atroposd_stream = (version, count, -1)
                if index == 0:
                    self._atroposd_begin_stream()
                self._atroposd_stream_load(weights)
                weights.clear()
                total += lay.size
                self._atroposd_stream = (version, count, index + 1)
            self._atroposd_end_stream(abandoned=False)
        except BaseException:
            receiver.leave()  # the trainer's end fails at once instead of waiting
            raise
        return orjson.dumps({"tensors": sum(len(b) for b in plan), "bytes": total, "buckets": count}).decode()


def _read_export(manifest: Manifest) -> tuple[list[tuple[str, Any]], int]:
    """Every tensor a manifest names, copied out of the export into the worker's own memory (CPU
    for shm, this worker's GPU for CUDA IPC) and checked against the exporter's checksums;
    returns ``([(name, tensor)], bytes)``. Nothing of the model is touched."""
    import torch

    from atroposd.weights.shm import read_into
    from atroposd.weights.tensors import checksum, same_checksum, torch_dtype

    weights: list[tuple[str, Any]] = []
    total = 0
    if manifest.transport == "shm":
        by_seg: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for e in manifest.tensors:
            t = torch.empty(tuple(e.shape), dtype=torch_dtype(e.dtype))
            by_seg.setdefault(e.segment, []).append((e.offset, t))
            weights.append((e.name, t))
        for seg in manifest.segments:
            total += read_into(seg.name, seg.size, by_seg.get(seg.index, []))
    else:  # CUDA IPC: rebuild once, copy out, synchronise, drop before acknowledging
        from atroposd.weights.cuda_ipc import rebuild_segment

        # check_layout guarantees every segment's handle and GPU UUID.
        buffers = {
            s.index: rebuild_segment(s.handle, s.device_uuid)  # type: ignore[arg-type]
            for s in manifest.segments
        }
        # The copy lands on this worker's own device, whichever GPU the trainer exported from.
        own = torch.device("cuda", torch.cuda.current_device())
        for e in manifest.tensors:
            view = buffers[e.segment][e.offset : e.offset + e.nbytes].view(torch_dtype(e.dtype))
            weights.append((e.name, view.view(tuple(e.shape)).to(own, copy=True)))
            total += e.nbytes
        torch.cuda.synchronize()
        buffers.clear()
    for e, (name, t) in zip(manifest.tensors, weights, strict=True):
        if not same_checksum(e.checksum, checksum(t)):
            raise ValueError(f"tensor {name!r}: checksum differs from the exporter's")
    return weights, total


def _release_cuda(manifest: Manifest) -> None:
    """After a CUDA IPC export was copied: drop what still refers to it before answering."""
    if manifest.transport == "cuda_ipc":
        import gc

        import torch

        gc.collect()
        torch.cuda.synchronize()


def _tied_groups(model: Any) -> list[list[tuple[Any, str]]]:
    """Parameters shared between modules: [[(module, attr), ...] per shared Parameter], first owner first."""
    by_id: dict[int, list[tuple[Any, str]]] = {}
    for _name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None and (module, attr) not in by_id.setdefault(id(p), []):
                by_id[id(p)].append((module, attr))
    return [owners for owners in by_id.values() if len(owners) > 1]

"""The inference server's side of the weight exchange.

The inference server's control socket routes ``POST /update_weights`` and ``POST /load`` to
its engine, and the torch engine calls :func:`apply_update` / :func:`load_dir` with the
request body. The caller must guarantee that no forward pass runs meanwhile (the trainer
pauses generation around every update: ``/pause`` → update → ``/resume``).

Requests
--------

``POST /update_weights``::

    {"manifest": "/run/atroposd/weights/manifest-<nonce>.json",   # required, exactly this launch's
     "mode": "attach" | "copy",                                     # required
     "weight_version": 17}                                          # optional; must match the manifest

* ``attach`` (``shared`` mode): map every segment (read-only) and rebind the model's tensors to
  views of the trainer's memory. The mappings live in ``state`` until the next attach, a
  ``copy``, or :meth:`ReceiverState.release`.
* a **bucket** (the bucketed ``push`` of several trainer ranks; the manifest's ``bucket`` is
  ``{"index": i, "count": n}``, mode ``copy``): copy the tensors the bucket names, each checked
  first (known to the model, same dtype and shape; checksums after the copy). Buckets arrive
  in order 0..n-1 with one ``weight_version``; the last one must complete the model (every
  tensor of it in some bucket). Until a complete set arrived the model holds a mix of versions:
  ``ReceiverState.incomplete()`` says so and the server refuses to resume. The served version
  is unchanged by a bucket: it changes with ``/resume``. A bucket's staging segment is mapped
  read-only once and kept in ``state.sources`` (every bucket of every sync uses the same one).
* ``copy`` (``push`` mode): copy every tensor into the model's own memory. POSIX shm segments
  are mapped read-only once per export and kept in ``state.sources`` while the trainer keeps
  exporting the same segments (the trainer trains in them; each sync is then one memory copy,
  and a sync maps nothing new); they are unmapped when the export's segments change, on an
  ``attach`` or ``load``, and by :meth:`ReceiverState.release`. A CUDA export is likewise
  rebuilt once and its mapping held for the export's life (``state.imports``: one
  rebuild/release cycle per export, SPEC §7); each sync copies from it, synchronises and drops
  its views before answering; the mapping is released when the trainer's export changes and by
  :meth:`ReceiverState.release`.

``POST /load``::

    {"path": "<state_dir>/sync/v17", "weight_version": 17}         # both required

reads ``model.safetensors`` of a directory written by the trainer (``reload`` mode), or the
shards that ``model.safetensors.index.json`` lists (several trainer ranks), checked and read
through :mod:`atroposd.weights.syncdir`.

Every request is validated completely before any model memory is touched: manifest
provenance (nonce, live exporter pid + start time, owner, mode), dtypes (allow-list, equal
to the model's), shapes, bounds, no tensor missing and none extra. Checksums recorded by the
exporter are verified after the transfer. A bad request raises :class:`WeightUpdateError`
(a ``ValueError``; the server answers 400 with its message) and leaves the model as it was.

Each call returns ``{"weight_version", "mode", "tensors", "bytes", "export_id"}``.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from atroposd.logs import get_logger
from atroposd.weights import syncdir
from atroposd.weights.control import UPDATE_MODES, LoadWeights, UpdateWeights
from atroposd.weights.manifest import Manifest, ManifestError, TensorSpec
from atroposd.weights.protocol import WeightUpdateError
from atroposd.weights.shm import ShmError, ShmSegment
from atroposd.weights.syncdir import read_tensors, sync_shards
from atroposd.weights.tensors import (
    ModelTensors,
    checksum,
    ensure_lora,
    match_tensors,
    model_tensors,
    same_checksum,
    torch_dtype,
)

if TYPE_CHECKING:
    from atroposd.config import Config
    from atroposd.weights.cuda_ipc import CudaImports

#: what the CPU push's mirror was laid out for: the export's segments (name, size), and each
#: model tensor's (name, segment, offset) in it
MirrorKey = tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int, int], ...]]

__all__ = [
    "BucketProgress",
    "CheckedUpdate",
    "ReceiverState",
    "WeightUpdateError",
    "apply_update",
    "check_update",
    "inspect_sync_dir",
    "load_dir",
    "other_gpu",
    "sync_shards",
]

log = get_logger(__name__)


@dataclass
class BucketProgress:
    """A bucketed push under way: buckets ``0..next-1`` of ``count`` of ``weight_version`` copied,
    covering the model's tensors ``covered``.

    Every engine applies a bucket the same way (the order and completeness checks live here,
    once): ``progress = state.next_bucket(manifest)`` (order) → check the bucket's tensors →
    ``state.buckets = progress`` before the model is touched → apply → ``progress.cover(...)``
    (completeness at the last bucket) → ``state.bucket_applied(manifest, progress)``.
    """

    weight_version: int
    count: int
    next: int = 0
    covered: set[str] = field(default_factory=set)

    def cover(self, manifest: Manifest, filled: Iterable[str], model: Collection[str]) -> bool:
        """Record the model's tensors bucket ``manifest`` fills; True when it is the last bucket,
        which must complete the model (every name of ``model`` in some bucket, else a
        :class:`WeightUpdateError` naming the missing ones)."""
        assert manifest.bucket is not None
        self.covered.update(filled)
        if manifest.bucket.index + 1 != manifest.bucket.count:
            return False
        missing = sorted(set(model) - self.covered)
        if missing:
            raise WeightUpdateError(
                f"the {self.count} buckets of weight_version {manifest.weight_version} did not "
                f"hold every tensor of the model: {', '.join(repr(m) for m in missing)} missing"
            )
        return True


@dataclass
class ReceiverState:
    """What an inference process keeps between weight updates.

    nonce: the daemon's per-launch nonce (``ATROPOSD_INSTANCE``); only its manifests are used.
    weights_dir: ``{runtime_dir}/weights``; the only place a manifest is read from.
    sync_dir: ``{state_dir}/sync``; the only place ``load`` reads from (None: anywhere given).
    """

    nonce: str
    weights_dir: Path
    sync_dir: Path | None = None
    segments: list[Any] = field(default_factory=list)
    # push mode: read-only mappings of the trainer's export, kept across syncs of one export
    sources: dict[str, ShmSegment] = field(default_factory=dict)
    # host staging on a GPU: the sources whose pages are registered with CUDA
    pinned: set[str] = field(default_factory=set)
    # push mode on CPU: the model's own tensors laid out like the export (one flat private
    # buffer per segment), so that a sync is one contiguous copy per segment
    mirror_key: MirrorKey | None = None
    mirror: dict[str, torch.Tensor] = field(default_factory=dict)
    export_id: int | None = None
    weight_version: int | None = None
    # a bucketed push that started and has not completed: the model holds a mix of versions
    buckets: BucketProgress | None = None
    # CUDA IPC: the trainer's exports, each rebuilt once and held for its life (a CudaImports)
    imports: CudaImports | None = None

    @classmethod
    def from_config(cls, cfg: Config, nonce: str | None = None) -> ReceiverState:
        from atroposd.paths import Paths

        paths = Paths.of(cfg)
        nonce = nonce or os.environ.get("ATROPOSD_INSTANCE", "")
        return cls(nonce=nonce, weights_dir=paths.weights_dir, sync_dir=paths.sync_dir)

    @property
    def attached(self) -> bool:
        return bool(self.segments)

    def incomplete(self) -> str | None:
        """Why the model must not serve (a bucketed push stopped halfway), or None."""
        b = self.buckets
        if b is None:
            return None
        return (
            f"the weights are incomplete: {b.next} of the {b.count} buckets of weight_version {b.weight_version} "
            "arrived, so the model holds a mix of versions; every bucket must arrive before generation resumes"
        )

    def next_bucket(self, manifest: Manifest) -> BucketProgress:
        """The push bucket ``manifest`` belongs to (not yet recorded in ``buckets``): a new one
        for bucket 0, else the push under way, of which it must be the next bucket (same
        ``weight_version`` and count); a :class:`WeightUpdateError` otherwise."""
        if manifest.bucket is None:
            raise WeightUpdateError("not a bucket manifest")
        index, count = manifest.bucket.index, manifest.bucket.count
        if index == 0:
            return BucketProgress(manifest.weight_version, count)
        progress = self.buckets
        if (
            progress is None
            or progress.weight_version != manifest.weight_version
            or progress.count != count
            or progress.next != index
        ):
            expected = (
                "bucket 0 (no bucketed push is under way)"
                if progress is None
                else f"bucket {progress.next} of {progress.count} of weight_version {progress.weight_version}"
            )
            raise WeightUpdateError(
                f"bucket {index} of {count} of weight_version {manifest.weight_version} arrived "
                f"out of order: expected {expected}; a push starts again from bucket 0"
            )
        return progress

    def bucket_applied(self, manifest: Manifest, progress: BucketProgress) -> bool:
        """Bucket ``manifest`` is in the model; True when it completed the push (the model then
        holds ``weight_version`` throughout and may serve again)."""
        assert manifest.bucket is not None
        progress.next = manifest.bucket.index + 1
        if progress.next < progress.count:
            return False
        self.buckets = None
        self.weight_version = manifest.weight_version
        return True

    def cuda_imports(self) -> CudaImports:
        """The :class:`~atroposd.weights.cuda_ipc.CudaImports` of this process (made at first use)."""
        if self.imports is None:
            from atroposd.weights.cuda_ipc import CudaImports

            self.imports = CudaImports()
        return self.imports

    def release(self, model: torch.nn.Module | None = None) -> None:
        """Drop every mapping. With ``model``, first give its tensors private copies."""
        self.release_sources()
        if not self.segments:
            self._release_imports()
            return
        if model is not None:
            _privatize(model, self.segments)
        gc.collect()
        for seg in self.segments:
            if isinstance(seg, ShmSegment):
                seg.close()  # raises ShmError naming the segment if a view is still alive
        if any(not isinstance(s, ShmSegment) for s in self.segments):
            torch.cuda.synchronize()
        self.segments = []
        self.export_id = None
        gc.collect()
        self._release_imports()

    def _release_imports(self) -> None:
        if self.imports is not None and len(self.imports):
            torch.cuda.synchronize()
            self.imports.release()

    def release_sources(self) -> None:
        """Unmap the push-mode copy sources (no model tensor ever views them)."""
        self.mirror_key = None  # the model keeps its mirror buffers as its own memory
        self.mirror = {}
        sources, self.sources = self.sources, {}
        pinned, self.pinned = self.pinned, set()
        for name, seg in sources.items():
            if name in pinned:
                from atroposd.weights.staging import unpin_host

                unpin_host(seg)
            seg.close()

    def pin_sources(self) -> None:
        """A replica on a GPU fed through host staging: page-lock the mapped sources once, so
        that its host-to-device copies run as DMA. A platform that refuses it copies unpinned."""
        from atroposd.weights.staging import pin_host

        for name, seg in self.sources.items():
            if name in self.pinned or not isinstance(seg, ShmSegment):
                continue
            try:
                pin_host(seg, read_only=True)
            except RuntimeError as exc:
                log.warning(
                    "host staging: the source's pages could not be pinned; copying unpinned",
                    segment=name,
                    error=str(exc),
                )
            else:
                self.pinned.add(name)


def _privatize(model: torch.nn.Module, segments: list[Any]) -> None:
    mt = model_tensors(model)
    for name, t in list(mt.tensors.items()):
        if any(_owns(seg, t) for seg in segments):
            mt.rebind(name, t.detach().clone())


def _owns(seg: object, t: torch.Tensor) -> bool:
    if isinstance(seg, ShmSegment):
        return seg.owns(t)
    if isinstance(seg, torch.Tensor):
        base = seg.data_ptr()
        return t.device == seg.device and base <= t.data_ptr() < base + seg.numel()
    return False


ModelTargets = Callable[[Manifest], "tuple[Mapping[str, TensorSpec], Mapping[str, str]]"]


@dataclass(frozen=True)
class CheckedUpdate:
    """A weight update that passed every check, before any model memory is touched.

    ``source``: the model's tensor name → the exported one it is filled from (the whole model,
    or the tensors a bucket fills). ``progress``: for a bucket, the push it belongs to, already
    checked to be in order (and, for the last bucket, complete); the engine records it in
    ``state.buckets`` before it touches the model and calls ``state.bucket_applied`` after."""

    request: UpdateWeights
    manifest: Manifest
    source: dict[str, str]
    progress: BucketProgress | None = None

    @property
    def mode(self) -> str:
        return self.request.mode


def check_update(
    request: UpdateWeights | Mapping[str, object],
    state: ReceiverState,
    targets: ModelTargets,
    *,
    engine: str = "torch",
    modes: Collection[str] = UPDATE_MODES,
    note: str = "",
    ready: Callable[[], None] | None = None,
) -> CheckedUpdate:
    """The one check of ``POST /update_weights`` that every engine calls (SPEC §7).

    In order: the body (:class:`~atroposd.weights.control.UpdateWeights`); the engine takes its
    ``mode`` (``modes``; ``note`` says why not); this server has a launch nonce; ``ready()`` (the
    engine's own precondition, such as a pause); the manifest's provenance
    (:meth:`Manifest.load`: this launch's, a live exporter, in ``state.weights_dir``); its
    ``weight_version`` equals the request's; a bucket is copied and arrives in order
    (:meth:`ReceiverState.next_bucket`); every tensor against ``targets(manifest)`` (the
    engine's tensors and aliases: names, dtypes, shapes; nothing missing, nothing extra — or,
    for a bucket, each one known, and the last bucket completing the model). Anything wrong is
    a :class:`WeightUpdateError` naming it, and nothing was changed."""
    body = UpdateWeights.parse(request)
    if body.mode not in modes:
        takes = (
            "only copies weights (mode 'copy')"
            if tuple(modes) == ("copy",)
            else f"takes weights with mode {' or '.join(map(repr, modes))} only"
        )
        raise WeightUpdateError(f"the {engine} engine {takes}, got {body.mode!r}{note}")
    if not state.nonce:
        raise WeightUpdateError("this server has no launch nonce (ATROPOSD_INSTANCE); it cannot accept weights")
    if ready is not None:
        ready()
    try:
        manifest = Manifest.load(Path(body.manifest), expected_nonce=state.nonce, weights_dir=state.weights_dir)
    except ManifestError as exc:
        raise WeightUpdateError(str(exc)) from None
    if body.weight_version is not None and body.weight_version != manifest.weight_version:
        raise WeightUpdateError(
            f"manifest holds weight_version {manifest.weight_version}, the request says "
            f"{body.weight_version}: stale manifest refused"
        )
    if manifest.bucket is None:
        try:
            expected, tied = targets(manifest)
            return CheckedUpdate(body, manifest, manifest.check_against(expected, tied))
        except ManifestError as exc:
            raise WeightUpdateError(str(exc)) from None
    if body.mode != "copy":
        raise WeightUpdateError(f"a bucket of a bucketed push is copied (mode 'copy'), not {body.mode!r}")
    index, count = manifest.bucket.index, manifest.bucket.count
    progress = state.next_bucket(manifest)
    try:
        expected, tied = targets(manifest)
        filled = manifest.check_bucket(expected, tied)
    except ManifestError as exc:
        raise WeightUpdateError(f"bucket {index} of {count}: {exc}") from None
    progress.cover(manifest, filled, expected)
    return CheckedUpdate(body, manifest, filled, progress)


def apply_update(
    model: torch.nn.Module, request: UpdateWeights | Mapping[str, object], *, state: ReceiverState
) -> dict[str, Any]:
    """Attach to or copy from the export a manifest describes (see the module docstring), once
    :func:`check_update` passed it against the model's own tensors."""

    def targets(manifest: Manifest) -> tuple[dict[str, TensorSpec], dict[str, str]]:
        ensure_lora(model, manifest.lora)
        if manifest.bucket is not None and state.segments:
            state.release(model)  # leave shared mode: the model gets its own memory back
        mt = model_tensors(model)
        return mt.specs(), mt.tied

    checked = check_update(request, state, targets)
    manifest, source, mode = checked.manifest, checked.source, checked.mode
    if checked.progress is not None:
        out = _apply_bucket(model, checked, state)
        filled = out.pop("filled")
        if checked.request.digest:  # the sha256 of each tensor the bucket filled, as the model holds it
            from atroposd.weights.tensors import tensor_digest

            mt = model_tensors(model)
            out["digests"] = {n: tensor_digest(mt.tensors[n]) for n in filled}
        return out
    mt = model_tensors(model)
    device = next(iter(mt.tensors.values())).device
    if manifest.transport == "cuda_ipc" and device.type != "cuda":
        raise WeightUpdateError("a CUDA IPC export needs a model on a GPU")
    if mode == "attach" and manifest.transport == "cuda_ipc":
        from atroposd.weights.cuda_ipc import device_uuid

        problem = other_gpu(manifest, device_uuid(device))
        if problem is not None:
            raise WeightUpdateError(problem)
    if mode == "attach":
        moved = _attach(model, manifest, source, state, device, mt)
    else:
        moved = _copy(model, manifest, source, state, device, mt)
    state.weight_version = manifest.weight_version
    state.buckets = None
    log.info(
        "weights updated",
        mode=mode,
        weight_version=manifest.weight_version,
        export_id=manifest.export_id,
        tensors=len(source),
        bytes=moved,
    )
    return {
        "weight_version": manifest.weight_version,
        "mode": mode,
        "tensors": len(source),
        "bytes": moved,
        "export_id": manifest.export_id,
    }


def _apply_bucket(model: torch.nn.Module, checked: CheckedUpdate, state: ReceiverState) -> dict[str, Any]:
    """Copy one bucket of a bucketed push (see the module docstring), checked by
    :func:`check_update`; from the first copied bucket on, ``state.buckets`` records the push
    until its last bucket completed the model."""
    manifest, source, progress = checked.manifest, checked.source, checked.progress
    assert manifest.bucket is not None and progress is not None
    index, count = manifest.bucket.index, manifest.bucket.count
    mt = model_tensors(model)
    device = next(iter(mt.tensors.values())).device
    if manifest.transport == "cuda_ipc" and device.type != "cuda":
        raise WeightUpdateError("a CUDA IPC export needs a model on a GPU")
    state.buckets = progress  # from here on the model holds a mix until the last bucket
    with torch.no_grad():
        if manifest.transport == "shm":
            _open_sources(manifest, state)
            if device.type == "cuda":
                state.pin_sources()
            for mine, src in source.items():
                e = manifest.entry(src)
                mapped = state.sources[manifest.segment(e.segment).name]
                v = mapped.view(e.offset, e.nbytes, torch_dtype(e.dtype), tuple(e.shape))
                mt.tensors[mine].copy_(v)
                del v
        else:
            mapped_cuda = _map_segments(manifest, state)
            try:
                for mine, src in source.items():
                    e = manifest.entry(src)
                    mt.tensors[mine].copy_(
                        _view(mapped_cuda[e.segment], e.offset, e.nbytes, torch_dtype(e.dtype), tuple(e.shape))
                    )
                torch.cuda.synchronize()
            finally:
                mapped_cuda.clear()  # the views go; the mapping stays for the export's life
    total = sum(manifest.entry(src).nbytes for src in set(source.values()))
    for mine, src in source.items():
        e = manifest.entry(src)
        if not same_checksum(e.checksum, checksum(mt.tensors[mine])):
            raise WeightUpdateError(
                f"tensor {mine!r}: checksum after the copy differs from the exporter's "
                "(the export changed during the copy?)"
            )
    complete = state.bucket_applied(manifest, progress)
    log.debug(
        "bucket copied",
        bucket=index,
        buckets=count,
        weight_version=manifest.weight_version,
        tensors=len(source),
        bytes=total,
    )
    return {
        "weight_version": manifest.weight_version,
        "mode": "copy",
        "tensors": len(source),
        "bytes": total,
        "export_id": manifest.export_id,
        "bucket": index,
        "buckets": count,
        "complete": complete,
        "filled": list(source),
    }


def other_gpu(manifest: Manifest, own_uuid: str) -> str | None:
    """Why the server cannot compute on this CUDA IPC export in place (shared mode needs the
    trainer's buffers on the server's own physical GPU), or None when it can."""
    for seg in manifest.segments:
        if seg.device_uuid != own_uuid:
            return (
                f"shared mode needs the trainer and the inference server on the same physical GPU: segment "
                f"{seg.index} lives on {seg.device_uuid}, this server computes on {own_uuid}"
            )
    return None


def _map_segments(manifest: Manifest, state: ReceiverState) -> dict[int, Any]:
    """Every segment of ``manifest``: shm segments attached anew, CUDA exports through
    ``state``'s imports (rebuilt once per export, held for its life)."""
    mapped: dict[int, Any] = {}
    try:
        if manifest.transport != "shm":
            mapped = state.cuda_imports().map(manifest.segments)
            for seg in manifest.segments:
                if mapped[seg.index].numel() < seg.size:
                    raise WeightUpdateError(
                        f"CUDA segment {seg.index} is {mapped[seg.index].numel()} bytes; the manifest says {seg.size}"
                    )
            return mapped
        for seg in manifest.segments:
            mapped[seg.index] = ShmSegment.attach(seg.name, seg.size)
    except (ShmError, OSError) as exc:
        for m in mapped.values():
            if isinstance(m, ShmSegment):
                m.close()
        raise WeightUpdateError(str(exc)) from None
    return mapped


def _view(
    mapped: ShmSegment | torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    if isinstance(mapped, ShmSegment):
        return mapped.view(offset, nbytes, dtype, shape)
    view: torch.Tensor = mapped[offset : offset + nbytes].view(dtype).view(shape)
    return view


def _attach(
    model: torch.nn.Module,
    manifest: Manifest,
    source: Mapping[str, str],
    state: ReceiverState,
    device: torch.device,
    mt: ModelTensors,
) -> int:
    if manifest.transport == "shm" and device.type != "cpu":
        raise WeightUpdateError("attach to POSIX shared memory needs a model on the CPU")
    state.release_sources()
    mapped = _map_segments(manifest, state)
    views: dict[str, torch.Tensor] = {}
    problem: str | None = None
    for mine, src in source.items():
        e = manifest.entry(src)
        v = _view(mapped[e.segment], e.offset, e.nbytes, torch_dtype(e.dtype), tuple(e.shape))
        if not same_checksum(e.checksum, checksum(v)):
            problem = f"tensor {mine!r}: checksum of the mapped memory differs from the exporter's"
            break
        views[mine] = v
    v = None  # type: ignore[assignment]
    if problem is not None:
        views.clear()
        for m in mapped.values():
            if isinstance(m, ShmSegment):
                m.close()
        raise WeightUpdateError(problem)
    old = state.segments
    for mine, v in views.items():
        mt.rebind(mine, v)
    views.clear()
    # The previous export's mappings are no longer referenced by the model: release them.
    state.segments = []
    for seg in old:
        if isinstance(seg, ShmSegment):
            seg.close()
    state.segments = list(mapped.values())
    state.export_id = manifest.export_id
    if manifest.transport == "cuda_ipc":
        torch.cuda.synchronize()
    return sum(manifest.entry(s).nbytes for s in source.values())


def _copy(
    model: torch.nn.Module,
    manifest: Manifest,
    source: Mapping[str, str],
    state: ReceiverState,
    device: torch.device,
    mt: ModelTensors,
) -> int:
    if state.segments:
        state.release(model)  # leave shared mode: the model gets its own memory back
        mt = model_tensors(model)
    # Group the destinations by segment. A destination the exporter ties to another one
    # (an importer that does not tie) is filled after its source.
    by_seg: dict[int, list[tuple[int, torch.Tensor]]] = {}
    later: list[tuple[str, str]] = []
    first_of: dict[str, str] = {}
    staging: list[tuple[torch.Tensor, torch.Tensor]] = []
    for mine, src in source.items():
        if src in first_of:
            later.append((mine, first_of[src]))
            continue
        first_of[src] = mine
        e = manifest.entry(src)
        dst = mt.tensors[mine]
        if manifest.transport == "shm":
            if dst.device.type != "cpu" or not dst.is_contiguous():
                tmp = torch.empty(tuple(e.shape), dtype=dst.dtype, pin_memory=dst.device.type == "cuda")
                staging.append((tmp, dst))
                dst = tmp
            by_seg.setdefault(e.segment, []).append((e.offset, dst.data))
    total = 0
    if manifest.transport == "shm" and not staging and not later:
        return _copy_mirrored(manifest, source, state, mt)
    if manifest.transport == "shm":
        wanted = {seg.name: seg.size for seg in manifest.segments if seg.index in by_seg}
        if {n: s.size for n, s in state.sources.items()} != wanted:
            state.release_sources()
            try:
                for seg in manifest.segments:
                    if seg.index in by_seg:
                        state.sources[seg.name] = ShmSegment.attach(seg.name, seg.size)
            except (ShmError, OSError) as exc:
                state.release_sources()
                raise WeightUpdateError(str(exc)) from None
        with torch.no_grad():
            for seg in manifest.segments:
                src_seg = state.sources.get(seg.name)
                for offset, dst in by_seg.get(seg.index, []):
                    v = src_seg.view(  # type: ignore[union-attr]
                        offset, dst.numel() * dst.element_size(), dst.dtype, tuple(dst.shape)
                    )
                    dst.copy_(v)
                    total += v.numel() * v.element_size()
                    del v
            for tmp, dst in staging:
                dst.copy_(tmp, non_blocking=False)
    else:
        mapped = _map_segments(manifest, state)
        try:
            with torch.no_grad():
                for mine, src in source.items():
                    if first_of[src] != mine:
                        continue
                    e = manifest.entry(src)
                    v = _view(mapped[e.segment], e.offset, e.nbytes, torch_dtype(e.dtype), tuple(e.shape))
                    mt.tensors[mine].copy_(v)
                    total += e.nbytes
                    del v
            torch.cuda.synchronize()
        finally:
            mapped.clear()  # the views go; the mapping stays for the export's life
    with torch.no_grad():
        for mine, first in later:
            mt.tensors[mine].copy_(mt.tensors[first])
    for mine, src in source.items():
        e = manifest.entry(src)
        if not same_checksum(e.checksum, checksum(mt.tensors[mine])):
            raise WeightUpdateError(
                f"tensor {mine!r}: checksum after the copy differs from the exporter's "
                "(the export changed during the copy?)"
            )
    return total


def _open_sources(manifest: Manifest, state: ReceiverState) -> None:
    wanted = {seg.name: seg.size for seg in manifest.segments}
    if {n: s.size for n, s in state.sources.items()} == wanted:
        return
    state.release_sources()
    try:
        for seg in manifest.segments:
            state.sources[seg.name] = ShmSegment.attach(seg.name, seg.size)
    except (ShmError, OSError) as exc:
        state.release_sources()
        raise WeightUpdateError(str(exc)) from None


def _copy_mirrored(manifest: Manifest, source: Mapping[str, str], state: ReceiverState, mt: ModelTensors) -> int:
    """CPU push: copy each exported segment in one piece into a private mirror of it.

    The first copy of an export moves the model's tensors into private flat buffers laid out
    exactly like the export (same offsets); later syncs of the same export are then one
    contiguous memory copy per segment, the floor of a copy.
    """
    _open_sources(manifest, state)
    key = (
        tuple((s.name, s.size) for s in manifest.segments),
        tuple(sorted((mine, manifest.entry(src).segment, manifest.entry(src).offset) for mine, src in source.items())),
    )
    fresh = state.mirror_key != key or any(
        not _inside(mt.tensors[mine], state.mirror.get(manifest.segment(manifest.entry(src).segment).name))
        for mine, src in source.items()
    )
    total = 0
    with torch.no_grad():
        if fresh:
            mirror = {seg.name: torch.empty(seg.size, dtype=torch.uint8) for seg in manifest.segments}
            for seg in manifest.segments:
                whole = state.sources[seg.name].view(0, seg.size, torch.uint8, (seg.size,))
                mirror[seg.name].copy_(whole)
                del whole
            for mine, src in source.items():
                e = manifest.entry(src)
                buf = mirror[manifest.segment(e.segment).name]
                mt.rebind(mine, buf[e.offset : e.offset + e.nbytes].view(torch_dtype(e.dtype)).view(tuple(e.shape)))
            state.mirror, state.mirror_key = mirror, key
        else:
            for seg in manifest.segments:
                whole = state.sources[seg.name].view(0, seg.size, torch.uint8, (seg.size,))
                state.mirror[seg.name].copy_(whole)
                del whole
        total = sum(seg.size for seg in manifest.segments)
    for mine, src in source.items():
        e = manifest.entry(src)
        if not same_checksum(e.checksum, checksum(mt.tensors[mine])):
            raise WeightUpdateError(
                f"tensor {mine!r}: checksum after the copy differs from the exporter's "
                "(the export changed during the copy?)"
            )
    return total


def _inside(t: torch.Tensor, buf: torch.Tensor | None) -> bool:
    if buf is None or t.device.type != "cpu":
        return False
    return buf.data_ptr() <= t.data_ptr() < buf.data_ptr() + buf.numel()


# ---------------------------------------------------------------------------- reload mode


def inspect_sync_dir(
    path: str | os.PathLike[str], weight_version: int | None, state: ReceiverState | None
) -> tuple[Path, int, dict[str, TensorSpec], dict[str, str], dict[str, Any] | None]:
    """Check a reload directory without loading tensors (:func:`atroposd.weights.syncdir.inspect_sync_dir`).

    With ``state``, the directory must lie in ``state.sync_dir``; its ``weight_version`` must
    equal ``weight_version`` when that is given.
    """
    within = state.sync_dir if state is not None else None
    return syncdir.inspect_sync_dir(path, weight_version, within)


LoadTargets = Callable[["Mapping[str, Any] | None"], "tuple[Mapping[str, TensorSpec], Mapping[str, str]] | None"]


@dataclass(frozen=True)
class CheckedLoad:
    """A reload directory that passed every check, before any tensor is read: ``file`` (the
    weights file or the shards' index), its ``weight_version``, the tensors it holds, the
    model's tensor name → the exported one (empty for a LoRA adapter the engine serves as one),
    and its LoRA metadata."""

    request: LoadWeights
    file: Path
    weight_version: int
    exported: dict[str, TensorSpec]
    source: dict[str, str]
    lora: dict[str, Any] | None


def check_load(
    request: LoadWeights | Mapping[str, object],
    state: ReceiverState | None,
    targets: LoadTargets,
    *,
    ready: Callable[[], None] | None = None,
) -> CheckedLoad:
    """The one check of ``POST /load`` that every engine calls: the body
    (:class:`~atroposd.weights.control.LoadWeights`), ``ready()`` (the engine's precondition),
    the directory (:func:`inspect_sync_dir`: in ``state.sync_dir``, its format and
    ``weight_version``), then its tensors against ``targets(lora)`` — the engine's tensors and
    aliases, or None when the engine serves the directory's LoRA adapter as an adapter."""
    body = LoadWeights.parse(request)
    if ready is not None:
        ready()
    file, version, exported, tied, lora = inspect_sync_dir(body.path, body.weight_version, state)
    try:
        mine = targets(lora)
        source = {} if mine is None else match_tensors(exported, tied, mine[0], mine[1])
    except ManifestError as exc:
        raise WeightUpdateError(str(exc)) from None
    return CheckedLoad(body, file, version, exported, source, lora)


def load_dir(
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    *,
    weight_version: int | None = None,
    state: ReceiverState | None = None,
) -> dict[str, Any]:
    """Load a directory the trainer wrote for ``reload`` (``model.safetensors``, or the shards
    of ``model.safetensors.index.json``), once :func:`check_load` passed it.

    The metadata carries ``format`` and ``weight_version`` (which must equal ``weight_version``
    when given) and ``tied``. With ``state``, the directory must lie in ``state.sync_dir``.
    Every tensor is checked before any is copied; one tensor is read at a time.
    """

    def targets(lora: Mapping[str, Any] | None) -> tuple[dict[str, TensorSpec], dict[str, str]]:
        ensure_lora(model, lora)
        if state is not None:
            state.release(model)
        mt = model_tensors(model)
        return mt.specs(), mt.tied

    checked = check_load(LoadWeights(str(path), weight_version), state, targets)
    file, version, source = checked.file, checked.weight_version, checked.source
    mt = model_tensors(model)
    into: dict[str, list[str]] = {}
    for mine, src in source.items():
        into.setdefault(src, []).append(mine)
    total = 0
    with torch.no_grad():
        for src, t in read_tensors(file, into):
            for mine in into[src]:
                mt.tensors[mine].copy_(t)
            total += t.numel() * t.element_size()
            del t
    if state is not None:
        state.weight_version = version
        state.buckets = None
    log.info("weights loaded", path=str(file.parent), weight_version=version, tensors=len(source), bytes=total)
    return {"weight_version": version, "mode": "load", "tensors": len(source), "bytes": total, "export_id": None}

"""The trainer's parameter arena: a model's tensors moved into a few large exported buffers.

``ParameterArena.create(model, ...)`` lays every exchangeable tensor (see
:mod:`atroposd.weights.tensors`) out in one or a few flat buffers — POSIX shm segments on
CPU, CUDA allocations on GPU — 64-byte aligned, copies each tensor in and rebinds the model's
parameter to a view of its slot (in place: the Parameter objects, and so any optimizer built
on them, stay the same). From then on the trainer trains directly in exported memory:

* ``shared``: the inference server maps the same buffers and computes on views of them;
* ``push``: the server copies out of them at each sync (one copy, nothing staged).

``manifest(version)`` describes the current export; ``release()`` gives the model private
memory again (copies back), then unmaps and unlinks every buffer.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from atroposd.logs import get_logger
from atroposd.weights.manifest import (
    ALIGNMENT,
    Manifest,
    SegmentRef,
    TensorEntry,
    contiguous_stride,
)
from atroposd.weights.shm import ShmSegment, segment_name, segment_tag
from atroposd.weights.tensors import ModelTensors, checksum, dtype_name, lora_spec, model_tensors

__all__ = ["DEFAULT_SEGMENT_BYTES", "ParameterArena", "Slot", "plan_layout"]

log = get_logger(__name__)

# Segments are at most this large unless one tensor alone is larger (then it gets its own).
DEFAULT_SEGMENT_BYTES = 1 << 30


class Segment(Protocol):
    name: str
    size: int

    def view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor: ...
    def owns(self, t: torch.Tensor) -> bool: ...
    def close(self) -> None: ...
    def unlink(self) -> None: ...


@dataclass(frozen=True)
class Slot:
    name: str
    segment: int
    offset: int
    nbytes: int


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def plan_layout(sizes: dict[str, int], max_segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> tuple[list[Slot], list[int]]:
    """Pack named byte sizes into segments in order. Returns (slots, segment sizes)."""
    slots: list[Slot] = []
    seg_sizes: list[int] = []
    used = 0
    for name, nbytes in sizes.items():
        start = _align(used)
        if not seg_sizes or (start + nbytes > max_segment_bytes and used > 0):
            seg_sizes.append(0)
            start = 0
        slots.append(Slot(name, len(seg_sizes) - 1, start, nbytes))
        used = start + nbytes
        seg_sizes[-1] = max(_align(used), ALIGNMENT)
    return slots, seg_sizes


class ParameterArena:
    """A model whose tensors live in exported buffers (one export; see the module docstring)."""

    def __init__(
        self,
        *,
        nonce: str,
        transport: str,
        model: torch.nn.Module,
        tensors: ModelTensors,
        segments: list[Segment],
        slots: list[Slot],
    ) -> None:
        self.nonce = nonce
        self.transport = transport
        self.model = model
        self.tensors = tensors
        self.segments = segments
        self.slots = slots
        self.export_id = 0
        self._lora = lora_spec(model)
        self._start_time = _own_start_time()
        self._released = False

    @classmethod
    def create(
        cls, model: torch.nn.Module, *, nonce: str, max_segment_bytes: int = DEFAULT_SEGMENT_BYTES, first_index: int = 0
    ) -> ParameterArena:
        """Move ``model``'s tensors into new buffers (shm on CPU, CUDA IPC on GPU).

        Segments are numbered from ``first_index`` (``atroposd-<nonce>-<tag>-<n>``, one random
        ``tag`` per arena).
        """
        mt = model_tensors(model)
        devices = {t.device for t in mt.tensors.values()}
        if len(devices) != 1:
            raise ValueError(
                f"the model's tensors are on several devices ({sorted(map(str, devices))}); "
                "one device is required for weight exchange"
            )
        device = devices.pop()
        for name, t in mt.tensors.items():
            dtype_name(t.dtype)  # raises on a dtype that cannot be exchanged
            if t.requires_grad and t.grad is not None:
                raise ValueError(f"tensor {name!r} already has a gradient; attach before the first step")
        sizes = {n: t.numel() * t.element_size() for n, t in mt.tensors.items()}
        slots, seg_sizes = plan_layout(sizes, max_segment_bytes)
        transport = "shm" if device.type == "cpu" else "cuda_ipc"
        segments: list[Segment] = []
        tag = segment_tag()
        try:
            for i, size in enumerate(seg_sizes):
                if transport == "shm":
                    segments.append(ShmSegment.create(segment_name(nonce, first_index + i, tag), size))
                else:
                    from atroposd.weights.cuda_ipc import CudaSegment

                    segments.append(CudaSegment.allocate(f"cuda-{nonce}-{first_index + i}", size, device))
            for slot in slots:
                old = mt.tensors[slot.name]
                view = segments[slot.segment].view(slot.offset, slot.nbytes, old.dtype, tuple(old.shape))
                with torch.no_grad():
                    view.copy_(old.detach())
                mt.rebind(slot.name, view)
        except BaseException:
            # Undo: give the tensors private memory back, drop the buffers.
            for slot in slots:
                t = mt.tensors[slot.name]
                if any(_is_view_of(t, s) for s in segments):
                    mt.rebind(slot.name, t.detach().clone())
            for seg in segments:
                seg.close()
                seg.unlink()
            raise
        arena = cls(nonce=nonce, transport=transport, model=model, tensors=mt, segments=segments, slots=slots)
        log.info(
            "parameters moved into exported buffers",
            transport=transport,
            segments=len(segments),
            bytes=sum(seg_sizes),
            tensors=len(slots),
        )
        return arena

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def missing_segments(self) -> list[str]:
        """Segments whose name is gone from /dev/shm (someone removed them: our mapping still
        works, but no other process can attach any more)."""
        if self.transport != "shm":
            return []
        return [seg.name for seg in self.segments if not os.path.exists(os.path.join("/dev/shm", seg.name))]

    def synchronize(self) -> None:
        """Wait until the device has finished every kernel queued on the buffers (the optimizer's
        step: CUDA runs it asynchronously). A CPU arena's writes are done when the step returns."""
        if self.transport == "cuda_ipc":
            for seg in self.segments:
                seg.synchronize()  # type: ignore[attr-defined]

    def check_bound(self) -> None:
        """Raise if a tensor of the model no longer lives in the arena (e.g. ``model.to()``)."""
        current = model_tensors(self.model)
        for slot in self.slots:
            t = current.tensors.get(slot.name)
            if t is None or not _is_view_of(t, self.segments[slot.segment]):
                raise RuntimeError(
                    f"tensor {slot.name!r} was moved out of the exported buffers; the model must "
                    "not be re-allocated after attach"
                )

    def manifest(self, weight_version: int, *, with_checksums: bool = True, consumer: int = 0) -> Manifest:
        """Describe the current contents as export ``export_id`` (incremented per call); CUDA
        IPC: with ``consumer``'s handles (one export per consumer cycle, :meth:`new_cycle`)."""
        self.export_id += 1
        seg_refs = []
        for seg in self.segments:
            handle, uuid = (None, None)
            if self.transport == "cuda_ipc":
                handle, uuid = seg.export_handle(consumer)  # type: ignore[attr-defined]
            index = int(seg.name.rsplit("-", 1)[1])
            seg_refs.append(SegmentRef(index=index, name=seg.name, size=seg.size, handle=handle, device_uuid=uuid))
        entries = []
        for slot in self.slots:
            t = self.tensors.tensors[slot.name]
            entries.append(
                TensorEntry(
                    name=slot.name,
                    dtype=dtype_name(t.dtype),
                    shape=tuple(t.shape),
                    stride=contiguous_stride(tuple(t.shape)),
                    segment=seg_refs[slot.segment].index,
                    offset=slot.offset,
                    nbytes=slot.nbytes,
                    checksum=checksum(t) if with_checksums else None,
                )
            )
        return Manifest(
            nonce=self.nonce,
            exporter_pid=os.getpid(),
            exporter_start_time=self._start_time,
            export_id=self.export_id,
            weight_version=weight_version,
            transport=self.transport,
            segments=tuple(seg_refs),
            tensors=tuple(entries),
            tied=dict(self.tensors.tied),
            lora=self._lora,
            created_at=time.time(),
        )

    def new_cycle(self, consumer: int) -> None:
        """CUDA IPC: ``consumer`` (re)starts; the next manifest for it carries new exports."""
        if self.transport == "cuda_ipc":
            for seg in self.segments:
                seg.new_cycle(consumer)  # type: ignore[attr-defined]

    def release(self) -> None:
        """Copy the tensors back to private memory, then unmap and unlink every buffer."""
        if self._released:
            return
        self._released = True
        current = model_tensors(self.model)
        for slot in self.slots:
            t = current.tensors.get(slot.name)
            if t is not None and _is_view_of(t, self.segments[slot.segment]):
                current.rebind(slot.name, t.detach().clone())
        self.tensors = current
        errors: list[str] = []
        for seg in self.segments:
            try:
                seg.unlink()
            except OSError as exc:
                errors.append(f"{seg.name}: {exc}")
            try:
                seg.close()
            except OSError as exc:
                errors.append(f"{seg.name}: {exc}")
        self.segments = []
        if errors:
            raise RuntimeError("releasing the exported buffers failed: " + "; ".join(errors))
        log.info("exported buffers released", transport=self.transport)


def _is_view_of(t: torch.Tensor, seg: Segment) -> bool:
    owns = getattr(seg, "owns", None)
    if owns is not None:
        return bool(owns(t))
    return False


def _own_start_time() -> int:
    from atroposd.weights.manifest import process_start_time

    st = process_start_time(os.getpid())
    assert st is not None
    return st

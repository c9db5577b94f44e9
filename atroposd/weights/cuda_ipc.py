"""CUDA IPC transport: the GPU twin of :mod:`atroposd.weights.shm`.

Shaped exactly like the CPU path so the CPU tests cover the protocol: the trainer's arena
allocates a few flat ``uint8`` CUDA buffers (``CudaSegment``) instead of shm segments, and a
manifest segment carries ``handle`` (the fields of torch's ``reduce_tensor`` export as plain
JSON values, :class:`~atroposd.weights.manifest.CudaIpcHandle`: nothing is unpickled) and the
physical GPU's UUID instead of a segment name.

One export per rebuild/release cycle (SPEC §7). Every torch export of a storage wraps it in a
new reference-counted IPC entry (a counter set to 1 in the producer's ``/dev/shm/torch_*``
file), which the block's memory waits on when the producer frees it; each consumer rebuild of
that export takes the counter down by one when the rebuilt storage is released. So an export
pairs with exactly one consumer rebuild and one release: rebuilding the same export at every
sync drives the (unsigned) counter below zero and strands the block, and each rebuild opens
the export's IPC event anew. Hence:

* producer (:class:`CudaSegment`): ``export_handle(consumer)`` exports once per consumer
  cycle and hands the same handle out at every later sync of that consumer (each call still
  waits for the device); ``new_cycle(consumer)`` — a consumer that (re)starts — makes the next
  call export anew. The buffers (the trainer's parameters) stay alive for the arena's life; on
  close ``gc.collect()`` then ``torch.cuda.ipc_collect()``;
* consumer (:class:`CudaImports`): rebuild each export once and hold the mapping for the
  export's life, as the shm path keeps its segments mapped; at every sync copy (push) or
  compute on views (shared), ``torch.cuda.synchronize()``, drop the views, then acknowledge;
  the mapping is released when the producer's export changes, and on ``release``.

Handles only ever travel through the 0600 manifest in ``runtime_dir`` and the 0600 Unix
control socket. The GPU calls need a GPU (the tests marked ``gpu`` run them); the mapping
between torch's export tuple and the manifest's fields is tested on the CPU.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from typing import Any

import torch

from atroposd.weights.manifest import CudaIpcHandle, SegmentRef

__all__ = [
    "CudaImports",
    "CudaSegment",
    "device_index_for_uuid",
    "device_uuid",
    "handle_args",
    "handle_from_args",
    "ipc_collect",
    "rebuild_segment",
]

# torch.multiprocessing.reductions.reduce_tensor's arguments for rebuild_cuda_tensor:
# (tensor_cls, size, stride, tensor_offset, storage_cls, dtype, device, storage_handle,
#  storage_size_bytes, storage_offset_bytes, requires_grad, ref_counter_handle,
#  ref_counter_offset, event_handle, event_sync_required)
_REDUCE_FIELDS = 15


def handle_from_args(args: tuple[Any, ...]) -> CudaIpcHandle:
    """The manifest's fields of ``reduce_tensor(flat_uint8_buffer)[1]``; refuses anything but a
    whole contiguous ``uint8`` tensor (what the importer will rebuild)."""
    if len(args) != _REDUCE_FIELDS:
        raise RuntimeError(
            f"torch's reduce_tensor gave {len(args)} fields, expected {_REDUCE_FIELDS}: this torch "
            "version's CUDA IPC export is not supported"
        )
    (
        tensor_cls,
        size,
        stride,
        offset,
        storage_cls,
        dtype,
        _device,
        storage_handle,
        storage_size_bytes,
        storage_offset_bytes,
        requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    if (
        tensor_cls is not torch.Tensor
        or storage_cls is not torch.storage.TypedStorage
        or dtype != torch.uint8
        or len(size) != 1
        or tuple(stride) != (1,)
        or offset != 0
        or requires_grad
    ):
        raise RuntimeError("a CUDA IPC export must be a whole flat uint8 tensor")
    return CudaIpcHandle(
        numel=int(size[0]),
        storage_handle=bytes(storage_handle),
        storage_size_bytes=int(storage_size_bytes),
        storage_offset_bytes=int(storage_offset_bytes),
        ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=bytes(event_handle) if event_handle is not None else None,
        event_sync_required=bool(event_sync_required),
    )


def handle_args(handle: CudaIpcHandle, device_index: int) -> tuple[Any, ...]:
    """``rebuild_cuda_tensor``'s arguments for ``handle`` on this process's ``device_index``;
    the classes are the importer's own, never read from the manifest."""
    return (
        torch.Tensor,
        torch.Size([handle.numel]),
        (1,),
        0,
        torch.storage.TypedStorage,
        torch.uint8,
        device_index,
        handle.storage_handle,
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        False,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle,
        handle.event_sync_required,
    )


def device_uuid(device: torch.device) -> str:
    """The physical GPU UUID of ``device`` (stable across CUDA_VISIBLE_DEVICES remapping)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index_for_uuid(uuid: str) -> int:
    """This process's device index of the GPU with ``uuid``; raises if it is not visible."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise RuntimeError(f"GPU {uuid} is not visible to this process (CUDA IPC needs the same physical GPU)")


class CudaSegment:
    """One flat ``uint8`` CUDA buffer of ``size`` bytes that the trainer's tensors view."""

    def __init__(self, name: str, buffer: torch.Tensor) -> None:
        self.name = name
        self.size = int(buffer.numel())
        self.buffer: torch.Tensor | None = buffer
        # consumer → its cycle's export (handle, GPU UUID); ``exports``: torch exports made
        self._exports: dict[int, tuple[CudaIpcHandle, str]] = {}
        self.exports = 0

    @classmethod
    def allocate(cls, name: str, size: int, device: torch.device) -> CudaSegment:
        return cls(name, torch.empty(size, dtype=torch.uint8, device=device))

    def view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of ``shape`` over bytes ``[offset, offset + nbytes)`` of the buffer."""
        assert self.buffer is not None
        return self.buffer[offset : offset + nbytes].view(dtype).view(shape)

    def owns(self, t: torch.Tensor) -> bool:
        if self.buffer is None or t.device != self.buffer.device:
            return False
        base = self.buffer.data_ptr()
        return base <= t.data_ptr() < base + self.size

    def export_handle(self, consumer: int = 0) -> tuple[CudaIpcHandle, str]:
        """(handle, GPU UUID) of the buffer for ``consumer``, after the device finished every
        queued kernel: exported at the first call of the consumer's cycle, the same handle at
        every later one (see the module docstring)."""
        assert self.buffer is not None
        torch.cuda.synchronize(self.buffer.device)
        export = self._exports.get(consumer)
        if export is None:
            from torch.multiprocessing.reductions import reduce_tensor

            _rebuild, args = reduce_tensor(self.buffer)
            export = self._exports[consumer] = handle_from_args(tuple(args)), device_uuid(self.buffer.device)
            self.exports += 1
        return export

    def new_cycle(self, consumer: int = 0) -> None:
        """``consumer`` (re)starts: its next :meth:`export_handle` exports anew (the export it
        had is released by the process that rebuilt it, or went with that process)."""
        self._exports.pop(consumer, None)

    def synchronize(self) -> None:
        """Wait for every kernel queued on the buffer's device (the optimizer's step)."""
        if self.buffer is not None:
            torch.cuda.synchronize(self.buffer.device)

    def close(self) -> None:
        self.buffer = None
        self._exports.clear()
        ipc_collect()

    def unlink(self) -> None:
        """Nothing has a name on a GPU; kept for the segment protocol."""


def rebuild_segment(handle: CudaIpcHandle, uuid: str) -> torch.Tensor:
    """Consumer: rebuild the flat buffer of one export (call once per export).

    Returns: a ``uint8`` CUDA tensor of the segment's size on the local index of ``uuid``.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    tensor: torch.Tensor = rebuild_cuda_tensor(*handle_args(handle, device_index_for_uuid(uuid)))
    return tensor


def export_key(seg: SegmentRef) -> tuple[Any, ...]:
    """What tells one export from another: a new export of the same buffer has its own
    reference counter (file and offset)."""
    h = seg.handle
    assert h is not None
    return (seg.name, seg.device_uuid, h.storage_handle, h.ref_counter_handle, h.ref_counter_offset)


class CudaImports:
    """A consumer's mappings of the producer's CUDA IPC exports, by segment name: each export
    rebuilt once (``rebuild``: :func:`rebuild_segment`) and held for the export's life — every
    sync of that export reuses the mapping — and released when the producer's export of a
    segment changes (or the segment is gone from the export) and on :meth:`release`.
    ``rebuilds`` and ``releases`` count the cycles."""

    def __init__(self, rebuild: Callable[[CudaIpcHandle, str], torch.Tensor] | None = None) -> None:
        self._rebuild = rebuild if rebuild is not None else rebuild_segment
        self._held: dict[str, tuple[tuple[Any, ...], torch.Tensor]] = {}
        self.rebuilds = 0
        self.releases = 0

    def __len__(self) -> int:
        return len(self._held)

    def map(self, segments: Iterable[SegmentRef]) -> dict[int, torch.Tensor]:
        """The flat buffer of each segment of one export, by segment index (each rebuilt only if
        this export was not mapped already); mappings of other exports are released first."""
        segs = list(segments)
        keys = {seg.name: export_key(seg) for seg in segs}
        self._drop([n for n, (key, _) in self._held.items() if keys.get(n) != key])
        out: dict[int, torch.Tensor] = {}
        for seg in segs:
            held = self._held.get(seg.name)
            if held is None:
                assert seg.handle is not None and seg.device_uuid is not None  # check_layout
                buf = self._rebuild(seg.handle, seg.device_uuid)
                self.rebuilds += 1
                held = self._held[seg.name] = (keys[seg.name], buf)
            out[seg.index] = held[1]
        return out

    def release(self) -> None:
        """Release every mapping (the caller dropped its views and synchronised first)."""
        self._drop(list(self._held))

    def _drop(self, names: list[str]) -> None:
        # The last reference to a rebuilt storage goes here (the callers dropped their views):
        # torch releases its reference on the export at once, or at the next collection when a
        # view still sits in a reference cycle — once either way.
        for name in names:
            del self._held[name]
            self.releases += 1


def ipc_collect() -> None:
    """Drop unreferenced Python objects, then let torch free IPC blocks whose counters reached 0."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()

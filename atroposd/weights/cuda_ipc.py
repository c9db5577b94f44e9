"""CUDA IPC transport: the GPU twin of :mod:`atroposd.weights.shm`.

Shaped exactly like the CPU path so the CPU tests cover the protocol: the trainer's arena
allocates a few flat ``uint8`` CUDA buffers (``CudaSegment``) instead of shm segments, and a
manifest segment carries ``handle`` (base64 of the pickled ``reduce_tensor`` args) and the
physical GPU's UUID instead of a segment name.

Release protocol (VLLM-NOTES §3):

* producer: one ``reduce_tensor`` per flat buffer per export; keep the buffers alive (they
  are the trainer's parameters) until the consumer acknowledged; on re-export and on close,
  ``gc.collect()`` then ``torch.cuda.ipc_collect()``;
* consumer: rebuild once per export, copy (push) or compute on views (shared),
  ``torch.cuda.synchronize()``, drop every view and the rebuilt tensor, ``gc.collect()``,
  and only then acknowledge.

Handles are pickles: they only ever travel through the 0600 manifest in ``runtime_dir`` and
the 0600 Unix control socket. This module needs a GPU; the tests marked ``gpu`` run it.
"""

from __future__ import annotations

import base64
import gc
import pickle
from typing import Any

import torch

__all__ = ["CudaSegment", "device_index_for_uuid", "device_uuid", "ipc_collect", "rebuild_segment"]


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

    @classmethod
    def allocate(cls, name: str, size: int, device: torch.device) -> CudaSegment:
        return cls(name, torch.empty(size, dtype=torch.uint8, device=device))

    def view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of ``shape`` over bytes ``[offset, offset + nbytes)`` of the buffer."""
        assert self.buffer is not None
        return self.buffer[offset:offset + nbytes].view(dtype).view(shape)

    def owns(self, t: torch.Tensor) -> bool:
        if self.buffer is None or t.device != self.buffer.device:
            return False
        base = self.buffer.data_ptr()
        return base <= t.data_ptr() < base + self.size

    def export_handle(self) -> tuple[str, str]:
        """One export: (base64 pickled reduce_tensor args, GPU UUID)."""
        from torch.multiprocessing.reductions import reduce_tensor

        assert self.buffer is not None
        torch.cuda.synchronize(self.buffer.device)
        _rebuild, args = reduce_tensor(self.buffer)
        return base64.b64encode(pickle.dumps(args)).decode(), device_uuid(self.buffer.device)

    def close(self) -> None:
        self.buffer = None
        ipc_collect()

    def unlink(self) -> None:
        """Nothing has a name on a GPU; kept for the segment protocol."""


def rebuild_segment(handle: str, uuid: str) -> torch.Tensor:
    """Consumer: rebuild the flat buffer of one export (call once per export).

    Returns: a ``uint8`` CUDA tensor of the segment's size on the local index of ``uuid``.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args: list[Any] = list(pickle.loads(base64.b64decode(handle)))
    args[6] = device_index_for_uuid(uuid)
    return rebuild_cuda_tensor(*args)


def ipc_collect() -> None:
    """Drop unreferenced Python objects, then let torch free IPC blocks whose counters reached 0."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()

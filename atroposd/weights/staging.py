"""The bucketed push's staging buffer: one exported flat buffer that holds one bucket at a time.

With several trainer ranks the parameters are shards, so the trainer cannot train inside an
exported buffer (what ``push`` does with one rank, :mod:`atroposd.weights.arena`). Instead a
sync gathers the weights a bucket at a time and writes each bucket into this one buffer, which
every replica copies from before the next bucket overwrites it. The buffer is the same
transport as the arena's: a POSIX shm segment (``atroposd-<nonce>-<tag>-<n>``, 0600, never
tracked by Python's resource tracker) on CPU, a flat CUDA allocation exported through CUDA IPC
(one handle for the buffer's life) on a GPU. It is sized once for the largest bucket and
reused for every bucket of every sync; ``close`` unmaps and unlinks it.

Host staging (``host=True``, SPEC §7): for replicas that cannot map the trainer's GPU memory
(another GPU, a tensor-parallel replica) the buffer is a POSIX shm segment even when the
tensors are on a GPU; its pages are pinned (``cudaHostRegister``) so that the trainer's
device-to-host copies and the replicas' host-to-device copies run at the bus's rate. The
trainer fills it once per bucket for all such replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from atroposd.logs import get_logger
from atroposd.weights.arena import Segment, plan_layout
from atroposd.weights.manifest import SegmentRef, TensorEntry, contiguous_stride
from atroposd.weights.shm import ShmSegment, segment_name, segment_tag
from atroposd.weights.tensors import checksum, dtype_name

__all__ = ["StagingBuffer", "pin_host", "unpin_host"]

log = get_logger(__name__)


class StagingBuffer:
    """One exported buffer of ``size`` bytes on ``device`` (see the module docstring)."""

    def __init__(self, segment: Segment, transport: str, device: torch.device, *, pinned: bool = False) -> None:
        self.segment = segment
        self.transport = transport
        self.device = device
        self.size = segment.size
        #: host staging of GPU tensors: the segment's pages are registered with CUDA
        self.pinned = pinned

    @classmethod
    def create(
        cls, nonce: str, size: int, device: torch.device, index: int = 0, *, host: bool = False
    ) -> StagingBuffer:
        """A buffer of ``size`` bytes for tensors on ``device``: shm on the CPU or with ``host``
        (pinned when ``device`` is a GPU), else a CUDA allocation exported through CUDA IPC."""
        segment: Segment
        if device.type == "cpu" or host:
            shm = ShmSegment.create(segment_name(nonce, index, segment_tag()), size)
            pinned = False
            if device.type == "cuda":
                try:
                    pin_host(shm)
                    pinned = True
                except BaseException:
                    shm.unlink()
                    shm.close()
                    raise
            log.info(
                "staging buffer for the push created",
                transport="shm",
                host_staging=host,
                pinned=pinned,
                bytes=size,
                segment=shm.name,
            )
            return cls(shm, "shm", device, pinned=pinned)
        else:
            from atroposd.weights.cuda_ipc import CudaSegment

            segment = CudaSegment.allocate(f"cuda-{nonce}-{index}", size, device)
            transport = "cuda_ipc"
        log.info("staging buffer for the bucketed push created", transport=transport, bytes=size, segment=segment.name)
        return cls(segment, transport, device)

    @property
    def index(self) -> int:
        return int(self.segment.name.rsplit("-", 1)[1])

    def fits(self, size: int, device: torch.device, *, host: bool = False) -> bool:
        return (
            self.size >= size and self.device == device and (self.transport == "shm") == (host or device.type == "cpu")
        )

    def fill(
        self, names: Sequence[str], tensors: Mapping[str, torch.Tensor], *, with_checksums: bool = True
    ) -> list[TensorEntry]:
        """Copy ``tensors`` (in the order of ``names``) into the buffer, each 64-byte aligned;
        return their manifest entries (checksums taken from the buffer's copy)."""
        slots, sizes = plan_layout(
            {n: tensors[n].numel() * tensors[n].element_size() for n in names}, max_segment_bytes=max(self.size, 1)
        )
        if len(sizes) != 1 or sizes[0] > self.size:
            raise ValueError(
                f"a bucket of {sum(s.nbytes for s in slots)} bytes does not fit the {self.size}-byte staging buffer"
            )
        entries: list[TensorEntry] = []
        with torch.no_grad():
            for slot in slots:
                t = tensors[slot.name]
                shape = tuple(t.shape)
                view = self.segment.view(slot.offset, slot.nbytes, t.dtype, shape)
                view.copy_(t)  # blocking: from a GPU the bytes are on the host when it returns
                entries.append(
                    TensorEntry(
                        name=slot.name,
                        dtype=dtype_name(t.dtype),
                        shape=shape,
                        stride=contiguous_stride(shape),
                        segment=self.index,
                        offset=slot.offset,
                        nbytes=slot.nbytes,
                        checksum=checksum(view) if with_checksums else None,
                    )
                )
                del view
        return entries

    def ref(self) -> SegmentRef:
        """The manifest's segment: its name (shm) or its CUDA IPC handle, once the device has
        finished the copies into it."""
        handle, uuid = None, None
        if self.transport == "cuda_ipc":
            handle, uuid = self.segment.export_handle()  # type: ignore[attr-defined]
        return SegmentRef(index=self.index, name=self.segment.name, size=self.size, handle=handle, device_uuid=uuid)

    def close(self) -> None:
        """Unlink and unmap the buffer (idempotent)."""
        try:
            self.segment.unlink()
        finally:
            if self.pinned and isinstance(self.segment, ShmSegment) and not self.segment.closed:
                self.pinned = False
                unpin_host(self.segment)
            self.segment.close()


# cudaHostRegister's flags: Portable — pinned for every CUDA context of the process, not only the
# current device's (a replica's host-to-device copies, a rank's device-to-host ones, whichever
# device is current on the thread that copies); ReadOnly — a mapping the process may only read
# (a replica's view of the buffer).
REGISTER_PORTABLE = 0x01
REGISTER_READ_ONLY = 0x08


def _cuda_host_register(address: int, size: int, flags: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(address, size, flags))  # GPU only


def pin_host(
    segment: ShmSegment, *, read_only: bool = False, register: Callable[[int, int, int], int] = _cuda_host_register
) -> None:
    """Page-lock ``segment``'s mapping for CUDA (``cudaHostRegister``, portable): copies between
    it and a GPU then run as DMA at the bus's rate instead of through a bounce buffer."""
    flags = REGISTER_PORTABLE | (REGISTER_READ_ONLY if read_only else 0)
    err = register(segment.address, segment.size, flags)
    if int(err) != 0:
        raise RuntimeError(
            f"cudaHostRegister of the staging segment {segment.name} ({segment.size} bytes) "
            f"failed: CUDA error {int(err)}"
        )


def unpin_host(segment: ShmSegment) -> None:
    """Undo :func:`pin_host` before the mapping goes away."""
    err = torch.cuda.cudart().cudaHostUnregister(segment.address)
    if int(err) != 0:
        log.warning("cudaHostUnregister of a staging segment failed", segment=segment.name, error=int(err))

"""Whether ``/dev/shm`` can hold what the weight sync puts there, checked at the daemon's start.

A container's ``/dev/shm`` is 64 MB unless it is given more (``docker run --shm-size``), and a
POSIX shared-memory segment is sized up front but backed page by page: a segment larger than
the file system is created without complaint and the process that first writes past the
space gets SIGBUS. The weight sync puts into ``/dev/shm`` (SPEC §7):

* ``shared`` and ``push`` with one trainer rank on the CPU: the whole model (the exported
  buffers the trainer trains in), in the working dtype;
* the staging buffer of a bucketed push (several ranks on the CPU) and of host staging (a
  replica on another GPU, several GPUs, or ``push_path = "host_staging"``): one bucket
  (``sync_bucket_mb``, or the largest tensor when that is bigger, never more than the model).

:func:`shm_need` says how much (read from the model's safetensors headers, nothing loaded),
:func:`check_shm` compares it with the file system's size: a start is refused when the file
system is smaller than that (it can never fit), and warned about when only its free space is.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from atroposd.config import Config

__all__ = ["SHM_DIR", "ShmNeed", "ShmVerdict", "check_shm", "model_bytes", "shm_need"]

SHM_DIR = Path("/dev/shm")

# safetensors' dtype names → bytes per element
_ST_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_HEADER_MAX = 100 << 20  # safetensors' own bound on a header


@dataclass(frozen=True)
class ShmNeed:
    """``nbytes`` of ``/dev/shm`` that ``what`` takes."""

    nbytes: int
    what: str


@dataclass(frozen=True)
class ShmVerdict:
    """``refuse`` (the file system is smaller than the need) or ``warn`` (only its free space
    is), with the message that names the size needed and how to give more."""

    level: str
    message: str


def model_bytes(model_dir: Path, dtype_bytes: int) -> tuple[int, int] | None:
    """(every floating-point tensor's bytes at ``dtype_bytes`` each plus the others as stored,
    the largest tensor's) of the model's ``*.safetensors`` files, from their headers; None
    when there are none or a header cannot be read."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = largest = 0
    for path in files:
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > _HEADER_MAX:
                    return None
                header: dict[str, Any] = json.loads(f.read(n))
        except (OSError, ValueError, struct.error):
            return None
        for name, info in header.items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            dtype = str(info.get("dtype", ""))
            numel = math.prod(int(d) for d in info.get("shape", []))
            size = numel * (dtype_bytes if dtype in ("F64", "F32", "F16", "BF16") else _ST_BYTES.get(dtype, 1))
            total += size
            largest = max(largest, size)
    return total, largest


def shm_need(cfg: Config, model_dir: Path) -> ShmNeed | None:
    """What this node's trainer puts into ``/dev/shm`` for the weight sync (see the module
    docstring), or None when it puts nothing there (``reload``, ``broadcast``, CUDA IPC) or the
    model's size cannot be read."""
    t, inf = cfg.trainer, cfg.inference
    mode = cfg.weight_sync
    if not (t.enabled and inf.enabled) or mode not in ("shared", "push"):
        return None
    from atroposd.devices import resolve

    device, dtype = resolve(t.devices()[0], inf.dtype, key="trainer.device")
    compute = dtype if t.compute_dtype == "auto" else str(t.compute_dtype)
    sizes = model_bytes(model_dir, _DTYPE_BYTES.get(compute, 4))
    if sizes is None:
        return None
    total, largest = sizes
    bucket = min(total, max(int(t.sync_bucket_mb) << 20, largest))
    if device == "cpu":
        if t.ranks == 1:
            return ShmNeed(total, f'the exported weights (weight_sync = "{mode}" on the CPU)')
        return ShmNeed(bucket, "the staging buffer of the bucketed push (several trainer ranks)")
    if mode == "push":
        from atroposd.weights.sync import push_paths

        if "host_staging" in push_paths(cfg):
            return ShmNeed(bucket, "the host staging buffer (a replica not on the trainer's GPU)")
    return None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n < 10 << 30 else f"{n / (1 << 30):.1f} GiB"


def check_shm(need: ShmNeed, directory: Path = SHM_DIR) -> ShmVerdict | None:
    """Compare ``need`` with the file system at ``directory`` (``os.statvfs``): None when it
    fits in the free space, else a :class:`ShmVerdict`."""
    st = os.statvfs(directory)
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    if need.nbytes <= free:
        return None
    # a round size with room for the rest of the job's segments (the API's, the engines')
    suggest = max(1, math.ceil(need.nbytes * 1.5 / (1 << 30)))
    advice = (
        f"give it more (docker run --shm-size={suggest}g; Kubernetes: an emptyDir with medium Memory "
        f"mounted at {directory})"
    )
    if need.nbytes > size:
        return ShmVerdict(
            "refuse",
            f"{directory} holds {_mib(size)} but {need.what} needs {_mib(need.nbytes)} there "
            f'(a process writing past its size gets SIGBUS): {advice}, or use weight_sync = "reload"',
        )
    return ShmVerdict(
        "warn",
        f"{directory} has {_mib(free)} free of {_mib(size)} but {need.what} needs {_mib(need.nbytes)} "
        f"there: free some, or {advice}",
    )

"""Device and dtype resolution: the one place that turns ``trainer.device``,
``inference.device`` and ``inference.dtype`` into what a process computes on.

The trainer and both inference engines call :func:`resolve` (or :func:`resolve_torch`), so
they cannot disagree on what ``auto`` means — shared memory needs the same dtype on both
sides. ``auto``: CUDA when available, else the CPU; dtype ``auto``: float32 on the CPU,
bfloat16 on a GPU. A GPU UUID (``GPU-…``/``MIG-…``) is ``cuda:0``: the daemon narrows
``CUDA_VISIBLE_DEVICES`` to it before the child starts.

torch is imported only to ask whether CUDA is available (and by :func:`resolve_torch`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

__all__ = ["DTYPES", "DeviceError", "gpu_uuids", "resolve", "resolve_torch", "same_device"]

DTYPES = ("float32", "bfloat16", "float16")
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


class DeviceError(ValueError):
    """A device or dtype that cannot be used here; the message names the setting."""


def _torch_cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def resolve(
    device: str, dtype: str, *, key: str = "device", cuda_available: Callable[[], bool] = _torch_cuda_available
) -> tuple[str, str]:
    """``(device, dtype)`` names: ``"cpu"`` / ``"cuda"`` / ``"cuda:N"`` and one of :data:`DTYPES`.

    ``key`` names the setting in errors (``"trainer.device"``). Raises :class:`DeviceError`
    for a malformed device, CUDA asked for where there is none, or an unknown dtype.
    """
    if device == "auto":
        name = "cuda" if cuda_available() else "cpu"
    elif device.startswith(("GPU-", "MIG-")):
        name = "cuda:0"
    elif _DEVICE_RE.match(device):
        name = device
    else:
        raise DeviceError(f"{key} = {device!r}: expected auto, cpu, cuda, cuda:N or a GPU UUID")
    if name != "cpu" and device != "auto" and not cuda_available():
        raise DeviceError(f"{key} = {device!r} but CUDA is not available")
    if dtype == "auto":
        return name, "float32" if name == "cpu" else "bfloat16"
    if dtype not in DTYPES:
        raise DeviceError(f"inference.dtype = {dtype!r}: expected auto or one of {', '.join(DTYPES)}")
    return name, dtype


def resolve_torch(device: str, dtype: str, *, key: str = "device") -> tuple[Any, Any]:
    """:func:`resolve` as ``(torch.device, torch.dtype)``."""
    import torch

    name, dtype_name = resolve(device, dtype, key=key)
    return torch.device(name), getattr(torch, dtype_name)


def gpu_uuids() -> list[str] | None:
    """The UUID of each GPU in index order (``nvidia-smi``), or None where it cannot be asked.

    Used by ``config check``, which must not import torch; the attach in shared mode compares
    the UUIDs torch reports, so a check skipped here is still made there.
    """
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in out.splitlines() if line.strip()]


def same_device(a: str, b: str, *, uuids: Callable[[], list[str] | None] = gpu_uuids) -> bool | None:
    """Whether two device settings name the same physical device: True, False, or None when
    it cannot be told without a GPU to ask (a UUID beside an index, with no ``nvidia-smi``).

    ``auto`` on both sides is the same device (both resolve alike); ``cuda`` is ``cuda:0``.
    """

    def norm(d: str) -> str:
        return "cuda:0" if d == "cuda" else d

    a, b = norm(a), norm(b)
    if a == b:
        return True
    if "auto" in (a, b):
        return None  # auto is the CPU or a GPU, which only the attach can tell
    if "cpu" in (a, b):
        return False
    uuid_a, uuid_b = a.startswith(("GPU-", "MIG-")), b.startswith(("GPU-", "MIG-"))
    if not uuid_a and not uuid_b:
        return False  # two different indices
    if uuid_a and uuid_b:
        return False  # two different UUIDs
    table = uuids()
    if table is None:
        return None
    index_dev, uuid_dev = (b, a) if uuid_a else (a, b)
    index = int(index_dev.partition(":")[2] or 0)
    return index < len(table) and table[index] == uuid_dev

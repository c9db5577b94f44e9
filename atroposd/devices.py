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

__all__ = ["DTYPES", "DeviceError", "resolve", "resolve_torch"]

DTYPES = ("float32", "bfloat16", "float16")
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


class DeviceError(ValueError):
    """A device or dtype that cannot be used here; the message names the setting."""


def _torch_cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def resolve(device: str, dtype: str, *, key: str = "device",
            cuda_available: Callable[[], bool] = _torch_cuda_available) -> tuple[str, str]:
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

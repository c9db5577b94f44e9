"""Device and dtype resolution (atroposd.devices): one answer for the trainer and both engines."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from atroposd.devices import DeviceError, resolve


def yes() -> bool:
    return True


def no() -> bool:
    return False


@pytest.mark.parametrize("device, dtype, cuda, want", [
    ("auto", "auto", no, ("cpu", "float32")),
    ("auto", "auto", yes, ("cuda", "bfloat16")),
    ("cpu", "auto", yes, ("cpu", "float32")),
    ("cuda:1", "auto", yes, ("cuda:1", "bfloat16")),
    ("GPU-0d1f2c3a-aaaa-bbbb-cccc-000000000000", "float16", yes, ("cuda:0", "float16")),
    ("MIG-0d1f2c3a-aaaa-bbbb-cccc-000000000000", "auto", yes, ("cuda:0", "bfloat16")),
    ("cpu", "bfloat16", no, ("cpu", "bfloat16")),
])
def test_resolution(device: str, dtype: str, cuda: Callable[[], bool], want: tuple[str, str]) -> None:
    assert resolve(device, dtype, cuda_available=cuda) == want


@pytest.mark.parametrize("device, dtype, message", [
    ("cuda", "auto", "trainer.device = 'cuda' but CUDA is not available"),
    ("GPU-1234", "auto", "CUDA is not available"),
    ("tpu", "auto", "expected auto, cpu"),
    ("cpu", "int8", "inference.dtype = 'int8'"),
])
def test_refusals_name_the_setting(device: str, dtype: str, message: str) -> None:
    with pytest.raises(DeviceError, match=message):
        resolve(device, dtype, key="trainer.device", cuda_available=no)

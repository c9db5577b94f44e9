"""Device and dtype resolution (atroposd.devices): one answer for the trainer and both engines."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from atroposd.devices import DeviceError, resolve


def yes() -> bool:
    return True


def no() -> bool:
    return False


@pytest.mark.parametrize(
    "device, dtype, cuda, want",
    [
        ("auto", "auto", no, ("cpu", "float32")),
        ("auto", "auto", yes, ("cuda", "bfloat16")),
        ("cpu", "auto", yes, ("cpu", "float32")),
        ("cuda:1", "auto", yes, ("cuda:1", "bfloat16")),
        ("GPU-0d1f2c3a-aaaa-bbbb-cccc-000000000000", "float16", yes, ("cuda:0", "float16")),
        ("MIG-0d1f2c3a-aaaa-bbbb-cccc-000000000000", "auto", yes, ("cuda:0", "bfloat16")),
        ("cpu", "bfloat16", no, ("cpu", "bfloat16")),
    ],
)
def test_resolution(device: str, dtype: str, cuda: Callable[[], bool], want: tuple[str, str]) -> None:
    assert resolve(device, dtype, cuda_available=cuda) == want


@pytest.mark.parametrize(
    "device, dtype, message",
    [
        ("cuda", "auto", "trainer.device = 'cuda' but CUDA is not available"),
        ("GPU-1234", "auto", "CUDA is not available"),
        ("tpu", "auto", "expected auto, cpu"),
        ("cpu", "int8", "inference.dtype = 'int8'"),
    ],
)
def test_refusals_name_the_setting(device: str, dtype: str, message: str) -> None:
    with pytest.raises(DeviceError, match=message):
        resolve(device, dtype, key="trainer.device", cuda_available=no)


@pytest.mark.parametrize(
    ("a", "b", "table", "expected"),
    [
        ("cpu", "cpu", None, True),
        ("cuda", "cuda:0", None, True),
        ("cuda:0", "cuda:1", None, False),
        ("cpu", "cuda:0", None, False),
        ("GPU-a", "GPU-b", None, False),
        ("auto", "cpu", None, None),
        ("cuda:1", "GPU-b", None, None),  # no nvidia-smi: told at attach
        ("cuda:1", "GPU-b", ["GPU-a", "GPU-b"], True),
        ("GPU-a", "cuda:1", ["GPU-a", "GPU-b"], False),
        ("cuda:3", "GPU-a", ["GPU-a", "GPU-b"], False),
    ],
)
def test_same_device(a: str, b: str, table: list[str] | None, expected: bool | None) -> None:
    from atroposd.devices import same_device

    assert same_device(a, b, uuids=lambda: table) is expected


def test_config_check_refuses_shared_mode_across_two_gpus() -> None:
    from atroposd.config import ConfigError, parse_toml

    with pytest.raises(ConfigError, match=r"trainer.weight_sync.*one device.*cuda:0.*cuda:1"):
        parse_toml('[trainer]\nweight_sync = "shared"\ndevice = "cuda:0"\n[inference]\ndevice = "cuda:1"\n')
    cfg = parse_toml('[trainer]\nweight_sync = "push"\ndevice = "cuda:0"\n[inference]\ndevice = "cuda:1"\n')
    assert cfg.weight_sync == "push"

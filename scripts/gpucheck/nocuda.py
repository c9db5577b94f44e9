"""A pytest plugin for the ``gpu_tests`` phase (``-p gpucheck.nocuda``): where torch sees no CUDA
device (the rehearsal), every ``gpu``-marked test is skipped as needing one, so that the phase
names and runs the same files on the CPU as on a GPU. Where there is a GPU it does nothing."""

from __future__ import annotations

from typing import Any

import pytest


def pytest_runtest_setup(item: Any) -> None:
    if item.get_closest_marker("gpu") is None:
        return
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none here)")

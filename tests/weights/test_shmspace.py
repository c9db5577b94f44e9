"""/dev/shm's room for the weight sync (SPEC §7), checked at start: what the sync puts there,
read from the model's safetensors headers, against the file system's real size and free space
(``os.statvfs``) — refused when it can never fit, warned about when only its free space is short,
the message naming the size needed and ``--shm-size``."""

from __future__ import annotations

import json
import os
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from atroposd.config import parse_config
from atroposd.weights.shmspace import ShmNeed, check_shm, model_bytes, shm_need

MIB = 1 << 20


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A model directory with two safetensors files: 1 MiB + 4 KiB of float32, a bf16 and an int64 tensor."""
    d = tmp_path / "model"
    d.mkdir()
    save_file({"big": torch.zeros(256, 1024), "small": torch.zeros(1024)}, str(d / "model-00001.safetensors"))
    save_file(
        {"half": torch.zeros(8, dtype=torch.bfloat16), "ids": torch.zeros(3, dtype=torch.int64)},
        str(d / "model-00002.safetensors"),
    )
    return d


def test_the_models_bytes_come_from_its_safetensors_headers(model_dir: Path, tmp_path: Path) -> None:
    # floating-point tensors at the working dtype's size, the others as stored
    assert model_bytes(model_dir, 4) == (MIB + 4096 + 8 * 4 + 3 * 8, MIB)
    assert model_bytes(model_dir, 2) == (MIB // 2 + 2048 + 8 * 2 + 3 * 8, MIB // 2)
    assert model_bytes(tmp_path, 4) is None  # no safetensors: not checked


def _cfg(**trainer: Any) -> Any:
    return parse_config({"trainer": trainer})


def test_what_each_mode_puts_into_shared_memory(model_dir: Path) -> None:
    total = MIB + 4096 + 8 * 4 + 3 * 8
    push = shm_need(_cfg(device="cpu", weight_sync="push"), model_dir)
    assert push is not None and push.nbytes == total and "exported weights" in push.what
    shared = shm_need(_cfg(device="cpu", weight_sync="shared"), model_dir)
    assert shared is not None and shared.nbytes == total
    # several ranks: one bucket in the staging buffer (the largest tensor when the bucket is smaller)
    ranks = shm_need(_cfg(device=["cpu", "cpu"], weight_sync="push", sync_bucket_mb=1), model_dir)
    assert ranks is not None and ranks.nbytes == MIB and "staging" in ranks.what
    assert shm_need(_cfg(device="cpu", weight_sync="reload"), model_dir) is None
    assert shm_need(_cfg(device="cpu", weight_sync="broadcast"), model_dir) is None


def test_a_need_larger_than_the_file_system_refuses_naming_the_size_and_shm_size(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    size = st.f_blocks * st.f_frsize
    verdict = check_shm(ShmNeed(size + MIB, "the host staging buffer"), tmp_path)
    assert verdict is not None and verdict.level == "refuse"
    assert "the host staging buffer needs" in verdict.message and "--shm-size=" in verdict.message
    assert f"{(size + MIB) / (1 << 30):.1f} GiB" in verdict.message or f"{(size + MIB) >> 20} MiB" in verdict.message
    assert check_shm(ShmNeed(4096, "the host staging buffer"), tmp_path) is None


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 4 MiB tmpfs (what a container's /dev/shm is, smaller), unmounted afterwards."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=1777", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_small_tmpfs_refuses_what_cannot_fit_and_warns_when_only_free_space_is_short(small_tmpfs: Path) -> None:
    refused = check_shm(ShmNeed(64 * MIB, "the host staging buffer"), small_tmpfs)
    assert refused is not None and refused.level == "refuse"
    assert "holds 4 MiB" in refused.message and "needs 64 MiB" in refused.message
    assert "--shm-size=1g" in refused.message
    assert check_shm(ShmNeed(2 * MIB, "the host staging buffer"), small_tmpfs) is None
    with open(small_tmpfs / "taken", "wb") as f:
        f.write(b"\0" * (3 * MIB))
    warned = check_shm(ShmNeed(2 * MIB, "the host staging buffer"), small_tmpfs)
    assert warned is not None and warned.level == "warn"
    assert "needs 2 MiB" in warned.message and "--shm-size=" in warned.message


def _huge_model(tiny: Path, into: Path) -> Path:
    """The tiny model's directory with a weights file whose header names a 160 GB float32 tensor
    (no data follows: nothing reads past the header before the check)."""
    import shutil

    d = into / "huge"
    shutil.copytree(tiny, d)
    for f in d.glob("*.safetensors"):
        f.unlink()
    header = json.dumps({"huge": {"dtype": "F32", "shape": [200_000, 200_000], "data_offsets": [0, 160_000_000_000]}})
    raw = header.encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return d


@pytest.mark.slow  # a daemon start: about 10 s here, more on a loaded machine
def test_a_start_is_refused_when_dev_shm_cannot_hold_the_exported_weights(short_tmp: Path) -> None:
    """A real daemon, the exported weights of a model larger than /dev/shm: the start fails
    (exit 1) before any child starts, its log naming the size needed and --shm-size."""
    from atroposd.models.tiny import ensure_builtin_model
    from tests.support import atroposd, write_config

    model = _huge_model(ensure_builtin_model(short_tmp / "tiny", 0, 256), short_tmp)
    cfg = write_config(
        short_tmp / "atroposd.toml",
        {
            "daemon": {
                "runtime_dir": str(short_tmp / "run"),
                "state_dir": str(short_tmp / "state"),
                "log_format": "json",
            },
            "inference": {"model": str(model), "device": "cpu", "max_model_len": 256},
            "trainer": {"device": "cpu", "weight_sync": "push", "max_token_len": 128},
            "env": [],
        },
    )
    r = atroposd("run", "-c", str(cfg), timeout=90)
    logs = list((short_tmp / "state").rglob("daemon.log"))
    log = r.stdout + r.stderr + "".join(p.read_text(errors="replace") for p in logs)
    assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-2000:])
    assert "--shm-size=" in log and "/dev/shm holds" in log and "needs 149.0 GiB" in log, log[-3000:]
    assert "exported weights" in log

"""Reload directories: one module writes and reads them (atroposd.weights.syncdir), for the
trainer (a model, or buckets from its ranks), an external trainer (numpy or torch arrays) and
both engines; it imports no torch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

from atroposd.weights import syncdir
from atroposd.weights.protocol import SYNC_INDEX_FILE, SYNC_WEIGHTS_FILE, WeightUpdateError
from atroposd.weights.receiver import load_dir
from atroposd.weights.reload import write_sharded_sync_dir, write_sync_dir
from atroposd.weights.source import ModelSource
from atroposd.weights.tensors import model_tensors
from tests.weights.conftest import make_model, score

REPO = Path(__file__).resolve().parents[2]


def test_syncdir_writes_and_reads_without_torch(tmp_path: Path) -> None:
    code = (
        "import sys\nfrom pathlib import Path\nimport numpy as np\n"
        "from atroposd.weights import syncdir\n"
        "w = np.ones((2, 3), np.float32)\n"
        f"d = syncdir.write_tensors(Path({str(tmp_path)!r}), 3, {{'w': w}}, tied={{'t': 'w'}})\n"
        "f, v, specs, tied, lora = syncdir.inspect_sync_dir(d, 3)\n"
        "assert (v, tied, lora, specs['w'].shape, specs['w'].dtype) == (3, {'t': 'w'}, None, (2, 3), 'float32')\n"
        "assert syncdir.sync_shards(f) == {f: ['w']}\n"
        "assert not [m for m in sys.modules if m == 'torch' or m.startswith('torch.')], 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_an_external_trainers_arrays_load_like_the_trainers_own_directory(tmp_path: Path) -> None:
    trainer = make_model(0)
    mt = model_tensors(trainer)
    own = write_sync_dir(trainer, tmp_path / "a", 5)
    arrays = {n: t.detach().numpy().copy() for n, t in mt.tensors.items()}
    external = syncdir.write_tensors(tmp_path / "b", 5, arrays, tied=mt.tied)
    torch_external = syncdir.write_tensors(tmp_path / "c", 5, mt.tensors, tied=mt.tied)
    seen = [syncdir.inspect_sync_dir(d, 5) for d in (own, external, torch_external)]
    assert [s[1:] for s in seen[1:]] == [seen[0][1:]] * 2  # version, specs, tied, lora
    for d in (external, torch_external):
        assert all(torch.equal(t, mt.tensors[n]) for n, t in syncdir.read_tensors(d / SYNC_WEIGHTS_FILE))
        server = make_model(1)
        load_dir(server, d, weight_version=5)
        assert torch.equal(score(server), score(trainer))


def test_the_sharded_directory_reads_as_the_one_file(tmp_path: Path) -> None:
    trainer = make_model(0)
    one = write_sync_dir(trainer, tmp_path / "one", 2)
    sharded = anyio.run(write_sharded_sync_dir, ModelSource(trainer), tmp_path / "sharded", 2, 40_000)
    file, version, specs, tied, _ = syncdir.inspect_sync_dir(sharded, 2)
    assert file.name == SYNC_INDEX_FILE and version == 2
    assert (specs, tied) == syncdir.inspect_sync_dir(one, 2)[2:4]
    shards = syncdir.sync_shards(file)
    assert len(shards) > 2 and all(p.parent == sharded for p in shards)
    whole = dict(syncdir.read_tensors(syncdir.inspect_sync_dir(one, 2)[0]))
    parts = dict(syncdir.read_tensors(file))
    assert whole.keys() == parts.keys() and all(torch.equal(whole[n], parts[n]) for n in whole)
    picked = [n for n, _ in syncdir.read_tensors(file, {"model.norm.weight"})]
    assert picked == ["model.norm.weight"]


def test_a_failed_write_publishes_nothing_and_leaves_nothing(tmp_path: Path) -> None:
    syncdir.write_tensors(tmp_path, 1, {"w": np.zeros(3, np.float32)})
    with pytest.raises(Exception):  # noqa: B017 (safetensors refuses an object array with its own error)
        syncdir.write_tensors(tmp_path, 2, {"w": np.array([object()])})

    def fail(directory: Path) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        syncdir.write_tensors(tmp_path, 1, {"w": np.ones(3, np.float32)}, also=fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]
    assert syncdir.inspect_sync_dir(tmp_path / "v1", 1)[2]["w"].shape == (3,)
    assert np.array_equal(next(syncdir.read_tensors(tmp_path / "v1" / SYNC_WEIGHTS_FILE))[1].numpy(), np.zeros(3))
    with pytest.raises(WeightUpdateError, match="stale"):
        syncdir.inspect_sync_dir(tmp_path / "v1", 2)


def test_no_module_but_syncdir_names_a_reload_directorys_files() -> None:
    """A second writer or reader of the layout would have to name its files."""
    names = re.compile(
        r"\b(SYNC_WEIGHTS_FILE|SYNC_INDEX_FILE|SYNC_FORMAT|ADAPTER_DIR|shard_name)\b|\.tmp-v|atroposd-sync-1"
    )
    package = REPO / "atroposd"
    # trainer/hfshards.py's shard_name names a checkpoint's shards, another layout
    mine = ("weights/syncdir.py", "weights/protocol.py", "trainer/hfshards.py")
    others = [
        str(p.relative_to(REPO))
        for p in sorted(package.rglob("*.py"))
        if str(p.relative_to(package)) not in mine and names.search(p.read_text())
    ]
    assert others == []


def test_a_lora_models_version_holds_its_adapters_and_loads_into_a_lora_server(tmp_path: Path) -> None:
    from atroposd.trainer.model import _wrap_lora

    lora = {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}
    trainer = _wrap_lora(make_model(0), lora)
    with torch.no_grad():  # adapters that change what the model computes (PEFT starts B at zero)
        for name, p in trainer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    d = write_sync_dir(trainer, tmp_path, 3)
    _, version, specs, _, spec = syncdir.inspect_sync_dir(d, 3)
    assert version == 3 and spec is not None and spec["r"] == 4 and any("lora_B" in n for n in specs)
    adapter = syncdir.adapter_dir(d)
    assert (adapter / "adapter_config.json").is_file() and all(
        f.stat().st_mode & 0o777 == 0o600 for f in adapter.iterdir()
    )
    server = make_model(1)
    load_dir(server, d, weight_version=3)  # the server takes the LoRA structure and every tensor
    assert torch.allclose(score(server), score(trainer), atol=1e-5)

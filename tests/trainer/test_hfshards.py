"""The ranks' model shards (DCP's Hugging Face writer layout) read without DCP: full tensors put
together from their pieces, one consolidated file, and shards that are not the writer's refused
with the file named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from atroposd.trainer.hfshards import ShardError, consolidate, load_full, read_layout, shard_name


def _shard(path: Path, tensors: dict[str, torch.Tensor], offsets: dict[str, list[int]]) -> None:
    info = {k: {"saved_offsets": v} for k, v in offsets.items()}
    save_file(tensors, str(path), metadata={"DCP_SHARDING_INFO": json.dumps(info), "format": "pt"})


def _two_ranks(d: Path, full: dict[str, torch.Tensor]) -> None:
    d.mkdir()
    w, b = full["w"], full["b"]
    _shard(d / shard_name(0), {"w": w[:3].clone(), "b": b}, {"w": [0, 0], "b": [0]})
    _shard(d / shard_name(1), {"w": w[3:].clone()}, {"w": [3, 0]})


def test_pieces_make_the_full_tensors_and_one_file(tmp_path: Path) -> None:
    full = {"w": torch.randn(5, 4), "b": torch.arange(4, dtype=torch.bfloat16)}
    _two_ranks(tmp_path / "model", full)
    got = load_full(tmp_path / "model", world=2)
    assert got.keys() == full.keys() and all(torch.equal(got[k], full[k]) for k in full)
    assert consolidate(tmp_path / "model", tmp_path / "model.safetensors", world=2) == 2
    merged = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(merged[k], full[k]) for k in full)


def test_a_missing_piece_a_missing_rank_and_a_stranger_are_refused(tmp_path: Path) -> None:
    full = {"w": torch.randn(5, 4), "b": torch.zeros(4)}
    d = tmp_path / "model"
    _two_ranks(d, full)
    with pytest.raises(ShardError, match="misses the model shards of 1 of 3 ranks: shard-00003-model-"):
        read_layout(d, world=3)
    (d / "notes.txt").write_text("x")
    with pytest.raises(ShardError, match=r"not a model shard: notes\.txt"):
        read_layout(d)
    (d / "notes.txt").unlink()
    _shard(d / shard_name(1), {"w": full["w"][3:4].clone()}, {"w": [3, 0]})  # the last row lost
    with pytest.raises(ShardError, match=r"the pieces of w make \[4, 4\], not its shape \[5, 4\]"):
        read_layout(d, shapes={"w": [5, 4], "b": [4]})
    _shard(d / shard_name(1), {"w": full["w"][4:].clone()}, {"w": [4, 0]})  # a row lost in the middle
    with pytest.raises(ShardError, match="pieces of w do not cover it exactly"):
        read_layout(d)
    _shard(d / shard_name(1), {"w": full["w"][3:].clone()}, {"w": [3]})  # offsets of another rank
    with pytest.raises(ShardError, match=f"{shard_name(1)}: w's offsets and shape differ in rank"):
        read_layout(d)

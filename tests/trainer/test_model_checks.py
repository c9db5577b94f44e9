"""The policy's load-time guards, each shown to refuse what it exists for: a model directory
missing weights (strict load), a tensor left on the meta device, a rotary ``inv_freq`` that
differs from the model's own, and a tokenizer larger than the embedding."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from atroposd.trainer.model import ModelLoadError, load_policy

CPU = torch.device("cpu")


def _load(model_dir: Path, tokenizer_dir: Path | None = None) -> Any:
    return load_policy(model_dir, tokenizer_dir or model_dir, device=CPU, dtype=torch.float32)


def _edit_weights(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    edit(weights)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _tampered_from_pretrained(monkeypatch: pytest.MonkeyPatch, tamper: Callable[[torch.nn.Module], None]) -> None:
    """from_pretrained as it is, followed by ``tamper`` on the model it returns (what a broken
    loader — low_cpu_mem_usage, a device map, a dtype cast — leaves behind)."""
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_pretrained

    def load(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        tamper(result[0] if isinstance(result, tuple) else result)
        return result

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", load)


def test_the_intact_model_loads(tiny_dir: Path) -> None:
    policy = _load(tiny_dir)
    assert policy.vocab_size == 22


def test_missing_weights_are_refused_not_initialised_at_random(tiny_dir: Path, tmp_path: Path) -> None:
    broken = _edit_weights(tiny_dir, tmp_path / "broken", lambda w: w.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"1 missing \(model\.layers\.0\.mlp\.up_proj\.weight\)"):
        _load(broken)


def test_unused_tensors_in_the_directory_are_ignored(tiny_dir: Path, tmp_path: Path) -> None:
    extra = _edit_weights(tiny_dir, tmp_path / "extra", lambda w: w.update({"mtp.head.weight": torch.zeros(2)}))
    assert _load(extra).vocab_size == 22


def test_a_weight_of_another_shape_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    def shrink(w: dict[str, torch.Tensor]) -> None:
        w["model.norm.weight"] = w["model.norm.weight"][:64].clone()

    with pytest.raises(ModelLoadError, match=r"cannot load the model|another shape"):
        _load(_edit_weights(tiny_dir, tmp_path / "shape", shrink))


def test_a_tensor_left_on_the_meta_device_is_refused(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def to_meta(model: torch.nn.Module) -> None:
        norm = model.get_submodule("model.norm")
        norm.weight = torch.nn.Parameter(torch.empty(128, device="meta"))

    _tampered_from_pretrained(monkeypatch, to_meta)
    with pytest.raises(ModelLoadError, match=r"still on the meta device\): model\.norm\.weight"):
        _load(tiny_dir)


def test_a_rotary_inv_freq_unlike_the_models_own_is_refused(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def bf16_round_trip(model: torch.nn.Module) -> None:  # what a blanket dtype cast does to the buffer
        rotary = model.get_submodule("model.rotary_emb")
        rotary.inv_freq = rotary.inv_freq.to(torch.bfloat16).float()

    _tampered_from_pretrained(monkeypatch, bf16_round_trip)
    with pytest.raises(ModelLoadError, match=r"model\.rotary_emb\.inv_freq differs"):
        _load(tiny_dir)


def test_a_tokenizer_larger_than_the_embedding_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    tokenizer.add_tokens(["@", "!"])
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    with pytest.raises(ModelLoadError, match=r"has 24 tokens but the model's embedding .* only 22 rows"):
        _load(tiny_dir, tmp_path / "tok")

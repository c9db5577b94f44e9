"""builtin:tiny: built locally, loadable by transformers and atroposlib, idempotent under
concurrent builders, and the resolver's errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from atroposd.config import parse_config
from atroposd.models.resolve import (
    ModelError,
    fingerprint_of,
    resolve_model,
    resolve_tokenizer,
    tokenizer_fingerprint,
)
from atroposd.models.tiny import BOS_ID, EOS_ID, PAD_ID, UNK_ID, VOCAB, ensure_builtin_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_builtin_model(tmp_path_factory.mktemp("state"), seed=0, max_model_len=128)


def test_tokenizer_round_trips_and_loads_with_autotokenizer(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    loaded = AutoTokenizer.from_pretrained(str(tiny_dir))
    assert isinstance(loaded, PreTrainedTokenizerFast)
    tok: Any = loaded  # transformers' return types are unions this test need not narrow
    assert len(tok) == len(VOCAB) == 22
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (PAD_ID, BOS_ID, EOS_ID, UNK_ID)
    ids = tok("12+34=46")["input_ids"]
    assert ids[0] == BOS_ID and len(ids) == 9
    assert tok.convert_ids_to_tokens(ids[1:]) == list("12+34=46")
    assert tok.decode(ids, skip_special_tokens=True) == "12+34=46"
    assert tok.decode([*ids, EOS_ID]) == "[BOS]12+34=46[EOS]"
    assert tok.encode("[BOS]7*8=", add_special_tokens=False) == [BOS_ID, *tok.convert_tokens_to_ids(list("7*8="))]
    assert tok("a")["input_ids"] == [BOS_ID, UNK_ID]
    every = "".join(VOCAB[4:])
    assert tok.decode(tok.encode(every, add_special_tokens=False)) == every
    chat = tok.apply_chat_template([{"role": "user", "content": "3+4="}], tokenize=True, add_generation_prompt=True)
    if isinstance(chat, dict) or hasattr(chat, "keys"):
        chat = chat["input_ids"]
    assert list(chat) == [BOS_ID, *tok.convert_tokens_to_ids(list("3+4="))]


def test_model_loads_with_the_requested_shape(tiny_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir))
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim) == (128, 2, 2, 64)
    assert cfg.intermediate_size == 256 and cfg.tie_word_embeddings and cfg.vocab_size == 22
    assert cfg.max_position_embeddings >= 128
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert (tiny_dir / "model.safetensors").is_file()
    with torch.no_grad():
        logits = model(torch.tensor([[BOS_ID, 5, 14, 6, 17]])).logits
    assert logits.shape == (1, 5, 22) and torch.isfinite(logits).all()


def test_same_seed_same_directory_other_seed_other_weights(tmp_path: Path, tiny_dir: Path) -> None:
    from safetensors.torch import load_file

    again = ensure_builtin_model(tiny_dir.parent.parent, seed=0, max_model_len=128)
    assert again == tiny_dir
    rebuilt = ensure_builtin_model(tmp_path, seed=0, max_model_len=128)
    assert rebuilt.name == tiny_dir.name
    a, b = load_file(str(tiny_dir / "model.safetensors")), load_file(str(rebuilt / "model.safetensors"))
    assert all((a[k] == b[k]).all() for k in a)
    other = ensure_builtin_model(tmp_path, seed=1, max_model_len=128)
    assert other != rebuilt
    c = load_file(str(other / "model.safetensors"))
    assert not (a["model.embed_tokens.weight"] == c["model.embed_tokens.weight"]).all()


def test_concurrent_builders_get_one_complete_directory(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from atroposd.models.tiny import ensure_builtin_model;"
        "print(ensure_builtin_model(Path(sys.argv[1]), 3, 64))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        outs.append(out.strip().splitlines()[-1])
    assert len(set(outs)) == 1
    entries = sorted(e.name for e in (tmp_path / "models").iterdir() if not e.name.endswith(".lock"))
    assert entries == [Path(outs[0]).name]  # no temporary leftovers


def test_resolve_builtin_and_local_and_errors(tmp_path: Path, tiny_dir: Path) -> None:
    cfg = parse_config(
        {
            "daemon": {"state_dir": str(tiny_dir.parent.parent)},
            "inference": {"max_model_len": 128},
            "trainer": {"max_token_len": 64},
        }
    )
    assert resolve_model(cfg) == tiny_dir
    assert resolve_tokenizer(cfg) == tiny_dir
    local = parse_config({"inference": {"model": str(tiny_dir)}})
    assert resolve_model(local) == tiny_dir
    with pytest.raises(ModelError, match="neither builtin:tiny nor an existing local directory"):
        resolve_model(parse_config({"inference": {"model": str(tmp_path / "missing")}}))
    with pytest.raises(ModelError, match=r"no config\.json"):
        resolve_model(parse_config({"inference": {"model": str(tmp_path)}}))
    with pytest.raises(ModelError, match="holds no tokenizer"):
        resolve_tokenizer(parse_config({"inference": {"tokenizer": str(tmp_path)}}))


def test_fingerprint_compares_vocabulary_and_special_ids(tmp_path: Path, tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    fp = tokenizer_fingerprint(tiny_dir)
    assert fp["vocab_size"] == 22
    assert fp["special_ids"] == {"bos": BOS_ID, "eos": EOS_ID, "pad": PAD_ID, "unk": UNK_ID}
    assert tokenizer_fingerprint(ensure_builtin_model(tmp_path, seed=5, max_model_len=64)) == fp
    tok: Any = AutoTokenizer.from_pretrained(str(tiny_dir))
    tok.add_tokens(["@"])
    tok.save_pretrained(str(tmp_path / "changed"))
    assert tokenizer_fingerprint(tmp_path / "changed")["fingerprint"] != fp["fingerprint"]
    assert tokenizer_fingerprint(tmp_path / "changed") == fingerprint_of(tok)


def test_fingerprint_reads_tokenizer_files_without_torch(tiny_dir: Path) -> None:
    code = (
        "import sys; from atroposd.models.resolve import tokenizer_fingerprint as f; import json;"
        "print(json.dumps(f(sys.argv[1]))); assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tiny_dir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    from transformers import AutoTokenizer

    assert json.loads(out.stdout) == fingerprint_of(AutoTokenizer.from_pretrained(str(tiny_dir)))


def test_chat_template_as_atroposlib_calls_it(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(str(tiny_dir))
    chat = [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]
    ids = tok.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert ids == [BOS_ID, *tok.convert_tokens_to_ids(list("3+4=7"))]
    assert tok.apply_chat_template(chat, tokenize=False) == "[BOS]3+4=7"

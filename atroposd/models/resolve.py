"""From the config's ``[inference] model`` / ``tokenizer`` to local directories, and the
tokenizer fingerprint every component compares (SPEC §3: one model, one tokenizer)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atroposd.config import Config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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
            raise ModelError(
                f"inference.tokenizer: {path} holds no tokenizer "
                "(no tokenizer.json, tokenizer_config.json or tokenizer.model)"
            )
        return path
    return resolve_model(cfg)


SPECIAL = ("bos", "eos", "pad", "unk")


def tokenizer_fingerprint(path: str | Path) -> dict[str, Any]:
    """``{"vocab_size", "fingerprint", "special_ids"}`` of the tokenizer saved at ``path``.

    A fast tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) is read with the
    tokenizers library alone (no torch, no transformers); anything else is loaded with
    ``AutoTokenizer``. Both give what :func:`fingerprint_of` gives for the loaded tokenizer.
    """
    path = Path(path)
    light = _light_fingerprint(path)
    if light is not None:
        return light
    from transformers import AutoTokenizer

    return fingerprint_of(AutoTokenizer.from_pretrained(str(path)))


def fingerprint_of(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The same fingerprint from a loaded tokenizer: two tokenizers that map every token to
    the same id and agree on the special ids have equal fingerprints."""
    special = {name: getattr(tokenizer, f"{name}_token_id", None) for name in SPECIAL}
    return _fingerprint(tokenizer.get_vocab(), len(tokenizer), special)


def _fingerprint(vocab: dict[str, int], size: int, special: dict[str, int | None]) -> dict[str, Any]:
    ordered = sorted(vocab.items(), key=lambda kv: (kv[1], kv[0]))
    digest = hashlib.sha256(json.dumps(ordered, ensure_ascii=False).encode()).hexdigest()
    return {"vocab_size": size, "fingerprint": digest[:32], "special_ids": special}


def _light_fingerprint(path: Path) -> dict[str, Any] | None:
    """The fingerprint from tokenizer.json and the special tokens of tokenizer_config.json
    (or special_tokens_map.json); None when those files are not there."""
    file, config = path / "tokenizer.json", path / "tokenizer_config.json"
    if not (file.is_file() and config.is_file()):
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(file))
    names: dict[str, Any] = {}
    for source in (path / "special_tokens_map.json", config):  # the config wins, as in transformers
        if source.is_file():
            data = json.loads(source.read_text())
            names.update({k: v for k, v in data.items() if k in {f"{n}_token" for n in SPECIAL} and v})
    special: dict[str, int | None] = {}
    for name in SPECIAL:
        token = names.get(f"{name}_token")
        if isinstance(token, dict):
            token = token.get("content")
        special[name] = tok.token_to_id(token) if isinstance(token, str) else None
    return _fingerprint(tok.get_vocab(with_added_tokens=True), tok.get_vocab_size(with_added_tokens=True), special)


def _local_dir(name: str, key: str, *, need: str | None) -> Path:
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelError(
            f"{key}: {name!r} is neither {BUILTIN_TINY} nor an existing local directory (models are never downloaded)"
        )
    if not path.is_dir():
        raise ModelError(f"{key}: {name!r} is not a directory")
    if need and not (path / need).is_file():
        raise ModelError(f"{key}: {name!r} is not a Hugging Face model directory (no {need})")
    return path.resolve()

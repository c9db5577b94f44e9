"""The job's tokenizer as a built-in environment needs it, loaded without torch or transformers.

Built-in environments only encode short prompts and decode short completions, so the
``tokenizers`` library and the special tokens named in ``tokenizer_config.json`` (or
``special_tokens_map.json``) are enough. Keeping transformers out keeps an environment child
small and quick to start.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class VocabError(ValueError):
    """The tokenizer directory cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class Vocab:
    """A loaded tokenizer plus the special ids an environment needs."""

    tokenizer: Any  # tokenizers.Tokenizer
    bos_id: int | None
    eos_id: int
    unk_id: int | None
    path: Path

    @classmethod
    def load(cls, directory: str | Path) -> Vocab:
        from tokenizers import Tokenizer

        path = Path(directory)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise VocabError(f"{path}: no tokenizer.json (a fast tokenizer is needed)")
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # the tokenizers library raises plain Exception subclasses
            raise VocabError(f"{file}: cannot load: {exc}") from exc
        special = _special_tokens(path)

        def token_id(role: str) -> int | None:
            name = special.get(f"{role}_token")
            if name is None:
                return None
            tid = tokenizer.token_to_id(name)
            if tid is None:
                raise VocabError(f"{path}: {role}_token {name!r} is not in the vocabulary")
            return int(tid)

        eos = token_id("eos")
        if eos is None:
            raise VocabError(
                f"{path}: no eos_token in tokenizer_config.json or special_tokens_map.json "
                "(completions must be able to end)"
            )
        return cls(tokenizer=tokenizer, bos_id=token_id("bos"), eos_id=eos, unk_id=token_id("unk"), path=path)

    def encode_prompt(self, text: str) -> list[int]:
        """BOS (when the tokenizer has one) followed by ``text``; a character the vocabulary
        lacks is an error, never a silent ``UNK``."""
        ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        if self.unk_id is not None and self.unk_id in ids:
            raise VocabError(f"prompt {text!r} has characters outside the vocabulary of {self.path}")
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def decode_completion(self, ids: Sequence[int]) -> tuple[str, bool]:
        """``(text before EOS, whitespace removed; whether EOS was generated)``.

        Special tokens other than EOS are kept in the text (as their names), so a completion
        that contains one is never mistaken for a well-formed answer.
        """
        ended = self.eos_id in ids
        body = list(ids[: list(ids).index(self.eos_id)] if ended else ids)
        text = self.tokenizer.decode(body, skip_special_tokens=False) if body else ""
        return "".join(text.split()), ended


def _special_tokens(path: Path) -> dict[str, str]:
    """``{"bos_token": "...", "eos_token": "...", ...}``: tokenizer_config.json first, then
    special_tokens_map.json; a value may be a string or ``{"content": ...}``."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        file = path / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise VocabError(f"{file}: cannot read: {exc}") from exc
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = data.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                found[key] = value  # tokenizer_config.json is read last and wins
    return found

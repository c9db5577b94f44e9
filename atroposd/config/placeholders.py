"""The ``{placeholders}`` of an environment's and an external API's command line: the names
the daemon fills in, the JSON Schema pattern of a command's arguments, and the filling."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

PLACEHOLDERS = (
    "api_url",
    "inference_url",
    "inference_urls",
    "openai_url",
    "model",
    "tokenizer",
    "group_size",
    "max_token_len",
    "steps",
    "name",
    "replica",
    "seed",
    "replica_port",
    "weight",
    "wandb_group",
    "inference_token",
)


def placeholder_pattern(known: Sequence[str]) -> str:
    """A string whose ``{identifier}`` braces are all known placeholders (other braces are free)."""
    return r"^(?:[^{]|\{(?:" + "|".join(known) + r")\}|\{(?![A-Za-z_][A-Za-z0-9_]*\}))*$"


PLACEHOLDER_RE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def unknown_placeholders(command: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    known = set(PLACEHOLDERS) | set(extra)
    return sorted({m for arg in command for m in PLACEHOLDER_RE.findall(arg) if m not in known})


def fill_placeholders(command: Sequence[str], values: Mapping[str, str]) -> list[str]:
    """Replace ``{name}`` placeholders (only known names; other braces are left alone)."""
    return [PLACEHOLDER_RE.sub(lambda m: values.get(m.group(1), m.group(0)), arg) for arg in command]

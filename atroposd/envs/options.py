"""Options of the built-in environments, validated by ``config check`` (no heavy imports here).

Each built-in environment declares its options as a dataclass; ``validate_options`` checks a
``[[env]] options`` table against it and returns ``(key, message)`` pairs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class ArithmeticOptions:
    """Options of the built-in ``arithmetic`` environment."""

    #: operands are drawn from 0..max_operand
    max_operand: int = 9
    #: operators used in prompts
    operators: tuple[str, ...] = field(default=("+",))
    #: completion length limit (digits + EOS)
    max_tokens: int = 3
    #: sampling temperature of rollouts
    temperature: float = 1.0
    #: prompts (groups) in flight at once
    concurrency: int = 8


BUILTIN_OPTIONS: dict[str, type] = {"arithmetic": ArithmeticOptions}


def parse_options(builtin: str, options: Mapping[str, Any]) -> Any:
    """Build the options object of a built-in environment; raises ValueError listing every problem."""
    problems = validate_options(builtin, options)
    if problems:
        raise ValueError("; ".join(f"options.{k}: {m}" if k else m for k, m in problems))
    cls = BUILTIN_OPTIONS[builtin]
    kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in options.items()}
    return cls(**kwargs)


def validate_options(builtin: str, options: Mapping[str, Any]) -> list[tuple[str, str]]:
    cls = BUILTIN_OPTIONS.get(builtin)
    if cls is None:
        return [("", f"unknown built-in environment {builtin!r}")]
    known = {f.name: f for f in fields(cls)}
    out: list[tuple[str, str]] = []
    for key, value in options.items():
        f = known.get(key)
        if f is None:
            out.append((key, f"unknown option (known: {', '.join(known)})"))
            continue
        default = f.default if f.default is not f.default_factory else f.default_factory()  # type: ignore[misc]
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
        elif isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
        elif isinstance(default, tuple):
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value) and len(value) > 0
        else:
            ok = isinstance(value, type(default))
        if not ok:
            out.append((key, f"must be {_describe(default)}, got {value!r}"))
    if builtin == "arithmetic" and "operators" in options and isinstance(options["operators"], list):
        bad = [o for o in options["operators"] if o not in ("+", "-", "*")]
        if bad:
            out.append(("operators", f"unknown operator(s) {bad} (known: '+', '-', '*')"))
    return out


def _describe(default: Any) -> str:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, int):
        return "a positive integer"
    if isinstance(default, float):
        return "a positive number"
    if isinstance(default, tuple):
        return "a non-empty array of strings"
    return type(default).__name__

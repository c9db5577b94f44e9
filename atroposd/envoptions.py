"""The built-in environments: their names and options, written once (a leaf: standard library only).

``config`` validates ``[[env]] builtin`` and ``options`` against this; ``envs/`` runs them.
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
    #: stop starting groups while this many trainer batches (of this environment's groups,
    #: queued and in flight together) wait at the API: bounds how stale a rollout gets. The
    #: trainer already fetches up to ``max_staleness`` batches ahead, so one more is enough to
    #: keep it fed
    max_batches_offpolicy: int = 1


BUILTIN_OPTIONS: dict[str, type[ArithmeticOptions]] = {"arithmetic": ArithmeticOptions}
#: The names a ``[[env]] builtin`` (and ``atroposd env NAME``) accepts.
BUILTIN_ENVS: tuple[str, ...] = tuple(BUILTIN_OPTIONS)


def options_schema(builtin: str) -> dict[str, Any]:
    """A JSON Schema of one built-in's ``options`` table (the per-option rules of ``validate_options``)."""
    cls = BUILTIN_OPTIONS[builtin]
    defaults = cls()
    props: dict[str, Any] = {}
    for f in fields(cls):
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            props[f.name] = {"type": "boolean"}
        elif isinstance(default, int):
            props[f.name] = {"type": "integer", "exclusiveMinimum": 0}
        elif isinstance(default, float):
            props[f.name] = {"type": "number", "exclusiveMinimum": 0}
        elif isinstance(default, tuple):
            props[f.name] = {"type": "array", "items": {"type": "string"}, "minItems": 1}
        else:
            props[f.name] = {"type": "string"}
        props[f.name]["default"] = list(default) if isinstance(default, tuple) else default
    return {"type": "object", "properties": props, "additionalProperties": False}


def parse_options(builtin: str, options: Mapping[str, Any]) -> ArithmeticOptions:
    """Build the options object of a built-in environment; raises ValueError listing every problem."""
    problems = validate_options(builtin, options)
    if problems:
        raise ValueError("; ".join(f"options.{k}: {m}" if k else m for k, m in problems))
    cls = BUILTIN_OPTIONS[builtin]
    kwargs: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in options.items()}
    return cls(**kwargs)


def validate_options(builtin: str, options: Mapping[str, Any]) -> list[tuple[str, str]]:
    cls = BUILTIN_OPTIONS.get(builtin)
    if cls is None:
        return [("", f"unknown built-in environment {builtin!r}")]
    known = {f.name: f for f in fields(cls)}
    defaults = cls()
    out: list[tuple[str, str]] = []
    for key, value in options.items():
        f = known.get(key)
        if f is None:
            out.append((key, f"unknown option (known: {', '.join(known)})"))
            continue
        default = getattr(defaults, key)
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
    if builtin == "arithmetic" and not {k for k, _ in out} & {"operators", "max_operand", "max_tokens"}:
        out.extend(_arithmetic_problems(options))
    return out


def _arithmetic_problems(options: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Cross-option rules: known operators, and room in max_tokens for every answer and EOS."""
    defaults = ArithmeticOptions()
    operators = options.get("operators", list(defaults.operators))
    bad = [o for o in operators if o not in ("+", "-", "*")]
    if bad:
        return [("operators", f"unknown operator(s) {bad} (known: '+', '-', '*')")]
    if len(set(operators)) != len(operators):
        return [("operators", f"duplicate operator in {operators}")]
    top = int(options.get("max_operand", defaults.max_operand))
    if top > 999:
        return [("max_operand", f"must be ≤ 999, got {top}")]
    extremes = {"+": (top + top,), "-": (-top, top), "*": (top * top,)}
    longest = max(len(str(v)) for op in operators for v in extremes[op])
    max_tokens = int(options.get("max_tokens", defaults.max_tokens))
    if max_tokens < longest + 1:
        return [
            (
                "max_tokens",
                f"must be ≥ {longest + 1} (the longest answer, {longest} characters, then EOS), got {max_tokens}",
            )
        ]
    return []


def _describe(default: object) -> str:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, int):
        return "a positive integer"
    if isinstance(default, float):
        return "a positive number"
    if isinstance(default, tuple):
        return "a non-empty array of strings"
    return type(default).__name__

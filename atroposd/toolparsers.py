"""The names ``[inference] tool_parser`` may take here, checked without importing vLLM or torch
(the config check's part of :mod:`atroposd.inference.tools`, kept at the bottom layer so that
the configuration can ask it)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

__all__ = ["AUTO", "BUILTIN_PARSERS", "available_parser_names", "have_vllm", "parser_problem", "vllm_parser_names"]

AUTO = "auto"
#: Parsers atroposd has itself (atroposd.inference.tools): available with or without vLLM.
BUILTIN_PARSERS = ("hermes",)


def have_vllm() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def vllm_parser_names() -> frozenset[str] | None:
    """The parser names vLLM registers, read from ``vllm/tool_parsers/__init__.py`` without
    importing vLLM; None when vLLM is not installed or the file does not list them as a
    dict literal (then a name is checked when the server makes the parser)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "tool_parsers" / "__init__.py"
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_TOOL_PARSERS_TO_REGISTER" for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            return frozenset(
                k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)
            )
    return None


def available_parser_names() -> frozenset[str] | None:
    """Every name ``tool_parser`` may take here besides ``""`` and ``auto``; None when vLLM is
    installed but its names cannot be read without importing it."""
    if not have_vllm():
        return frozenset(BUILTIN_PARSERS)
    names = vllm_parser_names()
    return None if names is None else names | frozenset(BUILTIN_PARSERS)


def parser_problem(name: str) -> str | None:
    """Why ``tool_parser = name`` cannot be had here (the config check's message), or None."""
    if name in ("", AUTO, *BUILTIN_PARSERS):
        return None
    names = available_parser_names()
    if names is None or name in names:
        return None
    if not have_vllm():
        return (
            f"parser {name!r} needs vLLM's tool parsers, and vLLM is not installed (pip install "
            f'\'atroposd[vllm]\'); available here: "hermes", "auto" or "" (off)'
        )
    import difflib

    close = difflib.get_close_matches(name, sorted(names), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"vLLM has no tool parser named {name!r}{hint}; known: {', '.join(sorted(names))}"

"""A configuration's problems: each with its key path, all of them raised at once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(Exception):
    """An invalid configuration; ``problems`` lists every one found."""

    def __init__(self, problems: Sequence[Problem], source: str = "") -> None:
        self.problems = list(problems)
        self.source = source
        head = f"invalid configuration {source}".rstrip() + f" ({len(self.problems)} problem"
        head += "s)" if len(self.problems) != 1 else ")"
        super().__init__(head + ":\n" + "\n".join(f"  {p}" for p in self.problems))

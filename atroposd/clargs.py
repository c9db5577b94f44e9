"""What every command line of the package shares: the ``-c`` flag, loading the config or
exiting 2, and checking flags against the config schema.

A leaf below the command lines: the top-level ``cli`` and each child's ``cli`` import it;
it imports only ``config`` and ``exitcodes``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from atroposd.config import Config, ConfigError, check_fields, load_config
from atroposd.exitcodes import Exit

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-c",
        "--config",
        metavar="FILE",
        help="config file (default: $ATROPOSD_CONFIG, ./atroposd.toml, "
        "/etc/atroposd/atroposd.toml, else the built-in defaults)",
    )


def load_or_exit(args: argparse.Namespace) -> Config:
    """Load the config named by ``-c`` (or discovered); print every problem and exit 2 if invalid."""
    try:
        return load_config(getattr(args, "config", None))
    except ConfigError as exc:
        print(f"atroposd: {exc}", file=sys.stderr)
        raise SystemExit(Exit.USAGE) from None


def apply_flags(
    section: DataclassInstance, prefix: str, args: argparse.Namespace, flags: Mapping[str, str]
) -> list[str]:
    """Set each given flag (``args`` attribute → the section's key in ``flags``) on a config
    section and check it against the schema's rules for that key (type, choices, bounds):
    one message per bad flag, naming it as typed (``--max-model-len must be ≥ 8, got 4``)."""
    given: dict[str, str] = {}
    for attr, key in flags.items():
        value = getattr(args, attr, None)
        if value is not None:
            setattr(section, key, value)
            given[key] = "--" + attr.replace("_", "-")
    return [f"{given[p.path.rsplit('.', 1)[-1]]} {p.message}" for p in check_fields(section, prefix, list(given))]

"""`atroposd envs`: flags and entry point (imports nothing heavy at module level)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this child's flags to its sub-parser (`-c` is already there)."""


def main(args: argparse.Namespace) -> int:
    raise SystemExit("atroposd envs: not implemented yet")

"""The seed every fuzz suite draws its cases from: fresh on each run, printed in the report
header (and again in the summary), and given back with ``--fuzz-seed N`` (or
``ATROPOSD_FUZZ_SEED=N``) to replay a failing run exactly.

Hypothesis suites take it with ``@hypothesis.seed(fuzzseed.SEED)`` and ``derandomize=False``;
plain ones draw from ``fuzzseed.rng("suite-name")`` (one independent stream per suite, so adding
a suite does not change another's cases)."""

from __future__ import annotations

import os
import random
import zlib

ENV = "ATROPOSD_FUZZ_SEED"


def _seed() -> int:
    value = os.environ.get(ENV, "")
    if value:
        try:
            return int(value, 0)
        except ValueError:
            raise SystemExit(f"{ENV}={value!r} is not an integer") from None
    seed = random.SystemRandom().randrange(1 << 32)
    os.environ[ENV] = str(seed)  # children and re-imports see the same seed
    return seed


SEED = _seed()


def rng(name: str) -> random.Random:
    """An independent generator for one suite, derived from the run's seed and the suite's name."""
    return random.Random((SEED << 32) ^ zlib.crc32(name.encode()))


def replay_hint() -> str:
    return f"fuzz seed {SEED} (replay: --fuzz-seed {SEED})"

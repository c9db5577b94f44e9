"""Faults injected into the daemon and its children from the tests, never from the package.

A test asks for faults with :func:`fault_env`; the variables it returns go into the environment
of the process it starts (``atroposd run``/``start``). ``PYTHONPATH`` then names this directory,
so every Python process of the job — the daemon, which runs the trainer loop, and its children,
which inherit the daemon's environment: inference servers, trainer ranks — imports
``sitecustomize`` from here, which installs the faults asked for in :data:`VAR`
(``fault_hooks.py``). See README.md here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["DIR", "VAR", "fault_env"]

DIR = Path(__file__).resolve().parent
VAR = "ATROPOSD_FAULTS"  # read by tests/faults/sitecustomize.py only


def fault_env(**faults: Any) -> dict[str, str]:
    """The environment that injects ``faults`` (name → its setting, see ``fault_hooks.FAULTS``) into
    every Python process started with it; an unknown name or a bad setting raises ValueError."""
    from tests.faults.fault_hooks import FAULTS, check

    for name, setting in faults.items():
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r} (known: {', '.join(sorted(FAULTS))})")
        check(name, setting)
    path = os.pathsep.join(p for p in (str(DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, VAR: json.dumps(faults)}

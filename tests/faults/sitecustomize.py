"""Imported at start by every Python process whose ``PYTHONPATH`` names this directory (the
``site`` module does it): installs the faults ``ATROPOSD_FAULTS`` asks for (tests/faults)."""

import os

if os.environ.get("ATROPOSD_FAULTS"):
    import json

    import fault_hooks  # beside this file, on PYTHONPATH

    fault_hooks.install(json.loads(os.environ["ATROPOSD_FAULTS"]))

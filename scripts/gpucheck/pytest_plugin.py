"""A pytest plugin for the ``gpu_tests`` phase (``-p gpucheck.pytest_plugin``).

* Each test's outcome is appended to ``$GPU_CHECK_TEST_LOG`` (one JSON line: file, test, outcome,
  seconds, message) the moment it is known, so a phase stopped at its deadline still names every
  test that ended (pytest's own JUnit report is written only at the session's end).
* Where torch sees no CUDA device (the rehearsal) every ``gpu``-marked test is skipped as needing
  one, so that the phase names and runs the same files on the CPU as on a GPU; where there is a
  GPU this does nothing.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

LOG_VAR = "GPU_CHECK_TEST_LOG"


def pytest_runtest_setup(item: Any) -> None:
    if item.get_closest_marker("gpu") is None:
        return
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none here)")


def pytest_runtest_logreport(report: Any) -> None:
    path = os.environ.get(LOG_VAR)
    if not path:
        return
    if report.when == "call":
        outcome = report.outcome  # passed, failed, skipped
    elif report.when == "setup" and not report.passed:
        outcome = "skipped" if report.skipped else "error"
    elif report.when == "teardown" and report.failed:
        outcome = "error"
    else:
        return
    message = None
    if not report.passed:
        longrepr = report.longrepr
        crash = getattr(longrepr, "reprcrash", None)
        if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
            message = str(longrepr[-1])
        else:
            message = str(crash.message if crash is not None else longrepr)
    file, _, test = report.nodeid.partition("::")
    row = {"file": file, "test": test, "when": report.when, "outcome": outcome, "s": round(report.duration, 3)}
    if message:
        row["message"] = message[:300]
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")

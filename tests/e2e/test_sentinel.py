"""The replica sentinel in whole jobs (SPEC §15): a healthy run's canary drift stays near 0, below
drift_limit, at every checked sync, and the daemon reports the time per check; a replica whose
weights did not arrive is resynced and let back; one that still drifts is restarted, then left
out while the job trains on the others."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.jobs import daemon_env, job_config, metrics, problem_lines, replica_job_config
from tests.faults import fault_env
from tests.support import atroposd


def _events(state: Path) -> list[dict[str, Any]]:
    log = (state / "logs" / "daemon.log").read_text()
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_corrupted_replicas_resynced_or_restarted_and_the_job_goes_on(short_tmp: Path) -> None:
    """Two replicas, each copying the weights (push): replica 0's weights are corrupted once,
    right after the sync that the first canary round checks — resynced, its drift falls, the log
    says the weights had not arrived; replica 1's after every update, also after its restart —
    resynced, restarted, still over: the job trains on replica 0 alone and says so. The canary
    prompts are the environment's own first prompts, kept in the checkpoints for a new start."""
    cfg = replica_job_config(
        short_tmp,
        replicas=2,
        steps=8,
        trainer={"weight_sync": "push"},
        health={"canary_every": 2, "canary_prompts": 4, "drift_limit": 0.05},
    )
    # update 1 is the attach, update n + 1 the sync of step n: replica 0's update 3 is step 2's
    env = {**daemon_env(), **fault_env(corrupt_weights={"inference-0": "3", "inference-1": "1+"})}
    res = atroposd("run", "-c", str(cfg), env=env, timeout=300)
    state = short_tmp / "state"
    assert res.returncode == 0, f"run exited {res.returncode}\n{problem_lines(res.stderr)}\n{res.stderr[-3000:]}"
    rows = metrics(state)
    assert [r["step"] for r in rows] == list(range(1, 9))  # it kept training
    events = _events(state)
    chosen = [e for e in events if e.get("event", "").startswith("canary prompts chosen from the environments")]
    assert chosen and chosen[0]["prompts"] == 4, [e.get("event") for e in events]

    # replica 0: over the limit at step 2, resynced, back under it: the weights had not arrived
    over = [e for e in events if str(e.get("event")).startswith("replica drift over the limit")]
    assert [(e["replica"], e["weight_version"]) for e in over][:2] == [(0, 2), (1, 2)], over
    fell = [e for e in events if e.get("cause") == "weights not arrived"]
    assert len(fell) == 1 and fell[0]["replica"] == 0 and fell[0]["drift_after"] < 1e-3, fell
    assert fell[0]["drift_before"] > 0.05
    # replica 1: still over after the resync, restarted (it got the weights before serving), still
    # over: quarantined, and the job goes on with replica 0
    restarting = [e for e in events if str(e.get("event")).startswith("replica still drifts after a resync")]
    assert [e["replica"] for e in restarting] == [1], restarting
    back = [e for e in events if e.get("event") == "replica restarted"]
    assert [e["unit"] for e in back] == ["inference-1"], back
    reattached = [
        n
        for n, e in enumerate(events)
        if str(e.get("event")).startswith("weights re-attached") and e.get("replica") == 1
    ]
    ready = [
        n
        for n, e in enumerate(events)
        if e.get("event") == "state" and e.get("unit") == "inference-1" and e.get("new") == "ready"
    ]
    assert len(reattached) == 1 and len(ready) == 2 and ready[0] < reattached[0] < ready[1], (
        "the restarted replica did not get the current weights before it served"
    )
    without = [e for e in events if "the job goes on without it" in str(e.get("event"))]
    assert len(without) == 1 and without[0]["replica"] == 1 and without[0]["serving"] == [0], without
    assert not [e for e in events if e.get("event") == "replica back in rotation" and e.get("replica") == 1]
    kept_out = [e["replica"] for e in events if e.get("event") == "replica still drifts: kept out of rotation"]
    assert kept_out == [1, 1, 1], kept_out  # the rounds at steps 4, 6 and 8: resynced, checked, not restarted
    # every later round: replica 0 near 0, replica 1 still over (kept out, never restarted again)
    drift = [r["replica_drift"] for r in rows]
    assert all(d[0] is not None and d[0] < 1e-3 for d in drift[1:]), drift
    assert all(d[1] is not None and d[1] > 0.05 for d in drift[1:]), drift
    rounds = [e for e in events if e.get("event") == "canary check"]
    assert len(rounds) == 8 // 2, rounds
    print("sentinel: seconds per canary round", [e["seconds"] for e in rounds])

    # the prompts are kept in the checkpoints: a new start of the job (both replicas healthy
    # now) checks with the same ones, and both replicas pass
    kept = torch.load(state / "checkpoints" / "step-8" / "trainer_state.pt", weights_only=False)["health"]
    assert len(kept["canary_prompts"]) == 4, kept
    text = cfg.read_text()
    assert "steps = 8\n" in text
    cfg.write_text(text.replace("steps = 8\n", "steps = 10\n"))
    res = atroposd("run", "-c", str(cfg), env=daemon_env(), timeout=300)
    assert res.returncode == 0, f"run exited {res.returncode}\n{problem_lines(res.stderr)}\n{res.stderr[-3000:]}"
    again = _events(state)[len(events) :]
    made = [e for e in again if e.get("event") == "replica sentinel"]
    assert made and made[0]["canary_source"].startswith("the checkpoint's"), made
    assert not [e for e in again if str(e.get("event")).startswith("canary prompts chosen")]
    last = metrics(state)[-1]
    assert last["step"] == 10 and all(d is not None and d < 1e-3 for d in last["replica_drift"]), last


@pytest.mark.slow
def test_two_ranks_score_the_canary_together(short_tmp: Path) -> None:
    """A healthy job on two gloo trainer ranks: every rank scores the canary (the sharded
    forward's collectives match) and rank 0's logprobs agree with the replica's: the drift stays
    near 0 at every checked sync (the first is not checked: canary_every = 2), and the daemon
    reports the seconds of each round. (One rank's healthy drift: the second run of the
    corrupted-replicas job above, both replicas healthy again.)"""
    cfg = job_config(
        short_tmp,
        steps=6,
        trainer={"device": ["cpu", "cpu"], "batch_size": 8, "micro_batch_size": 4, "join_timeout": 120.0},
        health={"canary_every": 2, "canary_prompts": 4, "drift_limit": 0.05},
    )
    res = atroposd("run", "-c", str(cfg), env=daemon_env(), timeout=300)
    assert res.returncode == 0, f"run exited {res.returncode}\n{problem_lines(res.stderr)}\n{res.stderr[-3000:]}"
    rows = metrics(short_tmp / "state")
    assert [r["step"] for r in rows] == list(range(1, 7))
    events = _events(short_tmp / "state")
    checks = [e for e in events if e.get("event") == "canary check"]
    rounds = [e["replica_drift"][0] for e in checks]
    assert len(rounds) == 3 and all(d is not None and d < 1e-3 for d in rounds), rounds  # float32: the same
    assert all(e["seconds"] > 0 for e in checks), checks  # the cost of each round is reported
    print("sentinel: seconds per canary round", [e["seconds"] for e in checks])
    assert rows[0]["replica_drift"] == [None], rows[0]  # the first sync is not checked (canary_every = 2)
    assert all(r["replica_drift"][0] is not None for r in rows[1:]), rows
    made = [e for e in events if e.get("event") == "replica sentinel"]
    assert made and made[0]["ranks"] == 2, made
    assert not [e for e in events if "drift over the limit" in str(e.get("event"))]

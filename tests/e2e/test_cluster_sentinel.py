"""The replica sentinel across machines (SPEC §15, §12.3), as two daemons on one machine: the
head's canaries reach node 1's replica (node 1 generates, the head's trainer scores), a corruption
of node 1's replica's weights is found from the head, the replica is quarantined, resynced and let
back by its own node at the head's word over the signed cluster link, and training goes on;
``status`` on the head shows every replica's drift."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.jobs import (
    SHORT_TASK,
    cluster_configs,
    daemon_env,
    metrics,
    processes_of_instance,
    segments_of,
    status,
)
from tests.faults import fault_env
from tests.support import wait_for

HEALTH = "\n[health]\ncanary_every = 1\ncanary_prompts = 4\ndrift_limit = 0.05\n"


def _popen(cfg: Path, log: Path, extra: dict[str, str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, **daemon_env(), **extra}
    env.pop("ATROPOSD_CONFIG", None)
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "atroposd", "run", "-c", str(cfg)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _events(*logs: Path) -> list[dict[str, Any]]:
    out = []
    for log in logs:
        for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    return out


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _drift(cfg: Path) -> list[Any]:
    sentinel = (status(cfg).get("trainer") or {}).get("sentinel") or {}
    return [sentinel.get("replicas"), sentinel.get("replica_drift")]


@pytest.mark.slow
def test_node1_replica_corrupted_once_is_found_from_the_head_and_healed(short_tmp: Path) -> None:
    steps = 16
    cfgs = cluster_configs(short_tmp, steps=steps, envs=SHORT_TASK, trainer={"checkpoint_every": steps})
    for cfg in cfgs:
        cfg.write_text(cfg.read_text() + HEALTH)
    # node 1's replica adds noise to its weights after its 4th weight update, once
    node = _popen(cfgs[1], short_tmp / "node1.log", fault_env(corrupt_weights={"inference": "4"}))
    procs = [node]
    nonces: list[str] = []
    try:
        wait_for(
            lambda: any("waiting for the head" in str(e.get("event")) for e in _events(short_tmp / "node1.log")),
            timeout=60,
            what="node 1 waiting for its head",
        )
        head = _popen(cfgs[0], short_tmp / "head.log", {})
        procs.insert(0, head)
        wait_for(lambda: status(cfgs[0])["state"] == "running", timeout=240, interval=0.5, what="the head READY")
        nonces = [status(c)["instance"] for c in cfgs]
        # status on the head: every replica's drift, its own and node 1's
        seen: list[Any] = []

        def both_checked() -> bool:
            seen[:] = _drift(cfgs[0])
            names, drift = seen
            return names == ["0", "node 1 replica 0"] and drift is not None and None not in drift

        wait_for(both_checked, timeout=180, interval=0.5, what="both replicas checked from the head")
        assert head.wait(600) == 0
        assert node.wait(120) == 0
    finally:
        for p in procs:
            _stop(p)
    wait_for(lambda: not any(processes_of_instance(n) for n in nonces), timeout=60, what="every process gone")
    for n in nonces:
        assert not segments_of(n), segments_of(n)
    rows = metrics(short_tmp / "node0" / "state")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # training went on
    assert all(len(r["replica_drift"]) == 2 for r in rows), [r["replica_drift"] for r in rows]
    assert all(d is not None and d < 0.05 for d in rows[-1]["replica_drift"]), rows[-1]["replica_drift"]
    head_events = _events(short_tmp / "head.log", *(short_tmp / "node0" / "state" / "logs").glob("*.log"))
    node_events = _events(short_tmp / "node1.log", *(short_tmp / "node1" / "state" / "logs").glob("*.log"))
    assert any("weights were corrupted" in str(e.get("event")) for e in node_events), "the fault never acted"
    found = [e for e in head_events if e.get("event") == "replica drift over the limit: quarantined, syncing it again"]
    assert found and all(e.get("where") == "node 1 replica 0" for e in found), found
    healed = [e for e in head_events if "drift fell after a resync" in str(e.get("event"))]
    assert healed and healed[0]["cause"] == "weights not arrived", healed
    # node 1 quarantined and released its replica at the head's word (the signed cluster messages)
    words = [str(e.get("event")) for e in node_events]
    assert "replica quarantined at the head's word" in words, words[-40:]
    assert "replica back in rotation at the head's word" in words, words[-40:]
    # the head's own replica was never touched
    assert not [e for e in found if e.get("replica") == 0 and "where" not in e]

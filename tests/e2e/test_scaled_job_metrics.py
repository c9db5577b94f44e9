"""Watching a job with two trainer ranks and two inference replicas (SPEC §12.1, §12.2), one real
job through the command line: `atroposd status` shows the ranks, `/metrics` has each replica's
generations and weight_version and the per-step gather and sync time, metrics.jsonl rows carry
`gather_s` (> 0: the ranks gather the sharded weights) and `replica_generations`, the Grafana
dashboard's queries resolve, and stop leaves nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from atroposd.config import load_config
from tests.e2e.jobs import (
    component,
    daemon_env,
    metrics,
    processes_of_instance,
    replica_health,
    replica_job_config,
    status,
)
from tests.e2e.test_watching import dashboard_metrics, samples, scrape, value
from tests.support import atroposd, wait_for


def _config(root: Path) -> Path:
    return replica_job_config(
        root,
        steps=100_000,
        metrics_port=True,
        daemon={"stop_timeout": 5.0},
        trainer={
            "device": ["cpu", "cpu"],
            "batch_size": 16,
            "micro_batch_size": 4,
            "join_timeout": 120.0,
            "checkpoint_every": 100_000,
        },
    )


@pytest.mark.slow  # a whole job or a long search: run by .ci/run, not in the default run
def test_two_ranks_two_replicas_status_metrics_and_rows(short_tmp: Path) -> None:
    cfg = _config(short_tmp)
    metrics_port = load_config(cfg).daemon.metrics_port
    state = short_tmp / "state"
    res = atroposd("start", "-c", str(cfg), env=daemon_env(), timeout=300)
    nonce = ""
    try:
        assert res.returncode == 0, f"start exited {res.returncode}: {res.stderr[-3000:]}"
        st = status(cfg)
        nonce = st["instance"]
        assert st["trainer"]["ranks"] == 2 and component(st, "trainer-1")["kind"] == "trainer"
        wait_for(
            lambda: len(metrics(state)) >= 4 and all(replica_health(cfg, i)["generations"] >= 1 for i in (0, 1)),
            timeout=180,
            interval=0.5,
            what="4 steps and both replicas serving",
        )

        # the human status: both ranks and both replicas
        human = atroposd("status", "-c", str(cfg), timeout=30)
        assert human.returncode == 0, human.stderr
        assert "trainer: 2 ranks, 0 group restarts" in human.stdout, human.stdout
        for name in ("trainer-1", "inference-0", "inference-1"):
            assert name in human.stdout, human.stdout

        # /metrics: each replica's generations and weight_version, the gather and sync time
        def polled(families: list[Any]) -> bool:  # the daemon polls each replica's /health every 2 s
            return all(
                value(families, "atroposd_replica_generations_total", component=f"inference-{i}") >= 1
                and value(families, "atroposd_replica_weight_version", component=f"inference-{i}") >= 1
                for i in (0, 1)
            )

        wait_for(
            lambda: polled(scrape(metrics_port)[0]),
            timeout=30,
            interval=0.5,
            what="the daemon's poll to see both replicas serve trained weights",
        )
        families, _ = scrape(metrics_port)
        for i in (0, 1):
            assert value(families, "atroposd_inference_weight_version", component=f"inference-{i}") >= 1
        assert value(families, "atroposd_trainer_last_gather_seconds", component="trainer") > 0
        assert value(families, "atroposd_trainer_gather_seconds_total", component="trainer") > 0
        sync_total = value(families, "atroposd_trainer_step_seconds_total", component="trainer", part="sync")
        assert sync_total >= value(families, "atroposd_trainer_gather_seconds_total", component="trainer")
        # (the sandbox panels' series exist with [sandbox] engine set: tests/sandbox/test_proxy.py)
        served = {s.name for s in samples(families)}
        missing = {m for m in dashboard_metrics() - served if not m.startswith("atroposd_sandbox_")}
        assert not missing, f"the dashboard queries metrics the job does not serve: {sorted(missing)}"
    finally:
        stopped = atroposd("stop", "-c", str(cfg), env=daemon_env(), timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    if nonce:
        wait_for(lambda: not processes_of_instance(nonce), timeout=30, what="every process of the job gone")

    # metrics.jsonl: every row has the step's gather time (inside its sync time) and each replica's count
    rows = metrics(state)
    assert len(rows) >= 4
    for r in rows:
        assert 0 < r["gather_s"] <= r["sync_s"], r
        assert isinstance(r["replica_generations"], list) and len(r["replica_generations"]) == 2, r
    last = rows[-1]["replica_generations"]
    assert all(isinstance(n, int) and n >= 1 for n in last), last
    for i in (0, 1):  # counts last known: never falling while a replica lives
        seen = [r["replica_generations"][i] for r in rows if r["replica_generations"][i] is not None]
        assert seen == sorted(seen), seen

"""Watching a live job: the whole job's /metrics (every component, a valid exposition, within
its deadline while a child is stopped), the Grafana dashboard's queries, and W&B offline
across a resume (the same run)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from atroposd.daemon.metrics import CACHE_S
from tests.e2e.jobs import component, daemon_env, job_config, metrics, status
from tests.support import atroposd, free_port, wait_for

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "atroposd.json"


def scrape(port: int) -> tuple[list[Any], float]:
    start = time.monotonic()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=15).read().decode()
    took = time.monotonic() - start
    return list(text_string_to_metric_families(text)), took  # the parser refuses an invalid page


def samples(families: list[Any]) -> list[Any]:
    return [s for f in families for s in f.samples]


def value(families: list[Any], name: str, **labels: str) -> float:
    for s in samples(families):
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    raise AssertionError(f"no sample {name}{labels}")


def dashboard_metrics() -> set[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert exprs, "the dashboard queries nothing"
    return {name for e in exprs for name in re.findall(r"\batroposd_[A-Za-z0-9_:]+", e)}


@pytest.mark.slow
def test_one_metrics_page_for_the_live_job_and_the_dashboard_resolves(short_tmp: Path) -> None:
    pytest.importorskip("wandb")
    port = free_port()
    cfg = job_config(
        short_tmp, steps=100_000, daemon={"metrics_port": port}, wandb={"project": "atroposd-e2e", "mode": "offline"}
    )
    res = atroposd("start", "-c", str(cfg), env=daemon_env(), timeout=240)
    inference_pid = None
    try:
        assert res.returncode == 0, f"start exited {res.returncode}: {res.stderr[-3000:]}"
        wait_for(lambda: status(cfg)["trainer"]["step"] >= 3, timeout=120, what="training steps")
        families, _ = scrape(port)
        names = {s.name for s in samples(families)}
        components = {s.labels.get("component") for s in samples(families)}
        assert {"daemon", "trainer", "api", "inference", "arithmetic-0"} <= components, components
        assert all("component" in s.labels for s in samples(families))
        assert all(f.name.startswith("atroposd_") for f in families)
        for c in ("daemon", "trainer", "api", "inference"):
            assert value(families, "atroposd_component_up", component=c) == 1.0
        assert value(families, "atroposd_component_state", component="arithmetic-0", state="ready") == 1.0
        assert value(families, "atroposd_trainer_step", component="trainer") >= 3
        assert value(families, "atroposd_inference_generated_tokens_total", component="inference") > 0
        assert value(families, "atroposd_api_batches_served_total", component="api") >= 3
        for part in ("data_wait", "compute", "sync"):
            assert value(families, "atroposd_trainer_step_seconds_total", part=part) > 0, part
        assert value(families, "atroposd_inference_pauses_total", component="inference") >= 3  # shared: one a step
        assert value(families, "atroposd_api_refused_total", reason="full") == 0  # known reasons from 0
        # (the sandbox panels' series exist with [sandbox] engine set: tests/sandbox/test_proxy.py)
        missing = {m for m in dashboard_metrics() - names if not m.startswith("atroposd_sandbox_")}
        assert not missing, f"the dashboard queries metrics the job does not serve: {sorted(missing)}"

        # a stopped child: the page still answers within its deadline, the child shows as down
        inference_pid = component(status(cfg), "inference")["pid"]
        os.kill(inference_pid, signal.SIGSTOP)
        time.sleep(CACHE_S)  # past the page the first scrape left (a scrape within it gets that page)
        families, took = scrape(port)
        assert took < 4.0, f"the scrape took {took:.1f}s with a stopped child"
        assert value(families, "atroposd_component_up", component="inference") == 0.0
        assert value(families, "atroposd_component_up", component="api") == 1.0
        os.kill(inference_pid, signal.SIGCONT)
        inference_pid = None
        stopped_at = status(cfg)["trainer"]["step"]
    finally:
        if inference_pid is not None:
            os.kill(inference_pid, signal.SIGCONT)
        stopped = atroposd("stop", "-c", str(cfg), timeout=120)
    assert stopped.returncode == 0, stopped.stderr

    # W&B offline: the run holds the steps; a resumed job continues the same run
    from tests.trainer.test_wandb_sink import history, offline_runs

    state = short_tmp / "state"
    (first,) = offline_runs(state)
    logged = [r["step"] for r in history(first)]
    trained = [r["step"] for r in metrics(state)]
    assert logged[:stopped_at] == list(range(1, stopped_at + 1)) and logged == trained
    last = trained[-1]
    cfg = job_config(
        short_tmp, steps=last + 3, daemon={"metrics_port": port}, wandb={"project": "atroposd-e2e", "mode": "offline"}
    )
    res = atroposd("run", "-c", str(cfg), env=daemon_env(), timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    runs = offline_runs(state)
    assert len(runs) == 2 and runs[0].name == runs[1].name  # run-<the same id>.wandb
    assert [r["step"] for r in history(runs[1])] == list(range(last + 1, last + 4))

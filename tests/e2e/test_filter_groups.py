"""filter_groups in a real job (SPEC §14): an environment posts one group in three with all
scores equal; those are counted (metrics.jsonl, status, /metrics), never trained, and every
batch is full. When every group it sends is equal, the trainer waits and says why, and goes on
when trainable groups come again."""

from __future__ import annotations

import math
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.jobs import daemon_env, job_config, metrics, status
from tests.support import REPO, atroposd, free_port, wait_for

GROUP = 8
BATCH = 32


def _filtered_counter(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=15).read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "atroposd_trainer_filtered_groups_total":
                return float(s.value)
    raise AssertionError("no atroposd_trainer_filtered_groups on /metrics")


def _starved_at(cfg: Path) -> int | None:
    """The step the trainer stands at, waiting because every group received was filtered."""
    first = status(cfg)["trainer"]
    if first["state"] != "waiting" or first["waiting_for"] != "filtered":
        return None
    time.sleep(1.0)
    again = status(cfg)["trainer"]
    if again["state"] != "waiting" or again["waiting_for"] != "filtered" or again["step"] != first["step"]:
        return None
    return int(again["step"])


@pytest.mark.slow
def test_filter_groups_counts_all_equal_groups_and_trains_full_batches(short_tmp: Path) -> None:
    flag = short_tmp / "only-equal"
    port = free_port()
    env = {
        "name": "equal",
        "command": [
            sys.executable,
            str(REPO / "tests" / "e2e" / "equal_groups_env.py"),
            "{api_url}",
            str(GROUP),
            str(flag),
        ],
        "group_size": GROUP,
    }
    cfg = job_config(
        short_tmp,
        steps=100_000,
        envs=[env],
        daemon={"metrics_port": port},
        trainer={"batch_size": BATCH, "micro_batch_size": BATCH, "filter_groups": True, "checkpoint_every": 100_000},
    )
    res = atroposd("start", "-c", str(cfg), env=daemon_env(), timeout=300)
    try:
        assert res.returncode == 0, f"start exited {res.returncode}: {res.stderr[-3000:]}"
        wait_for(lambda: status(cfg)["trainer"]["step"] >= 10, timeout=180, interval=0.5, what="10 steps")
        # every group from now on has equal scores: nothing to train, the trainer waits visibly
        flag.touch()
        # A fetch of equal groups alone also happens while mixed groups flow (one in three is
        # equal), and the trainable groups queued before the flag train first: starved means
        # waiting for "filtered" with the step standing still for a second.
        waiting_at = wait_for(  # a step past the first 10: never 0
            lambda: _starved_at(cfg),
            timeout=90,
            interval=0.3,
            what="the trainer waiting because every group was filtered",
        )
        shown = atroposd("status", "-c", str(cfg), timeout=60).stdout
        assert "equal scores" in shown, shown
        wait_for(
            lambda: status(cfg)["trainer"]["filtered_groups"] >= 40,
            timeout=60,
            interval=0.3,
            what="equal groups dropped while waiting",
        )
        before = status(cfg)["trainer"]
        scraped = _filtered_counter(port)
        after = status(cfg)["trainer"]
        assert before["filtered_groups"] <= scraped <= after["filtered_groups"]
        assert after["step"] <= waiting_at + 1 and after["state"] == "waiting"  # no batch is formed of them
        counted = after["filtered_groups"]
        flag.unlink()
        wait_for(
            lambda: status(cfg)["trainer"]["step"] >= waiting_at + 5,
            timeout=60,
            interval=0.3,
            what="training going on with trainable groups",
        )
    finally:
        assert atroposd("stop", "-c", str(cfg), timeout=120).returncode == 0
    rows = metrics(short_tmp / "state")
    assert len(rows) >= waiting_at + 5
    per_step = [r["filtered_groups"] for r in rows]
    assert sum(per_step) >= counted >= 40
    for r in rows:
        assert r["sequences"] == BATCH  # every batch full
        # trained groups score 0, 1, 0, 1 …: a dropped (0.9) group trained would move this off 0.5
        assert r["reward_mean_trained"] == 0.5
        n = r["filtered_groups"] * GROUP
        expected = (0.5 * BATCH + 0.9 * n) / (BATCH + n)  # reward_mean: every group received
        assert math.isclose(r["reward_mean"], expected, rel_tol=1e-9), (r["reward_mean"], expected)
        assert math.isclose(
            r["accuracy"],
            (0.5 * BATCH / GROUP + r["filtered_groups"]) / (BATCH / GROUP + r["filtered_groups"]),
            rel_tol=1e-9,
        )

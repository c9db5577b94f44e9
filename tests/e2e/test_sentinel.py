"""The replica sentinel in a whole job (SPEC §15): a healthy run's canary drift stays near 0,
below drift_limit, at every checked sync, and the daemon reports the time per check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.jobs import daemon_env, job_config, metrics
from tests.support import atroposd


@pytest.mark.slow
def test_healthy_job_drift_stays_near_zero(short_tmp: Path) -> None:
    cfg = job_config(short_tmp, steps=12, health={"canary_every": 2, "canary_prompts": 4, "drift_limit": 0.05})
    res = atroposd("run", "-c", str(cfg), env=daemon_env(), timeout=300)
    assert res.returncode == 0, f"run exited {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    rows = metrics(short_tmp / "state")
    assert [r["step"] for r in rows] == list(range(1, 13))
    drift = [r["replica_drift"] for r in rows]
    assert drift[0] == [None], drift  # the first sync is not checked (canary_every = 2)
    checked = [d[0] for d in drift[1:] if d[0] is not None]
    assert checked, drift
    assert all(d < 1e-3 for d in checked), drift  # float32 on the CPU: the same weights, the same tokens
    log = (short_tmp / "state" / "logs" / "daemon.log").read_text()
    events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert not [e for e in events if "drift over the limit" in str(e.get("event"))]
    # the cost of each check is reported: one line per round, with its seconds
    rounds = [e for e in events if e.get("event") == "canary check"]
    assert len(rounds) == 12 // 2 and all(e["seconds"] > 0 for e in rounds), rounds
    print("sentinel: seconds per canary round", [e["seconds"] for e in rounds])

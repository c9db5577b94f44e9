"""The external trainer of docs/EXTERNAL-TRAINER.md, verbatim, trains against a real job
(``trainer.enabled = false``): it pulls batches through shared memory, takes optimizer steps and
gives the inference server every new version of its weights."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from atroposd.client import InferenceControl
from tests.e2e.jobs import daemon_env, job_config
from tests.support import REPO, atroposd

DOC = REPO / "docs" / "EXTERNAL-TRAINER.md"
MARKER = "<!-- trainer-example -->\n```python\n"
STEPS = 3


def example_source() -> str:
    text = DOC.read_text()
    assert MARKER in text, "the documented trainer example is marked for this test"
    return text.split(MARKER, 1)[1].split("```", 1)[0]


def test_documented_example_is_short() -> None:
    assert len(example_source().strip().splitlines()) < 40


@pytest.mark.slow  # a whole job or a long search: run by .ci/run, not in the default run
def test_documented_trainer_trains_against_a_job(short_tmp: Path) -> None:
    cfg = job_config(short_tmp, trainer={"enabled": False, "batch_size": 16, "micro_batch_size": 16})
    script = short_tmp / "trainer.py"
    script.write_text(example_source())
    res = atroposd("start", "-c", str(cfg), env=daemon_env(), timeout=240)
    try:
        assert res.returncode == 0, f"start exited {res.returncode}: {res.stderr[-3000:]}"
        from atroposd.config import load_config
        from atroposd.models.resolve import resolve_model

        config = load_config(cfg)
        model_dir, port = resolve_model(config), config.api.port
        run = subprocess.run(
            [sys.executable, str(script), f"http://127.0.0.1:{port}", str(model_dir), str(cfg), str(STEPS)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=short_tmp,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert run.returncode == 0, f"the example trainer failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
        steps = [line for line in run.stdout.splitlines() if line.startswith("step ")]
        assert len(steps) == STEPS, run.stdout
        assert InferenceControl.from_config(cfg).weight_version() == STEPS, "the server runs the newest weights"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        acks = [
            line
            for line in metrics.splitlines()
            if line.startswith("atroposd_api_request_seconds_count") and 'route="/batch/ack"' in line
        ]
        assert acks and float(acks[0].split()[-1]) >= STEPS, "every batch came through shared memory"
    finally:
        assert atroposd("stop", "-c", str(cfg), timeout=120).returncode == 0

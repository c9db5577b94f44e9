"""scripts/gpu-check's preparation, as a dry run: what travels to a GPU machine (the wheel list,
the Qwen-shaped model's files, the job configs) is complete, passes ``config check`` and stays
under 64 MiB; the GPU run itself needs a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # builds the tiny tokenizer and checks three configs in subprocesses
def test_the_dry_run_prepares_wheels_list_model_and_jobs(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu-check"), "prepare", "--dry-run", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["dry_run"] is True and summary["bytes"] < 64 << 20

    # the wheels: atroposd's own dependencies, pinned, never torch's environment
    names = {r.split("==")[0] for r in summary["requirements"]}
    assert {
        "aiohttp",
        "anyio",
        "orjson",
        "structlog",
        "peft",
        "nvidia-ml-py",
        "pytest",
        "hypothesis",
        "torch-optimi",
    } <= names
    assert not names & {"torch", "transformers", "tokenizers", "safetensors", "numpy", "triton"}
    assert (out / "requirements.txt").read_text().split() == summary["requirements"]

    # the model: Qwen2.5-0.5B's shape (its weights are drawn on the GPU machine, not carried)
    assert 4.5e8 < summary["parameters"] < 5.5e8
    config = json.loads((out / "qwen-0.5b" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["num_hidden_layers"] == 24
    assert (out / "qwen-0.5b" / "tokenizer.json").exists()
    assert not list((out / "qwen-0.5b").glob("*.safetensors"))

    # the jobs: shared, push through CUDA IPC, push through host staging to a second replica;
    # bf16 compute with float32 master weights (each passed config check in the script)
    jobs = {name: tomllib.loads(Path(p).read_text()) for name, p in summary["configs"].items()}
    assert set(jobs) == {"shared", "push_cuda_ipc", "push_host_staging"}
    for job in jobs.values():
        assert job["trainer"]["dtype"] == "float32" and job["trainer"]["compute_dtype"] == "bfloat16"
        assert job["inference"]["engine"] == "torch" and job["trainer"]["device"] == "cuda:0"
    assert jobs["shared"]["trainer"]["weight_sync"] == "shared"
    assert jobs["push_cuda_ipc"]["trainer"]["weight_sync"] == "push"
    assert jobs["push_cuda_ipc"]["inference"]["device"] == "cuda:0"
    staged = jobs["push_host_staging"]
    assert staged["trainer"]["push_path"] == "host_staging" and staged["inference"]["replicas"] == 2


def test_the_prepared_folder_is_ignored_by_git() -> None:
    res = subprocess.run(["git", "check-ignore", "-q", ".gpu-check/wheels/x.whl"], cwd=ROOT)
    assert res.returncode == 0

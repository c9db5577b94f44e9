"""scripts/gpu-check: its CPU rehearsal runs every phase of the GPU proof here (gloo for NCCL, POSIX
shared memory for CUDA IPC, the built-in tiny model) and writes the same ``gpu-check.jsonl``; a
run killed at any moment leaves every finished phase in that file; a phase past its deadline is
stopped and recorded; ``prepare --dry-run`` writes what travels to a GPU machine (the pinned wheel
list for CPython 3.10-3.13, the Qwen-shaped model's files, the job configs, each checked)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import tomllib
from packaging.requirements import Requirement

from tests.support import wait_for

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check"
PHASES = [
    "preflight",
    "install",
    "model",
    "nccl",
    "ipc",
    "ipc_expandable",
    "bandwidth",
    "job_push",
    "gpu_tests",
    "job_shared",
    "job_host_staging",
]


def _rehearse(tmp: Path, *args: str) -> subprocess.Popen[str]:
    """``gpu-check run --rehearse`` in a session of its own (the test can kill its whole group)."""
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.Popen(
        [
            sys.executable,
            str(SCRIPT),
            "run",
            "--rehearse",
            "--out",
            str(tmp / "out"),
            "--work",
            str(tmp / "work"),
            *args,
            str(tmp),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)
    if proc.stdout is not None:
        proc.stdout.close()


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # every phase for real: about 75 s of CPU time
@pytest.mark.timeout(900)  # on two cores shared with other test runs it has taken 3 to 5 minutes
def test_the_rehearsal_runs_every_phase_on_the_cpu(short_tmp: Path) -> None:
    t0 = time.monotonic()
    proc = _rehearse(short_tmp)
    try:
        out, _ = proc.communicate(timeout=840)
    finally:
        _kill_group(proc)
    wall = time.monotonic() - t0
    rows = _lines(short_tmp / "out" / "gpu-check.jsonl")
    assert [r["phase"] for r in rows] == PHASES, out[-3000:]
    bad = {r["phase"]: (r.get("reason"), r.get("error"), r["log_tail"][-1500:]) for r in rows if r["status"] != "ok"}
    assert not bad, bad
    assert proc.returncode == 0, out[-3000:]
    print(f"rehearsal: {wall:.1f} s; " + ", ".join(f"{r['phase']} {r['wall_s']} s" for r in rows))
    by = {r["phase"]: r for r in rows}
    for r in rows:
        assert r["rehearse"] is True and r["device"] == "cpu" and r["wall_s"] > 0 and "log_tail" in r
        assert all(c["ok"] for c in r["checks"]), r["checks"]

    pre = by["preflight"]["figures"]
    assert Path(pre["atroposd_file"]).resolve().is_relative_to(ROOT)
    assert pre["HF_HUB_OFFLINE"] == "1" and pre["dev_shm"]["total_bytes"] > 0
    assert pre["commit"] or not (ROOT / ".git").exists()  # the commit, wherever the checkout is a git one
    assert Path(by["install"]["figures"]["atroposd_file"]).resolve().is_relative_to(ROOT)

    nccl = {c["name"]: c for c in by["nccl"]["checks"]}
    assert nccl["the group's backend is gloo"]["ok"]
    assert nccl["temperature reaches the root in float32"]["detail"]["dtype"] == "float32"
    assert nccl["the checkpoint reads back equal"]["ok"] and nccl["an aborted group refuses a broadcast"]["ok"]
    assert len(by["nccl"]["figures"]["kahan_steps"]) == 2 == len(by["nccl"]["figures"]["float32_master_steps"])

    for name in ("ipc", "ipc_expandable"):
        ipc = by[name]["figures"]
        assert ipc["transport"] == "shm" and ipc["syncs"] == 100 and ipc["replica_versions"] == [100]
        assert ipc["server_exit"] == -9 and ipc["sync_median_s"] > 0
    assert by["ipc_expandable"]["env"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert by["ipc_expandable"]["figures"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"

    bw = by["bandwidth"]["figures"]
    assert (
        bw["device_to_host_gb_per_s"] > 0 and bw["host_to_device_gb_per_s"] > 0 and bw["device_to_device_gb_per_s"] > 0
    )

    tests = by["gpu_tests"]["figures"]
    assert "tests/weights/test_cuda_ipc.py" in tests["files"]
    assert set(tests["tests"]) == set(tests["files"])  # every file named, each test's outcome
    assert {t["outcome"] for ts in tests["tests"].values() for t in ts} == {"skipped"}  # no CUDA here

    for name in ("job_push", "job_shared", "job_host_staging"):
        job = by[name]["figures"]
        assert job["steps"] == 6 and job["sync_median_s"] is not None, job
        assert job["precision"]["compute_dtype"] == "float32", job["precision"]
    push = by["job_push"]["figures"]
    assert push["sync_transfer_median_s"] > 0 and push["transfer_gb_per_s"] > 0 and push["weights_bytes"] > 0


@pytest.mark.slow  # three phases for real, killed while the fourth runs (~20 s)
def test_a_rehearsal_killed_mid_run_leaves_every_finished_phase(short_tmp: Path) -> None:
    jsonl = short_tmp / "out" / "gpu-check.jsonl"
    proc = _rehearse(short_tmp, "--phases", "preflight,install,model,nccl,bandwidth")
    try:
        wait_for(lambda: len(_lines(jsonl)) >= 3 or proc.poll() is not None, timeout=240, what="three phases")
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.5)  # the next phase (nccl) is under way
    finally:
        _kill_group(proc)  # SIGKILL of the run's whole process group
    rows = _lines(jsonl)  # every line whole
    names = [r["phase"] for r in rows]
    assert names == ["preflight", "install", "model", "nccl", "bandwidth"][: len(names)] and len(names) >= 3
    assert all(r["status"] == "ok" for r in rows), rows
    assert (short_tmp / "out" / "logs" / "nccl.log").exists()  # the phase that was killed had started


def test_a_phase_past_its_deadline_is_stopped_and_recorded(short_tmp: Path) -> None:
    """A phase that outlives its deadline is stopped with what it started, recorded as failed with
    its log's tail, and the run goes on; phases the run's deadline leaves no time for are skipped."""
    proc = _rehearse(short_tmp, "--phases", "preflight,install", "--phase-deadline", "0.3", "--deadline", "10.2")
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        _kill_group(proc)
    rows = _lines(short_tmp / "out" / "gpu-check.jsonl")
    assert [r["phase"] for r in rows] == ["preflight", "install"], out
    first = rows[0]
    assert first["status"] == "failed" and "deadline" in first["reason"] and first["deadline_s"] == 0.3
    assert "gpu-check phase preflight" in first["log_tail"] or first["log_tail"] == ""
    assert rows[1]["status"] == "skipped" and "deadline" in rows[1]["reason"]
    assert proc.returncode == 1


def test_a_run_stopped_by_sigterm_records_the_phase_under_way(short_tmp: Path) -> None:
    """SIGTERM of the run (a caller's timeout) stops the phase under way, with what it started,
    and records it before the run exits."""
    log = short_tmp / "out" / "logs" / "preflight.log"
    proc = _rehearse(short_tmp, "--phases", "preflight,install")
    try:
        wait_for(lambda: log.exists() and log.stat().st_size > 0, timeout=60, what="the preflight phase under way")
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        _kill_group(proc)
    rows = _lines(short_tmp / "out" / "gpu-check.jsonl")
    assert [r["phase"] for r in rows] == ["preflight"], rows
    assert rows[0]["status"] == "failed" and rows[0]["interrupted"] is True and "SIGTERM" in rows[0]["reason"]
    assert proc.returncode == 1


def test_bad_arguments_are_refused_naming_them(short_tmp: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "run", "--rehearse", "--phases", "preflight,warp", str(short_tmp)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0 and "unknown phase(s) ['warp']" in res.stderr
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "run", "--deadline", "-1", str(short_tmp)], capture_output=True, text=True
    )
    assert res.returncode == 2 and "must be a number of seconds > 0" in res.stderr


@pytest.mark.slow  # builds the tiny tokenizer and checks three configs in subprocesses
def test_the_dry_run_prepares_wheels_list_model_and_jobs(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "prepare", "--dry-run", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["dry_run"] is True and summary["bytes"] < 64 << 20
    assert summary["pythons"] == ["3.10", "3.11", "3.12", "3.13"]

    # the wheels: atroposd's own dependencies, pinned, never torch's environment
    names = {Requirement(r).name for r in summary["requirements"]}
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
    assert (out / "requirements.txt").read_text().splitlines() == summary["requirements"]

    # the model: Qwen2.5-0.5B's shape (its weights are drawn on the GPU machine, not carried)
    assert 4.5e8 < summary["parameters"] < 5.5e8
    config = json.loads((out / "qwen-0.5b" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["num_hidden_layers"] == 24
    assert (out / "qwen-0.5b" / "tokenizer.json").exists()
    assert not list((out / "qwen-0.5b").glob("*.safetensors"))

    # the jobs: push through CUDA IPC, shared, push through host staging; bf16 compute with
    # float32 master weights (each passed config check in the script)
    jobs = {name: tomllib.loads(Path(p).read_text()) for name, p in summary["configs"].items()}
    assert set(jobs) == {"job_push", "job_shared", "job_host_staging"}
    for job in jobs.values():
        assert job["trainer"]["dtype"] == "float32" and job["trainer"]["compute_dtype"] == "bfloat16"
        assert job["inference"]["engine"] == "torch" and job["trainer"]["device"] == "cuda:0"
        assert job["inference"]["device"] == "cuda:0" and job["daemon"]["checkpoint_timeout"] == 0.0
    assert jobs["job_shared"]["trainer"]["weight_sync"] == "shared"
    assert jobs["job_push"]["trainer"]["weight_sync"] == "push"
    assert jobs["job_host_staging"]["trainer"]["push_path"] == "host_staging"


def test_the_prepared_folder_is_ignored_by_git() -> None:
    res = subprocess.run(["git", "check-ignore", "-q", ".gpu-check/wheels/x.whl"], cwd=ROOT)
    assert res.returncode == 0

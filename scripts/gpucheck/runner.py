"""``gpu-check run``: every phase in a process of its own, under a deadline, each one's outcome
appended to ``gpu-check.jsonl`` (and flushed to disk) as it ends.

A phase that passes its deadline, hangs or dies is stopped with everything it started (its whole
process tree, by parent pid: a job's daemon and its children included) and recorded as failed
with what it had measured so far and its log's tail; the run goes on with the next phase. A phase
that the run's deadline leaves less than its least time (``MIN_PHASE_S``; a whole job's for the
last two jobs) is recorded as skipped. A run
killed at any moment (SIGKILL of its process group included) leaves every finished phase in the
file: each line is written whole and fsynced before the next phase starts.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpucheck.common import (
    Context,
    child_env,
    load_record,
    remove_segments,
    start,
    stop_tree,
    tail,
)

DEFAULT_DEADLINE_S = 360.0
MIN_PHASE_S = 10.0
#: (phase, its own deadline, the least time the run must have left for it to start), in the
#: order they run; the last two jobs run only while the run has time left for a whole job
PHASES: tuple[tuple[str, float, float], ...] = (
    ("preflight", 45.0, MIN_PHASE_S),
    ("install", 120.0, MIN_PHASE_S),
    ("model", 120.0, MIN_PHASE_S),
    ("nccl", 150.0, MIN_PHASE_S),
    ("ipc", 120.0, MIN_PHASE_S),
    ("ipc_expandable", 120.0, MIN_PHASE_S),
    ("bandwidth", 60.0, MIN_PHASE_S),
    ("job_push", 180.0, MIN_PHASE_S),
    ("gpu_tests", 240.0, MIN_PHASE_S),
    ("job_shared", 150.0, 60.0),
    ("job_host_staging", 150.0, 60.0),
)
PHASE_NAMES = tuple(name for name, _, _ in PHASES)
JSONL = "gpu-check.jsonl"
#: what every phase's process gets in its environment on top of the run's (``ipc_expandable``:
#: torch's allocator with expandable segments, in the producer and the consumer both)
PHASE_ENV: dict[str, dict[str, str]] = {
    "ipc_expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
}


class Interrupted(Exception):
    pass


def _interrupt(signum: int, _frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def append(path: Path, obj: dict[str, Any]) -> None:
    """One line, written whole and on disk before this returns."""
    line = (json.dumps(obj, default=str, sort_keys=False) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def run(
    *,
    rehearse: bool,
    out: Path,
    prepared: Path,
    work: Path | None = None,
    deadline_s: float = DEFAULT_DEADLINE_S,
    phase_deadline_s: float | None = None,
    phases: Sequence[str] | None = None,
    append_to: bool = False,
) -> int:
    """Run the phases; 0 when every phase that ran was ok (skipped ones aside), else 1."""
    t_start = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    work = work or (prepared / ("rehearsal" if rehearse else "work"))
    work.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    (work / "results").mkdir(exist_ok=True)
    jsonl = out / JSONL
    if not append_to:
        jsonl.unlink(missing_ok=True)
    wanted = list(phases) if phases else list(PHASE_NAMES)
    unknown = [p for p in wanted if p not in PHASE_NAMES]
    if unknown:
        raise SystemExit(f"gpu-check: unknown phase(s) {unknown}: the phases are {', '.join(PHASE_NAMES)}")
    ctx = Context(
        rehearse=rehearse,
        out=str(out),
        work=str(work),
        prepared=str(prepared),
        nonce="gpuchk" + secrets.token_hex(4),
        device="cpu" if rehearse else "cuda:0",
        python=sys.executable,
    )
    venv_python = work / "venv" / "bin" / "python"
    if not rehearse and "install" not in wanted:  # an earlier run's install, reused by a rerun of some phases
        if venv_python.exists():
            ctx.python = str(venv_python)
        elif (work / "site").is_dir():
            ctx.extra["site"] = str(work / "site")
    old = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    failed = 0
    try:
        for name, own_s, least_s in PHASES:
            if name not in wanted:
                continue
            left = deadline_s - (time.monotonic() - t_start)
            limit = min(own_s if phase_deadline_s is None else phase_deadline_s, left)
            if left < least_s:
                why = f"the run's deadline ({deadline_s:g} s) leaves {max(left, 0):.0f} s, under its {least_s:g} s"
                append(jsonl, _skipped(name, ctx, why))
                continue
            result = run_phase(name, ctx, limit)
            append(jsonl, result)
            if result.get("interrupted"):
                return 1
            if result["status"] != "ok":
                failed += 1
            if name == "install" and result["status"] == "ok" and result["figures"].get("python"):
                ctx.python = str(result["figures"]["python"])
                if result["figures"].get("site"):
                    ctx.extra["site"] = result["figures"]["site"]
    except Interrupted as exc:
        append(jsonl, _skipped("run", ctx, f"interrupted by {exc}", status="failed"))
        return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 1 if failed else 0


def _skipped(name: str, ctx: Context, reason: str, *, status: str = "skipped") -> dict[str, Any]:
    return {
        "phase": name,
        "status": status,
        "reason": reason,
        "rehearse": ctx.rehearse,
        "device": ctx.device,
        "at": _now(),
        "wall_s": 0.0,
        "figures": {},
        "checks": [],
    }


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_phase(name: str, ctx: Context, limit_s: float) -> dict[str, Any]:
    """One phase in its own process, stopped (with its whole tree) at ``limit_s``."""
    out, work = Path(ctx.out), Path(ctx.work)
    log = out / "logs" / f"{name}.log"
    log.unlink(missing_ok=True)
    result_file = work / "results" / f"{name}.json"
    result_file.unlink(missing_ok=True)
    env = child_env(ctx, PHASE_ENV.get(name))
    argv = [ctx.python, "-m", "gpucheck.phases", name, ctx.to_json(), str(result_file), str(time.time() + limit_s)]
    at = _now()
    t0 = time.monotonic()
    cpu0 = _children_cpu()
    proc: subprocess.Popen[Any] | None = None
    status, reason, killed = "failed", None, []
    interrupted: str | None = None
    rc: int | None = None
    try:
        proc = start(argv, log=log, env=env)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            reason = f"passed its deadline of {limit_s:.0f} s: stopped"
        except Interrupted as exc:  # the run itself is being stopped: this phase is recorded first
            reason = interrupted = f"the run was interrupted by {exc}: stopped"
        else:
            if rc == 0:
                status = "ok"
            elif rc < 0:
                reason = f"killed by {signal.Signals(-rc).name}"
            else:
                reason = f"exited {rc}"
    except OSError as exc:
        reason = f"could not start: {exc}"
    finally:
        if proc is not None:
            # whatever the phase started and left (a hung job, a consumer): stopped now, by pid
            killed = stop_tree(proc)
            rc = proc.returncode
    wall = round(time.monotonic() - t0, 2)
    cpu = round(_children_cpu() - cpu0, 2)
    left_segments = remove_segments(ctx.nonce)
    record = load_record(result_file)
    checks = record.get("checks", [])
    if status == "ok" and any(not c.get("ok") for c in checks):
        status, reason = "failed", "failed check(s): " + ", ".join(c["name"] for c in checks if not c.get("ok"))
    if status == "ok" and record.get("error"):
        status, reason = "failed", record["error"]
    if left_segments and status == "ok":
        status, reason = "failed", f"left shared-memory segments: {left_segments}"
    obj: dict[str, Any] = {
        "phase": name,
        "status": status,
        **({"reason": reason} if reason else {}),
        **({"error": record["error"]} if record.get("error") else {}),
        "rehearse": ctx.rehearse,
        "device": ctx.device,
        "at": at,
        "wall_s": wall,
        "cpu_s": cpu,
        "deadline_s": round(limit_s, 1),
        "exit": rc,
        "figures": record.get("figures", {}),
        "checks": checks,
        **({"stopped_pids": killed} if killed else {}),
        **({"left_segments": left_segments} if left_segments else {}),
        **({"env": PHASE_ENV[name]} if name in PHASE_ENV else {}),
        **({"interrupted": True} if interrupted else {}),
        "log_tail": tail(log),
    }
    return obj


def _children_cpu() -> float:
    """CPU seconds of this process's reaped descendants (a phase's, once it ended)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return float(usage.ru_utime + usage.ru_stime)


def summary(jsonl: Path) -> dict[str, Any]:
    """One line for the terminal: each phase's status and wall time."""
    rows = []
    with contextlib.suppress(OSError):
        rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    return {
        "jsonl": str(jsonl),
        "phases": {
            r["phase"]: {"status": r["status"], "wall_s": r.get("wall_s"), "cpu_s": r.get("cpu_s")} for r in rows
        },
    }

"""Learning with in-flight updates against draining: ``[trainer] inflight = "keep"`` vs ``"drain"``.

Runs ``atroposd run`` on the built-in defaults (the embedded job of SPEC §8), changing only
``[trainer] inflight`` and ``[trainer] seed``, each run in its own temporary runtime/state
directories and ports. Per seed the two modes run one after the other (keep, then drain; the
order alternates from seed to seed), so the machine's load falls on both alike. Each run is
watched through its ``metrics.jsonl``: when the moving mean of ``reward_mean`` over the last
``--window`` steps (50) reaches ``--target`` (0.8) the run is stopped (``atroposd stop``);
otherwise it ends at ``--cap`` steps (the job's ``steps``).

Per run: the step at which the moving mean first reached the target, the wall seconds from
the first step to that step (``train_s``) and from the launch (``wall_s``), the training
steps/s, and (JSON) the mean ``swapped_token_share`` and staleness of the trained steps.
Prints a table per seed and the mean ± spread (half the range over the seeds) per mode, and
writes everything as JSON (``--json``, default ``/tmp/bench_inflight_learning.json``).

The criterion: ``keep`` reaches the target in no more steps (and no more training seconds)
than ``drain`` beyond the seeds' spread.

    .venv/bin/python benchmarks/bench_inflight_learning.py [--seeds 0 1 2] [--cap 3000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_objectives import _rows, reached_at

REPO = Path(__file__).resolve().parent.parent


def _free_port(taken: set[int]) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in taken:
            taken.add(port)
            return port


def _config(root: Path, seed: int, mode: str, cap: int) -> Path:
    taken: set[int] = set()
    lines = [
        "[daemon]",
        f'runtime_dir = "{root / "run"}"',
        f'state_dir = "{root / "state"}"',
        'log_format = "console"',
        "[api]",
        f"port = {_free_port(taken)}",
        "[inference]",
        f"port = {_free_port(taken)}",
        "[trainer]",
        f"seed = {seed}",
        f"steps = {cap}",
        f'inflight = "{mode}"',
        "[[env]]",
        'name = "arithmetic"',
        'builtin = "arithmetic"',
    ]
    path = root / "atroposd.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_one(seed: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"ifl-{mode[0]}{seed}-", dir="/tmp"))
    cfg = _config(root, seed, mode, args.cap)
    metrics = root / "state" / "metrics.jsonl"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    cli = [sys.executable, "-m", "atroposd"]
    log = (Path(args.logs) / f"{mode}-seed{seed}.log").open("w")
    t0 = time.monotonic()
    proc = subprocess.Popen([*cli, "run", "-c", str(cfg)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    hit: int | None = None
    hit_wall: float | None = None
    stopped = False
    try:
        while proc.poll() is None:
            time.sleep(1.0)
            if hit is None:
                hit = reached_at(_rows(metrics), args.window, args.target)
                if hit is not None:
                    hit_wall = time.monotonic() - t0
                    stopped = True
                    subprocess.run([*cli, "stop", "-c", str(cfg)], cwd=REPO, env=env, timeout=120, capture_output=True)
            if time.monotonic() - t0 > args.timeout:
                proc.terminate()
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    rows = _rows(metrics)
    if hit is None:
        hit = reached_at(rows, args.window, args.target)
    t_first = float(rows[0]["time"]) if rows else 0.0
    result: dict[str, Any] = {
        "seed": seed,
        "mode": mode,
        "rc": rc,
        "stopped_at_target": stopped,
        "steps_run": len(rows),
        "steps_to_target": (int(rows[hit]["step"]) if "step" in rows[hit] else hit + 1) if hit is not None else None,
        "train_s_to_target": round(float(rows[hit]["time"]) - t_first, 1) if hit is not None else None,
        "wall_s_to_target": round(hit_wall, 1) if hit_wall is not None else None,
        "train_steps_per_s": (
            round((len(rows) - 1) / (float(rows[-1]["time"]) - t_first), 2) if len(rows) > 1 else None
        ),
        "reward_last_50": round(sum(float(r["reward_mean"]) for r in rows[-50:]) / max(1, len(rows[-50:])), 3),
        # what keep changes in what is trained: the tokens sampled after a swap, and the staleness
        "swapped_token_share": round(
            sum(float(r.get("swapped_token_share") or 0.0) for r in rows) / max(1, len(rows)), 4
        ),
        "staleness_mean": round(
            sum(float(r["staleness"]) for r in rows if r.get("staleness") is not None) / max(1, len(rows)), 2
        ),
    }
    if args.keep_dirs:
        result["dir"] = str(root)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return result


def _mean_spread(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return float("nan"), float("nan")
    return sum(xs) / len(xs), (max(xs) - min(xs)) / 2


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("keep", "drain"):
        mine = [r for r in results if r["mode"] == mode]
        out[mode] = {"runs": len(mine), "reached": sum(r["steps_to_target"] is not None for r in mine)}
        for key in ("steps_to_target", "train_s_to_target", "wall_s_to_target", "train_steps_per_s"):
            vals = [float(r[key]) for r in mine if r[key] is not None]
            mean, spread = _mean_spread(vals)
            out[mode][key] = {"mean": round(mean, 1), "spread": round(spread, 1)}
    k, d = out["keep"], out["drain"]
    if k["reached"] == k["runs"] and d["reached"] == d["runs"] and k["runs"]:
        slack = max(k["steps_to_target"]["spread"], d["steps_to_target"]["spread"])
        out["keep_no_worse_steps"] = k["steps_to_target"]["mean"] <= d["steps_to_target"]["mean"] + slack
        slack = max(k["train_s_to_target"]["spread"], d["train_s_to_target"]["spread"])
        out["keep_no_worse_seconds"] = k["train_s_to_target"]["mean"] <= d["train_s_to_target"]["mean"] + slack
    return out


def print_table(results: list[dict[str, Any]], summ: dict[str, Any]) -> None:
    print("| seed | inflight | steps to target | training s to target | wall s to target | steps/s | last 50 |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['seed']} | {r['mode']} | {r['steps_to_target']} | {r['train_s_to_target']} | "
            f"{r['wall_s_to_target']} | {r['train_steps_per_s']} | {r['reward_last_50']} |"
        )
    for mode in ("keep", "drain"):
        s = summ[mode]
        cells = [f"{s[k]['mean']} ± {s[k]['spread']}" for k in ("steps_to_target", "train_s_to_target")]
        cells += [f"{s['wall_s_to_target']['mean']} ± {s['wall_s_to_target']['spread']}"]
        cells += [f"{s['train_steps_per_s']['mean']} ± {s['train_steps_per_s']['spread']}"]
        print(f"| mean ± spread | {mode} ({s['reached']}/{s['runs']} reached) | " + " | ".join(cells) + " | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--cap", type=int, default=3000, help="steps at most (the job's [trainer] steps)")
    ap.add_argument("--window", type=int, default=50, help="moving-mean window (steps)")
    ap.add_argument("--target", type=float, default=0.8, help="moving mean reward to reach")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take at most")
    ap.add_argument("--json", default="/tmp/bench_inflight_learning.json")
    ap.add_argument("--logs", default=None, help="directory for each run's log (default: next to --json)")
    ap.add_argument("--keep-dirs", action="store_true", help="keep each run's directories")
    args = ap.parse_args()
    if args.logs is None:
        args.logs = str(Path(args.json).with_suffix("")) + "-logs"
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    results: list[dict[str, Any]] = []
    for i, seed in enumerate(args.seeds):
        for mode in ("keep", "drain") if i % 2 == 0 else ("drain", "keep"):
            r = run_one(seed, mode, args)
            results.append(r)
            print(json.dumps(r), flush=True)
            summ = summary(results)
            Path(args.json).write_text(
                json.dumps(
                    {
                        "benchmark": "inflight_learning",
                        "started": started,
                        "cpus": os.cpu_count(),
                        "load_avg": os.getloadavg(),
                        "window": args.window,
                        "target": args.target,
                        "cap": args.cap,
                        "results": results,
                        "summary": summ,
                    },
                    indent=1,
                )
            )
    summ = summary(results)
    print_table(results, summ)
    print(json.dumps({"benchmark": "inflight_learning", "summary": summ}))


if __name__ == "__main__":
    main()

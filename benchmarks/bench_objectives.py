"""The objective menu (SPEC §14) on the embedded job: how soon does each choice learn?

For the default and for each single choice of the menu, ``atroposd run`` on the built-in
defaults (the embedded job of SPEC §8, one key changed), once per seed, the choices interleaved
(seed by seed, in an order rotated per seed, so that a slow patch of the machine does not fall
on one choice). Measured per run: the job time (from the launch of ``atroposd run``) until the
moving reward — the mean ``reward_mean`` of the last 50 steps — first reaches 0.8, and the step
it reaches it at. A run is stopped (SIGINT, the orderly stop) once it reached the target, or
after ``--max-s`` seconds without it ("–" in the table). Beside the time, each run records its
exit code (0 for the orderly stop), its rollbacks (``rollbacks`` of its last metrics row) and its
health events (the rows whose ``health`` is not "ok": the collapse detector that tripped): a
"–" that is a crash, or a time that came after a rollback, says so in the table.

Prints a Markdown table (per choice: each seed's seconds, the mean, and the mean relative to
the default's) and one JSON line with every run; writes each run's metrics.jsonl under --out.

    .venv/bin/python benchmarks/bench_objectives.py                 # every choice, seeds 0 1 2
    .venv/bin/python benchmarks/bench_objectives.py --quick         # six choices, seed 0
    .venv/bin/python benchmarks/bench_objectives.py --choices default gspo --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# name → the [trainer] keys that differ from the defaults
CHOICES: dict[str, dict[str, Any]] = {
    "default": {},
    "gspo": {"loss": "gspo"},  # its own clip range (clip_eps = "auto": 3e-4 / 4e-4)
    "gspo-clip-0.2": {"loss": "gspo", "clip_eps": 0.2, "clip_eps_high": 0.0},  # GRPO's range, as before "auto"
    "clip-higher-0.28": {"clip_eps_high": 0.28},
    "seq-mean-token-mean": {"loss_agg": "seq-mean-token-mean"},
    "seq-mean-token-sum-norm": {"loss_agg": "seq-mean-token-sum-norm"},
    "group-mean": {"advantage": "group-mean"},
    "rloo": {"advantage": "rloo"},
    "filter-groups": {"filter_groups": True},
    "overlong-mask": {"overlong": "mask"},
    "token-tis": {"rollout_correction": "token-tis"},
    "seq-tis": {"rollout_correction": "seq-tis"},
    "token-mis": {"rollout_correction": "token-mis"},
    "seq-mis": {"rollout_correction": "seq-mis"},
    "linear": {"lr_schedule": "linear"},
    "cosine": {"lr_schedule": "cosine"},
    "ppo-epochs-2": {"ppo_epochs": 2},
    "ppo-epochs-2-mini-2": {"ppo_epochs": 2, "mini_batches": 2},
}
QUICK = ["default", "gspo", "clip-higher-0.28", "filter-groups", "rloo", "token-tis"]
WINDOW = 50
TARGET = 0.8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _toml(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, bool) else str(value).lower()


def _config(root: Path, seed: int, keys: dict[str, Any]) -> Path:
    lines = [
        "[daemon]",
        f'runtime_dir = "{root / "run"}"',
        f'state_dir = "{root / "state"}"',
        'log_format = "console"',
        "[api]",
        f"port = {_free_port()}",
        "[inference]",
        f"port = {_free_port()}",
        "[trainer]",
        f"seed = {seed}",
        *(f"{k} = {_toml(v)}" for k, v in keys.items()),
        "[[env]]",
        'name = "arithmetic"',
        'builtin = "arithmetic"',
    ]
    path = root / "atroposd.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _rows(metrics: Path) -> list[dict[str, Any]]:
    if not metrics.is_file():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            break  # a line being written
    return out


def reached_at(rows: list[dict[str, Any]], window: int = WINDOW, target: float = TARGET) -> int | None:
    """The index of the first row where the mean reward of the last ``window`` rows ≥ target."""
    total = 0.0
    for i, r in enumerate(rows):
        total += r["reward_mean"]
        if i >= window:
            total -= rows[i - window]["reward_mean"]
        if i + 1 >= window and total / window >= target:
            return i
    return None


def run_one(choice: str, seed: int, out_dir: Path, max_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="apd-obj-", dir="/tmp") as tmp:
        root = Path(tmp)
        cfg = _config(root, seed, CHOICES[choice])
        metrics = root / "state" / "metrics.jsonl"
        launched = time.time()
        with open(out_dir / f"{choice}-seed{seed}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "atroposd", "run", "-c", str(cfg)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
            try:
                while proc.poll() is None:
                    time.sleep(1.0)
                    if reached_at(_rows(metrics)) is not None or time.time() - launched > max_s:
                        break
            finally:  # reached, out of time, or the benchmark interrupted: the orderly stop
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        rows = _rows(metrics)
        hit = reached_at(rows)
        code = proc.returncode
        if metrics.is_file():
            (out_dir / f"{choice}-seed{seed}.metrics.jsonl").write_text(metrics.read_text())
    first = rows[0]["time"] - launched if rows else None
    events = [{"step": r.get("step"), "health": r.get("health")} for r in rows if r.get("health", "ok") != "ok"]
    return {
        "choice": choice,
        "seed": seed,
        "keys": CHOICES[choice],
        "steps_run": len(rows),
        "first_step_s": None if first is None else round(first, 1),
        "reached_s": None if hit is None else round(rows[hit]["time"] - launched, 1),
        "reached_step": None if hit is None else rows[hit]["step"],
        "steps_per_s": round((len(rows) - 1) / (rows[-1]["time"] - rows[0]["time"]), 2) if len(rows) > 1 else None,
        # what a "–" or a late time hides: the job's exit code (0: the orderly stop), its rollbacks
        # and the health events of its metrics rows (SPEC §15)
        "exit_code": code,
        "rollbacks": int(rows[-1].get("rollbacks", 0) or 0) if rows else 0,
        "health_events": events,
    }


def _flags(r: dict[str, Any]) -> str:
    """A run's exit code, rollbacks and health events, when any is not the orderly one."""
    out = []
    if r.get("exit_code") not in (0, None):
        out.append(f"exit {r['exit_code']}")
    if r.get("rollbacks"):
        out.append(f"{r['rollbacks']} rollback{'s' if r['rollbacks'] != 1 else ''}")
    events = r.get("health_events") or []
    if events:
        kinds = sorted({str(e["health"]) for e in events})
        out.append(f"{len(events)} health event{'s' if len(events) != 1 else ''}: {', '.join(kinds)}")
    return f" [{'; '.join(out)}]" if out else ""


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def table(results: list[dict[str, Any]], seeds: list[int]) -> list[str]:
    by = {(r["choice"], r["seed"]): r for r in results}
    choices = list(dict.fromkeys(r["choice"] for r in results))
    base = _mean(
        [
            by[("default", s)]["reached_s"]
            for s in seeds
            if ("default", s) in by and by[("default", s)]["reached_s"] is not None
        ]
    )
    lines = [
        "| choice | " + " | ".join(f"seed {s}: s (step)" for s in seeds) + " | mean s | vs default |",
        "|---|" + "---|" * (len(seeds) + 2),
    ]
    for c in choices:
        cells, times = [], []
        for s in seeds:
            r = by.get((c, s))
            if r is None:
                cells.append("–")
            elif r["reached_s"] is None:
                cells.append(f"– ({r['steps_run']} steps){_flags(r)}")
            else:
                cells.append(f"{r['reached_s']} ({r['reached_step']}){_flags(r)}")
                times.append(r["reached_s"])
        complete = len(times) == len(seeds)
        mean = _mean(times) if complete else None
        rel = f"{mean / base:.2f}×" if mean is not None and base else "–"
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {'–' if mean is None else round(mean, 1)} | {rel} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--choices", nargs="+", choices=list(CHOICES), default=None)
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK)}; seed 0")
    ap.add_argument("--max-s", type=float, default=600.0, help="give a run up this long (SPEC §8: 10 minutes)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "objectives")
    args = ap.parse_args()
    choices = args.choices or (QUICK if args.quick else list(CHOICES))
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.pop("ATROPOSD_CONFIG", None)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM too stops the running job first
    results = []
    for i, seed in enumerate(seeds):
        order = choices[i % len(choices) :] + choices[: i % len(choices)]  # rotated per seed
        for choice in order:
            res = run_one(choice, seed, args.out, args.max_s)
            results.append(res)
            print(json.dumps(res), flush=True)
    print(f"\njob time until the moving reward (last {WINDOW} steps) first reaches {TARGET}:\n")
    print("\n".join(table(results, seeds)))
    summary = {"bench": "objectives", "window": WINDOW, "target": TARGET, "seeds": seeds, "runs": results}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Collapse detection and rollback (SPEC §15), side by side with the same job left alone.

Two runs of the embedded job (the default task and config, ``--steps`` steps, the same seed):
the reference, and one whose learning rate the trainer's test hook multiplies by ``--factor``
for the optimizer step ``--burst`` (``ATROPOSD_TEST_LR_BURST``): the weights blow up within one
step. From the collapsed run's JSON log and ``metrics.jsonl``: the steps and seconds from the
blown-up step to the detection, from the detection to the replicas serving the known-good
weights (``rolled back``), the groups dropped, and how many steps until the reward's moving
average (10 steps) is back at its level before the collapse; for both runs the wall time and
the steps per second (the detectors' cost), the final 10 steps' reward. Also the detectors' own
cost per step, replaying the stored healthy run (``tests/trainer/data/healthy_metrics.jsonl``).
``--plot PNG`` draws the collapsed run with ``atroposd plot`` (the rollback marked).

    .venv/bin/python benchmarks/bench_rollback.py [--steps 300] [--burst 150] [--plot rollback.png]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_embedded import _config

REPO = Path(__file__).resolve().parent.parent


def _run(root: Path, steps: int, seed: int, env_extra: dict[str, str]) -> tuple[int, float, Path]:
    root.mkdir(parents=True)
    cfg = _config(root, seed, steps)
    text = cfg.read_text().replace('log_format = "console"', 'log_format = "json"')
    text += "\n[health]\nknown_good_after = 20\n"
    text = text.replace("[trainer]\n", "[trainer]\ncheckpoint_every = 20\n")
    cfg.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(REPO), **env_extra}
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "atroposd", "run", "-c", str(cfg)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    wall = time.monotonic() - t0
    (root / "stderr.log").write_text(res.stderr)
    return res.returncode, wall, root / "state"


def _events(log_text: str) -> list[dict[str, Any]]:
    out = []
    for line in log_text.splitlines():
        if line.startswith("{"):
            try:
                ev = json.loads(line)
                ev["_t"] = datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()
            except (ValueError, KeyError):
                continue
            out.append(ev)
    return out


def _rows(state: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _steps_per_s(rows: list[dict[str, Any]]) -> float:
    return (len(rows) - 1) / (rows[-1]["time"] - rows[0]["time"]) if len(rows) > 1 else float("nan")


def _avg(rows: list[dict[str, Any]], key: str = "reward_mean") -> float:
    return statistics.mean(r[key] for r in rows) if rows else float("nan")


def _detector_cost_us() -> float:
    from atroposd.trainer.health import replay

    rows = [
        json.loads(line)
        for line in (REPO / "tests" / "trainer" / "data" / "healthy_metrics.jsonl").read_text().splitlines()
    ]
    t0 = time.perf_counter()
    for _ in range(5):
        replay(rows)
    return (time.perf_counter() - t0) / (5 * len(rows)) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--burst", type=int, default=150)
    ap.add_argument("--factor", type=float, default=3000.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="apd-bench-rb-"))
    try:
        rc_ref, wall_ref, ref_state = _run(work / "ref", args.steps, args.seed, {})
        rc, wall, state = _run(
            work / "collapse", args.steps, args.seed, {"ATROPOSD_TEST_LR_BURST": f"{args.burst}:{args.factor:g}"}
        )
        if rc_ref != 0 or rc != 0:
            print(f"a run failed: reference exit {rc_ref}, collapsed exit {rc} (logs under {work})", file=sys.stderr)
            return 1
        ref, rows = _rows(ref_state), _rows(state)
        evs = _events((work / "collapse" / "stderr.log").read_text())
        burst = next(e for e in evs if e.get("event", "").startswith("test hook: the learning rate"))
        detected = next(e for e in evs if e.get("event", "").startswith("collapse detected"))
        rolled = next(e for e in evs if e.get("event") == "rolled back")
        after = [r for r in rows if r["step"] > detected["step"]]
        first_after = after[0] if after else None
        level = _avg([r for r in rows if args.burst - 10 <= r["step"] < args.burst])
        recovered = next(
            (
                r["step"] - detected["step"]
                for i, r in enumerate(after)
                if i >= 9 and _avg(after[i - 9 : i + 1]) >= level
            ),
            None,
        )
        result = {
            "steps": args.steps,
            "burst_step": args.burst,
            "factor": args.factor,
            "detector": detected["detector"],
            "detected_at_step": detected["step"],
            "detection_steps": detected["step"] - args.burst,
            "detection_s": round(detected["_t"] - burst["_t"], 3),
            "rollback_s": round(rolled["_t"] - detected["_t"], 3),
            "first_step_after_s": round(first_after["time"] - rolled["_t"], 3) if first_after else None,
            "rolled_back_to": Path(detected["to"]).name,
            "lr_after": first_after["lr"] if first_after else None,
            "dropped_groups": rows[-1].get("dropped_groups"),
            "reward_before_collapse": round(level, 4),
            "steps_to_reward_level": recovered,
            "reward_last10": round(_avg(rows[-10:]), 4),
            "reward_last10_reference": round(_avg(ref[-10:]), 4),
            "wall_s": round(wall, 1),
            "wall_s_reference": round(wall_ref, 1),
            "steps_per_s": round(_steps_per_s(rows), 2),
            "steps_per_s_reference": round(_steps_per_s(ref), 2),
            "detectors_us_per_step": round(_detector_cost_us(), 1),
        }
        print(f"{'':32} {'collapsed':>12} {'reference':>12}")
        print(f"{'wall (s)':32} {result['wall_s']:>12} {result['wall_s_reference']:>12}")
        print(f"{'steps/s':32} {result['steps_per_s']:>12} {result['steps_per_s_reference']:>12}")
        print(f"{'reward, last 10 steps':32} {result['reward_last10']:>12} {result['reward_last10_reference']:>12}")
        for key in (
            "detector",
            "detection_steps",
            "detection_s",
            "rollback_s",
            "first_step_after_s",
            "rolled_back_to",
            "lr_after",
            "dropped_groups",
            "reward_before_collapse",
            "steps_to_reward_level",
            "detectors_us_per_step",
        ):
            print(f"{key:32} {result[key]!s:>12}")
        if args.plot is not None:
            from atroposd.plot import Run, plot_runs

            plot_runs(
                [Run(f"collapsed at step {args.burst}", rows), Run("reference", ref)],
                args.plot,
                title=f"embedded job: learning rate x{args.factor:g} at step {args.burst}",
            )
            print(f"plot: {args.plot}")
        print(json.dumps({"bench": "rollback", **result}))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

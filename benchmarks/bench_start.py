"""The embedded job's start: from ``atroposd start`` to READY, on a state directory whose model is
already built (a restart, or any job on a local Hugging Face model), and the first start of a fresh
state directory (which builds ``builtin:tiny`` first).

Each source (this tree, and with ``--before REV`` git revision REV exported to a temporary
directory) runs ``atroposd start`` then ``atroposd stop`` ``--repeat`` times, interleaved, on
the same configuration. READY is where the API, the inference server (its health and one
generation), the trainer (its model loaded) and the environment are all up. Reports the median
and the spread of the ``start`` wall times, and where the daemon's own log puts each component's
readiness in the last run.

    .venv/bin/python benchmarks/bench_start.py [--repeat 3] [--before HEAD~1]
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
from bench_embedded import _config, export_revision

REPO = Path(__file__).resolve().parent.parent


def _cli(src: Path, *args: str, timeout: float = 300) -> tuple[int, float, str]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "atroposd", *args], cwd=src, env=env, capture_output=True, text=True, timeout=timeout
    )
    return res.returncode, time.monotonic() - t0, res.stderr


def _marks(log: Path, offset: int) -> dict[str, float]:
    """Seconds from the first line after ``offset`` to each component's ``ready`` and to READY."""
    marks: dict[str, float] = {}
    t0 = None
    with open(log) as fh:
        fh.seek(offset)
        for line in fh:
            try:
                ev = json.loads(line)
                ts = datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()
            except (ValueError, KeyError):
                continue
            t0 = ts if t0 is None else t0
            if ev.get("event") == "state" and ev.get("new") == "ready":
                marks.setdefault(str(ev.get("unit")), round(ts - t0, 2))
            elif ev.get("event") == "model loaded":
                marks.setdefault("trainer model loaded", round(ts - t0, 2))
            elif ev.get("event") == "READY":
                marks["READY"] = round(ts - t0, 2)
                break
    return marks


def one_start(src: Path, cfg: Path, log: Path) -> tuple[float, dict[str, float]]:
    offset = log.stat().st_size if log.exists() else 0
    code, wall, err = _cli(src, "start", "-c", str(cfg))
    try:
        if code != 0:
            raise SystemExit(f"start failed ({code}): {err[-2000:]}")
        return wall, _marks(log, offset)
    finally:
        code, _, err = _cli(src, "stop", "-c", str(cfg))
        if code != 0:
            raise SystemExit(f"stop failed ({code}): {err[-2000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--before", metavar="REV", help="also time git revision REV, interleaved")
    args = ap.parse_args()
    os.environ.pop("ATROPOSD_CONFIG", None)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="apd-bench-start-", dir="/tmp") as tmp:
        root = Path(tmp)
        sources = [("before", export_revision(args.before, root))] if args.before else []
        sources.append(("after" if args.before else "this tree", REPO))
        for label, src in sources:
            (root / label.replace(" ", "-")).mkdir()
            cfg = _config(root / label.replace(" ", "-"), seed=0, steps=100_000)
            text = cfg.read_text().replace('log_format = "console"', 'log_format = "json"')
            cfg.write_text(text)
            log = cfg.parent / "state" / "logs" / "daemon.log"
            first, first_marks = one_start(src, cfg, log)  # builds builtin:tiny
            results.append(
                {
                    "label": label,
                    "case": "fresh state (builds the model)",
                    "start_s": [round(first, 2)],
                    "marks": first_marks,
                    "cfg": cfg,
                    "log": log,
                    "src": src,
                }
            )
        built = []
        for r in results:
            built.append({**r, "case": "model already built", "start_s": []})
        for _ in range(args.repeat):
            for r in built:
                wall, marks = one_start(r["src"], r["cfg"], r["log"])
                r["start_s"].append(round(wall, 2))
                r["marks"] = marks
        results += built
        for r in results:
            shutil.rmtree(r["cfg"].parent, ignore_errors=True)
    print(f"{'source':<10} {'case':<32} {'start→READY s (median)':>22} {'runs':>24}")
    for r in results:
        print(
            f"{r['label']:<10} {r['case']:<32} {statistics.median(r['start_s']):>22.2f} "
            f"{' '.join(f'{x:.2f}' for x in r['start_s']):>24}"
        )
    print("last run, seconds from the first log line:")
    for r in results:
        print(f"  {r['label']} / {r['case']}: {r['marks']}")
    print(
        json.dumps(
            {
                "benchmark": "start",
                "before": args.before,
                "runs": [{k: r[k] for k in ("label", "case", "start_s", "marks")} for r in results],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The embedded job's speed with atroposlib's health probes against without them.

atroposlib's SGLang and OpenAI server classes check their server's health with a chat completion
of one user message and ``max_tokens = 1``, once a second per environment (SPEC §7). This runs
the embedded job (``atroposd run`` on the built-in defaults, shortened to ``--steps``) without
probes and with ``--probes`` such probe loops (default 16: sixteen environments' worth) against
its inference server, side by side in one run (interleaved in ABBA order, ``--repeat`` times of
each), and reports
end-to-end steps/s, training steps/s, the probes answered and their latency.

    .venv/bin/python benchmarks/bench_probes.py [--steps 300] [--probes 16] [--repeat 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_embedded import REPO, _config, _run_job


class Prober:
    """``count`` loops, each as atroposlib's SGLangServer.check_server_status_task: a one-token
    chat completion of ``hi``, then one second's sleep; in a thread with its own event loop."""

    def __init__(self, url: str, count: int) -> None:
        self.url, self.count = url, count
        self.latencies: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> None:
        if self.count:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    async def _main(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(self._loop(session) for _ in range(self.count)))

    async def _loop(self, session: Any) -> None:
        import aiohttp

        body = {"model": "builtin:tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                async with session.post(
                    self.url + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=30)
                ) as resp:
                    await resp.read()
                    ok = resp.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                ok = False  # the server is not up yet, or stopping
            if ok:
                self.latencies.append(time.perf_counter() - t0)
            else:
                self.failures += 1
            await asyncio.sleep(1.0)


def run_once(steps: int, probes: int, out_dir: Path, tag: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="apd-bench-probes-", dir="/tmp") as tmp:
        root = Path(tmp)
        cfg = _config(root, 0, steps)
        lines = cfg.read_text().splitlines()  # bench_embedded's config: "[inference]", then "port = N"
        port = int(lines[lines.index("[inference]") + 1].split("=")[1])
        prober = Prober(f"http://127.0.0.1:{port}", probes)
        prober.start()
        metrics = root / "state" / "metrics.jsonl"
        try:
            rc, wall, cpu = _run_job(cfg, out_dir / f"{tag}.log", metrics, REPO)
        finally:
            prober.stop()
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    train_s = rows[-1]["time"] - rows[0]["time"] if len(rows) > 1 else 0.0
    lat = sorted(prober.latencies)
    return {
        "probes": probes,
        "exit_code": rc,
        "steps": len(rows),
        "wall_s": round(wall, 1),
        "steps_per_s": round(len(rows) / wall, 3) if rows else 0.0,
        "train_steps_per_s": round((len(rows) - 1) / train_s, 3) if train_s > 0 else 0.0,
        "probes_answered": len(lat),
        "probes_failed": prober.failures,  # failed: also before the server was up
        "probe_p50_ms": round(1000 * statistics.median(lat), 1) if lat else None,
        "probe_p99_ms": round(1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1) if lat else None,
        "cpu_util": cpu["cpu_util"],
        "reward_last10": round(statistics.fmean(r["reward_mean"] for r in rows[-10:]), 3) if rows else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--probes", type=int, default=16, help="probe loops (environments' worth), one probe/s each")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each configuration, interleaved")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "probes")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.pop("ATROPOSD_CONFIG", None)
    results = []
    for rep in range(args.repeat):
        # ABBA order (without, with, with, without, ...): a load that drifts during the run
        # weighs on both configurations alike.
        for probes in (0, args.probes) if rep % 2 == 0 else (args.probes, 0):
            res = run_once(args.steps, probes, args.out, f"probes{probes}-run{rep}")
            results.append(res)
            print(json.dumps(res), flush=True)
    cols = [
        "probes",
        "exit_code",
        "steps",
        "wall_s",
        "steps_per_s",
        "train_steps_per_s",
        "probes_answered",
        "probe_p50_ms",
        "probe_p99_ms",
        "cpu_util",
        "reward_last10",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")

    def mean(probes: int, key: str) -> float:
        return round(statistics.fmean(r[key] for r in results if r["probes"] == probes), 3)

    summary = {
        "bench": "probes",
        "steps": args.steps,
        "probe_loops": args.probes,
        "repeat": args.repeat,
        "steps_per_s": {"without": mean(0, "steps_per_s"), "with": mean(args.probes, "steps_per_s")},
        "train_steps_per_s": {"without": mean(0, "train_steps_per_s"), "with": mean(args.probes, "train_steps_per_s")},
        "all_ok": all(r["exit_code"] == 0 for r in results),
    }
    summary["train_ratio"] = round(summary["train_steps_per_s"]["with"] / summary["train_steps_per_s"]["without"], 3)
    (args.out / "summary.json").write_text(json.dumps({**summary, "runs": results}, indent=1))
    print(json.dumps(summary))
    return 0 if summary["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

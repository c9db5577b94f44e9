"""Inference replicas (SPEC §12.2): generation throughput with 1 and 2 ``atroposd inference``
servers, side by side in one run.

Each replica is a real ``atroposd inference`` process (builtin:tiny, CPU, one torch thread);
the client is the built-in environments' own (``atroposd.envs.generate.InferenceClient``),
which sends each request to the ready replica with the fewest in flight. ``--concurrency``
requests are kept in flight (each ``n = 8``, 3 tokens from a 5-token prompt, as the embedded
job's environment sends them) for ``--seconds`` after a warm-up; the figure is requests and
sequences per second, how the requests split between the replicas, and each replica's memory. On a CPU each replica
is one more process competing for the same cores: more replicas only help while cores are
idle. Prints a table and one JSON line (``{"benchmark": "replicas", ...}``).

    .venv/bin/python benchmarks/bench_replicas.py [--seconds 10] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_inference import GROUP, MAX_TOKENS, prompts, start_server, stop, wait_up  # noqa: E402


async def measure(urls: list[str], seconds: float, concurrency: int) -> dict[str, Any]:
    import aiohttp

    from atroposd.envs.generate import InferenceClient

    ps = prompts()
    async with aiohttp.ClientSession() as session:
        client = InferenceClient(session, urls)
        done = 0
        stop_at = 0.0

        async def worker(k: int) -> None:
            nonlocal done
            i = k
            while time.perf_counter() < stop_at:
                await client.generate(ps[i % len(ps)], n=GROUP, max_tokens=MAX_TOKENS, temperature=1.0)
                done += 1
                i += concurrency

        stop_at = time.perf_counter() + min(3.0, seconds / 3)  # warm-up
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        done, before = 0, client.served()
        t0 = time.perf_counter()
        stop_at = t0 + seconds
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        elapsed = time.perf_counter() - t0
        split = [a - b for a, b in zip(client.served(), before, strict=True)]
    return {
        "requests_per_s": round(done / elapsed, 1),
        "sequences_per_s": round(done * GROUP / elapsed),
        "per_replica": split,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    from atroposd.models.tiny import ensure_builtin_model

    root = Path(tempfile.mkdtemp(prefix="atpd-bench-rep-", dir="/tmp"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        model_dir = ensure_builtin_model(root / "state", seed=0, max_model_len=256)
        servers = [start_server(model_dir, root, i) for i in range(2)]
        procs = [p for p, _ in servers]
        for p, url in servers:
            wait_up(p, url)
        urls = [url for _, url in servers]
        results = {}
        for k in (1, 2, 1):  # 1 again: the load of the machine may have changed meanwhile
            name = f"{k} replica{'s' if k > 1 else ''}"
            results[name if name not in results else name + " (again)"] = asyncio.run(
                measure(urls[:k], args.seconds, args.concurrency)
            )
        import psutil

        rss_mb = [round(psutil.Process(p.pid).memory_info().rss / 2**20) for p in procs]
    finally:
        for p in procs:
            stop(p)
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"builtin:tiny, CPU, 1 torch thread per replica; {args.concurrency} requests in flight (n={GROUP}, "
        f"{MAX_TOKENS} tokens); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(f"{'':<20} {'requests/s':>10} {'sequences/s':>12}  per replica")
    for name, r in results.items():
        print(f"{name:<20} {r['requests_per_s']:>10} {r['sequences_per_s']:>12}  {r['per_replica']}")
    print(f"memory (RSS) of each replica process: {rss_mb} MiB")
    print(
        json.dumps(
            {
                "benchmark": "replicas",
                "concurrency": args.concurrency,
                "seconds": args.seconds,
                "load_average": round(os.getloadavg()[0], 1),
                "replica_rss_mib": rss_mb,
                **results,
            },
            ensure_ascii=False,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

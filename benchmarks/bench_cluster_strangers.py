"""The cluster endpoint under strangers: how much memory connections that never join make the
head hold, how many it keeps open, and how soon an honest node joins after them.

Each source (this tree, and with ``--before REV`` git revision REV exported to a temporary
directory) runs a head (``ClusterHead``, three nodes, ``heartbeat_timeout`` 30 s) in its own
process on loopback and gets the same load in the same invocation: ``--strangers`` connections
each sending ``--mib`` MiB that never end a line. Measured: the head's RSS growth over its idle
RSS (the peak of samples every 50 ms while the strangers send and for 1 s after), the
connections it still holds 1 s after the flood, and the seconds until a node of this tree
joins it while the strangers are still connected.

Prints a table and one JSON line (``{"benchmark": "cluster_strangers", ...}``).

    .venv/bin/python benchmarks/bench_cluster_strangers.py [--before REV] [--strangers 100] [--mib 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_embedded import export_revision  # noqa: E402

from atroposd.cluster import ClusterNode  # noqa: E402
from atroposd.config import ClusterConfig  # noqa: E402
from tests.support import free_port_pair  # noqa: E402

TOKEN = b"the-shared-secret-of-this-benchmark"
HEAD = """
import asyncio, signal, sys
from atroposd.cluster import ClusterHead
from atroposd.config import ClusterConfig
from atroposd.logs import configure_logging

async def main():
    configure_logging("error", "json")
    cfg = ClusterConfig(nodes=3, head="127.0.0.1", port=int(sys.argv[1]), heartbeat_timeout=30.0)
    head = ClusterHead(cfg, token=sys.argv[2].encode(), host="bench-head")
    await head.start()
    head.report([{"name": "inference", "kind": "inference", "state": "ready"}])
    print("listening", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await head.close()

asyncio.run(main())
"""


async def _stranger(port: int, payload: bytes) -> asyncio.StreamWriter | None:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return None
    writer.write(payload)
    with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
        await asyncio.wait_for(writer.drain(), 5)
    return writer


async def _sample(proc: psutil.Process, until: asyncio.Event, peak: list[int]) -> None:
    while not until.is_set():
        with contextlib.suppress(psutil.Error):
            peak[0] = max(peak[0], proc.memory_info().rss)
        await asyncio.sleep(0.05)


def _measure(src: Path, strangers: int, mib: float) -> dict[str, Any]:
    """A head of ``src`` in its own process, measured under the strangers."""
    port = free_port_pair()
    env = {**os.environ, "PYTHONPATH": str(src)}
    head = subprocess.Popen(
        [sys.executable, "-c", HEAD, str(port), TOKEN.decode()],
        cwd=src,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert head.stdout is not None
        if head.stdout.readline().strip() != b"listening":
            raise RuntimeError(f"the head of {src} did not start")
        return asyncio.run(_load(psutil.Process(head.pid), port, strangers, mib))
    finally:
        head.terminate()
        head.wait(10)


async def _load(proc: psutil.Process, port: int, strangers: int, mib: float) -> dict[str, Any]:
    idle = proc.memory_info().rss
    peak = [idle]
    done = asyncio.Event()
    sampler = asyncio.create_task(_sample(proc, done, peak))
    payload = b"x" * int(mib * 1024 * 1024)
    writers = await asyncio.gather(*(_stranger(port, payload) for _ in range(strangers)))
    await asyncio.sleep(1.0)
    held = sum(1 for c in proc.net_connections() if c.status == psutil.CONN_ESTABLISHED)
    done.set()
    await sampler
    # an honest node of this tree joins while the strangers are still connected
    cfg = ClusterConfig(nodes=3, head="127.0.0.1", port=port, heartbeat_timeout=30.0, join_timeout=60.0)
    node = ClusterNode(cfg, token=TOKEN, node_rank=1, host="bench-node")
    t0 = time.monotonic()
    try:
        await node.join()
        joined: float | None = round(time.monotonic() - t0, 3)
    except Exception:
        joined = None
    finally:
        await node.leave("benchmark over")
    for w in writers:
        if w is not None:
            w.transport.abort()
    return {"rss_growth_mib": round((peak[0] - idle) / 2**20, 1), "held_after_1s": held, "join_s": joined}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", metavar="REV", help="also measure git revision REV, in the same run")
    ap.add_argument("--strangers", type=int, default=100)
    ap.add_argument("--mib", type=float, default=1.0, help="MiB each stranger sends without a newline")
    args = ap.parse_args()
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-strangers-") as tmp:
        sources = [("before", export_revision(args.before, Path(tmp)))] if args.before else []
        sources.append(("this tree", REPO))
        for name, src in sources:
            rows[name] = _measure(src, args.strangers, args.mib)
    print(f"{args.strangers} strangers × {args.mib:g} MiB without a newline; head of 3 nodes, heartbeat_timeout 30 s")
    print(f"{'source':<12} {'RSS growth MiB':>15} {'held after 1 s':>15} {'honest join s':>14}")
    for name, r in rows.items():
        print(f"{name:<12} {r['rss_growth_mib']:>15} {r['held_after_1s']:>15} {r['join_s']!s:>14}")
    print(
        json.dumps(
            {
                "benchmark": "cluster_strangers",
                "strangers": args.strangers,
                "mib": args.mib,
                "before": args.before,
                **{k.replace(" ", "_"): v for k, v in rows.items()},
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

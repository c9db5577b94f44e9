"""The trajectory API under hostile bodies: how long its event loop stalls, and how much memory
slow uploads take.

Each source (this tree, and with ``--before REV`` git revision REV exported to a temporary
directory) runs ``atroposd api`` as a real process on loopback, without its parse helper
(``ATROPOSD_API_PARSE_HELPER=0``: the event loop reads every body itself, as with one CPU or a
busy helper), and gets the same load in the same invocation:

* **stall**: a probe asks ``GET /info`` every 5 ms while a client posts ``--posts`` gzip
  bodies whose trailer lies: a first member inflating to ``--inflate`` MiB of JSON whitespace,
  then a group, then a one-byte member whose trailer is the body's last four bytes. The probe's
  p50 / p99 / max latency is the event loop's stall.
* **uploads**: on a fresh API, ``--uploads`` clients each send a chunked body of ``--upload``
  MiB in 1 MiB chunks and stop before its end; the API's peak RSS growth over its idle RSS, and
  how many uploads were refused (answered 503, or closed) before they were all sent.

Prints a table and one JSON line (``{"benchmark": "api_bounds", ...}``).

    .venv/bin/python benchmarks/bench_api_bounds.py [--before REV] [--posts 20] [--inflate 60]
                                                    [--uploads 6] [--upload 60] [--max-request-mib 64]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_api import free_port
from bench_embedded import export_revision

REPO = Path(__file__).resolve().parent.parent


def lying_body(inflate_mib: int) -> bytes:
    tokens = [[100 + j for j in range(16)] for _ in range(2)]
    group = orjson.dumps({"tokens": tokens, "masks": tokens, "scores": [0.0, 1.0]})
    return gzip.compress(b" " * (inflate_mib << 20) + group, 9) + gzip.compress(b" ")


def start(src: Path, tmp: Path, port: int, max_request_mib: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(src), "ATROPOSD_API_PARSE_HELPER": "0"}
    log = open(tmp / f"api-{port}.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "atroposd",
            "api",
            "--port",
            str(port),
            "--no-spool",
            "--max-request-bytes",
            str(max_request_mib << 20),
        ],
        cwd=src,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    import urllib.request

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/info", timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"the API of {src} did not start: {(tmp / f'api-{port}.log').read_text()[-2000:]}")


async def _request(port: int, head: bytes, body: bytes = b"") -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await writer.drain()
        line = await reader.readline()
        return int(line.split()[1])
    finally:
        writer.close()


async def stall(port: int, posts: int, body: bytes) -> dict[str, Any]:
    head = (
        f"POST /scored_data HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Encoding: gzip\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    probe = b"GET /info HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    latencies: list[float] = []
    done = False

    async def probing() -> None:
        while not done:
            t0 = time.perf_counter()
            await _request(port, probe)
            latencies.append((time.perf_counter() - t0) * 1000)
            await asyncio.sleep(0.005)

    task = asyncio.create_task(probing())
    statuses = [await _request(port, head, body) for _ in range(posts)]
    done = True
    await task
    latencies.sort()
    return {
        "statuses": sorted(set(statuses)),
        "probes": len(latencies),
        "p50_ms": round(statistics.median(latencies), 2),
        "p99_ms": round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))], 2),
        "max_ms": round(latencies[-1], 2),
    }


async def uploads(port: int, proc: psutil.Process, n: int, mib: int) -> dict[str, Any]:
    idle = proc.memory_info().rss
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
    conns = []
    for _ in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /scored_data HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        conns.append((reader, writer))
    refused = 0
    peak = idle
    open_conns = list(conns)
    for _ in range(mib):
        for reader, writer in list(open_conns):
            try:
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), 5)
            except (OSError, asyncio.TimeoutError):  # the API answered and closed: refused
                refused += 1
                open_conns.remove((reader, writer))
                continue
            if reader.at_eof() or len(reader._buffer):  # type: ignore[attr-defined]  # an answer came: refused
                refused += 1
                open_conns.remove((reader, writer))
                writer.close()
        await asyncio.sleep(0.01)
        peak = max(peak, proc.memory_info().rss)
    for _ in range(20):  # what the API still had to read
        await asyncio.sleep(0.1)
        peak = max(peak, proc.memory_info().rss)
    for reader, _ in open_conns:
        if reader.at_eof() or len(reader._buffer):  # type: ignore[attr-defined]
            refused += 1
    for _, writer in conns:
        writer.close()
    return {"refused": refused, "rss_growth_mb": round((peak - idle) / 1e6, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", metavar="REV", help="also run git revision REV, side by side")
    ap.add_argument("--posts", type=int, default=20)
    ap.add_argument("--inflate", type=int, default=60, help="MiB each lying body inflates to (default 60)")
    ap.add_argument("--uploads", type=int, default=6)
    ap.add_argument("--upload", type=int, default=60, help="MiB each chunked upload sends (default 60)")
    ap.add_argument(
        "--max-request-mib",
        type=int,
        default=64,
        help="the API's max_request_bytes in MiB (default 64: bodies in flight ≤ 256 MiB)",
    )
    args = ap.parse_args()
    body = lying_body(args.inflate)
    rows = []
    with tempfile.TemporaryDirectory(prefix="apd-bench-bounds-", dir="/tmp") as tmp:
        root = Path(tmp)
        sources = [("before", export_revision(args.before, root))] if args.before else []
        sources.append(("after" if args.before else "this tree", REPO))
        for label, src in sources:
            row: dict[str, Any] = {"source": label, "body_kib": round(len(body) / 1024, 1)}
            for phase in ("stall", "uploads"):  # each on a fresh API: no memory left by the other
                port = free_port()
                proc = start(src, root, port, args.max_request_mib)
                try:
                    row[phase] = asyncio.run(
                        stall(port, args.posts, body)
                        if phase == "stall"
                        else uploads(port, psutil.Process(proc.pid), args.uploads, args.upload)
                    )
                finally:
                    proc.terminate()
                    proc.wait(30)
            rows.append(row)
    print(
        f"{'source':<10} {'/info p50 ms':>12} {'p99 ms':>8} {'max ms':>8} {'post status':>12} "
        f"{'uploads refused':>16} {'RSS growth MB':>14}"
    )
    for r in rows:
        s, u = r["stall"], r["uploads"]
        print(
            f"{r['source']:<10} {s['p50_ms']:>12.2f} {s['p99_ms']:>8.2f} {s['max_ms']:>8.2f} "
            f"{','.join(map(str, s['statuses'])):>12} {u['refused']:>7}/{args.uploads:<8} {u['rss_growth_mb']:>14.1f}"
        )
    print(
        json.dumps(
            {
                "benchmark": "api_bounds",
                "before": args.before,
                "max_request_mib": args.max_request_mib,
                "posts": args.posts,
                "inflate_mib": args.inflate,
                "uploads": args.uploads,
                "upload_mib": args.upload,
                "rows": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

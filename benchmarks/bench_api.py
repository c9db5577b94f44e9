"""Trajectory API throughput, latency and memory: atroposd's API against atroposlib's run-api.

Both servers run as real processes on loopback and get the same load in the same invocation:

* warm-up: after registering, 256 groups are posted and drained (on every server alike), so that
  one-time start-up costs (the clients' connections, a new process's first allocations) stay
  out of the timing figures, which are those of a server that has been running;
* memory: server RSS growth per queued group over the warm-up's ingest (the first fill of a
  fresh process: later fills reuse the memory freed by the drain);
* ingest: a trainer registers (batch size 64), one environment registers, then 8 concurrent
  clients post groups of 8 × 512 tokens with masks (-100 on the prompt), scores and inference
  logprobs (as atroposlib's env client does: JSON, gzip'ed since the body is ≥ 1 KiB);
  POST groups/s and the p50/p99 request latency;
* drain: ``GET /batch`` until the queue is empty (the trainer's client accepts gzip, as
  ``requests`` and aiohttp do); drain groups/s and server CPU ms per 64-sequence batch;
* exactly-once: every posted group is served once (unique score tags);
* ``--flood``: nobody drains; the clients keep posting and retry on 503 (as atroposlib's env
  client does); the API's RSS is sampled while it is full, every refusal must be a 503 that came
  after ``full_wait``; then everything is drained exactly once (atroposd only: run-api has no cap).

Server CPU and RSS are those of the server process and its children (atroposd's API runs a parse
helper process beside its event loop).

Prints a table, the ratios, and one JSON line (``{"benchmark": "api", ...}``).
Targets: POST ≥ 5× run-api, drain ≥ 20× run-api, memory per queued group ≤ 1/4 of run-api's.

    python benchmarks/bench_api.py [--groups 512] [--warmup 256] [--clients 8] [--repeat 3] [--flood] [--spool]
                                   [--no-run-api]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil

REPO = Path(__file__).resolve().parent.parent
RUN_API = Path(sys.executable).parent / "run-api"
SEQS, TOKENS, BATCH = 8, 512, 64
WARMUP_TAG = 1_000_000  # warm-up groups carry tags from here on


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_group(tag: int, env_id: int) -> bytes:
    """One gzip'ed ScoredData body: 8 × 512 tokens, a 128-token prompt masked with -100."""
    prompt = 128
    rng = random.Random(tag)
    shared = [rng.randrange(100, 150000) for _ in range(prompt)]  # one prompt per group, as in GRPO
    tokens = [shared + [rng.randrange(100, 150000) for _ in range(TOKENS - prompt)] for _ in range(SEQS)]
    masks = [[-100] * prompt + row[prompt:] for row in tokens]
    logprobs = [[1.0] * prompt + [-rng.expovariate(2.0) for _ in range(TOKENS - prompt)] for _ in range(SEQS)]
    body = {
        "tokens": tokens,
        "masks": masks,
        "scores": [float(tag)] + [0.5] * (SEQS - 1),
        "inference_logprobs": logprobs,
        "env_id": env_id,
        "messages": None,
        "generation_params": {"temperature": 1.0},
    }
    return gzip.compress(orjson.dumps(body), compresslevel=1)


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    @property
    def ps(self) -> psutil.Process:
        return psutil.Process(self.proc.pid)

    def _tree(self) -> list[psutil.Process]:
        ps = self.ps
        return [ps, *ps.children(recursive=True)]  # atroposd's parse helper is part of the server

    def cpu(self) -> float:
        """CPU seconds (user + system) of the server and its child processes."""
        return sum(sum(p.cpu_times()[:2]) for p in self._tree())

    def rss(self) -> int:
        return sum(p.memory_info().rss for p in self._tree())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def start(name: str, cmd: list[str], tmp: Path) -> Server:
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
    port = cmd[cmd.index("--port") + 1]
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    import urllib.request

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited:\n{log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(url + "/info", timeout=1).close()
            return Server(name, proc, url, log)
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"{name} did not answer /info within 60 s")


@dataclass
class Result:
    name: str
    post_groups_s: float = 0.0
    post_p50_ms: float = 0.0
    post_p99_ms: float = 0.0
    post_cpu_ms_per_group: float = 0.0
    drain_groups_s: float = 0.0
    drain_cpu_ms_per_batch: float = 0.0
    drain_p50_ms: float = 0.0
    mem_per_group_kb: float = 0.0
    exactly_once: bool = False
    lost: int = 0
    duplicated: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


async def register(session: aiohttp.ClientSession, url: str) -> int:
    reg = dict(
        wandb_group="",
        wandb_project="",
        batch_size=BATCH,
        max_token_len=1024,
        checkpoint_dir="ckpt",
        save_checkpoint_interval=100,
        starting_step=0,
        num_steps=1000,
    )
    async with session.post(url + "/register", json=reg) as r:
        assert r.status == 200, await r.text()
    async with session.get(url + "/batch") as r:
        await r.read()
    env = dict(max_token_length=1024, desired_name="bench", weight=1.0, group_size=SEQS)
    async with session.post(url + "/register-env", json=env) as r:
        answer = await r.json()
    assert answer["status"] == "success", answer
    return int(answer["env_id"])


async def post_all(
    url: str,
    bodies: list[bytes],
    clients: int,
    *,
    retry_503: bool = False,
    statuses: dict[int, int] | None = None,
    waits: list[float] | None = None,
) -> list[float]:
    """Post every body from ``clients`` concurrent clients; returns per-request latencies (s)."""
    latencies: list[float] = []
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}

    async def client() -> None:
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            while not queue.empty():
                body = queue.get_nowait()
                while True:
                    t0 = time.perf_counter()
                    async with s.post(url + "/scored_data", data=body, headers=headers) as r:
                        await r.read()
                        status = r.status
                    dt = time.perf_counter() - t0
                    if statuses is not None:
                        statuses[status] = statuses.get(status, 0) + 1
                    if status == 200:
                        latencies.append(dt)
                        break
                    if not (retry_503 and status == 503):
                        raise RuntimeError(f"/scored_data answered {status}")
                    if waits is not None:
                        waits.append(dt)
                    await asyncio.sleep(0.05)

    await asyncio.gather(*(client() for _ in range(clients)))
    return latencies


async def drain(url: str, server: Server) -> tuple[list[int], float, float, list[float], int]:
    """GET /batch until null: (tags served, wall s, server CPU s, per-request s, batches)."""
    tags: list[int] = []
    per: list[float] = []
    batches = 0
    cpu0 = server.cpu()
    t0 = time.perf_counter()
    bodies: list[bytes] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        while True:
            t1 = time.perf_counter()
            async with s.get(url + "/batch") as r:  # aiohttp sends Accept-Encoding: gzip, deflate
                body = await r.read()
            per.append(time.perf_counter() - t1)
            if body.startswith(b'{"batch":null') or body.startswith(b'{"batch": null'):
                break
            bodies.append(body)
            batches += 1
    wall = time.perf_counter() - t0
    cpu = server.cpu() - cpu0
    for body in bodies:  # parsed after the clock stopped: the client's cost is not the server's
        batch = json.loads(body)["batch"]
        assert sum(len(g["tokens"]) for g in batch) == BATCH
        tags.extend(int(g["scores"][0]) for g in batch)
    return tags, wall, cpu, per[:-1] or per, batches


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def bench(server: Server, bodies: list[bytes], clients: int, warmup: list[bytes]) -> Result:
    res = Result(server.name)
    async with aiohttp.ClientSession() as s:
        env_id = await register(s, server.url)
    assert env_id == 0
    # Warm-up, the same for every server: start-up costs (connections, a new process's first
    # allocations, a helper's first bodies) stay out of the timed figures. Memory per queued
    # group is measured here, on the first fill of a fresh process (once drained, the freed
    # memory is reused, so a second fill would not show it).
    rss0 = server.rss()
    if warmup:
        await post_all(server.url, warmup, clients)
        rss1 = server.rss()
        res.mem_per_group_kb = (rss1 - rss0) / len(warmup) / 1024
        tags, *_ = await drain(server.url, server)
        assert sorted(tags) == sorted(range(WARMUP_TAG, WARMUP_TAG + len(warmup))), "warm-up not served once"
    cpu0 = server.cpu()
    t0 = time.perf_counter()
    lat = await post_all(server.url, bodies, clients)
    wall = time.perf_counter() - t0
    if not warmup:  # --warmup 0: memory from the timed fill, which is then the first
        rss1 = server.rss()
        res.mem_per_group_kb = (rss1 - rss0) / len(bodies) / 1024
    res.post_cpu_ms_per_group = (server.cpu() - cpu0) / len(bodies) * 1e3
    res.post_groups_s = len(bodies) / wall
    res.post_p50_ms, res.post_p99_ms = pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3
    tags, dwall, cpu, per, batches = await drain(server.url, server)
    res.drain_groups_s = len(tags) / dwall
    res.drain_cpu_ms_per_batch = cpu / max(1, batches) * 1e3
    res.drain_p50_ms = pct(per, 0.5) * 1e3
    expected = set(range(len(bodies)))
    res.lost = len(expected - set(tags))
    res.duplicated = len(tags) - len(set(tags))
    res.exactly_once = res.lost == 0 and res.duplicated == 0
    res.extra = {
        "post_wall_s": wall,
        "drain_wall_s": dwall,
        "batches": batches,
        "rss_before_mb": rss0 / 2**20,
        "rss_after_warmup_ingest_mb": rss1 / 2**20,
    }
    return res


async def flood(server: Server, bodies: list[bytes], clients: int, cap: int, full_wait: float) -> dict[str, Any]:
    """Nobody drains: memory must stay flat at the cap, every refusal a 503 after full_wait."""
    async with aiohttp.ClientSession() as s:
        await register(s, server.url)
    statuses: dict[int, int] = {}
    waits: list[float] = []
    samples: list[float] = []
    task = asyncio.ensure_future(post_all(server.url, bodies, clients, retry_503=True, statuses=statuses, waits=waits))
    while statuses.get(503, 0) < 20 * clients and not task.done():
        samples.append(server.rss() / 2**20)
        await asyncio.sleep(0.2)
    full = samples[len(samples) // 2 :] or samples
    tags: list[int] = []
    while True:  # now drain while the clients finish their retries
        got, *_ = await drain(server.url, server)
        tags.extend(got)
        if task.done() and not got:
            break
        await asyncio.sleep(0.05)
    await task
    return {
        "cap_sequences": cap,
        "full_wait_s": full_wait,
        "statuses": statuses,
        "refusals": statuses.get(503, 0),
        "min_refusal_wait_s": min(waits) if waits else None,
        "rss_full_mb_min": min(full) if full else None,
        "rss_full_mb_max": max(full) if full else None,
        "lost": len(set(range(len(bodies))) - set(tags)),
        "duplicated": len(tags) - len(set(tags)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=512, help="groups of 8 × 512 tokens (default 512)")
    ap.add_argument(
        "--warmup",
        type=int,
        default=256,
        help="groups posted and drained before the timed run, on every server; memory per "
        "queued group is measured on them (default 256)",
    )
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--flood", action="store_true", help="also run the flood mode (atroposd only)")
    ap.add_argument("--no-run-api", action="store_true", help="skip atroposlib's run-api")
    ap.add_argument("--spool", action="store_true", help="also measure atroposd with its spool on")
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="rounds (servers interleaved); the best round of each server is reported, which "
        "filters out the noise of a shared machine (default 3)",
    )
    args = ap.parse_args()
    groups = args.groups - args.groups % (BATCH // SEQS)
    tmp = Path(tempfile.mkdtemp(prefix="bench-api-"))
    print(f"building {groups} groups of {SEQS} × {TOKENS} tokens ...", file=sys.stderr)
    bodies = [make_group(k, 0) for k in range(groups)]
    warm = args.warmup - args.warmup % (BATCH // SEQS)
    warmup = [make_group(WARMUP_TAG + k, 0) for k in range(warm)]
    flood_out: dict[str, Any] | None = None
    configs: list[tuple[str, list[str]]] = [
        (
            "atroposd",
            [
                sys.executable,
                "-m",
                "atroposd",
                "api",
                "--port",
                str(free_port()),
                "--no-spool",
                "--log-level",
                "warning",
            ],
        )
    ]
    if args.spool:
        configs.append(
            (
                "atroposd+spool",
                [
                    sys.executable,
                    "-m",
                    "atroposd",
                    "api",
                    "--port",
                    str(free_port()),
                    "--spool-dir",
                    str(tmp / "spool"),
                    "--log-level",
                    "warning",
                ],
            )
        )
    if not args.no_run_api:
        if not RUN_API.exists():
            print("run-api not installed (pip install atroposlib==0.4.0); skipping it", file=sys.stderr)
        else:
            configs.append(("run-api", [str(RUN_API), "--host", "127.0.0.1", "--port", str(free_port())]))
    rounds: dict[str, list[Result]] = {name: [] for name, _ in configs}
    try:
        for round_ in range(args.repeat):
            for name, cmd in configs:
                shutil.rmtree(tmp / "spool", ignore_errors=True)  # each round starts from an empty spool
                server = start(name, cmd, tmp)
                try:
                    print(f"round {round_ + 1}/{args.repeat}: measuring {name} ...", file=sys.stderr)
                    rounds[name].append(asyncio.run(bench(server, bodies, args.clients, warmup)))
                finally:
                    server.stop()
        results = [best(rs) for rs in rounds.values()]
        if args.flood:
            cap, full_wait = 512, 0.5
            server = start(
                "atroposd-flood",
                [
                    sys.executable,
                    "-m",
                    "atroposd",
                    "api",
                    "--port",
                    str(free_port()),
                    "--no-spool",
                    "--max-queued-sequences",
                    str(cap),
                    "--full-wait",
                    str(full_wait),
                    "--log-level",
                    "warning",
                ],
                tmp,
            )
            try:
                print("flood mode ...", file=sys.stderr)
                flood_out = asyncio.run(flood(server, bodies, args.clients, cap, full_wait))
            finally:
                server.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(results, flood_out, groups, args.clients)
    return 0


def best(rounds: list[Result]) -> Result:
    """The best figure of each metric over the rounds (exactly-once must hold in every round)."""
    out = Result(rounds[0].name)
    out.post_groups_s = max(r.post_groups_s for r in rounds)
    out.post_p50_ms = min(r.post_p50_ms for r in rounds)
    out.post_p99_ms = min(r.post_p99_ms for r in rounds)
    out.post_cpu_ms_per_group = min(r.post_cpu_ms_per_group for r in rounds)
    out.drain_groups_s = max(r.drain_groups_s for r in rounds)
    out.drain_cpu_ms_per_batch = min(r.drain_cpu_ms_per_batch for r in rounds)
    out.drain_p50_ms = min(r.drain_p50_ms for r in rounds)
    out.mem_per_group_kb = min(r.mem_per_group_kb for r in rounds)
    out.lost = max(r.lost for r in rounds)
    out.duplicated = max(r.duplicated for r in rounds)
    out.exactly_once = all(r.exactly_once for r in rounds)
    out.extra = {
        "rounds": len(rounds),
        "post_groups_s_all": [round(r.post_groups_s, 1) for r in rounds],
        "drain_groups_s_all": [round(r.drain_groups_s, 1) for r in rounds],
    }
    return out


def report(results: list[Result], flood_out: dict[str, Any] | None, groups: int, clients: int) -> None:
    cols = [
        "server",
        "POST groups/s",
        "p50 ms",
        "p99 ms",
        "POST CPU ms/group",
        "drain groups/s",
        "drain CPU ms/batch",
        "KiB/group",
        "exactly once",
    ]
    rows = [
        [
            r.name,
            f"{r.post_groups_s:.0f}",
            f"{r.post_p50_ms:.1f}",
            f"{r.post_p99_ms:.1f}",
            f"{r.post_cpu_ms_per_group:.2f}",
            f"{r.drain_groups_s:.0f}",
            f"{r.drain_cpu_ms_per_batch:.1f}",
            f"{r.mem_per_group_kb:.0f}",
            "yes" if r.exactly_once else f"NO (lost {r.lost}, dup {r.duplicated})",
        ]
        for r in results
    ]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    print(f"\n{groups} groups of {SEQS}×{TOKENS} tokens, {clients} clients, batch {BATCH}")
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for row in rows:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
    ratios: dict[str, float] = {}
    by = {r.name: r for r in results}
    if "run-api" in by and "atroposd" in by:
        ours, theirs = by["atroposd"], by["run-api"]
        ratios = {
            "post": ours.post_groups_s / theirs.post_groups_s,
            "post_cpu": theirs.post_cpu_ms_per_group / max(ours.post_cpu_ms_per_group, 1e-9),
            "drain_cpu": theirs.drain_cpu_ms_per_batch / max(ours.drain_cpu_ms_per_batch, 1e-9),
            "drain": ours.drain_groups_s / theirs.drain_groups_s,
            "memory": ours.mem_per_group_kb / theirs.mem_per_group_kb if theirs.mem_per_group_kb else 0.0,
        }
        print(
            f"\natroposd / run-api: POST {ratios['post']:.1f}× (target ≥ 5×), drain {ratios['drain']:.1f}× "
            f"(target ≥ 20×), memory per queued group {ratios['memory']:.2f}× (target ≤ 0.25×)"
        )
        print(
            f"server CPU per unit, run-api / atroposd: POST {ratios['post_cpu']:.1f}×, drain {ratios['drain_cpu']:.1f}×"
        )
    if flood_out:
        print(
            f"\nflood (cap {flood_out['cap_sequences']} sequences, full_wait {flood_out['full_wait_s']} s): "
            f"statuses {flood_out['statuses']}, shortest refusal {flood_out['min_refusal_wait_s']:.2f} s, "
            f"RSS while full {flood_out['rss_full_mb_min']:.0f}–{flood_out['rss_full_mb_max']:.0f} MiB, "
            f"lost {flood_out['lost']}, duplicated {flood_out['duplicated']}"
        )
    print(
        json.dumps(
            {
                "benchmark": "api",
                "groups": groups,
                "clients": clients,
                "results": [r.__dict__ for r in results],
                "ratios": ratios,
                "flood": flood_out,
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())

"""An external trainer's cost of receiving a batch: JSON against safetensors and shared memory.

One atroposd API runs as a real process on loopback; the trainer registers with a batch size of
64 and environments' groups of 8 × 512 tokens (a 128-token prompt masked with -100, inference
logprobs, scores) are queued. Then, side by side in the same run and interleaved round by round,
batches are drained through four clients, and the client's CPU time (``time.process_time`` of
this process: the API is another process) and wall time per 64 × 512 batch are measured:

* ``requests + json``: ``requests.get(url + "/batch").json()``, as atroposlib's example trainer
  does (``requests`` asks for gzip; on loopback the API sends stored gzip blocks) — Python lists;
* ``requests + orjson``: the same response parsed by ``orjson`` — Python lists;
* ``safetensors / HTTP``: ``BatchClient(transport="safetensors")`` — padded numpy arrays;
* ``shared memory``: ``BatchClient(transport="shm")`` (mapped, acknowledged) — padded numpy arrays.

The JSON rows stop at nested lists; the binary rows hand over the padded [64, 512] arrays a
trainer needs (the JSON rows would still have to build them), and their timing includes reading
every array once (a shared-memory batch's pages are mapped on first touch, so that cost is
counted rather than deferred). Goals: shared memory ≥ 20× and
safetensors ≥ 5× less client CPU than requests + json.

Prints a table, the ratios, and one JSON line (``{"benchmark": "client", ...}``).

    python benchmarks/bench_client.py [--batches 32] [--repeat 3] [--tokens 512]
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from atroposd.client import BatchClient  # noqa: E402

SEQS, PROMPT, BATCH = 8, 128, 64
TOKENS = 512  # --tokens
GROUPS_PER_BATCH = BATCH // SEQS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_groups(first_tag: int, count: int) -> bytes:
    """A gzip'ed /scored_data_list body of ``count`` groups of 8 × 512 tokens."""
    groups = []
    for tag in range(first_tag, first_tag + count):
        rng = random.Random(tag)
        prompt = [rng.randrange(100, 150000) for _ in range(PROMPT)]
        tokens = [prompt + [rng.randrange(100, 150000) for _ in range(TOKENS - PROMPT)] for _ in range(SEQS)]
        groups.append(
            {
                "tokens": tokens,
                "masks": [[-100] * PROMPT + row[PROMPT:] for row in tokens],
                "scores": [float(tag)] + [0.5] * (SEQS - 1),
                "inference_logprobs": [
                    [1.0] * PROMPT + [-rng.expovariate(2.0) for _ in range(TOKENS - PROMPT)] for _ in range(SEQS)
                ],
                "generation_params": {"temperature": 1.0},
            }
        )
    return gzip.compress(orjson.dumps(groups), compresslevel=1)


def call(url: str, path: str, body: bytes | None = None, gz: bool = False) -> Any:
    headers = {"Content-Type": "application/json"}
    if gz:
        headers["Content-Encoding"] = "gzip"
    req = urllib.request.Request(url + path, data=body, headers=headers, method="POST" if body else "GET")
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def start_api(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(tmp / "api.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "atroposd", "api", "--port", str(port), "--max-queued-sequences", "16384"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            call(url, "/info")
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"the API exited: {(tmp / 'api.log').read_text()[-2000:]}") from None
            time.sleep(0.05)
    raise SystemExit("the API did not start")


def main() -> int:
    global TOKENS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=32, help="batches per client per round")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (every client in each)")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per sequence (prompt: 128)")
    args = ap.parse_args()
    TOKENS = args.tokens

    import requests

    tmp = Path(tempfile.mkdtemp(prefix="bench-client-"))
    proc, url = start_api(tmp)
    session = requests.Session()
    try:
        call(
            url,
            "/register",
            orjson.dumps(
                {
                    "wandb_group": "",
                    "wandb_project": "",
                    "batch_size": BATCH,
                    "max_token_len": TOKENS,
                    "checkpoint_dir": "",
                    "save_checkpoint_interval": 0,
                    "starting_step": 0,
                    "num_steps": 0,
                }
            ),
        )
        call(url, "/batch")
        bodies = [make_groups(i * GROUPS_PER_BATCH, GROUPS_PER_BATCH) for i in range(args.batches)]
        st_client = BatchClient(url, batch_size=BATCH, max_token_len=TOKENS, transport="safetensors")
        shm_client = BatchClient(url, batch_size=BATCH, max_token_len=TOKENS, transport="shm")

        def requests_json() -> Any:
            return session.get(url + "/batch").json()["batch"]

        def requests_orjson() -> Any:
            return orjson.loads(session.get(url + "/batch").content)["batch"]

        def check_lists(b: Any) -> int:
            return sum(len(g["tokens"]) for g in b)

        def check_arrays(b: Any) -> int:
            assert b.tokens.shape == (BATCH, TOKENS), b.tokens.shape
            return int(b.tokens.shape[0])

        def read_once(fetch: Callable[[], Any]) -> Callable[[], Any]:
            def fetch_and_read() -> Any:
                b = fetch()
                if b is not None:
                    for a in b.arrays.values():
                        a.sum()
                return b

            return fetch_and_read

        clients: list[tuple[str, Callable[[], Any], Callable[[Any], int]]] = [
            ("requests + json", requests_json, check_lists),
            ("requests + orjson", requests_orjson, check_lists),
            ("safetensors / HTTP", read_once(st_client.get_batch), check_arrays),
            ("shared memory", read_once(shm_client.get_batch), check_arrays),
        ]
        cpu: dict[str, list[float]] = {name: [] for name, _, _ in clients}
        wall: dict[str, list[float]] = {name: [] for name, _, _ in clients}
        warm = make_groups(10**6, GROUPS_PER_BATCH)
        for _, fetch, check in clients:  # warm-up: connections, first allocations
            call(url, "/scored_data_list", warm, gz=True)
            assert check(fetch()) == BATCH
        for _ in range(args.repeat):
            for name, fetch, check in clients:
                for body in bodies:
                    call(url, "/scored_data_list", body, gz=True)
                gc.collect()
                for _ in range(args.batches):
                    w0, c0 = time.perf_counter(), time.process_time()
                    b = fetch()
                    c1, w1 = time.process_time(), time.perf_counter()
                    assert check(b) == BATCH
                    del b
                    cpu[name].append(c1 - c0)
                    wall[name].append(w1 - w0)
                assert call(url, "/status")["queued_sequences"] == 0, "every batch drained exactly once"
        st_client.close()
        shm_client.close()
    finally:
        session.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    leftovers = [p.name for p in Path("/dev/shm").glob("atroposd-batch-*")]

    base = statistics.median(cpu["requests + json"])
    rows = []
    print(
        f"client cost per {BATCH} × {TOKENS}-token batch (median of {args.batches * args.repeat}; "
        f"{os.cpu_count()} CPUs, loaded machine: read the CPU column)"
    )
    print(f"{'transport':<20} {'client CPU ms':>14} {'wall ms':>9} {'CPU vs requests+json':>22}")
    for name, _, _ in clients:
        c, w = statistics.median(cpu[name]) * 1e3, statistics.median(wall[name]) * 1e3
        ratio = base * 1e3 / c if c > 0 else float("inf")
        rows.append({"transport": name, "cpu_ms": round(c, 3), "wall_ms": round(w, 3), "cpu_ratio": round(ratio, 1)})
        print(f"{name:<20} {c:>14.3f} {w:>9.3f} {ratio:>21.1f}×")
    shm_ratio = rows[3]["cpu_ratio"]
    st_ratio = rows[2]["cpu_ratio"]
    print(
        f"goals: shared memory ≥ 20× ({'met' if shm_ratio >= 20 else 'NOT met'}: {shm_ratio}×), "
        f"safetensors ≥ 5× ({'met' if st_ratio >= 5 else 'NOT met'}: {st_ratio}×); "
        f"segments left: {len(leftovers)}"
    )
    print(json.dumps({"benchmark": "client", "batch": [BATCH, TOKENS], "rows": rows, "segments_left": leftovers}))
    return 0 if not leftovers else 1


if __name__ == "__main__":
    sys.exit(main())

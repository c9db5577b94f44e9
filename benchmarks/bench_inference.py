"""Torch engine throughput on the embedded job's shape: batched against one request at a time.

The embedded job samples 8 prompts × group 8 = 64 sequences of 3 tokens from 5-token prompts
(``[BOS]a+b=``) per optimizer step. Measured on builtin:tiny, CPU, one torch thread:

* engine: the decoding loop in this process (no HTTP) — the 64 sequences as one batch (the
  8 requests with n = 8 arriving together; with the flat Llama forward and with the model's own
  forward), as 8 requests one after another, and as 64 single sequences one after another;
* http: ``atroposd inference`` as a real child process; 8 concurrent ``POST /generate`` with
  n = 8 (what the environment sends) against 64 sequential ``n = 1`` requests.

Each figure is the median over ``--rounds`` rounds (the minimum is shown too). Prints a table
and one JSON line (``{"benchmark": "inference", ...}``). Target: a 64-sequence round well under
50 ms.

    .venv/bin/python benchmarks/bench_inference.py [--rounds 30] [--no-http]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PROMPTS, GROUP, MAX_TOKENS = 8, 8, 3


def prompts() -> list[list[int]]:
    from atroposd.models.tiny import BOS_ID, VOCAB

    ids = {t: i for i, t in enumerate(VOCAB)}
    return [[BOS_ID, ids[str(a)], ids["+"], ids[str((a * 3) % 10)], ids["="]] for a in range(PROMPTS)]


def timed(fn: Callable[[], Any], rounds: int) -> tuple[float, float]:
    """(median, min) seconds of ``fn`` over ``rounds`` runs after two warm-up runs."""
    fn()
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def bench_engine(model_dir: Path, rounds: int) -> dict[str, tuple[float, float]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from atroposd.inference.schema import GenerateParams
    from atroposd.inference.torch_engine import decode_batch

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    gen = torch.Generator().manual_seed(0)
    group = [GenerateParams(prompt_ids=p, n=GROUP, max_tokens=MAX_TOKENS, ignore_eos=True) for p in prompts()]
    single = [GenerateParams(prompt_ids=p, n=1, max_tokens=MAX_TOKENS, ignore_eos=True) for p in prompts()]

    def run(reqs: list[GenerateParams], fast: bool = True) -> None:
        with torch.inference_mode():
            decode_batch(model, reqs, tokenizer=tok, eos_ids=frozenset({2}), generator=gen, fast=fast)

    return {
        "one batch (8 requests × n=8)": timed(lambda: run(group), rounds),
        "one batch, model's own forward": timed(lambda: run(group, fast=False), rounds),
        "8 requests one at a time": timed(lambda: [run([r]) for r in group], rounds),
        "64 sequences one at a time": timed(
            lambda: [run([r]) for r in single for _ in range(GROUP)], max(3, rounds // 5)
        ),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model_dir: Path, root: Path, index: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "atroposd",
        "inference",
        "--port",
        str(port),
        "--model",
        str(model_dir),
        "--max-model-len",
        "256",
        "--control-socket",
        str(root / f"inf-{index}.sock"),
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def wait_up(proc: subprocess.Popen[bytes], url: str) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"inference server exited {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"inference server at {url} not up within 180 s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def bench_http(model_dir: Path, rounds: int) -> dict[str, tuple[float, float]]:
    import aiohttp

    root = Path(tempfile.mkdtemp(prefix="atpd-bench-inf-", dir="/tmp"))
    proc, url = start_server(model_dir, root, 0)
    try:
        wait_up(proc, url)

        async def measure() -> dict[str, tuple[float, float]]:
            async with aiohttp.ClientSession() as session:

                async def post(p: list[int], n: int) -> None:
                    body = {
                        "prompt": {"prompt_token_ids": p},
                        "n": n,
                        "max_tokens": MAX_TOKENS,
                        "logprobs": 0,
                        "temperature": 1.0,
                        "ignore_eos": True,
                    }
                    async with session.post(url + "/generate", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        await resp.read()

                async def concurrent() -> None:
                    await asyncio.gather(*(post(p, GROUP) for p in prompts()))

                async def sequential() -> None:
                    for p in prompts():
                        for _ in range(GROUP):
                            await post(p, 1)

                out = {}
                for name, fn, k in (
                    ("8 concurrent requests × n=8", concurrent, rounds),
                    ("64 sequential n=1 requests", sequential, max(3, rounds // 5)),
                ):
                    await fn()
                    times = []
                    for _ in range(k):
                        t0 = time.perf_counter()
                        await fn()
                        times.append(time.perf_counter() - t0)
                    out[name] = (statistics.median(times), min(times))
                return out

        return asyncio.run(measure())
    finally:
        stop(proc)
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--no-http", action="store_true", help="only the in-process engine")
    args = parser.parse_args()
    from atroposd.models.tiny import ensure_builtin_model

    state = Path(tempfile.mkdtemp(prefix="atpd-bench-state-", dir="/tmp"))
    try:
        model_dir = ensure_builtin_model(state, seed=0, max_model_len=256)
        results = {"engine": bench_engine(model_dir, args.rounds)}
        if not args.no_http:
            results["http"] = bench_http(model_dir, args.rounds)
    finally:
        shutil.rmtree(state, ignore_errors=True)
    tokens = PROMPTS * GROUP * MAX_TOKENS
    print(
        f"64 sequences × {MAX_TOKENS} tokens from 5-token prompts; builtin:tiny, CPU, 1 thread; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(f"{'path':<6} {'how':<32} {'median ms':>10} {'min ms':>8} {'tokens/s':>10}")
    summary: dict[str, Any] = {"benchmark": "inference", "sequences": PROMPTS * GROUP, "max_tokens": MAX_TOKENS}
    for path, rows in results.items():
        for how, (med, best) in rows.items():
            print(f"{path:<6} {how:<32} {med * 1e3:>10.1f} {best * 1e3:>8.1f} {tokens / med:>10.0f}")
            key = f"{path}: {how}"
            summary[key] = {
                "median_ms": round(med * 1e3, 2),
                "min_ms": round(best * 1e3, 2),
                "tokens_per_s": round(tokens / med),
            }
    engine = results["engine"]
    batched = engine["one batch (8 requests × n=8)"][0]
    summary["batched_speedup_vs_single_sequences"] = round(engine["64 sequences one at a time"][0] / batched, 1)
    print(f"batched vs one sequence at a time: {summary['batched_speedup_vs_single_sequences']}×")
    print(json.dumps(summary, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())

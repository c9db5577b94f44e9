"""In-flight weight updates against draining (``[trainer] inflight = "keep" | "drain"``, SPEC §7).

A job with long-tailed rollouts on builtin:tiny (CPU, one torch thread), the torch engine in this
process: ``--clients`` environments each generate one completion after another, its length drawn
log-normal and clipped to 16..1,024 tokens (``ignore_eos``); a trainer takes ``--batch``
completions per step, "trains" (``--train-ms``) and syncs the weights every step (pause →
``load_weights`` of a sync directory → resume, as the reload mode does). The same seeds drive
both modes. Per mode:

* the time from a sync's start to the swap (the pause returning: frozen at once with ``keep``,
  every generation in flight answered with ``drain``), p50 and p99;
* the replica's idle share: the share of the run's time no forward pass computes (sampled
  every 2 ms);
* the job's steps/s, and (``keep``) the share of the trained tokens sampled after a swap.

Prints a table and one JSON line (``{"benchmark": "inflight", ...}``).

    .venv/bin/python benchmarks/bench_inflight.py [--steps 20] [--clients 16] [--batch 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MAX_MODEL_LEN = 1100
SYNC_VERSION = 10_000  # the versions the two sync directories are written with


def lengths(seed: int, count: int) -> list[int]:
    """Log-normal completion lengths (median ~90 tokens, a long tail), clipped to 16..1,024."""
    rng = random.Random(seed)
    return [max(16, min(1024, int(rng.lognormvariate(math.log(90), 1.0)))) for _ in range(count)]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


async def run_mode(mode: str, args: argparse.Namespace, model_dir: Path, sync_dirs: list[Path]) -> dict[str, Any]:
    from atroposd.inference.torch_engine import TorchEngine
    from atroposd.models.tiny import BOS_ID
    from atroposd.weights.receiver import ReceiverState

    work = Path(tempfile.mkdtemp(prefix="bench-inflight-"))
    receiver = ReceiverState(nonce="benchinflight", weights_dir=work / "weights", sync_dir=sync_dirs[0].parent)
    eng = TorchEngine(model_dir=model_dir, max_model_len=MAX_MODEL_LEN, seed=args.seed, receiver=receiver)
    await eng.start()
    done: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    stop = asyncio.Event()
    busy = idle = 0

    async def client(c: int) -> None:
        for n in lengths(args.seed * 1000 + c, 100_000):
            if stop.is_set():
                return
            body = {
                "prompt": {"prompt_token_ids": [BOS_ID, 5 + c % 9, 14, 7, 17]},
                "max_tokens": n,
                "ignore_eos": True,
                "temperature": 1.0,
                "seed": c * 100_003 + n,
                "logprobs": 0,
            }
            try:
                await done.put(await eng.generate(body))
            except Exception:
                return

    async def sampler() -> None:
        nonlocal busy, idle
        while not stop.is_set():
            if eng._owns_compute:
                busy += 1
            else:
                idle += 1
            await asyncio.sleep(0.002)

    tasks = [asyncio.create_task(client(c)) for c in range(args.clients)]
    watch = asyncio.create_task(sampler())
    try:
        return await _steps(mode, args, eng, done, sync_dirs, lambda: (busy, idle))
    finally:
        stop.set()
        await eng.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, watch, return_exceptions=True)
        shutil.rmtree(work, ignore_errors=True)


async def _steps(
    mode: str,
    args: argparse.Namespace,
    eng: Any,
    done: asyncio.Queue[dict[str, Any]],
    sync_dirs: list[Path],
    counts: Any,
) -> dict[str, Any]:
    to_swap: list[float] = []
    tokens = swapped = 0
    t0 = time.perf_counter()
    for step in range(args.steps):
        for _ in range(args.batch):
            answer = await done.get()
            n = len(answer["token_ids"][0])
            tokens += n
            record = (answer.get("weight_versions") or [[[0, 0]]])[0]
            if len(record) > 1:
                swapped += n - record[1][0]
        await asyncio.sleep(args.train_ms / 1000)
        start = time.perf_counter()
        if mode == "keep":
            await eng.pause(mode="keep", clear_cache=True)
        else:
            await eng.pause()
        to_swap.append(time.perf_counter() - start)
        k = (step + 1) % len(sync_dirs)
        try:
            await eng.load_weights({"path": str(sync_dirs[k]), "weight_version": SYNC_VERSION + k})
        finally:
            await eng.resume(step + 1)
    elapsed = time.perf_counter() - t0
    busy, idle = counts()
    return {
        "mode": mode,
        "steps": args.steps,
        "to_swap_p50_ms": round(1000 * percentile(to_swap, 0.5), 2),
        "to_swap_p99_ms": round(1000 * percentile(to_swap, 0.99), 2),
        "idle_share": round(idle / max(1, busy + idle), 3),
        "steps_per_s": round(args.steps / elapsed, 3),
        "swapped_token_share": round(swapped / max(1, tokens), 3),
        "frozen_syncs": eng.frozen_syncs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--train-ms", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from atroposd.models.tiny import ensure_builtin_model
    from atroposd.weights.reload import write_sync_dir

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench-inflight-"))
    try:
        model_dir = ensure_builtin_model(root / "state", seed=0, max_model_len=MAX_MODEL_LEN)
        sync_root = root / "sync"
        dirs = []
        for k in range(2):  # two sets of weights, alternated
            model = AutoModelForCausalLM.from_pretrained(str(model_dir))
            with torch.no_grad():
                gen = torch.Generator().manual_seed(k)
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 0.01)
            dirs.append(write_sync_dir(model, sync_root, SYNC_VERSION + k))
        rows = [asyncio.run(run_mode(mode, args, model_dir, dirs)) for mode in ("keep", "drain")]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    keep, drain = rows
    print(f"{'mode':6} {'to swap p50 ms':>15} {'p99 ms':>10} {'idle share':>11} {'steps/s':>9} {'swapped':>8}")
    for r in rows:
        print(
            f"{r['mode']:6} {r['to_swap_p50_ms']:15.2f} {r['to_swap_p99_ms']:10.2f} {r['idle_share']:11.3f}"
            f" {r['steps_per_s']:9.3f} {r['swapped_token_share']:8.3f}"
        )
    ratio_p99 = keep["to_swap_p99_ms"] / drain["to_swap_p99_ms"] if drain["to_swap_p99_ms"] else math.nan
    ratio_steps = keep["steps_per_s"] / drain["steps_per_s"] if drain["steps_per_s"] else math.nan
    print(f"keep/drain: p99 to swap {ratio_p99:.3f}x, steps/s {ratio_steps:.2f}x")
    summary = {
        "benchmark": "inflight",
        "args": vars(args),
        "rows": rows,
        "p99_ratio": round(ratio_p99, 4),
        "steps_ratio": round(ratio_steps, 3),
        "median_length": statistics.median(lengths(args.seed, 10_000)),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

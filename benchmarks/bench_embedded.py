"""The embedded job end to end: does it learn, how fast, on this machine.

Runs ``atroposd run`` on the built-in defaults (the embedded job of SPEC §8) once per seed, each
in its own temporary runtime/state directories and ports, and reports per seed: wall time,
end-to-end steps/s, mean reward and accuracy of the first and last 10 steps, whether SPEC §8's
target holds (last 10 ≥ first 10 + 0.3, ≥ 2× first 10, ≥ 0.6), and the greedy exact-match accuracy
of the final checkpoint on all 100 single-digit sums. Writes each run's curve with ``atroposd
plot`` next to the JSON summary.

    .venv/bin/python benchmarks/bench_embedded.py --seeds 0 1 2 [--steps 3000] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(root: Path, seed: int, steps: int | None) -> Path:
    lines = [
        "[daemon]", f'runtime_dir = "{root / "run"}"', f'state_dir = "{root / "state"}"', 'log_format = "console"',
        "[api]", f"port = {_free_port()}",
        "[inference]", f"port = {_free_port()}",
        "[trainer]", f"seed = {seed}",
    ]
    if steps is not None:
        lines.append(f"steps = {steps}")
    lines += ["[[env]]", 'name = "arithmetic"', 'builtin = "arithmetic"']
    path = root / "atroposd.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def greedy_exact_match(checkpoint: Path) -> float:
    """Greedy exact match of the checkpoint on every problem of the default task."""
    import torch
    from transformers import AutoModelForCausalLM

    from atroposd.envs.arithmetic import evaluate_exact_match

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint)).eval()
    eos = model.config.eos_token_id

    def greedy(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        out = []
        with torch.no_grad():
            for ids in prompts:
                completion: list[int] = []
                for _ in range(max_tokens):
                    nxt = int(model(torch.tensor([ids + completion])).logits[0, -1].argmax())
                    completion.append(nxt)
                    if nxt == eos:
                        break
                out.append(completion)
        return out

    return evaluate_exact_match(greedy, checkpoint).accuracy


def run_seed(seed: int, steps: int | None, out_dir: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="apd-bench-", dir="/tmp") as tmp:
        root = Path(tmp)
        cfg = _config(root, seed, steps)
        log = out_dir / f"seed{seed}.log"
        t0 = time.monotonic()
        with open(log, "wb") as fh:
            rc = subprocess.call([sys.executable, "-m", "atroposd", "run", "-c", str(cfg)], stdout=fh,
                                 stderr=subprocess.STDOUT, cwd=REPO)
        wall = time.monotonic() - t0
        rows = [json.loads(x) for x in (root / "state" / "metrics.jsonl").read_text().splitlines() if x.strip()]
        (out_dir / f"seed{seed}.metrics.jsonl").write_text(
            (root / "state" / "metrics.jsonl").read_text())
        subprocess.call([sys.executable, "-m", "atroposd", "plot", "-c", str(cfg), "-o",
                         str(out_dir / f"seed{seed}.png")], cwd=REPO)
        ckpts = sorted((root / "state" / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        exact = greedy_exact_match(ckpts[-1]) if ckpts else float("nan")
    reward = [r["reward_mean"] for r in rows]
    acc = [r["accuracy"] for r in rows if r.get("accuracy") is not None]
    first, last = _mean(reward[:10]), _mean(reward[-10:])
    t_first = rows[0]["time"] if rows else 0.0
    return {
        "seed": seed, "exit_code": rc, "steps": len(rows), "wall_s": round(wall, 1),
        "train_s": round(rows[-1]["time"] - t_first, 1) if rows else None,
        "steps_per_s": round(len(rows) / wall, 2) if rows else 0.0,
        "reward_first10": round(first, 3), "reward_last10": round(last, 3),
        "accuracy_first10": round(_mean(acc[:10]), 3), "accuracy_last10": round(_mean(acc[-10:]), 3),
        "greedy_exact_match": exact,
        "target_met": bool(rc == 0 and last >= first + 0.3 and last >= 2 * first and last >= 0.6
                           and wall <= 600),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None, help="default: the built-in default")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "embedded")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.pop("ATROPOSD_CONFIG", None)
    results = []
    for seed in args.seeds:
        res = run_seed(seed, args.steps, args.out)
        results.append(res)
        print(json.dumps(res), flush=True)
    cols = ["seed", "exit_code", "steps", "wall_s", "steps_per_s", "reward_first10", "reward_last10",
            "accuracy_first10", "accuracy_last10", "greedy_exact_match", "target_met"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    summary = {"bench": "embedded", "runs": results, "all_met": all(r["target_met"] for r in results)}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0 if summary["all_met"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""The embedded job end to end: does it learn, how fast, where the time goes, on this machine.

Runs ``atroposd run`` on the built-in defaults (the embedded job of SPEC §8) once per seed, each
in its own temporary runtime/state directories and ports, and reports per seed: wall time,
end-to-end steps/s (``steps_per_s``: steps over the whole run's wall time, start and stop
included; ``train_steps_per_s``: over the training itself, first step to last), the trainer's
wait fraction (``batch_wait_s`` summed over the training time), the CPU the job's processes
used over the training (``cpu_util``: of all cores), mean reward and accuracy of the first and
last 10 steps, whether SPEC §8's target holds (last 10 ≥ first 10 + 0.3, ≥ 2× first 10, ≥ 0.6),
and the greedy exact-match accuracy of the final checkpoint on all 100 single-digit sums.
Writes each run's curve with ``atroposd plot`` next to the JSON summary.

``--timeline`` prints where a step's time goes (the per-step timeline of ``metrics.jsonl``,
mean milliseconds per step after the first 20): the trainer's wait for the batch, preparation,
compute, the optimizer step, the rest of the pause (shared mode), the weight sync after it; on
the rollout side a group's time at the gate, generating, and from posting to the trainer
(``delivery``), and the ``GET /batch``; and each component's CPU seconds per second.

``--before REV`` runs the same seeds first on the code of git revision REV (exported to a
temporary directory), then on this tree, and prints them side by side.

    .venv/bin/python benchmarks/bench_embedded.py --seeds 0 1 2 [--steps 3000] [--out DIR]
    .venv/bin/python benchmarks/bench_embedded.py --seeds 0 --steps 400 --timeline --before HEAD~3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
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
        "[daemon]",
        f'runtime_dir = "{root / "run"}"',
        f'state_dir = "{root / "state"}"',
        'log_format = "console"',
        "[api]",
        f"port = {_free_port()}",
        "[inference]",
        f"port = {_free_port()}",
        "[trainer]",
        f"seed = {seed}",
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


def _component(cmdline: list[str]) -> str:
    """Which part of the job a process of the tree is (by its command line)."""
    words = [w for w in cmdline if not w.startswith("-")]
    for part in ("api", "inference", "env"):
        if part in words:
            return part
    if any("atroposd.api" in w for w in cmdline):
        return "api"  # the API's parse helper
    if any("vllm" in w.lower() for w in cmdline):
        return "inference"
    return "daemon+trainer"


class CpuSampler:
    """Samples the CPU time of a process tree twice a second; per component, the CPU seconds
    used between ``mark()`` and the last sample (processes that exit keep their last value)."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.last: dict[int, tuple[str, float]] = {}
        self.marked: dict[int, float] | None = None
        self.marked_at = self.last_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import psutil

        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        for proc in procs:
            try:
                with proc.oneshot():
                    t = proc.cpu_times()
                    name = (
                        self.last[proc.pid][0]
                        if proc.pid in self.last
                        else ("daemon+trainer" if proc.pid == self.root.pid else _component(proc.cmdline()))
                    )
                    self.last[proc.pid] = (name, t.user + t.system)
            except psutil.Error:
                continue
        self.last_at = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self._sample()

    def mark(self) -> None:
        self._sample()
        self.marked = {pid: cpu for pid, (_name, cpu) in self.last.items()}
        self.marked_at = self.last_at

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        base = self.marked or {}
        span = max(self.last_at - self.marked_at, 1e-9)
        per: dict[str, float] = {}
        for pid, (name, cpu) in self.last.items():
            per[name] = per.get(name, 0.0) + cpu - base.get(pid, 0.0)
        total = sum(per.values())
        return {
            "cpu_s": round(total, 1),
            "cpu_span_s": round(span, 1),
            "cpu_util": round(total / span / (os.cpu_count() or 1), 3),
            "cpu_per_s": {k: round(v / span, 3) for k, v in sorted(per.items())},
        }


def _run_job(cfg: Path, log: Path, metrics: Path, src: Path) -> tuple[int, float, dict[str, Any]]:
    """``atroposd run`` of ``src``'s code; its exit code, wall time and CPU use over the training."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    t0 = time.monotonic()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "atroposd", "run", "-c", str(cfg)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=src,
            env=env,
        )
        sampler = CpuSampler(proc.pid)
        while proc.poll() is None:  # the CPU window opens at the first step
            if sampler.marked is None and metrics.is_file() and metrics.stat().st_size > 0:
                sampler.mark()
            time.sleep(0.1)
        rc = proc.returncode
    wall = time.monotonic() - t0
    return rc, wall, sampler.stop()


def run_seed(seed: int, steps: int | None, out_dir: Path, *, src: Path = REPO, label: str = "") -> dict[str, Any]:
    tag = f"{label}-seed{seed}" if label else f"seed{seed}"
    with tempfile.TemporaryDirectory(prefix="apd-bench-", dir="/tmp") as tmp:
        root = Path(tmp)
        cfg = _config(root, seed, steps)
        metrics = root / "state" / "metrics.jsonl"
        rc, wall, cpu = _run_job(cfg, out_dir / f"{tag}.log", metrics, src)
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        (out_dir / f"{tag}.metrics.jsonl").write_text(metrics.read_text())
        subprocess.call(
            [sys.executable, "-m", "atroposd", "plot", "-c", str(cfg), "-o", str(out_dir / f"{tag}.png")], cwd=REPO
        )
        ckpts = sorted((root / "state" / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        exact = greedy_exact_match(ckpts[-1]) if ckpts else float("nan")
    reward = [r["reward_mean"] for r in rows]
    acc = [r["accuracy"] for r in rows if r.get("accuracy") is not None]
    first, last = _mean(reward[:10]), _mean(reward[-10:])
    t_first = rows[0]["time"] if rows else 0.0
    train_s = rows[-1]["time"] - t_first if rows else 0.0
    return {
        "label": label,
        "seed": seed,
        "exit_code": rc,
        "steps": len(rows),
        "wall_s": round(wall, 1),
        "train_s": round(train_s, 1),
        "steps_per_s": round(len(rows) / wall, 2) if rows else 0.0,
        "train_steps_per_s": round((len(rows) - 1) / train_s, 2) if train_s > 0 else 0.0,
        "wait_fraction": round(sum(r.get("batch_wait_s") or 0.0 for r in rows[1:]) / train_s, 3)
        if train_s > 0
        else None,
        "cpu_util": cpu["cpu_util"],
        "reward_first10": round(first, 3),
        "reward_last10": round(last, 3),
        "accuracy_first10": round(_mean(acc[:10]), 3),
        "accuracy_last10": round(_mean(acc[-10:]), 3),
        "greedy_exact_match": exact,
        "target_met": bool(rc == 0 and last >= first + 0.3 and last >= 2 * first and last >= 0.6 and wall <= 600),
        "timeline": timeline(rows),
        "cpu": cpu,
    }


# The per-step timeline (ms per step): (label, how it is read from a metrics row).
TIMELINE: list[tuple[str, Any]] = [
    ("step interval", None),
    ("trainer: wait for batch", lambda r: r.get("batch_wait_s")),
    ("trainer: prepare", lambda r: r.get("prepare_s")),
    ("trainer: compute", lambda r: r.get("compute_s")),
    ("trainer: optimizer step", lambda r: r.get("optimizer_s")),
    ("trainer: rest of pause", lambda r: _diff(r.get("pause_s"), r.get("optimizer_s"))),
    ("trainer: sync after step", lambda r: _diff(r.get("sync_s"), r.get("pause_s"))),
    ("rollout: at the gate", lambda r: r.get("rollout_gate_s")),
    ("rollout: generating", lambda r: r.get("rollout_generate_s")),
    ("rollout: post → trainer", lambda r: r.get("rollout_delivery_s")),
    ("trainer: GET /batch", lambda r: r.get("fetch_s")),
]


def _diff(a: Any, b: Any) -> float | None:
    return a - b if isinstance(a, (int, float)) and isinstance(b, (int, float)) else None


def timeline(rows: list[dict[str, Any]], skip: int = 20) -> dict[str, float | None]:
    """Mean milliseconds per step of each part (the first ``skip`` steps left out: warm-up)."""
    rows = rows[skip:] if len(rows) > skip + 10 else rows
    out: dict[str, float | None] = {}
    if len(rows) > 1:
        out["step interval"] = round(1000 * (rows[-1]["time"] - rows[0]["time"]) / (len(rows) - 1), 1)
    for name, read in TIMELINE[1:]:
        values = [v for v in (read(r) for r in rows) if isinstance(v, (int, float))]
        out[name] = round(1000 * _mean(values), 1) if values else None
    return out


def print_timeline(results: list[dict[str, Any]]) -> None:
    heads = [f"{r['label'] or 'run'} s{r['seed']}" for r in results]
    print("\n| ms per step | " + " | ".join(heads) + " |")
    print("|---|" + "---|" * len(results))
    for name, _ in TIMELINE:
        print(f"| {name} | " + " | ".join(_cell(r["timeline"].get(name)) for r in results) + " |")
    parts = sorted({k for r in results for k in r["cpu"]["cpu_per_s"]})
    for part in parts:
        print(f"| CPU s/s: {part} | " + " | ".join(_cell(r["cpu"]["cpu_per_s"].get(part)) for r in results) + " |")
    print("| CPU utilisation (all cores) | " + " | ".join(_cell(r["cpu"]["cpu_util"]) for r in results) + " |")


def _cell(v: Any) -> str:
    return "–" if v is None else str(v)


def export_revision(rev: str, into: Path) -> Path:
    """The tree of git revision ``rev`` of this repository, unpacked under ``into``."""
    dest = into / "src"
    dest.mkdir()
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None, help="default: the built-in default")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "embedded")
    ap.add_argument("--timeline", action="store_true", help="print where each step's time goes")
    ap.add_argument("--before", metavar="REV", help="run the same seeds on git revision REV first, side by side")
    ap.add_argument("--repeat", type=int, default=1, help="run each configuration this many times (interleaved)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.pop("ATROPOSD_CONFIG", None)
    results = []
    with tempfile.TemporaryDirectory(prefix="apd-bench-src-", dir="/tmp") as tmp:
        sources = [("before", export_revision(args.before, Path(tmp)))] if args.before else []
        sources.append(("after" if args.before else "", REPO))
        for _ in range(args.repeat):
            for seed in args.seeds:
                for label, src in sources:
                    res = run_seed(seed, args.steps, args.out, src=src, label=label)
                    results.append(res)
                    print(json.dumps(res), flush=True)
    cols = [
        "label",
        "seed",
        "exit_code",
        "steps",
        "wall_s",
        "steps_per_s",
        "train_steps_per_s",
        "wait_fraction",
        "cpu_util",
        "reward_first10",
        "reward_last10",
        "accuracy_first10",
        "accuracy_last10",
        "greedy_exact_match",
        "target_met",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    if args.timeline:
        print_timeline(results)
    summary = {
        "bench": "embedded",
        "before": args.before,
        "runs": results,
        "all_met": all(r["target_met"] for r in results if r["label"] != "before"),
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0 if summary["all_met"] else 1


if __name__ == "__main__":
    sys.exit(main())

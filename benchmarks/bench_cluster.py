"""Several machines (SPEC §12.3), as two daemons on this one machine over loopback: what a
weight sync costs a replica on node 1 against one on node 0, and how long a node's kill -9
costs the trainer.

Each case is a whole job of two nodes (``atroposd run`` twice: its own runtime and state
directories and inference port each, one cluster port, a shared ``checkpoint_dir``), one trainer
rank and one inference replica per node, ``weight_sync = "push"``, the built-in task:

1. **sync, tiny and ~85M**: every step is one push. Node 0's replica is fed by rank 0 in the
   daemon (``sync_s`` of the metrics rows, less ``gather_s``: pause, write, copy, resume); node
   1's by node 1's trainer rank from the same gathered buckets (its summary line, logged when it
   stops). The gathers themselves (``gather_s``) are shared by both.
2. **recovery, tiny**: at a step past a checkpoint node 1's daemon is killed -9 and started
   again at once; the time until the head finds the node lost, until it is ready again, and
   until the trainer trains past its pre-kill step.

On two shared cores the eight processes of a job compete for the same CPUs: the figures are an
upper bound of what loopback costs, not a network's. Prints a table and one JSON line
(``{"benchmark": "cluster", ...}``).

    .venv/bin/python benchmarks/bench_cluster.py [--steps 100] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.e2e.jobs import SHORT_TASK, cluster_configs  # noqa: E402

# An ~85M-parameter Llama with builtin:tiny's tokenizer (vocabulary 512, so the built-in task's
# text round-trips): hidden 768, 12 layers.
SIZE_85M = dict(
    vocab_size=512,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    head_dim=64,
)


def build_85m(root: Path) -> Path:
    from benchmarks.bench_ranks import build_llama

    return build_llama(root / "model-85M", SIZE_85M)


def _status(cfg: Path) -> dict[str, Any] | None:
    res = subprocess.run(
        [sys.executable, "-m", "atroposd", "status", "-c", str(cfg), "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if res.returncode != 0:
        return None
    data: dict[str, Any] = json.loads(res.stdout)
    return data


def _run(cfg: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("ATROPOSD_CONFIG", None)
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "atroposd", "run", "-c", str(cfg)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _wait(pred: Any, timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what}: not within {timeout:g} s")


def _step(cfg: Path) -> int:
    st = _status(cfg)
    return int(st["trainer"]["step"]) if st and st.get("trainer") else -1


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def _fed_summary(log: Path) -> dict[str, Any] | None:
    for line in reversed(log.read_text(errors="replace").splitlines() if log.exists() else []):
        if "this node's replicas were fed" in line:
            data: dict[str, Any] = json.loads(line)
            return data
    return None


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 5) if xs else float("nan")


def sync_case(root: Path, name: str, steps: int, model: Path | None) -> dict[str, Any]:
    trainer: dict[str, Any] = {
        "batch_size": 16,
        "micro_batch_size": 4,
        "checkpoint_every": 10_000,
        "weight_sync": "push",
        "sync_bucket_mb": 64,
    }
    inference: dict[str, Any] = {}
    if model is not None:
        inference = {"model": str(model), "max_model_len": 64}
    cfgs = cluster_configs(
        root, steps=steps, envs=SHORT_TASK, trainer=trainer, inference=inference, cluster={"heartbeat_timeout": 30.0}
    )
    print(f"  {name}: {steps} steps across 2 nodes ...", file=sys.stderr, flush=True)
    procs = [_run(cfgs[1], root / "node1.out"), _run(cfgs[0], root / "node0.out")]
    try:
        codes = [p.wait(1800) for p in procs]
    finally:
        _stop(procs)
    if codes != [0, 0]:
        raise RuntimeError(f"{name}: the job exited {codes}; see {root}")
    rows = [json.loads(x) for x in (root / "node0" / "state" / "metrics.jsonl").read_text().splitlines() if x]
    rows = rows[2:]  # the first steps include the first attach
    sync = [r["sync_s"] for r in rows]
    gather = [r["gather_s"] for r in rows]
    node0 = [r["sync_s"] - r["gather_s"] for r in rows]
    fed = _fed_summary(root / "node1" / "state" / "logs" / "trainer-1.log") or {}
    return {
        "case": name,
        "steps": len(rows),
        "sync_s": _median(sync),
        "gather_s": _median(gather),
        "node0_feed_s": _median(node0),
        "node1_feed_s": fed.get("median_s"),
        "node1_pushes": fed.get("pushes"),
        "staging_bytes": fed.get("staging_bytes"),
        "step_s": _median([r["step_s"] for r in rows]),
    }


def recovery_case(root: Path) -> dict[str, Any]:
    cfgs = cluster_configs(
        root,
        steps=100_000,
        envs=SHORT_TASK,
        trainer={"checkpoint_every": 5, "batch_size": 16, "micro_batch_size": 4},
        cluster={"heartbeat_timeout": 10.0},
    )
    print("  recovery: kill -9 of node 1, started again at once ...", file=sys.stderr, flush=True)
    procs = [_run(cfgs[1], root / "node1.out"), _run(cfgs[0], root / "node0.out")]
    try:
        _wait(lambda: _step(cfgs[0]) >= 12, 600, "training to step 12")
        before = _step(cfgs[0])
        t0 = time.monotonic()
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait(30)
        procs[0] = _run(cfgs[1], root / "node1-again.out")
        lost = _wait(
            lambda: (_status(cfgs[0]) or {}).get("nodes", [{}, {}])[1].get("state") == "lost" and time.monotonic(),
            60,
            "node 1 lost",
        )
        ready = _wait(
            lambda: (_status(cfgs[0]) or {}).get("nodes", [{}, {}])[1].get("state") == "ready" and time.monotonic(),
            600,
            "node 1 ready again",
        )
        trained = _wait(lambda: _step(cfgs[0]) > before and time.monotonic(), 600, "training past the pre-kill step")
        st = _status(cfgs[0]) or {}
    finally:
        _stop(procs)
    return {
        "case": "recovery",
        "pre_kill_step": before,
        "lost_after_s": round(lost - t0, 2),
        "ready_again_after_s": round(ready - t0, 2),
        "training_again_after_s": round(trained - t0, 2),
        "group_restarts": st.get("trainer", {}).get("group_restarts"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="steps of the tiny sync case (default 100)")
    ap.add_argument("--steps-85m", type=int, default=8, help="steps of the ~85M sync case (default 8)")
    ap.add_argument("--quick", action="store_true", help="the tiny cases only")
    args = ap.parse_args()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="apc-", dir="/tmp") as tmp:
        base = Path(tmp)
        (base / "tiny").mkdir()
        results.append(sync_case(base / "tiny", "sync tiny", args.steps, None))
        if not args.quick:
            (base / "85M").mkdir()
            model = build_85m(base)
            results.append(sync_case(base / "85M", "sync ~85M", args.steps_85m, model))
        (base / "recovery").mkdir()
        results.append(recovery_case(base / "recovery"))
    print(f"{'case':<12} {'steps':>5} {'step s':>8} {'gather s':>9} {'node 0 feed s':>14} {'node 1 feed s':>14}")
    for r in results:
        if r["case"].startswith("sync"):
            print(
                f"{r['case']:<12} {r['steps']:>5} {r['step_s']:>8.4f} {r['gather_s']:>9.4f} "
                f"{r['node0_feed_s']:>14.4f} {r['node1_feed_s'] or float('nan'):>14.4f}"
            )
    rec = results[-1]
    print(
        f"recovery: node 1 killed -9 at step {rec['pre_kill_step']} and started again at once: lost after "
        f"{rec['lost_after_s']} s, ready again after {rec['ready_again_after_s']} s, training past its pre-kill "
        f"step after {rec['training_again_after_s']} s"
    )
    print(json.dumps({"benchmark": "cluster", "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

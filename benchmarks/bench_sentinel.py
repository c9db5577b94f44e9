"""The replica sentinel's cost (SPEC §15) and the time from a corruption to the replica back in rotation.

1. Steps/s of the embedded job (SPEC §8, ``atroposd run`` on the built-in defaults, ``steps`` set)
   with ``[health] canary_every = 10`` against ``canary_every = 0`` (off), the two interleaved
   ``--repeats`` times in alternating order. Steps/s is taken over the steps after the first
   ``--skip`` (start-up excluded): (rows - 1) / (time of the last row - time of the first).
2. Heal time: a real ``atroposd inference`` server on ``builtin:tiny`` with reload sync; its
   weights are corrupted through the weight-control socket (noise loaded as the same
   weight_version), then one sentinel round runs: canary → drift over the limit → quarantine →
   resync → canary → back in rotation. Timed from the start of the round to the release, and
   the healthy round alone for comparison. (In a job the round starts at the next checked sync:
   add up to ``canary_every`` steps.)
3. In a job (two replicas, push, ``canary_every = 2``, the test hook
   ``ATROPOSD_TEST_CORRUPT_WEIGHTS``): replica 0's weights are corrupted once, after the sync the
   first round checks (the resync heals it), replica 1's after that sync and every later update
   of the same process (the resync does not heal it; its restart does: the restarted process
   gets clean weights). From the daemon log: the seconds from the round's "drift over the
   limit" to "back in rotation" for each, and the restart itself (declared to ready again, its
   reattach included).

Prints a table and one JSON line.

    .venv/bin/python benchmarks/bench_sentinel.py                 # 150 steps, 2 repeats
    .venv/bin/python benchmarks/bench_sentinel.py --steps 60 --repeats 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(root: Path, steps: int, canary_every: int) -> Path:
    lines = [
        "[daemon]",
        f'runtime_dir = "{root / "run"}"',
        f'state_dir = "{root / "state"}"',
        'log_format = "json"',
        "[api]",
        f"port = {_free_port()}",
        "[inference]",
        f"port = {_free_port()}",
        "[trainer]",
        f"steps = {steps}",
        f"checkpoint_every = {steps}",
        "[health]",
        f"canary_every = {canary_every}",
        "[[env]]",
        'name = "arithmetic"',
        'builtin = "arithmetic"',
    ]
    path = root / "atroposd.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_job(steps: int, canary_every: int, skip: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="apd-sent-", dir="/tmp") as tmp:
        root = Path(tmp)
        cfg = _config(root, steps, canary_every)
        proc = subprocess.run(
            [sys.executable, "-m", "atroposd", "run", "-c", str(cfg)], cwd=REPO, capture_output=True, timeout=3600
        )
        if proc.returncode != 0:
            raise SystemExit(f"run exited {proc.returncode}: {proc.stderr[-2000:]!r}")
        rows = [json.loads(x) for x in (root / "state" / "metrics.jsonl").read_text().splitlines() if x.strip()]
        log = (root / "state" / "logs" / "daemon.log").read_text().splitlines()
        rounds = [json.loads(x)["seconds"] for x in log if x.startswith("{") and '"canary check"' in x]
    part = rows[skip:]
    sps = (len(part) - 1) / (part[-1]["time"] - part[0]["time"])
    return {
        "canary_every": canary_every,
        "steps": len(rows),
        "steps_per_s": round(sps, 3),
        "canary_rounds": len(rounds),
        "round_s_mean": round(sum(rounds) / len(rounds), 4) if rounds else None,
    }


async def heal_time() -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from atroposd.models.tiny import ensure_builtin_model
    from atroposd.trainer.sentinel import Sentinel, builtin_prompts
    from atroposd.weights.client import WeightControlClient
    from atroposd.weights.reload import write_sync_dir
    from atroposd.weights.sync import ReloadSync
    from tests.inference.conftest import start_server
    from tests.support import stop_process

    root = Path(tempfile.mkdtemp(prefix="apd-sent-", dir="/tmp"))
    server = None
    try:
        tiny = ensure_builtin_model(root / "tiny", seed=0, max_model_len=256)
        server = start_server(root, tiny)
        model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
        sync = ReloadSync(sync_dir=root / "state" / "sync", control_socket=server.socket)
        await sync.attach(model, 1)

        async def run(fn: Any, *args: Any) -> Any:
            return await asyncio.to_thread(fn, *args)

        sentinel = Sentinel(
            every=1,
            limit=0.05,
            prompts=builtin_prompts(8, model.config.vocab_size),
            sockets=lambda: [server.socket],
            run=run,
        )
        t0 = time.perf_counter()
        await sentinel.check_all(sync, model, 1)
        healthy = time.perf_counter() - t0
        bad = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
        with torch.no_grad():
            for p in bad.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        path = await asyncio.to_thread(write_sync_dir, bad, root / "state" / "sync", 999)
        client = WeightControlClient(server.socket)
        await client.pause()
        await client.load(path, 999)
        await client.resume(1)
        await client.close()
        t0 = time.perf_counter()
        await sentinel.check_all(sync, model, 1)
        healed = time.perf_counter() - t0
        back = 0 not in sentinel.quarantined
        sync.close()
        return {
            "healthy_round_s": round(healthy, 3),
            "corrupt_to_rotation_s": round(healed, 3),
            "resyncs": sentinel.resyncs,
            "back_in_rotation": back,
            "drift_after": sentinel.replica_drift()[0],
        }
    finally:
        if server is not None:
            stop_process(server.proc)
        shutil.rmtree(root, ignore_errors=True)


def job_heal(steps: int = 8) -> dict[str, Any]:
    """Part 3: a job whose replica 0 is healed by a resync and replica 1 by a restart."""
    from datetime import datetime

    with tempfile.TemporaryDirectory(prefix="apd-sent-", dir="/tmp") as tmp:
        root = Path(tmp)
        port = _free_port()
        lines = [
            "[daemon]",
            f'runtime_dir = "{root / "run"}"',
            f'state_dir = "{root / "state"}"',
            'log_format = "json"',
            "[api]",
            f"port = {_free_port()}",
            "[inference]",
            f"port = {port}",
            "replicas = 2",
            "[trainer]",
            f"steps = {steps}",
            f"checkpoint_every = {steps}",
            'weight_sync = "push"',
            "[health]",
            "canary_every = 2",
            "[[env]]",
            'name = "arithmetic"',
            'builtin = "arithmetic"',
        ]
        cfg = root / "atroposd.toml"
        cfg.write_text("\n".join(lines) + "\n")
        env = {**os.environ, "ATROPOSD_TEST_CORRUPT_WEIGHTS": "inference-0:3,inference-1:2+"}
        proc = subprocess.run(
            [sys.executable, "-m", "atroposd", "run", "-c", str(cfg)],
            cwd=REPO,
            capture_output=True,
            timeout=3600,
            env=env,
        )
        if proc.returncode != 0:
            raise SystemExit(f"run exited {proc.returncode}: {proc.stderr[-2000:]!r}")
        events = [
            json.loads(x)
            for x in (root / "state" / "logs" / "daemon.log").read_text().splitlines()
            if x.startswith("{")
        ]

    def at(event: str, **match: Any) -> float | None:
        for e in events:
            if str(e.get("event", "")).startswith(event) and all(e.get(k) == v for k, v in match.items()):
                return datetime.fromisoformat(e["timestamp"]).timestamp()
        return None

    def span(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(b - a, 3)

    out: dict[str, Any] = {}
    for replica, path in ((0, "resync"), (1, "restart")):
        over = at("replica drift over the limit", replica=replica)
        out[f"job_{path}_to_rotation_s"] = span(over, at("replica back in rotation", replica=replica))
    out["job_restart_s"] = span(
        at("replica still drifts after a resync", replica=1), at("replica restarted", replica=1)
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--skip", type=int, default=10, help="first steps left out of steps/s")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    os.environ.pop("ATROPOSD_CONFIG", None)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    runs = []
    for i in range(args.repeats):
        for every in (10, 0) if i % 2 == 0 else (0, 10):
            res = run_job(args.steps, every, args.skip)
            runs.append(res)
            print(json.dumps(res), flush=True)
    heal = asyncio.run(heal_time())
    print(json.dumps(heal), flush=True)
    heal.update(job_heal())
    print(json.dumps(heal), flush=True)

    def mean(every: int) -> float:
        xs = [r["steps_per_s"] for r in runs if r["canary_every"] == every]
        return sum(xs) / len(xs)

    on, off = mean(10), mean(0)
    slower = (off - on) / off * 100
    print("\n| canary_every | steps/s (mean) | per run | canary rounds | s per round |")
    print("|---|---|---|---|---|")
    for every, m in ((0, off), (10, on)):
        rs = [r for r in runs if r["canary_every"] == every]
        print(
            f"| {every} | {m:.3f} | {', '.join(str(r['steps_per_s']) for r in rs)} | "
            f"{', '.join(str(r['canary_rounds']) for r in rs)} | "
            f"{', '.join(str(r['round_s_mean']) for r in rs)} |"
        )
    print(
        f"\ncanary_every = 10 is {slower:.1f}% slower than off (goal < 5%); corruption → back in rotation: "
        f"{heal['corrupt_to_rotation_s']} s (a healthy round: {heal['healthy_round_s']} s); in a job: "
        f"{heal['job_resync_to_rotation_s']} s by a resync, {heal['job_restart_to_rotation_s']} s by a restart "
        f"(the restart itself {heal['job_restart_s']} s)"
    )
    print(
        json.dumps(
            {
                "bench": "sentinel",
                "steps_per_s_off": round(off, 3),
                "steps_per_s_canary10": round(on, 3),
                "slower_pct": round(slower, 2),
                **heal,
                "runs": runs,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Trainer ranks (SPEC §12.1): one rank against two FSDP2 ranks over gloo, side by side in one run.

Every configuration runs in a fresh rank-0 process of its own (this script, ``rank-zero``), laid
out as the daemon lays it out: rank 0 hosts the group's store (``trainer.group.GroupStore``),
starts real ``atroposd trainer-rank`` children for ranks 1..N-1, joins, then loads, shards and
trains through ``trainer.setup`` / the learner on its one compute thread (``ComputeThread``).
The same seeded batches go to 1 and 2 ranks (the losses are printed side by side: they must
agree). Measured, per model (builtin:tiny and a ~100M-parameter Llama built locally, 32k
vocabulary, hidden 768, 12 layers, tied embeddings; float32; AdamW; ``kl_coef = 0``, so no
frozen reference):

1. memory per rank: each rank process's RSS (now and its peak, ``VmHWM``) and its parameter,
   gradient and optimizer-state shard bytes (local numel × element size, taken after a step's
   backward, before the optimizer step, so every one of them is held). Rank 0's bytes are read
   from its tensors; rank r's from the same DTensors' placements (torch.chunk of the sharded
   dimension), cross-checked against rank 0's own. Goal: 2-rank bytes per rank ≤ 0.55 × 1-rank.
2. weight sync of the ~100M model into a real ``atroposd inference`` replica (torch engine,
   ``--await-weights``): 1 rank = ``PushSync`` (the trainer trains in the exported buffers; a
   sync is the replica's copy), 2 ranks = ``BucketPushSync`` fed by ``trainer.ranks.ShardedSource``
   (every bucket gathered by both ranks through rank 0's compute thread, staged, copied). Each
   sync is timed right after a memory-copy floor of the model's bytes (interleaved, as
   ``bench_weights`` does); rank 0's peak extra memory is its peak RSS rise over the sync
   (``VmHWM`` reset before it): the first sync creates the staging segment, later ones reuse it.
3. step time (compute + optimizer step), 1 against 2 ranks, both models, the same batches.

4. checkpoints of the ~100M model with 2 ranks (``--checkpoints``: this part alone): (a) rank 0's
   extra memory while it checkpoints (its peak RSS over the checkpoint minus its RSS before,
   ``VmHWM`` reset first): the sharded checkpoint written at once (every rank its own model and
   optimizer shards through DCP, from its live shards), the same written in the background (as
   the loop writes a periodic one; no steps meanwhile here), and the gather path that atroposd
   used before (every tensor gathered into rank 0 — ``Gather``, as ``get_model_state_dict(
   full_state_dict=True, cpu_offload=True)`` did —, written as one ``model.safetensors`` and
   hashed; its optimizer shards, written through DCP then as now, left out: the old path's
   figure is a floor); goal: sharded at most half the gather path. (b) step time while a
   periodic checkpoint is written in the background against without one (goal: at most 1.2×),
   and the steps taken while it was in flight. Every process of this part runs with glibc's
   ``MALLOC_MMAP_THRESHOLD_`` fixed at 1 MiB (unless ``--mmap-threshold`` says otherwise), so that
   what one measurement freed does not hide the next one's growth.

Every rank computes with one torch thread, as the daemon sets it on a CPU. On a machine with
two cores shared with other work, two ranks cannot be faster than the cores they get.

    .venv/bin/python benchmarks/bench_ranks.py [--quick | --checkpoints] [--bucket-mb 64] [--json PATH]

``--quick``: builtin:tiny only (a few seconds of steps, no sync). ``--checkpoints``: part 4 only.
Prints tables and a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_trainer import make_groups  # noqa: E402
from bench_weights import Floor, peak_rss, reset_peak_rss  # noqa: E402

from tests.support import spawn, stop_process, write_config  # noqa: E402

MODELS: dict[str, dict[str, Any]] = {
    # sequences, group size, prompt tokens, completion tokens, micro-batch, timed steps
    "tiny": dict(n=64, group=8, prompt=4, completion=4, micro=32, steps=20, warmup=2),
    "100M": dict(n=8, group=8, prompt=48, completion=16, micro=4, steps=3, warmup=1),
}
SIZE_100M = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    head_dim=64,
)
SYNC_REPS = 4
GOAL = 0.55  # the 2-rank shard bytes per rank against the 1-rank bytes (issue: ≤ 0.55×)
CKPT_MEMORY_GOAL = 0.5  # rank 0's extra memory while checkpointing: sharded / gather path
CKPT_STEP_GOAL = 1.2  # step time with a background checkpoint in flight / without
CKPT_MMAP_THRESHOLD = 1 << 20


# --------------------------------------------------------------------------- the driver


def build_100m(root: Path) -> Path:
    """A ~100M-parameter Llama directory (random init, seeded) with builtin:tiny's tokenizer."""
    return build_llama(root / "model-100M", SIZE_100M)


def build_llama(path: Path, size: dict[str, Any]) -> Path:
    """A Llama directory of ``size`` (random init, seed 0, float32, tied embeddings) with
    builtin:tiny's tokenizer, at ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from atroposd.models.tiny import build_tokenizer

    path.mkdir(parents=True)
    build_tokenizer(512).save_pretrained(str(path))
    cfg = LlamaConfig(
        **size, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).float()
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def job_config(root: Path, model_dir: Path, model: str, world: int, bucket_mb: int) -> Path:
    from tests.support import free_port

    shape = MODELS[model]
    return write_config(
        root / f"{model}-{world}.toml",
        {
            "daemon": {
                "runtime_dir": str(root / f"run-{model}-{world}"),
                "state_dir": str(root / f"state-{model}-{world}"),
            },
            "inference": {"model": str(model_dir), "max_model_len": 512, "port": free_port()},
            "trainer": {
                "device": ["cpu"] * world if world > 1 else "cpu",
                "batch_size": shape["n"],
                "micro_batch_size": shape["micro"],
                "max_token_len": 128,
                "kl_coef": 0.0,
                "weight_sync": "push",
                "sync_bucket_mb": bucket_mb,
                "checkpoint_every": 1000,
                "resume": False,
                "join_timeout": 300.0,
                "collective_timeout": 600.0,
            },
        },
    )


def run_case(
    root: Path,
    config: Path,
    model: str,
    world: int,
    sync: bool,
    mmap_threshold: int | None = None,
    checkpoints: bool = False,
) -> dict[str, Any]:
    out = root / f"{model}-{world}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "rank-zero", str(config), str(out), "--model", model]
    if sync:
        cmd.append("--sync")
    if checkpoints:
        cmd.append("--checkpoints")
    print(
        f"  {model}, {world} rank{'s' if world > 1 else ''}{', sync' if sync else ''}"
        f"{', checkpoints' if checkpoints else ''} ...",
        file=sys.stderr,
        flush=True,
    )
    log = root / f"{model}-{world}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if mmap_threshold is not None:  # every process of the case: rank 0, the ranks, the replica
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    tmp, shm = Path(tempfile.gettempdir()), Path("/dev/shm")
    before = {*tmp.glob("apr-inf-*"), *shm.glob("atroposd-r*")}
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=900)
        except BaseException:
            # interrupted (Ctrl-C, SIGTERM, the timeout): rank 0 may be inside a collective, so its
            # whole tree goes — its ranks and its replica included — then what it left: its
            # replica's directory and its staging segment
            import psutil

            try:
                tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                tree = []
            for p in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            proc.wait(timeout=60)
            for leftover in {*tmp.glob("apr-inf-*"), *shm.glob("atroposd-r*")} - before:
                if leftover.is_dir():
                    shutil.rmtree(leftover, ignore_errors=True)
                else:
                    leftover.unlink(missing_ok=True)
            raise
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"{model} with {world} rank(s) failed (exit {proc.returncode}):\n{log.read_text(errors='replace')[-4000:]}"
        )
    result: dict[str, Any] = orjson.loads(out.read_bytes())
    return result


def mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def report(results: dict[str, dict[int, dict[str, Any]]], machine: dict[str, Any]) -> dict[str, Any]:
    print(
        f"machine: {machine['cores']} cores, load average {machine['load_before']} before, "
        f"{machine['load_after']} after; torch {machine['torch']}, one torch thread per rank"
    )
    summary: dict[str, Any] = {"benchmark": "ranks", "machine": machine, "models": {}}

    print("\n1. memory per rank (after backward, before the optimizer step; MB = 10^6 bytes)")
    print(
        f"{'model':>6} {'ranks':>5} {'rank':>4} {'params MB':>10} {'grads MB':>9} {'optim MB':>9} {'shard MB':>9} "
        f"{'RSS MB':>8} {'anon MB':>8} {'shm MB':>7} {'peak RSS MB':>12}"
    )
    for model, by_world in results.items():
        summary["models"][model] = {
            "parameters": by_world[min(by_world)]["parameters"],
            "bytes": by_world[min(by_world)]["bytes"],
        }
        for world, r in sorted(by_world.items()):
            for rank in r["memory"]:
                print(
                    f"{model:>6} {world:>5} {rank['rank']:>4} {mb(rank['params']):>10} {mb(rank['grads']):>9} "
                    f"{mb(rank['optim']):>9} {mb(rank['shard']):>9} {mb(rank['rss']):>8} {mb(rank['anon']):>8} "
                    f"{mb(rank['shmem']):>7} {mb(rank['peak_rss']):>12}"
                )
        if 2 in by_world and 1 in by_world:
            one = by_world[1]["memory"][0]["shard"]
            two = max(rank["shard"] for rank in by_world[2]["memory"])
            ratio = two / one
            met = ratio <= GOAL
            print(
                f"{model:>6} shard bytes per rank, 2 ranks / 1 rank: {ratio:.3f} "
                f"(goal <= {GOAL}: {'met' if met else 'NOT met'})"
            )
            summary["models"][model].update(
                shard_ratio=round(ratio, 4),
                shard_goal_met=met,
                shard_bytes={w: [m["shard"] for m in r["memory"]] for w, r in by_world.items()},
                rss_bytes={w: [m["rss"] for m in r["memory"]] for w, r in by_world.items()},
            )

    synced = {model: by_world for model, by_world in results.items() if "sync" in by_world.get(1, {})}
    if synced:
        print("\n2. weight sync into one atroposd inference replica (torch engine); ms are medians")
        print(
            f"{'model':>6} {'ranks':>5} {'how':>9} {'buckets':>7} {'floor ms':>9} {'gather ms':>10} "
            f"{'sync ms':>8} {'x floor':>8} {'staging MB':>11} {'1st extra MB':>13} {'extra MB':>9}"
        )
        for model, by_world in synced.items():
            rows = []
            for world, r in sorted(by_world.items()):
                s = r["sync"]
                print(
                    f"{model:>6} {world:>5} {s['how']:>9} {s['buckets']:>7} {s['floor_ms']:>9.1f} "
                    f"{s['gather_ms']:>10.1f} {s['sync_ms']:>8.1f} {s['x_floor']:>8.2f} {mb(s['staging_bytes']):>11} "
                    f"{mb(s['first_extra_bytes']):>13} {mb(s['extra_bytes']):>9}"
                )
                rows.append({"ranks": world, **s})
            summary["models"][model]["sync"] = rows

    ckpt = {
        model: by_world[2]["checkpoints"]
        for model, by_world in results.items()
        if 2 in by_world and "checkpoints" in by_world[2]
    }
    for model, c in ckpt.items():
        print(
            f"\n4. checkpoints, {model}, 2 ranks (model {mb(c['model_bytes'])} MB, rank 0's optimizer shard "
            f"{mb(c['optimizer_shard_bytes'])} MB)"
        )
        print(f"{'path':>34} {'rank 0 extra MB':>16} {'seconds':>8} {'x gather':>9}")
        old_extra = c["gather"]["extra_bytes"]
        for key, label in (
            ("gather", "gather into rank 0 (before)"),
            ("sharded", "sharded, written at once"),
            ("background", "sharded, in the background"),
        ):
            r = c[key]
            print(f"{label:>34} {mb(r['extra_bytes']):>16} {r['seconds']:>8.2f} {r['extra_bytes'] / old_extra:>9.3f}")
        ratio = c["sharded"]["extra_bytes"] / old_extra
        bg_ratio = c["background"]["extra_bytes"] / old_extra
        print(
            f"rank 0's extra memory, sharded / gather: {ratio:.3f} (goal <= {CKPT_MEMORY_GOAL}: "
            f"{'met' if ratio <= CKPT_MEMORY_GOAL else 'NOT met'}); in the background: {bg_ratio:.3f}"
        )
        s_ratio = c["step_ms_writing"] / c["step_ms_idle"]
        print(
            f"step time: {c['step_ms_idle']:.1f} ms without a checkpoint, {c['step_ms_writing']:.1f} ms while one "
            f"is written in the background ({c['steps_in_flight']} steps in flight, the write took "
            f"{c['background']['seconds']:.1f} s): {s_ratio:.3f}x (goal <= {CKPT_STEP_GOAL}: "
            f"{'met' if s_ratio <= CKPT_STEP_GOAL else 'NOT met'}); the copy before it: {c['stage_s'] * 1000:.0f} ms"
        )
        summary["models"].setdefault(model, {})["checkpoints"] = {
            **c,
            "memory_ratio": round(ratio, 4),
            "memory_goal_met": ratio <= CKPT_MEMORY_GOAL,
            "background_memory_ratio": round(bg_ratio, 4),
            "step_ratio": round(s_ratio, 4),
            "step_goal_met": s_ratio <= CKPT_STEP_GOAL,
        }
    if all("step_ms" not in by_world.get(1, {}) for by_world in results.values()):
        return summary

    print("\n3. step time (compute + optimizer step), the same batches; ms are medians")
    print(f"{'model':>6} {'ranks':>5} {'tokens':>7} {'ms/step':>9} {'min ms':>8} {'x 1 rank':>9}  losses")
    for model, by_world in results.items():
        if 1 not in by_world:
            continue
        base = by_world[1]["step_ms"]
        rows = []
        for world, r in sorted(by_world.items()):
            losses = " ".join(f"{x:.6f}" for x in r["losses"][:3])
            print(
                f"{model:>6} {world:>5} {r['tokens']:>7} {r['step_ms']:>9.1f} {min(r['step_times_ms']):>8.1f} "
                f"{r['step_ms'] / base:>9.2f}  {losses}"
            )
            rows.append(
                {
                    "ranks": world,
                    "ms_per_step": round(r["step_ms"], 2),
                    "x_one_rank": round(r["step_ms"] / base, 3),
                    "losses": r["losses"],
                }
            )
        if 2 in by_world:
            diff = max(abs(a - b) for a, b in zip(by_world[1]["losses"], by_world[2]["losses"], strict=True))
            print(f"{model:>6} largest loss difference, 1 vs 2 ranks: {diff:.2e}")
            summary["models"][model]["loss_max_diff"] = diff
        summary["models"][model]["steps"] = rows
    return summary


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="builtin:tiny only (steps, memory; no sync)")
    ap.add_argument(
        "--bucket-mb",
        type=int,
        default=64,
        help="[trainer] sync_bucket_mb of the 2-rank push (default 64 here, so that the ~100M model "
        "takes several buckets; the config's default is 512)",
    )
    ap.add_argument("--only", choices=tuple(MODELS), help="one model only")
    ap.add_argument(
        "--mmap-threshold",
        type=int,
        metavar="BYTES",
        help="run every process with glibc's MALLOC_MMAP_THRESHOLD_=BYTES (a fixed threshold: freed "
        "buffers above it go back to the system instead of staying in the heap)",
    )
    ap.add_argument(
        "--checkpoints",
        action="store_true",
        help="part 4 only: checkpoints of the ~100M model with 2 ranks (memory, step time)",
    )
    ap.add_argument("--json", type=Path, help="also write the JSON summary to this file")
    args = ap.parse_args()
    from atroposd.models.tiny import ensure_builtin_model

    machine = {
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "load_before": load_average(),
        "malloc_mmap_threshold": args.mmap_threshold,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "gpu": torch.cuda.is_available(),
    }
    root = Path(tempfile.mkdtemp(prefix="apr-", dir="/tmp"))
    results: dict[str, dict[int, dict[str, Any]]] = {}
    try:
        models: dict[str, Path] = {}
        if args.only == "tiny" or (args.only is None and not args.checkpoints):
            models["tiny"] = ensure_builtin_model(root / "state", 0, 512)
        if not args.quick and args.only in (None, "100M"):
            models["100M"] = build_100m(root)
        for model, model_dir in models.items():
            sync = model == "100M" and not args.checkpoints
            results[model] = {}
            for world in (2,) if args.checkpoints else (1, 2):
                config = job_config(root, model_dir, model, world, args.bucket_mb)
                threshold = args.mmap_threshold
                if args.checkpoints and threshold is None:
                    threshold = machine["malloc_mmap_threshold"] = CKPT_MMAP_THRESHOLD
                results[model][world] = run_case(
                    root, config, model, world, sync, threshold, checkpoints=args.checkpoints
                )
        machine["load_after"] = load_average()
        summary = report(results, machine)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary["cases"] = results
    line = orjson.dumps(summary, option=orjson.OPT_NON_STR_KEYS).decode()
    print(line)
    if args.json is not None:
        args.json.write_text(line + "\n")
    return 0


# --------------------------------------------------------------------------- one configuration (rank 0)


def status_bytes(pid: int | str, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def rss_parts(pid: int | str) -> dict[str, int]:
    """RSS now, its peak, and its anonymous / file / shared-memory parts, in bytes."""
    return {
        "rss": status_bytes(pid, "VmRSS"),
        "peak_rss": status_bytes(pid, "VmHWM"),
        "anon": status_bytes(pid, "RssAnon"),
        "file": status_bytes(pid, "RssFile"),
        "shmem": status_bytes(pid, "RssShmem"),
    }


def local_numel(t: torch.Tensor, rank: int) -> int:
    """Elements of rank ``rank``'s shard of ``t``: a DTensor's placements (torch.chunk of each
    sharded dimension, as FSDP2 cuts it); a plain tensor is held whole by every rank."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t.numel()
    shape = list(t.shape)
    mesh = t.device_mesh.size()
    for p in t.placements:
        if p.is_shard():
            dim = p.dim  # type: ignore[attr-defined]
            chunk = math.ceil(shape[dim] / mesh) if shape[dim] else 0
            shape[dim] = max(0, min(shape[dim], chunk * (rank + 1)) - chunk * rank)
    return math.prod(shape)


def shard_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> dict[str, int]:
    """Rank ``rank``'s bytes of parameters, gradients and optimizer state (every storage once)."""
    from torch.distributed.tensor import DTensor

    def nbytes(t: torch.Tensor) -> int:
        return local_numel(t, rank) * t.element_size()

    params = list(dict.fromkeys(model.parameters()))
    out = {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optim": sum(nbytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
    }
    if rank == 0:  # what rank 0 holds, read from its tensors: the placements must say the same

        def local(t: torch.Tensor) -> int:
            inner = t.to_local() if isinstance(t, DTensor) else t
            return inner.numel() * inner.element_size()

        held = {
            "params": sum(local(p) for p in params),
            "grads": sum(local(p.grad) for p in params if p.grad is not None),
            "optim": sum(local(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
        }
        if held != out:
            raise RuntimeError(f"rank 0 holds {held} but its placements say {out}")
    out["shard"] = out["params"] + out["grads"] + out["optim"]
    return out


async def rank_zero(
    config: Path, out: Path, model_name: str, sync_wanted: bool, checkpoints: bool = False
) -> dict[str, Any]:
    from atroposd.config import load_config
    from atroposd.logs import configure_logging
    from atroposd.trainer.batch import prepare_batch
    from atroposd.trainer.follower import KEY_VAR, SECRET_VAR, STORE_VAR
    from atroposd.trainer.group import Stop
    from atroposd.trainer.ranks import ComputeThread, GroupRanks, OneRank, Ranks, ShardedSource
    from atroposd.trainer.setup import build_learner, load_for_training
    from atroposd.weights.shm import list_segments
    from atroposd.weights.sync import BucketPushSync, PushSync
    from atroposd.weights.tensors import model_tensors
    from tests.inference.conftest import Server, env_with_nonce, start_server

    configure_logging("warning", "console", stream=sys.stderr)
    cfg = load_config(config, discover=False)
    t = cfg.trainer
    world = t.ranks
    shape = MODELS[model_name]
    torch.set_num_threads(1)
    compute = ComputeThread()
    nonce = "r" + secrets.token_hex(6)
    server_root = Path(tempfile.mkdtemp(prefix="apr-inf-", dir="/tmp"))
    followers: list[subprocess.Popen[bytes]] = []
    store: Any = None
    server: Server | None = None
    sync: PushSync | BucketPushSync | None = None
    ranks: Ranks = OneRank()
    result: dict[str, Any] = {"model": model_name, "ranks": world}
    server_task: asyncio.Future[Server] | None = None
    try:
        if sync_wanted:  # the replica loads while the trainer does
            server_task = asyncio.ensure_future(
                asyncio.to_thread(
                    start_server,
                    server_root,
                    Path(cfg.inference.model),
                    extra=["--await-weights"],
                    env=env_with_nonce(nonce),
                )
            )
        if world > 1:
            from atroposd.trainer.group import GroupStore

            store = GroupStore(secret=nonce, world=world)
            prefix = store.next_generation()
            env = {STORE_VAR: store.address, SECRET_VAR: nonce, KEY_VAR: store.key.hex(), "PYTHONPATH": str(REPO)}
            for r in range(1, world):
                followers.append(
                    spawn(
                        [sys.executable, "-m", "atroposd", "trainer-rank", "-c", str(config), "--rank", str(r)],
                        env=env,
                        log=out.with_suffix(f".rank{r}.log"),
                    )
                )
            ranks = await compute.run(
                GroupRanks.join,
                store.store,
                prefix=prefix,
                key=store.key,
                rank=0,
                world=world,
                device=torch.device("cpu"),
                join_timeout=t.join_timeout,
                collective_timeout=t.collective_timeout,
            )
        result["rss_start"] = rss_parts(os.getpid())
        setup = await compute.run(load_for_training, cfg, ranks)
        result["rss_loaded"] = rss_parts(os.getpid())
        model = setup.policy.model
        specs = setup.tensor_specs if world > 1 else model_tensors(model).specs()
        from atroposd.weights.source import spec_nbytes

        model_bytes = sum(spec_nbytes(s) for s in specs.values())
        result["bytes"] = model_bytes
        result["parameters"] = sum(math.prod(s.shape) for s in specs.values())
        learner = None
        if world > 1:  # as the trainer does: every rank builds its optimizer (and settles) before a gather
            learner = await compute.run(build_learner, cfg, setup)
        if server_task is not None:
            server = await server_task
            server_task = None
            weights_dir = server.root / "run" / "weights"
            if world == 1:  # today's push: the trainer trains in the exported buffers (attached first)
                sync = PushSync(nonce=nonce, weights_dir=weights_dir, control_socket=server.socket)
            else:
                source = ShardedSource(model, ranks, compute, setup.tensor_specs, setup.tied)
                sync = BucketPushSync(
                    nonce=nonce,
                    weights_dir=weights_dir,
                    control_socket=server.socket,
                    bucket_bytes=t.sync_bucket_mb << 20,
                    source_for=lambda m: source,
                )
            before = reset_peak_rss()
            await sync.attach(model, 0)
            first_extra = max(0, peak_rss() - before)
        if learner is None:
            learner = await compute.run(build_learner, cfg, setup)
        result["rss_learner"] = rss_parts(os.getpid())
        batches = [
            prepare_batch(
                make_groups(
                    shape["n"], shape["group"], shape["prompt"], shape["completion"], setup.policy.vocab_size, seed
                ),
                micro_batch_size=t.micro_batch_size,
                max_token_len=t.max_token_len,
                adv_std_floor=t.adv_std_floor,
                vocab_size=setup.policy.vocab_size,
            )
            for seed in range(4)
        ]

        def step(i: int) -> float:
            res = learner.compute(batches[i % len(batches)])
            if not res.finite:
                raise RuntimeError(f"step {i}: non-finite loss or gradient norm ({res})")
            learner.apply()
            return res.loss

        times, losses = [], []
        for i in range(-shape["warmup"], shape["steps"]):
            t0 = time.perf_counter()
            loss = await compute.run(step, i)
            if i >= 0:
                times.append(time.perf_counter() - t0)
                losses.append(loss)
        result.update(
            step_times_ms=[x * 1000 for x in times],
            step_ms=statistics.median(times) * 1000,
            losses=losses,
            tokens=batches[0].completion_tokens,
        )

        # 1. memory: one more step, measured after its backward (gradients and optimizer state held)
        def measure() -> list[dict[str, int]]:
            res = learner.compute(batches[0])
            assert res.finite, res
            rows = []
            for rank in range(world):
                row: dict[str, int] = {"rank": rank, **shard_bytes(learner.policy.model, learner.optimizer, rank)}
                row.update(rss_parts(os.getpid() if rank == 0 else followers[rank - 1].pid))
                rows.append(row)
            learner.apply()
            return rows

        result["memory"] = await compute.run(measure)

        # 2. the weight sync, each one right after a copy of the floor
        if sync is not None:
            floor = Floor(model_bytes)
            floors, syncs, gathers, extras = [], [], [], []
            for version in range(1, SYNC_REPS + 2):
                f = floor()
                before = reset_peak_rss()
                t0 = time.perf_counter()
                await sync.after_step(model, version)
                took = time.perf_counter() - t0
                extra = max(0, peak_rss() - before)
                if version == 1:
                    continue  # warm-up
                floors.append(f)
                syncs.append(took)
                extras.append(extra)
                gathers.append(sync.last_sync["gather_s"] if isinstance(sync, BucketPushSync) else 0.0)
            del floor
            med = statistics.median
            result["sync"] = {
                "how": "bucketed" if isinstance(sync, BucketPushSync) else "push",
                "buckets": int(sync.last_sync["buckets"]) if isinstance(sync, BucketPushSync) else 1,
                "floor_ms": med(floors) * 1000,
                "sync_ms": med(syncs) * 1000,
                "gather_ms": med(gathers) * 1000,
                "x_floor": med(syncs) / med(floors),
                "sync_times_ms": [x * 1000 for x in syncs],
                "staging_bytes": int(sync.last_sync["staging_bytes"]) if isinstance(sync, BucketPushSync) else 0,
                "first_extra_bytes": first_extra,
                "extra_bytes": max(extras),
                "bucket_bytes": t.sync_bucket_mb << 20,
            }
            # the replica serves what the trainer holds now (one generation, its weight_version)
            status, body = await asyncio.to_thread(
                server.http,
                "POST",
                "/generate",
                {  # type: ignore[union-attr]
                    "prompt": {"prompt_token_ids": [1, 5, 6, 7]},
                    "max_tokens": 1,
                    "temperature": 1.0,
                },
            )
            if status != 200 or body.get("weight_version") != SYNC_REPS + 1:
                raise RuntimeError(f"the replica answered {status} {body!r} after the syncs")
        if checkpoints:
            result["checkpoints"] = await checkpoint_case(cfg, setup, learner, ranks, compute, batches, shape)
        if world > 1:
            await compute.run(ranks.command, Stop())
        return result
    finally:
        if server_task is not None:  # the trainer failed while the replica started
            try:
                server = await server_task
            except Exception as exc:
                print(f"the inference replica did not start: {exc}", file=sys.stderr)
        if sync is not None:
            sync.close()
        for p in followers:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                stop_process(p)
        if world > 1:
            await compute.run(ranks.close)
        compute.close()
        if store is not None:
            store.close()
        if server is not None:
            stop_process(server.proc)
        shutil.rmtree(server_root, ignore_errors=True)
        left = list_segments(f"atroposd-{nonce}-")
        if left:
            raise RuntimeError(f"segments left behind: {left}")


async def checkpoint_case(
    cfg: Any, setup: Any, learner: Any, ranks: Any, compute: Any, batches: list[Any], shape: dict[str, Any]
) -> dict[str, Any]:
    """Part 4, on rank 0 (every rank takes part): rank 0's extra memory while checkpointing —
    sharded at once, sharded in the background, and the gather path of before —, then the step
    time while a background checkpoint is written against without one."""
    import hashlib

    from safetensors.torch import save_file

    from atroposd.trainer.group import Gather
    from atroposd.trainer.ranks import gather_full

    checkpointer = setup.checkpointer(learner)
    root = checkpointer.root
    model = learner.policy.model
    names = [n for n in model.state_dict() if n not in setup.aliases]
    out: dict[str, Any] = {
        "model_bytes": sum(
            t.numel() * t.element_size() for n, t in model.state_dict().items() if n not in setup.aliases
        ),
        "optimizer_shard_bytes": sum(
            v.to_local().numel() * v.element_size()
            for s in learner.optimizer.state.values()
            for v in s.values()
            if hasattr(v, "to_local")
        ),
    }

    def measured(fn: Any) -> dict[str, Any]:
        import gc

        gc.collect()
        time.sleep(1.0)  # a background writer's thread has let go of what it held
        before = reset_peak_rss()
        t0 = time.perf_counter()
        fn()
        return {"seconds": time.perf_counter() - t0, "extra_bytes": max(0, peak_rss() - before)}

    def sharded() -> None:
        checkpointer.save(1, 1, 0)

    def background() -> None:
        checkpointer.start(2, 2, 0, background=True).result()

    def gather() -> None:  # what every checkpoint did before: the whole model into rank 0
        ranks.command(Gather(tuple(names)))
        full = gather_full(model, names)
        path = root / "gathered.safetensors"
        save_file({k: v.contiguous() for k, v in full.items()}, str(path), metadata={"format": "pt"})
        del full
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
        path.unlink()

    # the gather path first: what it frees must not make room for the sharded ones' growth
    out["gather"] = await compute.run(measured, gather)
    out["sharded"] = await compute.run(measured, sharded)
    out["background"] = await compute.run(measured, background)

    def step(i: int) -> float:
        t0 = time.perf_counter()
        res = learner.compute(batches[i % len(batches)])
        assert res.finite, res
        learner.apply()
        return time.perf_counter() - t0

    idle = [await compute.run(step, i) for i in range(2)]  # before, and 2 after (the load varies)
    t0 = time.perf_counter()
    future = await compute.run(checkpointer.start, 3, 3, 0, background=True)
    out["stage_s"] = time.perf_counter() - t0  # the copy between two steps (the part training waits for)
    writing: list[float] = []
    i = 0
    while not future.done() or not writing:
        took = await compute.run(step, i)
        i += 1
        if not future.done():
            writing.append(took)
        elif not writing:  # finished within the first step: that step overlapped it all the same
            writing.append(took)
    future.result()
    await compute.run(checkpointer.wait_previous)
    idle += [await compute.run(step, i + j) for j in range(2)]
    out.update(
        step_ms_idle=statistics.median(idle) * 1000,
        step_ms_writing=statistics.median(writing) * 1000,
        steps_in_flight=len(writing),
        step_times_idle_ms=[x * 1000 for x in idle],
        step_times_writing_ms=[x * 1000 for x in writing],
    )
    return out


def rank_zero_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench_ranks.py rank-zero")
    ap.add_argument("config", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", choices=tuple(MODELS), required=True)
    ap.add_argument("--sync", action="store_true")
    ap.add_argument("--checkpoints", action="store_true")
    args = ap.parse_args(argv)
    result = asyncio.run(rank_zero(args.config, args.out, args.model, args.sync, args.checkpoints))
    args.out.write_bytes(orjson.dumps(result))
    return 0


def _exit_on_term(signum: int, frame: Any) -> None:
    """SIGTERM ends the benchmark through its ``finally`` blocks: no replica or rank is left."""
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "rank-zero":
        sys.exit(rank_zero_main(sys.argv[2:]))
    signal.signal(signal.SIGTERM, _exit_on_term)
    sys.exit(main())

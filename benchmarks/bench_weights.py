"""Weight-sync latency per mode (shared, push, reload) against the memory-copy floor.

For each model size (the tiny model, and a ~100M-parameter Llama) this starts a real
inference-side process (``tests/weights/child_server.py``: the weight-control routes on a
Unix socket, calling ``atroposd.weights.receiver`` exactly as the torch engine does), attaches
a trainer-side model in this process and times, in the same run:

* ``floor``   — ``dst.copy_(src)`` of the model's bytes (both buffers allocated and touched):
  the cost of moving the weights once through memory on this machine, timed right before
  each sync (interleaved), so that the machine's swings in memory bandwidth hit both alike;
  each mode's ratio is against the floor timed between its own syncs;
* ``shared``  — the sync cost in shared mode: ``/pause`` + ``/resume`` around an (empty)
  optimizer step (the server computes on the trainer's memory, so nothing is copied);
* ``push``    — ``after_step``: manifest (with checksums) → ``/pause`` → the server copies the
  exported buffers into its own weights → ``/resume`` (one connection for the three);
* ``reload``  — ``after_step``: safetensors written to ``state_dir/sync`` → ``/pause`` → the
  server loads them → ``/resume``;
* ``bucketed`` — ``BucketPushSync.after_step`` (the push of several trainer ranks, fed here by
  the one-rank source): ``/pause`` → per bucket of ``--bucket-mb``: the bucket written into the
  one staging segment, its manifest, the server copies it → ``/resume``. Two copies of the
  weights (trainer → staging, staging → server) where ``push`` makes one, plus a round trip
  per bucket. ``staging MB`` is the segment's size (rank 0's extra memory); ``peak MB`` is how
  far this process's peak RSS rose above its RSS during the first sync of ``push`` (which moves
  the model into exported buffers) and of ``bucketed`` (kernel ``VmHWM``, reset before each).

* ``broadcast`` — ``BroadcastSync.after_step`` (``weight_sync = "broadcast"``, gloo over
  loopback, the group formed at ``attach``): ``/pause`` → per bucket of ``--bucket-mb``: gathered,
  packed into one flat buffer, broadcast to the server, which copies it into its weights →
  ``/resume``. ``pause ms`` (the replica's pause before the first byte) and ``transfer ms``
  (from the plan's check to the server's last bucket; ``send ms`` of it in the broadcasts) are
  medians of the timed syncs; ``first ms`` is the ``attach`` that formed the group.

Prints a table and one JSON line (``{"benchmark": "weights", ...}``). Targets: shared ≈ the
pause overhead only; push ≤ 1.5× the floor (for the ~100M model).

    python benchmarks/bench_weights.py [--quick]
    .venv-vllm/bin/python benchmarks/bench_weights.py --engine vllm   # the vLLM engine (push, reload)

Measured on the 2-core CPU machine, quiet (load average below 1.3), four runs on 2026-11-24
(medians, ms; each ratio against the floor timed between that mode's own syncs). The tiny
model's figures are round trips on the control socket, not copies; the ~100M model's are the
ones the targets are about:

    model   params       floor   shared   push (x floor)   reload (x floor)
    tiny    331,136      0.1     0.9-1.7  3.4-9.2          6.8-10.2
    100M    109,529,856  28-32   2.3-3.4  38.2-41.4        301-356
                                          (1.23-1.33)      (10.6-12.5)
    tiny, vLLM engine    0.1     -        13.4             16.3             (--engine vllm)

The bucketed push (two runs on 2026-11-25, machine loaded: load average 2.2-3.2; 64 MiB
buckets for the ~100M model, a quarter of the model for the tiny one; ms, x the floor timed
between its own syncs):

    model   buckets  bucketed          push (same run)   staging MB   peak MB: push  bucketed
    tiny    5        11.2-15.2         13.1-13.9         0.3          1.4-1.5        0.4-0.5
    100M    7        127-129           31-116            98.3         340            98.3-98.4
                     (3.2-3.8)         (1.1-1.3)

The staging segment is max(bucket, largest tensor): the ~100M model's embedding (98.3 MB)
is larger than a 64 MiB bucket. The first sync's peak RSS rise is the staging segment and
nothing else (the one-rank source copies nothing), where ``push``'s first sync moves the model
into exported buffers. A bucketed sync copies the weights twice (into the staging segment,
then out of it on the server) and pays a manifest and a round trip per bucket; ``push`` copies
once because the trainer trains inside the exported buffers, which FSDP2 shards cannot do.

Broadcast (two runs on 2026-11-27, machine heavily loaded: load average 14-16, then 8-12, on
the 2 cores, so every figure is several times its quiet value — the floor of the ~100M model
was 159-349 ms instead of about 30; ms, × the floor timed between its own syncs; 64 MiB
buckets; run 1 / run 2):

    model   buckets  floor        push (x floor)            broadcast (x floor)         pause      transfer (send)           first
    tiny    5        0.17 / 0.23  66.2 / 56.6               40.6 / 13.2                 5.7 / 1.4  30.7 / 10.6 (12.6 / 4.0)  176 / 110
    100M    7        349 / 159    302 / 310 (1.23 / 1.49)   3785 / 1885 (10.8 / 11.9)   21 / 8.5   3749 / 1857 (2951 / 1510) 5292 / 2794

On one CPU machine a broadcast sends the bytes through gloo's loopback TCP (150-290 MB/s
here, loaded) where ``push`` shares memory and copies once: it is not the CPU's mode, it is
the GPU-to-GPU one (NCCL), which has not run here.

Push = the copy (one memcpy per segment into the server's mirror of the export) plus about
8-10 ms of fixed cost: the manifest with checksums (about 2 ms) and its atomic write, the
pause / update / resume round trips on one connection, the server's manifest checks and
checksum verification. Timed in separate blocks instead, the floor and the copy swing by
±30 % with the machine's memory bandwidth, which is why they are interleaved.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import orjson
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from atroposd.weights.shm import list_segments  # noqa: E402
from atroposd.weights.sync import (  # noqa: E402
    BroadcastSync,
    BucketPushSync,
    PushSync,
    ReloadSync,
    SharedSync,
)

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=22,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
    ),
    "100M": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        head_dim=64,
    ),
}


def build(size: str, root: Path) -> tuple[torch.nn.Module, Path]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **SIZES[size],
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model_dir = root / f"model-{size}"
    cfg.save_pretrained(model_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.eval()
    return model, model_dir


def vllm_config(root: Path, model_dir: Path) -> Path:
    port = _free_port()
    text = (
        f"[daemon]\nruntime_dir = {str(root / 'run')!r}\nstate_dir = {str(root / 'state')!r}\n"
        f'[inference]\nengine = "vllm"\nmodel = {str(model_dir)!r}\nport = {port}\nmax_model_len = 256\n'
        'device = "cpu"\n[trainer]\nmax_token_len = 128\n'
    )
    (root / "vllm.toml").write_text(text)
    return root / "vllm.toml"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Floor:
    """The memory-copy floor: ``dst.copy_(src)`` of the model's bytes, both buffers touched.

    It is timed right before every sync of every mode (interleaved, not in a block of its
    own), so that a shared machine's swings in memory bandwidth hit the floor and the sync
    alike and their ratio stays meaningful. A small copy split across threads waits for a
    busy core on a loaded machine, so the faster of torch's threads and one thread is used.
    """

    def __init__(self, nbytes: int) -> None:
        self.src = torch.empty(nbytes, dtype=torch.uint8).random_()
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # touch every page of both
        self.threads = torch.get_num_threads()
        self.single = False
        if self.threads > 1:
            many = [self._copy() for _ in range(5)]
            torch.set_num_threads(1)
            one = [self._copy() for _ in range(5)]
            torch.set_num_threads(self.threads)
            self.single = statistics.median(one) < statistics.median(many)

    def _copy(self) -> float:
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - t0

    def __call__(self) -> float:
        if not self.single:
            return self._copy()
        torch.set_num_threads(1)
        try:
            return self._copy()
        finally:
            torch.set_num_threads(self.threads)


class Child:
    def __init__(self, root: Path, model_dir: Path, nonce: str, engine: str = "stand-in") -> None:
        self.socket = root / "inf.sock"
        self.weights = root / "run" / "weights"
        self.sync = root / "state" / "sync"
        for d in (self.weights, self.sync):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.log = open(root / "child.log", "ab")
        # The server copies with every core, as an inference server does while the trainer waits.
        env = {
            **os.environ,
            "ATROPOSD_INSTANCE": nonce,
            "PYTHONPATH": str(REPO),
            "CHILD_SERVER_THREADS": str(torch.get_num_threads()),
        }
        if engine == "vllm":
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GB of KV cache: plenty for the tiny model
            cmd = [
                sys.executable,
                "-m",
                "atroposd",
                "inference",
                "-c",
                str(vllm_config(root, model_dir)),
                "--control-socket",
                str(self.socket),
            ]
        else:
            cmd = [
                sys.executable,
                str(REPO / "tests/weights/child_server.py"),
                str(model_dir),
                str(self.socket),
                str(self.weights),
                str(self.sync),
            ]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 900
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {(root / 'child.log').read_text()[-2000:]}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        if not self.socket.exists():
            return False
        from atroposd.weights.client import WeightControlClient, WeightControlError

        async def info() -> bool:
            client = WeightControlClient(self.socket, timeout=10)
            try:
                await client.request("GET", "/weight_info")
                return True
            except (WeightControlError, TimeoutError):
                return False  # the vLLM front answers 503 while the engine loads
            finally:
                await client.close()

        return anyio.run(info)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


async def timed(
    fn: Callable[[], Awaitable[Any]], reps: int, floor: Floor, warmup: int = 2
) -> tuple[list[float], list[float]]:
    """(sync times, floor times), each sync right after a floor copy."""
    for _ in range(warmup):
        await fn()
    out: list[float] = []
    floors: list[float] = []
    for _ in range(reps):
        floors.append(floor())
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return out, floors


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark of this process (``VmHWM``); return the RSS now, in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmRSS") * 1024


def peak_rss() -> int:
    return _status_kb("VmHWM") * 1024


async def run_mode(
    mode: str,
    model: torch.nn.Module,
    child: Child,
    nonce: str,
    reps: int,
    floor: Floor,
    bucket_bytes: int,
    extra: dict[str, Any],
) -> tuple[list[float], list[float]]:
    version = [0]
    sync: SharedSync | PushSync | ReloadSync | BucketPushSync | BroadcastSync
    if mode == "broadcast":
        sync = BroadcastSync(nonce=nonce, control_socket=child.socket, bucket_bytes=bucket_bytes, form_timeout=120.0)
    elif mode == "shared":
        sync = SharedSync(nonce=nonce, weights_dir=child.weights, control_socket=child.socket)
    elif mode == "push":
        sync = PushSync(nonce=nonce, weights_dir=child.weights, control_socket=child.socket)
    elif mode == "bucketed":
        sync = BucketPushSync(
            nonce=nonce, weights_dir=child.weights, control_socket=child.socket, bucket_bytes=bucket_bytes
        )
    else:
        sync = ReloadSync(sync_dir=child.sync, control_socket=child.socket)
    try:
        before = reset_peak_rss()
        await sync.attach(model, 0)
        extra[f"{mode}_peak_extra_bytes"] = max(0, peak_rss() - before)

        if isinstance(sync, BroadcastSync):
            extra["broadcast_first_ms"] = sync.last_sync["seconds"] * 1000  # the group formed in it
        splits: list[dict[str, float]] = []

        async def one() -> None:
            version[0] += 1
            if mode == "shared":
                async with sync.paused(version[0]):
                    pass
            else:
                await sync.after_step(model, version[0])
            if isinstance(sync, BroadcastSync):
                splits.append(dict(sync.last_sync))

        out = await timed(one, reps, floor)
        if isinstance(sync, BroadcastSync):
            # the last ``reps`` syncs (after the warm-up): the replicas' pause and the transfer apart
            for key in ("pause_s", "transfer_s", "gather_s", "pack_s", "send_s"):
                extra[f"broadcast_{key[:-2]}_ms"] = ms([x[key] for x in splits[-reps:]])
            extra["broadcast_buckets"] = sync.last_sync["buckets"]
        if isinstance(sync, BucketPushSync):
            extra["staging_bytes"] = sync.last_sync["staging_bytes"]
            extra["buckets"] = sync.last_sync["buckets"]
        return out
    finally:
        sync.close()


def ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model only, fewer repetitions")
    ap.add_argument(
        "--engine",
        choices=("stand-in", "vllm"),
        default="stand-in",
        help="the server: the receiver as the torch engine calls it, or atroposd inference --engine "
        "vllm (tiny model only, push and reload; run with the vllm-cpu environment)",
    )
    ap.add_argument(
        "--bucket-mb",
        type=float,
        default=64.0,
        help="bucket size of the bucketed push ([trainer] sync_bucket_mb; default 64 here, so that the "
        "~100M model takes several buckets)",
    )
    args = ap.parse_args()
    bucket_bytes = int(args.bucket_mb * (1 << 20))
    if args.engine == "vllm":
        args.quick = True
    from atroposd.logs import configure_logging

    configure_logging("warning", "console", stream=sys.stderr)
    sizes = ["tiny"] if args.quick else ["tiny", "100M"]
    rows: list[dict[str, Any]] = []
    for size in sizes:
        root = Path(tempfile.mkdtemp(prefix="apb-", dir="/tmp"))
        nonce = "b" + secrets.token_hex(6)
        child: Child | None = None
        try:
            if args.engine == "vllm":
                from transformers import AutoModelForCausalLM

                from tests.vllm.conftest import build_model_dir

                model_dir = build_model_dir(root / "model-vllm")
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
                model.eval()
            else:
                model, model_dir = build(size, root)
            nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
            params = sum(p.numel() for p in model.parameters())
            reps = {"tiny": 10 if args.quick else 50, "100M": 10}[size]
            child = Child(root, model_dir, nonce, args.engine)
            floor = Floor(nbytes)
            floors: list[float] = []
            result = {
                "model": size,
                "params": params,
                "bytes": nbytes,
                "engine": args.engine,
                "shared_ms": float("nan"),
                "shared_x_floor": float("nan"),
            }
            modes = (
                ("shared", "push", "bucketed", "broadcast", "reload") if args.engine != "vllm" else ("push", "reload")
            )
            for mode in modes:
                r = reps if mode != "reload" or size == "tiny" else 5
                # tiny: a quarter of the model per bucket (several buckets, as with the ~100M model)
                b = bucket_bytes if size != "tiny" else nbytes // 4
                times, mode_floor = anyio.run(run_mode, mode, model, child, nonce, r, floor, b, result)
                floors += mode_floor
                result[f"{mode}_ms"] = ms(times)
                result[f"{mode}_floor_ms"] = ms(mode_floor)  # the floor timed between this mode's syncs
                result[f"{mode}_x_floor"] = ms(times) / ms(mode_floor)
            result["floor_ms"] = ms(floors)
            del floor
            rows.append(result)
        finally:
            if child is not None:
                child.stop()
            leftover = list_segments(f"atroposd-{nonce}-")
            shutil.rmtree(root, ignore_errors=True)
            if leftover:
                raise RuntimeError(f"segments left behind: {leftover}")
    print(
        f"{'model':>6} {'params':>11} {'MB':>8} {'floor ms':>9} {'shared ms':>10} {'push ms':>9} "
        f"{'push/floor':>10} {'reload ms':>10} {'reload/floor':>12}"
    )
    for r in rows:
        print(
            f"{r['model']:>6} {r['params']:>11,} {r['bytes'] / 1e6:>8.1f} {r['floor_ms']:>9.2f} "
            f"{r['shared_ms']:>10.2f} {r['push_ms']:>9.2f} {r['push_x_floor']:>10.2f} {r['reload_ms']:>10.2f} "
            f"{r['reload_x_floor']:>12.2f}"
        )
    if args.engine != "vllm":
        print(
            f"\n{'model':>6} {'buckets':>8} {'bucketed ms':>12} {'bkt/floor':>10} {'staging MB':>11} "
            f"{'peak MB push':>13} {'peak MB bkt':>12}"
        )
        for r in rows:
            print(
                f"{r['model']:>6} {r['buckets']:>8} {r['bucketed_ms']:>12.2f} {r['bucketed_x_floor']:>10.2f} "
                f"{r['staging_bytes'] / 1e6:>11.1f} {r['push_peak_extra_bytes'] / 1e6:>13.1f} "
                f"{r['bucketed_peak_extra_bytes'] / 1e6:>12.1f}"
            )
        print(
            f"\n{'model':>6} {'buckets':>8} {'floor ms':>9} {'push ms':>8} {'bcast ms':>9} {'bcast/floor':>11} "
            f"{'pause ms':>9} {'transfer ms':>12} {'(send ms)':>10} {'first ms':>9}"
        )
        for r in rows:
            print(
                f"{r['model']:>6} {r['broadcast_buckets']:>8} {r['broadcast_floor_ms']:>9.2f} {r['push_ms']:>8.2f} "
                f"{r['broadcast_ms']:>9.2f} {r['broadcast_x_floor']:>11.2f} {r['broadcast_pause_ms']:>9.2f} "
                f"{r['broadcast_transfer_ms']:>12.2f} {r['broadcast_send_ms']:>10.2f} "
                f"{r['broadcast_first_ms']:>9.1f}"
            )
    print(orjson.dumps({"benchmark": "weights", "median_ms": True, "rows": rows}).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())

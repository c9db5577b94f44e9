"""The phases of ``gpu-check run``, each run in a process of its own by the runner
(``python -m gpucheck.phases NAME CONTEXT_JSON RESULT_FILE DEADLINE``).

Every phase drives the product's own code — the trainer's group join, FSDP2 sharding, optimizers
and sharded checkpoint (:mod:`atroposd.trainer`), the weights' arena, receiver, staging buffer and
broadcast group (:mod:`atroposd.weights`), ``atroposd run`` for the jobs — on the context's
device: ``cuda:0`` with NCCL and CUDA IPC on a GPU machine, the CPU with gloo and POSIX shared
memory in the rehearsal. Only the CUDA calls differ between the two.

A phase writes its figures and checks as it goes (:class:`~gpucheck.common.Record`); an
exception is recorded with its traceback's tail and the process exits 1.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpucheck.common import (
    QWEN_SHAPE,
    QWEN_SMALL,
    ROOT,
    Context,
    Record,
    child_env,
    descendants,
    device_memory,
    shm_files,
    shm_size,
    start,
    stop_tree,
    wait_until,
)

GIB = 1 << 30
MIB = 1 << 20


class PhaseError(RuntimeError):
    """A phase cannot go on (the message says why)."""


def git_commit() -> str | None:
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() or None if res.returncode == 0 else None


def _version(module: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return None


def models(ctx: Context) -> dict[str, str]:
    """The model directories the ``model`` phase made."""
    path = Path(ctx.work) / "models.json"
    if not path.exists():
        raise PhaseError(f"no models in {ctx.work}: the 'model' phase did not run or failed")
    data: dict[str, str] = json.loads(path.read_text())
    return data


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 6) if values else None


# ------------------------------------------------------------------------------- preflight


def _nvidia_smi(query: str, key: str = "--query-gpu") -> list[list[str]] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        res = subprocess.run(
            [exe, f"{key}={query}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    return [[c.strip() for c in line.split(",")] for line in res.stdout.splitlines() if line.strip()]


def _nvml_pids(index: int) -> list[int] | None:
    """The pids NVML reports using the GPU (a container sees host pids there, or none)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            return sorted(int(p.pid) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h))
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        rows = _nvidia_smi("pid", "--query-compute-apps")
        return None if rows is None else sorted(int(r[0]) for r in rows if r and r[0].isdigit())


def preflight(ctx: Context, rec: Record, deadline: float) -> None:
    import torch

    import atroposd

    rec.figures_update(
        {
            "python": platform.python_version(),
            "executable": sys.executable,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": _version("transformers"),
            "torch_optimi": _version("torch-optimi"),
            "triton": _version("triton"),
            "atroposd_file": atroposd.__file__,
            "commit": git_commit(),
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE"),
            "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "dev_shm": shm_size(),
            "c_compiler": next((shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c)), None),
            "python_headers": (Path(sysconfig.get_paths()["include"]) / "Python.h").exists(),
        }
    )
    rec.check("the checkout's atroposd is imported", Path(atroposd.__file__).resolve().is_relative_to(ROOT))
    rec.check("HF_HUB_OFFLINE=1", os.environ.get("HF_HUB_OFFLINE") == "1")
    if ctx.rehearse:
        rec.figures_update({"gpu": None, "nccl": None, "driver": None})
        rec.check("the rehearsal sees no GPU", not torch.cuda.is_available())
        return
    if not rec.check("CUDA is available", torch.cuda.is_available()):
        return
    props = torch.cuda.get_device_properties(0)
    import torch.distributed as dist

    nccl = torch.cuda.nccl.version() if dist.is_nccl_available() else None
    rec.figures_update(
        {
            "gpu": props.name,
            "gpu_count": torch.cuda.device_count(),
            "gpu_memory_bytes": int(props.total_memory),
            "capability": f"{props.major}.{props.minor}",
            "gpu_uuid": str(props.uuid),
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
            "bf16": torch.cuda.is_bf16_supported(),
        }
    )
    rows = _nvidia_smi("driver_version,compute_mode,mig.mode.current")
    if rows:
        driver, mode, mig = (rows[0] + [None, None, None])[:3]
        rec.figures_update({"driver": driver, "compute_mode": mode, "mig": mig})
    else:
        rec.figures_update({"driver": None, "compute_mode": None, "mig": None, "nvidia_smi": "absent"})
    torch.zeros(1, device="cuda:0")  # this process's context, then: does NVML name this pid?
    pids = _nvml_pids(0)
    rec.figure("nvml_pids", pids)
    rec.figure("nvml_sees_own_pid", None if pids is None else os.getpid() in pids)
    rec.figure("device_memory", device_memory(ctx.device))


# --------------------------------------------------------------------------------- install


def install(ctx: Context, rec: Record, deadline: float) -> None:
    """The wheels that ``prepare`` carried, into a venv that sees the system's packages (torch,
    transformers); the phases after this one run on its interpreter and import the checkout."""
    prepared = Path(ctx.prepared)
    python = sys.executable
    if ctx.rehearse:
        rec.figure("wheels", "not used: the rehearsal runs on this environment")
    else:
        wheels = prepared / "wheels"
        reqs = prepared / "requirements.txt"
        if not wheels.is_dir() or not reqs.exists():
            raise PhaseError(
                f"no wheels in {prepared}: run `scripts/gpu-check prepare` on a machine with network and carry "
                "the folder along"
            )
        venv = Path(ctx.work) / "venv"
        site_dir: Path | None = None
        if not (venv / "bin" / "python").exists():
            made = subprocess.run(
                [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if made.returncode != 0:  # no venv module (a bare Debian Python): a directory on PYTHONPATH instead
                rec.figure("venv", f"not made: {made.stderr.strip()[-300:]}")
                shutil.rmtree(venv, ignore_errors=True)
                site_dir = Path(ctx.work) / "site"
        if site_dir is None:
            python = str(venv / "bin" / "python")
            _see_this_environment(python)
            target: list[str] = []
        else:
            target = ["--target", str(site_dir)]
            os.environ["GPU_CHECK_SITE"] = str(site_dir)
            rec.figure("site", str(site_dir))
        # the system's pip, run by the venv's interpreter, installs into the venv (--isolated: no
        # configuration of the machine's in the way); each pin's wheel for this Python (prepare
        # carried CPython 3.10-3.13)
        pip = [python, "-m", "pip", "--isolated"]
        argv = [*pip, "install", "--no-index", "--no-deps", "--find-links", str(wheels), *target, "-r", str(reqs)]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=max(10.0, deadline - time.time() - 15))
        print(res.stdout[-4000:], res.stderr[-4000:], flush=True)
        if res.returncode != 0:
            raise PhaseError(f"pip install from the carried wheels failed: {res.stderr.strip()[-800:]}")
        rec.figure("requirements", len(reqs.read_text().splitlines()))
        check = subprocess.run([*pip, "check"], capture_output=True, text=True, timeout=120, env=child_env(ctx))
        rec.figure("pip_check", {"exit": check.returncode, "tail": (check.stdout + check.stderr)[-1500:]})
    # on the GPU machine what the phases import, from the venv; in the rehearsal only where
    # atroposd comes from (this environment is the tests' own)
    imports = "" if ctx.rehearse else "torch, transformers, aiohttp, orjson, structlog, psutil, optimi, pytest, "
    probe = (
        f"import {imports}json, sys, atroposd;"
        "print(json.dumps({'atroposd_file': atroposd.__file__, 'python': sys.version.split()[0]}))"
    )
    res = subprocess.run([python, "-c", probe], env=child_env(ctx), capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise PhaseError(f"the phases' interpreter cannot import what they need: {res.stderr.strip()[-800:]}")
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    rec.figures_update({"python": python, "python_version": seen["python"], "atroposd_file": seen["atroposd_file"]})
    rec.figure("commit", git_commit())
    rec.check("children import the checkout", Path(seen["atroposd_file"]).resolve().is_relative_to(ROOT))


def _see_this_environment(python: str) -> None:
    """The venv sees this interpreter's packages even when this interpreter is itself a venv
    (``--system-site-packages`` reaches only the base installation's): a ``.pth`` file in the
    venv names this one's site directories, after the venv's own."""
    import site

    res = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    pth = Path(res.stdout.strip()) / "gpu-check-outer.pth"
    pth.write_text("".join(f"{d}\n" for d in dirs if Path(d).is_dir()))


# ----------------------------------------------------------------------------------- model


def _draw(src: Path, dest: Path, config: dict[str, Any], device: str) -> int:
    """A Qwen-shaped model with random weights (bf16, drawn on ``device``), the tokenizer of ``src``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (dest / "model.safetensors").exists():
        return -1
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, dest / f.name)
    base = json.loads((src / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**base, **config}, indent=1))
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(dest)), dtype=torch.bfloat16)
    model.save_pretrained(str(dest))
    return sum(p.numel() for p in model.parameters())


def model(ctx: Context, rec: Record, deadline: float) -> None:
    """The models the phases load: on a GPU the ~0.5B Qwen-shaped model (ipc, bandwidth, the jobs)
    and a 2-layer cut of it (nccl), their weights drawn here; in the rehearsal the built-in tiny
    model for all."""
    work = Path(ctx.work)
    if ctx.rehearse:
        from atroposd.models.tiny import ensure_builtin_model

        tiny = ensure_builtin_model(work / "models", seed=0, max_model_len=64)
        made = {"model": str(tiny), "small": str(tiny)}
    else:
        src = Path(ctx.prepared) / "qwen-0.5b"
        if not (src / "config.json").exists():
            raise PhaseError(f"{src} is missing: run `scripts/gpu-check prepare` and carry the folder along")
        big, small = work / "qwen-0.5b", work / "qwen-small"
        rec.figure("parameters", _draw(src, big, QWEN_SHAPE, ctx.device))
        rec.figure("small_parameters", _draw(src, small, QWEN_SMALL, ctx.device))
        made = {"model": str(big), "small": str(small)}
    (work / "models.json").write_text(json.dumps(made))
    rec.figures_update(
        {k: {"dir": v, "bytes": sum(f.stat().st_size for f in Path(v).glob("*.safetensors"))} for k, v in made.items()}
    )


# ------------------------------------------------------------------------------------ nccl


def nccl(ctx: Context, rec: Record, deadline: float) -> None:
    """One trainer rank as the daemon forms it, with everything several ranks use switched on."""
    from atroposd.config.load import parse_toml
    from atroposd.daemon.specs import trainer_group_env

    # before the first group, what the daemon sets in its own environment (gloo on loopback, NCCL's
    # error handling), for a job of this machine
    work = Path(ctx.work)
    job = job_config(work / "nccl-job", "job_push", model_dir=models(ctx)["small"], rehearse=ctx.rehearse, run_dir=work)
    group_env = trainer_group_env(parse_toml(toml(job)), os.environ)
    os.environ.update(group_env)
    rec.figure("group_env", group_env)

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from atroposd.trainer.fsdp import gather_full
    from atroposd.trainer.group import GroupStore
    from atroposd.trainer.model import ROOT_ATTR, token_scores
    from atroposd.trainer.precision import PrecisionAdamW, compensated_adamw
    from atroposd.trainer.ranks import GroupRanks
    from atroposd.trainer.setup import _run, set_thread_device
    from atroposd.trainer.sharded import (
        MODEL_DIR,
        OPTIMIZER_DIR,
        check_model_shards,
        check_shards,
        load_model_shards,
        model_shapes,
        stage,
        tied_aliases,
        write_shards,
    )
    from atroposd.weights.broadcast import BroadcastGroup

    device = torch.device(ctx.device)
    store = GroupStore(secret=ctx.nonce, world=1, directory=str(work))
    ranks = None
    try:
        t0 = time.perf_counter()
        prefix = store.next_generation()  # the generation's store first, as the daemon makes it
        ranks = GroupRanks.join(
            store.store,
            prefix=prefix,
            key=store.key,
            rank=0,
            world=1,
            device=device,
            join_timeout=60.0,
            collective_timeout=60.0,
        )
        rec.figure("join_s", round(time.perf_counter() - t0, 3))
        rec.check(f"the group's backend is {ctx.backend}", dist.get_backend() == ctx.backend, dist.get_backend())

        model_dir = models(ctx)["small"]
        policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)  # type: ignore[arg-type]
        aliases = tied_aliases(policy)
        ranks.shard(policy, mixed_precision=True)  # FSDP2 with the GPU's policy (bf16 params, fp32 reduce)
        root = policy.__dict__[ROOT_ATTR]
        seen: dict[str, Any] = {}

        def look(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            temp = args[3] if len(args) > 3 else kwargs.get("temperature")
            if isinstance(temp, torch.Tensor):
                seen["dtype"], seen["value"] = str(temp.dtype).removeprefix("torch."), float(temp.flatten()[0])

        root.register_forward_pre_hook(look, with_kwargs=True)  # runs after FSDP2's own (it is prepended)
        params = [p for p in policy.parameters() if p.requires_grad]
        vocab = int(policy.config.vocab_size)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(4, min(vocab, 1000), (2, 24), generator=gen).to(device)
        mask = torch.ones_like(ids, dtype=torch.bool)
        mask[:, :4] = False
        labels = torch.roll(ids, -1, dims=1)
        temperature = torch.full((2,), 0.7, dtype=torch.float32, device=device)

        def step(opt: torch.optim.Optimizer) -> dict[str, Any]:
            scores = token_scores(policy, ids, mask, labels, temperature)
            loss = -scores.logp.float().mean()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, 1.0)  # DTensor gradients: the global norm
            grad_kind = type(params[0].grad).__name__
            full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            return {"loss": float(loss.detach()), "grad_norm": float(full.detach()), "grad_type": grad_kind}

        before = {n: t.clone() for n, t in gather_full(policy, list(stage_names(policy, aliases))).items()}
        master = PrecisionAdamW(params, lr=1e-3)
        t0 = time.perf_counter()
        steps = [step(master) for _ in range(2)]
        rec.figure("float32_master_steps", steps)
        rec.figure("float32_master_s", round(time.perf_counter() - t0, 3))
        rec.check(
            "temperature reaches the root in float32",
            seen.get("dtype") == "float32" and seen.get("value") == float(torch.tensor(0.7)),
            seen,
        )
        rec.check("gradients are DTensors", steps[0]["grad_type"] == "DTensor", steps[0]["grad_type"])
        rec.check("the clipped global norm is finite", all(s["grad_norm"] == s["grad_norm"] for s in steps))
        state = master.state[params[0]]
        rec.check(
            "the optimizer keeps float32 master weights",
            "master" in state and state["master"].dtype == torch.float32,
            {k: str(getattr(v, "dtype", v)) for k, v in state.items()},
        )
        kahan = compensated_adamw(params, lr=1e-3)
        t0 = time.perf_counter()
        steps = [step(kahan) for _ in range(2)]
        rec.figure("kahan_steps", steps)
        rec.figure("kahan_s", round(time.perf_counter() - t0, 3))
        rec.figure("kahan_state", {k: str(getattr(v, "dtype", v)) for k, v in kahan.state[params[0]].items()})
        rec.check("Kahan steps finite", all(s["loss"] == s["loss"] for s in steps))
        after = gather_full(policy, list(before))
        rec.check("the steps moved the weights", any(not torch.equal(before[n], after[n]) for n in before))

        # the background sharded checkpoint: written on a thread of its own while a forward runs
        path = work / "nccl-checkpoint"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        staged = stage(policy, kahan, aliases)
        shapes = model_shapes(staged)
        t0 = time.perf_counter()
        future = _run(
            lambda: write_shards(staged, path, ranks.checkpoint_group),
            True,
            name="gpu-check-checkpoint",
            on_thread=lambda: set_thread_device(device),
        )
        with torch.no_grad():
            token_scores(policy, ids, mask, labels, temperature)
        future.result(timeout=max(5.0, deadline - time.time() - 20))
        rec.figure("checkpoint_s", round(time.perf_counter() - t0, 3))
        check_shards(path / OPTIMIZER_DIR, 1)
        check_model_shards(path / MODEL_DIR, 1, shapes)
        back = load_model_shards(path / MODEL_DIR, shapes)
        live = gather_full(policy, list(back))
        diff = [n for n in live if not torch.equal(live[n].cpu(), back[n].cpu())]
        rec.figure("checkpoint_bytes", sum(f.stat().st_size for f in path.rglob("*") if f.is_file()))
        rec.check("the checkpoint reads back equal", not diff and set(back) == set(live), diff[:5])

        # a broadcast group as the trainer forms one with a replica (here alone), then aborted
        bstore = dist.PrefixStore("gpu-check-broadcast/", store.store)
        group = BroadcastGroup.build(
            bstore,
            rank=0,
            world=1,
            backend=ctx.backend,
            device=device,
            timeout_s=30.0,
            formation="gpu-check",
        )
        buf = torch.arange(16 * MIB // 4, dtype=torch.float32, device=device)
        t0 = time.perf_counter()
        group.broadcast(buf)
        rec.figure("broadcast_s", round(time.perf_counter() - t0, 4))
        rec.check("the broadcast left the buffer intact", bool(buf[-1] == buf.numel() - 1))
        group.close()
        try:
            group.broadcast(buf)
            refused = False
        except RuntimeError:
            refused = True
        rec.check("an aborted group refuses a broadcast", refused)
    finally:
        if ranks is not None:
            ranks.close()
        store.close()


def stage_names(model: Any, aliases: set[str]) -> list[str]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return [k for k in get_model_state_dict(model) if k not in aliases]


# ------------------------------------------------------------------------------------- ipc

SYNCS = 100


def _torch_files(owners: dict[str, int]) -> dict[str, int]:
    """How many /dev/shm/torch_<pid>_* files each of ``owners`` (name: pid) has, and the others."""
    counts = {name: 0 for name in owners}
    counts["others"] = 0
    by_pid = {pid: name for name, pid in owners.items()}
    for name in shm_files("torch_"):
        parts = name.split("_")
        pid = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else -1
        counts[by_pid.get(pid, "others")] += 1
    return counts


def _answers(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status) == 200
    except (OSError, urllib.error.URLError):
        return False


def _torch_dtype(ctx: Context) -> Any:
    import torch

    return torch.float32 if ctx.rehearse else torch.bfloat16


def ipc(ctx: Context, rec: Record, deadline: float) -> None:
    """The push between two real processes: this one is the trainer's side (the product's
    :class:`~atroposd.weights.sync_arena.PushSync` over the model's arena: CUDA IPC on a GPU, POSIX
    shm in the rehearsal), the other a real ``atroposd inference`` server on the same device,
    which copies through its own receiver; 100 syncs, then kill -9 of the server while it holds
    the export mapped, in the middle of a sync."""
    import anyio
    import torch
    from transformers import AutoModelForCausalLM

    from atroposd.config.load import load_config
    from atroposd.paths import Paths
    from atroposd.weights.sync_arena import PushSync

    device = torch.device(ctx.device)
    cuda = device.type == "cuda"
    phase = os.environ.get("GPU_CHECK_PHASE", "ipc")
    root = Path(ctx.work) / phase
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    run_dir = Path("/tmp") / f"{ctx.nonce}-{phase}"
    shutil.rmtree(run_dir, ignore_errors=True)
    model_dir = models(ctx)["model"]
    cfg_path = root / "atroposd.toml"
    cfg_path.write_text(toml(job_config(root, "job_push", model_dir=model_dir, rehearse=ctx.rehearse, run_dir=run_dir)))
    cfg = load_config(cfg_path)
    paths = Paths.of(cfg)
    for d in (run_dir, paths.weights_dir):
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    sock = run_dir / "gpu-check-inference.sock"
    rec.figure("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))

    def reserved() -> int | None:
        return int(torch.cuda.memory_reserved(device)) if cuda else None

    torch_files0 = _torch_files({})
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_torch_dtype(ctx)).to(device)  # type: ignore[arg-type]
    _sync(device)
    if cuda:
        torch.cuda.empty_cache()
    reserved0 = reserved()
    rec.figure("producer_reserved_before_export", reserved0)
    baseline = device_memory(ctx.device)
    rec.figure("device_memory_baseline", baseline)
    env = child_env(ctx, {"ATROPOSD_INSTANCE": ctx.nonce})
    server: subprocess.Popen[Any] | None = None
    server_pid = 0
    sync = PushSync(nonce=ctx.nonce, weights_dir=paths.weights_dir, control_socket=sock)
    small = min(policy.parameters(), key=lambda t: t.numel())
    try:
        argv = [sys.executable, "-m", "atroposd", "inference", "-c", str(cfg_path), "--control-socket", str(sock)]
        t0 = time.monotonic()
        server = start(argv, log=Path(ctx.out) / "logs" / f"{phase}.inference.log", env=env)
        proc = server
        server_pid = proc.pid

        health = f"http://127.0.0.1:{cfg.inference.port}/health"

        def up() -> bool:
            if proc.poll() is not None:
                raise PhaseError(f"the inference server exited {proc.returncode} at its start; see its log")
            return sock.exists() and _answers(health)

        if not wait_until(up, timeout=max(5.0, deadline - time.time() - 40), interval=0.2):
            raise PhaseError(f"the inference server did not answer {health} in time")

        async def attach() -> None:
            while True:
                try:
                    await sync.attach(policy, 0)
                    return
                except Exception:  # not serving yet: again until the phase's deadline
                    if time.time() > deadline - 40 or proc.poll() is not None:
                        raise
                    await anyio.sleep(0.2)

        anyio.run(attach)
        rec.figure("server_ready_s", round(time.monotonic() - t0, 2))
        arena = sync.arena
        assert arena is not None
        rec.figures_update({"transport": arena.transport, "bytes": arena.nbytes, "segments": len(arena.segments)})
        want = "cuda_ipc" if cuda else "shm"
        rec.check(f"the arena's transport is {want}", arena.transport == want, arena.transport)
        rec.figure("device_memory_attached", device_memory(ctx.device))
        rec.figure("producer_reserved_attached", reserved())
        reports: list[dict[str, Any]] = []

        async def syncs() -> None:
            for version in range(1, SYNCS + 1):
                async with sync.paused(version):
                    with torch.no_grad():
                        small.add_(1.0)  # every sync carries new bytes
                t = time.perf_counter()
                report = await sync.after_step(policy, version)
                reports.append({**(report or {}), "wall_s": time.perf_counter() - t})

        t0 = time.monotonic()
        anyio.run(syncs)
        rec.figure("syncs_s", round(time.monotonic() - t0, 2))
        walls = [r["wall_s"] for r in reports[1:]]
        transfer = _median([float(r.get("sync_transfer_s", 0.0)) for r in reports[1:]])
        rec.figures_update(
            {
                "syncs": len(reports),
                "sync_median_s": _median(walls),
                "sync_pause_median_s": _median([float(r.get("sync_pause_s", 0.0)) for r in reports[1:]]),
                "sync_transfer_median_s": transfer,
                "gb_per_s": round(arena.nbytes / transfer / 1e9, 3) if transfer else None,
                "replica_versions": sync.replica_versions(),
                "device_memory_after_syncs": device_memory(ctx.device),
                "producer_reserved_after_syncs": reserved(),
                "torch_shm_files_after_syncs": _torch_files({"producer": os.getpid(), "server": proc.pid}),
            }
        )
        rec.check("the replica holds the last version", sync.replica_versions() == [SYNCS], sync.replica_versions())
        grown = (reserved() or 0) - (rec.figures["producer_reserved_attached"] or 0)
        rec.check("the producer's reserved memory did not grow over the syncs", grown <= 64 * MIB, grown)

        # kill -9 of the server while it holds the export mapped, in the middle of one more sync
        async def killed_mid_sync() -> str:
            outcome = "completed"

            async def kill() -> None:
                await anyio.sleep(0.003)
                proc.send_signal(signal.SIGKILL)

            async with anyio.create_task_group() as tg:
                tg.start_soon(kill)
                try:
                    async with sync.paused(SYNCS + 1):
                        with torch.no_grad():
                            small.add_(1.0)
                    await sync.after_step(policy, SYNCS + 1)
                except Exception as exc:  # the replica died under it: what the trainer sees
                    outcome = f"{type(exc).__name__}: {exc}"[:300]
            return outcome

        rec.figure("sync_while_killed", anyio.run(killed_mid_sync))
        proc.wait(30)
        rec.figure("server_exit", proc.returncode)
        server = None
        time.sleep(1.0 if cuda else 0.1)
        if cuda:
            from atroposd.weights.cuda_ipc import ipc_collect

            ipc_collect()
        after_kill = device_memory(ctx.device)
        rec.figure("device_memory_after_kill", after_kill)
        attached = rec.figures.get("device_memory_attached")
        if attached is not None and after_kill is not None and baseline is not None:
            # the server's context and model are gone; the producer keeps its arena
            delta = after_kill["used_bytes"] - attached["used_bytes"]
            rec.figure("device_memory_after_kill_minus_attached", delta)
            server_share = attached["used_bytes"] - baseline["used_bytes"]
            rec.check(
                "the killed server's device memory is back",
                after_kill["used_bytes"] <= baseline["used_bytes"] + max(server_share // 4, 64 * MIB) + arena.nbytes,
                {"after_kill_minus_baseline": after_kill["used_bytes"] - baseline["used_bytes"]},
            )
    finally:
        if server is not None:
            stop_tree(server, grace=5.0)
        sync.close()  # the arena released: the model's tensors back in private memory
        shutil.rmtree(run_dir, ignore_errors=True)
    if cuda:
        from atroposd.weights.cuda_ipc import ipc_collect

        ipc_collect()
        torch.cuda.empty_cache()
    rec.figure("producer_reserved_after_release", reserved())
    if cuda and reserved0 is not None:
        # what the producer still holds once its arena is released: the block of the export the
        # killed server had mapped stays until this process exits (torch frees no block whose
        # reference counter did not reach zero); reported, not judged
        rec.figure("producer_held_after_release_bytes", int(torch.cuda.memory_reserved(device)) - reserved0)
    # torch's own files (CUDA IPC's reference counters, torch_<pid>_...), by whose pid: reported
    rec.figure("torch_shm_files_before", torch_files0)
    rec.figure("torch_shm_files_after_release", _torch_files({"producer": os.getpid(), "server": server_pid}))
    left = shm_files(f"atroposd-{ctx.nonce}")
    rec.check("no segment of the export left", not left, left)


# ------------------------------------------------------------------------------- bandwidth


def bandwidth(ctx: Context, rec: Record, deadline: float) -> None:
    """Host↔device through the push's host staging buffer (pinned POSIX shm), device↔device
    through the model's arena."""
    import torch
    from transformers import AutoModelForCausalLM

    from atroposd.weights.arena import ParameterArena
    from atroposd.weights.staging import StagingBuffer

    device = torch.device(ctx.device)
    free = shm_size()["free_bytes"]
    size = min(256 * MIB if device.type == "cuda" else 32 * MIB, max(MIB, free // 4))
    rec.figure("staging_bytes", size)
    staging = StagingBuffer.create(ctx.nonce, size, device, host=True)
    try:
        rec.figure("pinned", staging.pinned)
        if device.type == "cuda":
            rec.check("the staging buffer is pinned", staging.pinned)
        host = staging.segment.view(0, size, torch.uint8, (size,))
        dev = torch.randint(0, 255, (size,), dtype=torch.uint8, device=device)
        d2h, h2d = [], []
        for _ in range(5):
            _sync(device)
            t0 = time.perf_counter()
            host.copy_(dev, non_blocking=True)
            _sync(device)
            d2h.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            _sync(device)
            h2d.append(time.perf_counter() - t0)
        rec.figures_update(
            {
                "device_to_host_gb_per_s": round(size / min(d2h) / 1e9, 3),
                "host_to_device_gb_per_s": round(size / min(h2d) / 1e9, 3),
                "device_to_host_median_gb_per_s": round(size / statistics.median(d2h) / 1e9, 3),
                "host_to_device_median_gb_per_s": round(size / statistics.median(h2d) / 1e9, 3),
            }
        )
        rec.check("host staging copies round-trip", bool(torch.equal(host[:4096].to(device), dev[:4096])))
        del host
    finally:
        staging.close()
    policy = AutoModelForCausalLM.from_pretrained(models(ctx)["model"], dtype=_torch_dtype(ctx)).to(device)  # type: ignore[arg-type]
    arena = ParameterArena.create(policy, nonce=ctx.nonce)
    try:
        seg = arena.segments[0]
        src = seg.view(0, seg.size, torch.uint8, (seg.size,))
        dst = torch.empty_like(src)
        times = []
        for _ in range(5):
            _sync(device)
            t0 = time.perf_counter()
            dst.copy_(src)
            _sync(device)
            times.append(time.perf_counter() - t0)
        rec.figures_update(
            {
                "arena_bytes": seg.size,
                "device_to_device_gb_per_s": round(seg.size / min(times) / 1e9, 3),
                "device_to_device_median_gb_per_s": round(seg.size / statistics.median(times) / 1e9, 3),
            }
        )
        rec.check("the arena copy is exact", bool(torch.equal(dst, src)))
        del src, dst
    finally:
        arena.release()


# ------------------------------------------------------------------------------- gpu tests


def gpu_tests(ctx: Context, rec: Record, deadline: float) -> None:
    """Every ``gpu``-marked test, named file by file, each one's outcome as it ends (in the
    rehearsal they find no CUDA and skip)."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text())
    rec.figure("files", files)
    outcomes = Path(ctx.work) / "gpu-tests.jsonl"
    outcomes.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-p", "gpucheck.pytest_plugin"]
    proc = start([*argv, *files], log=None, env=child_env(ctx, {"GPU_CHECK_TEST_LOG": str(outcomes)}))
    limit = max(5.0, deadline - time.time() - 10)
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        stop_tree(proc, grace=3.0)
    rec.figure("pytest_exit", rc)
    if rc is None:
        rec.check(f"the gpu tests ended within {limit:.0f} s", False)
    by_file: dict[str, list[dict[str, Any]]] = {}
    counts: dict[str, int] = {}
    for row in _jsonl(outcomes):
        entry = {k: v for k, v in row.items() if k not in ("file", "when")}
        by_file.setdefault(str(row["file"]), []).append(entry)
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    rec.figures_update({"tests": by_file, "counts": counts})
    rec.check("no gpu test failed", not counts.get("failed") and not counts.get("error"), counts)
    rec.check("every gpu test file ran", set(by_file) == set(files) and rc in (0, 5), rc)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a kill
    return rows


# ------------------------------------------------------------------------------------ jobs

JOB_KINDS = {
    "job_push": {"weight_sync": "push"},
    "job_shared": {"weight_sync": "shared"},
    "job_host_staging": {"weight_sync": "push", "push_path": "host_staging"},
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_config(root: Path, kind: str, *, model_dir: str, rehearse: bool, run_dir: Path) -> dict[str, Any]:
    """A job on the torch engine that trains until stopped (no periodic checkpoint; a stop
    abandons its final one at once: ``checkpoint_timeout = 0``)."""
    gpu = not rehearse
    inference: dict[str, Any] = {
        "engine": "torch",
        "model": model_dir,
        "port": free_port(),
        "max_model_len": 256 if gpu else 64,
        "device": "cuda:0" if gpu else "cpu",
        "dtype": "bfloat16" if gpu else "float32",
    }
    trainer: dict[str, Any] = {
        "device": "cuda:0" if gpu else "cpu",
        "dtype": "float32",
        "compute_dtype": "bfloat16" if gpu else "float32",
        "steps": 100000,
        "checkpoint_every": 100000,
        "max_token_len": 256 if gpu else 64,
        **JOB_KINDS[kind],
    }
    return {
        "daemon": {
            "runtime_dir": str(run_dir),
            "state_dir": str(root / "state"),
            "log_format": "json",
            "stop_timeout": 20.0,
            "checkpoint_timeout": 0.0,
        },
        "api": {"port": free_port()},
        "inference": inference,
        "trainer": trainer,
        "env": [{"name": "arithmetic", "builtin": "arithmetic"}],
    }


def toml(cfg: dict[str, Any]) -> str:
    lines: list[str] = []
    for section, body in cfg.items():
        if isinstance(body, list):
            for item in body:
                lines.append(f"[[{section}]]")
                lines += [f"{k} = {json.dumps(v)}" for k, v in item.items()]
            continue
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"


def _rows(path: Path) -> list[dict[str, Any]]:
    """A job's metrics.jsonl rows so far (a line being written is left out)."""
    return [row for row in _jsonl(path) if isinstance(row, dict) and "step" in row]


def _precision(logs: Path) -> dict[str, Any] | None:
    """What the trainer's "model loaded" log line says it uses (dtypes, optimizer precision)."""
    for log in sorted(logs.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "model loaded" not in line:
                continue
            try:
                row = json.loads(line)
            except ValueError:
                continue
            keys = ("compute_dtype", "master_dtype", "optimizer_precision", "inference_dtype", "dtype", "device")
            return {k: row[k] for k in keys if k in row}
    return None


def job(ctx: Context, rec: Record, deadline: float, kind: str) -> None:
    """``atroposd run`` for ``ctx.steps`` steps, then a requested stop; the start, the wait and the
    stop all under this phase's deadline (a start that fails or hangs is stopped here)."""
    work = Path(ctx.work)
    root = work / "jobs" / kind
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    run_dir = Path("/tmp") / f"{ctx.nonce}-{kind.removeprefix('job_')}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = job_config(root, kind, model_dir=models(ctx)["model"], rehearse=ctx.rehearse, run_dir=run_dir)
    path = root / "atroposd.toml"
    path.write_text(toml(cfg))
    rec.figure("config", {"trainer": cfg["trainer"], "inference": cfg["inference"]})
    env = child_env(ctx)
    check = subprocess.run(
        [sys.executable, "-m", "atroposd", "config", "check", "-c", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if not rec.check("config check", check.returncode == 0, (check.stdout + check.stderr)[-1500:] or None):
        return
    metrics = root / "state" / "metrics.jsonl"
    before = device_memory(ctx.device)
    rec.figure("device_memory_before", before)
    proc: subprocess.Popen[Any] | None = None
    t0 = time.monotonic()
    try:
        proc = start([sys.executable, "-m", "atroposd", "run", "-c", str(path)], log=root / "run.log", env=env)

        def progressed() -> bool:
            return len(_rows(metrics)) >= ctx.steps or proc.poll() is not None

        wait_until(progressed, timeout=max(1.0, deadline - time.time() - 30))
        rows = _rows(metrics)
        rec.figure("steps_s", round(time.monotonic() - t0, 2))
        if proc.poll() is not None:
            raise PhaseError(f"atroposd run exited {proc.returncode} after {len(rows)} step(s); see its log")
        if len(rows) < ctx.steps:
            raise PhaseError(f"{len(rows)} of {ctx.steps} steps within the phase's deadline")
        # the job's own segments (what its processes map now): each must be gone after the stop
        mapped = _shm_mapped([proc.pid, *descendants(proc.pid)])
        rec.figure("segments_mapped", sorted(mapped))
        t1 = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # a requested stop (its checkpoint abandoned at once)
        try:
            rc = proc.wait(timeout=max(5.0, deadline - time.time() - 5))
        except subprocess.TimeoutExpired:
            rc = None
        rec.figure("stop_s", round(time.monotonic() - t1, 2))
        rec.check("the requested stop ended the job with exit 0", rc == 0, rc)
    finally:
        if proc is not None:
            killed = stop_tree(proc, grace=5.0)
            if killed:
                rec.figure("killed_pids", killed)
    shutil.rmtree(run_dir, ignore_errors=True)
    time.sleep(1.0 if ctx.device.startswith("cuda") else 0.0)
    after = device_memory(ctx.device)
    rec.figure("device_memory_after_stop", after)
    if before is not None and after is not None:
        delta = after["used_bytes"] - before["used_bytes"]
        rec.figure("device_memory_after_minus_before", delta)
        rec.check("the job's device memory is freed after stop", delta <= 64 * MIB, delta)
    rows = _rows(metrics)[: ctx.steps]
    later = rows[1:]  # the first step's sync attaches and maps: apart
    nbytes = sum(f.stat().st_size for f in Path(models(ctx)["model"]).glob("*.safetensors"))
    transfer = _median([float(r.get("sync_transfer_s", 0.0)) for r in later])
    span = float(rows[-1]["time"]) - float(rows[0]["time"]) if len(rows) > 1 else 0.0
    rec.figures_update(
        {
            "steps": len(rows),
            "sync_median_s": _median([float(r.get("sync_s", 0.0)) for r in later]),
            "sync_pause_median_s": _median([float(r.get("sync_pause_s", 0.0)) for r in later]),
            "sync_transfer_median_s": transfer,
            "sync_step1_s": float(rows[0].get("sync_s", 0.0)) if rows else None,
            "weights_bytes": nbytes,
            "transfer_gb_per_s": round(nbytes / transfer / 1e9, 3) if transfer else None,
            "steps_per_s": round((len(rows) - 1) / span, 3) if span > 0 else None,
            "precision": _precision(root / "state" / "logs"),
            "loss": [r.get("loss") for r in rows],
        }
    )
    left = sorted(n for n in rec.figures.get("segments_mapped", []) if (Path("/dev/shm") / n).exists())
    rec.check("no segment of the job left after stop", not left, left)


def _shm_mapped(pids: list[int]) -> set[str]:
    """The /dev/shm files (atroposd's segments, torch's) that the processes ``pids`` map."""
    names: set[str] = set()
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if path.startswith("/dev/shm/"):
                names.add(path.removeprefix("/dev/shm/").removesuffix(" (deleted)"))
    return names


# ------------------------------------------------------------------------------------ main

PHASES: dict[str, Callable[[Context, Record, float], None]] = {
    "preflight": preflight,
    "install": install,
    "model": model,
    "nccl": nccl,
    "ipc": ipc,
    "ipc_expandable": ipc,
    "bandwidth": bandwidth,
    "gpu_tests": gpu_tests,
    "job_push": functools.partial(job, kind="job_push"),
    "job_shared": functools.partial(job, kind="job_shared"),
    "job_host_staging": functools.partial(job, kind="job_host_staging"),
}


def main(argv: list[str]) -> int:
    name, ctx_json, result, deadline = argv[0], argv[1], Path(argv[2]), float(argv[3])
    ctx = Context.from_json(ctx_json)
    rec = Record(result)
    rec.save()
    os.environ["GPU_CHECK_PHASE"] = name
    print(f"gpu-check phase {name}: pid {os.getpid()}, {deadline - time.time():.0f} s", flush=True)
    try:
        PHASES[name](ctx, rec, deadline)
    except BaseException as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:2000]
        rec.figure("traceback", traceback.format_exc()[-3000:])
        traceback.print_exc()
        return 1
    if rec.failed:
        print(f"gpu-check phase {name}: failed check(s): {rec.failed}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""What the runner and the phases share: the run's context, a phase's record, process handling,
and the device-wide figures (memory, ``/dev/shm``) read the same way on a GPU and on the CPU."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPTS = ROOT / "scripts"

#: Qwen2.5-0.5B's shape (494M parameters with its 151936-token embedding)
QWEN_SHAPE: dict[str, Any] = {
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
#: the same shape cut to 2 layers and a 32k vocabulary: the NCCL phase's model (its sharded
#: checkpoint holds a float32 master copy and two moments: small enough to write in seconds)
QWEN_SMALL: dict[str, Any] = {**QWEN_SHAPE, "num_hidden_layers": 2, "vocab_size": 32768}


@dataclass
class Context:
    """One run, as every phase's process sees it (JSON in its argv)."""

    rehearse: bool
    out: str  # the output folder: gpu-check.jsonl and the phases' logs (what comes back)
    work: str  # big and private things: models, checkpoints, venv, job state (never carried back)
    prepared: str  # what ``prepare`` wrote (wheels, requirements, the model's config and tokenizer)
    nonce: str  # every segment of this run is named atroposd-<nonce>...
    device: str  # "cuda:0", or "cpu" in the rehearsal
    python: str  # the interpreter the phases run on (the venv's once ``install`` made it)
    steps: int = 6
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def backend(self) -> str:
        return "gloo" if self.rehearse else "nccl"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Context:
        return cls(**json.loads(text))


class Record:
    """A phase's figures and checks, rewritten to ``path`` (atomically) at every change, so that a
    phase stopped at its deadline still reports what it measured."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.figures: dict[str, Any] = {}
        self.checks: list[dict[str, Any]] = []
        self.error: str | None = None

    def figure(self, key: str, value: Any) -> Any:
        self.figures[key] = value
        self.save()
        return value

    def figures_update(self, values: Mapping[str, Any]) -> None:
        self.figures.update(values)
        self.save()

    def check(self, name: str, ok: bool, detail: Any = None) -> bool:
        self.checks.append({"name": name, "ok": bool(ok), **({"detail": detail} if detail is not None else {})})
        self.save()
        return bool(ok)

    @property
    def failed(self) -> list[str]:
        return [c["name"] for c in self.checks if not c["ok"]]

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"figures": self.figures, "checks": self.checks, "error": self.error}, default=str))
        os.replace(tmp, self.path)


def load_record(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"figures": {}, "checks": []}
    return data if isinstance(data, dict) else {"figures": {}, "checks": []}


# ------------------------------------------------------------------------------ processes

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def child_env(ctx: Context | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every child imports this checkout (never an installed atroposd) and downloads nothing."""
    env = dict(os.environ)
    path = [str(ROOT), str(SCRIPTS)]
    site = (ctx.extra.get("site") if ctx is not None else None) or os.environ.get("GPU_CHECK_SITE")
    if site:  # the carried wheels, where no venv could be made
        path.append(str(site))
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if ctx is not None and ctx.rehearse:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the rehearsal never touches a GPU, even where there is one
    env.update(extra or {})
    return env


def start(
    argv: Sequence[str],
    *,
    log: Path | None,
    env: Mapping[str, str],
    cwd: Path = ROOT,
    stdin: Any = subprocess.DEVNULL,
    **kw: Any,
) -> subprocess.Popen[Any]:
    """A child in this process group (a kill of the group takes it), killed with its parent; its
    output to ``log`` (None: this process's own)."""
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(log, "ab")) if log is not None else None
        return subprocess.Popen(
            list(argv),
            stdin=stdin,
            stdout=kw.pop("stdout", out),
            stderr=out,
            env=dict(env),
            cwd=str(cwd),
            preexec_fn=_die_with_parent,
            **kw,
        )


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (by parent pid, whatever their session)."""
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def stop_tree(proc: subprocess.Popen[Any], *, grace: float = 5.0) -> list[int]:
    """SIGTERM ``proc`` and every descendant, SIGKILL what is left after ``grace`` seconds; reaps
    ``proc``. Returns the pids that had to be killed."""
    import psutil

    pids = [proc.pid, *descendants(proc.pid)] if proc.poll() is None else descendants(proc.pid)
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            p.send_signal(signal.SIGTERM)
            procs.append(p)
    _gone, alive = psutil.wait_procs(procs, timeout=grace)
    killed = []
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
            killed.append(p.pid)
    psutil.wait_procs(alive, timeout=5)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    return killed


def tail(path: Path, chars: int = 4000) -> str:
    """The last ``chars`` characters of a log (whole lines)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chars))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    if size > chars and "\n" in data:
        data = data.split("\n", 1)[1]
    return data


# ------------------------------------------------------------------------- device figures

SHM = Path("/dev/shm")


def shm_files(prefix: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(SHM) if n.startswith(prefix))
    except OSError:
        return []


def remove_segments(nonce: str) -> list[str]:
    """Remove this run's segments (``atroposd-<nonce>…``) that a killed phase left."""
    left = shm_files(f"atroposd-{nonce}")
    for name in left:
        with contextlib.suppress(OSError):
            (SHM / name).unlink()
    return left


def shm_size() -> dict[str, int]:
    st = os.statvfs(SHM)
    return {"total_bytes": st.f_blocks * st.f_frsize, "free_bytes": st.f_bavail * st.f_frsize}


def device_memory(device: str) -> dict[str, Any] | None:
    """The device's memory in use, device-wide (every process's): ``cudaMemGetInfo`` (a CUDA
    context in this process, made here when there is none), and NVML's count beside it when NVML
    is there; None on the CPU."""
    if not device.startswith("cuda"):
        return None
    import torch

    index = int(device.split(":", 1)[1]) if ":" in device else 0
    free, total = torch.cuda.mem_get_info(index)
    out: dict[str, Any] = {"used_bytes": int(total - free), "total_bytes": int(total)}
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
            out["nvml_used_bytes"] = int(info.used)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML here (its bindings or the library): cudaMemGetInfo alone
        out["nvml_used_bytes"] = None
    return out


def wait_until(pred: Any, timeout: float, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


@contextlib.contextmanager
def timed(rec: Record, key: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        rec.figure(key, round(time.perf_counter() - t0, 4))

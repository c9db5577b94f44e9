"""``gpu-check prepare``: what a GPU machine without network needs, in one folder of at most 64 MiB.

* ``requirements.txt``: every distribution atroposd, its tests and ``run`` need that the GPU
  machine's image lacks (torch's own environment and transformers are there), pinned to this
  environment's versions, each line marked with the Python versions that need it;
* ``wheels/``: a wheel of each for CPython 3.10, 3.11, 3.12 and 3.13 (manylinux x86_64), so that
  ``run`` installs whatever Python the machine has (``--dry-run``: none);
* ``qwen-0.5b/``: the config and tokenizer of a Qwen2.5-0.5B-shaped model (its weights are drawn
  on the GPU machine, never carried);
* ``jobs/``: the jobs' configs as ``run`` writes them there, each passed through ``config check``.

A requirement that cannot be resolved (not installed here, and no wheel for one of the Pythons)
fails ``prepare`` naming it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpucheck.common import QWEN_SHAPE, ROOT

LIMIT_BYTES = 64 << 20
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
#: what the GPU machine's image already holds: never carried
PREINSTALLED = ("torch", "transformers", "tokenizers", "safetensors", "numpy")
#: what ``run`` itself needs: NVML's bindings
RUN_ONLY = ("nvidia-ml-py>=12",)
#: torch's own environment (torch 2.11 wheels bring these): never carried
TORCH_ENV = {
    "torch",
    "triton",
    "sympy",
    "mpmath",
    "networkx",
    "jinja2",
    "markupsafe",
    "fsspec",
    "filelock",
    "typing-extensions",
    "setuptools",
    "huggingface-hub",
    "pyyaml",
    "regex",
    "requests",
    "tqdm",
    "packaging",
    "certifi",
    "charset-normalizer",
    "idna",
    "urllib3",
    "hf-xet",
}


class PrepareError(RuntimeError):
    pass


def requirements() -> list[str]:
    """atroposd's dependencies (and its tests') that the GPU machine's environment lacks."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # the tests' own needs too (the gpu-marked tests run there); matplotlib only draws plots
    tests = [d for d in project["optional-dependencies"]["test"] if not d.startswith("matplotlib")]
    out = []
    for dep in [*project["dependencies"], *tests, *RUN_ONLY]:
        match = re.match(r"[A-Za-z0-9_.-]+", dep.strip())
        if match is not None and match.group(0).lower() not in PREINSTALLED:
            out.append(dep)
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(reqs: list[str], python: str) -> dict[str, str]:
    """``{name: "name==version"}`` of every distribution ``reqs`` need on ``python`` (this
    environment's versions; a requirement not installed here keeps its own specifier), less what
    the GPU machine's image holds."""
    from importlib import metadata

    from packaging.requirements import Requirement

    skip = {_norm(n) for n in PREINSTALLED} | TORCH_ENV
    seen: dict[str, str] = {}
    todo = list(reqs)
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"python_version": python, "extra": ""}):
            continue
        name = _norm(req.name)
        if name in skip or name in seen or (name.startswith("nvidia-") and name != "nvidia-ml-py"):
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            seen[name] = f"{name}{req.specifier}"  # not installed here: pip resolves it, or prepare fails
            continue
        seen[name] = f"{name}=={dist.version}"
        todo += list(dist.requires or [])
    return seen


def pinned(reqs: list[str]) -> list[str]:
    """One line per pin, with the Pythons that need it as an environment marker when not all do."""
    by_python = {py: closure(reqs, py) for py in PYTHONS}
    pins = sorted({pin for c in by_python.values() for pin in c.values()})
    lines = []
    for pin in pins:
        need = [py for py in PYTHONS if pin in by_python[py].values()]
        if len(need) == len(PYTHONS):
            lines.append(pin)
        else:
            lines.append(pin + " ; " + " or ".join(f'python_version == "{py}"' for py in need))
    return lines


def download(out: Path, lines: list[str]) -> None:
    """Each pin's wheel for each Python that needs it (binary wheels only; pip fails on a pin
    it cannot resolve, and so does prepare)."""
    from packaging.requirements import Requirement

    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for py in PYTHONS:
        pins = []
        for line in lines:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"python_version": py, "extra": ""}):
                pins.append(f"{req.name}{req.specifier}")
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-d",
                str(wheels),
                "--only-binary=:all:",
                "--python-version",
                py,
                "--implementation",
                "cp",
                "--platform",
                "manylinux2014_x86_64",
                "--platform",
                "manylinux_2_17_x86_64",
                "--platform",
                "manylinux_2_28_x86_64",
                "--platform",
                "any",
                *pins,
            ],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            raise PrepareError(f"no wheel for CPython {py} of a requirement: {res.stderr.strip()[-1500:]}")


def write_model_files(out: Path) -> Path:
    """The Qwen-shaped model's config and the built-in tokenizer (weights are drawn at ``run``)."""
    from atroposd.models.tiny import ensure_builtin_model

    model = out / "qwen-0.5b"
    model.mkdir(parents=True, exist_ok=True)
    tiny = ensure_builtin_model(out / "tiny-state", seed=0, max_model_len=512)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "vocab.json", "merges.txt"):
            (model / f.name).write_bytes(f.read_bytes())
    tok = json.loads((tiny / "config.json").read_text())
    cfg = {**QWEN_SHAPE, **{k: tok[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in tok}}
    (model / "config.json").write_text(json.dumps(cfg, indent=1))
    return model


def parameter_count(model_dir: Path) -> int:
    """The model's parameters, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)))
    return sum(p.numel() for p in model.parameters())


def job_configs(out: Path, model: Path) -> dict[str, Path]:
    """The jobs' configs as ``run`` writes them on the GPU machine, each checked here."""
    from gpucheck.phases import JOB_KINDS, job_config, toml

    paths = {}
    for kind in JOB_KINDS:
        root = out / "jobs" / kind
        root.mkdir(parents=True, exist_ok=True)
        cfg = job_config(root, kind, model_dir=str(model), rehearse=False, run_dir=Path("/tmp") / f"gpuchk-{kind}")
        path = root / "atroposd.toml"
        path.write_text(toml(cfg))
        res = subprocess.run(
            [sys.executable, "-m", "atroposd", "config", "check", "-c", str(path)], capture_output=True, text=True
        )
        if res.returncode != 0:
            raise PrepareError(f"{path}: config check failed:\n{res.stdout}{res.stderr}")
        paths[kind] = path
    return paths


def prepare(out: Path, dry_run: bool) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    lines = pinned(requirements())
    (out / "requirements.txt").write_text("\n".join(lines) + "\n")
    if not dry_run:
        download(out, lines)
    model = write_model_files(out)
    configs = job_configs(out, model)
    carried = sum(
        f.stat().st_size
        for f in out.rglob("*")
        if f.is_file() and not {"tiny-state", "work", "rehearsal", "out"} & set(f.relative_to(out).parts)
    )
    if carried > LIMIT_BYTES:
        raise PrepareError(f"{out} holds {carried} bytes, over the {LIMIT_BYTES}-byte limit")
    return {
        "requirements": lines,
        "pythons": list(PYTHONS),
        "wheels": len(list((out / "wheels").glob("*.whl"))) if not dry_run else 0,
        "model": str(model),
        "parameters": parameter_count(model),
        "configs": {k: str(v) for k, v in configs.items()},
        "bytes": carried,
        "dry_run": dry_run,
    }

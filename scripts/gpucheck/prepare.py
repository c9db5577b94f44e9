"""``gpu-check prepare``: what a GPU machine without network needs, in one folder of at most 64 MiB.

* ``requirements.txt``: every distribution atroposd, its tests and ``run`` need that the GPU
  machine's image lacks (torch's own environment and transformers are there), pinned to this
  environment's versions, each line marked with the Python versions that need it;
* ``wheels/``: a wheel of each for CPython 3.10, 3.11, 3.12 and 3.13 (manylinux x86_64), so that
  ``run`` installs whatever Python the machine has (``--dry-run``: none); a pinned version
  without a wheel for one of them is loosened, for that Python only, to what its requirers ask;
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
#: of the test extra, what the ``gpu``-marked tests and their conftests need (not atroposlib, wandb,
#: docker...: those tests do not run there, and their wheels would not fit 64 MiB)
GPU_TESTS_NEED = ("pytest", "pytest-timeout", "hypothesis")
#: what ``run`` itself needs: NVML's bindings
RUN_ONLY = ("nvidia-ml-py>=12",)
#: torch's own environment (torch 2.11 wheels bring these): never carried (packaging and
#: typing-extensions are: atroposd and anyio ask for newer ones than an image may hold)
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
    "setuptools",
    "huggingface-hub",
    "pyyaml",
    "regex",
    "requests",
    "tqdm",
    "certifi",
    "charset-normalizer",
    "idna",
    "urllib3",
    "hf-xet",
}


class PrepareError(RuntimeError):
    pass


def requirements() -> list[str]:
    """atroposd's dependencies (and its gpu tests') that the GPU machine's environment lacks."""
    import tomllib
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # of the tests' own needs, what the gpu-marked tests and their conftests import
    tests = [d for d in project["optional-dependencies"]["test"] if _norm(Requirement(d).name) in GPU_TESTS_NEED]
    out = []
    for dep in [*project["dependencies"], *tests, *RUN_ONLY]:
        match = re.match(r"[A-Za-z0-9_.-]+", dep.strip())
        if match is not None and match.group(0).lower() not in PREINSTALLED:
            out.append(dep)
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(reqs: list[str], python: str, parents: dict[str, set[str]] | None = None) -> dict[str, tuple[str, str]]:
    """``{name: (pin, loose)}`` of every distribution ``reqs`` need on ``python``, less what the
    GPU machine's image holds: ``pin`` is ``name==version`` of this environment (a requirement
    not installed here keeps its specifier), ``loose`` the name with what its requirers ask.
    ``parents``, when given, gets each name's requirers."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    skip = {_norm(n) for n in PREINSTALLED} | TORCH_ENV
    seen: dict[str, str] = {}
    asked: dict[str, SpecifierSet] = {}
    todo: list[tuple[str, str | None]] = [(r, None) for r in reqs]
    while todo:
        text, parent = todo.pop()
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"python_version": python, "extra": ""}):
            continue
        name = _norm(req.name)
        if name in skip or (name.startswith("nvidia-") and name != "nvidia-ml-py"):
            continue
        asked[name] = asked.get(name, SpecifierSet()) & req.specifier
        if parents is not None and parent is not None:
            parents.setdefault(name, set()).add(parent)
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            seen[name] = ""  # not installed here: pip resolves it, or prepare fails
            continue
        seen[name] = dist.version
        todo += [(r, name) for r in dist.requires or []]
    out = {}
    for name, version in seen.items():
        loose = f"{name}{asked[name]}"
        out[name] = (f"{name}=={version}" if version else loose, loose)
    return out


def pinned(reqs: list[str]) -> dict[str, dict[str, str]]:
    """Per Python: ``{name: requirement}``, each pinned to this environment's version."""
    return {py: {name: pin for name, (pin, _loose) in closure(reqs, py).items()} for py in PYTHONS}


def lines(per_python: dict[str, dict[str, str]]) -> list[str]:
    """requirements.txt: one line per requirement, marked with the Pythons that take it when not all do."""
    every = sorted({r for reqs in per_python.values() for r in reqs.values()})
    out = []
    for req in every:
        need = [py for py in PYTHONS if req in per_python[py].values()]
        if len(need) == len(PYTHONS):
            out.append(req)
        else:
            out.append(req + " ; " + " or ".join(f'python_version == "{py}"' for py in need))
    return out


_NOT_FOUND = re.compile(r"No matching distribution found for ([A-Za-z0-9_.-]+)==")


def download(out: Path, reqs: list[str], per_python: dict[str, dict[str, str]]) -> None:
    """Each requirement's wheel for each Python (binary wheels only). A pin with no wheel for a
    Python (a version that dropped it) is loosened to what its requirers ask, for that Python
    alone, and resolved by pip; one pip cannot resolve fails ``prepare``, naming it."""
    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for py in PYTHONS:
        parents: dict[str, set[str]] = {}
        loose = {name: lo for name, (_pin, lo) in closure(reqs, py, parents).items()}
        for _attempt in range(40):
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
                    *sorted(per_python[py].values()),
                ],
                capture_output=True,
                text=True,
            )
            if res.returncode == 0:
                break
            miss = _NOT_FOUND.search(res.stderr)
            name = _norm(miss.group(1)) if miss else None
            if name is None or name not in per_python[py] or per_python[py][name] == name:
                raise PrepareError(f"a requirement has no wheel for CPython {py}: {res.stderr.strip()[-1500:]}")
            if per_python[py][name] != loose[name]:
                per_python[py][name] = loose[name]  # what its requirers ask
            else:  # its requirers pin it: the newest for this Python, and they loosened as well
                per_python[py][name] = name
                for parent in parents.get(name, ()):
                    if parent in per_python[py] and per_python[py][parent] != name:
                        per_python[py][parent] = loose[parent]
        else:
            raise PrepareError(f"the requirements for CPython {py} did not resolve: {res.stderr.strip()[-1500:]}")


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
    reqs = requirements()
    per_python = pinned(reqs)
    if not dry_run:
        download(out, reqs, per_python)
    req_lines = lines(per_python)
    (out / "requirements.txt").write_text("\n".join(req_lines) + "\n")
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
        "requirements": req_lines,
        "pythons": list(PYTHONS),
        "wheels": len(list((out / "wheels").glob("*.whl"))) if not dry_run else 0,
        "model": str(model),
        "parameters": parameter_count(model),
        "configs": {k: str(v) for k, v in configs.items()},
        "bytes": carried,
        "dry_run": dry_run,
    }

"""Checkpoints: ``state_dir/checkpoints/step-<N>/``, written atomically (SPEC §9).

Layout (a Hugging Face directory plus the trainer's state)::

    step-N/config.json, model.safetensors     full mode (tied aliases stored once, as HF does)
    step-N/adapter_config.json, adapter_model.safetensors   LoRA mode (PEFT layout)
    step-N/tokenizer files
    step-N/trainer_state.pt   {"format", "step", "weight_version", "optimizer", "scheduler", "rng",
                               "config", "model", "mode", "tokenizer", "skipped_steps"}

Everything is written into ``.tmp-step-N-<pid>/``, each file fsync'ed, then the directory is
renamed to ``step-N`` and the parent fsync'ed. A ``step-N`` directory therefore always is a
complete checkpoint; a temporary one left by a crash or kill is ignored and removed at the
next start. Old checkpoints are pruned *before* a new one is written (so a full disk has room)
keeping ``keep - 1``, then ``keep`` once the new one is in place.

The reference model of ``kl_reference = "initial"`` is not stored: it is the model source
itself (the configured directory, or builtin:tiny rebuilt from the seed), which resume checks
is unchanged (``model`` and ``tokenizer`` fingerprints in the state).
"""

from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

__all__ = ["FORMAT_VERSION", "CheckpointError", "Restored", "clean_partial", "complete_checkpoints",
           "latest_checkpoint", "load_checkpoint", "prune", "rng_state", "save_checkpoint", "set_rng_state"]

log = structlog.get_logger("trainer", component="trainer")  # lazy: bound at first use

FORMAT_VERSION = 1
STATE_FILE = "trainer_state.pt"
WEIGHTS_FILE = "model.safetensors"
_STEP_RE = re.compile(r"^step-(\d+)$")
TMP_PREFIX = ".tmp-step-"


class CheckpointError(RuntimeError):
    pass


@dataclass
class Restored:
    path: Path
    state: dict[str, Any]  # trainer_state.pt
    weights: dict[str, torch.Tensor]  # full: model state dict; LoRA: adapter tensors (PEFT names)


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP_RE.match(entry.name)
        if m and entry.is_dir() and (entry / STATE_FILE).is_file():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def clean_partial(root: Path) -> list[Path]:
    """Remove temporary directories left by an interrupted write; returns what was removed."""
    removed = []
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name.startswith(TMP_PREFIX):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def prune(root: Path, keep: int) -> None:
    """Keep the ``keep`` newest complete checkpoints (``keep`` may be 0)."""
    found = complete_checkpoints(root)
    for _, path in found[: max(0, len(found) - keep)]:
        shutil.rmtree(path, ignore_errors=True)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def model_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full model's state dict for safetensors: private contiguous copies, each storage once.

    Tied aliases (``lm_head.weight`` of a tied-embedding model) are dropped as Hugging Face
    does; the copy also detaches from shared memory that the inference server computes on.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...], torch.dtype]] = set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().to("cpu", copy=True).contiguous()
    return out


def _fsync_tree(path: Path) -> None:
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(root: Path, step: int, *, model: torch.nn.Module, tokenizer: Any, lora: bool,
                    state: dict[str, Any], keep: int) -> Path:
    """Write ``root/step-<step>/`` atomically; raises CheckpointError (temp dir removed)."""
    final = root / f"step-{step}"
    tmp = root / f"{TMP_PREFIX}{step}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        prune(root, keep - 1)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        _write_model(tmp, model, lora)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        torch.save({"format": FORMAT_VERSION, "step": step, **state}, tmp / STATE_FILE)
        _fsync_tree(tmp)
        if final.exists():  # a checkpoint of this very step (e.g. written again after a resume)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = "no space left on the device" if exc.errno == 28 else (exc.strerror or str(exc))
        raise CheckpointError(f"cannot write checkpoint {final}: {reason}") from exc
    prune(root, keep)
    return final


def _write_model(path: Path, model: torch.nn.Module, lora: bool) -> None:
    from safetensors.torch import save_file

    if lora:
        # PEFT's own layout (adapter_config.json + adapter_model.safetensors); the base model is
        # the configured source and is not copied.
        model.save_pretrained(str(path))  # type: ignore[operator]
        return
    save_file(model_weights(model), str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    config = getattr(model, "config", None)
    if config is not None:
        config.save_pretrained(str(path))
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        try:
            gen.save_pretrained(str(path))
        except ValueError as exc:  # an invalid generation config must not lose the checkpoint
            log.warning("generation config not saved", error=str(exc))


def load_checkpoint(path: Path) -> Restored:
    from safetensors.torch import load_file

    try:
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
        lora = state.get("mode") == "lora"
        weights = load_file(str(path / ("adapter_model.safetensors" if lora else WEIGHTS_FILE)))
    except (OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    if state.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format {state.get('format')!r}; this atroposd reads "
                              f"format {FORMAT_VERSION}")
    return Restored(path=path, state=state, weights=weights)


def restore_weights(model: torch.nn.Module, restored: Restored, *, lora: bool) -> None:
    """Copy the checkpoint's tensors into ``model`` (strict: every tensor present, nothing extra)."""
    if lora:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, restored.weights)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise CheckpointError(f"checkpoint {restored.path}: adapter tensors not in the model: {unexpected[:5]}")
        return
    result = model.load_state_dict(restored.weights, strict=False)
    own = model.state_dict()
    missing = [k for k in result.missing_keys
               if not any(own[k].data_ptr() == own[o].data_ptr() for o in restored.weights if o in own)]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"checkpoint {restored.path} does not match the model: missing {missing[:5]}, "
                              f"unexpected {list(result.unexpected_keys)[:5]}")

"""``atroposd export [-c FILE] [--step N] DIR`` (SPEC §2, §12.1): a checkpoint as a Hugging Face
model directory — config, ``model.safetensors``, generation config, tokenizer — that
``transformers`` loads with exactly the trained weights.

The checkpoint (default: the newest complete one under the config's checkpoint directory) is
verified against its checksums before anything of it is read. Its weights are copied as they are
(one rank, and the last step of several: ``model.safetensors`` is there already) or consolidated
from the ranks' model shards one tensor at a time (:mod:`.hfshards`), never the whole model in
memory. A LoRA checkpoint exports its adapters in PEFT's layout. ``DIR`` must not exist or be
empty; the directory is written under a temporary name beside it and renamed when complete.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from atroposd.config import Config
from atroposd.exitcodes import Exit
from atroposd.paths import Paths
from atroposd.trainer.checkpoint import (
    KNOWN_GOOD_FILE,
    STATE_FILE,
    WEIGHTS_FILE,
    complete_checkpoints,
    verify_checksums,
)
from atroposd.trainer.ckptfiles import CHECKSUM_FILE, CheckpointError

__all__ = ["ExportError", "export_checkpoint", "main"]

# What a checkpoint holds that a model directory does not.
_TRAINER_ONLY = {STATE_FILE, CHECKSUM_FILE, KNOWN_GOOD_FILE}


class ExportError(ValueError):
    """Bad usage: no such checkpoint, or an output directory that is not empty."""


def pick_checkpoint(root: Path, step: int | None) -> Path:
    found = complete_checkpoints(root)
    if not found:
        raise ExportError(f"no complete checkpoint in {root}")
    if step is None:
        return found[-1][1]
    for s, path in found:
        if s == step:
            return path
    raise ExportError(f"no complete checkpoint of step {step} in {root} (steps: {', '.join(str(s) for s, _ in found)})")


def export_checkpoint(checkpoint: Path, out: Path) -> list[str]:
    """Write ``checkpoint`` as a Hugging Face directory at ``out``; returns the files written.
    Raises CheckpointError (damaged) or ExportError (``out`` not empty)."""
    from atroposd.trainer.hfshards import ShardError, consolidate
    from atroposd.trainer.sharded import MODEL_DIR, OPTIMIZER_DIR, check_verified

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty directory")
    verified = verify_checksums(checkpoint)  # raises CheckpointError naming the first difference
    if verified:
        import json

        check_verified(checkpoint, json.loads((checkpoint / CHECKSUM_FILE).read_text())["files"])
    else:
        check_verified(checkpoint, None)  # a sharded checkpoint without checksums is refused
        print(f"warning: {checkpoint} has no checksums (written by an older atroposd): not verified", file=sys.stderr)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    written: list[str] = []
    try:
        for entry in sorted(checkpoint.iterdir()):
            if entry.name in _TRAINER_ONLY or entry.name in (MODEL_DIR, OPTIMIZER_DIR):
                continue
            if entry.is_file() and not entry.is_symlink():
                shutil.copyfile(entry, tmp / entry.name)
                written.append(entry.name)
        if not (tmp / WEIGHTS_FILE).exists() and (checkpoint / MODEL_DIR).is_dir():
            try:
                consolidate(checkpoint / MODEL_DIR, tmp / WEIGHTS_FILE, shapes=_model_shapes(checkpoint))
            except ShardError as exc:
                raise CheckpointError(f"checkpoint {checkpoint}: {exc}") from exc
            written.append(WEIGHTS_FILE)
        if not any(n.endswith(".safetensors") for n in written):
            raise CheckpointError(f"checkpoint {checkpoint} holds no weights")
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(written)


def _model_shapes(checkpoint: Path) -> dict[str, list[int]] | None:
    """The full shapes the trainer state recorded for the model shards (verified already)."""
    import torch

    try:
        state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load errors of a damaged file are of many kinds
        raise CheckpointError(f"cannot read checkpoint {checkpoint}: {type(exc).__name__}: {exc}") from exc
    shapes = state.get("model_shapes") if isinstance(state, dict) else None
    return shapes if isinstance(shapes, dict) else None


def main(cfg: Config, args: argparse.Namespace) -> int:
    """The command: exit 0 once written, 2 for bad usage, 1 for a damaged checkpoint."""
    root = Paths.of(cfg).checkpoints_dir
    out = Path(args.dir)
    try:
        checkpoint = pick_checkpoint(root, args.step)
        written = export_checkpoint(checkpoint, out)
    except ExportError as exc:
        print(f"atroposd export: {exc}", file=sys.stderr)
        return Exit.USAGE
    except (CheckpointError, OSError) as exc:
        print(f"atroposd export: {exc}", file=sys.stderr)
        return Exit.RUNTIME
    print(f"exported {checkpoint} to {out}: {', '.join(written)}")
    return Exit.OK

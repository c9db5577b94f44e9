"""``reload`` mode, trainer side: the weights written to ``{state_dir}/sync/v<version>/``.

One ``model.safetensors`` per version (the model's canonical tensors, tied aliases listed in
the metadata; for a LoRA model also ``adapter/`` in PEFT's layout), written to a temporary
directory and renamed when complete, files 0600. Only
the newest directory is kept once the server has loaded it; the directory is not a
checkpoint and is not counted in ``keep_checkpoints``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import orjson
import torch

from atroposd.logs import get_logger
from atroposd.weights.protocol import ADAPTER_DIR, SYNC_FORMAT, SYNC_WEIGHTS_FILE
from atroposd.weights.tensors import lora_spec, model_tensors

__all__ = ["prune_sync_dirs", "write_sync_dir"]

log = get_logger(__name__)


def write_sync_dir(model: torch.nn.Module, sync_dir: Path, weight_version: int) -> Path:
    """Write ``sync_dir/v<weight_version>/model.safetensors`` atomically; return the directory."""
    from safetensors.torch import save_file

    sync_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    final = sync_dir / f"v{weight_version}"
    tmp = sync_dir / f".tmp-v{weight_version}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(mode=0o700)
    try:
        mt = model_tensors(model)
        tensors = {n: t.detach().to("cpu").contiguous() for n, t in mt.tensors.items()}
        meta = {"format": SYNC_FORMAT, "weight_version": str(weight_version),
                "tied": orjson.dumps(mt.tied).decode()}
        lora = lora_spec(model)
        if lora is not None:
            meta["lora"] = orjson.dumps(lora).decode()
        file = tmp / SYNC_WEIGHTS_FILE
        save_file(tensors, str(file), metadata=meta)
        os.chmod(file, 0o600)
        if lora is not None and hasattr(model, "save_pretrained"):
            # The adapters alone, in PEFT's layout, for engines that serve LoRA adapters (vLLM).
            peft_model: Any = model
            peft_model.save_pretrained(str(tmp / ADAPTER_DIR))
            for f in (tmp / ADAPTER_DIR).iterdir():
                os.chmod(f, 0o600)
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def prune_sync_dirs(sync_dir: Path, keep: Path | None) -> None:
    """Remove every version directory (and leftover temporary one) except ``keep``."""
    if not sync_dir.is_dir():
        return
    for entry in sync_dir.iterdir():
        if keep is not None and entry == keep:
            continue
        if entry.is_dir() and (entry.name.startswith("v") or entry.name.startswith(".tmp-v")):
            shutil.rmtree(entry)

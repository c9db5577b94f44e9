"""``reload`` mode, trainer side: the weights written to ``{state_dir}/sync/v<version>/``.

One trainer rank: one ``model.safetensors`` per version (the model's canonical tensors, tied
aliases listed in the metadata). Several ranks (``write_sharded_sync_dir``): the weights are
gathered from a :class:`~atroposd.weights.source.TensorSource` a bucket at a time and each
bucket is written as one shard ``model-0000i-of-0000n.safetensors`` before the next is
gathered (never more than one bucket held), plus ``model.safetensors.index.json`` in Hugging
Face's layout, whose ``metadata`` carries what the one file's metadata carries. For a LoRA
model also ``adapter/`` in PEFT's layout. Written to a temporary directory and renamed when
complete, files 0600. Only the newest directory is kept once the server has loaded it; the
directory is not a checkpoint and is not counted in ``keep_checkpoints``. The directory's
layout, its atomic writing and its reading are :mod:`atroposd.weights.syncdir`'s; this module
adds what needs the model (its tensors, its adapters) or the trainer's ranks (the buckets).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, cast

import anyio
import torch

from atroposd.logs import get_logger
from atroposd.weights.source import TensorSource, check_gathered, plan_buckets, spec_nbytes
from atroposd.weights.syncdir import (
    adapter_dir,
    prune_sync_dirs,
    publishing,
    version_dir,
    write_index,
    write_shard,
    write_tensors,
)
from atroposd.weights.tensors import lora_spec, model_tensors

__all__ = ["prune_sync_dirs", "write_sharded_sync_dir", "write_sync_dir"]

log = get_logger(__name__)


class _Pretrained(Protocol):
    """A PEFT model: it saves its adapters alone."""

    def save_pretrained(self, save_directory: str) -> None: ...


def _save_adapter(model: torch.nn.Module, directory: Path) -> None:
    """The adapters alone, in PEFT's layout, for engines that serve LoRA adapters (vLLM)."""
    if not hasattr(model, "save_pretrained"):
        return
    peft_model = cast(_Pretrained, model)
    peft_model.save_pretrained(str(adapter_dir(directory)))
    for f in adapter_dir(directory).iterdir():
        os.chmod(f, 0o600)


def write_sync_dir(model: torch.nn.Module, sync_dir: Path, weight_version: int) -> Path:
    """Write ``sync_dir/v<weight_version>/model.safetensors`` atomically; return the directory."""
    mt = model_tensors(model)
    lora = lora_spec(model)
    adapter = (lambda directory: _save_adapter(model, directory)) if lora is not None else None
    return write_tensors(sync_dir, weight_version, mt.tensors, tied=mt.tied, lora=lora, also=adapter)


async def write_sharded_sync_dir(
    source: TensorSource,
    sync_dir: Path,
    weight_version: int,
    bucket_bytes: int,
    *,
    model: torch.nn.Module | None = None,
) -> Path:
    """Write ``sync_dir/v<weight_version>/`` as shards of at most ``bucket_bytes`` (a tensor
    larger than that alone in its shard) plus the index, gathering one bucket at a time from
    ``source``; return the directory. ``model``: written as a PEFT adapter too when the source
    has LoRA."""
    specs, tied, lora = source.specs(), source.tied(), source.lora()
    plan = plan_buckets(specs, bucket_bytes)
    if not plan:
        raise ValueError("the model has no tensors to write")
    weight_map: dict[str, str] = {}
    with publishing(sync_dir, weight_version) as tmp:
        for i, names in enumerate(plan):
            tensors = await source.gather(names)
            check_gathered(specs, names, tensors)
            fname = await anyio.to_thread.run_sync(write_shard, tmp, i, len(plan), tensors, weight_version)
            del tensors
            weight_map.update(dict.fromkeys(names, fname))
        total = sum(spec_nbytes(s) for s in specs.values())
        write_index(tmp, weight_version, weight_map, tied=tied, lora=lora, total_size=total)
        if lora is not None and model is not None:
            await anyio.to_thread.run_sync(_save_adapter, model, tmp)
    log.info("weights written in shards", weight_version=weight_version, shards=len(plan), tensors=len(specs))
    return version_dir(sync_dir, weight_version)

"""``reload`` mode, trainer side: the weights written to ``{state_dir}/sync/v<version>/``.

One trainer rank: one ``model.safetensors`` per version (the model's canonical tensors, tied
aliases listed in the metadata). Several ranks (``write_sharded_sync_dir``): the weights are
gathered from a :class:`~atroposd.weights.source.TensorSource` a bucket at a time and each
bucket is written as one shard ``model-0000i-of-0000n.safetensors`` before the next is
gathered (never more than one bucket held), plus ``model.safetensors.index.json`` in Hugging
Face's layout, whose ``metadata`` carries what the one file's metadata carries. For a LoRA
model also ``adapter/`` in PEFT's layout. Written to a temporary directory and renamed when
complete, files 0600. Only the newest directory is kept once the server has loaded it; the
directory is not a checkpoint and is not counted in ``keep_checkpoints``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import orjson
import torch

from atroposd.logs import get_logger
from atroposd.weights.protocol import (
    ADAPTER_DIR,
    SYNC_FORMAT,
    SYNC_INDEX_FILE,
    SYNC_WEIGHTS_FILE,
    shard_name,
)
from atroposd.weights.source import TensorSource, check_gathered, plan_buckets, spec_nbytes
from atroposd.weights.tensors import lora_spec, model_tensors

__all__ = ["prune_sync_dirs", "write_sharded_sync_dir", "write_sync_dir"]

log = get_logger(__name__)


@contextmanager
def _publishing(sync_dir: Path, weight_version: int) -> Iterator[Path]:
    """A temporary directory to write version ``weight_version`` into; renamed to
    ``sync_dir/v<weight_version>`` when the block ends without an error, removed otherwise."""
    sync_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    final = sync_dir / f"v{weight_version}"
    tmp = sync_dir / f".tmp-v{weight_version}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(mode=0o700)
    try:
        yield tmp
        for f in tmp.iterdir():
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
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


def _save(tensors: dict[str, torch.Tensor], file: Path, meta: dict[str, str]) -> None:
    from safetensors.torch import save_file

    save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, str(file), metadata=meta)
    os.chmod(file, 0o600)


def _save_adapter(model: torch.nn.Module, directory: Path) -> None:
    """The adapters alone, in PEFT's layout, for engines that serve LoRA adapters (vLLM)."""
    if not hasattr(model, "save_pretrained"):
        return
    peft_model: Any = model
    peft_model.save_pretrained(str(directory / ADAPTER_DIR))
    for f in (directory / ADAPTER_DIR).iterdir():
        os.chmod(f, 0o600)


def write_sync_dir(model: torch.nn.Module, sync_dir: Path, weight_version: int) -> Path:
    """Write ``sync_dir/v<weight_version>/model.safetensors`` atomically; return the directory."""
    with _publishing(sync_dir, weight_version) as tmp:
        mt = model_tensors(model)
        meta = {"format": SYNC_FORMAT, "weight_version": str(weight_version), "tied": orjson.dumps(mt.tied).decode()}
        lora = lora_spec(model)
        if lora is not None:
            meta["lora"] = orjson.dumps(lora).decode()
        _save(mt.tensors, tmp / SYNC_WEIGHTS_FILE, meta)
        if lora is not None:
            _save_adapter(model, tmp)
    return sync_dir / f"v{weight_version}"


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
    shard_meta = {"format": SYNC_FORMAT, "weight_version": str(weight_version)}
    weight_map: dict[str, str] = {}
    with _publishing(sync_dir, weight_version) as tmp:
        for i, names in enumerate(plan):
            tensors = await source.gather(names)
            check_gathered(specs, names, tensors)
            fname = shard_name(i, len(plan))
            await anyio.to_thread.run_sync(_save, tensors, tmp / fname, shard_meta)
            del tensors
            weight_map.update(dict.fromkeys(names, fname))
        index = {
            "metadata": {
                "format": SYNC_FORMAT,
                "weight_version": weight_version,
                "tied": tied,
                "lora": lora,
                "total_size": sum(spec_nbytes(s) for s in specs.values()),
            },
            "weight_map": weight_map,
        }
        (tmp / SYNC_INDEX_FILE).write_bytes(orjson.dumps(index))
        os.chmod(tmp / SYNC_INDEX_FILE, 0o600)
        if lora is not None and model is not None:
            await anyio.to_thread.run_sync(_save_adapter, model, tmp)
    log.info("weights written in shards", weight_version=weight_version, shards=len(plan), tensors=len(specs))
    return sync_dir / f"v{weight_version}"


def prune_sync_dirs(sync_dir: Path, keep: Path | None) -> None:
    """Remove every version directory (and leftover temporary one) except ``keep``."""
    if not sync_dir.is_dir():
        return
    for entry in sync_dir.iterdir():
        if keep is not None and entry == keep:
            continue
        if entry.is_dir() and (entry.name.startswith("v") or entry.name.startswith(".tmp-v")):
            shutil.rmtree(entry)

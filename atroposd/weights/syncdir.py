"""Reload directories (``reload`` mode, SPEC §7), written and read here only; torch-free.

A version lives in ``{state_dir}/sync/v<weight_version>/`` (the names are
:mod:`atroposd.weights.protocol`'s):

* one file, ``model.safetensors``, whose metadata holds ``format``, ``weight_version``,
  ``tied`` (alias name → the name it shares memory with) and, for a LoRA model, ``lora``;
* or, written a bucket at a time (several trainer ranks), shards ``model-0000i-of-0000n.safetensors``
  (metadata ``format``, ``weight_version``) and ``model.safetensors.index.json`` in Hugging
  Face's layout, whose ``metadata`` carries what the one file's metadata carries plus
  ``total_size``;
* for a LoRA model also ``adapter/`` in PEFT's layout.

Writers: the trainer (:mod:`atroposd.weights.reload`: a model, or its buckets gathered from the
ranks) and an external trainer (:class:`atroposd.client.InferenceControl`: torch or numpy
arrays). Each writes into a temporary directory (:func:`publishing`) renamed to ``v<N>`` when
complete, files 0600, so a reader never sees half a version. Readers: the torch engine
(:mod:`atroposd.weights.receiver`) and the vLLM engine and its workers, through
:func:`inspect_sync_dir` (every check, before a tensor is read: format, version, shards, dtypes)
and :func:`sync_shards` / :func:`read_tensors`.

Nothing here imports torch at import time: safetensors' files are inspected through its numpy
view (headers only); only :func:`save_tensors` of torch tensors and :func:`read_tensors` load torch.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from atroposd.weights.manifest import TensorSpec
from atroposd.weights.protocol import (
    ADAPTER_DIR,
    SYNC_FORMAT,
    SYNC_INDEX_FILE,
    SYNC_WEIGHTS_FILE,
    WeightUpdateError,
    shard_name,
)

__all__ = [
    "adapter_dir",
    "file_metadata",
    "inspect_sync_dir",
    "prune_sync_dirs",
    "publishing",
    "read_tensors",
    "save_tensors",
    "sync_shards",
    "version_dir",
    "write_index",
    "write_shard",
    "write_tensors",
]


# ---------------------------------------------------------------------------- writing


def version_dir(sync_dir: Path, weight_version: int) -> Path:
    """Where version ``weight_version`` lives: ``sync_dir/v<weight_version>``."""
    return sync_dir / f"v{weight_version}"


def adapter_dir(directory: Path) -> Path:
    """Where a version's LoRA adapters lie (PEFT's layout, written by PEFT's ``save_pretrained``)."""
    return directory / ADAPTER_DIR


@contextmanager
def publishing(sync_dir: Path, weight_version: int) -> Iterator[Path]:
    """A temporary directory to write version ``weight_version`` into; its files are synced and
    it is renamed to ``sync_dir/v<weight_version>`` (replacing one there) when the block ends
    without an error, removed otherwise."""
    sync_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    final = version_dir(sync_dir, weight_version)
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


def file_metadata(
    weight_version: int, tied: Mapping[str, str] | None = None, lora: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """The metadata of the one ``model.safetensors`` of a version."""
    meta = {
        "format": SYNC_FORMAT,
        "weight_version": str(weight_version),
        "tied": orjson.dumps(dict(tied or {})).decode(),
    }
    if lora is not None:
        meta["lora"] = orjson.dumps(lora).decode()
    return meta


def save_tensors(tensors: Mapping[str, Any], file: Path, meta: Mapping[str, str]) -> None:
    """Write ``{name: tensor}`` (torch tensors, on any device, or numpy arrays) as one
    safetensors file with ``meta``; 0600."""
    first = next(iter(tensors.values()), None)
    if first is not None and type(first).__module__.startswith("torch"):
        from safetensors.torch import save_file as save_torch

        save_torch({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, str(file), metadata=dict(meta))
    else:
        import numpy as np
        from safetensors.numpy import save_file as save_numpy

        save_numpy({n: np.ascontiguousarray(t) for n, t in tensors.items()}, str(file), metadata=dict(meta))
    os.chmod(file, 0o600)


def write_tensors(
    sync_dir: Path,
    weight_version: int,
    tensors: Mapping[str, Any],
    *,
    tied: Mapping[str, str] | None = None,
    lora: Mapping[str, Any] | None = None,
    also: Callable[[Path], None] | None = None,
) -> Path:
    """Write version ``weight_version`` as the one ``model.safetensors`` (atomic); return its
    directory. ``also(directory)`` writes what else the version holds (a LoRA model's
    ``adapter/``) before it is published."""
    with publishing(sync_dir, weight_version) as tmp:
        save_tensors(tensors, tmp / SYNC_WEIGHTS_FILE, file_metadata(weight_version, tied, lora))
        if also is not None:
            also(tmp)
    return version_dir(sync_dir, weight_version)


def write_shard(directory: Path, index: int, count: int, tensors: Mapping[str, Any], weight_version: int) -> str:
    """Shard ``index`` of ``count`` of a version being written into ``directory``; returns its
    file name (the index maps each of its tensors to it)."""
    fname = shard_name(index, count)
    save_tensors(tensors, directory / fname, {"format": SYNC_FORMAT, "weight_version": str(weight_version)})
    return fname


def write_index(
    directory: Path,
    weight_version: int,
    weight_map: Mapping[str, str],
    *,
    tied: Mapping[str, str],
    lora: Mapping[str, Any] | None,
    total_size: int,
) -> None:
    """The index of a version written in shards (``weight_map``: tensor name → shard file name)."""
    index = {
        "metadata": {
            "format": SYNC_FORMAT,
            "weight_version": weight_version,
            "tied": dict(tied),
            "lora": lora,
            "total_size": total_size,
        },
        "weight_map": dict(weight_map),
    }
    (directory / SYNC_INDEX_FILE).write_bytes(orjson.dumps(index))
    os.chmod(directory / SYNC_INDEX_FILE, 0o600)


def prune_sync_dirs(sync_dir: Path, keep: Path | None) -> None:
    """Remove every version directory (and leftover temporary one) except ``keep``."""
    if not sync_dir.is_dir():
        return
    for entry in sync_dir.iterdir():
        if keep is not None and entry == keep:
            continue
        if entry.is_dir() and (entry.name.startswith("v") or entry.name.startswith(".tmp-v")):
            shutil.rmtree(entry)


# ---------------------------------------------------------------------------- reading


def inspect_sync_dir(
    path: str | os.PathLike[str], weight_version: int | None, within: str | os.PathLike[str] | None = None
) -> tuple[Path, int, dict[str, TensorSpec], dict[str, str], dict[str, Any] | None]:
    """Check a reload directory without loading tensors.

    Returns (file, weight_version, exported tensor specs, tied aliases, LoRA spec or None);
    ``file`` is ``model.safetensors``, or ``model.safetensors.index.json`` for a directory
    written in shards (:func:`sync_shards` lists them). With ``within``, the directory must lie
    inside that directory; its ``weight_version`` must equal ``weight_version`` when that is
    given. A directory that fails a check raises :class:`WeightUpdateError`.
    """
    directory = Path(path)
    if within is not None:
        real = Path(os.path.realpath(directory))
        root = Path(os.path.realpath(within))
        if root not in real.parents:
            raise WeightUpdateError(f"{directory} is not inside the sync directory {within}")
    file, index = directory / SYNC_WEIGHTS_FILE, directory / SYNC_INDEX_FILE
    if index.is_file():
        if file.exists():
            raise WeightUpdateError(
                f"{directory} holds both {SYNC_WEIGHTS_FILE} and {SYNC_INDEX_FILE}: which one "
                "holds the weights is ambiguous"
            )
        return _inspect_index(index, weight_version)
    if not file.is_file():
        raise WeightUpdateError(f"{file} does not exist")
    meta, exported = _inspect_file(file)
    try:
        version = int(meta["weight_version"])
        tied = orjson.loads(meta.get("tied", "{}"))
        lora = orjson.loads(meta["lora"]) if meta.get("lora") else None
    except (KeyError, ValueError, orjson.JSONDecodeError) as exc:
        raise WeightUpdateError(f"{file}: bad metadata ({exc!r})") from None
    _check_version(file, version, weight_version)
    return file, version, exported, tied, lora


def sync_shards(file: Path) -> dict[Path, list[str]]:
    """The safetensors files of a sync directory and the tensors each holds: ``file`` itself
    (every tensor it holds) or, for an index, its shards in order."""
    if file.name != SYNC_INDEX_FILE:
        from safetensors import safe_open

        with safe_open(str(file), framework="numpy", device="cpu") as f:
            return {file: list(f.keys())}
    _meta, weight_map = _read_index(file)
    shards: dict[Path, list[str]] = {}
    for name, fname in weight_map.items():
        shards.setdefault(file.parent / fname, []).append(name)
    return dict(sorted(shards.items()))


def read_tensors(file: Path, wanted: Collection[str] | None = None) -> Iterator[tuple[str, Any]]:
    """The tensors of a checked version (``file`` from :func:`inspect_sync_dir`) as torch
    tensors on the CPU, one at a time, shard by shard; only those in ``wanted`` when given."""
    from safetensors import safe_open

    for shard, names in sync_shards(file).items():
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for name in names:
                if wanted is None or name in wanted:
                    yield name, f.get_tensor(name)


def _check_version(file: Path, version: int, wanted: int | None) -> None:
    if wanted is not None and version != wanted:
        raise WeightUpdateError(
            f"{file} holds weight_version {version}, the request says {wanted}: stale weights refused"
        )


def _inspect_file(file: Path) -> tuple[dict[str, str], dict[str, TensorSpec]]:
    """One safetensors file of a sync directory: its metadata (format checked) and tensor specs."""
    from safetensors import safe_open

    try:
        handle = safe_open(str(file), framework="numpy", device="cpu")
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise WeightUpdateError(f"cannot read {file}: {exc}") from None
    with handle as f:
        meta = f.metadata() or {}
        if meta.get("format") != SYNC_FORMAT:
            raise WeightUpdateError(f"{file} is not an atroposd sync file (format {meta.get('format')!r})")
        exported: dict[str, TensorSpec] = {}
        for key in f.keys():
            sl = f.get_slice(key)
            exported[key] = TensorSpec(_st_dtype(sl.get_dtype(), key), tuple(sl.get_shape()))
    return meta, exported


def _read_index(index: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The index's metadata and weight map (tensor → shard file name), checked for shape."""
    try:
        data = orjson.loads(index.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise WeightUpdateError(f"cannot read {index}: {exc}") from None
    meta = data.get("metadata") if isinstance(data, dict) else None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(meta, dict) or not isinstance(weight_map, dict):
        raise WeightUpdateError(f"{index} must be an object with 'metadata' and 'weight_map'")
    if meta.get("format") != SYNC_FORMAT:
        raise WeightUpdateError(f"{index} is not an atroposd sync index (format {meta.get('format')!r})")
    for name, fname in weight_map.items():
        if not isinstance(fname, str) or "/" in fname or fname in ("", ".", "..") or not fname.endswith(".safetensors"):
            raise WeightUpdateError(f"{index}: tensor {name!r} maps to {fname!r}, not a shard file of the directory")
    return meta, weight_map


def _inspect_index(
    index: Path, weight_version: int | None
) -> tuple[Path, int, dict[str, TensorSpec], dict[str, str], dict[str, Any] | None]:
    meta, _ = _read_index(index)
    version, tied, lora = meta.get("weight_version"), meta.get("tied", {}), meta.get("lora")
    if isinstance(version, bool) or not isinstance(version, int):
        raise WeightUpdateError(f"{index}: weight_version must be an integer, got {version!r}")
    if not isinstance(tied, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
        raise WeightUpdateError(f"{index}: 'tied' must map tensor names to tensor names")
    if lora is not None and not isinstance(lora, dict):
        raise WeightUpdateError(f"{index}: 'lora' must be an object or null")
    _check_version(index, version, weight_version)
    exported: dict[str, TensorSpec] = {}
    for shard, names in sync_shards(index).items():
        if not shard.is_file():
            raise WeightUpdateError(f"{shard}, listed in {index.name}, does not exist")
        meta_s, specs = _inspect_file(shard)
        if meta_s.get("weight_version") != str(version):
            raise WeightUpdateError(
                f"{shard} holds weight_version {meta_s.get('weight_version')}, its index "
                f"{version}: a shard of another sync"
            )
        if set(specs) != set(names):
            raise WeightUpdateError(f"{shard} holds {sorted(specs)}; {index.name} lists {sorted(names)}")
        exported.update(specs)
    return index, version, exported, tied, lora


def _st_dtype(name: str, key: str) -> str:
    mapping = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    if name not in mapping:
        raise WeightUpdateError(f"tensor {key!r}: dtype {name} is not allowed (allowed: float32, bfloat16, float16)")
    return mapping[name]

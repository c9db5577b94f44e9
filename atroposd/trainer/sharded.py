"""Checkpoints of several trainer ranks (SPEC §12.1): the model gathered in Hugging Face layout,
the optimizer state sharded through torch.distributed.checkpoint (DCP).

``step-N/`` keeps the one-rank layout (``model.safetensors``, config, tokenizer,
``trainer_state.pt``, ``checksums.json``) — the gathered weights are written by rank 0 — plus
``optimizer/``: every rank's optimizer shard and DCP's metadata. ``trainer_state.pt`` then
holds ``"optimizer": None``, ``"ranks": N`` and ``"optimizer_dcp": "optimizer"``. The directory
is renamed complete by rank 0 after every rank finished writing (DCP's save ends with a
collective), so a complete ``step-N`` always holds every shard.

Loading reads nothing unverified (SPEC §12.1): a checkpoint with ``optimizer/`` must carry
``checksums.json`` covering every file under it (:func:`check_verified`); the optimizer's
directory is always ``optimizer`` (a checkpoint naming another is refused, never followed);
DCP's pickled ``.metadata`` goes through an allow-list unpickler (DCP's own metadata classes,
torch sizes and dtypes, nothing that runs code) and names only shard files of its directory;
the non-tensor values in the shards (the optimizer's hyper-parameters) load with
``weights_only``, where DCP's own planner would unpickle anything.

Resume with any rank count: the weights are loaded in full before sharding; the optimizer state
comes from DCP (resharded by it to the new rank count, or gathered into one process without a
process group) or, from a one-rank checkpoint, from its index-keyed state dict turned into
parameter names.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from atroposd.logs import get_logger

__all__ = ["OPTIMIZER_DIR", "check_optimizer_path", "check_shards", "check_verified", "gathered_weights",
           "load_optimizer", "read_metadata", "save_optimizer", "tied_aliases"]

log = get_logger(__name__)

OPTIMIZER_DIR = "optimizer"


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """Names of the state dict that alias an earlier tensor (a tied ``lm_head.weight``): dropped
    from the written weights as Hugging Face does. Call before sharding."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    aliases: set[str] = set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:
            aliases.add(name)
        seen.add(key)
    return aliases


def gathered_weights(model: torch.nn.Module, aliases: set[str]) -> dict[str, torch.Tensor]:
    """Every rank calls this (collectives); rank 0 gets the full weights on the CPU, the others {}."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.contiguous() for k, v in full.items() if k not in aliases and isinstance(v, torch.Tensor)}


def save_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Every rank writes its optimizer shard under ``path`` (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optimizer)
    dcp.save({"optimizer": osd}, checkpoint_id=str(path))


def check_shards(path: Path, world: int) -> None:
    """Raise CheckpointError unless ``path`` holds DCP's metadata and one shard file of every
    rank (``__<rank>_0.distcp``): with several machines a ``checkpoint_dir`` that is not shared
    leaves the other nodes' shards on their own disks."""
    from atroposd.trainer.ckptfiles import CheckpointError

    expected = [".metadata", *(f"__{r}_0.distcp" for r in range(world))]
    missing = [name for name in expected if not (path / name).is_file()]
    if missing:
        shown = ", ".join(str(path / name) for name in missing[:4]) + (" ..." if len(missing) > 4 else "")
        raise CheckpointError(f"the checkpoint misses {len(missing)} of its {world} ranks' files: {shown}; "
                              "trainer.checkpoint_dir must be a directory every node sees (a shared file system)")


def check_optimizer_path(path: Path, state: dict[str, Any]) -> None:
    """The trainer state of a sharded checkpoint names its optimizer's directory: it must be
    ``optimizer`` (the one place a checkpoint keeps it), never a path read and followed."""
    from atroposd.trainer.ckptfiles import CheckpointError

    named = state.get("optimizer_dcp")
    if named is not None and named != OPTIMIZER_DIR:
        raise CheckpointError(f"checkpoint {path}: its trainer state names the optimizer directory {named!r}; "
                              f"a checkpoint keeps it in {OPTIMIZER_DIR!r} (refused, not followed)")


def check_verified(path: Path, table: dict[str, Any] | None) -> None:
    """A sharded checkpoint (``optimizer/`` present) loads only with checksums that cover every
    file DCP will read: raises CheckpointError without ``checksums.json`` or with a file under
    ``optimizer/`` that it does not list."""
    from atroposd.trainer.ckptfiles import CHECKSUM_FILE, CheckpointError

    opt = path / OPTIMIZER_DIR
    if not opt.exists() and not opt.is_symlink():
        return
    if table is None:
        raise CheckpointError(f"checkpoint {path}: a sharded checkpoint without {CHECKSUM_FILE} is not loaded "
                              "(its optimizer shards and metadata cannot be verified)")
    if opt.is_symlink() or not opt.is_dir():
        raise CheckpointError(f"checkpoint {path}: {OPTIMIZER_DIR} is not a directory of the checkpoint")
    unlisted = sorted(str(p.relative_to(path)) for p in opt.rglob("*")
                      if (p.is_file() or p.is_symlink()) and str(p.relative_to(path)) not in table)
    if unlisted:
        raise CheckpointError(f"checkpoint {path}: files its {CHECKSUM_FILE} does not cover: "
                              f"{', '.join(unlisted[:4])}")
    try:
        data = (opt / ".metadata").read_bytes()
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read its optimizer metadata: {exc.strerror or exc}") from exc
    try:
        read_metadata(data)
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from None


# DCP's metadata, as torch.distributed.checkpoint pickles it: these globals and no others.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
     ("collections", "OrderedDict")}
_SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def read_metadata(data: bytes) -> Any:
    """DCP's ``.metadata`` through the allow-list; its storage entries must name shard files of
    the same directory (``__<rank>_<n>.distcp``) at non-negative offsets. Raises CheckpointError."""
    from torch.distributed.checkpoint.metadata import Metadata

    from atroposd.trainer.ckptfiles import CheckpointError

    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # UnpicklingError, and whatever a crafted stream raises
        raise CheckpointError(f"optimizer metadata refused: {type(exc).__name__}: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"optimizer metadata refused: a {type(metadata).__name__}, not DCP's Metadata")
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(rel, str) or not _SHARD_FILE.fullmatch(rel):
            raise CheckpointError(f"optimizer metadata refused: it names the file {rel!r}, not a shard of its directory")
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            raise CheckpointError(f"optimizer metadata refused: a shard range {offset!r}+{length!r}")
    return metadata


def _reader(path: Path) -> Any:
    """DCP's file-system reader with :func:`read_metadata` in place of its ``pickle.load``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class VerifiedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{int(rank)}.metadata"
            metadata = read_metadata((path / name).read_bytes())
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return VerifiedReader(str(path))


def _planner() -> Any:
    """DCP's default load planner, its non-tensor values loaded with ``weights_only``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return WeightsOnlyPlanner()


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                   checkpoint: Path, *, world: int) -> None:
    """Restore the optimizer of a (sharded or not) model from either checkpoint layout."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from atroposd.trainer.ckptfiles import CheckpointError

    saved_ranks = int(state.get("ranks", 1))
    if state.get("optimizer_dcp"):
        import torch.distributed.checkpoint as dcp

        check_optimizer_path(checkpoint, state)
        directory = checkpoint / OPTIMIZER_DIR  # fixed: never a path the checkpoint names
        osd = get_optimizer_state_dict(model, optimizer)
        box = {"optimizer": osd}
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            dcp.load(box, storage_reader=_reader(directory), planner=_planner(), no_dist=world == 1)
        except (Exception, CheckpointException) as exc:  # DCP wraps what its reader and planner raise
            raise CheckpointError(f"cannot load the optimizer shards of {checkpoint}: {type(exc).__name__}: "
                                  f"{_first_line(exc)}") from exc
        set_optimizer_state_dict(model, optimizer, optim_state_dict=box["optimizer"])
    elif world == 1:
        optimizer.load_state_dict(state["optimizer"])
    else:
        full = _named_optimizer_state(model, optimizer, state["optimizer"])
        set_optimizer_state_dict(model, optimizer, optim_state_dict=full,
                                 options=StateDictOptions(full_state_dict=True))
    if saved_ranks != world:
        log.info("optimizer state resharded", checkpoint=str(checkpoint), saved_ranks=saved_ranks, ranks=world)


def _first_line(exc: BaseException) -> str:
    """What DCP's wrapped error says, without its tracebacks: the refusal's own message when one
    is in it."""
    text = str(exc)
    for marker in ("refused", "Weights only load failed", "Unsupported global"):
        at = text.find(marker)
        if at >= 0:
            return text[max(0, text.rfind("\n", 0, at) + 1):].split("\n", 1)[0][:400]
    return text.strip().splitlines()[-1][:400] if text.strip() else type(exc).__name__


def _named_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                           indexed: dict[str, Any]) -> dict[str, Any]:
    """A one-rank optimizer state dict (keyed by parameter index, in the optimizer's order) keyed
    by parameter name instead, as torch.distributed.checkpoint's full state dicts are."""
    names = {id(p): n for n, p in model.named_parameters()}
    ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    groups = []
    for g in indexed["param_groups"]:
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": [ordered[i] for i in g["params"]]})
    state = {ordered[int(i)]: dict(v) for i, v in indexed["state"].items()}
    return {"state": state, "param_groups": groups}

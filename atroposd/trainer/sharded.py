"""Checkpoints of several trainer ranks (SPEC §12.1): every rank writes its own shards of the model
and of the optimizer through torch.distributed.checkpoint (DCP); nothing is gathered into one
process.

``step-N/`` (format 2) holds ``model/`` — safetensors files, each rank's own, written by DCP's
Hugging Face storage writer (:mod:`.hfshards` reads them) —, ``optimizer/`` (every rank's optimizer shard
and DCP's metadata), the model's config, the tokenizer, ``trainer_state.pt`` (``"optimizer":
None``, ``"ranks": N``, ``"optimizer_dcp": "optimizer"``, ``"model_dcp": "model"``,
``"model_shapes"``: each model tensor's full shape, which the shards must make exactly) and
``checksums.json``; at the last step also ``model.safetensors``, consolidated from the shards one
tensor at a time, so that the directory is a Hugging Face model (``atroposd export`` writes the
same for any checkpoint). Format 1 (written before) held the weights gathered into
``model.safetensors`` instead of ``model/``; it still resumes.

Every rank writes from its live shards, not a copy, on a background thread when the checkpoint
is a periodic one: only an optimizer step changes them, and the next one waits until they are
written (the checkpointer's fence), so training's forward and backward go on meanwhile. The
model's tensors are split into parts (``file_index``: about 64 of them, each at least 64 MiB of
full tensors), a file per rank and part: DCP's writer holds about twice one file's bytes. The writes' collectives run
on the group's own checkpoint
process group (gloo), never on the one training uses. The directory is renamed complete by rank 0
after every rank finished writing (DCP's save ends with a collective), so a complete ``step-N``
always holds every shard.

Loading reads nothing unverified (SPEC §12.1): a checkpoint with ``optimizer/`` or ``model/``
must carry ``checksums.json`` covering every file under them (:func:`check_verified`); those
directories are always ``optimizer`` and ``model`` (a checkpoint naming another is refused, never
followed); DCP's pickled ``.metadata`` goes through an allow-list unpickler (DCP's own metadata
classes, torch sizes and dtypes, nothing that runs code) and names only shard files of its
directory; the non-tensor values in the shards (the optimizer's hyper-parameters) load with
``weights_only``, where DCP's own planner would unpickle anything. The model shards are
safetensors: their headers are JSON.

Resume with any rank count: the weights are loaded in full before sharding; the optimizer state
comes from DCP (resharded by it to the new rank count, or gathered into one process without a
process group) or, from a one-rank checkpoint, from its index-keyed state dict turned into
parameter names.
"""

from __future__ import annotations

import io
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from atroposd.logs import get_logger

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import ReadItem

__all__ = [
    "MODEL_DIR",
    "OPTIMIZER_DIR",
    "Staged",
    "check_model_shards",
    "check_optimizer_path",
    "check_shards",
    "check_verified",
    "file_index",
    "load_model_shards",
    "load_optimizer",
    "model_shapes",
    "read_metadata",
    "save_optimizer",
    "stage",
    "tied_aliases",
    "write_shards",
]

log = get_logger(__name__)

OPTIMIZER_DIR = "optimizer"
MODEL_DIR = "model"


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


@dataclass
class Staged:
    """One rank's shards of a checkpoint (its live tensors): what :func:`write_shards` writes."""

    model: dict[str, Any]
    optimizer: dict[str, Any]


# The model's tensors go into parts of about MODEL_PARTS equal sizes, each at least
# MODEL_FILE_BYTES of full tensors (a rank's file of a part holds its shard of them): DCP's
# safetensors writer holds about twice one file's bytes while it writes it.
MODEL_FILE_BYTES = 64 << 20
MODEL_PARTS = 64


def stage(model: torch.nn.Module, optimizer: torch.optim.Optimizer, aliases: set[str]) -> Staged:
    """Every rank, between two steps: its shards of the model (tied aliases left out, as Hugging
    Face does) and of the optimizer — the live tensors, not a copy (the next optimizer step waits
    until they are written: the checkpointer's fence). No collective."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    msd = {k: v for k, v in get_model_state_dict(model).items() if k not in aliases}
    return Staged(model=msd, optimizer=get_optimizer_state_dict(model, optimizer))


def file_index(model: dict[str, Any], limit: int | None = None) -> dict[str, int]:
    """Each tensor's model file (1, 2, ...): in state-dict order, a new file once the full
    tensors of the current one reach ``limit`` bytes (default: the larger of MODEL_FILE_BYTES
    and a MODEL_PARTS-th of the model). The same on every rank (full shapes)."""
    if limit is None:
        total = sum(t.numel() * t.element_size() for t in model.values())
        limit = max(MODEL_FILE_BYTES, total // MODEL_PARTS)
    out: dict[str, int] = {}
    index, size = 1, 0
    for name, t in model.items():
        n = t.numel() * t.element_size()  # a DTensor's numel is the full tensor's
        if size and size + n > limit:
            index, size = index + 1, 0
        out[name] = index
        size += n
    return out


def write_shards(staged: Staged, path: Path, group: dist.ProcessGroup | None = None) -> None:
    """Every rank (collectives on ``group``): the model's shards as safetensors under
    ``path/model`` (DCP's Hugging Face storage writer, one file per rank and part of the model)
    and the optimizer's under ``path/optimizer``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    writer = HuggingFaceStorageWriter(
        str(path / MODEL_DIR), fqn_to_index_mapping=file_index(staged.model), save_distributed=True
    )
    dcp.save(staged.model, storage_writer=writer, process_group=group)
    dcp.save({"optimizer": staged.optimizer}, checkpoint_id=str(path / OPTIMIZER_DIR), process_group=group)


def save_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """The optimizer's shards under ``path`` (DCP), at once."""
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
        raise CheckpointError(
            f"the checkpoint misses {len(missing)} of its {world} ranks' files: {shown}; "
            "trainer.checkpoint_dir must be a directory every node sees (a shared file system)"
        )


def check_optimizer_path(path: Path, state: dict[str, Any]) -> None:
    """The trainer state of a sharded checkpoint names its optimizer's and its model's directory:
    they must be ``optimizer`` and ``model`` (the one place a checkpoint keeps each), never a path
    read and followed."""
    from atroposd.trainer.ckptfiles import CheckpointError

    for key, fixed, what in (("optimizer_dcp", OPTIMIZER_DIR, "optimizer"), ("model_dcp", MODEL_DIR, "model")):
        named = state.get(key)
        if named is not None and named != fixed:
            raise CheckpointError(
                f"checkpoint {path}: its trainer state names the {what} directory {named!r}; "
                f"a checkpoint keeps it in {fixed!r} (refused, not followed)"
            )


def check_verified(path: Path, table: dict[str, Any] | None) -> None:
    """A sharded checkpoint (``optimizer/`` or ``model/`` present) loads only with checksums that
    cover every file that will be read: raises CheckpointError without ``checksums.json`` or with
    a file under those directories that it does not list."""
    from atroposd.trainer.ckptfiles import CHECKSUM_FILE, CheckpointError

    present = [d for d in (OPTIMIZER_DIR, MODEL_DIR) if (path / d).exists() or (path / d).is_symlink()]
    if not present:
        return
    if table is None:
        raise CheckpointError(
            f"checkpoint {path}: a sharded checkpoint without {CHECKSUM_FILE} is not loaded "
            "(its shards and metadata cannot be verified)"
        )
    for name in present:
        d = path / name
        if d.is_symlink() or not d.is_dir():
            raise CheckpointError(f"checkpoint {path}: {name} is not a directory of the checkpoint")
        unlisted = sorted(
            str(p.relative_to(path))
            for p in d.rglob("*")
            if (p.is_file() or p.is_symlink()) and str(p.relative_to(path)) not in table
        )
        if unlisted:
            raise CheckpointError(
                f"checkpoint {path}: files its {CHECKSUM_FILE} does not cover: {', '.join(unlisted[:4])}"
            )
    if OPTIMIZER_DIR not in present:
        return
    opt = path / OPTIMIZER_DIR
    try:
        data = (opt / ".metadata").read_bytes()
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read its optimizer metadata: {exc.strerror or exc}") from exc
    try:
        read_metadata(data)
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from None


def model_shapes(staged: Staged) -> dict[str, list[int]]:
    """The full shape of every model tensor a checkpoint's shards hold (kept in its trainer state)."""
    return {k: list(v.shape) for k, v in staged.model.items()}


def check_model_shards(path: Path, world: int, shapes: dict[str, list[int]] | None = None) -> None:
    """Raise CheckpointError unless ``path`` holds the model shard of every rank and they cover
    every tensor (with several machines, a ``checkpoint_dir`` that is not shared leaves the other
    nodes' shards on their own disks)."""
    from atroposd.trainer.ckptfiles import CheckpointError
    from atroposd.trainer.hfshards import ShardError, read_layout

    try:
        read_layout(path, world=world, shapes=shapes)
    except ShardError as exc:
        raise CheckpointError(
            f"the checkpoint's model shards are incomplete: {exc}; trainer.checkpoint_dir must "
            "be a directory every node sees (a shared file system)"
        ) from exc


def load_model_shards(path: Path, shapes: dict[str, list[int]] | None = None) -> dict[str, torch.Tensor]:
    """The full weights from the model shards under ``path`` (safetensors headers are JSON),
    each of its recorded full shape."""
    from atroposd.trainer.ckptfiles import CheckpointError
    from atroposd.trainer.hfshards import ShardError, load_full

    try:
        return load_full(path, shapes=shapes)
    except ShardError as exc:
        raise CheckpointError(f"cannot read the model shards of {path.parent}: {exc}") from exc


# DCP's metadata, as torch.distributed.checkpoint pickles it: these globals and no others.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}
_SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def read_metadata(data: bytes) -> Metadata:
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
            raise CheckpointError(
                f"optimizer metadata refused: it names the file {rel!r}, not a shard of its directory"
            )
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
            raise CheckpointError(f"optimizer metadata refused: a shard range {offset!r}+{length!r}")
    return metadata


def _reader(path: Path) -> FileSystemReader:
    """DCP's file-system reader with :func:`read_metadata` in place of its ``pickle.load``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class VerifiedReader(FileSystemReader):
        def read_metadata(self, *args: object, rank: int | None = None, **kwargs: object) -> Metadata:
            name = ".metadata" if rank is None else f"__{int(rank)}.metadata"
            metadata = read_metadata((path / name).read_bytes())
            storage_meta = getattr(metadata, "storage_meta", None)
            if storage_meta is None:
                storage_meta = metadata.storage_meta = StorageMeta()
            storage_meta.load_id = self.load_id
            return metadata

    return VerifiedReader(str(path))


def _planner() -> DefaultLoadPlanner:
    """DCP's default load planner, its non-tensor values loaded with ``weights_only``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return WeightsOnlyPlanner()


def load_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], checkpoint: Path, *, world: int
) -> None:
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
            raise CheckpointError(
                f"cannot load the optimizer shards of {checkpoint}: {type(exc).__name__}: {_first_line(exc)}"
            ) from exc
        set_optimizer_state_dict(model, optimizer, optim_state_dict=box["optimizer"])
    elif world == 1:
        optimizer.load_state_dict(state["optimizer"])
    else:
        full = _named_optimizer_state(model, optimizer, state["optimizer"])
        set_optimizer_state_dict(
            model, optimizer, optim_state_dict=full, options=StateDictOptions(full_state_dict=True)
        )
    if saved_ranks != world:
        log.info("optimizer state resharded", checkpoint=str(checkpoint), saved_ranks=saved_ranks, ranks=world)


def _first_line(exc: BaseException) -> str:
    """What DCP's wrapped error says, without its tracebacks: the refusal's own message when one
    is in it."""
    text = str(exc)
    for marker in ("refused", "Weights only load failed", "Unsupported global"):
        at = text.find(marker)
        if at >= 0:
            return text[max(0, text.rfind("\n", 0, at) + 1) :].split("\n", 1)[0][:400]
    return text.strip().splitlines()[-1][:400] if text.strip() else type(exc).__name__


def _named_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, indexed: dict[str, Any]
) -> dict[str, Any]:
    """A one-rank optimizer state dict (keyed by parameter index, in the optimizer's order) keyed
    by parameter name instead, as torch.distributed.checkpoint's full state dicts are."""
    names = {id(p): n for n, p in model.named_parameters()}
    ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    groups = []
    for g in indexed["param_groups"]:
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [ordered[i] for i in g["params"]]})
    state = {ordered[int(i)]: dict(v) for i, v in indexed["state"].items()}
    return {"state": state, "param_groups": groups}

"""The model shards of a checkpoint of several ranks (SPEC §12.1), as torch.distributed.checkpoint's
Hugging Face storage writer leaves them: safetensors files
``shard-<rank+1>-model-<k>-of-<n>.safetensors`` — rank r's pieces of the tensors of the model's
part k of n —, with each piece's place in the full tensor in the file's own metadata
(``DCP_SHARDING_INFO``: ``{name: {"saved_offsets": [...]}}``).

Read here without DCP and without unpickling anything: a safetensors header is JSON. Every piece is
checked (a known dtype, offsets and shape inside the full tensor, bytes inside the file) and the
pieces of a tensor must cover it exactly (their sizes add up to the whole). Two uses:

* :func:`load_full` — the full tensors, for a resume with any rank count (the weights are loaded in
  full before sharding, as from a one-rank checkpoint);
* :func:`consolidate` — one ``model.safetensors`` in Hugging Face layout (the one file that
  ``transformers`` loads), written one tensor at a time: never the whole model in memory.

A leaf: imports torch only.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__ = ["SHARD_RE", "ShardError", "Tensors", "consolidate", "load_full", "read_layout", "shard_name"]

SHARD_RE = re.compile(r"shard-(\d{5})-model-(\d{5})-of-(\d{5})\.safetensors")
SHARDING_KEY = "DCP_SHARDING_INFO"
MAX_HEADER = 100 << 20  # safetensors' own limit on a header
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class ShardError(ValueError):
    """The shards are damaged or not the writer's (a clear message naming the file)."""


def shard_name(rank: int, part: int = 1, parts: int = 1) -> str:
    """The file of rank ``rank`` for the model's part ``part`` of ``parts`` (DCP numbers its
    plans from 1)."""
    return f"shard-{rank + 1:05d}-model-{part:05d}-of-{parts:05d}.safetensors"


@dataclass
class _Piece:
    file: Path
    start: int  # absolute byte offset in the file
    shape: list[int]
    offsets: list[int]


@dataclass
class Tensors:
    """Every tensor of the shards: its dtype, full shape and pieces (in file order)."""

    dtype: dict[str, torch.dtype] = field(default_factory=dict)
    shape: dict[str, list[int]] = field(default_factory=dict)
    pieces: dict[str, list[_Piece]] = field(default_factory=dict)

    def nbytes(self, name: str) -> int:
        return math.prod(self.shape[name]) * torch.empty((), dtype=self.dtype[name]).element_size()


def _header(file: Path) -> tuple[dict[str, Any], int]:
    try:
        with open(file, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise ShardError(f"{file.name}: not a safetensors file (shorter than its header size)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise ShardError(f"{file.name}: a header of {n} bytes")
            raw = fh.read(n)
    except OSError as exc:
        raise ShardError(f"{file.name}: cannot read: {exc.strerror or exc}") from exc
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise ShardError(f"{file.name}: its header is not JSON") from exc
    if not isinstance(header, dict):
        raise ShardError(f"{file.name}: its header is not an object")
    return header, 8 + n


def _ints(value: object, what: str, file: Path) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ShardError(f"{file.name}: {what} must be a list of counts")
    return list(value)


def read_layout(directory: Path, *, world: int | None = None, shapes: dict[str, list[int]] | None = None) -> Tensors:
    """The tensors of every shard file in ``directory``, checked (raises :class:`ShardError`).

    ``world``: the shard file of each of that many ranks must be there. ``shapes``: the full
    tensors the shards must make, exactly (the writer records them; without them a missing last
    piece of a tensor would look like a shorter tensor). Any other file in the directory is
    refused: a shard directory holds the writer's files only."""
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        raise ShardError(f"cannot list the model shards in {directory}: {exc.strerror or exc}") from exc
    strangers = [n for n in names if not SHARD_RE.fullmatch(n)]
    if strangers:
        raise ShardError(f"{directory}: not a model shard: {', '.join(strangers[:4])}")
    if not names:
        raise ShardError(f"{directory}: no model shards")
    if world is not None:
        have = {int(m.group(1)) - 1 for m in map(SHARD_RE.fullmatch, names) if m}
        missing = [r for r in range(world) if r not in have]
        if missing:
            raise ShardError(
                f"{directory}: misses the model shards of {len(missing)} of {world} ranks: "
                f"{', '.join(f'shard-{r + 1:05d}-model-*' for r in missing[:4])}"
            )
    out = Tensors()
    ends: dict[str, list[int]] = {}
    for name in names:
        file = directory / name
        header, data_start = _header(file)
        size = file.stat().st_size
        meta = header.pop("__metadata__", None) or {}
        try:
            sharding = json.loads(meta.get(SHARDING_KEY, "{}")) if isinstance(meta, dict) else None
        except ValueError:
            sharding = None
        if not isinstance(sharding, dict):
            raise ShardError(f"{file.name}: no readable {SHARDING_KEY} in its metadata")
        for tname, info in header.items():
            if not isinstance(info, dict) or info.get("dtype") not in _DTYPES:
                raise ShardError(f"{file.name}: tensor {tname!r} has no known dtype")
            dtype = _DTYPES[info["dtype"]]
            shape = _ints(info.get("shape"), f"{tname}'s shape", file)
            span = _ints(info.get("data_offsets"), f"{tname}'s data offsets", file)
            if len(span) != 2:
                raise ShardError(f"{file.name}: {tname}'s data offsets must be two")
            begin, end = span
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if end - begin != nbytes or data_start + end > size:
                raise ShardError(f"{file.name}: {tname}'s bytes do not match its shape or lie past the file's end")
            entry = sharding.get(tname)
            offsets = _ints(
                entry.get("saved_offsets") if isinstance(entry, dict) else None, f"{tname}'s saved offsets", file
            )
            if len(offsets) != len(shape):
                raise ShardError(f"{file.name}: {tname}'s offsets and shape differ in rank")
            if tname in out.dtype and (out.dtype[tname] != dtype or len(ends[tname]) != len(shape)):
                raise ShardError(f"{file.name}: {tname}'s pieces disagree in dtype or rank")
            out.dtype[tname] = dtype
            ends[tname] = [
                max(a, o + s) for a, o, s in zip(ends.get(tname, [0] * len(shape)), offsets, shape, strict=True)
            ]
            out.pieces.setdefault(tname, []).append(_Piece(file, data_start + begin, shape, offsets))
    if shapes is not None:
        if set(shapes) != set(out.pieces):
            odd = sorted(set(shapes) ^ set(out.pieces))
            raise ShardError(f"{directory}: the shards' tensors are not the model's: {', '.join(odd[:4])}")
        for tname, shape in shapes.items():
            if list(shape) != ends[tname]:
                raise ShardError(f"{directory}: the pieces of {tname} make {ends[tname]}, not its shape {list(shape)}")
    for tname, pieces in out.pieces.items():
        out.shape[tname] = ends[tname]
        covered = sum(math.prod(p.shape) for p in pieces)
        if covered != math.prod(ends[tname]):
            raise ShardError(
                f"{directory}: the pieces of {tname} do not cover it exactly "
                f"({covered} of {math.prod(ends[tname])} elements)"
            )
    return out


def _assemble(layout: Tensors, name: str, handles: dict[Path, BinaryIO]) -> torch.Tensor:
    """The full tensor ``name``, from its pieces."""
    dtype, shape = layout.dtype[name], layout.shape[name]
    full = torch.empty(shape, dtype=dtype)
    size = torch.empty((), dtype=dtype).element_size()
    for p in layout.pieces[name]:
        n = math.prod(p.shape) * size
        fh = handles[p.file]
        fh.seek(p.start)
        raw = bytearray(fh.read(n))
        if len(raw) != n:
            raise ShardError(f"{p.file.name}: {name}'s bytes end early")
        piece = torch.frombuffer(raw, dtype=dtype).reshape(p.shape) if n else torch.empty(p.shape, dtype=dtype)
        index = tuple(slice(o, o + s) for o, s in zip(p.offsets, p.shape, strict=True))
        full[index] = piece
    return full


def _open_all(layout: Tensors) -> dict[Path, BinaryIO]:
    files = sorted({p.file for ps in layout.pieces.values() for p in ps})
    return {f: open(f, "rb") for f in files}


def load_full(
    directory: Path, *, world: int | None = None, shapes: dict[str, list[int]] | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the shards in full (CPU)."""
    layout = read_layout(directory, world=world, shapes=shapes)
    handles = _open_all(layout)
    try:
        return {name: _assemble(layout, name, handles) for name in sorted(layout.pieces)}
    finally:
        for fh in handles.values():
            fh.close()


def consolidate(
    directory: Path, out: Path, *, world: int | None = None, shapes: dict[str, list[int]] | None = None
) -> int:
    """Write the shards as one safetensors file ``out`` (Hugging Face layout, metadata
    ``format = pt``), one tensor in memory at a time; returns the tensors written."""
    layout = read_layout(directory, world=world, shapes=shapes)
    names = sorted(layout.pieces)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        n = layout.nbytes(name)
        header[name] = {
            "dtype": _NAMES[layout.dtype[name]],
            "shape": layout.shape[name],
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    handles = _open_all(layout)
    try:
        with open(out, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)))
            fh.write(raw)
            for name in names:
                tensor = _assemble(layout, name, handles)
                fh.write(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
                del tensor
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        for h in handles.values():
            h.close()
    return len(names)

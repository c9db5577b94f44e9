"""Binary batches (SPEC §5): a batch as one safetensors file, written with numpy alone.

The layout, for a batch of ``S`` sequences padded to ``L`` positions:

  ``tokens``              int64   [S, L]     right-padded with 0
  ``masks``               int64   [S, L]     padded with -100
  ``inference_logprobs``  float32 [S, L]     padded with 1.0 (a group without them: all 1.0)
  ``lengths``             int64   [S]        tokens per sequence
  ``scores``              float32 [S]
  ``group_index``         int64   [S]        the group's position in the batch
  ``env_id``              int64   [S]        -1 when absent
  ``advantages``, ``ref_logprobs``
                          float32 [S, L]     padded with 0.0, with ``has_<name>`` uint8 [S];
                                             present when a group of the batch carries them
  ``distill_token_ids``   int64   [S, L, K]  teacher top-k ids, -1 padding
  ``distill_logprobs``    float32 [S, L, K]  padded with 0.0; both present when a group
                                             carries either
  ``groups_json``         uint8   [N]        one JSON list, an object per group: every other
                                             field the group carries (messages, overrides, ...)

``L`` is the longest token row of the batch and ``K`` the largest teacher top-k, at most
``MAX_DISTILL_K``: no other field widens a batch (SPEC §13), so a batch file is never larger than
``S × L × (28 + 5 per optional row field + 12 K)`` bytes plus its header and ``groups_json``, and
that size is known (:func:`plan_batch`) before anything is allocated. A per-token field whose
shape does not fit the layout (a row count other than the group's, a row longer than its
sequence, distillation data that is not a [position][k] list of numbers with at most one entry
per token and ``MAX_DISTILL_K`` per position) stays in the group's entry of ``groups_json``
instead, and its ``has_`` flag is 0: nothing accepted is lost. (The API refuses such
distillation data when a group arrives; a group spooled before it did is laid out this way.)

The file is standard safetensors (8-byte little-endian header length, a JSON header naming
each tensor's dtype, shape and byte range, the raw little-endian bytes), readable by
``safetensors.numpy.load`` and ``safetensors.torch.load``; its metadata carries
``format = "atroposd-batch-1"``. This module imports numpy and orjson only (the API never
imports torch); the client library decodes with :func:`decode`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from atroposd.api.schema import DISTILL, MAX_DISTILL_K, PASSTHROUGH, Group

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "CONTENT_TYPE",
    "FORMAT",
    "FORMATS",
    "BatchLayout",
    "LayoutError",
    "batch_arrays",
    "decode",
    "encode",
    "plan_batch",
    "requested_format",
    "response_body",
]

CONTENT_TYPE = "application/vnd.safetensors"
FORMAT = "atroposd-batch-1"
OPTIONAL_ROWS = ("advantages", "ref_logprobs")
SHM_CONTENT_TYPE = "application/vnd.atroposd.shm+json"
FORMATS = ("json", "safetensors", "shm")
_HEADER_ALIGN = 8
_REST_ORDER = (*OPTIONAL_ROWS, *PASSTHROUGH)  # the keys of a groups_json entry, in this order

_DTYPES: dict[str, str] = {"<i8": "I64", "<f4": "F32", "|u1": "U8", "<i4": "I32", "<f8": "F64", "|b1": "BOOL"}
_NUMPY: dict[str, np.dtype[Any]] = {v: np.dtype(k) for k, v in _DTYPES.items()}
_I64, _F32, _U8 = np.dtype("<i8"), np.dtype("<f4"), np.dtype("|u1")


class LayoutError(ValueError):
    """Bytes that are not a safetensors file of the expected layout."""


# ----------------------------------------------------------------------------- one group's view


@dataclass(slots=True)
class GroupRows:
    """One group reduced to what the layout needs: flat rows with their bounds (numpy), and the
    JSON of every other field. Built from the API's in-memory group or from a JSON group."""

    n: int
    tokens: np.ndarray
    masks: np.ndarray
    bounds: np.ndarray  # int64 [n + 1]
    scores: np.ndarray
    env_id: int | None
    logprobs: np.ndarray | None  # same bounds as tokens
    rows: dict[str, tuple[np.ndarray, np.ndarray]]  # advantages / ref_logprobs: (flat, bounds)
    distill: dict[str, list[np.ndarray]]  # name -> per sequence [positions, k]
    rest: dict[str, Any]  # name -> JSON text (bytes) or a parsed value, for groups_json

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.bounds)


def _fits(bounds: np.ndarray, lengths: np.ndarray) -> bool:
    """Rows (their bounds) that fit the layout: one per sequence, none longer than its tokens."""
    return bool(bounds.size == lengths.size + 1 and (np.diff(bounds) <= lengths).all())


def _ragged_from_rows(value: object, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Rows of numbers as (flat float64, bounds); None when they are not one flat row of numbers
    per sequence, each no longer than the sequence's tokens."""
    n = lengths.size
    if not isinstance(value, list) or len(value) != n:
        return None
    parts = []
    for row, length in zip(value, lengths.tolist(), strict=True):
        if not isinstance(row, list) or len(row) > length:
            return None
        try:
            a = np.asarray(row, dtype=np.float64)
        except (TypeError, ValueError):
            return None
        if a.ndim != 1:
            return None
        parts.append(a)
    bounds = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([p.size for p in parts], out=bounds[1:])
    flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.float64)
    return flat, bounds


def _numbers(value: object, integer: bool) -> np.ndarray | None:
    """A flat list of numbers as int64 / float64; None when it is not one (floats are not ids)."""
    if not isinstance(value, list):
        return None
    if not value:
        return np.empty(0, dtype=np.int64 if integer else np.float64)
    try:
        a = np.asarray(value)
    except (TypeError, ValueError, OverflowError):
        return None
    if a.ndim != 1 or a.dtype.kind not in ("iu" if integer else "iuf"):
        return None
    if integer and a.dtype.kind == "u" and int(a.max()) > np.iinfo(np.int64).max:
        return None
    return a.astype(np.int64 if integer else np.float64)


def _distill_rows(value: object, lengths: np.ndarray, integer: bool) -> list[np.ndarray] | None:
    """Per sequence a [positions, k] array (k may vary by position: padded here with -1 / 0.0;
    a null sequence or position has none); None when ``value`` is not one list per sequence of
    at most one entry per token, each a list of at most ``MAX_DISTILL_K`` numbers. Checked
    before anything is allocated."""
    if not isinstance(value, list) or len(value) != lengths.size:
        return None
    pad = -1 if integer else 0.0
    out = []
    for seq, length in zip(value, lengths.tolist(), strict=True):
        if seq is None:
            seq = []
        if not isinstance(seq, list) or len(seq) > length:
            return None
        if any(p is not None and (not isinstance(p, list) or len(p) > MAX_DISTILL_K) for p in seq):
            return None
        per_pos = [_numbers(p if p is not None else [], integer) for p in seq]
        if any(p is None for p in per_pos):
            return None
        k = max((p.size for p in per_pos if p is not None), default=0)
        a = np.full((len(seq), k), pad, dtype=np.int64 if integer else np.float64)
        for i, p in enumerate(per_pos):
            if p is not None and p.size:
                a[i, : p.size] = p
        out.append(a)
    return out


def _split_rest(
    lengths: np.ndarray, passthrough: Mapping[str, Any], loads: Callable[[Any], Any]
) -> tuple[dict[str, list[np.ndarray]], dict[str, Any]]:
    """Lay out the distillation fields when they fit; everything else stays for groups_json."""
    distill: dict[str, list[np.ndarray]] = {}
    rest = dict(passthrough)
    for name in DISTILL:
        if name not in rest:
            continue
        rows = _distill_rows(loads(rest[name]), lengths, integer=name == "distill_token_ids")
        if rows is not None:
            distill[name] = rows
            del rest[name]
    return distill, rest


def rows_from_group(g: Group) -> GroupRows:
    """The API's in-memory :class:`~atroposd.api.schema.Group` as layout rows."""
    bounds = np.asarray(g.tokens.bounds, dtype=np.int64)
    lengths = np.diff(bounds)
    rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    rest_rows: dict[str, Any] = {}
    for name in OPTIONAL_ROWS:
        r = getattr(g, name)
        if r is None:
            continue
        r_bounds = np.asarray(r.bounds, dtype=np.int64)
        if _fits(r_bounds, lengths):
            rows[name] = (r.flat, r_bounds)
        else:  # not one row per sequence, or a row wider than its tokens: kept as JSON
            rest_rows[name] = orjson.loads(orjson.dumps(r.rows(), option=orjson.OPT_SERIALIZE_NUMPY))
    distill, rest = _split_rest(lengths, {k: _parsed(v) for k, v in g.extras.items()}, lambda v: v)
    return GroupRows(
        n=g.n,
        tokens=g.tokens.flat,
        masks=g.masks.flat,
        bounds=bounds,
        scores=g.scores,
        env_id=g.env_id,
        logprobs=g.logprobs.flat if g.logprobs is not None else None,
        rows=rows,
        distill=distill,
        rest={**rest_rows, **rest},
    )


def _parsed(text: bytes) -> object:
    """A kept field's JSON as a value (re-serialised into groups_json in one canonical form, so
    that the file does not depend on how the field was posted); the text itself if orjson cannot
    parse it back (an integer beyond 64 bits)."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return orjson.Fragment(text)


def rows_from_json(obj: Mapping[str, Any]) -> GroupRows:
    """A group as ``GET /batch`` returns it in JSON, as layout rows (what a JSON client does)."""
    tokens, masks = obj["tokens"], obj["masks"]
    n = len(tokens)
    lengths = [len(r) for r in tokens]
    bounds = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=bounds[1:])
    flat_t = np.fromiter((t for r in tokens for t in r), dtype=np.int64, count=int(bounds[-1]))
    flat_m = np.fromiter((t for r in masks for t in r), dtype=np.int64, count=int(bounds[-1]))
    lp = obj.get("inference_logprobs")
    flat_lp = (
        np.fromiter((x for r in lp for x in r), dtype=np.float64, count=int(bounds[-1])) if lp is not None else None
    )
    rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    passthrough: dict[str, Any] = {k: obj[k] for k in PASSTHROUGH if obj.get(k) is not None}
    rest_rows: dict[str, Any] = {}
    for name in OPTIONAL_ROWS:
        value = obj.get(name)
        if value is None:
            continue
        r = _ragged_from_rows(value, np.diff(bounds))
        if r is not None:
            rows[name] = r
        else:
            rest_rows[name] = value
    distill, rest = _split_rest(np.diff(bounds), passthrough, lambda v: v)
    return GroupRows(
        n=n,
        tokens=flat_t,
        masks=flat_m,
        bounds=bounds,
        scores=np.asarray(obj["scores"], dtype=np.float64),
        env_id=obj.get("env_id"),
        logprobs=flat_lp,
        rows=rows,
        distill=distill,
        rest={**rest_rows, **rest},
    )


# ----------------------------------------------------------------------------- the plan


@dataclass(slots=True)
class BatchLayout:
    """Names, dtypes and shapes of a batch's tensors, and its header: known before any array is
    filled, so the arrays can be written straight into their final buffer."""

    groups: list[GroupRows]
    specs: list[tuple[str, np.dtype[Any], tuple[int, ...]]]
    groups_json: bytes
    header: bytes  # length prefix + padded JSON header
    offsets: dict[str, int]  # name -> byte offset in the file
    size: int  # total file size

    def fill(self, buf: Buffer) -> None:
        """Write the whole file into ``buf`` (a writable buffer of at least ``size`` bytes)."""
        mv = memoryview(buf).cast("B")
        mv[: len(self.header)] = self.header
        arrays = {
            name: np.frombuffer(mv, dtype=dt, count=_count(shape), offset=self.offsets[name]).reshape(shape)
            for name, dt, shape in self.specs
        }
        _fill(self, arrays)

    def to_bytes(self) -> bytes:
        buf = bytearray(self.size)
        self.fill(buf)
        return bytes(buf)

    def arrays(self) -> dict[str, np.ndarray]:
        """The tensors as fresh numpy arrays (no file)."""
        arrays = {name: np.empty(shape, dtype=dt) for name, dt, shape in self.specs}
        _fill(self, arrays)
        return arrays


def _count(shape: tuple[int, ...]) -> int:
    c = 1
    for d in shape:
        c *= d
    return c


def plan_batch(groups: Sequence[GroupRows], metadata: Mapping[str, str] | None = None) -> BatchLayout:
    """The layout of a batch of ``groups`` (in batch order): names, shapes and the file's size,
    computed from the token rows and the top-k alone, before anything is allocated."""
    s = sum(g.n for g in groups)
    width = max((int(g.lengths.max()) for g in groups if g.n), default=0)  # the widest token row
    specs: list[tuple[str, np.dtype[Any], tuple[int, ...]]] = [
        ("tokens", _I64, (s, width)),
        ("masks", _I64, (s, width)),
        ("inference_logprobs", _F32, (s, width)),
        ("lengths", _I64, (s,)),
        ("scores", _F32, (s,)),
        ("group_index", _I64, (s,)),
        ("env_id", _I64, (s,)),
    ]
    for name in OPTIONAL_ROWS:
        if any(name in g.rows for g in groups):
            specs += [(name, _F32, (s, width)), (f"has_{name}", _U8, (s,))]
    if any(g.distill for g in groups):
        k = max((a.shape[1] for g in groups for rows in g.distill.values() for a in rows), default=0)
        specs += [("distill_token_ids", _I64, (s, width, k)), ("distill_logprobs", _F32, (s, width, k))]
    groups_json = b"[" + b",".join(_group_json(g.rest) for g in groups) + b"]"
    specs.append(("groups_json", _U8, (len(groups_json),)))
    header, offsets, size = _header(specs, {"format": FORMAT, **(metadata or {})})
    return BatchLayout(
        groups=list(groups), specs=specs, groups_json=groups_json, header=header, offsets=offsets, size=size
    )


def _group_json(rest: Mapping[str, Any]) -> bytes:
    if not rest:
        return b"{}"
    return orjson.dumps({k: rest[k] for k in _REST_ORDER if k in rest})


def _header(
    specs: Sequence[tuple[str, np.dtype[Any], tuple[int, ...]]], metadata: Mapping[str, str]
) -> tuple[bytes, dict[str, int], int]:
    entries: dict[str, Any] = {"__metadata__": dict(metadata)}
    pos = 0
    rel: dict[str, int] = {}
    for name, dt, shape in specs:
        nbytes = _count(shape) * dt.itemsize
        entries[name] = {"dtype": _DTYPES[dt.str], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        rel[name] = pos
        pos += nbytes
    text = orjson.dumps(entries)
    text += b" " * (-(8 + len(text)) % _HEADER_ALIGN)
    head = struct.pack("<Q", len(text)) + text
    return head, {k: v + len(head) for k, v in rel.items()}, len(head) + pos


# ----------------------------------------------------------------------------- filling


def _fill(layout: BatchLayout, out: dict[str, np.ndarray]) -> None:
    groups = layout.groups
    lengths = np.concatenate([g.lengths for g in groups]) if groups else np.empty(0, dtype=np.int64)
    width = out["tokens"].shape[1]
    inside = np.arange(width) < lengths[:, None]  # [S, L]: the positions each sequence has
    _scatter(out["tokens"], inside, [g.tokens for g in groups], 0)
    _scatter(out["masks"], inside, [g.masks for g in groups], -100)
    lp = out["inference_logprobs"]
    lp.fill(1.0)
    row = 0
    for g in groups:
        if g.logprobs is not None and g.n:
            block = lp[row : row + g.n]
            block[inside[row : row + g.n]] = g.logprobs
        row += g.n
    out["lengths"][:] = lengths
    out["scores"][:] = np.concatenate([g.scores for g in groups]) if groups else []
    out["group_index"][:] = np.repeat(np.arange(len(groups)), [g.n for g in groups])
    out["env_id"][:] = np.repeat([g.env_id if g.env_id is not None else -1 for g in groups], [g.n for g in groups])
    for name in OPTIONAL_ROWS:
        if name not in out:
            continue
        target, has = out[name], out[f"has_{name}"]
        target.fill(0.0)
        has.fill(0)
        row = 0
        for g in groups:
            r = g.rows.get(name)
            if r is not None and g.n:
                flat, bounds = r
                mask = np.arange(width) < np.diff(bounds)[:, None]
                target[row : row + g.n][mask] = flat
                has[row : row + g.n] = 1
            row += g.n
    if "distill_token_ids" in out:
        ids, lps = out["distill_token_ids"], out["distill_logprobs"]
        ids.fill(-1)
        lps.fill(0.0)
        row = 0
        for g in groups:
            for name, target in (("distill_token_ids", ids), ("distill_logprobs", lps)):
                for i, a in enumerate(g.distill.get(name, ())):
                    target[row + i, : a.shape[0], : a.shape[1]] = a
            row += g.n
    out["groups_json"][:] = np.frombuffer(layout.groups_json, dtype=np.uint8)


def _scatter(target: np.ndarray, inside: np.ndarray, flats: list[np.ndarray], pad: int) -> None:
    target.fill(pad)
    if flats:
        target[inside] = np.concatenate(flats)


# ----------------------------------------------------------------------------- entry points


def encode(groups: Sequence[Any], metadata: Mapping[str, str] | None = None) -> bytes:
    """The safetensors file of a batch of API groups."""
    return plan_batch([rows_from_group(g) for g in groups], metadata).to_bytes()


def batch_arrays(groups: Sequence[Mapping[str, Any]], max_bytes: int | None = None) -> dict[str, np.ndarray]:
    """The arrays of a JSON batch (the groups of ``{"batch": [...]}``), exactly as :func:`encode`
    would lay them out. LayoutError, before they are allocated, when they would take more than
    ``max_bytes``."""
    layout = plan_batch([rows_from_json(g) for g in groups])
    if max_bytes is not None and layout.size > max_bytes:
        raise LayoutError(f"the batch would take {layout.size} bytes, more than the {max_bytes} allowed")
    return layout.arrays()


def decode(buf: Buffer) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of a safetensors file in ``buf``: numpy views of ``buf``, no copy.

    Raises LayoutError for anything malformed (bad header, offsets out of bounds, unknown dtype).
    """
    mv = memoryview(buf).cast("B")
    if len(mv) < 8:
        raise LayoutError(f"{len(mv)} bytes: too short for a safetensors file")
    (hlen,) = struct.unpack_from("<Q", mv)
    if hlen > len(mv) - 8:
        raise LayoutError(f"header of {hlen} bytes in a file of {len(mv)}")
    try:
        header = orjson.loads(mv[8 : 8 + hlen])
    except orjson.JSONDecodeError as exc:
        raise LayoutError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise LayoutError("header is not a JSON object")
    base = 8 + hlen
    meta = header.pop("__metadata__", None) or {}
    tensors: dict[str, np.ndarray] = {}
    for name, spec in header.items():
        try:
            dt = _NUMPY[spec["dtype"]]
            shape = tuple(int(d) for d in spec["shape"])
            begin, end = (int(x) for x in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise LayoutError(f"tensor {name!r}: bad header entry {spec!r}") from None
        count = _count(shape)
        if begin < 0 or end != begin + count * dt.itemsize or base + end > len(mv):
            raise LayoutError(f"tensor {name!r}: bytes [{begin}, {end}) do not fit its shape or the file")
        tensors[name] = np.frombuffer(mv, dtype=dt, count=count, offset=base + begin).reshape(shape)
    return tensors, {str(k): str(v) for k, v in meta.items()}


# ----------------------------------------------------------------------------- HTTP


def requested_format(accept: str, query: str | None) -> str:
    """``json`` (the default), ``safetensors`` or ``shm`` from ``?format=`` or the Accept header;
    an unknown ``format`` value is a 400 naming the choices."""
    if query is not None:
        if query not in FORMATS:
            from atroposd.api.schema import InvalidRequest

            raise InvalidRequest(f"format must be one of {', '.join(FORMATS)}; got {query!r}", 400, "bad_format")
        return query
    accept = accept.lower()
    if CONTENT_TYPE in accept:
        return "safetensors"
    if SHM_CONTENT_TYPE in accept:
        return "shm"
    return "json"


def response_body(
    groups: Sequence[Any], step: int, *, remote: bool, accepts_gzip: bool
) -> tuple[bytes, dict[str, str]]:
    """The safetensors response of a batch: gzip (level 1) only to a remote client that accepts
    it; on the same host the bytes cost nothing and deflating them would."""
    import zlib

    body = encode(groups, {"step": str(step)})
    headers = {"Content-Type": CONTENT_TYPE}
    if remote and accepts_gzip:
        c = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        body = c.compress(body) + c.flush()
        headers["Content-Encoding"] = "gzip"
    return body, headers

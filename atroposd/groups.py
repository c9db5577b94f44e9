"""The scored group: one schema for the API that accepts it and the trainer that trains on it.

A rollout group (atroposlib's ``ScoredData``, ATROPOS-PROTOCOL.md §1.1) becomes a :class:`Group`:
token ids and masks as one flat integer array each, inference logprobs as one flat float64
array, row boundaries in ``bounds``. That is about a sixth of the memory of Python lists of ints
and floats, and ``orjson`` writes the arrays back out without building Python objects again.
Fields the schema never reads (messages, overrides, ...) are kept as already-serialised JSON
fragments.

Validation is exactly SPEC §5 and no stricter: equal row lengths of tokens/masks/logprobs, one
score per sequence, finite scores, rows no longer than a ``max_token_len``, the distillation
fields' shape. Types are checked only as far as the upstream pydantic model coerces them (an
integral float is an int, an int is a float); anything else is a :class:`SchemaError` naming the
field. The API answers it with a 4xx (``status``) and counts it under ``reason``; the trainer,
which receives the same groups back over the network, checks them again with the same code
(:func:`group_from_json` with ``fields``) and counts a failure under its own reasons.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

__all__ = [
    "DISTILL",
    "FLOAT_ROWS",
    "MAX_DISTILL_K",
    "MAX_PASSTHROUGH_DEPTH",
    "PASSTHROUGH",
    "Group",
    "Ragged",
    "SchemaError",
    "assemble_group",
    "check_distill",
    "check_distill_values",
    "check_messages",
    "check_passthrough",
    "encode_passthrough",
    "group_from_json",
    "group_to_json",
    "narrow_rows",
    "text_depth",
    "value_depth",
]

_I32 = np.iinfo(np.int32)
_I64 = np.iinfo(np.int64)

# Rows of floats, stored flat like the token ids.
FLOAT_ROWS = ("inference_logprobs", "advantages", "ref_logprobs")
PASSTHROUGH = (
    "messages",
    "generation_params",
    "overrides",
    "group_overrides",
    "images",
    "distill_token_ids",
    "distill_logprobs",
)
# How deep a passthrough field may nest below its own level (SPEC §13). Kept bytes are written
# back verbatim, never re-encoded, but a client's JSON encoder or orjson (254 levels) must
# still be able to read what a batch serves.
MAX_PASSTHROUGH_DEPTH = 64
# Teacher top-k per position in ``distill_token_ids`` / ``distill_logprobs`` (SPEC §13): a binary
# batch lays them out as [S, L, K], so K is bounded where a group arrives. The trainer's bound.
MAX_DISTILL_K = 256
DISTILL = ("distill_token_ids", "distill_logprobs")


class SchemaError(ValueError):
    """Data that breaks the schema: ``field`` names the offending field (None: the whole body),
    ``status`` is the HTTP code the API answers with (400, 404, 413, 422), ``reason`` a short
    label for the API's rejection metric (a bounded set)."""

    def __init__(self, message: str, status: int = 422, reason: str = "invalid", *, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.field = field


# ----------------------------------------------------------------------------- ragged rows


@dataclass(eq=False, slots=True)
class Ragged:
    """Rows of numbers stored flat: row i is ``flat[bounds[i]:bounds[i+1]]``."""

    flat: np.ndarray  # [sum of row lengths], int32/int64 or float64
    bounds: list[int]  # [rows + 1]

    def rows(self) -> list[np.ndarray]:
        b, f = self.bounds, self.flat
        return [f[b[i] : b[i + 1]] for i in range(len(b) - 1)]

    def lengths(self) -> list[int]:
        b = self.bounds
        return [b[i + 1] - b[i] for i in range(len(b) - 1)]

    @property
    def nbytes(self) -> int:
        return int(self.flat.nbytes)


def _row_array(row: object, name: str, i: int) -> np.ndarray:
    if not isinstance(row, list):
        raise SchemaError(f"{name}[{i}] must be a list of numbers, got {type(row).__name__}", field=name)
    try:
        a = np.asarray(row)
    except (ValueError, TypeError):
        raise SchemaError(f"{name}[{i}] must be a flat list of numbers", field=name) from None
    if a.ndim != 1:
        raise SchemaError(f"{name}[{i}] must be a flat list of numbers", field=name)
    return a


def _rectangular(rows: list[object]) -> np.ndarray | None:
    """All rows at once when they are lists of one length (the common case): one numpy call
    instead of one per row. None when ragged or not plain lists."""
    first = rows[0] if rows else None
    if type(first) is not list or not first:
        return None
    width = len(first)
    for r in rows:
        if type(r) is not list or len(r) != width:
            return None
    try:
        a = np.array(rows)
    except (ValueError, TypeError):
        return None
    return a if a.ndim == 2 else None


def _check_int(a: np.ndarray, name: str, i: int | None) -> np.ndarray:
    kind = a.dtype.kind
    where = name if i is None else f"{name}[{i}]"
    if a.size == 0 or kind in "ib":
        return a
    if kind == "u":  # beyond int64
        raise SchemaError(f"{where}: integer out of range", field=name)
    if kind == "f" and bool(np.all(np.isfinite(a))) and bool(np.all(a == np.trunc(a))):
        return a
    raise SchemaError(f"{where} must hold integers", field=name)


def _check_float(a: np.ndarray, name: str, i: int | None) -> np.ndarray:
    if a.size and a.dtype.kind not in "iubf":
        raise SchemaError(f"{name if i is None else f'{name}[{i}]'} must hold numbers", field=name)
    return a


def _int_rows(value: object, name: str) -> Ragged:
    rows = _require_list(value, name)
    block = _rectangular(rows)
    if block is not None and _fine(_check_int, block, name):
        return _from_block(block, name, integer=True)
    # ragged, or invalid: row by row, so that an error names the row
    return _flatten([_check_int(_row_array(row, name, i), name, i) for i, row in enumerate(rows)], name, integer=True)


def _float_rows(value: object, name: str) -> Ragged:
    rows = _require_list(value, name)
    block = _rectangular(rows)
    if block is not None and _fine(_check_float, block, name):
        return _from_block(block, name, integer=False)
    return _flatten(
        [_check_float(_row_array(row, name, i), name, i) for i, row in enumerate(rows)], name, integer=False
    )


def _fine(check: Callable[[np.ndarray, str, int | None], np.ndarray], block: np.ndarray, name: str) -> bool:
    try:
        check(block, name, None)
    except SchemaError:
        return False
    return True


def _from_block(block: np.ndarray, name: str, *, integer: bool) -> Ragged:
    n, width = block.shape
    return narrow_rows(block.reshape(-1), list(range(0, n * width + 1, width)), name, integer=integer)


def _flatten(parts: list[np.ndarray], name: str, *, integer: bool) -> Ragged:
    bounds = [0]
    for a in parts:
        bounds.append(bounds[-1] + int(a.size))
    if not parts:
        return Ragged(np.empty(0, dtype=np.int32 if integer else np.float64), bounds)
    return narrow_rows(np.concatenate(parts), bounds, name, integer=integer)


def narrow_rows(flat: np.ndarray, bounds: list[int], name: str, *, integer: bool) -> Ragged:
    """float64 for numbers; int32 for integers when they fit (token ids do), else int64."""
    if not integer:
        return Ragged(flat.astype(np.float64, copy=False), bounds)
    low, high = (int(flat.min()), int(flat.max())) if flat.size else (0, 0)
    if low < _I32.min or high > _I32.max:
        if flat.dtype.kind == "u" or low < _I64.min or high > _I64.max:
            raise SchemaError(f"{name}: integer out of range", field=name)
        return Ragged(flat.astype(np.int64), bounds)
    return Ragged(flat.astype(np.int32), bounds)


def _require_list(value: object, name: str) -> list[object]:
    if not isinstance(value, list):
        raise SchemaError(f"{name} must be a list, got {type(value).__name__}", field=name)
    return value


# ----------------------------------------------------------------------------- groups


@dataclass(eq=False, slots=True)
class Group:
    """One accepted ScoredData item (an environment's group of sequences)."""

    tokens: Ragged
    masks: Ragged  # same bounds as tokens
    scores: np.ndarray  # float64 [n]
    logprobs: Ragged | None  # inference_logprobs, same bounds as tokens
    advantages: Ragged | None
    ref_logprobs: Ragged | None
    extras: dict[str, bytes] = field(default_factory=dict)  # PASSTHROUGH fields as JSON text, not null
    env_id: int | None = None
    seq: int = -1  # acceptance number (the spool's key)
    qpos: int = -1  # position in the queue order; -1 while in a mixed-size buffer

    @property
    def n(self) -> int:
        return len(self.tokens.bounds) - 1

    @property
    def nbytes(self) -> int:
        total = self.tokens.nbytes + self.masks.nbytes + int(self.scores.nbytes)
        for r in (self.logprobs, self.advantages, self.ref_logprobs):
            if r is not None:
                total += r.nbytes
        return total + sum(len(v) for v in self.extras.values())


def _optional_int(value: object, name: str) -> int | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value != int(value)
    ):
        raise SchemaError(f"{name} must be an integer or null", field=name)
    if not _I64.min <= int(value) <= _I64.max:
        raise SchemaError(f"{name}: integer out of range", field=name)
    return int(value)


def group_from_json(
    obj: object, *, max_token_len: int | None = None, where: str = "", fields: Collection[str] | None = None
) -> Group:
    """Validate one ScoredData object (SPEC §5) and build its compact form.

    ``fields``: the optional fields to read (of FLOAT_ROWS, PASSTHROUGH and ``env_id``); None:
    all of them. The trainer reads only what it trains on; ``tokens``, ``masks`` and ``scores``
    are always read."""
    if not isinstance(obj, Mapping):
        raise SchemaError(f"{where}body must be a JSON object (ScoredData), got {type(obj).__name__}")
    try:
        return _build_group(obj, max_token_len, fields)
    except SchemaError as exc:
        raise SchemaError(f"{where}{exc}", exc.status, exc.reason, field=exc.field) from None


def _build_group(obj: Mapping[str, object], max_token_len: int | None, fields: Collection[str] | None) -> Group:
    for key in ("tokens", "masks", "scores"):
        if key not in obj or obj[key] is None:
            raise SchemaError(f"field required: {key}", field=key)
    tokens = _int_rows(obj["tokens"], "tokens")
    masks = _int_rows(obj["masks"], "masks")
    floats = {
        k: _float_rows(obj[k], k) if obj.get(k) is not None and (fields is None or k in fields) else None
        for k in FLOAT_ROWS
    }
    extras = {}
    for k in PASSTHROUGH:
        value = obj.get(k)
        if value is None or (fields is not None and k not in fields):
            continue
        check_passthrough(k, value)
        extras[k] = encode_passthrough(k, value)
    env_id = obj.get("env_id") if fields is None or "env_id" in fields else None
    return assemble_group(tokens, masks, obj["scores"], floats, extras, env_id, max_token_len=max_token_len)


def assemble_group(
    tokens: Ragged,
    masks: Ragged,
    scores: object,
    floats: Mapping[str, Ragged | None],
    extras: dict[str, bytes],
    env_id: object,
    *,
    max_token_len: int | None,
    where: str = "",
) -> Group:
    """The checks of SPEC §5 on already-converted rows, and the group (``floats``: the rows of
    FLOAT_ROWS by field name, None when absent; ``scores`` and ``env_id`` as posted; ``where``
    prefixes error messages)."""
    try:
        return _assemble(tokens, masks, scores, floats, extras, env_id, max_token_len)
    except SchemaError as exc:
        if not where:
            raise
        raise SchemaError(f"{where}{exc}", exc.status, exc.reason, field=exc.field) from None


def _assemble(
    tokens: Ragged,
    masks: Ragged,
    scores: object,
    floats: Mapping[str, Ragged | None],
    extras: dict[str, bytes],
    env_id: object,
    max_token_len: int | None,
) -> Group:
    n = len(tokens.bounds) - 1
    if n == 0:
        raise SchemaError("tokens is empty: a group needs at least one sequence", 422, "empty_group", field="tokens")
    lengths = tokens.lengths()
    if masks.bounds != tokens.bounds:
        raise SchemaError(_mismatch("masks", masks, lengths), 400, "length_mismatch", field="masks")
    logprobs = floats.get("inference_logprobs")
    if logprobs is not None and logprobs.bounds != tokens.bounds:
        raise SchemaError(
            _mismatch("inference_logprobs", logprobs, lengths), 400, "length_mismatch", field="inference_logprobs"
        )
    score_array = _scores(scores, n)
    if DISTILL[0] in extras or DISTILL[1] in extras:
        check_distill(extras, lengths)
    if max_token_len is not None and max_token_len > 0 and lengths and max(lengths) > max_token_len:
        i = max(range(n), key=lengths.__getitem__)
        raise SchemaError(
            f"tokens[{i}] has {lengths[i]} tokens, longer than the registered max_token_len {max_token_len}",
            400,
            "too_long",
            field="tokens",
        )
    return Group(
        tokens=tokens,
        masks=masks,
        scores=score_array,
        logprobs=logprobs,
        advantages=floats.get("advantages"),
        ref_logprobs=floats.get("ref_logprobs"),
        extras=extras,
        env_id=_optional_int(env_id, "env_id"),
    )


def _mismatch(name: str, other: Ragged, lengths: list[int]) -> str:
    other_lengths = other.lengths()
    if len(other_lengths) != len(lengths):
        return f"{name} has {len(other_lengths)} sequences but tokens has {len(lengths)}"
    i = next(i for i, (a, b) in enumerate(zip(other_lengths, lengths, strict=True)) if a != b)
    return f"{name}[{i}] has {other_lengths[i]} entries but tokens[{i}] has {lengths[i]}"


def _scores(value: object, n: int) -> np.ndarray:
    values = _require_list(value, "scores")
    if len(values) != n:
        raise SchemaError(
            f"scores has {len(values)} entries but there are {n} sequences", 400, "score_count", field="scores"
        )
    try:
        scores = np.asarray(values, dtype=np.float64)
    except (ValueError, TypeError):
        raise SchemaError("scores must be a list of numbers", field="scores") from None
    if scores.ndim != 1:
        raise SchemaError("scores must be a flat list of numbers", field="scores")
    bad = np.flatnonzero(~np.isfinite(scores))
    if bad.size:
        raise SchemaError(f"scores[{int(bad[0])}] is not a finite number", 400, "non_finite_score", field="scores")
    return scores


def check_distill(extras: Mapping[str, bytes], lengths: list[int]) -> None:
    """The distillation fields against their token rows (SPEC §13), 422 ``distill_invalid``
    otherwise: one entry per sequence (null: none for it), in it one entry per token (null or
    []: none at that position), each at most ``MAX_DISTILL_K`` teacher ids (integers) or
    logprobs (finite numbers), and as many logprobs as ids where both are given."""
    given: dict[str, object] = {}
    for name in DISTILL:
        if name in extras:
            try:
                given[name] = orjson.loads(extras[name])
            except orjson.JSONDecodeError as exc:
                raise SchemaError(f"{name}: {exc}", 422, "distill_invalid", field=name) from None
    check_distill_values(given, lengths)


def check_distill_values(given: Mapping[str, object], lengths: list[int]) -> None:
    """:func:`check_distill` on decoded fields (``given``: those of DISTILL present, by name)."""
    for name, value in given.items():
        _check_distill_field(name, value, lengths)
    ids, lps = given.get(DISTILL[0]), given.get(DISTILL[1])
    if isinstance(ids, list) and isinstance(lps, list):
        for i, (a, b) in enumerate(zip(ids, lps, strict=True)):
            if a is None or b is None:
                continue
            for t, (x, y) in enumerate(zip(a, b, strict=True)):
                if x is not None and y is not None and len(x) != len(y):
                    raise SchemaError(
                        f"distill_logprobs[{i}][{t}] has {len(y)} entries but distill_token_ids[{i}][{t}] has {len(x)}",
                        422,
                        "distill_invalid",
                        field=DISTILL[1],
                    )


def _check_distill_field(name: str, value: object, lengths: list[int]) -> None:
    def bad(message: str) -> SchemaError:
        return SchemaError(f"{name}{message}", 422, "distill_invalid", field=name)

    if not isinstance(value, list) or len(value) != len(lengths):
        got = f"{len(value)} entries" if isinstance(value, list) else f"a {type(value).__name__}"
        raise bad(f" must hold one entry per sequence ({len(lengths)}), got {got}")
    integer = name == DISTILL[0]
    flat: list[Any] = []
    for i, seq in enumerate(value):
        if seq is None:
            continue
        if not isinstance(seq, list) or len(seq) != lengths[i]:
            got = f"{len(seq)} entries" if isinstance(seq, list) else f"a {type(seq).__name__}"
            raise bad(f"[{i}] must hold one entry per token of tokens[{i}] ({lengths[i]}), got {got}")
        for t, top in enumerate(seq):
            if top is None:
                continue
            if not isinstance(top, list):
                raise bad(f"[{i}][{t}] must be a list of numbers, got a {type(top).__name__}")
            if len(top) > MAX_DISTILL_K:
                raise bad(f"[{i}][{t}] has {len(top)} entries, more than {MAX_DISTILL_K} (the top-k bound)")
            flat.extend(top)
    if not flat:
        return
    kinds = set(map(type, flat))
    if integer:
        if kinds != {int}:
            raise bad(" must hold integers (teacher token ids)")
        if min(flat) < _I64.min or max(flat) > _I64.max:
            raise bad(": integer out of range")
        return
    if not kinds <= {int, float}:
        raise bad(" must hold numbers (teacher logprobs)")
    try:
        finite = bool(np.isfinite(np.asarray(flat, dtype=np.float64)).all())
    except OverflowError:
        finite = False
    if not finite:
        raise bad(" must hold finite numbers")


def check_passthrough(name: str, value: object) -> None:
    """The checks a passthrough field gets on every parse path: its nesting depth, and for
    ``messages`` run-api's own shape (a list of lists of objects with ``role`` and ``content``)."""
    if value_depth(value, MAX_PASSTHROUGH_DEPTH) > MAX_PASSTHROUGH_DEPTH:
        raise SchemaError(f"{name} nests deeper than {MAX_PASSTHROUGH_DEPTH} levels", 422, "too_deep", field=name)
    if name == "messages":
        check_messages(value)


def encode_passthrough(name: str, value: object) -> bytes:
    """A decoded passthrough field as JSON text; 422 for what orjson cannot write (integers
    beyond 64 bits)."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        raise SchemaError(f"{name}: {exc}", field=name) from None


def check_messages(value: object) -> None:
    """run-api's ``messages: Optional[List[List[Dict[str, Any]]]]`` and its validator."""
    if not isinstance(value, list):
        raise SchemaError("messages must be a list of lists of messages", field="messages")
    for i, conversation in enumerate(value):
        if not isinstance(conversation, list):
            raise SchemaError(f"messages[{i}] must be a list of messages", field="messages")
        for j, msg in enumerate(conversation):
            if not isinstance(msg, dict):
                raise SchemaError(f"messages[{i}][{j}] must be an object", field="messages")
            if "role" not in msg or "content" not in msg:
                raise SchemaError(
                    f"messages[{i}][{j}]: Message must have 'role' and 'content' fields", field="messages"
                )


def value_depth(value: object, limit: int) -> int:
    """Nesting depth of a decoded JSON value (a scalar: 0), counted up to ``limit`` + 1."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        elif not isinstance(v, list):
            continue
        d += 1
        if d > deepest:
            deepest = d
            if d > limit:
                return d
        stack.extend((x, d) for x in v if isinstance(x, (list, dict)))
    return deepest


def text_depth(data: bytes) -> int | None:
    """Nesting depth of compact JSON text, from its brackets outside strings; None when it holds
    a backslash (an escaped quote would upset the string mask: decode and use value_depth)."""
    if b"\\" in data:
        return None
    a = np.frombuffer(data, dtype=np.uint8)
    outside = (np.cumsum(a == 0x22) & 1) == 0  # '"' toggles; the quote itself counts as inside
    step = ((a == 0x5B) | (a == 0x7B)).astype(np.int32) - ((a == 0x5D) | (a == 0x7D)).astype(np.int32)
    step *= outside
    return int(np.cumsum(step).max()) if a.size else 0


def group_to_json(g: Group) -> dict[str, Any]:
    """The group as run-api returns it (every field present, null when absent); the arrays are
    written by orjson (``dumps``) without becoming Python objects."""
    ex = {k: orjson.Fragment(v) for k, v in g.extras.items()}
    return {
        "tokens": g.tokens.rows(),
        "masks": g.masks.rows(),
        "scores": g.scores,
        "advantages": g.advantages.rows() if g.advantages is not None else None,
        "ref_logprobs": g.ref_logprobs.rows() if g.ref_logprobs is not None else None,
        "messages": ex.get("messages"),
        "generation_params": ex.get("generation_params"),
        "inference_logprobs": g.logprobs.rows() if g.logprobs is not None else None,
        "overrides": ex.get("overrides"),
        "group_overrides": ex.get("group_overrides"),
        "images": ex.get("images"),
        "env_id": g.env_id,
        "distill_token_ids": ex.get("distill_token_ids"),
        "distill_logprobs": ex.get("distill_logprobs"),
    }

"""ScoredData bodies parsed straight into numpy rows, without a Python object per number.

``orjson.loads`` of a group of 8 × 512 tokens builds about 12,000 Python numbers, which the
schema then turns into numpy arrays and the garbage collector frees again: most of what a
``POST /scored_data`` costs. Here simdjson parses the body into its own tape and exports each
number array as one flat buffer (``as_buffer``), so a group costs a parse and three copies.

This path takes only the plain shape that every well-behaved client posts: an object (or a
list of objects) without duplicate keys, whose ``tokens``/``masks`` are lists of rows of
integers and whose ``inference_logprobs``/``advantages``/``ref_logprobs`` are lists of rows of
numbers or null. Anything else (integral floats as token ids, booleans, deeper nesting,
numbers beyond 64 bits, invalid JSON, ...) returns None and the caller parses the body with
orjson and the full validation of :mod:`atroposd.api.schema`, which also writes the error
message. Both paths then run the same checks (:func:`~atroposd.api.schema.assemble_group`),
so a body is accepted or refused alike, with the same message, whichever path parsed it.

``as_buffer`` flattens nested arrays, so rows such as ``[3, [4]]`` would pass as two numbers:
the body's ``[`` count must therefore equal the rows found plus the brackets of every other
value, or the body takes the full path.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import orjson
import simdjson

from atroposd.api.schema import (
    FLOAT_ROWS,
    MAX_PASSTHROUGH_DEPTH,
    PASSTHROUGH,
    Group,
    InvalidRequest,
    Ragged,
    assemble_group,
    check_passthrough,
    encode_passthrough,
    narrow_rows,
    text_depth,
)

__all__ = ["parse_groups"]

INT_ROWS = ("tokens", "masks")
# A parser keeps its buffers (about 8 bytes of tape per byte of JSON) for the next body: a new
# parser per body would allocate and page-fault them afresh each time, which costs more than
# the parse. Bodies larger than this get a parser of their own, so that one huge body does not
# leave its buffers behind for the life of the process.
REUSE_MAX_BYTES = 4 << 20
_local = threading.local()
# What a simdjson proxy raises on an unexpected type or value.
_SHAPE_ERRORS = (TypeError, ValueError, RuntimeError, OverflowError, KeyError, IndexError)


def parse_groups(raw: bytes | bytearray, *, listed: bool, max_token_len: int | None) -> list[Group] | None:
    """The validated groups of a ``/scored_data`` body (``listed=False``: one object) or a
    ``/scored_data_list`` body (a list of objects); None when the body is not in the plain
    shape (the caller then takes the full path). Raises ``InvalidRequest`` exactly as the full
    path would for a body in the plain shape that breaks a rule of SPEC §5."""
    if b"\\" in raw and b"\\u005" in raw:  # an escaped bracket in a string would upset the bracket count
        return None
    try:
        doc = _parse(raw)
        if listed:
            if not isinstance(doc, simdjson.Array):
                return None
            items: list[object] = list(doc)
            brackets = 1
        else:
            items = [doc]
            brackets = 0
        parts: list[dict[str, Any]] = []
        for item in items:
            got = _extract(item)
            if got is None:
                return None
            parts.append(got)
            brackets += got.pop("_brackets")
    except InvalidRequest:  # a ValueError, but a refusal, not a shape this path does not take
        raise
    except _SHAPE_ERRORS:
        return None
    finally:
        doc = items = None  # type: ignore[assignment]  # drop the proxies (they pin the parser)
    if int(np.count_nonzero(np.frombuffer(raw, dtype=np.uint8) == 0x5B)) != brackets:  # "["
        return None  # nested rows somewhere: the full path names them
    return [
        assemble_group(
            p["tokens"],
            p["masks"],
            p["scores"],
            p["floats"],
            p["extras"],
            p["env_id"],
            max_token_len=max_token_len,
            where=f"[{i}]." if listed else "",
        )
        for i, p in enumerate(parts)
    ]


def _parse(raw: bytes | bytearray) -> object:
    """The document of ``raw`` from this thread's parser. Every proxy of it must be gone before
    the thread parses again (``parse_groups`` drops them before it returns); should one still
    be alive, the parser refuses, and a new one takes its place."""
    if len(raw) > REUSE_MAX_BYTES:
        return simdjson.Parser().parse(raw)
    parser = getattr(_local, "parser", None)
    if parser is not None:
        try:
            return parser.parse(raw)
        except RuntimeError:  # the last document is still referenced somewhere
            pass
    _local.parser = parser = simdjson.Parser()
    return parser.parse(raw)


def _extract(item: object) -> dict[str, Any] | None:
    if not isinstance(item, simdjson.Object):
        return None
    keys = list(item.keys())
    if len(keys) != len(set(keys)):
        return None  # JSON says the last one wins, simdjson gives the first: let orjson decide
    brackets = sum(k.count("[") for k in keys)
    rows: dict[str, Ragged | None] = {}
    extras: dict[str, bytes] = {}
    scores: object = None
    env_id: object = None
    for key in keys:
        value = item[key]
        if key in INT_ROWS or key in FLOAT_ROWS:
            if value is None:
                rows[key] = None
                continue
            got = _rows(value, key, integer=key in INT_ROWS)
            if got is None:
                return None
            rows[key] = got
            brackets += len(got.bounds)  # the list's own bracket and one per row
            continue
        if isinstance(value, (simdjson.Array, simdjson.Object)):
            if key == "env_id":
                return None
            mini: bytes = value.mini  # type: ignore[assignment]  # the stubs say str; it is bytes
            brackets += mini.count(b"[")
            if key == "scores":
                scores = value.as_list() if isinstance(value, simdjson.Array) else value.as_dict()
            elif key in PASSTHROUGH:
                _check_kept(key, mini)
                extras[key] = mini
            continue
        if isinstance(value, str):
            brackets += value.count("[")
        if key == "scores":
            scores = value
        elif key == "env_id":
            env_id = value
        elif key in PASSTHROUGH and value is not None:
            check_passthrough(key, value)
            extras[key] = encode_passthrough(key, value)
    if any(rows.get(k) is None for k in INT_ROWS) or scores is None:
        return None  # a required field is missing: the full path says which
    return {
        "tokens": rows["tokens"],
        "masks": rows["masks"],
        "scores": scores,
        "env_id": env_id,
        "floats": {k: rows.get(k) for k in FLOAT_ROWS},
        "extras": extras,
        "_brackets": brackets,
    }


def _check_kept(key: str, mini: bytes) -> None:
    """The passthrough checks of the full path, on the field's compact text: its depth from the
    brackets (decoded only when the text has escapes), and the shape of ``messages``."""
    depth = text_depth(mini)
    if depth is None or key == "messages":
        try:
            value = orjson.loads(mini)
        except orjson.JSONDecodeError:  # deeper than orjson reads
            raise InvalidRequest(f"{key} nests deeper than {MAX_PASSTHROUGH_DEPTH} levels", 422, "too_deep") from None
        check_passthrough(key, value)
    elif depth > MAX_PASSTHROUGH_DEPTH:
        raise InvalidRequest(f"{key} nests deeper than {MAX_PASSTHROUGH_DEPTH} levels", 422, "too_deep")


def _rows(value: object, name: str, *, integer: bool) -> Ragged | None:
    if not isinstance(value, simdjson.Array):
        return None
    bounds = [0]
    for row in value:
        if not isinstance(row, simdjson.Array):
            return None
        bounds.append(bounds[-1] + len(row))
    flat = np.frombuffer(value.as_buffer(of_type="i" if integer else "d"), dtype=np.int64 if integer else np.float64)
    if flat.size != bounds[-1]:
        return None
    return narrow_rows(flat, bounds, name, integer=integer)

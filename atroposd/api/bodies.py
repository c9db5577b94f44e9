"""Request bodies: bounded gzip inflation, JSON, and the ScoredData groups of a body.

The groups come from the simdjson path (:mod:`atroposd.api.fastparse`) when the body is in
its plain shape, else from orjson and the full checks of :mod:`atroposd.api.schema`.
"""

from __future__ import annotations

import zlib
from typing import Any

import orjson

from atroposd.api.fastparse import parse_groups
from atroposd.api.schema import Group, InvalidRequest, group_from_json

__all__ = ["groups_from_body", "gunzip", "parse_json"]


def gunzip(raw: bytes, limit: int) -> bytes:
    """Decompress gzip members into at most ``limit`` bytes; 413 past it, 400 if invalid.
    A gzip bomb never allocates more than ``limit`` + 1 bytes."""
    out: list[bytes] = []
    total = 0
    data = raw
    while data:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            chunk = d.decompress(data, limit - total + 1)
        except zlib.error:
            raise InvalidRequest("Invalid gzip payload", 400, "invalid_gzip") from None
        total += len(chunk)
        if total > limit:
            raise InvalidRequest(f"request body larger than max_request_bytes ({limit}) after decompression", 413,
                                 "too_large")
        if not d.eof:
            raise InvalidRequest("Invalid gzip payload (truncated)", 400, "invalid_gzip")
        out.append(chunk)
        data = d.unused_data
    return b"".join(out)


def parse_json(raw: bytes, *, optional: bool = False) -> Any:
    if not raw.strip():
        if optional:
            return None
        raise InvalidRequest("empty request body: a JSON document is required", 400, "invalid_json")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"invalid JSON: {exc}", 400, "invalid_json") from None


def groups_from_body(raw: bytes, *, listed: bool, max_token_len: int | None) -> list[Group]:
    """The validated groups of a ``/scored_data`` (one) or ``/scored_data_list`` body
    (decompressed): the simdjson path for the plain shape, else orjson and the full checks,
    which name what is wrong."""
    groups = parse_groups(raw, listed=listed, max_token_len=max_token_len)
    if groups is not None:
        return groups
    body = parse_json(raw)
    if not listed:
        return [group_from_json(body, max_token_len=max_token_len)]
    if not isinstance(body, list):
        raise InvalidRequest(f"body must be a JSON list of ScoredData, got {type(body).__name__}")
    return [group_from_json(item, max_token_len=max_token_len, where=f"[{i}].") for i, item in enumerate(body)]

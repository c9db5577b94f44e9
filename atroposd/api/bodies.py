"""Request bodies: bounded gzip inflation, JSON, and the ScoredData groups of a body.

A gzip body of one member (what every HTTP client sends) inflates with libdeflate in one call
into a buffer of the size its trailer states, checked against ``max_request_bytes`` first:
2.5 times faster than zlib's streaming inflater. Anything else (several members, a trailer
that lies, bytes after the member, damage) takes zlib's bounded streaming path, which decides
and words the error, so both paths accept and refuse the same bodies.

The groups come from the simdjson path (:mod:`atroposd.api.fastparse`) when the body is in
its plain shape, else from orjson and the full checks of :mod:`atroposd.api.schema`.
"""

from __future__ import annotations

import zlib

import orjson

try:
    import deflate
except ImportError:  # Python 3.10 has no wheel of it: zlib inflates every body
    deflate = None  # type: ignore[assignment]

from atroposd.api.fastparse import parse_groups
from atroposd.api.schema import Group, InvalidRequest, group_from_json

__all__ = ["HAS_LIBDEFLATE", "groups_from_body", "gunzip", "gunzip_if_small", "parse_json"]

HAS_LIBDEFLATE = deflate is not None


def gunzip(raw: bytes | bytearray, limit: int) -> bytes | bytearray:
    """Decompress gzip members into at most ``limit`` bytes; 413 past it, 400 if invalid.
    A gzip bomb never allocates more than ``limit`` + 1 bytes."""
    one = _one_member(raw, limit)
    return one if one is not None else _gunzip_stream(raw, limit)


def gunzip_if_small(raw: bytes | bytearray, limit: int) -> bytearray | None:
    """``raw`` inflated when it is one gzip member whose trailer says at most ``limit`` bytes
    and whose content is exactly that; else None, having inflated at most ``limit`` bytes
    (libdeflate writes into a buffer of the trailer's size and stops where it is full): the
    bounded work an event loop may do whatever the trailer says."""
    return _one_member(raw, limit)


_GZIP_MAGIC = b"\x1f\x8b\x08"  # ID1 ID2 CM=deflate


def _one_member(raw: bytes | bytearray, limit: int) -> bytearray | None:
    """``raw`` inflated by libdeflate when it is exactly one valid gzip member whose content
    fits in ``limit``; None for anything else.

    libdeflate allocates what the trailer's ISIZE says (checked against ``limit`` first, so a
    lying trailer cannot make it allocate more) and fails when the content does not fit. It
    stops at the end of the first member, so the content must match the input's last eight
    bytes (CRC-32 and size) and those eight bytes must occur nowhere earlier: a member that
    ended before the input's end would have its own trailer, equal to them, earlier."""
    if deflate is None or len(raw) < 18 or not raw.startswith(_GZIP_MAGIC):
        return None
    tail = raw[-8:]
    size = int.from_bytes(tail[4:], "little")
    if size == 0 or size > limit:  # the binding answers an ISIZE of 0 with b"" unread
        return None
    try:
        out = deflate.gzip_decompress(raw)
    except deflate.DeflateError:
        return None
    if (
        len(out) != size
        or deflate.crc32(out) != int.from_bytes(tail[:4], "little")
        or raw.rfind(tail, 0, len(raw) - 1) != -1
    ):
        return None
    return out


def _gunzip_stream(raw: bytes | bytearray, limit: int) -> bytes:
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
            raise InvalidRequest(
                f"request body larger than max_request_bytes ({limit}) after decompression", 413, "too_large"
            )
        if not d.eof:
            raise InvalidRequest("Invalid gzip payload (truncated)", 400, "invalid_gzip")
        out.append(chunk)
        data = d.unused_data
    return b"".join(out)


def parse_json(raw: bytes | bytearray, *, optional: bool = False) -> object:
    if not raw.strip():
        if optional:
            return None
        raise InvalidRequest("empty request body: a JSON document is required", 400, "invalid_json")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"invalid JSON: {exc}", 400, "invalid_json") from None


def groups_from_body(raw: bytes | bytearray, *, listed: bool, max_token_len: int | None) -> list[Group]:
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

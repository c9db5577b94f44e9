"""gzip request bodies: the one-call libdeflate path and zlib's streaming path accept and refuse
the same bodies, with the same content or the same error; the fast path is taken for what HTTP
clients send and never for anything it cannot vouch for."""

from __future__ import annotations

import gzip
import zlib
from typing import Any

import pytest

from atroposd.api import bodies
from atroposd.api.bodies import _gunzip_stream, _one_member, gunzip
from atroposd.api.schema import InvalidRequest

LIMIT = 1 << 16


def member(data: bytes, **kw: Any) -> bytes:
    return gzip.compress(data, **kw)


def with_header_fields(data: bytes) -> bytes:
    """A member with FEXTRA, FNAME, FCOMMENT and FHCRC set (zlib writes none of them)."""
    flags = 0x04 | 0x08 | 0x10 | 0x02
    head = b"\x1f\x8b\x08" + bytes([flags]) + b"\x00\x00\x00\x00\x00\xff"
    head += (4).to_bytes(2, "little") + b"ab\x00\x00" + b"name.json\x00" + b"a comment\x00"
    head += (zlib.crc32(head) & 0xFFFF).to_bytes(2, "little")
    c = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    return (
        head + c.compress(data) + c.flush() + zlib.crc32(data).to_bytes(4, "little") + len(data).to_bytes(4, "little")
    )


def outcome(fn: Any, raw: bytes, limit: int = LIMIT) -> Any:
    try:
        return ("ok", bytes(fn(raw, limit)))
    except InvalidRequest as exc:
        return ("refused", exc.status, exc.reason, str(exc))


PAYLOAD = b'{"tokens": [[1, 2, 3]], "masks": [[-100, 2, 3]], "scores": [1.0]}' * 20
ONE = member(PAYLOAD)

# Bodies that are one valid member: the fast path takes them.
SINGLE = {
    "plain": ONE,
    "level 1": member(PAYLOAD, compresslevel=1),
    "level 0 (stored blocks)": member(PAYLOAD, compresslevel=0),
    "header fields": with_header_fields(PAYLOAD),
    "exactly the limit": member(b"x" * LIMIT),
}
# Everything else: the streaming path decides.
OTHER = {
    "empty content (libdeflate wants room for output)": member(b""),
    "two members": ONE + member(b" more"),
    "a member twice": ONE + ONE,
    "trailing junk": ONE + b"xx",
    "trailing zeros": ONE + b"\x00" * 8,
    "junk ending in an empty member's trailer": ONE + b"\x01" + b"\x00" * 8,
    "its trailer again": ONE + ONE[-8:],
    "its trailer again, overlapping": ONE + ONE[-3:],
    "truncated": ONE[:-3],
    "truncated inside the data": ONE[: len(ONE) // 2],
    "wrong CRC": ONE[:-8] + bytes([ONE[-8] ^ 1]) + ONE[-7:],
    "ISIZE too small": ONE[:-4] + (len(PAYLOAD) - 1).to_bytes(4, "little"),
    "ISIZE too large": ONE[:-4] + (len(PAYLOAD) + 1).to_bytes(4, "little"),
    "one byte over the limit": member(b"x" * (LIMIT + 1)),
    "a bomb that states its size": member(b"\x00" * (LIMIT * 64)),
    "a bomb whose trailer lies": member(b"\x00" * (LIMIT * 64))[:-4] + (100).to_bytes(4, "little"),
    "not gzip": b"\x1f\x8bnot really gzip at all, but long enough",
    "bad method": b"\x1f\x8b\x07" + ONE[3:],
    "too short": ONE[:10],
}


@pytest.mark.parametrize("name", sorted(SINGLE))
def test_one_member_takes_the_fast_path(name: str) -> None:
    raw = SINGLE[name]
    fast = _one_member(raw, LIMIT)
    assert fast is not None, f"{name}: the fast path refused a plain member"
    assert outcome(gunzip, raw) == outcome(_gunzip_stream, raw) == ("ok", gzip.decompress(raw))


@pytest.mark.parametrize("name", sorted(OTHER))
def test_anything_else_is_decided_by_the_stream_path(name: str) -> None:
    raw = OTHER[name]
    assert _one_member(raw, LIMIT) is None, f"{name}: the fast path vouched for a body it cannot"
    assert outcome(gunzip, raw) == outcome(_gunzip_stream, raw)


def test_refusals_name_the_problem() -> None:
    assert outcome(gunzip, OTHER["trailing junk"])[1:3] == (400, "invalid_gzip")
    assert outcome(gunzip, OTHER["a member twice"]) == ("ok", PAYLOAD + PAYLOAD)
    too_big = outcome(gunzip, OTHER["one byte over the limit"])
    assert too_big[1] == 413 and "after decompression" in too_big[3]
    assert outcome(gunzip, OTHER["a bomb whose trailer lies"])[1] == 413


def test_fast_path_never_allocates_more_than_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """libdeflate sizes its output by the trailer: a trailer over the limit never reaches it."""
    seen: list[int] = []
    real = bodies.deflate.gzip_decompress

    def spy(data: bytes) -> bytearray:
        seen.append(int.from_bytes(data[-4:], "little"))
        return real(data)

    monkeypatch.setattr(bodies.deflate, "gzip_decompress", spy)
    lie = ONE[:-4] + (LIMIT * 1024).to_bytes(4, "little")
    assert outcome(gunzip, lie)[0] == "refused"
    assert outcome(gunzip, OTHER["a bomb that states its size"])[1] == 413
    assert all(size <= LIMIT for size in seen), seen

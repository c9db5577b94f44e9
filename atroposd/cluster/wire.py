"""The cluster endpoint's wire format and the secrets derived from the cluster token.

One message is one line: ``<mac> <json>\\n``, where ``mac`` is the hex HMAC-SHA256 of the
JSON bytes under a key derived from the token (``auth_key``). Every message in both
directions is signed and checked (constant-time compare) before its JSON is parsed; the
token itself never travels. The one unsigned message is a refusal a head sends to a peer
whose messages it cannot verify (its mac is ``-``): the peer has another token, so nothing
signed could reach it, and it must still learn why it was turned away. A node takes it only
before its first welcome; once welcomed, only a signed refusal ends it.

The token also gives the trainer ranks' c10d store prefix (``store_secret``; the inference
servers' token, ``config.inference_secret``, is derived the same way under its own label): the store has
no authentication of its own, so keys only a holder of the token can name keep a stray
client from reading or writing the group's keys by accident (SPEC §12.3, Trust).

A leaf of the ``cluster`` package: standard library and orjson only.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

import orjson

__all__ = [
    "MAX_JOIN_BYTES",
    "MAX_MESSAGE_BYTES",
    "BadMessage",
    "Channel",
    "WrongToken",
    "auth_key",
    "decode",
    "encode",
    "encode_unsigned",
    "store_secret",
]

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# The longest line a connection may send before it has joined (a join is a few hundred bytes):
# a stranger never makes the head buffer more than this.
MAX_JOIN_BYTES = 64 * 1024
_READ_CHUNK = 64 * 1024
_AUTH_LABEL = b"atroposd cluster endpoint v1"
_STORE_LABEL = b"atroposd c10d store prefix v1"
_RANKS_LABEL = b"atroposd trainer rank commands v1"
UNSIGNED = b"-"
_MAC_LEN = 64  # hex SHA-256


def auth_key(token: bytes) -> bytes:
    """The key that signs every message of the cluster endpoint (HMAC of a fixed label)."""
    return hmac.new(token, _AUTH_LABEL, hashlib.sha256).digest()


def store_secret(token: bytes) -> str:
    """A secret for the trainer ranks' c10d store prefix: 32 hex characters, the same on every
    node that holds the token, unrelated to the endpoint's signing key."""
    return hmac.new(token, _STORE_LABEL, hashlib.sha256).hexdigest()[:32]


def ranks_key(token: bytes) -> bytes:
    """The trainer ranks' command key (SPEC §12.1): the same on every node that holds the token,
    given to each rank in its environment, never written to the store."""
    return hmac.new(token, _RANKS_LABEL, hashlib.sha256).digest()


class BadMessage(ValueError):
    """A line that is not a message of this protocol (framing, JSON, or not an object)."""


class WrongToken(BadMessage):
    """A message whose signature does not verify: the peer holds another cluster token."""


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).hexdigest().encode()


def encode(key: bytes, msg: Mapping[str, Any]) -> bytes:
    body = orjson.dumps(msg)
    return _mac(key, body) + b" " + body + b"\n"


def encode_unsigned(msg: Mapping[str, Any]) -> bytes:
    """A refusal to a peer that holds another token (the only unsigned message)."""
    return UNSIGNED + b" " + orjson.dumps(msg) + b"\n"


def decode(key: bytes, line: bytes, *, allow_unsigned_refusal: bool = False) -> dict[str, Any]:
    """The message of one line, its signature checked first (WrongToken when it does not
    verify). ``allow_unsigned_refusal``: accept an unsigned ``refused`` (a joining node)."""
    mac, sep, body = line.rstrip(b"\n").partition(b" ")
    if not sep or not body:
        raise BadMessage("not a message of the atroposd cluster protocol")
    if mac == UNSIGNED:
        msg = _parse(body)
        if allow_unsigned_refusal and msg.get("t") == "refused":
            return msg
        raise WrongToken("an unsigned message")
    if len(mac) != _MAC_LEN or mac.strip(b"0123456789abcdef"):
        raise BadMessage("not a message of the atroposd cluster protocol")
    if not hmac.compare_digest(mac, _mac(key, body)):
        raise WrongToken("a message not signed with this cluster's token")
    return _parse(body)


def _parse(body: bytes) -> dict[str, Any]:
    try:
        msg = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadMessage(f"a message that is not JSON: {exc}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise BadMessage("a message that is not a JSON object with a type")
    return msg


class Channel:
    """One connection: signed messages out, checked messages in.

    Lines are read into a buffer of this channel's own, bounded by ``limit`` (a line longer is
    a BadMessage): the head gives a connection ``MAX_JOIN_BYTES`` until it has joined, and
    ``MAX_MESSAGE_BYTES`` after."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes, *,
                 limit: int = MAX_MESSAGE_BYTES) -> None:
        self.reader, self.writer, self.key = reader, writer, key
        self.limit = limit
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._lock = asyncio.Lock()
        self._buf = bytearray()

    async def send(self, msg: Mapping[str, Any]) -> None:
        async with self._lock:
            self.writer.write(encode(self.key, msg))
            await self.writer.drain()

    async def try_send(self, msg: Mapping[str, Any], timeout: float) -> bool:
        """``send`` within ``timeout``; False when the connection failed or the peer did not read."""
        try:
            await asyncio.wait_for(self.send(msg), timeout)
        except (OSError, asyncio.TimeoutError):
            return False
        return True

    async def send_unsigned(self, msg: Mapping[str, Any]) -> None:
        async with self._lock:
            self.writer.write(encode_unsigned(msg))
            await self.writer.drain()

    async def _readline(self) -> bytes:
        """The next line with its newline; b"" at the end of the stream (a line cut off by the
        end of the stream counts as the end). BadMessage past ``limit``."""
        searched = 0
        while True:
            end = self._buf.find(b"\n", searched)
            if end >= 0:
                if end >= self.limit:
                    raise BadMessage(f"a message longer than {self.limit} bytes")
                line = bytes(self._buf[: end + 1])
                del self._buf[: end + 1]
                return line
            if len(self._buf) >= self.limit:
                raise BadMessage(f"a message longer than {self.limit} bytes")
            searched = len(self._buf)
            chunk = await self.reader.read(min(_READ_CHUNK, self.limit + 1 - len(self._buf)))
            if not chunk:
                self._buf.clear()
                return b""
            self._buf += chunk

    async def recv(self, *, allow_unsigned_refusal: bool = False) -> dict[str, Any] | None:
        """The next message; None at the end of the stream (the peer closed or went away)."""
        line = await self._readline()
        if not line:
            return None
        return decode(self.key, line, allow_unsigned_refusal=allow_unsigned_refusal)

    def abort(self) -> None:
        """Drop the connection at once (no flush: the peer may be stopped)."""
        self.writer.transport.abort()

    async def close(self) -> None:
        if self.writer.is_closing():
            return
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), 1.0)
        except (OSError, asyncio.TimeoutError):
            self.abort()

"""The cluster endpoint's wire format: sessions of signed lines, and the secrets derived from
the cluster token.

One message is one line: ``<mac> <json>\n``, ``mac`` the hex HMAC-SHA256 of the JSON bytes. The
JSON is an envelope ``{"t": type, "sid": session, "dir": "h2n" | "n2h", "seq": n, "m": {fields}}``
(the fields: ``messages``). A connection runs one session:

1. the head sends a fresh random challenge (``hello``, unsigned: it proves nothing and needs
   nothing proved);
2. the node's ``join`` carries that challenge and a nonce of its own, signed under
   ``join_key(token, challenge)``: a join recorded on one connection verifies on no other;
3. the head answers in the session (``welcome`` or ``refused``) with a fresh session id. From
   then on every message carries the session id, its direction and a sequence number above the
   previous one in that direction, signed under that direction's key: ``session_keys`` derives
   the head→node and node→head keys from the token, the challenge and the node's nonce (HMAC
   under labels of their own), so each connection has keys of its own.

``Session.open`` checks a line in this order, before anything in it is acted on: the signature
(constant-time compare; a line that verifies under the other direction's key is one reflected
back), the envelope, the direction, the session id, the sequence number, then the message's
fields (``messages.decode``). Any failure is a :class:`BadMessage` whose ``reason`` labels the
drop counter; the token itself never travels. The unsigned messages are the ``hello`` and a
refusal the head sends to a peer whose join it cannot verify (the peer has another token, so
nothing signed could reach it, and it must still learn why it was turned away). A node takes that
refusal only before its first welcome; once welcomed, only a signed refusal ends it.

The token also gives the trainer ranks' c10d store prefix (``store_secret``; the inference
servers' token, ``config.inference_secret``, is derived the same way under its own label): the store has
no authentication of its own, so keys only a holder of the token can name keep a stray
client from reading or writing the group's keys by accident (SPEC §12.3, Trust).

A leaf of the ``cluster`` package: standard library, orjson and ``messages``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from typing import Any

import anyio
import orjson

from atroposd.cluster.messages import (
    CHALLENGE,
    DIRECTION,
    FIELDS,
    H2N,
    N2H,
    SEQUENCE,
    SESSION,
    BadMessage,
    Hello,
    Join,
    LineTooLong,
    Message,
    Refused,
    WrongToken,
    decode,
    fields,
)

__all__ = [
    "MAX_JOIN_BYTES",
    "MAX_MESSAGE_BYTES",
    "UNSIGNED",
    "BadMessage",
    "Channel",
    "LineTooLong",
    "Session",
    "WrongToken",
    "auth_key",
    "encode_unsigned",
    "head_session",
    "join_key",
    "new_challenge",
    "node_session",
    "open_join",
    "open_unsigned",
    "session_keys",
    "store_secret",
]

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# The longest line a connection may send before it has joined (a join is a few hundred bytes):
# a stranger never makes the head buffer more than this.
MAX_JOIN_BYTES = 64 * 1024
_READ_CHUNK = 64 * 1024
_AUTH_LABEL = b"atroposd cluster endpoint v1"
_JOIN_LABEL = b"atroposd cluster join v2"
_DIR_LABELS = {H2N: b"atroposd cluster head to node v2", N2H: b"atroposd cluster node to head v2"}
_STORE_LABEL = b"atroposd c10d store prefix v1"
_RANKS_LABEL = b"atroposd trainer rank commands v1"
UNSIGNED = b"-"
_MAC_LEN = 64  # hex SHA-256
_ENVELOPE = ("t", "sid", "dir", "seq", "m")
_UNSIGNED_TYPES = (Hello.TYPE, Refused.TYPE)


def auth_key(token: bytes) -> bytes:
    """The endpoint's root key (HMAC of a fixed label): every key of a session derives from it."""
    return hmac.new(token, _AUTH_LABEL, hashlib.sha256).digest()


def join_key(auth: bytes, challenge: str) -> bytes:
    """The key a join on the connection of ``challenge`` is signed with."""
    return hmac.new(auth, _JOIN_LABEL + b"\0" + challenge.encode(), hashlib.sha256).digest()


def session_keys(auth: bytes, challenge: str, nonce: str) -> dict[str, bytes]:
    """The key of each direction (``h2n``, ``n2h``) of the session of ``challenge`` and the node's
    ``nonce``."""
    salt = b"\0" + challenge.encode() + b"\0" + nonce.encode()
    return {d: hmac.new(auth, label + salt, hashlib.sha256).digest() for d, label in _DIR_LABELS.items()}


def new_challenge() -> str:
    """32 hex digits from the system's random source (a challenge, a nonce, a session id)."""
    return secrets.token_hex(16)


def store_secret(token: bytes) -> str:
    """A secret for the trainer ranks' c10d store prefix: 32 hex characters, the same on every
    node that holds the token, unrelated to the endpoint's signing key."""
    return hmac.new(token, _STORE_LABEL, hashlib.sha256).hexdigest()[:32]


def ranks_key(token: bytes) -> bytes:
    """The trainer ranks' command key (SPEC §12.1): the same on every node that holds the token,
    given to each rank in its environment, never written to the store."""
    return hmac.new(token, _RANKS_LABEL, hashlib.sha256).digest()


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).hexdigest().encode()


def _split(line: bytes) -> tuple[bytes, bytes]:
    mac, sep, body = line.rstrip(b"\n").partition(b" ")
    if not sep or not body:
        raise BadMessage("not a message of the atroposd cluster protocol")
    if mac != UNSIGNED and (len(mac) != _MAC_LEN or mac.strip(b"0123456789abcdef")):
        raise BadMessage("not a message of the atroposd cluster protocol")
    return mac, body


def _parse(body: bytes) -> dict[str, Any]:
    try:
        env = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadMessage(f"a message that is not JSON: {exc}") from None
    if not isinstance(env, dict) or not isinstance(env.get("t"), str):
        raise BadMessage("a message that is not a JSON object with a type")
    return env


def _envelope(env: dict[str, Any]) -> tuple[str, str, str, int, Any]:
    """The envelope's type, session id, direction, sequence number and fields: exactly those keys,
    each of its type (BadMessage, reason ``fields``)."""
    if set(env) != set(_ENVELOPE):
        missing = [k for k in _ENVELOPE if k not in env]
        raise BadMessage(
            "an envelope "
            + (f"without {', '.join(missing)}" if missing else f"with {len(env) - len(_ENVELOPE)} key(s) too many"),
            FIELDS,
        )
    t, sid, d, seq = env["t"], env["sid"], env["dir"], env["seq"]
    if not isinstance(sid, str) or not isinstance(d, str) or not isinstance(seq, int) or isinstance(seq, bool):
        raise BadMessage("an envelope whose sid, dir or seq is of the wrong type", FIELDS)
    return t, sid, d, seq, env["m"]


def _seal(key: bytes, msg: Message, sid: str, seq: int) -> bytes:
    body = orjson.dumps({"t": msg.TYPE, "sid": sid, "dir": msg.DIRECTION, "seq": seq, "m": fields(msg)})
    return _mac(key, body) + b" " + body + b"\n"


def encode_unsigned(msg: Message) -> bytes:
    """A ``hello``, or a refusal to a peer whose join did not verify (the only unsigned lines)."""
    if msg.TYPE not in _UNSIGNED_TYPES:
        raise ValueError(f"a {msg.TYPE!r} is always signed")
    return UNSIGNED + b" " + orjson.dumps({"t": msg.TYPE, "m": fields(msg)}) + b"\n"


def open_unsigned(line: bytes) -> Message:
    """The ``hello`` or refusal of an unsigned line (BadMessage for anything else)."""
    mac, body = _split(line)
    if mac != UNSIGNED:
        raise BadMessage("expected an unsigned hello or refusal, got a signed message")
    env = _parse(body)
    if env["t"] not in _UNSIGNED_TYPES:
        raise WrongToken(f"an unsigned {env['t'][:40]!r}")
    if set(env) != {"t", "m"}:
        raise BadMessage("an unsigned message with keys other than t and m", FIELDS)
    return decode(env["t"], env["m"], H2N)


class Session:
    """One connection's keys, session id and sequence numbers, one side of it.

    ``seal`` signs a message of this side's direction with the next sequence number; ``open``
    checks a line of the other side's (module docstring) and returns its message. A node's session
    learns its id from the head's first answer (``sid`` None until then)."""

    def __init__(self, *, sid: str | None, keys: dict[str, bytes], send_dir: str) -> None:
        self.sid = sid
        self.send_dir = send_dir
        self.recv_dir = N2H if send_dir == H2N else H2N
        self._send_key, self._recv_key = keys[send_dir], keys[self.recv_dir]
        self.send_seq = -1  # the last sequence number sent
        self.recv_seq = -1  # the last sequence number taken

    def seal(self, msg: Message, *, key: bytes | None = None) -> bytes:
        """``msg`` as a line of this session (``key``: the join's, for a node's first message)."""
        if msg.DIRECTION != self.send_dir:
            raise ValueError(f"a {msg.TYPE!r} is not sent in direction {self.send_dir}")
        self.send_seq += 1
        return _seal(key or self._send_key, msg, "" if key else self.sid or "", self.send_seq)

    def open(self, line: bytes) -> Message:
        """The message of one line of the peer's, every check passed; BadMessage (its ``reason``
        says which check failed) otherwise. Nothing of a refused line is kept."""
        mac, body = _split(line)
        if mac == UNSIGNED:
            raise WrongToken("an unsigned message inside a session")
        if not hmac.compare_digest(mac, _mac(self._recv_key, body)):
            if hmac.compare_digest(mac, _mac(self._send_key, body)):
                raise BadMessage("a message of this side's own direction (reflected back)", DIRECTION)
            raise WrongToken("a message whose signature does not verify under this session's key")
        t, sid, d, seq, m = _envelope(_parse(body))
        if d != self.recv_dir:
            raise BadMessage(f"a message of direction {d[:8]!r} where {self.recv_dir!r} is expected", DIRECTION)
        if self.sid is None:
            if len(sid) != 32:
                raise BadMessage("a first answer without a session id", FIELDS)
        elif sid != self.sid:
            raise BadMessage("a message of another session", SESSION)
        if seq <= self.recv_seq:
            raise BadMessage(
                f"sequence number {seq} is not above the last one taken ({self.recv_seq}): a replayed message", SEQUENCE
            )
        self.recv_seq = seq
        if self.sid is None:
            self.sid = sid
        return decode(t, m, self.recv_dir)


def node_session(auth: bytes, challenge: str, nonce: str) -> Session:
    """A node's side of the session it opens with ``nonce`` on the connection of ``challenge``."""
    return Session(sid=None, keys=session_keys(auth, challenge, nonce), send_dir=N2H)


def head_session(auth: bytes, challenge: str, nonce: str, sid: str) -> Session:
    """The head's side of a session whose join (seq 0) it has taken."""
    s = Session(sid=sid, keys=session_keys(auth, challenge, nonce), send_dir=H2N)
    s.recv_seq = 0
    return s


def open_join(auth: bytes, challenge: str, line: bytes) -> tuple[Session, dict[str, Any]]:
    """The head's check of a connection's first line: a join signed for ``challenge``. Returns the
    head's session (a fresh session id) and the join's fields, still to be decoded
    (``messages.decode``: a join whose fields do not check gets a signed refusal). Raises
    WrongToken (another token), BadMessage with reason ``challenge`` (a join signed for another
    connection: a recorded one, replayed) or another BadMessage (not the protocol)."""
    mac, body = _split(line)
    if mac == UNSIGNED:
        raise WrongToken("an unsigned message")
    if not hmac.compare_digest(mac, _mac(join_key(auth, challenge), body)):
        _refuse_join(auth, mac, body)
    t, sid, d, seq, m = _envelope(_parse(body))
    if t != Join.TYPE or d != N2H or sid or seq != 0:
        raise BadMessage("a first message that is not a join (type, direction, session or sequence)", FIELDS)
    if (
        not isinstance(m, dict)
        or m.get("challenge") != challenge
        or not isinstance(m.get("nonce"), str)
        or len(m["nonce"]) != 32
        or m["nonce"].strip("0123456789abcdef")
    ):
        raise BadMessage("a join without this connection's challenge and a nonce of 32 hex digits", FIELDS)
    return head_session(auth, challenge, m["nonce"], new_challenge()), m


def _refuse_join(auth: bytes, mac: bytes, body: bytes) -> None:
    """Why a join does not verify under this connection's challenge (always raises)."""
    try:
        env = orjson.loads(body)
    except orjson.JSONDecodeError:
        env = None
    if isinstance(env, dict):
        m = env.get("m")
        claimed = m.get("challenge") if isinstance(m, dict) else None
        if (
            isinstance(claimed, str)
            and len(claimed) == 32
            and hmac.compare_digest(mac, _mac(join_key(auth, claimed), body))
        ):
            raise BadMessage("a join signed for another connection's challenge (a recorded join, replayed)", CHALLENGE)
        if hmac.compare_digest(mac, _mac(auth, body)):
            raise BadMessage(
                "a message of an older version of the cluster protocol: every node must run the same atroposd version"
            )
    raise WrongToken("a message not signed with this cluster's token")


class Channel:
    """One connection: sealed messages out, checked messages in, through its ``session`` (set
    once the handshake made one; before that only unsigned lines and the join travel).

    Lines are read into a buffer of this channel's own, bounded by ``limit`` (a line longer is
    a LineTooLong): the head gives a connection ``MAX_JOIN_BYTES`` until it has joined, and
    ``MAX_MESSAGE_BYTES`` after. ``dropped``: the messages of this connection refused so far."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, limit: int = MAX_MESSAGE_BYTES
    ) -> None:
        self.reader, self.writer = reader, writer
        self.limit = limit
        self.session: Session | None = None
        self.dropped = 0
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._lock = asyncio.Lock()
        self._buf = bytearray()

    async def send(self, msg: Message, *, key: bytes | None = None) -> None:
        """``msg`` sealed in this channel's session (the sequence number taken in the order the
        lines are written); ``key``: the join's."""
        if self.session is None:
            raise RuntimeError("no session on this connection yet")
        async with self._lock:
            self.writer.write(self.session.seal(msg, key=key))
            await self.writer.drain()

    async def try_send(self, msg: Message, within: float) -> bool:
        """``send`` within ``within`` seconds; False when the connection failed or the peer did
        not read."""
        with anyio.move_on_after(within):
            try:
                await self.send(msg)
            except OSError:
                return False
            return True
        return False

    async def send_unsigned(self, msg: Message) -> None:
        async with self._lock:
            self.writer.write(encode_unsigned(msg))
            await self.writer.drain()

    async def readline(self) -> bytes:
        """The next line with its newline; b"" at the end of the stream (a line cut off by the
        end of the stream counts as the end). LineTooLong past ``limit``."""
        searched = 0
        while True:
            end = self._buf.find(b"\n", searched)
            if end >= 0:
                if end >= self.limit:
                    raise LineTooLong(f"a message longer than {self.limit} bytes")
                line = bytes(self._buf[: end + 1])
                del self._buf[: end + 1]
                return line
            if len(self._buf) >= self.limit:
                raise LineTooLong(f"a message longer than {self.limit} bytes")
            searched = len(self._buf)
            chunk = await self.reader.read(min(_READ_CHUNK, self.limit + 1 - len(self._buf)))
            if not chunk:
                self._buf.clear()
                return b""
            self._buf += chunk

    async def recv(self) -> Message | None:
        """The next message of the session; None at the end of the stream (the peer closed or
        went away). BadMessage for a line refused (its ``reason`` says why), counted in
        ``dropped``; LineTooLong ends what can be read of the connection."""
        line = await self.readline()
        if not line:
            return None
        if self.session is None:
            raise RuntimeError("no session on this connection yet")
        try:
            return self.session.open(line)
        except LineTooLong:
            raise
        except BadMessage:
            self.dropped += 1
            raise

    def abort(self) -> None:
        """Drop the connection at once (no flush: the peer may be stopped)."""
        self.writer.transport.abort()

    async def close(self) -> None:
        if self.writer.is_closing():
            return
        self.writer.close()
        try:
            with anyio.fail_after(1.0):
                await self.writer.wait_closed()
        except (OSError, TimeoutError):
            self.abort()

"""Fuzz of the cluster endpoint's messages: 10,000 lines to a real head over loopback, drawn from
the run's fuzz seed (``fuzzseed.rng``; printed in the report header, ``--fuzz-seed N`` replays it).

A tenth are first lines of fresh connections (a stranger's: random bytes, unsigned or
foreign-signed messages, lines past the 64 KiB bound, JSON that is not an object, signed joins
with odd ranks, hosts, units and components); the rest follow a valid join on an admitted
connection (signed messages of every kind with odd fields: reports of odd rows, beats with odd
sequence numbers, unknown kinds for the daemon's handler; now and then one that ends the
connection: garbage, an unsigned or oversized line, a leave). The head never lets an exception
out of a connection (the loop's exception handler stays silent), its watchdog keeps running,
its nodes view stays bounded and clean, and an honest node joins and is ready afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import random
from collections.abc import Mapping
from typing import Any

import pytest

from atroposd.cluster import READY, ClusterHead
from atroposd.cluster.membership import MAX_REPORT_ROWS, MAX_TEXT, clean_value
from atroposd.cluster.wire import MAX_JOIN_BYTES, auth_key
from atroposd.config import ClusterConfig
from tests import fuzzseed
from tests.cluster.conftest import until
from tests.cluster.test_endpoint import READY_REPLICA, TOKEN, running_node

pytestmark = pytest.mark.anyio

CASES = max(10, int(10_000 * float(os.environ.get("ATROPOSD_FUZZ_SCALE", "1"))))
KINDS = ("join", "beat", "report", "stopped", "leave", "rank_exit", "resync", "ranks", "refused", "welcome",
         "ack", "stop", "", "x" * 300)
ODD_STRINGS = ("", "\x1b[2J\x1b[31mred", "\x1b]0;title\x07", "\x9b1m", "a\nb\rc\td", "\x00\x7f\x85", "é𝛑", "%s%n", "../../etc/passwd", "' OR 1=1 --")
# ASCII with its control characters, C1 controls, and a spread of the Basic Multilingual Plane
ALPHABET = [chr(c) for c in range(0x80)] + [chr(c) for c in range(0x80, 0xa0)] + \
    [chr(c) for c in range(0xa0, 0xd800, 97)] + ["\U0001d6d1", "\ufeff", "\u202e"]
_POOL: str = ""  # random characters of ALPHABET, drawn once per run (strings are slices of it)
KEY = auth_key(TOKEN)
FOREIGN = auth_key(b"another-secret-of-another-job")


def encode(key: bytes, msg: Mapping[str, Any]) -> bytes:
    """A signed line as the wire's, through the standard library's JSON (which writes integers
    past 64 bits and escapes lone surrogates: values the wire's encoder never sends)."""
    body = json.dumps(msg).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest().encode() + b" " + body + b"\n"


def encode_unsigned(msg: Mapping[str, Any]) -> bytes:
    return b"- " + json.dumps(msg).encode() + b"\n"


def _draw_pool(r: random.Random) -> None:
    global _POOL
    _POOL = "".join(r.choices(ALPHABET, k=1 << 16))


def _string(r: random.Random) -> str:
    pick = r.random()
    if pick < 0.005:
        return r.choice(("\ud800", "\udfff\ud800"))  # lone surrogates: JSON the head cannot read
    if pick < 0.4:
        return r.choice(ODD_STRINGS)
    if pick < 0.5:
        return r.choice(ODD_STRINGS) * r.randint(1, 200)
    start = r.randrange(len(_POOL) - 40)
    return _POOL[start:start + r.randint(0, 40)]


def _value(r: random.Random, depth: int = 0) -> Any:
    pick = r.random()
    if depth > 3 or pick < 0.15:
        return r.choice([None, True, False, 0, -1, 2**63, -(2**70), 1e308, -0.0, 3.5])
    if pick < 0.45:
        return _string(r)
    if pick < 0.6:
        return r.randint(-5, 5)
    if pick < 0.8:
        return [_value(r, depth + 1) for _ in range(r.randint(0, 4))]
    return {_string(r)[:40]: _value(r, depth + 1) for _ in range(r.randint(0, 4))}


def _rows(r: random.Random) -> Any:
    pick = r.random()
    if pick < 0.2:
        return _value(r)
    n = r.choice((0, 1, 3, 40, 300)) if r.random() < 0.1 else r.randint(0, 3)
    return [{"name": _string(r), "kind": r.choice(("inference", "env", "trainer", _string(r))),
             "state": r.choice(("ready", "starting", _string(r))), "pid": _value(r), "extra": _value(r)}
            if r.random() < 0.9 else _value(r) for _ in range(n)]


def _message(r: random.Random, kind: str | None = None) -> dict[str, Any]:
    kind = kind if kind is not None else r.choice(KINDS)
    msg: dict[str, Any] = {"t": kind}
    for _ in range(r.randint(0, 3)):
        msg[_string(r)[:20]] = _value(r)
    if kind == "join":
        msg.update(node_rank=r.choice((1, 2, 0, -1, 3, 99, 2**64, True, "1", 1.0, None)), host=_value(r),
                   instance=_value(r), units=_value(r) if r.random() < 0.5 else {"trainer_ranks": _value(r)},
                   components=_rows(r), pid=_value(r), ready=_value(r), rejoin=_value(r) if r.random() < 0.3 else False,
                   head_instance=_value(r))
    elif kind == "report":
        msg.update(components=_rows(r), ready=_value(r))
    elif kind == "beat":
        msg["seq"] = _value(r)
    elif kind in ("rank_exit", "resync", "ranks", "leave"):
        msg.update(name=_value(r), how=_value(r), replica=_value(r), op=_value(r), generation=_value(r),
                   reason=_value(r))
    return msg


def _stranger_line(r: random.Random) -> bytes:
    """The first line of a connection that has not joined."""
    pick = r.random()
    if pick < 0.15:
        return bytes(r.getrandbits(8) for _ in range(r.randint(0, 300))) + b"\n"
    if pick < 0.25:
        return encode_unsigned(_message(r))
    if pick < 0.35:
        return encode(FOREIGN, _message(r, "join"))
    if pick < 0.40:
        return b"x" * r.randint(MAX_JOIN_BYTES - 10, MAX_JOIN_BYTES + 10) + b"\n"
    if pick < 0.45:
        return encode(KEY, {"t": "join"})[:-1] + b"garbage\n"  # a mac that no longer verifies
    if pick < 0.5:
        body = json.dumps(_value(r)).encode()
        return encode(KEY, {"t": "x"}).split(b" ", 1)[0][:-1] + b"0 " + body + b"\n"
    return encode(KEY, _message(r, "join" if r.random() < 0.7 else None))


def _node_line(r: random.Random) -> tuple[bytes, bool]:
    """A line on an admitted connection, and whether it may end the connection."""
    pick = r.random()
    if pick < 0.01:
        return bytes(r.getrandbits(8) for _ in range(r.randint(1, 100))) + b"\n", True
    if pick < 0.015:
        return encode_unsigned(_message(r)), True
    if pick < 0.02:
        return encode(FOREIGN, _message(r)), True
    if pick < 0.025:
        return encode(KEY, {"t": "leave", "reason": _value(r)}), True
    if pick < 0.026:
        return b"z" * (4 * 1024 * 1024 + 1) + b"\n", True  # past the bound of an admitted connection
    msg = _message(r, r.choice([k for k in KINDS if k != "leave"]))
    return encode(KEY, msg), False


async def _stranger(port: int, line: bytes, slots: asyncio.Semaphore) -> None:
    async with slots:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return
        try:
            writer.write(line)
            with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
                await asyncio.wait_for(writer.drain(), 5)
            # the head answers every line (a refusal, or a welcome) or closes at once (over the cap)
            with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
                await asyncio.wait_for(reader.readline(), 5)
        finally:
            writer.transport.abort()


async def _node_session(port: int, rank: int, lines: list[bytes]) -> None:
    """A valid join, then ``lines``; a beat whose ack shows the head read them all (unless one
    ended the connection)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(encode(KEY, {"t": "join", "node_rank": rank, "host": f"fuzz-{rank}", "instance": f"i{rank}",
                                  "units": {}, "components": [], "ready": False}))
        for line in lines:
            writer.write(line)
        writer.write(encode(KEY, {"t": "beat", "seq": "sentinel"}))
        with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
            await asyncio.wait_for(writer.drain(), 10)
        buffered = b""
        with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
            while b'"seq":"sentinel"' not in buffered:
                chunk = await asyncio.wait_for(reader.read(65536), 10)
                if not chunk:
                    break
                buffered += chunk
    finally:
        writer.transport.abort()


async def test_the_endpoint_survives_fuzzed_messages_and_still_serves(cfg: ClusterConfig) -> None:
    r = fuzzseed.rng("cluster-endpoint")
    _draw_pool(r)
    errors: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    seen: list[dict[str, Any]] = []

    def on_message(rank: int, msg: dict[str, Any]) -> None:
        seen.append(clean_value(msg))  # what the daemon's handler gets, bounded as it would read it

    head = ClusterHead(cfg, token=TOKEN, host="head-host", on_message=on_message, join_deadline=2.0)
    await head.start()
    head.report([READY_REPLICA])
    try:
        strangers = CASES // 10
        slots = asyncio.Semaphore(6)
        await asyncio.gather(*(_stranger(head.port, _stranger_line(r), slots) for _ in range(strangers)))
        sent = strangers
        while sent < CASES:
            batch: list[bytes] = []
            while sent < CASES and len(batch) < 200:
                line, ends = _node_line(r)
                batch.append(line)
                sent += 1
                if ends:
                    break
            await _node_session(head.port, r.choice((1, 2)), batch)
        hint = fuzzseed.replay_hint()
        assert not errors, f"{hint}: {errors[:3]}"
        assert head._watch is not None and not head._watch.done(), hint
        for row in head.nodes():
            assert len(row["components"]) <= MAX_REPORT_ROWS, hint
            for value in (row["host"], row["reason"], *(str(c) for c in row["components"])):
                assert value is None or not any(ch in value for ch in "\x1b\x9b\x07"), (hint, value[:200])
            assert row["host"] is None or len(row["host"]) <= MAX_TEXT, hint
        # an honest node still joins and is ready
        async with running_node(cfg, 1, host="honest") as (node, _):
            node.report([READY_REPLICA])
            await until(lambda: head.nodes()[1]["state"] == READY and head.nodes()[1]["host"] == "honest", 10,
                        "the honest node ready after the fuzz")
        assert not errors, f"{hint}: {errors[:3]}"
    finally:
        await head.close()
        loop.set_exception_handler(None)

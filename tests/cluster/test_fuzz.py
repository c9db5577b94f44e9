"""Fuzz of the cluster endpoint's messages: 10,000 lines to a real head over loopback, drawn from
the run's fuzz seed (``fuzzseed.rng``; printed in the report header, ``--fuzz-seed N`` replays it).

A tenth are first lines of fresh connections, sent after the head's hello (a stranger's: random
bytes, unsigned or foreign-signed messages, lines past the 64 KiB bound, JSON that is not an
object, joins signed for another connection's challenge, signed joins with odd ranks, hosts,
units and components, fields missing, extra or of the wrong type); the rest follow a valid join
on an admitted connection (signed messages of every kind with odd fields, envelopes of odd
shape, replayed lines, lines of the head's direction, unsigned and foreign-signed lines; now and
then one that ends the connection: an oversized line, a leave). The head never lets an exception
out of a connection (the loop's exception handler stays silent), its watchdog keeps running, its
nodes view stays bounded and clean, what it drops is counted, and an honest node joins and is
ready afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import random
from collections.abc import Callable
from typing import Any

import pytest

from atroposd.cluster import READY, ClusterHead
from atroposd.cluster.membership import MAX_REPORT_ROWS, MAX_TEXT, clean_value
from atroposd.cluster.messages import REASONS, Ack, Beat, Message, fields
from atroposd.cluster.wire import MAX_JOIN_BYTES, BadMessage, auth_key, join_key, new_challenge
from atroposd.config import ClusterConfig
from tests import fuzzseed
from tests.cluster.conftest import RawNode, until
from tests.cluster.test_endpoint import READY_REPLICA, TOKEN, running_node

pytestmark = pytest.mark.anyio

CASES = max(10, int(10_000 * float(os.environ.get("ATROPOSD_FUZZ_SCALE", "1"))))
KINDS = (
    "join",
    "beat",
    "report",
    "stopped",
    "leave",
    "rank_exit",
    "resync",
    "ranks",
    "ranks_stopped",
    "refused",
    "welcome",
    "ack",
    "stop",
    "hello",
    "replaced",
    "",
    "x" * 300,
)
NODE_KINDS = ["beat", "report", "stopped", "rank_exit", "resync", "ranks_stopped"]
ODD_STRINGS = (
    "",
    "\x1b[2J\x1b[31mred",
    "\x1b]0;title\x07",
    "\x9b1m",
    "a\nb\rc\td",
    "\x00\x7f\x85",
    "é𝛑",
    "%s%n",
    "../../etc/passwd",
    "' OR 1=1 --",
)
# ASCII with its control characters, C1 controls, and a spread of the Basic Multilingual Plane
ALPHABET = (
    [chr(c) for c in range(0x80)]
    + [chr(c) for c in range(0x80, 0xA0)]
    + [chr(c) for c in range(0xA0, 0xD800, 97)]
    + ["\U0001d6d1", "\ufeff", "\u202e"]
)
_POOL: str = ""  # random characters of ALPHABET, drawn once per run (strings are slices of it)
KEY = auth_key(TOKEN)
FOREIGN = auth_key(b"another-secret-of-another-job")
# What a line becomes once the connection's challenge (a stranger's) or session (a node's) is known.
Recipe = Callable[[Any], bytes]


def sign(key: bytes, envelope: Any) -> bytes:
    """A signed line as the wire's, through the standard library's JSON (which writes integers
    past 64 bits and escapes lone surrogates: values the wire's encoder never sends)."""
    body = json.dumps(envelope).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest().encode() + b" " + body + b"\n"


def unsigned(envelope: Any) -> bytes:
    return b"- " + json.dumps(envelope).encode() + b"\n"


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
    return _POOL[start : start + r.randint(0, 40)]


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
    return [
        {
            "name": _string(r),
            "kind": r.choice(("inference", "env", "trainer", _string(r))),
            "state": r.choice(("ready", "starting", _string(r))),
            "pid": _value(r),
            "extra": _value(r),
        }
        if r.random() < 0.9
        else _value(r)
        for _ in range(n)
    ]


def _object_rows(r: random.Random) -> list[dict[str, Any]]:
    rows = _rows(r)
    return [row for row in rows if isinstance(row, dict)] if isinstance(rows, list) else []


def _fields(r: random.Random, kind: str) -> dict[str, Any]:
    """Fields for a message of ``kind``: of the right names and types most of the time, odd values
    within them; now and then one missing, one too many, or one of another type."""
    draw: dict[str, Callable[[], dict[str, Any]]] = {
        "join": lambda: {
            "node_rank": r.choice((1, 2, 0, -1, 3, 99, 2**62)),
            "host": _string(r),
            "pid": r.randint(-5, 2**31),
            "instance": _string(r),
            "units": {"trainer_ranks": _value(r)} if r.random() < 0.5 else {},
            "components": _object_rows(r) if r.random() < 0.8 else [],
            "ready": r.random() < 0.5,
            "rejoin": r.random() < 0.2,
            "head_instance": _string(r),
        },
        "report": lambda: {"components": _object_rows(r), "ready": r.random() < 0.5},
        "leave": lambda: {"reason": _string(r)},
        "rank_exit": lambda: {"name": _string(r), "how": _string(r)},
        "resync": lambda: {"replica": r.choice((0, 1, -1, 2**62))},
        "ranks": lambda: {"op": r.choice(("start", "stop")), "generation": r.randint(-3, 9), "launch": _string(r)},
        "refused": lambda: {"reason": _string(r), "fatal": r.random() < 0.5},
        "ack": lambda: {"beat": r.randint(0, 9)},
        "replaced": lambda: {"by_pid": r.randint(0, 9)},
        "hello": lambda: {"challenge": new_challenge()},
        "welcome": lambda: {"head_instance": _string(r), "head_host": _string(r), "nodes": 3, "interval": 0.5},
    }
    typed = draw[kind]() if kind in draw else {}
    pick = r.random()
    if pick < 0.04 and typed:
        typed.pop(r.choice(list(typed)))
    elif pick < 0.08:
        typed[_string(r)[:20] or "extra"] = _value(r)
    elif pick < 0.12 and typed:
        typed[r.choice(list(typed))] = _value(r)
    elif pick < 0.13:
        return _value(r)  # type: ignore[no-any-return]
    return typed


def _join(m: Any, challenge: str, nonce: str) -> dict[str, Any]:
    """A join's envelope around fields drawn before (``_fields``), for ``challenge``."""
    if isinstance(m, dict):
        m = {**m, "challenge": challenge, "nonce": nonce}
    return {"t": "join", "sid": "", "dir": "n2h", "seq": 0, "m": m}


def _stranger_line(r: random.Random) -> Recipe:
    """The first line of a connection that has not joined (given the head's challenge); everything
    random is drawn here, in order, so that a seed replays the same lines."""
    pick, m, nonce = r.random(), _fields(r, "join"), new_challenge()
    if pick < 0.15:
        junk = bytes(r.getrandbits(8) for _ in range(r.randint(0, 300))) + b"\n"
        return lambda challenge: junk
    if pick < 0.25:
        return lambda challenge: unsigned(_join(m, challenge, nonce))
    if pick < 0.32:
        return lambda challenge: sign(FOREIGN, _join(m, challenge, nonce))
    if pick < 0.40:
        other = new_challenge()  # a join recorded on another connection, replayed here
        return lambda challenge: sign(join_key(KEY, other), _join(m, other, nonce))
    if pick < 0.44:
        n = r.randint(MAX_JOIN_BYTES - 10, MAX_JOIN_BYTES + 10)
        return lambda challenge: b"x" * n + b"\n"
    if pick < 0.48:  # an edited line: the signature no longer verifies
        return lambda challenge: sign(join_key(KEY, challenge), _join(m, challenge, nonce))[:-1] + b"x\n"
    if pick < 0.52:
        value = _value(r)
        return lambda challenge: sign(join_key(KEY, challenge), value)
    if pick < 0.6:  # an envelope of odd shape
        kind, seq = r.choice(KINDS), r.choice((0, 1, -1, "0", None))
        return lambda challenge: sign(join_key(KEY, challenge), {**_join(m, challenge, nonce), "t": kind, "seq": seq})
    return lambda challenge: sign(join_key(KEY, challenge), _join(m, challenge, nonce))


def _node_line(r: random.Random) -> tuple[Recipe, bool]:
    """A line on an admitted connection (given its RawNode), and whether it may end the connection."""
    pick = r.random()

    def sealed(kind: str, m: Any, **env: Any) -> Recipe:
        def make(node: RawNode) -> bytes:
            s = node.session
            assert s is not None
            if "seq" not in env:
                s.send_seq += 1
            envelope = {"t": kind, "sid": s.sid, "dir": "n2h", "seq": s.send_seq, "m": m, **env}
            return sign(node.keys[envelope["dir"]] if envelope["dir"] in node.keys else KEY, envelope)

        return make

    if pick < 0.01:
        junk = bytes(r.getrandbits(8) for _ in range(r.randint(1, 100))) + b"\n"
        return (lambda node: junk), False
    if pick < 0.02:
        env = {"t": "report", "m": {"components": [], "ready": True}}
        return (lambda node: unsigned(env)), False
    if pick < 0.03:
        m = _fields(r, "rank_exit")
        return (
            lambda node: sign(
                FOREIGN,
                {"t": "rank_exit", "sid": node.session.sid, "dir": "n2h", "seq": node.session.send_seq + 1, "m": m},
            )
        ), False
    if pick < 0.04:
        return (lambda node: node.last or b"\n"), False  # a replay of the previous line
    if pick < 0.05:  # a line of the head's direction
        return sealed(r.choice(("ack", "ranks", "stop")), _fields(r, "ranks"), dir="h2n"), False
    if pick < 0.06:  # another session, an old sequence number, odd envelope values
        return sealed(
            "beat",
            {},
            **r.choice(({"sid": new_challenge()}, {"seq": 0}, {"seq": -1}, {"seq": "1"}, {"dir": "x"}, {"extra": 1})),
        ), False
    if pick < 0.065:
        return sealed("leave", {"reason": _string(r)}), True
    if pick < 0.066:
        return (lambda node: b"z" * (4 * 1024 * 1024 + 1) + b"\n"), True  # past the bound of an admitted connection
    # mostly the kinds a node sends (a connection that delivers MAX_DROPPED bad lines is closed)
    kind = r.choice(NODE_KINDS if r.random() < 0.85 else [k for k in KINDS if k != "leave"])
    return sealed(kind, _fields(r, kind)), False


async def _stranger(port: int, recipe: Recipe, slots: asyncio.Semaphore) -> None:
    async with slots:
        try:
            node = await RawNode.connect(port, TOKEN)
        except OSError:
            return
        try:
            with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError, BadMessage, AssertionError):
                node.write(recipe(await node.hello()))
                await asyncio.wait_for(node.writer.drain(), 5)
                # the head answers every line (a refusal, or a welcome) or closes at once (over the cap)
                await asyncio.wait_for(node.reader.readline(), 5)
        finally:
            node.abort()


async def _node_session(port: int, rank: int, recipes: list[Recipe]) -> None:
    """A valid join, then the lines of ``recipes``; a beat whose ack shows the head read them all
    (unless one ended the connection)."""
    node = await RawNode.connect(port, TOKEN)
    try:
        await node.join(rank, host=f"fuzz-{rank}", instance=f"i{rank}")
        for recipe in recipes:
            node.write(recipe(node))
        node.write(node.seal(Beat()))
        sentinel = node.session.send_seq if node.session else -1
        with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError):
            await asyncio.wait_for(node.writer.drain(), 10)
        with contextlib.suppress(ConnectionError, OSError, asyncio.TimeoutError, EOFError):
            while True:
                line = await asyncio.wait_for(node.reader.readline(), 10)
                if not line:
                    break
                with contextlib.suppress(BadMessage):
                    assert node.session is not None
                    msg = node.session.open(line)
                    if isinstance(msg, Ack) and msg.beat == sentinel:
                        break
    finally:
        node.abort()


async def test_the_endpoint_survives_fuzzed_messages_and_still_serves(cfg: ClusterConfig) -> None:
    r = fuzzseed.rng("cluster-endpoint")
    _draw_pool(r)
    errors: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    seen: list[dict[str, Any]] = []

    def on_message(rank: int, msg: Message) -> None:
        seen.append(clean_value(fields(msg)))  # what the daemon's handler gets, bounded as it would read it

    head = ClusterHead(cfg, token=TOKEN, host="head-host", on_message=on_message, join_deadline=2.0)
    await head.start()
    head.report([READY_REPLICA])
    try:
        strangers = CASES // 10
        slots = asyncio.Semaphore(6)
        await asyncio.gather(*(_stranger(head.port, _stranger_line(r), slots) for _ in range(strangers)))
        sent = strangers
        while sent < CASES:
            batch: list[Recipe] = []
            while sent < CASES and len(batch) < 30:
                line, ends = _node_line(r)
                batch.append(line)
                sent += 1
                if ends:
                    break
            await _node_session(head.port, r.choice((1, 2)), batch)
        hint = fuzzseed.replay_hint()
        assert not errors, f"{hint}: {errors[:3]}"
        assert head._runner is not None and not head._runner.done(), hint  # the watchdog's and handlers' task
        # every kind of bad line was met, dropped and counted by its reason
        dropped = head.dropped
        if CASES >= 5000:
            assert all(dropped[reason] > 0 for reason in REASONS), (hint, dropped)
        for row in head.nodes():
            assert len(row["components"]) <= MAX_REPORT_ROWS, hint
            for value in (row["host"], row["reason"], *(str(c) for c in row["components"])):
                assert value is None or not any(ch in value for ch in "\x1b\x9b\x07"), (hint, value[:200])
            assert row["host"] is None or len(row["host"]) <= MAX_TEXT, hint
        # an honest node still joins and is ready
        async with running_node(cfg, 1, host="honest") as (node, _):
            node.report([READY_REPLICA])
            await until(
                lambda: head.nodes()[1]["state"] == READY and head.nodes()[1]["host"] == "honest",
                10,
                "the honest node ready after the fuzz",
            )
        assert not errors, f"{hint}: {errors[:3]}"
    finally:
        await head.close()
        loop.set_exception_handler(None)

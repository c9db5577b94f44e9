"""The cluster messages (one dataclass per type) and their strict decoding, and a fuzz of the
decoder: whatever a line holds, checking it raises nothing but the typed refusal (BadMessage,
its reason one of the counter's labels). Cases come from the run's fuzz seed (``fuzzseed.rng``;
``--fuzz-seed N`` replays them)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import random
from typing import Any

import pytest

from atroposd.cluster import messages as m
from atroposd.cluster.messages import H2N, N2H, REASONS, BadMessage, Message, decode, fields
from atroposd.cluster.wire import (
    auth_key,
    encode_unsigned,
    head_session,
    join_key,
    new_challenge,
    node_session,
    open_join,
    open_unsigned,
    session_keys,
)
from tests import fuzzseed

CASES = max(100, int(10_000 * float(os.environ.get("ATROPOSD_FUZZ_SCALE", "1"))))
AUTH = auth_key(b"the-shared-secret-of-this-job")
HEX = "0123456789abcdef" * 2

SAMPLES: list[Message] = [
    m.Hello(challenge=HEX),
    m.Join(
        challenge=HEX,
        nonce=HEX,
        node_rank=1,
        host="n1",
        pid=42,
        instance="i",
        units={"trainer_ranks": 1},
        components=[{"name": "inference", "state": "ready"}],
        ready=True,
        rejoin=False,
        head_instance="",
    ),
    m.Welcome(head_instance="h", head_host="head", nodes=2, interval=0.5),
    m.Refused(reason="no", fatal=False),
    m.Beat(),
    m.Ack(beat=3),
    m.Report(components=[], ready=True),
    m.Stop(),
    m.Stopped(),
    m.Leave(reason="bye"),
    m.Replaced(by_pid=7),
    m.Ranks(op="start", generation=2),
    m.RanksStopped(),
    m.RankExit(name="trainer-1", how="exited 1"),
    m.Resync(replica=0),
    m.CanaryAsk(request=1, replica=0, prompts=[{"ids": [3, 4, 5]}], max_tokens=16),
    m.CanaryAnswer(request=1, replica=0, answers=[{"tokens": [7], "logprobs": [-0.5], "weight_version": 2}]),
    m.Care(request=2, replica=0, op="quarantine", reason="canary drift 0.3 over drift_limit 0.05"),
    m.Cared(request=2, replica=0, ok=True),
]


def _pair() -> tuple[Any, Any]:
    """A node's and the head's side of one session (join and welcome taken)."""
    challenge, nonce = new_challenge(), new_challenge()
    head = head_session(AUTH, challenge, nonce, new_challenge())
    node = node_session(AUTH, challenge, nonce)
    node.sid, node.send_seq, node.recv_seq = head.sid, 0, -1
    return node, head


def test_every_type_is_sampled_and_round_trips_through_a_session() -> None:
    assert {type(s) for s in SAMPLES} == set(m.MESSAGES.values())
    for sample in SAMPLES:
        node, head = _pair()
        sender, receiver = (node, head) if sample.DIRECTION == N2H else (head, node)
        assert receiver.open(sender.seal(sample)) == sample
        assert decode(sample.TYPE, json.loads(json.dumps(fields(sample))), sample.DIRECTION) == sample


@pytest.mark.parametrize(
    ("kind", "values", "direction", "says"),
    [
        ("nope", {}, N2H, "unknown message type 'nope'"),
        (3, {}, N2H, "unknown message type '3'"),
        ("stop", {}, N2H, "a 'stop' is sent from the head to a node, not from a node to the head"),
        ("resync", [], N2H, "the fields of a 'resync' must be an object, not a list"),
        ("resync", {}, N2H, "a 'resync' without its field 'replica'"),
        ("resync", {"replica": 0, "extra": 1}, N2H, "a 'resync' has no field 'extra'"),
        ("resync", {"replica": "0"}, N2H, "a 'resync' whose 'replica' is a string, not an integer"),
        ("resync", {"replica": True}, N2H, "a 'resync' whose 'replica' is a boolean, not an integer"),
        ("report", {"components": [1], "ready": True}, N2H, "whose 'components' is a list, not a list of objects"),
        ("report", {"components": [], "ready": 1}, N2H, "whose 'ready' is an integer, not a boolean"),
        ("ranks", {"op": "reboot", "generation": 1}, H2N, "whose 'op' is a string, not 'start' or 'stop'"),
        (
            "welcome",
            {"head_instance": "h", "head_host": "h", "nodes": 2, "interval": None},
            H2N,
            "whose 'interval' is null, not a number",
        ),
        ("hello", {"challenge": "xyz"}, H2N, "a 'hello' whose 'challenge' is not 32 hex digits"),
    ],
)
def test_a_message_that_does_not_check_is_refused_naming_the_problem(
    kind: Any, values: Any, direction: str, says: str
) -> None:
    with pytest.raises(BadMessage) as err:
        decode(kind, values, direction)
    assert says in str(err.value) and err.value.reason == "fields"


def test_a_session_refuses_each_kind_of_bad_line_with_its_reason() -> None:
    node, head = _pair()
    line = node.seal(m.Resync(replica=0))
    assert head.open(line) == m.Resync(replica=0)
    keys = session_keys(AUTH, "a" * 32, "b" * 32)

    def reason(session: Any, text: bytes) -> str:
        with pytest.raises(BadMessage) as err:
            session.open(text)
        return err.value.reason

    assert reason(head, line) == "sequence"  # the same line again
    assert reason(head, line.replace(b'"replica":0', b'"replica":1')) == "mac"
    assert reason(node, line) == "direction"  # reflected back to its sender
    other = head_session(AUTH, "a" * 32, "b" * 32, "c" * 32)
    assert reason(other, node_session(AUTH, "a" * 32, "b" * 32).seal(m.Beat())) == "session"
    assert keys["h2n"] != keys["n2h"]
    assert reason(head, b"- {}\n") == "mac" and reason(head, b"garbage\n") == "framing"


def test_a_join_verifies_only_on_the_connection_of_its_challenge() -> None:
    challenge, nonce = new_challenge(), new_challenge()
    join = node_session(AUTH, challenge, nonce).seal(
        m.Join(**{**fields(SAMPLES[1]), "challenge": challenge, "nonce": nonce}), key=join_key(AUTH, challenge)
    )
    session, values = open_join(AUTH, challenge, join)
    assert decode("join", values, N2H).node_rank == 1 and session.sid and session.recv_seq == 0
    with pytest.raises(BadMessage) as err:
        open_join(AUTH, new_challenge(), join)
    assert err.value.reason == "challenge" and "another connection's challenge" in str(err.value)
    with pytest.raises(BadMessage) as err:
        open_join(auth_key(b"another-token"), challenge, join)
    assert err.value.reason == "mac"


# ----------------------------------------------------------------------------- the fuzz


def _value(r: random.Random, depth: int = 0) -> Any:
    pick = r.random()
    if depth > 3 or pick < 0.2:
        return r.choice(
            [
                None,
                True,
                False,
                0,
                -1,
                1,
                2**63,
                -(2**70),
                1e308,
                float("nan"),
                -0.0,
                3.5,
                "",
                "start",
                "stop",
                HEX,
                "\ud800",
                "é\x1b[2J",
            ]
        )
    if pick < 0.4:
        return "".join(chr(r.randrange(0x20, 0x3000)) for _ in range(r.randint(0, 12)))
    if pick < 0.6:
        return [_value(r, depth + 1) for _ in range(r.randint(0, 3))]
    keys = [f.name for cls in m.MESSAGES.values() for f in cls.__dataclass_fields__.values()]
    return {
        r.choice(keys) if r.random() < 0.7 else str(_value(r, 3)): _value(r, depth + 1) for _ in range(r.randint(0, 5))
    }


def _fields_of(r: random.Random, kind: str) -> Any:
    """Mostly the fields of ``kind`` (a sample's), some replaced, dropped or added."""
    sample = next((s for s in SAMPLES if s.TYPE == kind), None)
    out: Any = dict(fields(sample)) if sample is not None else _value(r)
    if isinstance(out, dict):
        for _ in range(r.randint(0, 2)):
            action, name = r.random(), r.choice([*out, "x"]) if out else "x"
            if action < 0.4:
                out[name] = _value(r)
            elif action < 0.7:
                out.pop(name, None)
            else:
                out[str(_value(r, 3))[:10]] = _value(r)
    return out


def _envelope(r: random.Random, sid: str) -> Any:
    kind = r.choice([*m.MESSAGES, "", "x" * 50]) if r.random() < 0.9 else _value(r)
    env: dict[str, Any] = {
        "t": kind,
        "sid": sid if r.random() < 0.9 else _value(r),
        "dir": r.choice(["n2h", "h2n", "x"]),
        "seq": r.choice([1, 2, 0, -1, 2**40, "1", None]),
        "m": _fields_of(r, kind) if isinstance(kind, str) else _value(r),
    }
    if r.random() < 0.1:
        env.pop(r.choice(list(env)))
    if r.random() < 0.1:
        env[r.choice(["extra", "t2", "m2"])] = _value(r)
    return env if r.random() < 0.95 else _value(r)


def _sign(key: bytes, obj: Any) -> bytes:
    body = json.dumps(obj).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest().encode() + b" " + body + b"\n"


def _mutate(r: random.Random, line: bytes) -> bytes:
    b = bytearray(line)
    for _ in range(r.randint(1, 3)):
        op = r.random()
        if op < 0.4 and b:
            b[r.randrange(len(b))] = r.randrange(256)
        elif op < 0.7 and b:
            del b[r.randrange(len(b)) :][: r.randint(1, 20)]
        else:
            b[r.randrange(len(b) + 1) : 0] = bytes(r.getrandbits(8) for _ in range(r.randint(1, 8)))
    return bytes(b)


def test_the_decoder_raises_nothing_but_the_typed_refusal() -> None:
    r = fuzzseed.rng("cluster-decoder")
    hint = fuzzseed.replay_hint()
    challenge, nonce = new_challenge(), new_challenge()
    keys = session_keys(AUTH, challenge, nonce)
    taken = refused = 0
    for i in range(CASES):
        node, head = _pair()
        pick = r.random()
        if pick < 0.45:  # signed with the right key: the envelope and the fields are what is tested
            line = _sign(keys["n2h"] if r.random() < 0.8 else keys["h2n"], _envelope(r, head.sid))
            node_side = head_session(AUTH, challenge, nonce, head.sid)
        elif pick < 0.6:
            line = _mutate(r, node.seal(r.choice([s for s in SAMPLES if s.DIRECTION == N2H])))
            node_side = head
        elif pick < 0.7:
            line = b"- " + json.dumps(_envelope(r, "")).encode() + b"\n"
            node_side = head
        elif pick < 0.8:
            line = _mutate(r, encode_unsigned(r.choice([SAMPLES[0], SAMPLES[3]])))
            node_side = head
        elif pick < 0.9:
            env = _envelope(r, "")
            line = _sign(join_key(AUTH, challenge), env) if r.random() < 0.7 else _mutate(r, _sign(AUTH, env))
            node_side = head
        else:
            line = bytes(r.getrandbits(8) for _ in range(r.randint(0, 80))) + b"\n"
            node_side = head
        for check in (
            node_side.open,
            open_unsigned,
            lambda x: open_join(AUTH, challenge, x),
            lambda x: decode(r.choice([*m.MESSAGES, "x"]), _fields_of(r, "join"), r.choice([N2H, H2N])),
        ):
            try:
                check(line)
                taken += 1
            except BadMessage as exc:
                refused += 1
                assert exc.reason in REASONS, (hint, i, exc.reason)
            except Exception as exc:  # anything else is a defect of the decoder
                raise AssertionError(f"{hint}: case {i}: {type(exc).__name__}: {exc} for {line[:300]!r}") from exc
    assert taken and refused, (taken, refused)

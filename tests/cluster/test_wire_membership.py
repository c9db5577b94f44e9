"""The cluster wire format (signed lines, derived secrets) and the membership bookkeeping."""

from __future__ import annotations

import pytest

from atroposd.cluster.membership import JOINING, LOST, READY, Membership, replicas_ready
from atroposd.cluster.messages import Beat, Hello, Refused, Stop
from atroposd.cluster.wire import (
    BadMessage,
    WrongToken,
    auth_key,
    encode_unsigned,
    head_session,
    new_challenge,
    node_session,
    open_unsigned,
    ranks_key,
    store_secret,
)


def test_a_sealed_message_opens_only_in_its_session() -> None:
    key = auth_key(b"secret-a")
    challenge, nonce = new_challenge(), new_challenge()
    node, head = node_session(key, challenge, nonce), head_session(key, challenge, nonce, new_challenge())
    head.recv_seq, node.sid = -1, head.sid  # no join nor welcome in this exchange
    line = node.seal(Beat())
    assert head.open(line) == Beat()
    assert b"secret-a" not in line  # the token never travels
    other = head_session(auth_key(b"secret-b"), challenge, nonce, head.sid or "")
    with pytest.raises(WrongToken):
        other.open(line)
    tampered = line.replace(b'"seq":0', b'"seq":1')
    with pytest.raises(WrongToken):
        head_session(key, challenge, nonce, head.sid or "").open(tampered)


def test_only_a_hello_or_a_refusal_may_be_unsigned() -> None:
    refusal = encode_unsigned(Refused(reason="wrong cluster token"))
    msg = open_unsigned(refusal)
    assert isinstance(msg, Refused) and msg.reason == "wrong cluster token"
    assert isinstance(open_unsigned(encode_unsigned(Hello(challenge="ab" * 16))), Hello)
    with pytest.raises(ValueError):
        encode_unsigned(Stop())
    with pytest.raises(WrongToken):
        open_unsigned(b'- {"t":"stop","m":{}}\n')
    with pytest.raises(WrongToken):  # inside a session nothing unsigned is taken
        node_session(auth_key(b"k"), new_challenge(), new_challenge()).open(refusal)


@pytest.mark.parametrize(
    "line", [b"\n", b"nospace\n", b"- [1,2]\n", b"- {not json}\n", b"GET / HTTP/1.0\r\n", b"abc {}\n"]
)
def test_garbage_is_a_bad_message(line: bytes) -> None:
    with pytest.raises(BadMessage):
        open_unsigned(line)
    with pytest.raises(BadMessage):
        node_session(auth_key(b"k"), new_challenge(), new_challenge()).open(line)


def test_store_secret_is_derived_from_the_token() -> None:
    a, b = store_secret(b"token-1"), store_secret(b"token-2")
    assert a == store_secret(b"token-1") and a != b
    assert len(a) == 32 and int(a, 16) >= 0
    assert a not in auth_key(b"token-1").hex() and "token-1" not in a
    # the trainer ranks' command key: per token, unrelated to the prefix and the endpoint's key
    k = ranks_key(b"token-1")
    assert k == ranks_key(b"token-1") != ranks_key(b"token-2") and len(k) == 32
    assert k != auth_key(b"token-1") and a not in k.hex()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_node_states_joining_ready_lost_and_the_view() -> None:
    clock = Clock()
    changes: list[tuple[int, str, str, str]] = []
    m = Membership(3, 5.0, clock=clock, on_change=lambda *c: changes.append(c))
    view = m.view()
    assert [(r["node_rank"], r["state"], r["host"]) for r in view] == [
        (0, JOINING, None),
        (1, JOINING, None),
        (2, JOINING, None),
    ]
    assert view[1]["reason"] == "not joined yet"
    m.report(0, [{"name": "inference", "kind": "inference", "state": "ready"}], True)
    replica = {"name": "inference", "kind": "inference", "state": "starting"}
    m.join(
        1,
        host="n1",
        address="10.0.0.2",
        pid=42,
        instance="x",
        units={"trainer_ranks": 2},
        components=[replica],
        ready=replicas_ready([replica]),
    )
    assert m.members[1].state == JOINING and m.members[1].reason.startswith("joined; waiting")
    m.report(1, [{**replica, "state": "ready"}], True)
    assert m.members[1].state == READY
    clock.now += 4.0
    assert m.silent() == []  # node 2 never joined: not silent, just joining
    clock.now += 2.0
    assert m.silent() == [1]
    m.lose(1, "no heartbeat for 5 s")
    row = m.view()[1]
    assert (row["state"], row["reason"], row["host"], row["pid"], row["units"]) == (
        LOST,
        "no heartbeat for 5 s",
        "n1",
        42,
        {"trainer_ranks": 2},
    )
    assert row["components"] == [{**replica, "state": "ready"}] and row["last_heartbeat_s"] == 6.0
    assert m.silent() == [] and not m.all_ready()
    assert changes == [(0, JOINING, READY, ""), (1, JOINING, READY, ""), (1, READY, LOST, "no heartbeat for 5 s")]


def test_a_node_is_ready_once_its_replicas_are() -> None:
    assert replicas_ready([])
    assert replicas_ready([{"kind": "env", "state": "backoff"}, {"kind": "inference", "state": "ready"}])
    assert not replicas_ready([{"kind": "inference", "state": "ready"}, {"kind": "inference", "state": "starting"}])


def test_the_heartbeat_board_stays_bounded_whatever_names_and_pids_arrive() -> None:
    """Any local process may send beats under any name and pid: the board keeps at most
    MAX_BOARD of each (the oldest half dropped), and the newest beats stay."""
    from atroposd.heartbeat import Beat
    from atroposd.process.liveness import MAX_BOARD, HeartbeatBoard

    board = HeartbeatBoard()
    for i in range(3 * MAX_BOARD):
        board.record(Beat(name=f"stranger-{i}", pid=100_000 + i, at=float(i)))
    assert len(board.by_name) <= MAX_BOARD and len(board.by_pid) <= MAX_BOARD
    last = 3 * MAX_BOARD - 1
    assert board.by_name[f"stranger-{last}"].at == last and board.by_pid[100_000 + last].at == last

"""The trainer group's store layout, commands and the follower's dispatch (SPEC §12.1), against a
real c10d TCPStore on loopback: typed commands round-trip, anything not signed by rank 0 of this
generation for this position is refused, a share and a broadcast value travel as checked data."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

from atroposd.trainer import group
from atroposd.trainer.group import (
    Apply,
    BadCommand,
    Canary,
    Checkpoint,
    Compute,
    Discard,
    Gather,
    GroupStore,
    Push,
    Reload,
    Stop,
    decode_command,
    encode_command,
)

KEY = bytes(range(32))
PREFIX = "s3cret/g1/"
COMMANDS = [
    Compute(),
    Apply(),
    Discard(),
    Stop(),
    Gather(("a.weight", "b.bias")),
    Gather(("x",), Push(1, 3, 7)),
    Reload("/w/v7", 7),
    Checkpoint("/c/.tmp-step-2"),
    Canary(),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.op)
def test_commands_round_trip(command: group.Command) -> None:
    value = encode_command(command, key=KEY, prefix=PREFIX, seq=5)
    assert decode_command(value, key=KEY, prefix=PREFIX, seq=5) == command
    assert b"\x80" not in value  # JSON after the MAC, never a pickle


def test_a_value_not_signed_for_this_position_is_refused() -> None:
    value = encode_command(Stop(), key=KEY, prefix=PREFIX, seq=5)
    with pytest.raises(BadCommand, match="bad MAC"):  # another key
        decode_command(value, key=bytes(32), prefix=PREFIX, seq=5)
    with pytest.raises(BadCommand, match="bad MAC"):  # replayed at another position
        decode_command(value, key=KEY, prefix=PREFIX, seq=6)
    with pytest.raises(BadCommand, match="bad MAC"):  # replayed from another generation
        decode_command(value, key=KEY, prefix="s3cret/g2/", seq=5)
    mac, _, body = value.partition(b".")
    with pytest.raises(BadCommand, match="bad MAC"):  # the body changed under its MAC
        decode_command(mac + b"." + body.replace(b"stop", b"apply"), key=KEY, prefix=PREFIX, seq=5)
    with pytest.raises(BadCommand, match="no MAC"):
        decode_command(pickle.dumps(("stop", None)), key=KEY, prefix=PREFIX, seq=5)


def _signed(body: bytes, seq: int = 1) -> bytes:
    return group._mac(KEY, PREFIX, seq, body).encode() + b"." + body


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"not json", "not JSON"),
        (b'{"seq":2,"op":"stop","args":{}}', "malformed"),
        (b'{"seq":1,"op":"exec","args":{}}', "unknown op"),
        (b'{"seq":1,"op":"stop","args":{"cmd":"id"}}', "unknown argument"),
        (b'{"seq":1,"op":"gather","args":{"names":"a"}}', "names must be a list"),
        (b'{"seq":1,"op":"gather","args":{"names":[1]}}', "must be a string"),
        (b'{"seq":1,"op":"gather","args":{"names":[],"push":{"index":3,"count":3,"version":1}}}', "out of range"),
        (b'{"seq":1,"op":"reload","args":{"path":"/p","version":true}}', "must be an integer"),
        (b'{"seq":1,"op":"checkpoint","args":{}}', "must be a string"),
    ],
)
def test_signed_but_malformed_commands_are_refused(body: bytes, error: str) -> None:
    with pytest.raises(BadCommand, match=error):
        decode_command(_signed(body), key=KEY, prefix=PREFIX, seq=1)


def test_key_from_env() -> None:
    assert group.key_from_env({group.KEY_VAR: KEY.hex()}) == KEY
    for bad in ({}, {group.KEY_VAR: "zz"}, {group.KEY_VAR: "00" * 8}):
        with pytest.raises(ValueError, match=group.KEY_VAR):
            group.key_from_env(bad)


def test_store_layout_and_the_join_check() -> None:
    import torch.distributed as dist

    store = GroupStore(secret="s3cret", world=2)
    try:
        assert store.host == "127.0.0.1" and len(store.key) == 32
        assert "key" not in repr(store) or store.key.hex() not in repr(store)
        assert GroupStore.__dataclass_fields__["key"].default_factory is not None
        assert store.next_generation() == "s3cret/g1/"
        assert store.store.get("s3cret/generation") == b"1"
        assert not store.joined(1)
        dist.PrefixStore("s3cret/g1/", store.store).set("joined/1", "1")
        assert store.joined(1)
        assert store.next_generation() == "s3cret/g2/" and not store.joined(1)
        # the key is never in the store
        keys = store.store.list_keys()
        assert all(store.key.hex() not in k for k in keys)
        assert all(store.key.hex().encode() not in store.store.get(k) for k in keys)
    finally:
        store.close()


def _pair(store: GroupStore, prefix: str) -> tuple[Any, Any]:
    import torch.distributed as dist

    from atroposd.trainer.ranks import GroupRanks

    scoped = dist.PrefixStore(prefix, store.store)
    cpu = torch.device("cpu")
    return (
        GroupRanks(0, 2, cpu, scoped, key=store.key, prefix=prefix),
        GroupRanks(1, 2, cpu, scoped, key=store.key, prefix=prefix),
    )


def test_commands_through_a_real_store() -> None:
    store = GroupStore(secret="s3cret", world=2)
    try:
        leader, follower = _pair(store, store.next_generation())
        for command in COMMANDS * 2:  # past COMMANDS_KEPT: old keys are deleted
            leader.command(command)
            assert follower.receive() == command
        assert follower.refused == 0
        assert not leader.store.check(["cmd/1"]) and leader.store.check([f"cmd/{2 * len(COMMANDS)}"])
    finally:
        store.close()


def test_a_forged_command_that_stays_ends_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value rank 0 never replaces is read again for the grace period, then refused: the rank
    ends (the daemon restarts the group) without running it."""
    from atroposd.trainer import ranks as ranks_mod

    monkeypatch.setattr(ranks_mod, "BAD_COMMAND_GRACE_S", 0.3)
    store = GroupStore(secret="s3cret", world=2)
    try:
        prefix = store.next_generation()
        leader, follower = _pair(store, prefix)
        other = GroupStore(secret="s3cret", world=2)  # another group's key
        try:
            forged = encode_command(Stop(), key=other.key, prefix=prefix, seq=1)
        finally:
            other.close()
        leader.store.set("cmd/1", forged)
        with pytest.raises(BadCommand, match="bad MAC"):
            follower.receive()
        assert follower.refused == 1
        # a forged value that rank 0's own write replaces in time: the rank goes on
        monkeypatch.setattr(ranks_mod, "BAD_COMMAND_GRACE_S", 5.0)
        leader.store.set("cmd/2", pickle.dumps(("stop", None)))
        import threading

        timer = threading.Timer(0.3, lambda: (setattr(leader, "_seq", 1), leader.command(Apply())))
        timer.start()
        assert follower.receive() == Apply()
        timer.join()
        assert follower.refused == 2
    finally:
        store.close()


def _micro(seed: int, packed: bool = False) -> Any:
    from atroposd.trainer.batch import MicroBatch

    g = torch.Generator().manual_seed(seed)
    b, t = (1, 7) if packed else (2, 5)
    return MicroBatch(
        input_ids=torch.randint(0, 50, (b, t), generator=g),
        labels=torch.randint(0, 50, (b, t), generator=g),
        mask=torch.rand(b, t, generator=g) > 0.5,
        old_logp=torch.randn(b, t, generator=g),
        advantages=torch.randn(b, t, generator=g),
        temperature=torch.ones(2),
        distill_ids=torch.full((b, t, 2), -1) if seed % 2 else None,
        distill_lp=torch.randn(b, t, 2, generator=g).to(torch.bfloat16) if seed % 2 else None,
        loss_weight=None,
        seq_lens=torch.tensor([3, 4]) if packed else None,
    )


def _same(a: Any, b: Any) -> bool:
    import dataclasses

    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if (x is None) != (y is None) or (x is not None and not (x.dtype == y.dtype and torch.equal(x, y))):
            return False
    return True


def test_a_share_travels_as_checked_tensors() -> None:
    from atroposd.trainer.share import Share, decode_share, encode_share

    share = Share([_micro(1), _micro(2, packed=True)], 3, _micro(3), 40, 6)
    header, data = encode_share(share)
    assert data.dtype == torch.uint8
    back = decode_share(header, data)
    assert (back.passes, back.denom, back.distill_positions) == (3, 40, 6)
    assert len(back.micro) == 2 and all(_same(a, b) for a, b in zip(share.micro, back.micro, strict=True))
    assert back.pad is not None and _same(share.pad, back.pad)
    # anything else is refused
    with pytest.raises(BadCommand, match="more bytes"):
        decode_share(header, torch.cat([data, torch.zeros(1, dtype=torch.uint8)]))
    with pytest.raises(BadCommand, match="fewer bytes"):
        decode_share(header, data[:-1])
    for bad, error in [
        (header.replace(b"torch.int64", b"torch.complex64", 1), "bad dtype"),
        (header.replace(b'"passes":3', b'"passes":1'), "passes"),
        (header.replace(b'"denom":40', b'"denom":-1'), "count"),
        (header.replace(b'"input_ids"', b'"code"', 1), "other fields"),
        (pickle.dumps(share), "not JSON"),
    ]:
        with pytest.raises(BadCommand, match=error):
            decode_share(bad, data)


class _Recorder:
    """Stands in for the learner, checkpointer and feed: records what the dispatch called."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: self.calls.append((name, *a, *sorted(k.items())))


def test_the_followers_dispatch_table() -> None:
    from atroposd.trainer.follower import Follower

    assert set(Follower.HANDLERS) == {Compute, Apply, Discard, Stop, Gather, Reload, Checkpoint, Canary}
    rec = _Recorder()
    ranks = _Recorder()
    ranks.rank = 1  # type: ignore[attr-defined]
    f = Follower(ranks, rec, rec, torch.nn.Linear(2, 2), rec)
    assert f.run(Apply()) is None and f.run(Discard()) is None
    assert f.run(Reload("/w/v3", 3)) is None and f.run(Checkpoint("/c/t")) is None
    assert f.run(Gather(("weight",), Push(0, 2, 3))) is None
    assert f.run(Stop()) == 0
    names = [c[0] for c in rec.calls]
    assert names == ["apply_local", "discard_local", "load", "write_shards", "bucket"]
    assert rec.calls[2][1:] == (__import__("pathlib").Path("/w/v3"), 3)
    assert rec.calls[4][1] == ["weight"] and ("version", 3) in rec.calls[4]
    # the stream of commands until stop
    queue = [Apply(), Apply(), Stop(), Apply()]
    ranks.receive = lambda: queue.pop(0)  # type: ignore[attr-defined]
    assert f.follow() == 0 and queue == [Apply()]


def test_a_share_to_a_rank_that_does_not_receive_fails_within_collective_timeout() -> None:
    # gloo bounds a plain send by the timeout the group was formed with (join_timeout here), not
    # by collective_timeout: a stopped rank held rank 0's step that long, past the watchdog
    import json
    import subprocess
    import sys

    from tests.support import REPO, free_port

    port = free_port()
    cmd = [sys.executable, "-m", "tests.trainer.share_peer"]
    args = [str(port), "2", "60"]
    peer = subprocess.Popen([*cmd, "1", *args], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out = subprocess.run([*cmd, "0", *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        peer.kill()
        peer.wait()
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["error"] is not None and result["group_error"], result
    assert result["seconds"] < 15, result  # collective_timeout (2 s), not join_timeout (60 s)

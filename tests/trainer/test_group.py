"""The trainer group's store layout, commands and the follower's dispatch (SPEC §12.1), against a
real c10d TCPStore on loopback: typed commands round-trip, anything not signed by rank 0 of this
generation for this position is refused, a share and a broadcast value travel as checked data."""

from __future__ import annotations

import pickle
from typing import Any, ClassVar

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
    Score,
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
    Compute(capture=40),
    Score(40),
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


# One machine (no port): a FileStore in a private directory; several machines: the TCPStore.
STORES = ["file", "tcp"]


def _store(kind: str) -> GroupStore:
    from tests.support import free_port

    return GroupStore(secret="s3cret", world=2, **({"port": free_port()} if kind == "tcp" else {}))


def _readable(store: Any) -> list[str]:
    return [k for k in store.list_keys() if store.check([k])]  # a FileStore lists one key of its own mangled


@pytest.mark.parametrize("kind", STORES)
def test_store_layout_and_the_join_check(kind: str) -> None:
    import torch.distributed as dist

    store = _store(kind)
    try:
        assert store.local == (kind == "file") and len(store.key) == 32
        assert "key" not in repr(store) or store.key.hex() not in repr(store)
        assert GroupStore.__dataclass_fields__["key"].default_factory is not None
        assert store.next_generation() == "s3cret/g1/"
        assert store.store.get("s3cret/generation") == b"1"
        assert not store.joined(1)
        # a rank marks itself joined through its own client of the store, at the generation's prefix
        client = group.connect_store(store.address, 10)
        assert client.get("s3cret/generation") == b"1"
        theirs = dist.PrefixStore("s3cret/g1/", client)
        theirs.set("joined/1", "1")
        assert theirs.check(["joined/1"])  # a TCPStore's set is not answered: this waits for it
        assert store.joined(1) and not store.joined(0)
        theirs.set("joined/0", "1")
        assert theirs.check(["joined/0"]) and store.joined(0)
        # the keys of one generation: the generation key and what its ranks set under its prefix
        assert sorted(_readable(store.store)) == ["s3cret/g1//joined/0", "s3cret/g1//joined/1", "s3cret/generation"]
        assert store.next_generation() == "s3cret/g2/" and not store.joined(1) and not store.joined(0)
        assert store.store.get("s3cret/generation") == b"2"
        # the key is never in the store
        keys = _readable(store.store)
        assert keys and all(store.key.hex() not in k for k in keys)
        assert all(store.key.hex().encode() not in store.store.get(k) for k in keys)
        if kind == "tcp":
            assert store.address == f"127.0.0.1:{store.port}"
    finally:
        store.close()


def test_on_one_machine_the_store_is_a_private_file_per_generation(tmp_path: Any) -> None:
    """SPEC §12.1: with every rank on this machine only this user reaches the store — a file, mode
    0600, in a directory of mode 0700 made for it; each (re)formed group its own file, the
    previous one removed; nothing left once the store closes. No port is listened on."""
    import os
    import stat

    store = GroupStore(secret="s3cret", world=2, directory=tmp_path)
    try:
        d = store.private_dir
        assert store.local and d is not None and d.parent == tmp_path and store.port == 0
        st = os.stat(d)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        with pytest.raises(RuntimeError, match="no generation yet"):
            store.address  # noqa: B018
        store.next_generation()
        first = store.address
        st = os.stat(first)
        assert os.path.dirname(first) == str(d) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        client = group.connect_store(first, 10)
        client.set("s3cret/g1//arrived/1", "1")
        assert store.store.check(["s3cret/g1//arrived/1"])
        store.next_generation()
        second = store.address
        assert (
            second != first
            and not os.path.exists(first)
            and sorted(os.listdir(d)) == [os.path.basename(second), os.path.basename(second) + ".cmd"]
        )
        assert group.connect_store(second, 10).get("s3cret/generation") == b"2"
        assert not store.store.check(["s3cret/g1//arrived/1"])  # a new file: nothing of the last generation
        with pytest.raises(FileNotFoundError, match="is gone"):
            group.connect_store(first, 10)
    finally:
        store.close()
    assert not d.exists() and store.store is None and os.listdir(tmp_path) == []
    # a killed daemon's store directory (in the daemon's runtime directory) goes at the next start
    left = GroupStore(secret="s3cret", world=2, directory=tmp_path)
    left.next_generation()
    assert left.private_dir is not None and left.private_dir.exists()
    again = GroupStore(secret="s3cret", world=2, directory=tmp_path)
    try:
        assert not left.private_dir.exists() and os.listdir(tmp_path) == [again.private_dir.name]  # type: ignore[union-attr]
    finally:
        again.close()


def test_two_ranks_form_a_gloo_group_through_the_one_machine_store() -> None:
    """Two rank processes find the store at its address (its file on one machine), form the gloo
    group, and rank 0's command and share reach rank 1 (the TCPStore: tests/e2e, several nodes)."""
    import json
    import subprocess
    import sys

    from tests.support import REPO

    store = _store("file")
    try:
        prefix = store.next_generation()
        args = [store.address, prefix, store.key.hex()]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.trainer.group_peer", str(r), *args],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in (0, 1)
        ]
        outs = []
        try:
            for p in procs:
                out, err = p.communicate(timeout=90)
                assert p.returncode == 0, err[-3000:]
                outs.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for p in procs:
                p.kill()
                p.wait()
        assert outs[0] == {"rank": 0, "sum": [3.0]}
        assert outs[1] == {"rank": 1, "command": "Compute", "micro": 1, "sum": [3.0]}
        assert store.joined(0) and store.joined(1)
    finally:
        store.close()


def _pair(store: GroupStore, prefix: str) -> tuple[Any, Any]:
    """Rank 0 on the daemon's store, rank 1 on its own client of it (at the store's address)."""
    import torch.distributed as dist

    from atroposd.trainer.ranks import GroupRanks

    cpu = torch.device("cpu")
    theirs = group.connect_store(store.address, 10)
    return (
        GroupRanks(0, 2, cpu, dist.PrefixStore(prefix, store.store), key=store.key, prefix=prefix),
        GroupRanks(1, 2, cpu, dist.PrefixStore(prefix, theirs), key=store.key, prefix=prefix),
    )


@pytest.mark.parametrize("kind", STORES)
def test_commands_through_a_real_store(kind: str) -> None:
    store = _store(kind)
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


def _follower_ranks(store: GroupStore, prefix: str, share: Any, pairs: Any) -> Any:
    """Rank 1 on its own client of a real store (the commands). What the process group carries
    after a command (a share, the canary's pairs) is the value rank 0 would send."""
    import torch.distributed as dist

    from atroposd.trainer.ranks import GroupRanks

    class FollowerRanks(GroupRanks):
        received: ClassVar[list[str]] = []

        def receive_share(self) -> Any:
            self.received.append("share")
            return share

        def broadcast(self, value: Any) -> Any:
            self.received.append("broadcast")
            return pairs

    FollowerRanks.received = []
    scoped = dist.PrefixStore(prefix, group.connect_store(store.address, 10))
    return FollowerRanks(1, 2, torch.device("cpu"), scoped, key=store.key, prefix=prefix)


def test_each_command_reaches_its_handler_through_the_store() -> None:
    import types
    from pathlib import Path

    import torch.distributed as dist

    from atroposd.trainer.follower import Follower
    from atroposd.trainer.ranks import GroupRanks
    from atroposd.trainer.share import Share

    # one handler per command type, named after its op
    assert set(Follower.HANDLERS) == {Compute, Score, Apply, Discard, Stop, Gather, Reload, Checkpoint, Canary}
    assert all(handler is getattr(Follower, kind.op) for kind, handler in Follower.HANDLERS.items())
    store = GroupStore(secret="s3cret", world=2)
    try:
        prefix = store.next_generation()
        leader = GroupRanks(
            0, 2, torch.device("cpu"), dist.PrefixStore(prefix, store.store), key=store.key, prefix=prefix
        )
        share = Share([_micro(1)], 1, None, 10, 0)
        ranks = _follower_ranks(store, prefix, share, [])
        rec = _Recorder()
        rec.policy = types.SimpleNamespace(vocab_size=50)  # type: ignore[attr-defined]
        model = torch.nn.Linear(2, 2)
        sent = [  # at most COMMANDS_KEPT ahead of the follower
            Compute(),
            Apply(),
            Discard(),
            Gather(("weight",), Push(0, 2, 3)),
            Reload("/w/v3", 3),
            Checkpoint("/c/t", background=False),
            Canary(),
            Stop(),
        ]
        for command in sent:
            leader.command(command)
        assert Follower(ranks, rec, rec, model, rec).follow() == 0
        assert [c[0] for c in rec.calls] == [
            "compute_share",
            "apply_local",
            "discard_local",
            "bucket",
            "load",
            "write_shards",
        ]
        assert rec.calls[0][1] is share and ranks.received == ["share", "broadcast"]
        bucket = rec.calls[3]
        assert bucket[1] == ["weight"] and torch.equal(bucket[2]["weight"], model.weight.detach())
        assert ("count", 2) in bucket and ("index", 0) in bucket and ("version", 3) in bucket
        assert rec.calls[4][1:] == (Path("/w/v3"), 3)
        assert rec.calls[5][1:] == (Path("/c/t"), ("background", False))
        assert ranks.refused == 0 and ranks._seq == len(sent)
    finally:
        store.close()


# What a store client without the group's key may write at the next command's key.
REFUSED: list[tuple[str, Any, str]] = [
    ("pickle", lambda key, prefix: pickle.dumps(("stop", None)), "no MAC"),
    ("unsigned", lambda key, prefix: b"0" * 64 + b'.{"seq":1,"op":"stop","args":{}}', "bad MAC"),
    ("other key", lambda key, prefix: encode_command(Stop(), key=bytes(32), prefix=prefix, seq=1), "bad MAC"),
    ("other position", lambda key, prefix: encode_command(Stop(), key=key, prefix=prefix, seq=2), "bad MAC"),
    ("other generation", lambda key, prefix: encode_command(Stop(), key=key, prefix="s3cret/g9/", seq=1), "bad MAC"),
    (
        "unknown op",
        lambda key, prefix: (
            group._mac(key, prefix, 1, b'{"seq":1,"op":"exec","args":{}}').encode()
            + b'.{"seq":1,"op":"exec","args":{}}'
        ),
        "unknown op",
    ),
]


@pytest.mark.parametrize(("value", "error"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_the_follower_refuses_and_counts_what_rank_0_did_not_send(
    monkeypatch: pytest.MonkeyPatch, value: Any, error: str
) -> None:
    """A value at the next command's key that is not rank 0's (or, signed, names no command) is
    counted and refused: the follower ends (the daemon restarts the group) and runs nothing."""
    import torch.distributed as dist

    from atroposd.trainer import ranks as ranks_mod
    from atroposd.trainer.follower import Follower

    monkeypatch.setattr(ranks_mod, "BAD_COMMAND_GRACE_S", 0.2)
    store = GroupStore(secret="s3cret", world=2)
    try:
        prefix = store.next_generation()
        dist.PrefixStore(prefix, store.store).set("cmd/1", value(store.key, prefix))
        ranks = _follower_ranks(store, prefix, None, None)
        rec = _Recorder()
        with pytest.raises(BadCommand, match=error):
            Follower(ranks, rec, rec, torch.nn.Linear(2, 2), rec).follow()
        assert ranks.refused == 1 and rec.calls == [] and ranks.received == []
    finally:
        store.close()


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


# ---------------------------------------------------------------------------- bounded, launch-bound


def _leader_and_follower(store: GroupStore, prefix: str) -> tuple[Any, Any]:
    """Rank 0 and rank 1 as the daemon and a rank process set them up: commands through the
    generation's command box on one machine (the scoped store with several, or before there was one)."""
    import torch.distributed as dist

    from atroposd.trainer.ranks import GroupRanks

    cpu = torch.device("cpu")
    mine = getattr(store, "commands", lambda: None)()
    theirs = getattr(group, "command_box", lambda a: None)(store.address)
    return (
        GroupRanks(0, 2, cpu, mine or dist.PrefixStore(prefix, store.store), key=store.key, prefix=prefix),
        GroupRanks(
            1,
            2,
            cpu,
            theirs or dist.PrefixStore(prefix, group.connect_store(store.address, 10)),
            key=store.key,
            prefix=prefix,
        ),
    )


def _held(store: GroupStore) -> int:
    import os

    size = getattr(store, "size_bytes", None)
    return int(size()) if size is not None else os.stat(store.address).st_size


@pytest.mark.slow
def test_the_one_machine_store_stays_flat_over_ten_thousand_commands() -> None:
    """Rank 0's commands do not grow what the group holds (a FileStore only grows: each command
    was one more record, about 13 KB a synced step, for as long as the group lived)."""
    store = GroupStore(secret="s3cret", world=2)
    try:
        leader, follower = _leader_and_follower(store, store.next_generation())
        names = tuple(f"model.layers.{i}.mlp.weight" for i in range(40))
        sent = [Compute(), Gather(names, Push(0, 4, 1)), Apply()]
        sizes = []
        for i in range(10_000):
            command = sent[i % len(sent)]
            leader.command(command)
            assert follower.receive() == command
            if i in (99, 9_999):
                sizes.append(_held(store))
        assert follower.refused == 0
        assert sizes[1] <= sizes[0] + 4096, sizes
    finally:
        store.close()


def test_commands_as_files_beside_the_store_private_and_bounded() -> None:
    import os

    store = GroupStore(secret="s3cret", world=2)
    try:
        prefix = store.next_generation()
        box = store.commands()
        assert isinstance(box, group.CommandBox) and os.stat(box.directory).st_mode & 0o777 == 0o700
        assert group.command_box(store.address).directory == box.directory
        assert group.command_box("127.0.0.1:29401") is None  # several machines: the TCPStore
        leader, follower = _leader_and_follower(store, prefix)
        for command in COMMANDS * 2:
            leader.command(command)
            assert follower.receive() == command
        files = sorted(os.listdir(box.directory))
        assert len(files) == group.COMMANDS_KEPT and all(
            os.stat(box.directory / f).st_mode & 0o777 == 0o600 for f in files
        )
        assert store.size_bytes() == os.stat(store.address).st_size + box.size_bytes()
        # a re-formed group: the previous generation's commands are gone, and a rank still
        # waiting on them gets an error at once instead of a wait
        first = box
        store.next_generation()
        assert not first.directory.exists()
        with pytest.raises(RuntimeError, match="gone"):
            first.wait(["cmd/99"])
    finally:
        store.close()


def test_a_command_replayed_across_two_launches_of_the_head_is_refused() -> None:
    """Several machines: the prefix and the command key come from the cluster token and the
    head's launch nonce, so an Apply recorded in one launch does not verify in the next, where a
    Discard was due at the same generation and position (generations start at 1 each launch)."""
    from atroposd.cluster.messages import Ranks, decode, fields
    from tests.support import free_port

    token_key = bytes(range(32))
    first = GroupStore(secret="tok-secret", world=2, port=free_port(), key=token_key, launch="launch-one")
    second = GroupStore(secret="tok-secret", world=2, port=free_port(), key=token_key, launch="launch-two")
    try:
        p1, p2 = first.next_generation(), second.next_generation()
        assert p1 != p2 and first.key != second.key
        recorded = encode_command(Apply(), key=first.key, prefix=p1, seq=1)
        assert decode_command(recorded, key=first.key, prefix=p1, seq=1) == Apply()
        with pytest.raises(BadCommand, match="bad MAC"):
            decode_command(recorded, key=second.key, prefix=p2, seq=1)
        # a node derives the same prefix and key from its token and the head's start message
        msg = decode("ranks", fields(Ranks(op="start", generation=1, launch="launch-two")), "h2n")
        assert isinstance(msg, Ranks) and msg.launch == "launch-two"
        assert group.store_keys(group.launch_secret("tok-secret", msg.launch), 1) == p2
        assert group.launch_key(token_key, msg.launch) == second.key
        # the replayed value, written where the next command is due, is refused by the rank
        leader, follower = _leader_and_follower(second, p2)
        leader.store.set("cmd/1", recorded)
        from atroposd.trainer import ranks as ranks_mod

        grace, ranks_mod.BAD_COMMAND_GRACE_S = ranks_mod.BAD_COMMAND_GRACE_S, 0.2
        try:
            with pytest.raises(BadCommand, match="bad MAC"):
                follower.receive()
        finally:
            ranks_mod.BAD_COMMAND_GRACE_S = grace
    finally:
        first.close()
        second.close()

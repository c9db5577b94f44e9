"""``weight_sync = "broadcast"`` (SPEC §7) on gloo, into real `atroposd inference` servers (torch
engine, the builtin tiny model): the trainer forms a process group with each replica and streams
the weights bucket by bucket; after a sync every replica's tensors equal the trainer's bit for bit
(float32, by sha256); a replica killed mid-broadcast is skipped and catches up; a trainer that
fails mid-stream leaves no replica serving a mix and re-forms every group on fresh prefixes; a
group whose peer never joins (it cannot reach the store, or waits in another formation) fails that
replica's sync within the trainer's deadline and the next sync goes on; the store's values are
read as bounded integers, never unpickled."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from atroposd.daemon.metrics import weight_sync_families
from atroposd.weights.broadcast import (
    BroadcastFormTimeout,
    BroadcastHub,
    BroadcastReceiver,
    layout,
    pack,
    parse_plan,
    plan_body,
)
from atroposd.weights.manifest import TensorSpec
from atroposd.weights.protocol import WeightUpdateError
from atroposd.weights.source import plan_buckets
from atroposd.weights.sync import BroadcastSync, replica_sync_status
from atroposd.weights.tensors import model_tensors
from tests.inference.conftest import Server
from tests.inference.test_weights import close, local_logprobs, served, train_step, trainer_model
from tests.weights.test_bucket_push import (
    BUCKET,
    Replicas,
    Watched,
    digests,
    tiny_dir,
    two_replicas,
)

__all__ = ["tiny_dir"]  # the module's fixture: the builtin tiny model, built once

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def pair(tiny_dir: Path) -> Iterator[Replicas]:
    """Two replicas for the module's tests that kill nothing."""
    with two_replicas(tiny_dir) as replicas:
        yield replicas


def bcast(launch: Replicas, servers: Sequence[Server], **kw: Any) -> BroadcastSync:
    kw.setdefault("form_timeout", 30.0)
    sync = BroadcastSync(
        nonce=launch.nonce, control_sockets=[s.socket for s in servers], bucket_bytes=BUCKET, digest=True, **kw
    )
    sync.deadline = 60.0
    return sync


def assert_bit_for_bit(sync: BroadcastSync, model: torch.nn.Module, replicas: Sequence[int]) -> None:
    want = digests(model)
    assert sorted(sync.last_results) == sorted(replicas)
    for i in replicas:
        got = sync.last_results[i]["digests"]
        assert got == want, f"replica {i}: {sorted(n for n in want if got.get(n) != want[n])} differ"


def assert_serves(srv: Server, model: torch.nn.Module, version: int) -> None:
    lps, v = served(srv)
    assert v == version
    assert close(lps, local_logprobs(model), 1e-5), "the replica does not serve the trainer's weights"


def test_plan_round_trips_and_bad_plans_are_refused() -> None:
    specs = {"a": TensorSpec("float32", (3, 5)), "b": TensorSpec("bfloat16", (7,)), "c": TensorSpec("float16", ())}
    plan = plan_buckets(specs, 80)
    body = {"buckets": plan_body(specs, plan)}
    parsed = parse_plan(body)
    assert [[n for n, _ in b] for b in parsed] == plan and dict(x for b in parsed for x in b) == specs
    lay = layout(parsed[0])
    assert all(s.offset % 64 == 0 for s in lay.slots)
    tensors = {"a": torch.arange(15, dtype=torch.float32).reshape(3, 5)}
    assert pack(layout([("a", specs["a"])]), tensors)[:60].view(torch.float32).tolist() == list(range(15))
    for bad in (
        [],
        [[]],
        [[["a", "int64", [2]]]],
        [[["a", "float32", [-1]]]],
        [[["a", "float32", [True]]]],
        [["a"]],
        "x",
    ):
        with pytest.raises(WeightUpdateError):
            parse_plan({"buckets": bad})
    rx = BroadcastReceiver("nonce1")
    with pytest.raises(WeightUpdateError, match="not this launch"):
        rx.join(
            {
                "op": "join",
                "store": "/nowhere/store",
                "prefix": "other/bcast/r0/f1/",
                "backend": "gloo",
                "deadline_s": 1.0,
                "timeout_s": 1.0,
            },
            torch.device("cpu"),
        )
    with pytest.raises(WeightUpdateError, match="backend"):
        rx.join(
            {
                "op": "join",
                "store": "/nowhere/store",
                "prefix": "nonce1/bcast/r0/f1/",
                "backend": "mpi",
                "deadline_s": 1.0,
                "timeout_s": 1.0,
            },
            torch.device("cpu"),
        )
    with pytest.raises(WeightUpdateError, match="absolute path"):
        rx.join(
            {
                "op": "join",
                "store": "127.0.0.1:1",
                "prefix": "nonce1/bcast/r0/f1/",
                "backend": "gloo",
                "deadline_s": 1.0,
                "timeout_s": 1.0,
            },
            torch.device("cpu"),
        )


class _RunsWhenUnpickled:
    """A pickle that creates ``path`` when loaded: if a store value were unpickled, it would exist."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def test_the_hub_forms_within_its_deadline_on_a_fresh_prefix_and_reads_only_integers(tmp_path: Path) -> None:
    """The trainer's side of a formation, on its real FileStore: each formation gets a prefix of
    its own; nobody under it, or a worker missing, costs the deadline and names what is missing
    (the list cut); the store's values are parsed as bounded integers, never unpickled; an
    abandoned formation stops."""
    import torch.distributed as dist

    hub = BroadcastHub(secret="nonce1", directory=tmp_path)
    hub.store()
    assert hub.path is not None and Path(hub.path).parent.parent == tmp_path
    assert os.stat(Path(hub.path).parent).st_mode & 0o777 == 0o700 and os.stat(hub.path).st_mode & 0o777 == 0o600
    peer = dist.FileStore(hub.address, -1)
    try:
        prefixes = [hub.next_prefix(0), hub.next_prefix(0), hub.next_prefix(1)]
        assert len(set(prefixes)) == 3 and all(p.startswith("nonce1/bcast/r") for p in prefixes)
        assert hub.join_request(prefixes[0], deadline_s=1.0, timeout_s=2.0)["store"] == hub.path

        # a replica that joined an earlier formation answers nothing for this one
        dist.PrefixStore(prefixes[0], peer).set("world", "2")
        dist.PrefixStore(prefixes[0], peer).set("arrived/1", "0")
        t0 = time.monotonic()
        with pytest.raises(BroadcastFormTimeout, match=r"within 0.5 s: the replica never joined"):
            hub.form(prefixes[1], deadline_s=0.5, timeout_s=2.0)
        assert 0.5 <= time.monotonic() - t0 < 3.0

        # one worker of two arrived (a tensor-parallel replica): the missing rank is named
        scoped = dist.PrefixStore(prefixes[2], peer)
        scoped.set("world", "3")
        scoped.set("arrived/1", "0")
        t0 = time.monotonic()
        with pytest.raises(BroadcastFormTimeout, match=r"worker rank\(s\) 2 of 2 never arrived"):
            hub.form(prefixes[2], deadline_s=0.5, timeout_s=2.0)
        assert 0.5 <= time.monotonic() - t0 < 3.0

        # what a peer writes is data: a pickle is refused, never loaded; out-of-range sizes too
        ran = tmp_path / "ran"
        for value, error in (
            (pickle.dumps(_RunsWhenUnpickled(ran), protocol=0), "not an integer"),
            (pickle.dumps(_RunsWhenUnpickled(ran)), "not an integer"),
            (b"1", "out of range"),
            (b"70000", "out of range"),
        ):
            prefix = hub.next_prefix(2)
            dist.PrefixStore(prefix, peer).set("world", value)
            with pytest.raises(WeightUpdateError, match=error):
                hub.form(prefix, deadline_s=5.0, timeout_s=2.0)
        assert not ran.exists()

        # a formation given up (its replica refused to join) stops waiting at once
        t0 = time.monotonic()
        with pytest.raises(BroadcastFormTimeout, match="abandoned"):
            hub.form(hub.next_prefix(3), deadline_s=30.0, timeout_s=2.0, cancelled=lambda: True)
        assert time.monotonic() - t0 < 2.0

        # a world of 65,536 workers with none arrived: the error names eight and counts the rest
        prefix = hub.next_prefix(4)
        dist.PrefixStore(prefix, peer).set("world", "65536")
        with pytest.raises(BroadcastFormTimeout) as info:
            hub.form(prefix, deadline_s=0.2, timeout_s=2.0)
        assert "1, 2, 3, 4, 5, 6, 7, 8 and 65527 more of 65535" in str(info.value) and len(str(info.value)) < 300
    finally:
        del peer
        private = Path(hub.path).parent if hub.path else None
        hub.close()
        assert private is not None and not private.exists(), "the store's directory goes with the hub"


@pytest.mark.slow
def test_a_stranger_cannot_reach_the_broadcast_rendezvous(tmp_path: Path) -> None:
    """Another user of the machine (a child that drops to nobody when the tests run as root)
    cannot open the rendezvous store to write into it: it is a file in a private directory, and
    the trainer listens on no TCP port for it (it used to be a loopback TCPStore any local user
    could connect to, write any key of, and grow without bound)."""
    from tests.unprivileged import run_unprivileged

    hub = BroadcastHub(secret="nonce1")
    try:
        address = hub.join_request(hub.next_prefix(0), deadline_s=1.0, timeout_s=2.0)["store"]
        code = (
            "import sys, datetime\n"
            "address = sys.argv[1]\n"
            "try:\n"
            "    if address.startswith('/'):\n"
            "        open(address, 'ab').close()\n"
            "        store = dist.FileStore(address, -1)\n"
            "    else:\n"
            "        host, _, port = address.rpartition(':')\n"
            "        store = dist.TCPStore(host, int(port), is_master=False, "
            "timeout=datetime.timedelta(seconds=5), use_libuv=False)\n"
            "    store.set('nonce1/bcast/r0/f2/world', '65536')\n"
            "    print('REACHED')\n"
            "except Exception as exc:\n"
            "    print('REFUSED', type(exc).__name__, exc)\n"
        )
        result = run_unprivileged(code, [address], setup="import torch.distributed as dist")
        assert "REFUSED" in result.stdout and "REACHED" not in result.stdout, (result.stdout, result.stderr[-2000:])
        # and its file is only reachable through a directory of this user's that no one else may enter
        from atroposd.weights.broadcast import check_store_path

        check_store_path(address)
        os.chmod(Path(address).parent, 0o755)
        with pytest.raises(WeightUpdateError, match="private directory"):
            check_store_path(address)
    finally:
        hub.close()


def test_config_takes_broadcast_explicitly_and_auto_never_picks_it() -> None:
    from atroposd.config import ConfigError, parse_toml

    assert parse_toml('[trainer]\nweight_sync = "broadcast"\n').weight_sync == "broadcast"
    assert parse_toml('[inference]\nengine = "vllm"\n[trainer]\nweight_sync = "broadcast"\n').weight_sync == "broadcast"
    assert parse_toml('[trainer]\ndevice = ["cpu", "cpu"]\nweight_sync = "broadcast"\n').weight_sync == "broadcast"
    for text in (
        "",
        '[inference]\nengine = "vllm"\n',
        '[trainer]\ndevice = ["cpu", "cpu"]\n',
        "[inference]\nreplicas = 2\n",
    ):
        assert parse_toml(text).weight_sync != "broadcast"
    with pytest.raises(ConfigError) as info:
        parse_toml('[inference]\nenabled = false\n[trainer]\nweight_sync = "broadcast"\n')
    assert any("trainer.weight_sync" in str(p) and "local inference server" in str(p) for p in info.value.problems)
    with pytest.raises(ConfigError) as info:
        parse_toml('[trainer]\nmode = "lora"\nweight_sync = "broadcast"\n')
    assert any("trainer.weight_sync" in str(p) for p in info.value.problems)
    with pytest.raises(ConfigError) as info:
        parse_toml('[trainer]\nweight_sync = "broadcastt"\n')
    assert any("trainer.weight_sync" in str(p) for p in info.value.problems)


def test_config_refuses_broadcast_across_nodes(tmp_path: Path) -> None:
    from tests.support import config_problems

    token = tmp_path / "token"
    token.write_text("s3cret-token-0123456789\n")
    text = (
        f'[cluster]\nnodes = 2\nnode_rank = 0\nhead = "127.0.0.1"\ntoken_file = "{token}"\n'
        f'[trainer]\ncheckpoint_dir = "{tmp_path / "ckpt"}"\nweight_sync = "broadcast"\n'
    )
    found = config_problems(text)
    assert any(p.startswith("trainer.weight_sync") and "one node" in p for p in found), found
    assert not any(p.startswith("trainer.weight_sync") for p in config_problems(text.replace("broadcast", "push")))


async def test_broadcast_reaches_every_replica_bit_for_bit(pair: Replicas) -> None:
    first, second = pair.servers
    model = trainer_model(pair.tiny_dir, seed=7)
    source = Watched(model, pair.nonce)
    sync = bcast(pair, pair.servers, source_for=lambda m: source)
    plan = plan_buckets(source.specs(), BUCKET)
    model_bytes = sum(t.numel() * t.element_size() for t in model_tensors(model).tensors.values())
    try:
        await sync.attach(model, 3)
        assert len(plan) >= 4 and source.gathered == plan and source.copies == 0
        assert_bit_for_bit(sync, model, [0, 1])
        for srv in (first, second):
            await asyncio.to_thread(assert_serves, srv, model, 3)
        assert sync.replica_versions() == [3, 3] and sync.server_current and sync.formations == 2

        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        before = local_logprobs(model)
        async with sync.paused(4):
            train_step(model, opt)
        last = await sync.after_step(model, 4)
        assert last is sync.last_sync  # the step's sync report, returned
        assert not close(before, local_logprobs(model), 1e-3)  # the step changed what is served
        assert_bit_for_bit(sync, model, [0, 1])
        for srv in (first, second):
            await asyncio.to_thread(assert_serves, srv, model, 4)
            status, info = await asyncio.to_thread(srv.control, "GET", "/weight_info")
            assert status == 200 and info["weight_version"] == 4 and info["paused"] is False
        assert sync.formations == 2  # the groups are formed once per replica start, not per sync
        assert last["buckets"] == len(plan) and last["bytes"] >= model_bytes
        assert last["staging_bytes"] <= BUCKET < model_bytes / 4
        assert all(last[k] >= 0 for k in ("pause_s", "gather_s", "pack_s", "send_s"))
        assert last["sync_pause_s"] == last["pause_s"] and last["sync_transfer_s"] > 0

        # what status --json and /metrics show of each replica
        for i in (0, 1):
            row = replica_sync_status(sync, i)
            assert row["mode"] == "broadcast" and row["backend"] == "gloo" and row["group"] == "formed"
            assert row["formations"] == 1 and row["form_failures"] == row["send_failures"] == 0
            assert row["last_transfer_s"] > 0 and row["formation"].startswith(f"{pair.nonce}/bcast/r{i}/")
        cfg = SimpleNamespace(inference=SimpleNamespace(replicas=2))
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in weight_sync_families(cfg, sync)
            for s in f.samples
        }
        assert samples[("atroposd_replica_weight_sync", (("component", "inference-1"), ("mode", "broadcast")))] == 1
        assert samples[("atroposd_replica_broadcast_group", (("component", "inference-0"),))] == 1.0
        assert samples[("atroposd_replica_broadcast_formations_total", (("component", "inference-1"),))] == 1.0
        assert (
            samples[("atroposd_replica_broadcast_failures_total", (("component", "inference-0"), ("kind", "send")))]
            == 0
        )
    finally:
        sync.close()


async def test_a_replica_refuses_a_plan_that_does_not_fit_its_model(pair: Replicas) -> None:
    """The whole plan is checked before any byte moves: the replica keeps serving what it had."""
    first = pair.servers[0]
    model = trainer_model(pair.tiny_dir, seed=8)
    sync = bcast(pair, [first])
    try:
        await sync.attach(model, 10)
        group = sync.groups[0]
        specs = {n: TensorSpec("float32", tuple(t.shape)) for n, t in model_tensors(model).tensors.items()}
        wrong = dict(specs)
        name = next(iter(wrong))
        wrong[name] = TensorSpec("float32", (1, *wrong[name].shape))
        body = {
            "op": "receive",
            "formation": group.formation,
            "weight_version": 11,
            "buckets": plan_body(wrong, [list(wrong)]),
        }
        status, answer = await asyncio.to_thread(first.control, "POST", "/pause")
        assert status == 200
        status, answer = await asyncio.to_thread(first.control, "POST", "/broadcast", body)
        assert status == 400 and name in answer["error"], answer
        del body["buckets"][0][0]
        status, answer = await asyncio.to_thread(first.control, "POST", "/broadcast", body)
        assert status == 400 and "missing" in answer["error"], answer
        status, answer = await asyncio.to_thread(
            first.control, "POST", "/broadcast", {**body, "formation": pair.nonce + "/bcast/r0/f999/"}
        )
        assert status == 400 and "join again" in answer["error"], answer
        status, answer = await asyncio.to_thread(first.control, "POST", "/resume", {"weight_version": 10})
        assert status == 200
        await asyncio.to_thread(assert_serves, first, model, 10)
    finally:
        sync.close()


async def test_a_peer_that_never_joins_fails_that_replica_within_the_deadline(pair: Replicas) -> None:
    """Replica 1 is pointed at a store address where no store listens: its group cannot form. Its
    sync fails within form_timeout (logged, counted), replica 0 gets the weights, and the next
    sync (a reachable store) brings replica 1 current."""
    model = trainer_model(pair.tiny_dir, seed=9)
    sync = bcast(pair, pair.servers, form_timeout=3.0)
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    dead_port = dead.getsockname()[1]
    real = sync.hub.join_request

    def misdirected(prefix: str, **kw: Any) -> dict[str, Any]:
        req = real(prefix, **kw)
        return {**req, "store": f"/nonexistent/{dead_port}/store"} if "/r1/" in prefix else req

    try:
        sync.hub.join_request = misdirected  # type: ignore[method-assign]
        t0 = time.monotonic()
        await sync.attach(model, 20)
        took = time.monotonic() - t0
        assert took < 3.0 + 10.0, took
        assert sync.form_failures == 1 and 1 not in sync.groups
        assert sync.replicas[0].current and not sync.replicas[1].current
        await asyncio.to_thread(assert_serves, pair.servers[0], model, 20)
        assert_bit_for_bit(sync, model, [0])

        sync.hub.join_request = real  # type: ignore[method-assign]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_step(model, opt)
        await sync.after_step(model, 21)
        assert sync.server_current and sync.replica_versions() == [21, 21]
        assert_bit_for_bit(sync, model, [0, 1])
    finally:
        dead.close()
        sync.close()


async def test_a_replica_that_never_arrives_costs_the_formation_deadline_and_nothing_else(pair: Replicas) -> None:
    """Replica 1 answers the join but never arrives in the trainer's formation (its workers wait
    in another one, far longer than the trainer's deadline): the trainer stops waiting at its own
    deadline, that replica's sync fails (logged, counted, shown), replica 0 gets the weights, and
    the next sync forms replica 1's group on a new prefix and brings it current."""
    model = trainer_model(pair.tiny_dir, seed=13)
    form_timeout = 2.0
    sync = bcast(pair, pair.servers, form_timeout=form_timeout)
    real = sync.hub.join_request
    strays: list[str] = []

    def elsewhere(prefix: str, **kw: Any) -> dict[str, Any]:
        req = real(prefix, **kw)
        if "/r1/" not in prefix:
            return req
        # a valid formation of this launch, but not the one the trainer waits on
        strays.append(prefix.replace("/r1/", "/r1-elsewhere/"))
        return {**req, "prefix": strays[-1], "deadline_s": 30.0, "timeout_s": 30.0}

    try:
        sync.hub.join_request = elsewhere  # type: ignore[method-assign]
        t0 = time.monotonic()
        with capture_logs() as logs:
            await sync.attach(model, 40)
        took = time.monotonic() - t0
        # the trainer's deadline ended it: the replica's own join would have waited 30 s
        assert form_timeout <= took < form_timeout + 8.0, took
        failed = [e for e in logs if e["event"].startswith("broadcast group did not form")]
        assert len(failed) == 1 and failed[0]["replica"] == 1, logs
        assert "within 2 s: the replica never joined" in failed[0]["error"], failed
        assert sync.form_failures == 1 and 1 not in sync.groups and 0 in sync.groups
        row = replica_sync_status(sync, 1)
        assert row["group"] == "none" and row["form_failures"] == 1 and row["formations"] == 0, row
        assert sync.replicas[0].current and not sync.replicas[1].current
        assert sync.replica_versions() == [40, None]
        assert_bit_for_bit(sync, model, [0])
        await asyncio.to_thread(assert_serves, pair.servers[0], model, 40)
        # the replica still waits in the other formation: it is formed from here and dropped, so
        # its server is not held until its own deadline
        assert len(strays) == 1
        stray = await asyncio.to_thread(sync.hub.form, strays[0], deadline_s=10.0, timeout_s=10.0)
        stray.close()

        sync.hub.join_request = real  # type: ignore[method-assign]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_step(model, opt)
        await sync.after_step(model, 41)
        assert sync.server_current and sync.replica_versions() == [41, 41]
        assert_bit_for_bit(sync, model, [0, 1])
        assert sync.groups[1].formation.startswith(f"{pair.nonce}/bcast/r1/f")
        assert replica_sync_status(sync, 1)["formations"] == 1
        await asyncio.to_thread(assert_serves, pair.servers[1], model, 41)
    finally:
        sync.close()


async def test_a_trainer_failing_mid_stream_leaves_no_mix_and_reforms_every_group(pair: Replicas) -> None:
    """A gather that fails halfway (a trainer rank lost): the error reaches the trainer, every
    group in flight is closed, no replica resumes with a mix, and the next attach (the trainer
    group formed again) forms every group afresh and brings every replica current."""
    model = trainer_model(pair.tiny_dir, seed=10)
    source = Watched(model, pair.nonce)
    sync = bcast(pair, pair.servers, source_for=lambda m: source)
    try:
        await sync.attach(model, 30)
        formations = sync.formations
        before = {i: g.formation for i, g in sync.groups.items()}

        async def fail_in_the_middle(i: int) -> None:
            if i == len(source.gathered) and i % len(plan_buckets(source.specs(), BUCKET)) == 3:
                raise RuntimeError("Connection closed by peer [gloo]: a trainer rank is gone")

        source.on_gather = fail_in_the_middle
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_step(model, opt)
        with pytest.raises(RuntimeError, match="trainer rank is gone"):
            await sync.after_step(model, 31)
        assert not sync.groups and not any(r.current for r in sync.replicas)
        for srv in pair.servers:  # half a sync arrived: the server refuses to serve it
            status, answer = await asyncio.to_thread(srv.control, "POST", "/resume", {"weight_version": 31})
            assert status == 400 and "incomplete" in answer["error"], answer

        source.on_gather = None
        await sync.attach(model, 32)
        assert sync.formations == formations + 2 and sync.server_current
        # each group formed again on a prefix of its own: a worker of the old one answers nothing
        assert sorted(sync.groups) == [0, 1] and all(sync.groups[i].formation != before[i] for i in (0, 1))
        assert_bit_for_bit(sync, model, [0, 1])
        for srv in pair.servers:
            await asyncio.to_thread(assert_serves, srv, model, 32)
    finally:
        sync.close()


@pytest.mark.slow  # starts and kills a replica of its own
async def test_a_replica_killed_mid_broadcast_is_skipped_and_catches_up(tiny_dir: Path) -> None:
    replicas = Replicas(tiny_dir)
    try:
        first, victim = replicas.start(), replicas.start()
        model = trainer_model(tiny_dir, seed=11)
        source = Watched(model, replicas.nonce)
        sync = bcast(replicas, [first, victim], source_for=lambda m: source)
        try:
            await sync.attach(model, 4)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            train_step(model, opt)
            start = len(source.gathered)

            async def kill_in_the_middle(i: int) -> None:
                if i == start + 3:
                    os.kill(victim.proc.pid, signal.SIGKILL)
                    await asyncio.to_thread(victim.proc.wait, 10)

            source.on_gather = kill_in_the_middle
            t0 = time.monotonic()
            await sync.after_step(model, 5)  # the dead replica is skipped; the sync goes on
            assert time.monotonic() - t0 < 30
            assert len(source.gathered) == start + len(plan_buckets(source.specs(), BUCKET))
            assert sync.send_failures == 1 and 1 not in sync.groups
            assert_bit_for_bit(sync, model, [0])
            await asyncio.to_thread(assert_serves, first, model, 5)
            assert sync.replica_versions() == [5, 4] and not sync.replicas[1].current
            replicas.stop(victim)

            source.on_gather = None
            back = replicas.start()  # the restarted replica (the daemon keeps its socket path)
            status, info = await asyncio.to_thread(back.control, "GET", "/weight_info")
            assert status == 200 and info["awaiting_weights"] and info["paused"], info  # it serves nothing yet
            sync.replicas[1].socket = back.socket
            await sync.reattach(model, 5, 1)
            assert_bit_for_bit(sync, model, [1])
            await asyncio.to_thread(assert_serves, back, model, 5)
            assert sync.replica_versions() == [5, 5] and sync.server_current
        finally:
            sync.close()
    finally:
        replicas.close()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="NCCL needs two GPUs (it refuses two ranks on one)",
)
async def test_nccl_broadcast_between_two_gpus_bit_for_bit(tiny_dir: Path) -> None:
    """The NCCL twin of the gloo test: the trainer's model on cuda:0, a replica on cuda:1."""
    from tests.inference.conftest import env_with_nonce, start_server

    replicas = Replicas(tiny_dir)
    try:
        env = {**env_with_nonce(replicas.nonce), "CUDA_VISIBLE_DEVICES": "1"}
        srv = start_server(replicas.root, tiny_dir, extra=["--await-weights", "--device", "cuda:0"], env=env)
        replicas.servers.append(srv)
        # the replica's dtype on a GPU (auto): bfloat16, so the trainer's copy here is bfloat16 too
        model = trainer_model(tiny_dir, seed=12).to("cuda:0", torch.bfloat16)
        sync = bcast(replicas, [srv], backend="nccl", device=torch.device("cuda:0"))
        try:
            await sync.attach(model, 1)
            assert sync.groups[0].backend == "nccl"
            assert_bit_for_bit(sync, model, [0])
        finally:
            sync.close()
    finally:
        replicas.close()

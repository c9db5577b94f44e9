"""A damaged spool never stops the API starting and costs only what is damaged (SPEC §13):
records that cannot be replayed are set aside, corruption in the middle of a segment drops only
the bad record, passthrough fields replay as received, registrations are written one by one."""

from __future__ import annotations

import asyncio
import os
import zlib
from pathlib import Path
from typing import Any

import orjson

from atroposd.api.queue import TrajectoryStore
from atroposd.api.schema import Group, TrainerRegistration, group_from_json
from atroposd.api.spool import BAD_DIR, Spool, _frame
from tests.api.conftest import group


def _g(tag: float, n: int = 4, **extra: Any) -> Group:
    return group_from_json(group(n, length=16, tag=tag, **extra))


def _write(spool: Spool, groups: list[Group], seq0: int) -> None:
    for i, g in enumerate(groups):
        g.seq = g.qpos = seq0 + i
    spool.write_groups(groups)
    spool.write_queued(groups)


def _segment(tmp: Path) -> Path:
    return sorted(tmp.glob("seg-*.log"))[-1]


def test_deep_passthrough_replays_as_received(tmp_path: Path) -> None:
    """Passthrough bytes are kept as received: a field deeper than orjson re-encodes (254) no
    longer makes every start fail."""
    g = _g(1.0)
    deep = b"[" * 300 + b"1" + b"]" * 300
    g.extras["generation_params"] = b'{"a":' + deep + b"}"
    g.extras["messages"] = b'[[{"role":"user","content":"caf\\u00e9 1.50E+2"}]]'
    spool = Spool(tmp_path)
    spool.open()
    _write(spool, [g], 0)
    spool.close()
    again = Spool(tmp_path)
    state = again.open()
    assert [x.extras for x in state.queue] == [g.extras]
    assert state.set_aside == 0
    again.close()


def _corrupt_group_record(tmp_path: Path) -> tuple[Path, int]:
    """Three groups and an ack of none; the second group's record damaged in the middle of the
    segment. Returns (segment, offset of the damage)."""
    spool = Spool(tmp_path)
    spool.open()
    _write(spool, [_g(1.0)], 0)
    _write(spool, [_g(2.0)], 1)
    _write(spool, [_g(3.0)], 2)
    spool.close()
    seg = _segment(tmp_path)
    data = bytearray(seg.read_bytes())
    second = data.find(b'"seq":1')
    assert second > 0
    data[second + 40] ^= 0xFF
    seg.write_bytes(bytes(data))
    return seg, second


def test_corruption_in_the_middle_drops_only_the_bad_record(tmp_path: Path) -> None:
    _corrupt_group_record(tmp_path)
    spool = Spool(tmp_path)
    state = spool.open()
    assert [g.scores[0] for g in state.queue] == [1.0, 3.0]  # the third (after the damage) survives
    assert state.set_aside == 1 and state.dropped_bytes > 0
    kept = list((tmp_path / BAD_DIR).iterdir())
    assert len(kept) == 1 and kept[0].stat().st_size == state.dropped_bytes
    spool.close()
    again = Spool(tmp_path)  # rewritten without the damage: nothing set aside a second time
    state = again.open()
    assert [g.scores[0] for g in state.queue] == [1.0, 3.0] and state.set_aside == 0
    again.close()


def test_a_record_that_cannot_be_replayed_is_set_aside(tmp_path: Path) -> None:
    """Framed correctly (its CRC holds) but not a group: set aside, counted; the API starts."""
    spool = Spool(tmp_path)
    spool.open()
    _write(spool, [_g(1.0)], 0)
    spool.close()
    seg = _segment(tmp_path)
    bogus = [
        _frame(b"G", b'\x05\x00\x00\x00{"x":'),
        _frame(b"Q", b"not json"),
        _frame(b"A", b'{"seqs": 1}'),
        _frame(b"E", b'{"i": 9, "env": {}}'),
    ]
    seg.write_bytes(seg.read_bytes() + b"".join(bogus))
    spool = Spool(tmp_path)
    state = spool.open()
    assert [g.scores[0] for g in state.queue] == [1.0]
    assert state.set_aside == len(bogus) and spool.stats()["set_aside"] == len(bogus)
    assert len(list((tmp_path / BAD_DIR).iterdir())) == len(bogus)
    spool.close()


def test_a_failed_ack_write_is_counted(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.open()
    g = _g(1.0)
    _write(spool, [g], 0)
    good_fd = spool._fd
    spool._fd = ro = os.open(_segment(tmp_path), os.O_RDONLY)
    try:
        spool.write_ack([g], 1)
    finally:
        spool._fd = good_fd
        os.close(ro)
    assert spool.ack_failures == 1 and spool.stats()["ack_failures"] == 1
    spool.close()


def _env(i: int) -> dict[str, Any]:
    return {
        "max_token_length": 64,
        "desired_name": f"e{i}",
        "weight": 1.0,
        "group_size": 4,
        "min_batch_allocation": None,
    }


def test_registrations_are_written_one_record_per_change(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    store = TrajectoryStore(64, spool=spool)
    store.restore(spool.open())
    store.register(TrainerRegistration("g", "p", 8, 64, "c", 5, 0, 10))
    store.started_by_batch()
    seg = _segment(tmp_path)
    growth = []
    for i in range(200):
        before = seg.stat().st_size
        store.register_env(_env(i))
        growth.append(seg.stat().st_size - before)
    assert max(growth) < 2 * min(growth)  # not all registrations again each time
    store.disconnect_env(3)
    spool.close()
    spool = Spool(tmp_path)
    again = TrajectoryStore(64, spool=spool)
    again.restore(spool.open())
    assert [e.desired_name for e in again.envs] == [f"e{i}" for i in range(200)]
    assert [e.registered_id for e in again.envs] == list(range(200))
    assert not again.envs[3].connected and again.envs[4].connected
    spool.close()


def test_out_of_bounds_registrations_are_clamped_on_replay(tmp_path: Path) -> None:
    """A spool written before registrations were bounded: the API starts and answers."""
    spool = Spool(tmp_path)
    spool.open()
    reg = TrainerRegistration("g", "p", 8, 64, "c", 5, 0, 10)
    env = {
        "max_context_len": 64,
        "weight": -3.0,
        "desired_name": "x" * 1000,
        "real_name": "x_0",
        "registered_id": 0,
        "group_size": 10**9,
        "min_batch_allocation": 1e308,
        "connected": True,
    }
    spool.write_state({"registration": reg.to_json(), "started": True, "step": 0, "envs": [env]})
    _write(spool, [_g(1.0, n=4, env_id=0), _g(2.0, n=4, env_id=0)], 0)
    spool.close()
    spool = Spool(tmp_path)
    store = TrajectoryStore(8, spool=spool)
    store.restore(spool.open())
    e = store.envs[0]
    assert (e.weight, e.group_size, e.min_batch_allocation, len(e.desired_name)) == (0.0, 8, 1.0, 256)
    assert store.status_env(0)["env_weight"] > 0
    batch = store.take_batch()  # min-mode batch formation with the clamped allocation
    assert batch is not None and sum(g.n for g in batch) == 8
    spool.close()


def test_an_api_with_a_damaged_spool_starts(tmp_path: Path) -> None:
    """The whole start path: serve() replays a damaged spool instead of failing."""
    from atroposd.api.app import serve
    from atroposd.api.server import ApiSettings
    from tests.support import free_port

    spool_dir = tmp_path / "spool"
    _corrupt_group_record(spool_dir)
    seg = _segment(spool_dir)
    seg.write_bytes(seg.read_bytes() + _frame(b"S", b"[1, 2]") + b"\x00" * 7)  # a bad state and a torn tail
    settings = ApiSettings(
        host="127.0.0.1",
        port=free_port(),
        token="",
        max_queued_sequences=64,
        max_request_bytes=1 << 20,
        full_wait=0.1,
        spool_dir=str(spool_dir),
    )

    async def run() -> int:
        ready, stop = asyncio.Event(), asyncio.Event()
        task = asyncio.ensure_future(serve(settings, ready=ready, stop=stop))
        await asyncio.wait([asyncio.ensure_future(ready.wait()), task], return_when=asyncio.FIRST_COMPLETED)
        assert ready.is_set(), "the API did not start"
        stop.set()
        return await task

    assert asyncio.run(run()) == 0
    assert len(list((spool_dir / BAD_DIR).iterdir())) == 3


def test_frame_crc_covers_the_kind() -> None:
    frame = _frame(b"A", b"{}")
    assert zlib.crc32(b"{}", zlib.crc32(b"A")) == int.from_bytes(frame[4:8], "little")
    assert orjson.loads(frame[9:]) == {}

"""The parse helper process (atroposd.api.ingest): every body gets from it the answer the event
loop would give; a helper that dies loses nothing and comes back; it never outlives the API."""

from __future__ import annotations

import asyncio
import gzip
import os
import pickle
import re
import signal
import threading
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest

from atroposd.api import ingest
from atroposd.api import server as server_module
from atroposd.api.bodies import groups_from_body, gunzip
from atroposd.api.ingest import ParseHelper
from atroposd.api.queue import TrajectoryStore
from atroposd.api.schema import InvalidRequest, dumps, group_to_json
from atroposd.api.server import ApiServer, ApiSettings
from tests.api.conftest import group, start_atroposd
from tests.api.test_fastparse import plain
from tests.support import stop_process, wait_for

LIMIT = 1 << 20


def answer(groups: Any) -> Any:
    return [orjson.loads(dumps(group_to_json(g))) for g in groups]


async def outcome_of(coro: Any) -> Any:
    try:
        return ("accepted", answer(await coro))
    except InvalidRequest as exc:
        return ("refused", exc.status, exc.reason, str(exc))


async def parsed(helper: ParseHelper, raw: bytes, gz: bool, listed: bool, max_token_len: int | None) -> Any:
    """What the API does with a body: the helper's groups, or (None) the loop's own parse."""
    groups = await helper.groups(raw, gz, listed=listed, max_token_len=max_token_len)
    if groups is not None:
        return groups
    return groups_from_body(gunzip(raw, helper.limit) if gz else raw, listed=listed, max_token_len=max_token_len)


def on_loop(raw: bytes, gz: bool, listed: bool, max_token_len: int | None) -> Any:
    """What the event loop makes of a body (the reference)."""
    try:
        return (
            "accepted",
            answer(groups_from_body(gunzip(raw, LIMIT) if gz else raw, listed=listed, max_token_len=max_token_len)),
        )
    except InvalidRequest as exc:
        return ("refused", exc.status, exc.reason, str(exc))


def bodies() -> list[tuple[str, bytes, bool, bool, int | None]]:
    """(name, raw, gzip, listed, max_token_len): plain, refused, irregular, gzip'ed and bad gzip."""
    one = orjson.dumps(plain(8, 64, seed=3))
    many = orjson.dumps([plain(2, 5, seed=k) for k in range(3)])
    out = [
        ("plain", one, False, False, None),
        ("plain, gzip", gzip.compress(one), True, False, None),
        ("a list, gzip", gzip.compress(many), True, True, None),
        ("too long for max_token_len", one, False, False, 32),
        ("unequal lengths", orjson.dumps(plain(2, 5, masks=[[1] * 5, [1] * 4])), False, False, None),
        ("a score missing", orjson.dumps(plain(2, 5, scores=[1.0])), False, False, None),
        ("a non-finite score", b'{"tokens": [[1]], "masks": [[1]], "scores": [NaN]}', False, False, None),
        (
            "integral floats (the full path)",
            b'{"tokens": [[1.0, 2]], "masks": [[1, 1]], "scores": [0]}',
            False,
            False,
            None,
        ),
        (
            "nested rows",
            b'{"tokens": [[1, 2], [3, [4]]], "masks": [[1, 1], [1, 1]], "scores": [0, 1]}',
            False,
            False,
            None,
        ),
        ("not JSON", b"{not json", False, False, None),
        ("not a list", one, False, True, None),
        ("bad gzip", b"\x1f\x8b\x08\x00garbage-garbage", True, False, None),
        ("over the limit after inflating", gzip.compress(b" " * (LIMIT + 1)), True, False, None),
    ]
    return out


def test_the_helper_answers_as_the_loop_would(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest, "MIN_BYTES", 0)  # small bodies too
    cases = bodies()

    async def run() -> list[Any]:
        helper = ParseHelper(LIMIT)
        await helper.start()
        try:
            got = [await outcome_of(parsed(helper, raw, gz, listed, mtl)) for _, raw, gz, listed, mtl in cases]
            assert helper.handed == len(cases) and helper.on_loop == 0, "the helper did not take every body"
            return got
        finally:
            await helper.close()
        assert helper.proc is not None and helper.proc.returncode is not None

    got = asyncio.run(run())
    for (name, raw, gz, listed, mtl), answered in zip(cases, got, strict=True):
        assert answered == on_loop(raw, gz, listed, mtl), name
    assert sum(1 for a in got if a[0] == "refused") >= 8  # the corpus does exercise refusals


def test_bodies_beyond_its_depth_are_parsed_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest, "MIN_BYTES", 0)
    raws = [orjson.dumps(plain(4, 32, seed=k)) for k in range(12)]

    async def run() -> tuple[list[Any], int, int]:
        helper = ParseHelper(LIMIT)
        await helper.start()
        try:
            got = await asyncio.gather(*(outcome_of(parsed(helper, r, False, False, None)) for r in raws))
            return list(got), helper.handed, helper.on_loop
        finally:
            await helper.close()

    got, handed, looped = asyncio.run(run())
    assert got == [on_loop(r, False, False, None) for r in raws]
    assert handed == ingest.DEPTH and looped == len(raws) - ingest.DEPTH


def test_small_bodies_are_parsed_on_the_loop() -> None:
    small, large = orjson.dumps(plain(2, 5)), orjson.dumps(plain(8, 256))
    assert len(small) < ingest.MIN_BYTES <= len(large)

    async def run() -> tuple[int, int]:
        helper = ParseHelper(LIMIT)
        await helper.start()
        try:
            assert await outcome_of(parsed(helper, small, False, False, None)) == on_loop(small, False, False, None)
            assert await outcome_of(parsed(helper, large, False, False, None)) == on_loop(large, False, False, None)
            return helper.handed, helper.on_loop
        finally:
            await helper.close()

    assert asyncio.run(run()) == (1, 1)


def test_a_dead_helper_loses_nothing_and_comes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest, "RESTART_DELAY_S", 0.2)
    raw = orjson.dumps(plain(8, 64, seed=5))
    expected = on_loop(raw, False, False, None)

    async def run() -> None:
        helper = ParseHelper(LIMIT)
        await helper.start()
        try:
            assert helper.proc is not None
            first = helper.proc.pid
            assert await outcome_of(parsed(helper, raw, False, False, None)) == expected
            os.kill(first, signal.SIGKILL)
            # bodies sent to the dead helper, or after it was seen to be gone, are parsed here
            for _ in range(3):
                assert await outcome_of(parsed(helper, raw, False, False, None)) == expected
            assert helper.on_loop >= 1 and not helper.up
            await asyncio.sleep(0.3)
            assert await outcome_of(parsed(helper, raw, False, False, None)) == expected
            assert helper.restarts == 1 and helper.up and helper.proc.pid != first
            assert not psutil.pid_exists(first) or psutil.Process(first).status() == psutil.STATUS_ZOMBIE
        finally:
            await helper.close()

    asyncio.run(run())


def helper_of(api_pid: int) -> psutil.Process:
    kids = [p for p in psutil.Process(api_pid).children() if "atroposd.api.ingest" in " ".join(p.cmdline())]
    assert len(kids) == 1, kids
    return kids[0]


def test_api_under_load_survives_its_helper_being_killed(tmp_path: Path) -> None:
    """kill -9 of the helper while 8 clients post: every post is answered 200, every group is
    served once, and the helper is back (the metrics count the restart)."""
    server = start_atroposd(tmp_path)
    api = server.api
    try:
        api.start(batch_size=8, max_token_len=512)
        first = helper_of(server.proc.pid)
        statuses: list[int] = []
        lock = threading.Lock()

        def client(c: int) -> None:
            for k in range(25):
                r = api.post("/scored_data", group(4, length=400, tag=float(c * 100 + k)))  # 30 KB: helper-sized
                with lock:
                    statuses.append(r.status)

        threads = [threading.Thread(target=client, args=(c,)) for c in range(8)]
        for t in threads:
            t.start()
        wait_for(lambda: len(statuses) >= 40, timeout=30, what="posts under way")
        first.send_signal(signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert statuses == [200] * 200
        served = sorted(g["scores"][0] for batch in api.drain() for g in batch)
        assert served == sorted(float(c * 100 + k) for c in range(8) for k in range(25))
        wait_for(
            lambda: (
                api.post("/scored_data", group(4, tag=-1.0)).status == 200
                and helper_of(server.proc.pid).pid != first.pid
            ),
            timeout=20,
            what="a new helper",
        )
        metrics = api.get("/metrics").body.decode()
        assert "atroposd_api_parse_helper_restarts 1.0" in metrics
        handed = re.search(r'atroposd_api_parsed_bodies\{where="helper"\} (\S+)', metrics)
        assert handed is not None and float(handed.group(1)) >= 20, metrics
        assert "the parse helper is gone" in server.log.read_text()
    finally:
        stop_process(server.proc)


def test_the_helper_dies_with_the_api(tmp_path: Path) -> None:
    server = start_atroposd(tmp_path)
    try:
        helper = helper_of(server.proc.pid)
        os.kill(server.proc.pid, signal.SIGKILL)  # no chance to close anything
        server.proc.wait(10)
        wait_for(
            lambda: not helper.is_running() or helper.status() == psutil.STATUS_ZOMBIE,
            timeout=10,
            what="the helper to end with the API",
        )
    finally:
        stop_process(server.proc)


def test_a_stopped_api_ends_its_helper_first(tmp_path: Path) -> None:
    """SIGTERM to the API's process group (as the supervisor stops it): the helper ignores it,
    the API closes the helper's socket and reaps it, and exits 0 with nothing left."""
    server = start_atroposd(tmp_path)
    helper = helper_of(server.proc.pid)
    assert stop_process(server.proc) == 0
    assert not helper.is_running()
    assert "the parse helper is gone" not in server.log.read_text()


def test_the_helper_can_be_turned_off(tmp_path: Path) -> None:
    server = start_atroposd(tmp_path, env={ingest.ENV: "0"})
    try:
        server.api.start(batch_size=8)
        assert server.api.ok("POST", "/scored_data", group(8)) == {"status": "received"}
        assert psutil.Process(server.proc.pid).children() == []
    finally:
        stop_process(server.proc)


def test_an_answer_that_does_not_decode_replaces_the_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest, "RESTART_DELAY_S", 0.2)
    raw = orjson.dumps(plain(8, 64, seed=6))
    expected = on_loop(raw, False, False, None)
    real = ingest.decode_groups
    calls = {"n": 0}

    def garbled(payload: bytes) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise pickle.UnpicklingError("garbled")
        return real(payload)

    monkeypatch.setattr(ingest, "decode_groups", garbled)

    async def run() -> None:
        helper = ParseHelper(LIMIT)
        await helper.start()
        try:
            assert helper.proc is not None
            first = helper.proc
            assert await outcome_of(parsed(helper, raw, False, False, None)) == expected
            assert helper.on_loop == 1 and not helper.up
            await asyncio.sleep(0.3)
            assert await outcome_of(parsed(helper, raw, False, False, None)) == expected
            assert helper.restarts == 1 and helper.proc is not first and helper.on_loop == 1
            await asyncio.wait_for(first.wait(), 5)  # the distrusted helper was ended
        finally:
            await helper.close()

    asyncio.run(run())


def test_a_large_gzip_body_parsed_on_the_loop_inflates_on_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body the helper leaves to the loop (here it never has room) is inflated by the server,
    on its inflater thread when it is 1 MiB or more, as without a helper."""
    monkeypatch.setattr(ingest, "DEPTH", 0)
    raw = gzip.compress(orjson.dumps(plain(8, 20000, seed=9)), compresslevel=1)
    assert len(raw) >= server_module.GUNZIP_THREAD_MIN_BYTES
    threads: list[str] = []
    real = server_module.gunzip

    def spy(data: bytes, limit: int) -> Any:
        threads.append(threading.current_thread().name)
        return real(data, limit)

    monkeypatch.setattr(server_module, "gunzip", spy)
    limit = 64 << 20
    settings = ApiSettings(
        host="127.0.0.1",
        port=0,
        token="",
        max_queued_sequences=64,
        max_request_bytes=limit,
        full_wait=0.1,
        spool_dir=None,
    )

    async def run() -> tuple[Any, Any]:
        helper = ParseHelper(limit)
        await helper.start()
        server = ApiServer(TrajectoryStore(64), settings, helper)
        try:
            declined = await helper.groups(raw, True, listed=False, max_token_len=None)
            body = await server._inflate(raw, True)
            return declined, ("accepted", answer(groups_from_body(body, listed=False, max_token_len=None)))
        finally:
            server._inflater.shutdown(wait=True)
            await helper.close()

    declined, got = asyncio.run(run())
    assert declined is None
    assert got[0] == "accepted" and got == on_loop_limit(raw, limit)
    assert threads and threads[0] != threading.main_thread().name


def on_loop_limit(raw: bytes, limit: int) -> Any:
    return ("accepted", answer(groups_from_body(gunzip(raw, limit), listed=False, max_token_len=None)))

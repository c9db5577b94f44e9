"""Sizes bounded before allocation and bounds that hold for every body (SPEC §13): the
distillation fields against their token rows, a binary batch never wider than its token rows
and laid out off the event loop, request bodies charged as they arrive whatever their framing,
a cap on connections, gzip bodies inflated off the loop whatever their trailer says, segment
names that do not give a batch away.

The API runs in this process (its objects can be inspected) on a loopback port, without the
parse helper."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from atroposd.api import binary, shmbatch
from atroposd.api import server as server_module
from atroposd.api.fastparse import parse_groups
from atroposd.api.queue import TrajectoryStore
from atroposd.api.schema import MAX_DISTILL_K, InvalidRequest, group_from_json
from atroposd.api.server import ApiServer, ApiSettings
from atroposd.api.shmbatch import ShmBatches
from tests.api.conftest import group

# ----------------------------------------------------------------------------- an API in this process


def _settings(**over: Any) -> ApiSettings:
    s = ApiSettings(
        host="127.0.0.1",
        port=0,
        token="",
        max_queued_sequences=256,
        max_request_bytes=1 << 20,
        full_wait=0.1,
        spool_dir=None,
    )
    for k, v in over.items():
        setattr(s, k, v)
    return s


@contextlib.asynccontextmanager
async def running(settings: ApiSettings) -> AsyncIterator[tuple[ApiServer, str, int]]:
    """(server, url, port) of an API served by this event loop."""
    store = TrajectoryStore(settings.max_queued_sequences, capacity_bytes=settings.queue_bytes())
    server = ApiServer(store, settings)
    runner = web.AppRunner(
        server.app(),
        auto_decompress=False,
        access_log=None,
        handle_signals=False,
        handler_cancellation=True,
        shutdown_timeout=0.5,
    )
    await runner.setup()
    try:
        site = server.site(runner)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield server, f"http://127.0.0.1:{port}", port
    finally:
        await runner.cleanup()


async def _post(session: aiohttp.ClientSession, url: str, body: Any, **kw: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with session.post(
        url, data=data, headers={"Content-Type": "application/json", **kw.pop("headers", {})}, **kw
    ) as r:
        return r.status, await r.read()


async def _start(session: aiohttp.ClientSession, url: str, batch_size: int) -> None:
    status, _ = await _post(
        session,
        url + "/register",
        dict(
            wandb_group="g",
            wandb_project="p",
            batch_size=batch_size,
            max_token_len=4096,
            checkpoint_dir="c",
            save_checkpoint_interval=0,
            starting_step=0,
            num_steps=10,
        ),
    )
    assert status == 200
    async with session.get(url + "/batch") as r:  # opens the gate for environments
        assert r.status == 200


def _segment_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


# ----------------------------------------------------------------------------- distillation at ingestion


def _outcomes(body: dict[str, Any]) -> tuple[str, str]:
    """(fast path, full path) for one /scored_data body: 'accepted' or 'status reason'."""
    raw = json.dumps(body).encode()
    out = []
    for parse in (
        lambda: parse_groups(raw, listed=False, max_token_len=None),
        lambda: [group_from_json(json.loads(raw))],
    ):
        try:
            got = parse()
            out.append("accepted" if got is not None else "declined")
        except InvalidRequest as exc:
            out.append(f"{exc.status} {exc.reason}")
    return out[0], out[1]


@pytest.mark.parametrize(
    "change",
    [
        {"distill_token_ids": [[[7]] * 10_000] * 2},  # far more positions than tokens
        {"distill_token_ids": [[[7]] * 4] * 3},  # more sequences than the group has
        {"distill_token_ids": [[[7]] * 4, [[7]] * 3]},  # a sequence one position short
        {"distill_token_ids": [[list(range(MAX_DISTILL_K + 1))] * 4] * 2},  # k past the bound
        {"distill_token_ids": [[[True]] * 4] * 2},  # not integers
        {"distill_token_ids": [[[1.5]] * 4] * 2},
        {"distill_token_ids": [[7] * 4] * 2},  # not [position][k]
        {"distill_logprobs": [[["x"]] * 4] * 2},
        {"distill_logprobs": [[[1e308 * 10]] * 4] * 2},  # json.dumps writes Infinity: invalid JSON, 400
        {"distill_token_ids": [[[7, 8]] * 4] * 2, "distill_logprobs": [[[-0.5]] * 4] * 2},  # k differs
    ],
    ids=["positions", "sequences", "short", "k", "bool", "float_id", "flat", "string", "infinite", "k_differs"],
)
def test_distillation_fields_are_checked_against_their_token_rows(change: dict[str, Any]) -> None:
    """One entry per sequence, one per token in it, at most MAX_DISTILL_K numbers each, finite:
    else a 4xx on both parse paths (a wide group used to be accepted and widen every batch)."""
    fast, full = _outcomes(group(2, length=4, **change))
    assert full.startswith("4") and fast in (full, "declined"), (fast, full)
    if "1e308" not in repr(change) and "inf" not in repr(change):
        assert full == "422 distill_invalid", full


def test_distillation_fields_that_fit_are_accepted_on_both_paths() -> None:
    ok = group(
        2,
        length=4,
        distill_token_ids=[[[1, 2], [3], [], None], None],
        distill_logprobs=[[[-0.1, -0.2], [-0.3], [], None], None],
    )
    assert _outcomes(ok) == ("accepted", "accepted")
    top = group(
        1,
        length=2,
        distill_token_ids=[[list(range(MAX_DISTILL_K))] * 2],
        distill_logprobs=[[[-1.0] * MAX_DISTILL_K] * 2],
    )
    assert _outcomes(top) == ("accepted", "accepted")


def test_a_wide_distillation_group_is_a_422_and_counted() -> None:
    async def run() -> None:
        async with running(_settings()) as (server, url, _), aiohttp.ClientSession() as s:
            wide = group(2, length=4, distill_token_ids=[[[7]] * 20_000] * 2, distill_logprobs=[[[-0.5]] * 20_000] * 2)
            status, body = await _post(s, url + "/scored_data", wide)
            assert status == 422 and b"one entry per token" in body, (status, body[:300])
            assert server.metrics.rejected.labels("distill_invalid")._value.get() == 1
            assert server.store.held == 0

    asyncio.run(run())


# ----------------------------------------------------------------------------- binary batches


def _unchecked(body: dict[str, Any], **extras: Any) -> Any:
    """A group as the API holds it, with passthrough fields no longer checked (a group spooled by
    an API before the check, replayed)."""
    g = group_from_json(body)
    for k, v in extras.items():
        g.extras[k] = orjson.dumps(v)
    return g


def test_wide_distillation_group_gives_a_bounded_binary_batch() -> None:
    """A 2 × 4-token group whose distillation fields claim 20,000 positions of up to 4,096 ids: the
    batch stays 4 wide, K within the bound, and the fields stay in groups_json (this group used
    to plan a [4, 20000, 4096] batch: 3.7 GiB)."""
    wide = _unchecked(
        group(2, length=4),
        distill_token_ids=[[[7] * 4096] + [[7]] * 19_999] * 2,
        distill_logprobs=[[[-0.5]] * 20_000] * 2,
    )
    fits = group_from_json(
        group(2, length=6, distill_token_ids=[[[1, 2]] * 6] * 2, distill_logprobs=[[[-0.1, -0.2]] * 6] * 2)
    )
    layout = binary.plan_batch([binary.rows_from_group(g) for g in (wide, fits)])
    shapes = {name: shape for name, _, shape in layout.specs}
    assert shapes["tokens"] == (4, 6), "no wider than the widest token row"
    assert shapes["distill_token_ids"] == (4, 6, 2)
    # planned before anything is allocated: the tensors are small, groups_json holds the fields
    assert layout.size - len(layout.groups_json) < 16 << 10, layout.size
    assert len(layout.groups_json) <= sum(len(v) for v in wide.extras.values()) + 1024
    arrays, _ = binary.decode(layout.to_bytes())
    kept = orjson.loads(arrays["groups_json"].tobytes())
    assert len(kept[0]["distill_token_ids"][0]) == 20_000, "nothing accepted is lost"
    assert (arrays["distill_token_ids"][:2] == -1).all() and arrays["distill_token_ids"][2, 0].tolist() == [1, 2]


def test_rows_wider_than_their_tokens_do_not_widen_a_batch() -> None:
    """advantages / ref_logprobs are not validated (upstream posts them loosely): a row longer
    than its sequence keeps the field in groups_json instead of widening the batch."""
    g = group_from_json(group(2, length=4, advantages=[[0.5] * 100_000, [0.5]]))
    layout = binary.plan_batch([binary.rows_from_group(g)])
    assert dict((n, s) for n, _, s in layout.specs)["tokens"] == (2, 4) and "advantages" not in {
        n for n, _, _ in layout.specs
    }
    assert layout.size - len(layout.groups_json) < 16 << 10


def test_batches_are_planned_and_filled_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """safetensors and shared-memory batches are laid out on the batch thread, not the loop."""
    threads: list[str] = []
    real_fill, real_plan = binary.BatchLayout.fill, binary.plan_batch

    def fill(self: binary.BatchLayout, buf: Any) -> None:
        threads.append("fill:" + threading.current_thread().name)
        real_fill(self, buf)

    def plan(*args: Any, **kw: Any) -> binary.BatchLayout:
        threads.append("plan:" + threading.current_thread().name)
        return real_plan(*args, **kw)

    monkeypatch.setattr(binary.BatchLayout, "fill", fill)
    monkeypatch.setattr(binary, "plan_batch", plan)
    monkeypatch.setattr(shmbatch, "plan_batch", plan)

    async def run() -> None:
        async with running(_settings()) as (_, url, _port), aiohttp.ClientSession() as s:
            await _start(s, url, batch_size=2)
            for fmt in ("safetensors", "shm"):
                assert (await _post(s, url + "/scored_data", group(2, length=5)))[0] == 200
                async with s.get(url + f"/batch?format={fmt}") as r:
                    assert r.status == 200
                    body = await r.read()
                if fmt == "shm":
                    info = orjson.loads(body)["shm"]
                    assert (await _post(s, url + "/batch/ack", {"batch_id": info["batch_id"]}))[0] == 200
                else:
                    assert binary.decode(body)[0]["tokens"].shape == (2, 5)

    asyncio.run(run())
    assert len(threads) == 4 and all(t.split(":")[1].startswith("api-batch") for t in threads), threads


def test_segment_names_do_not_carry_the_batch_id() -> None:
    """Any local user can list /dev/shm: a name that held the batch id let them acknowledge
    another trainer's batch."""

    async def run() -> None:
        async with running(_settings()) as (server, url, _), aiohttp.ClientSession() as s:
            await _start(s, url, batch_size=2)
            assert (await _post(s, url + "/scored_data", group(2, length=5)))[0] == 200
            async with s.get(url + "/batch?format=shm") as r:
                info = orjson.loads(await r.read())["shm"]
            name = info["name"]
            assert _segment_exists(name)
            assert info["batch_id"] not in name and name.startswith(server.shm.prefix)
            assert len(name) - len(server.shm.prefix) == 32  # its own 128 random bits
            assert (await _post(s, url + "/batch/ack", {"batch_id": info["batch_id"]}))[0] == 200
            assert not _segment_exists(name)

    asyncio.run(run())


def test_a_large_batchs_scratch_memory_is_given_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """One large batch does not pin its scratch buffer; a small one is kept for the next."""
    monkeypatch.setattr(shmbatch, "SCRATCH_KEEP_BYTES", 4096)

    async def run() -> None:
        shm = ShmBatches(TrajectoryStore(1000), ack_timeout=30.0, spool_dir=None)
        try:
            small = await shm.offer([group_from_json(group(1, length=3))], 0, 0)
            assert len(shm._scratch) >= small["size"], "a small one is kept for the next batch"
            big = await shm.offer([group_from_json(group(8, length=300))], 0, 1)
            assert big["size"] > 4096 and len(shm._scratch) == 0, "given back"
            assert shm.ack(small["batch_id"])["acknowledged"]
        finally:
            shm.close()
        assert not _segment_exists(big["name"])

    asyncio.run(run())


# ----------------------------------------------------------------------------- bodies in flight


async def _stall_chunked(port: int, path: str, nbytes: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send ``nbytes`` of a chunked body to ``path`` and stop there (the body never ends)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n".encode()
    )
    chunk = 16 << 10
    for start in range(0, nbytes, chunk):
        size = min(chunk, nbytes - start)
        writer.write(b"%x\r\n%s\r\n" % (size, b" " * size))
    await writer.drain()
    return reader, writer


async def _until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_chunked_bodies_and_every_route_count_against_the_in_flight_bound() -> None:
    """A chunked body is charged as it arrives (it used to be charged only once complete, so
    any number of them could be read at once), and so is every other body a route reads."""

    async def run() -> None:
        async with running(_settings(max_request_bytes=512 << 10)) as (server, url, port), aiohttp.ClientSession() as s:
            server.max_inflight_bytes = 400 << 10
            _, writer = await _stall_chunked(port, "/scored_data", 300 << 10)
            await _until(lambda: server.inflight_bytes >= 250 << 10)
            # a second chunked body: refused once what arrived passes the bound
            r2, w2 = await _stall_chunked(port, "/scored_data_list", 200 << 10)
            head = await asyncio.wait_for(r2.readuntil(b"\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 503"), head
            w2.close()
            # the other routes' bodies count as well
            pad = {"batch_id": "x" * (200 << 10)}
            status, body = await _post(s, url + "/batch/ack", pad)
            assert status == 503 and b"in flight" in body, (status, body[:200])
            status, _ = await _post(s, url + "/register-env", {"desired_name": "x" * (200 << 10)})
            assert status == 503
            assert server.metrics.refused.labels("inflight")._value.get() >= 3
            writer.close()
            await _until(lambda: server.inflight_bytes == 0)
            assert (await _post(s, url + "/batch/ack", {"batch_id": "y"}))[0] == 200, "room again"

    asyncio.run(run())


def test_a_refused_body_gives_its_room_back_at_once() -> None:
    """Four chunked uploads arrive together and pass the bound: one is refused and its bytes are
    given back before the others are read on, so the three that fit go on (refusals used to
    cascade: each body read in the same turn of the loop was refused before any gave room back)."""

    async def run() -> None:
        async with running(_settings(max_request_bytes=512 << 10)) as (server, _, port):
            server.max_inflight_bytes = 300 << 10
            conns = [await _stall_chunked(port, "/scored_data", 70 << 10) for _ in range(4)]
            await _until(lambda: server.inflight_bytes == 4 * (70 << 10))
            for _, w in conns:  # 20 KiB more on each, all there before the API reads on
                w.write(b"%x\r\n%s\r\n" % (20 << 10, b" " * (20 << 10)))
            await asyncio.gather(*(w.drain() for _, w in conns))
            await _until(lambda: server.metrics.refused.labels("inflight")._value.get() >= 1)
            await asyncio.sleep(0.2)
            assert server.metrics.refused.labels("inflight")._value.get() == 1
            assert server.inflight_bytes == 3 * (90 << 10)
            for _, w in conns:
                w.close()
            await _until(lambda: server.inflight_bytes == 0)

    asyncio.run(run())


def test_declared_but_idle_bodies_hold_no_room() -> None:
    """Four connections that declare bodies of max_request_bytes and send nothing hold no room:
    an honest upload goes through (the declared lengths used to be charged before any byte
    arrived, so four idle connections made every upload a 503 for the body deadline)."""

    async def run() -> None:
        async with running(_settings(max_request_bytes=1 << 20)) as (server, url, port), aiohttp.ClientSession() as s:
            idle = []
            for _ in range(server_module.INFLIGHT_BODIES):
                _reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(
                    b"POST /scored_data HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % (1 << 20)
                )
                await writer.drain()
                idle.append(writer)
            await asyncio.sleep(0.2)  # every handler is waiting for its body
            await _start(s, url, 4)
            status, body = await _post(s, url + "/scored_data", group(2))
            assert status == 200, (status, body[:200])
            assert server.inflight_bytes == 0
            assert server.metrics.refused.labels("inflight")._value.get() == 0
            for w in idle:
                w.close()
            await _until(lambda: server.inflight_bytes == 0)

    asyncio.run(run())


def test_a_chunked_body_past_max_request_bytes_is_413_as_it_arrives() -> None:
    async def run() -> None:
        async with running(_settings(max_request_bytes=64 << 10)) as (server, _, port):
            reader, writer = await _stall_chunked(port, "/scored_data", 100 << 10)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 413"), head
            writer.close()
            await _until(lambda: server.inflight_bytes == 0)

    asyncio.run(run())


def test_a_refused_body_is_freed_at_once() -> None:
    """What arrived of a refused body is freed when it is refused, not when the cyclic garbage
    collector runs (the exception's traceback held it in a cycle: 36 refused uploads kept 195
    MiB alive)."""
    import gc
    import tracemalloc

    async def run() -> int:
        async with running(_settings(max_request_bytes=4 << 20)) as (server, _, port):
            before = tracemalloc.get_traced_memory()[0]
            reader, writer = await _stall_chunked(port, "/scored_data", 5 << 20)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 413"), head
            writer.close()
            await _until(lambda: server.inflight_bytes == 0)
            await asyncio.sleep(0.1)
            return tracemalloc.get_traced_memory()[0] - before

    gc.disable()
    tracemalloc.start()
    try:
        held = asyncio.run(run())
    finally:
        tracemalloc.stop()
        gc.enable()
    assert held < 1 << 20, held


def test_connections_past_the_cap_get_503() -> None:
    async def run() -> None:
        async with running(_settings(max_connections=3)) as (server, url, port):
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /info HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 5)  # then closed
            assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer, answer
            writer.close()
            assert server.metrics.refused.labels("connections")._value.get() == 1
            idle[0][1].close()
            await _until(lambda: server.site_connections() < 3)
            async with aiohttp.ClientSession() as s, s.get(url + "/info") as r:
                assert r.status == 200, "room again once one is closed"
            for _, w in idle[1:]:
                w.close()

    asyncio.run(run())


def test_refused_connections_are_counted_each_and_logged_once(capsys: pytest.CaptureFixture[str]) -> None:
    """A flood past the cap is counted connection by connection but logged once per 10 s."""

    async def run() -> None:
        async with running(_settings(max_connections=1)) as (server, _, port):
            idle = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(20):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 503")
                writer.close()
            assert server.metrics.refused.labels("connections")._value.get() == 20
            idle[1].close()

    asyncio.run(run())
    assert capsys.readouterr().out.count("connection refused: too many open") == 1


def test_connection_cap_stays_below_the_descriptor_limit() -> None:
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert _settings(max_connections=1 << 30).connection_cap() <= max(1, soft - server_module.FD_RESERVE)
    assert _settings(max_connections=5).connection_cap() == 5


# ----------------------------------------------------------------------------- gzip off the loop


def _lying_bodies() -> dict[str, bytes]:
    """gzip bodies of a valid group whose last four bytes understate what they inflate to."""
    payload = orjson.dumps(group(2, generation_params={"pad": os.urandom(40 << 10).hex()}))
    tiny = gzip.compress(b" ")
    members = gzip.compress(payload) + tiny  # valid: the trailer is the last member's
    forged = bytearray(gzip.compress(payload))
    forged[-4:] = (10).to_bytes(4, "little")  # one member whose size field lies: invalid
    return {"members": members, "forged": bytes(forged)}


@pytest.mark.parametrize("libdeflate", [True, False], ids=["libdeflate", "zlib"])
@pytest.mark.parametrize("name", ["members", "forged"])
def test_gzip_bodies_with_a_lying_trailer_inflate_off_the_event_loop(
    name: str, libdeflate: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trailer that understates the inflated size never keeps the inflation on the loop: a
    body of 4 KiB or more as sent inflates on the inflater thread whatever its trailer says."""
    raw = _lying_bodies()[name]
    assert server_module._inflated_size(raw, True) < server_module.GUNZIP_THREAD_MIN_BYTES
    threads: list[str] = []
    real = server_module.gunzip

    def spy(data: bytes, limit: int) -> Any:
        threads.append(threading.current_thread().name)
        return real(data, limit)

    monkeypatch.setattr(server_module, "gunzip", spy)
    monkeypatch.setattr(server_module, "HAS_LIBDEFLATE", libdeflate and server_module.HAS_LIBDEFLATE)

    async def run() -> None:
        async with running(_settings()) as (server, url, _), aiohttp.ClientSession() as s:
            status, body = await _post(s, url + "/scored_data", raw, headers={"Content-Encoding": "gzip"})
            assert status == (200 if name == "members" else 400), (status, body[:200])
            await _until(lambda: server.inflight_bytes == 0)

    asyncio.run(run())
    assert threads and all(t.startswith("api-inflate") for t in threads), threads
    assert len(raw) >= server_module.GUNZIP_THREAD_MIN_COMPRESSED


@pytest.mark.parametrize("size", ["small", "large"])
def test_where_a_gzip_body_whose_trailer_holds_inflates(size: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A body under GUNZIP_THREAD_MIN_COMPRESSED as sent (a few KiB) inflates on the loop, where a
    thread would cost more than the inflation; a larger one goes to the inflater thread even
    when its trailer is right (and small): whatever a trailer says, the loop inflates nothing
    sent larger."""
    pad = 256 if size == "small" else 4096
    body = orjson.dumps(
        group(8 if size == "large" else 1, length=512, generation_params={"pad": os.urandom(pad).hex()})
    )
    raw = gzip.compress(body)
    assert (len(raw) < server_module.GUNZIP_THREAD_MIN_COMPRESSED) == (size == "small"), len(raw)
    assert server_module._inflated_size(raw, True) < server_module.GUNZIP_THREAD_MIN_BYTES
    threads: list[str] = []

    def spying(real: Any) -> Any:
        def spy(data: bytes, limit: int) -> Any:
            threads.append(threading.current_thread().name)
            return real(data, limit)

        return spy

    monkeypatch.setattr(server_module, "gunzip_if_small", spying(server_module.gunzip_if_small))
    monkeypatch.setattr(server_module, "gunzip", spying(server_module.gunzip))

    async def run() -> None:
        server = ApiServer(TrajectoryStore(64), _settings())
        try:
            assert bytes(await server._inflate(raw, True)) == body
        finally:
            server._inflater.shutdown(wait=True)
            server._batcher.shutdown(wait=True)

    asyncio.run(run())
    if size == "small":
        assert threads == [threading.main_thread().name]
    else:
        assert threads and all(t.startswith("api-inflate") for t in threads), threads


def test_max_connections_from_the_flag_and_its_bound() -> None:
    import argparse

    from atroposd.api import cli

    ap = argparse.ArgumentParser()
    ap.add_argument("-c", dest="config")
    cli.add_arguments(ap)
    settings, _, _, problems = cli.settings_from(ap.parse_args(["--max-connections", "7"]))
    assert settings.max_connections == 7 and not problems
    _, _, _, problems = cli.settings_from(ap.parse_args(["--max-connections", "0"]))
    assert problems and "--max-connections" in " ".join(problems), problems


def test_a_wildcard_host_binds_cluster_bind_with_several_machines(tmp_path: Path) -> None:
    """With several machines ``atroposd api -c`` binds ``[cluster] bind`` for a wildcard host (SPEC
    §12.3: no port of a node listens on every interface); with one machine the host is as given."""
    import argparse

    from atroposd.api import cli

    token = tmp_path / "cluster.token"
    token.write_text("the-cluster-secret-of-the-job\n")
    token.chmod(0o600)
    common = f'[api]\nhost = "0.0.0.0"\n[daemon]\nstate_dir = "{tmp_path}/state"\nruntime_dir = "{tmp_path}/run"\n'
    two = tmp_path / "two.toml"
    two.write_text(
        common + f'[cluster]\nnodes = 2\nnode_rank = 0\nhead = "127.0.0.1"\nbind = "127.0.0.2"\n'
        f'token_file = "{token}"\n[trainer]\ncheckpoint_dir = "{tmp_path}/ckpt"\n'
    )
    one = tmp_path / "one.toml"
    one.write_text(common)
    ap = argparse.ArgumentParser()
    ap.add_argument("-c", dest="config")
    cli.add_arguments(ap)
    settings, _, _, problems = cli.settings_from(ap.parse_args(["-c", str(two)]))
    assert settings.host == "127.0.0.2" and not problems, (settings.host, problems)
    settings, _, _, problems = cli.settings_from(ap.parse_args(["-c", str(one)]))
    assert settings.host == "0.0.0.0" and not problems, (settings.host, problems)


def test_aiohttp_floor_has_the_request_smuggling_fixes() -> None:
    """aiohttp before 3.12.14 parses some chunked bodies and trailers in ways a proxy in front
    of the API may not (request smuggling); the dependency excludes those versions."""
    import importlib.metadata
    import re
    import sys

    from packaging.requirements import Requirement
    from packaging.version import Version

    from tests.support import REPO

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised only on 3.10
        import tomli as tomllib
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    req = next(Requirement(d) for d in deps if re.match(r"aiohttp\b", d))
    assert not req.specifier.contains("3.12.13") and req.specifier.contains("3.12.14"), str(req)
    assert Version(importlib.metadata.version("aiohttp")) >= Version("3.12.14")

"""Bounded memory (SPEC §5): a full queue makes a submission wait up to full_wait, then 503 with
Retry-After (never 429); draining lets a waiting submission in; nothing accepted is lost or
served twice, and the server's memory stays flat at the cap under a flood."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.api.conftest import Api, Reply, Server, group, start_atroposd
from tests.support import stop_process, wait_for


@pytest.fixture
def small(tmp_path: Path) -> Iterator[Server]:
    server = start_atroposd(tmp_path, "--max-queued-sequences", "16", "--full-wait", "0.5")
    try:
        yield server
    finally:
        stop_process(server.proc)


def metric(api: Api, name: str) -> float:
    text = api.get("/metrics").body.decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if m:
            total += float(m.group(2))
    return total


def test_full_queue_waits_then_503(small: Server) -> None:
    api = small.api
    api.start(batch_size=8)
    for k in range(4):
        assert api.ok("POST", "/scored_data", group(4, tag=float(k))) == {"status": "received"}
    status = api.ok("GET", "/status")
    assert (status["queued_sequences"], status["capacity"]) == (16, 16)
    started = time.monotonic()
    r = api.post("/scored_data", group(4, tag=9.0))
    waited = time.monotonic() - started
    assert r.status == 503 and r.headers["retry-after"] == "1"
    assert "queue is full" in r.json()["detail"]
    assert waited >= 0.45
    assert api.ok("GET", "/status")["queued_sequences"] == 16
    assert metric(api, "atroposd_api_refused_total") == 1
    # the cap counts formed batches until they are delivered
    assert len(api.ok("GET", "/batch")["batch"]) == 2  # forms two batches, serves one
    status = api.ok("GET", "/status")
    assert (status["queued_sequences"], status["formed_batches"]) == (8, 1)


def test_waiting_submission_gets_in_when_drained(tmp_path: Path) -> None:
    server = start_atroposd(tmp_path, "--max-queued-sequences", "8", "--full-wait", "20")
    try:
        api = server.api
        api.start(batch_size=8)
        api.ok("POST", "/scored_data", group(4, tag=1.0))
        api.ok("POST", "/scored_data", group(4, tag=2.0))
        result: list[Reply] = []
        t = threading.Thread(target=lambda: result.append(api.post("/scored_data", group(4, tag=3.0))))
        t.start()
        wait_for(lambda: api.ok("GET", "/status")["waiting_submissions"] == 1, timeout=10, what="a waiter")
        assert not result
        started = time.monotonic()
        batch = api.ok("GET", "/batch")["batch"]
        t.join(10)
        assert result and result[0].status == 200, result
        assert time.monotonic() - started < 5  # let in on the drain, not at the end of full_wait
        assert [g["scores"][0] for g in batch] == [1.0, 2.0]
        assert api.ok("GET", "/status")["queued_sequences"] == 4
    finally:
        stop_process(server.proc)


def test_list_larger_than_the_cap_is_413(small: Server) -> None:
    api = small.api
    api.start(batch_size=8)
    r = api.post("/scored_data_list", [group(4, tag=float(k)) for k in range(5)])
    assert r.status == 413 and "never fit" in r.json()["detail"]
    r = api.post("/scored_data_list", [group(4, tag=float(k)) for k in range(4)])
    assert r.status == 200 and r.json()["groups_processed"] == 4
    r = api.post("/scored_data_list", [group(1)])
    assert r.status == 503  # all or nothing: no room for even one


def test_flood_memory_flat_nothing_lost_nothing_twice(tmp_path: Path) -> None:
    """8 clients post 8×512-token groups as fast as they can while nobody drains: every refusal
    is a 503 after full_wait, memory stays flat at the cap; then a trainer drains everything and
    every accepted group arrives exactly once."""
    cap, clients, per_client = 128, 8, 10
    server = start_atroposd(tmp_path, "--max-queued-sequences", str(cap), "--full-wait", "0.2")
    api = server.api
    proc = psutil.Process(server.proc.pid)
    try:
        api.start(batch_size=64, max_token_len=512)
        accepted: list[float] = []
        statuses: Counter[int] = Counter()
        lock = threading.Lock()

        def client(c: int) -> None:
            mine = Api(server.url)
            for k in range(per_client):
                tag = c * 1000.0 + k
                body = group(8, length=512, tag=tag)
                while True:
                    r = mine.post("/scored_data", body)
                    with lock:
                        statuses[r.status] += 1
                    if r.status == 200:
                        with lock:
                            accepted.append(tag)
                        break
                    assert r.status == 503 and r.headers.get("retry-after"), (r.status, r.body[:200])

        threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
        for t in threads:
            t.start()
        wait_for(lambda: statuses[503] >= clients, timeout=60, what="refusals while nobody drains")
        rss_full = proc.memory_info().rss
        assert api.ok("GET", "/status")["queued_sequences"] <= cap
        wait_for(lambda: statuses[503] >= 4 * clients, timeout=60, what="more refusals")
        rss_later = proc.memory_info().rss
        assert rss_later - rss_full < 24 << 20, "memory grows while the queue is full"
        assert api.ok("GET", "/status")["queued_sequences"] <= cap

        served: list[float] = []
        deadline = time.monotonic() + 120
        while len(served) < clients * per_client and time.monotonic() < deadline:
            batch = api.ok("GET", "/batch")["batch"]
            for g in batch or []:
                assert len(g["tokens"]) == 8 and len(g["tokens"][0]) == 512
                served.append(g["scores"][0])
            assert api.ok("GET", "/status")["queued_sequences"] <= cap
        for t in threads:
            t.join(30)
        assert set(statuses) <= {200, 503}
        assert (
            sorted(served)
            == sorted(accepted)
            == sorted(c * 1000.0 + k for c in range(clients) for k in range(per_client))
        )
        assert len(set(served)) == len(served)
    finally:
        stop_process(server.proc)

"""Shared-memory batches (SPEC §5): delivered once acknowledged, served again after
``shm_ack_timeout``, a late acknowledgement ignored; exactly once across formats, API restarts
(with the spool) and a client killed while it holds a batch; segments follow the weight
segments' rules and never outlive the API or its next start."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest

from atroposd.api import binary
from atroposd.api.shmbatch import BATCH_PREFIX, RECORD_NAME
from atroposd.client import Batch, BatchClient
from atroposd.client.batches import _map_segment
from tests.api.conftest import Api, Server, group, start_atroposd
from tests.support import REPO, stop_process, wait_for

SHM = Path("/dev/shm")


def tagged(k: int, n: int = 4) -> dict[str, Any]:
    return group(n, tag=float(k), group_overrides={"tag": k})


def post(api: Api, tags: range, n: int = 4) -> None:
    api.ok("POST", "/scored_data_list", [tagged(k, n) for k in tags])


def take_shm(api: Api) -> dict[str, Any]:
    info = api.ok("GET", "/batch?format=shm")["shm"]
    assert info is not None
    return dict(info)


def ack(api: Api, batch_id: str, **extra: Any) -> dict[str, Any]:
    return dict(api.ok("POST", "/batch/ack", {"batch_id": batch_id, **extra}))


def tags_of(batch: Batch | dict[str, Any]) -> list[int]:
    raw = batch["groups_json"] if isinstance(batch, dict) else batch.arrays["groups_json"]
    return [g["group_overrides"]["tag"] for g in orjson.loads(raw.tobytes())]


def shm_tags(info: dict[str, Any]) -> list[int]:
    arrays, _ = binary.decode(_map_segment(info["name"], info["size"]))
    return tags_of(arrays)


def drain(client: BatchClient) -> list[int]:
    out = []
    while (b := client.get_batch()) is not None:
        out += tags_of(b)
    return out


def batch_segments() -> set[str]:
    return {p.name for p in SHM.glob(f"{BATCH_PREFIX}*")}


def test_acknowledged_batch_is_delivered_and_its_segment_unlinked(api: Api) -> None:
    api.start(batch_size=4)
    post(api, range(2))
    info = take_shm(api)
    seg = SHM / info["name"]
    st = seg.stat()
    assert info["name"].startswith(BATCH_PREFIX) and len(info["name"]) > len(BATCH_PREFIX) + 30
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid() and st.st_size == info["size"]
    assert api.ok("GET", "/status")["queued_sequences"] == 8, "held until acknowledged"
    first = shm_tags(info)
    assert ack(api, info["batch_id"]) == {"acknowledged": True, "batch_id": info["batch_id"]}
    assert not seg.exists()
    assert api.ok("GET", "/status")["queued_sequences"] == 4
    assert ack(api, info["batch_id"])["acknowledged"], "a repeated acknowledgement is answered the same"
    assert not ack(api, "0" * 24)["acknowledged"], "an unknown batch id"
    assert api.post("/batch/ack", {}).status == 422
    with BatchClient(api.url, batch_size=4, max_token_len=64) as client:
        rest = drain(client)
    assert sorted(first + rest) == [0, 1]
    metrics = api.get("/metrics").body.decode()
    assert "atroposd_api_batches_served_total 2.0" in metrics


def test_unacknowledged_batch_is_served_again_and_a_late_ack_ignored(tmp_path: Path) -> None:
    server = start_atroposd(tmp_path, "--shm-ack-timeout", "0.3")
    api = server.api
    try:
        api.start(batch_size=4)
        post(api, range(2))
        info = take_shm(api)
        assert shm_tags(info) == [1], "LIFO within one formation, as upstream"
        wait_for(
            lambda: api.ok("GET", "/status")["formed_batches"] == 2,
            timeout=10,
            what="the unacknowledged batch to go back",
        )
        assert not (SHM / info["name"]).exists()
        late = ack(api, info["batch_id"])
        assert late["acknowledged"] is False and "late" in late["detail"]
        assert api.ok("GET", "/status")["queued_sequences"] == 8, "the late ack changed nothing"
        with BatchClient(api.url, batch_size=4, max_token_len=64, transport="safetensors") as client:
            assert drain(client) == [1, 0], "the expired batch is served first"
        # release: a client that cannot read a segment gives the batch back at once
        post(api, range(5, 6))
        info = take_shm(api)
        assert ack(api, info["batch_id"], release=True)["released"]
        assert not (SHM / info["name"]).exists()
        assert api.ok("GET", "/status")["formed_batches"] == 1
    finally:
        stop_process(server.proc)


def test_exactly_once_across_formats(tmp_path: Path) -> None:
    server = start_atroposd(tmp_path)
    api = server.api
    try:
        api.start(batch_size=8)
        post(api, range(24), n=4)
        clients = [
            BatchClient(api.url, batch_size=8, max_token_len=64, transport=t) for t in ("shm", "safetensors", "json")
        ]
        got: list[int] = []
        seen = Counter[str]()
        for i in range(12):
            b = clients[i % 3].get_batch()
            assert b is not None
            seen[b.transport] += 1
            got += tags_of(b)
        assert all(c.get_batch() is None for c in clients)
        for c in clients:
            c.close()
        assert sorted(got) == list(range(24)) and seen == {"shm": 4, "safetensors": 4, "json": 4}
        assert api.ok("GET", "/status")["queued_sequences"] == 0
        assert not batch_segments()
        # the API child still maps no torch after serving every format
        pids = [server.proc.pid, *(p.pid for p in psutil.Process(server.proc.pid).children())]
        for pid in pids:
            assert "/torch/" not in Path(f"/proc/{pid}/maps").read_text()
    finally:
        stop_process(server.proc)


def test_stop_unlinks_and_kill9_leftovers_go_at_the_next_start(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    server = start_atroposd(tmp_path, "--spool-dir", str(spool))
    port = server.port
    try:
        server.api.start(batch_size=4)
        post(server.api, range(3))
        info = take_shm(server.api)
        first = shm_tags(info)
        prefix = f"{BATCH_PREFIX}{server.proc.pid}-"
        assert info["name"].startswith(prefix)
        assert (spool / RECORD_NAME).read_text().strip() == info["name"][: len(prefix) + 17]
        assert stop_process(server.proc) == 0
        assert not (SHM / info["name"]).exists(), "a clean stop unlinks every pending segment"
        server = start_atroposd(tmp_path, "--spool-dir", str(spool), port=port)
        pending = take_shm(server.api)
        assert shm_tags(pending) == first, "not acknowledged: replayed from the spool"
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        assert (SHM / pending["name"]).exists(), "kill -9 leaves it"
        server = start_atroposd(tmp_path, "--spool-dir", str(spool), port=port)
        assert not (SHM / pending["name"]).exists(), "the next start removes what the killed launch left"
        with BatchClient(server.url, batch_size=4, max_token_len=64) as client:
            assert sorted(drain(client)) == [0, 1, 2]
    finally:
        stop_process(server.proc)
    assert not batch_segments()


def test_exactly_once_across_an_api_restart(tmp_path: Path) -> None:
    """A trainer keeps pulling (shared memory) while the API is killed and started again with its
    spool: every group exactly once, the pending batch's segment gone."""
    spool = tmp_path / "spool"
    server = start_atroposd(tmp_path, "--spool-dir", str(spool))
    port = server.port
    client = BatchClient(server.url, batch_size=4, max_token_len=64, max_backoff=0.2)
    try:
        server.api.start(batch_size=4)
        post(server.api, range(8))
        first = client.next_batch(timeout=10)
        got = tags_of(first) + tags_of(client.next_batch(timeout=10))
        pending = take_shm(server.api)  # another trainer's, never acknowledged
        with BatchClient(server.url, batch_size=4, max_token_len=64, transport="json") as other:
            got += tags_of(other.next_batch(10))
        # A JSON batch counts once the API has finished writing it, which may come a moment
        # after the client has read it all: kill only once the API has recorded it.
        wait_for(
            lambda: server.api.ok("GET", "/status")["queued_sequences"] == 20,
            timeout=10,
            what="the JSON batch to be recorded as delivered",
        )
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        with pytest.raises(OSError):
            client.get_batch()  # the API is down: next_batch would retry
        server = start_atroposd(tmp_path, "--spool-dir", str(spool), port=port)
        assert not (SHM / pending["name"]).exists()
        assert first.batch_id is not None
        assert ack(server.api, first.batch_id)["acknowledged"], (
            "an acknowledgement whose answer was lost in the restart is answered the same (the spool)"
        )
        assert not ack(server.api, pending["batch_id"])["acknowledged"]
        while len(got) < 8:
            got += tags_of(client.next_batch(timeout=20))
        assert sorted(got) == list(range(8)), got
        assert client.get_batch() is None
        assert client.fallbacks == []
    finally:
        client.close()
        stop_process(server.proc)


CHILD = """
import sys, time, urllib.request, json
from atroposd.client.batches import _map_segment
info = json.loads(urllib.request.urlopen(sys.argv[1] + "/batch?format=shm").read())["shm"]
mapping = _map_segment(info["name"], info["size"])
print(info["batch_id"], flush=True)
time.sleep(600)
"""


def test_client_killed_holding_an_unacknowledged_batch(tmp_path: Path) -> None:
    server: Server = start_atroposd(tmp_path, "--shm-ack-timeout", "0.5")
    api = server.api
    child = None
    try:
        api.start(batch_size=4)
        post(api, range(4))
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, server.url],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert child.stdout is not None
        batch_id = child.stdout.readline().strip()
        assert batch_id
        child.kill()
        child.wait(10)
        with BatchClient(api.url, batch_size=4, max_token_len=64) as client:
            got = []
            while len(got) < 4:
                got += tags_of(client.next_batch(timeout=10))
            assert client.get_batch() is None
        assert sorted(got) == [0, 1, 2, 3]
        assert not ack(api, batch_id)["acknowledged"]
        assert not batch_segments()
    finally:
        if child is not None:
            if child.poll() is None:
                child.kill()
                child.wait(10)
            if child.stdout is not None:
                child.stdout.close()
        stop_process(server.proc)


def test_without_a_spool_the_next_api_removes_a_killed_apis_segments(tmp_path: Path) -> None:
    server = start_atroposd(tmp_path)
    try:
        server.api.start(batch_size=4)
        post(server.api, range(1))
        info = take_shm(server.api)
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        assert (SHM / info["name"]).exists()
    finally:
        stop_process(server.proc)
    other = start_atroposd(tmp_path)
    try:
        assert not (SHM / info["name"]).exists(), "its creator no longer runs"
    finally:
        stop_process(other.proc)

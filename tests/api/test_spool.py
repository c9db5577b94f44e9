"""Durability (SPEC §5): accepted groups and registrations survive kill -9 of the API; every
accepted, unserved group is served exactly once after a restart; the spool stays compact."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from atroposd.api.schema import group_from_json
from atroposd.api.spool import Spool, SpoolError
from tests.api.conftest import Api, RegisteredChild, Server, group, start_atroposd
from tests.support import REPO, free_port, spawn, stop_process, wait_for


def kill9(server: Server) -> None:
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)


def served_tags(batches: list[list[dict[str, Any]]]) -> list[float]:
    return [g["scores"][0] for batch in batches for g in batch]


def test_kill9_and_restart_serves_every_unserved_group_once(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    port = free_port()
    server = start_atroposd(tmp_path, "--spool-dir", str(spool), port=port)
    try:
        api = server.api
        api.start(batch_size=8, max_token_len=64)
        env = api.register_env(group_size=4, name="arith")["env_id"]
        tags = [float(k) for k in range(11)]
        for t in tags[:10]:
            assert api.ok("POST", "/scored_data", group(4, env_id=env, tag=t)) == {"status": "received"}
        # a mixed-size piece waits in the env's buffer
        assert api.ok("POST", "/scored_data", group(2, env_id=env, tag=tags[10]))["status"] == "buffered"
        first = [api.ok("GET", "/batch")["batch"], api.ok("GET", "/batch")["batch"]]  # 5 formed, 2 served
        assert api.ok("GET", "/status")["formed_batches"] == 3
        kill9(server)

        server = start_atroposd(tmp_path, "--spool-dir", str(spool), port=port)
        api = server.api
        assert api.ok("GET", "/info") == {"batch_size": 8, "max_token_len": 64}
        status = api.ok("GET", "/status")
        assert status["registered"] and status["started"] and status["current_step"] == 2
        assert status["queued_sequences"] == 6 * 4 + 2
        # the environment's id is still valid: it keeps posting and polling with it
        assert api.ok("GET", "/status-env", {"env_id": env})["self_queue_size"] == 6
        api.register(batch_size=8, max_token_len=64)  # the trainer registers again: nothing is reset
        assert api.ok("POST", "/scored_data", group(2, env_id=env, tag=11.0))["status"] == "buffered"
        assert api.ok("POST", "/scored_data", group(4, env_id=env, tag=12.0))["status"] == "received"
        rest = api.drain()
        got = served_tags(first) + served_tags(rest)
        assert sorted(got) == [float(k) for k in range(13)]  # the buffered halves joined the queue
        assert len(got) == len(set(got))
        kill9(server)

        # after delivery nothing comes back
        server = start_atroposd(tmp_path, "--spool-dir", str(spool), port=port)
        assert server.api.drain() == []
        assert server.api.ok("GET", "/status")["queued_sequences"] == 0
    finally:
        stop_process(server.proc)


def test_spool_is_exclusive_and_reset_data_clears_it(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    server = start_atroposd(tmp_path, "--spool-dir", str(spool))
    try:
        r = subprocess.run(
            [sys.executable, "-m", "atroposd", "api", "--port", str(free_port()), "--spool-dir", str(spool)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        assert r.returncode == 1 and "in use by another API process" in r.stderr
        server.api.start(batch_size=8)
        server.api.ok("POST", "/scored_data", group(4))
        assert server.api.get("/reset_data").status == 200
        stop_process(server.proc)
        server = start_atroposd(tmp_path, "--spool-dir", str(spool))
        assert server.api.ok("GET", "/info")["batch_size"] == -1
        assert server.api.ok("GET", "/status")["queued_sequences"] == 0
    finally:
        stop_process(server.proc)


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))


def test_spool_that_cannot_write_refuses_with_503(tmp_path: Path) -> None:
    """A full disk (here: a file-size limit) makes the API answer 503 rather than accept what it
    cannot keep; what it accepted before is served after a restart."""
    spool = tmp_path / "spool"
    port = free_port()
    log = tmp_path / "limited.log"
    proc = spawn(
        [sys.executable, "-m", "atroposd", "api", "--port", str(port), "--spool-dir", str(spool)],
        log=log,
        cwd=REPO,
        preexec_fn=_limit_file_size,
    )
    api = Api(f"http://127.0.0.1:{port}")
    try:
        from tests.support import wait_http

        wait_http(api.url + "/info", proc=proc)
        api.start(batch_size=8, max_token_len=512)
        accepted, refused = [], 0
        for k in range(40):
            r = api.post("/scored_data", group(4, length=500, tag=float(k)))
            if r.status == 200:
                accepted.append(float(k))
            else:
                assert r.status == 503 and "spool" in r.json()["detail"], r
                refused += 1
        assert refused and accepted
        assert api.ok("GET", "/status")["queued_sequences"] == 4 * len(accepted)
        stop_process(proc)
        server = start_atroposd(tmp_path, "--spool-dir", str(spool), port=port)
        try:
            assert sorted(served_tags(server.api.drain())) == accepted[: len(accepted) // 2 * 2]
        finally:
            stop_process(server.proc)
    finally:
        stop_process(proc)


# ----------------------------------------------------------------------------- in-process spool


def _g(tag: float, n: int = 4, env_id: int | None = None, length: int = 64) -> Any:
    return group_from_json(group(n, length=length, tag=tag, env_id=env_id))


def _write(spool: Spool, groups: list[Any], seq0: int, qpos: bool = True) -> None:
    for i, g in enumerate(groups):
        g.seq = seq0 + i
    spool.write_groups(groups)
    if qpos:
        for g in groups:
            g.qpos = g.seq
        spool.write_queued(groups)


def test_compaction_bounds_the_spool_and_keeps_live_groups(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=16 << 10)
    spool.open()
    snapshot = {
        "registration": None,
        "started": True,
        "step": 0,
        "envs": [
            {
                "max_context_len": 64,
                "weight": 1.0,
                "desired_name": "e",
                "real_name": "e_0",
                "registered_id": 0,
                "group_size": 8,
                "min_batch_allocation": None,
            }
        ],
    }
    spool.write_state(snapshot)
    pinned = _g(-1.0, n=2, env_id=0)  # a buffered piece in the oldest segment
    _write(spool, [pinned], 0, qpos=False)
    seq, step, biggest = 1, 0, 0
    live: list[Any] = []
    for round_ in range(60):
        batch = [_g(float(round_ * 10 + i)) for i in range(4)]
        _write(spool, batch, seq)
        seq += len(batch)
        live.extend(batch)
        if len(live) >= 8:  # deliver the oldest four groups: about 8 stay held
            step += 1
            spool.write_ack(live[:4], step)
            live = live[4:]
        biggest = max(biggest, spool.stats()["bytes"])
    stats = spool.stats()
    assert biggest <= max(4 * (16 << 10), 2 * stats["live_bytes"]) + (48 << 10)
    assert stats["segments"] <= 8
    spool.close()

    state = Spool(tmp_path).open()
    assert [g.scores[0] for g in state.queue] == [g.scores[0] for g in live]
    assert [g.scores[0] for g in state.buffers[0]] == [-1.0]
    assert state.step == step and state.started
    assert state.queue[0].tokens.rows()[0].tolist() == live[0].tokens.rows()[0].tolist()


def test_torn_tail_is_cut_off(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.open()
    _write(spool, [_g(1.0), _g(2.0)], 0)
    spool.close()
    segment = sorted(tmp_path.glob("seg-*.log"))[-1]
    data = segment.read_bytes()
    header = 9 + 2  # the empty state record ({}) that heads the segment
    torn = data[header : header + 1000]  # the first group record, cut in the middle
    segment.write_bytes(data + torn)
    again = Spool(tmp_path)
    state = again.open()
    assert [g.scores[0] for g in state.queue] == [1.0, 2.0]
    assert state.dropped_bytes == len(torn)
    assert segment.stat().st_size == len(data)
    again.close()
    assert Spool(tmp_path).open().dropped_bytes == 0


def test_spool_lock(tmp_path: Path) -> None:
    first = Spool(tmp_path)
    first.open()
    with pytest.raises(SpoolError, match="in use"):
        Spool(tmp_path).open()
    first.close()
    Spool(tmp_path).open()


def test_restart_marks_environments_whose_process_is_gone_disconnected(tmp_path: Path) -> None:
    """After a whole-daemon restart the old environments' processes are gone: their
    registrations stop counting in /status-env weights; a live environment keeps its own."""
    spool = tmp_path / "spool"
    port = free_port()
    server = start_atroposd(tmp_path, "--spool-dir", str(spool), port=port)
    try:
        api = server.api
        api.start(batch_size=8, max_token_len=64)
        child = RegisteredChild(
            api.url, {"max_token_length": 64, "desired_name": "gone", "weight": 1.0, "group_size": 4}
        )
        gone = int(child.answer["env_id"])
        live = api.register_env(group_size=4, name="live")["env_id"]
        assert api.ok("POST", "/scored_data", group(4, env_id=gone, tag=1.0)) == {"status": "received"}
        assert api.ok("GET", "/status-env", {"env_id": live})["env_weight"] == 0.5
        kill9(server)
        child.exit()  # the whole daemon went: its environment too

        server = start_atroposd(tmp_path, "--spool-dir", str(spool), port=port)
        api = server.api
        envs = {e["env_id"]: e for e in api.ok("GET", "/atroposd/registrations")["envs"]}
        assert envs[gone]["connected"] is False and envs[live]["connected"] is True
        assert api.ok("GET", "/status-env", {"env_id": live})["env_weight"] == 1.0
        # what the gone environment posted is still served, with the live one's
        assert api.ok("POST", "/scored_data", group(4, env_id=live, tag=2.0)) == {"status": "received"}
        assert sorted(served_tags(api.drain())) == [1.0, 2.0]
    finally:
        stop_process(server.proc)


def test_an_environment_whose_process_dies_stops_counting_while_the_api_runs(tmp_path: Path) -> None:
    """A killed environment restarted under a new registration: the dead registration's share of
    /status-env would hold the living one to half the budget for good (a batch never forms), so
    it is marked disconnected as soon as its process is gone, not only at a restart."""
    server = start_atroposd(tmp_path)
    try:
        api = server.api
        api.start(batch_size=8, max_token_len=64)
        child = RegisteredChild(
            api.url, {"max_token_length": 64, "desired_name": "first", "weight": 1.0, "group_size": 4}
        )
        live = api.register_env(group_size=4, name="second")["env_id"]
        assert api.ok("GET", "/status-env", {"env_id": live})["env_weight"] == 0.5  # both alive
        child.exit()
        wait_for(
            lambda: api.ok("GET", "/status-env", {"env_id": live})["env_weight"] == 1.0,
            timeout=10,
            what="the dead environment's share to go",
        )
        envs = {e["env_id"]: e for e in api.ok("GET", "/atroposd/registrations")["envs"]}
        assert envs[int(child.answer["env_id"])]["connected"] is False and envs[live]["connected"] is True
    finally:
        stop_process(server.proc)

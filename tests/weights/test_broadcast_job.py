"""``weight_sync = "broadcast"`` in whole jobs through the command line (gloo, torch engine, two
inference replicas): the job learns as in ``push``; with two trainer ranks the replicas serve
the weights the ranks gathered (the canary agrees with rank 0), kill -9 of a rank while a sync
is under way and of a replica re-forms the broadcast groups and the job goes on; status --json
shows each replica's mode and group, metrics.jsonl the sync's pause and transfer apart, /metrics
a series per replica; stop leaves nothing."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from atroposd.config import load_config
from tests.e2e.jobs import (
    SHORT_TASK,
    component,
    daemon_env,
    kill9,
    metrics,
    processes_of_instance,
    replica_job_config,
    run_short_learning_job,
    segments_of,
    status,
)
from tests.support import atroposd, wait_for

pytestmark = pytest.mark.slow

RANKS = {"device": ["cpu", "cpu"], "batch_size": 16, "micro_batch_size": 4, "join_timeout": 120.0}


def _sync(st: dict[str, Any], name: str) -> dict[str, Any]:
    row: dict[str, Any] = component(st, name)["weight_sync"]
    return row


def _metrics_text(cfg_text: str) -> str:
    port = int(cfg_text.split("metrics_port = ")[1].split()[0])
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=15).read().decode()


def _paused(sock: Path) -> bool:
    """Whether the replica behind the weight-control socket ``sock`` is paused for a sync (its
    ``GET /weight_info``)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(5)
        conn.connect(str(sock))
        conn.sendall(b"GET /weight_info HTTP/1.0\r\nHost: inference\r\n\r\n")
        raw = b""
        while chunk := conn.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"200", raw[:300]
    return bool(json.loads(body)["paused"])


def _kill_rank_mid_sync(sock: Path, pid: int, *, within: float = 90.0) -> None:
    """kill -9 of trainer rank ``pid`` while a weight sync is under way. Once the replica behind
    ``sock`` is seen paused (the sync has begun), the rank is stopped: the sync's gathers wait for
    it, so a replica still paused a moment later means the sync is waiting on the rank, which is
    killed there. A sync that ended between the look and the stop lets the rank go on; the next
    one is tried."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        if not _paused(sock):
            time.sleep(0.005)
            continue
        os.kill(pid, signal.SIGSTOP)
        killed = False
        try:
            time.sleep(0.3)  # well inside collective_timeout: the rank is lost to the kill, not a timeout
            if _paused(sock):
                os.kill(pid, signal.SIGKILL)
                killed = True
                return
        finally:
            if not killed:
                os.kill(pid, signal.SIGCONT)
    raise AssertionError(f"no weight sync seen under way within {within:g} s")


def _canary_rounds(root: Path) -> list[list[float | None]]:
    """Each canary round's drift per replica so far (the daemon's log, read while it writes)."""
    path = root / "state" / "logs" / "daemon.log"
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:  # not JSON, or the line being written
            continue
    over = [e for e in events if str(e.get("event")).startswith("replica drift over the limit")]
    assert not over, over
    return [e["replica_drift"] for e in events if e.get("event") == "canary check"]


def _log_tail(root: Path, lines: int = 40) -> str:
    path = root / "state" / "logs" / "daemon.log"
    if not path.exists():
        return ""
    kept = [line for line in path.read_text(errors="replace").splitlines() if '"event":"step"' not in line]
    return "\n".join(line[:400] for line in kept[-lines:])


# the only whole job in which a trainer rank dies under broadcast: both groups form again
def test_two_ranks_broadcast_to_two_replicas_survive_a_rank_and_a_replica_killed(short_tmp: Path) -> None:
    cfg = replica_job_config(
        short_tmp,
        replicas=2,
        metrics_port=True,
        steps=100_000,
        trainer={
            **RANKS,
            "weight_sync": "broadcast",
            "checkpoint_every": 4,
            "collective_timeout": 4.0,
            "sync_bucket_mb": 1,
        },
        daemon={"stop_timeout": 5.0},
        # the canary compares what each replica serves with rank 0's own scoring (SPEC §15)
        health={"canary_every": 2, "canary_prompts": 4, "drift_limit": 0.05},
    )
    control = short_tmp / "run" / f"inference-{load_config(cfg).inference.port}.sock"
    res = atroposd("start", "-c", str(cfg), env=daemon_env(), timeout=300)
    nonce = ""
    try:
        assert res.returncode == 0, f"start exited {res.returncode}: {res.stderr[-3000:]}"
        st = status(cfg)
        nonce = st["instance"]
        for name in ("inference-0", "inference-1"):
            row = _sync(st, name)
            assert row["mode"] == "broadcast" and row["backend"] == "gloo", row
            assert row["group"] == "formed" and row["formations"] == 1, row
        wait_for(lambda: status(cfg)["trainer"]["step"] >= 5, timeout=180, interval=0.5, what="training steps")
        rows = metrics(short_tmp / "state")
        assert all(r["sync_pause_s"] >= 0 and r["sync_transfer_s"] > 0 for r in rows), rows[-1]
        text = _metrics_text(cfg.read_text())
        for name in ("inference-0", "inference-1"):
            assert f'atroposd_replica_weight_sync{{component="{name}",mode="broadcast"}} 1.0' in text
            assert f'atroposd_replica_broadcast_formations_total{{component="{name}"}} 1.0' in text
            assert f'atroposd_replica_broadcast_group{{component="{name}"}} 1.0' in text
        # the buckets the two ranks gathered are what the replicas serve: float32, the same tokens
        wait_for(lambda: len(_canary_rounds(short_tmp)) >= 2, timeout=120, interval=0.5, what="two canary rounds")
        rounds = _canary_rounds(short_tmp)
        assert all(d is not None and d < 1e-3 for r in rounds for d in r) and len(rounds[-1]) == 2, rounds

        # kill -9 of trainer rank 1 while a sync streams: the trainer group restarts, and every
        # broadcast group after it
        rank1 = component(st, "trainer-1")
        _kill_rank_mid_sync(control, rank1["pid"])
        before = status(cfg)["trainer"]["step"]  # the step whose sync was cut: no step ends without the rank
        wait_for(
            lambda: status(cfg)["trainer"]["group_restarts"] >= 1,
            timeout=60,
            interval=0.2,
            what="the trainer group to restart",
        )
        wait_for(
            lambda: status(cfg)["trainer"]["step"] > before + 1,
            timeout=180,
            interval=0.5,
            what="training past the pre-kill step",
        )
        st = status(cfg)
        for name in ("inference-0", "inference-1"):
            row = _sync(st, name)
            assert row["formations"] >= 2 and row["group"] == "formed", row

        # kill -9 of replica 1: restarted, its group formed again, it catches up
        victim = component(st, "inference-1")
        formed_before = _sync(st, "inference-1")["formations"]
        kill9(victim["pid"])

        def back() -> bool:
            s = status(cfg)
            c = component(s, "inference-1")
            return bool(
                c["state"] == "ready"
                and c["pid"] != victim["pid"]
                and c["weight_sync"]["formations"] > formed_before
                and (c.get("weight_version") or -1) >= s["trainer"]["weight_version"] - 2
            )

        wait_for(back, timeout=180, interval=0.5, what="replica 1 back, its group formed again, current")
        step = status(cfg)["trainer"]["step"]
        seen = len(_canary_rounds(short_tmp))
        wait_for(
            lambda: status(cfg)["trainer"]["step"] > step + 1 and len(_canary_rounds(short_tmp)) > seen,
            timeout=120,
            interval=0.5,
            what="training on after the replica came back, and a canary round",
        )
        assert status(cfg)["state"] == "running"
        # after both groups formed again (and replica 1's once more), the replicas still serve the
        # ranks' weights
        rounds = _canary_rounds(short_tmp)[seen:]
        assert rounds and all(d is not None and d < 1e-3 for d in rounds[-1]) and len(rounds[-1]) == 2, rounds
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- daemon log ---\n{_log_tail(short_tmp)}") from exc
    finally:
        res = atroposd("stop", "-c", str(cfg), env=daemon_env(), timeout=120)
        assert res.returncode == 0, res.stderr
        if nonce:
            wait_for(lambda: not processes_of_instance(nonce), timeout=30, what="every process of the job gone")
            assert not segments_of(nonce)


def test_a_job_with_two_replicas_in_broadcast_mode_learns(short_tmp: Path) -> None:
    """test_job's shortened learning run with two replicas, weights by broadcast: the same floor."""
    rows = run_short_learning_job(
        replica_job_config(
            short_tmp, steps=400, envs=SHORT_TASK, trainer={"checkpoint_every": 400, "weight_sync": "broadcast"}
        ),
        short_tmp / "state",
    )
    assert all(r["weight_version"] == r["step"] for r in rows)
    assert all(r["sync_transfer_s"] > 0 for r in rows)
    log = (short_tmp / "state" / "logs" / "daemon.log").read_text()
    assert log.count("broadcast group formed") == 2, "one formation per replica start"

"""Several machines (SPEC §12.3), as two daemons on one machine: each "node" has its own
runtime and state directories and inference ports, both share the cluster port, the API port,
a token and a ``checkpoint_dir``, on loopback.

The default suite has the cheap ones (a wrong token, a head that never comes); the whole jobs
(learning across two nodes, a node killed -9 and started again, a node stopped with SIGSTOP,
the head killed -9) are ``slow``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.jobs import (
    SHORT_TASK,
    cluster_configs,
    component,
    daemon_env,
    kill9,
    metrics,
    processes_of_instance,
    replica_health,
    segments_of,
    status,
)
from tests.support import atroposd, free_port, wait_for


def _popen_run(cfg: Path, log: Path) -> subprocess.Popen[bytes]:
    """``atroposd run`` in the background (a node of the job), its output in ``log``."""
    env = {**os.environ, **daemon_env()}
    env.pop("ATROPOSD_CONFIG", None)
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "atroposd", "run", "-c", str(cfg)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _events(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _has_event(log: Path, text: str) -> bool:
    return any(text in str(e.get("event", "")) or text in str(e.get("reason", "")) for e in _events(log))


def _stop_proc(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _lightweight(root: Path, **kw: Any) -> list[Path]:
    """Two nodes with no trainer, no inference server and no environment: the API on the head,
    the cluster link on both (what joining and refusing need)."""
    return cluster_configs(
        root, envs=[], trainer={"enabled": False}, inference={"enabled": False, "url": "http://127.0.0.1:9"}, **kw
    )


def _dropped_metrics(port: int) -> dict[str, float]:
    """``atroposd_cluster_messages_dropped`` on a daemon's /metrics, by reason."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=15).read().decode()
    return {
        s.labels["reason"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "atroposd_cluster_messages_dropped"
        for s in f.samples
        if s.name.endswith("_total")
    }


def _replay_a_join(cfg: Path) -> str:
    """A join signed for another connection's challenge (as a recorded one is), sent to the head:
    the head's answer."""
    from atroposd.cluster.messages import Refused
    from atroposd.cluster.wire import new_challenge, open_unsigned
    from atroposd.config import load_config
    from tests.cluster.conftest import RawNode

    c = load_config(cfg).cluster

    async def replay() -> str:
        raw = await RawNode.connect(c.port, c.read_token())
        try:
            await raw.hello()
            raw.write(raw.join_line(new_challenge(), 1, host="replayer"))
            answer = open_unsigned(await asyncio.wait_for(raw.reader.readline(), 10))
            assert isinstance(answer, Refused), answer
            return answer.reason
        finally:
            raw.abort()

    return asyncio.run(replay())


def test_wrong_token_is_refused_and_a_lonely_node_gives_up(short_tmp: Path) -> None:
    head_cfg, node_cfg = _lightweight(short_tmp, cluster={"join_timeout": 4.0})
    metrics_port = free_port()
    head_cfg.write_text(
        head_cfg.read_text().replace(
            "stop_timeout = 10.0\n", f"stop_timeout = 10.0\nmetrics_port = {metrics_port}\n", 1
        )
    )
    # a node started before its head waits for it, then gives up after join_timeout, clearly
    started = time.monotonic()
    res = atroposd("run", "-c", str(node_cfg), env=daemon_env(), timeout=120)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "waiting for the head" in res.stderr
    assert "cluster.join_timeout" in res.stderr, res.stderr[-2000:]
    assert time.monotonic() - started < 60

    head = _popen_run(head_cfg, short_tmp / "head.log")
    try:
        wait_for(lambda: status(head_cfg)["state"] == "running", timeout=60, what="the head running")
        # a node holding another token is refused, and both sides say why
        other = short_tmp / "other.token"
        other.write_text("not-the-cluster-secret")
        text = node_cfg.read_text().replace(str(short_tmp / "cluster.token"), str(other))
        wrong_cfg = node_cfg.with_name("wrong.toml")
        wrong_cfg.write_text(text)
        res = atroposd("run", "-c", str(wrong_cfg), env=daemon_env(), timeout=120)
        assert res.returncode == 1
        assert "wrong cluster token" in res.stderr, res.stderr[-2000:]
        wait_for(
            lambda: _has_event(short_tmp / "head.log", "refused a node"),
            timeout=10,
            what="the head's log naming the refusal",
        )
        nodes = status(head_cfg)["nodes"]
        assert [n["node_rank"] for n in nodes] == [0, 1]
        assert nodes[1]["state"] == "joining" and nodes[1]["host"] is None
        # a join signed for another connection's challenge (a recorded one) is refused; every
        # message the head dropped is counted by reason, in status and on /metrics
        assert "another connection's challenge" in _replay_a_join(head_cfg)
        dropped = status(head_cfg)["cluster"]["dropped"]
        assert dropped["mac"] >= 1 and dropped["challenge"] == 1, dropped
        on_metrics = _dropped_metrics(metrics_port)
        assert on_metrics["challenge"] == 1 and on_metrics["mac"] == dropped["mac"], on_metrics
        assert status(head_cfg)["nodes"][1]["host"] is None  # never admitted
    finally:
        _stop_proc(head)


def _start_job(cfgs: list[Path], root: Path) -> list[subprocess.Popen[bytes]]:
    """Node 1 first (it waits for its head), then the head; both ``atroposd run``."""
    node = _popen_run(cfgs[1], root / "node1.log")
    wait_for(
        lambda: _has_event(root / "node1.log", "waiting for the head"), timeout=60, what="node 1 waiting for its head"
    )
    head = _popen_run(cfgs[0], root / "head.log")
    return [head, node]


def _nodes(cfg: Path) -> list[dict[str, Any]]:
    return list(status(cfg)["nodes"])


def _node_ready(cfg: Path, rank: int) -> bool:
    return bool(_nodes(cfg)[rank]["state"] == "ready")


def _instances(cfgs: list[Path]) -> list[str]:
    return [status(c)["instance"] for c in cfgs]


def _head_running(cfgs: list[Path]) -> list[str]:
    """Wait for the head's READY; then every node's instance id."""
    wait_for(lambda: status(cfgs[0])["state"] == "running", timeout=240, interval=0.5, what="the head READY")
    return _instances(cfgs)


def _until_step(cfg: Path, step: int) -> None:
    wait_for(lambda: status(cfg)["trainer"]["step"] >= step, timeout=180, interval=0.5, what="training")


def _nothing_left(nonces: list[str]) -> None:
    wait_for(lambda: not any(processes_of_instance(n) for n in nonces), timeout=60, what="every process gone")
    for n in nonces:
        assert not segments_of(n), segments_of(n)


@pytest.mark.slow
def test_two_nodes_learn_and_node1_replicas_follow(short_tmp: Path) -> None:
    steps = 300
    cfgs = cluster_configs(
        short_tmp,
        steps=steps,
        envs=SHORT_TASK,
        trainer={"batch_size": 32, "micro_batch_size": 8, "checkpoint_every": 100},
    )
    procs = _start_job(cfgs, short_tmp)
    nonces: list[str] = []
    try:
        nonces = _head_running(cfgs)
        st = status(cfgs[0])
        nodes = st["nodes"]
        assert [n["state"] for n in nodes] == ["ready", "ready"], nodes
        names = {c["name"] for c in nodes[1]["components"]}
        assert {"inference", "trainer-1", "arithmetic-1"} <= names, names
        assert st["trainer"]["ranks"] == 2
        assert component(status(cfgs[1]), "trainer-1")["state"] == "ready"
        # node 1's replica serves the trainer's weights: its version follows the head's steps
        _until_step(cfgs[0], 20)
        v1 = replica_health(cfgs[1], 0)["weight_version"]
        step = status(cfgs[0])["trainer"]["step"]
        assert v1 is not None and v1 >= 17 and abs(step - v1) <= 3, (step, v1)  # a push may be under way
        assert procs[0].wait(600) == 0
        assert procs[1].wait(120) == 0
    finally:
        for p in procs:
            _stop_proc(p)
    _nothing_left(nonces)
    rows = metrics(short_tmp / "node0" / "state")
    assert len(rows) == steps

    def mean(key: str, part: list[dict[str, Any]]) -> float:
        return float(sum(r[key] for r in part) / len(part))

    first, last = rows[:10], rows[-10:]
    assert mean("reward_mean", last) >= mean("reward_mean", first) + 0.3
    assert mean("accuracy", last) >= mean("accuracy", first) + 0.3
    # every rank's shard is in the shared checkpoint directory
    assert {p.name for p in (short_tmp / "checkpoints" / f"step-{steps}" / "optimizer").iterdir()} >= {
        "__0_0.distcp",
        "__1_0.distcp",
    }


@pytest.mark.slow
def test_node_killed_rejoins_sigstop_is_lost_and_head_stop_ends_all(short_tmp: Path) -> None:
    cfgs = cluster_configs(short_tmp, steps=100_000, envs=SHORT_TASK, trainer={"checkpoint_every": 5})
    procs = _start_job(cfgs, short_tmp)
    nonces: list[str] = []
    try:
        head_nonce, node_nonce = _head_running(cfgs)
        nonces = [head_nonce, node_nonce]
        wait_for(
            lambda: status(cfgs[0])["trainer"]["last_checkpoint"] is not None,
            timeout=180,
            interval=0.5,
            what="a checkpoint",
        )

        # kill -9 of node 1's daemon: its processes go with it, the head finds it lost, the trainer waits
        before = status(cfgs[0])["trainer"]["step"]
        kill9(procs[1].pid)
        procs[1].wait(10)
        wait_for(lambda: not processes_of_instance(node_nonce), timeout=10, what="node 1's processes gone")
        wait_for(lambda: _nodes(cfgs[0])[1]["state"] == "lost", timeout=30, what="the head marking node 1 lost")
        wait_for(
            lambda: status(cfgs[0])["trainer"]["waiting_for"] == "ranks",
            timeout=30,
            what="the trainer waiting for its ranks",
        )
        restarts = status(cfgs[0])["trainer"]["group_restarts"]

        # node 1 again: it rejoins, and training passes its pre-kill step
        procs[1] = _popen_run(cfgs[1], short_tmp / "node1-again.log")
        wait_for(
            lambda: _node_ready(cfgs[0], 1) and status(cfgs[0])["trainer"]["step"] > before + 2,
            timeout=240,
            interval=0.5,
            what="node 1 ready again and training past the pre-kill step",
        )
        node_nonce2 = status(cfgs[1])["instance"]
        assert node_nonce2 != node_nonce and not segments_of(node_nonce)
        nonces.append(node_nonce2)
        st = status(cfgs[0])
        assert st["trainer"]["group_restarts"] >= restarts and st["state"] == "running"

        # SIGSTOP of node 1's daemon: its connection stays open; silence finds it lost
        stopped = psutil.Process(procs[1].pid)
        stopped.suspend()
        try:
            t0 = time.monotonic()
            wait_for(
                lambda: _nodes(cfgs[0])[1]["state"] == "lost",
                timeout=30,
                interval=0.2,
                what="the head finding the stopped node lost",
            )
            assert "no heartbeat" in (_nodes(cfgs[0])[1]["reason"] or "")
            assert time.monotonic() - t0 < 15
        finally:
            stopped.kill()  # its children follow it (parent-death signal)
        procs[1].wait(10)
        wait_for(lambda: not processes_of_instance(node_nonce2), timeout=15, what="node 1's processes gone")

        # node 1 once more, then the head's stop ends every node
        procs[1] = _popen_run(cfgs[1], short_tmp / "node1-third.log")
        wait_for(
            lambda: _node_ready(cfgs[0], 1) and status(cfgs[1])["state"] == "running",
            timeout=240,
            interval=0.5,
            what="node 1 ready a third time",
        )
        nonces.append(status(cfgs[1])["instance"])
        res = atroposd("stop", "-c", str(cfgs[0]), env=daemon_env(), timeout=180)
        assert res.returncode == 0, res.stderr
        # the head's stop returns once every node's processes are gone
        assert not processes_of_instance(nonces[-1])
        assert procs[1].wait(10) == 0
        assert procs[0].wait(10) == 0
    finally:
        for p in procs:
            _stop_proc(p)
    _nothing_left(nonces)


@pytest.mark.slow
def test_reload_across_nodes_then_the_head_killed_takes_every_node_down(short_tmp: Path) -> None:
    """``weight_sync = "reload"``: the head writes each version under the shared checkpoint_dir,
    node 1's first rank has its replica load it. Then the head is killed -9: node 1 exits 1
    within heartbeat_timeout and leaves nothing."""
    cfgs = cluster_configs(
        short_tmp, steps=100_000, envs=SHORT_TASK, trainer={"weight_sync": "reload"}, cluster={"heartbeat_timeout": 5.0}
    )
    procs = _start_job(cfgs, short_tmp)
    nonces: list[str] = []
    try:
        nonces = _head_running(cfgs)
        _until_step(cfgs[0], 8)
        v1 = replica_health(cfgs[1], 0)["weight_version"]
        step = status(cfgs[0])["trainer"]["step"]
        # node 1 loads each version between the trainer's steps: at most a few behind
        assert v1 is not None and v1 >= 4 and abs(step - v1) <= 5, (step, v1)
        assert any((short_tmp / "checkpoints" / "sync").glob("v*"))

        kill9(procs[0].pid)
        t0 = time.monotonic()
        code = procs[1].wait(60)
        assert code == 1
        assert time.monotonic() - t0 <= 5.0 + 5.0  # heartbeat_timeout, plus the stop of its children
        assert _has_event(short_tmp / "node1.log", "lost the head")
        wait_for(lambda: not any(processes_of_instance(n) for n in nonces), timeout=30, what="every process gone")
        assert not segments_of(nonces[1])  # node 1 left nothing
        # what the head left at its kill -9 (its run files) goes with its next start's recovery
        from atroposd.config import load_config
        from atroposd.daemon.recovery import recover
        from atroposd.paths import Paths

        recover(Paths.of(load_config(cfgs[0])))
    finally:
        for p in procs:
            _stop_proc(p)
    _nothing_left(nonces)


@pytest.mark.slow
def test_every_node_sigtermed_at_once_leaves_nothing(short_tmp: Path) -> None:
    """As a cluster's launcher stops a job (``scancel``): SIGTERM to every node's daemon at once.
    Node 1's first rank, which owns its staging buffer, is stopped by its daemon before its own
    clean-up: its daemon removes what it left."""
    cfgs = cluster_configs(short_tmp, steps=100_000, envs=SHORT_TASK)
    procs = _start_job(cfgs, short_tmp)
    nonces: list[str] = []
    try:
        nonces = _head_running(cfgs)
        _until_step(cfgs[0], 5)
        assert segments_of(nonces[1]), "node 1's first rank has its staging buffer"
        for p in procs:
            p.send_signal(signal.SIGTERM)
        assert [p.wait(120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            _stop_proc(p)
    _nothing_left(nonces)

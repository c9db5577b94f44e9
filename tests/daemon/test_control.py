"""The control socket protocol: framing, size cap, read deadline, permissions, client errors."""

from __future__ import annotations

import socket
import stat
import struct
from pathlib import Path
from typing import Any

import anyio
import pytest

from atroposd import control


def serve_control(path: Path, handler: Any, *, body: Any, **kw: Any) -> None:
    """Run a real ControlServer on ``path`` with ``handler`` while ``body()`` (sync, in a thread)
    talks to it; ``kw`` go to the server."""

    async def main() -> None:
        server = control.ControlServer(path, handler, **kw)
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve)
            try:
                await anyio.to_thread.run_sync(body)
            finally:
                tg.cancel_scope.cancel()

    anyio.run(main)


def _serve(path: Path, body: Any, *, read_timeout: float = 5.0) -> list[dict[str, Any]]:
    """Run a ControlServer while ``body()`` (sync, in a thread) talks to it; returns requests seen."""
    seen: list[dict[str, Any]] = []

    async def handler(req: dict[str, Any]) -> dict[str, Any]:
        seen.append(req)
        return {"ok": True, "echo": req}

    serve_control(path, handler, read_timeout=read_timeout, body=body)
    return seen


def test_round_trip_and_socket_mode(short_tmp: Path) -> None:
    path = short_tmp / "control.sock"
    answers: list[dict[str, Any]] = []

    def body() -> None:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        answers.append(control.request(path, {"cmd": "ping", "x": [1, 2]}))

    seen = _serve(path, body)
    assert seen == [{"cmd": "ping", "x": [1, 2]}]
    assert answers == [{"ok": True, "echo": {"cmd": "ping", "x": [1, 2]}}]
    assert not path.exists()  # removed when the server ends


def test_oversized_frame_and_bad_json_are_refused(short_tmp: Path) -> None:
    path = short_tmp / "control.sock"
    answers: list[bytes] = []

    def raw(payload: bytes) -> bytes:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(path))
            s.sendall(payload)
            return s.recv(65536)

    def body() -> None:
        answers.append(raw(struct.pack(">I", control.MAX_FRAME + 1)))
        answers.append(raw(struct.pack(">I", 5) + b"nope!"))
        answers.append(raw(struct.pack(">I", 2) + b"[]"))

    seen = _serve(path, body)
    assert seen == []
    texts = [a[4:].decode() for a in answers]
    assert "exceeds" in texts[0] and "invalid JSON" in texts[1] and "JSON object" in texts[2]
    with pytest.raises(control.ProtocolError):
        control.encode({"x": "y" * (control.MAX_FRAME + 1)})


def test_a_silent_client_is_dropped_at_the_read_deadline(short_tmp: Path) -> None:
    path = short_tmp / "control.sock"
    got: list[bytes] = []

    def body() -> None:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(path))
            s.sendall(b"\x00\x00")  # half a header, then silence
            got.append(s.recv(16))  # the server closes: EOF, not a hang

    _serve(path, body, read_timeout=0.3)
    assert got == [b""]


def test_an_answer_nobody_reads_is_dropped_at_the_send_deadline(short_tmp: Path) -> None:
    """An answer far larger than the socket buffers, to a client that never reads: the send
    gives up at its deadline (False) instead of pinning the task (the test would hang)."""
    import time

    path = short_tmp / "control.sock"

    async def main() -> tuple[bool, float]:
        listener = await anyio.create_unix_listener(path)
        async with listener:
            with socket.socket(socket.AF_UNIX) as client:  # connects, then never reads
                client.connect(str(path))
                async with await listener.accept() as stream:
                    t0 = time.monotonic()
                    sent = await control._send(stream, {"ok": True, "pad": "x" * (900 << 10)}, 0.5)
                    return sent, time.monotonic() - t0

    sent, took = anyio.run(main)
    assert sent is False and 0.4 < took < 5.0, (sent, took)


def test_client_errors_name_the_problem(short_tmp: Path) -> None:
    with pytest.raises(control.NotRunning, match="no daemon is running"):
        control.request(short_tmp / "missing.sock", {"cmd": "ping"})
    stale = short_tmp / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # bound, not listening: a dead daemon's socket
    with pytest.raises(control.NotRunning):
        control.request(stale, {"cmd": "ping"})
    assert control.NotRunning.exit_code == 3 and control.PermissionDenied.exit_code == 1


# ---------------------------------------------------------------------------- answers that do not fit


def test_an_answer_too_large_for_the_frame_leaves_the_server_serving(short_tmp: Path) -> None:
    """A 2 MiB answer, a handler that raises and one that returns what JSON cannot carry: each
    client gets ``{"ok": false, "error": ...}`` and the server (run in its owner's task group, as
    the daemon runs it) goes on answering; before, the first raised out of the task group."""
    path = short_tmp / "control.sock"
    answers: list[dict[str, Any]] = []

    async def handler(req: dict[str, Any]) -> dict[str, Any]:
        if req["cmd"] == "big":
            return {"ok": True, "pad": "x" * (2 << 20)}
        if req["cmd"] == "raise":
            raise RuntimeError("boom")
        if req["cmd"] == "unencodable":
            return {"ok": True, "value": {1, 2}}
        return {"ok": True, "cmd": req["cmd"]}

    def body() -> None:
        for cmd in ("big", "ping", "raise", "unencodable", "big", "ping"):
            answers.append(control.request(path, {"cmd": cmd}, timeout=10))

    serve_control(path, handler, body=body)
    big, ping, raised, unencodable, big2, ping2 = answers
    for a in (big, big2):
        assert a["ok"] is False and "does not fit the control frame" in a["error"], a
    assert raised["ok"] is False and "boom" in raised["error"]
    assert unencodable["ok"] is False and "cannot be encoded" in unencodable["error"]
    assert ping == ping2 == {"ok": True, "cmd": "ping"}


def _row(name: str, state: str = "ready") -> dict[str, Any]:
    return {
        "name": name,
        "kind": "env",
        "external": False,
        "state": state,
        "pid": 1234,
        "restarts": 0,
        "last_exit": None,
        "since_s": 1.0,
        "log": "/var/lib/atroposd/logs/" + "x" * 300 + ".log",
    }


def _big_head_status(nodes: int = 64, per_node: int = 40, own: int = 40) -> dict[str, Any]:
    return {
        "state": "running",
        "pid": 4242,
        "uptime_s": 1.0,
        "config": "/etc/atroposd/atroposd.toml",
        "instance": "abc",
        "trainer": None,
        "queue": None,
        "start_error": None,
        "node_rank": 0,
        "components": [_row(f"own-{i}", "backoff" if i % 10 == 0 else "ready") for i in range(own)],
        "nodes": [
            {
                "node_rank": r,
                "host": f"node{r}",
                "state": "ready",
                "units": {},
                "components": [_row(f"env-{r}-{i}") for i in range(per_node)],
            }
            for r in range(nodes)
        ],
    }


def test_a_large_head_status_is_cut_to_the_frame_with_a_note() -> None:
    """64 nodes × 40 rows (about 1.2 MB): the nodes' rows go, counted by state; one node's
    rows come whole on request; a head whose own rows alone overflow keeps what fits."""
    import orjson

    from atroposd.daemon.status import fit_status

    st = _big_head_status()
    assert len(orjson.dumps(st)) > control.MAX_FRAME
    cut = fit_status(st, control.ANSWER_LIMIT)
    assert len(orjson.dumps(cut)) <= control.ANSWER_LIMIT
    assert "exceeds the control frame" in cut["truncated"] and "--node" in cut["truncated"]
    assert len(cut["nodes"]) == 64 and all(n["components"] is None for n in cut["nodes"])
    assert cut["nodes"][5]["components_by_state"] == {"ready": 40}
    assert len(cut["components"]) == 40  # the head's own rows fit: kept whole

    one = fit_status(st, control.ANSWER_LIMIT, node=5)
    assert "truncated" not in one and [n["node_rank"] for n in one["nodes"]] == [5]
    assert len(one["nodes"][0]["components"]) == 40

    huge = _big_head_status(nodes=2, own=6000)  # about 2.3 MB of the head's own rows
    cut = fit_status(huge, control.ANSWER_LIMIT)
    size = len(orjson.dumps(cut))
    assert control.ANSWER_LIMIT * 0.8 < size <= control.ANSWER_LIMIT, size
    assert cut["components_total"] == 6000 and cut["components_by_state"] == {"ready": 5400, "backoff": 600}
    assert f"{6000 - len(cut['components'])} of 6000 component rows left out" in cut["truncated"]
    small = _big_head_status(nodes=2, per_node=2, own=2)
    assert fit_status(small, control.ANSWER_LIMIT) is small  # nothing cut from what fits


def test_the_daemons_status_command_answers_within_the_frame() -> None:
    """The daemon's own handler cuts ``status`` (a large head's) to the frame and checks ``node``."""
    from types import SimpleNamespace

    from atroposd.daemon.core import Daemon

    async def status() -> dict[str, Any]:
        return _big_head_status()

    stand_in = SimpleNamespace(status=status)

    async def main() -> list[dict[str, Any]]:
        return [
            await Daemon._control(stand_in, req)  # type: ignore[arg-type]
            for req in ({"cmd": "status"}, {"cmd": "status", "node": 3}, {"cmd": "status", "node": "x"})
        ]

    whole, one, bad = anyio.run(main)
    assert whole["ok"] and len(control.encode(whole)) <= control.MAX_FRAME and whole["status"]["truncated"]
    assert one["ok"] and [n["node_rank"] for n in one["status"]["nodes"]] == [3]
    assert bad["ok"] is False and "node must be" in bad["error"]


def test_status_cli_asks_for_one_node_and_reports_an_error_answer(
    short_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``atroposd status --node N`` sends the node; a cut status says so; an error answer is
    exit 1 with the daemon's error, not a traceback."""
    import argparse

    from atroposd import commands
    from atroposd.config import parse_config

    cfg = parse_config({"daemon": {"runtime_dir": str(short_tmp), "state_dir": str(short_tmp / "state")}})
    seen: list[dict[str, Any]] = []

    async def handler(req: dict[str, Any]) -> dict[str, Any]:
        seen.append(req)
        if req.get("node") == 9:
            return {"ok": False, "error": "node must be a node rank"}
        st = _big_head_status(nodes=1, per_node=1, own=1)
        return {"ok": True, "status": {**st, "truncated": "the status of 2 bytes exceeds the control frame"}}

    codes: list[int] = []

    def body() -> None:
        codes.append(commands.status(cfg, argparse.Namespace(node=3, json=False, watch=False)))
        codes.append(commands.status(cfg, argparse.Namespace(node=9, json=True, watch=False)))

    serve_control(cfg.control_socket, handler, body=body)
    out = capsys.readouterr()
    assert [r.get("node") for r in seen] == [3, 9] and codes == [0, 1]
    assert "(cut to fit: the status of 2 bytes exceeds the control frame)" in out.out
    assert "node must be a node rank" in out.err and "Traceback" not in out.err


_OUT_OF_DESCRIPTORS = """
import os, resource, sys
import anyio
from atroposd import control

async def handler(req):
    return {"ok": True, "cmd": req.get("cmd")}

async def main():
    server = control.ControlServer(control.Path(sys.argv[1]), handler, read_timeout=30)
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve)
        # two descriptors more than are open now: the third connection finds none (EMFILE)
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 2, hard))
        print("ready", flush=True)
        await anyio.sleep(60)

anyio.run(main)
"""


def test_a_failed_accept_waits_and_the_server_serves_on(short_tmp: Path) -> None:
    """No file descriptor left for a connection (EMFILE at accept): the server logs it, waits
    and accepts again once descriptors are free, instead of raising out of the daemon's task
    group. A real descriptor limit, in a child process of its own."""
    import subprocess
    import sys
    import time

    from tests.support import REPO

    path = short_tmp / "control.sock"
    child = subprocess.Popen(
        [sys.executable, "-c", _OUT_OF_DESCRIPTORS, str(path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    idle: list[socket.socket] = []
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n", child.stderr
        for _ in range(5):  # silent clients: two take the descriptors, the rest wait in the backlog
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(path))
            idle.append(s)
        time.sleep(0.5)  # accept fails with EMFILE, again and again
        assert child.poll() is None, child.communicate()[1][-2000:]
        for s in idle:
            s.close()
        idle.clear()
        deadline = time.monotonic() + 10
        while True:  # the closed clients' connections end, their descriptors come back
            try:
                answer = control.request(path, {"cmd": "ping"}, timeout=5)
                break
            except control.ControlError:
                assert time.monotonic() < deadline, "the server never accepted again"
                time.sleep(0.1)
        assert answer == {"ok": True, "cmd": "ping"}
        assert child.poll() is None
    finally:
        for s in idle:
            s.close()
        child.kill()
        out, err = child.communicate(timeout=10)
    logged = out + err  # structlog's default configuration writes to stdout
    # five or more failed accepts in the half second, logged once (twice on a machine slow enough
    # to pass the 10 s interval)
    assert 1 <= logged.count("control socket cannot accept") <= 2, logged[-2000:]
    assert "Too many open files" in logged, logged[-2000:]

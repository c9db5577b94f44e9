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


def _serve(path: Path, body: Any, *, read_timeout: float = 5.0) -> list[dict[str, Any]]:
    """Run a ControlServer while ``body()`` (sync, in a thread) talks to it; returns requests seen."""
    seen: list[dict[str, Any]] = []

    async def handler(req: dict[str, Any]) -> dict[str, Any]:
        seen.append(req)
        return {"ok": True, "echo": req}

    async def main() -> None:
        server = control.ControlServer(path, handler, read_timeout=read_timeout)
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve)
            try:
                await anyio.to_thread.run_sync(body)
            finally:
                tg.cancel_scope.cancel()

    anyio.run(main)
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

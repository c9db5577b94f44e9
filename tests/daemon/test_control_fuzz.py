"""Fuzz of the control socket's frames: 10,000 connections to a real control server on a Unix
socket, behind it the daemon's own request handler (``Daemon._control``) on a stand-in daemon
whose ``status`` is a large head's. Each case is a header and a body drawn from the run's fuzz
seed (``fuzzseed.rng``; printed in the report header, ``--fuzz-seed N`` replays it): lengths
over the limit, short, zero, lying; bodies of random bytes, invalid UTF-8, JSON that is not an
object, deep nesting, huge numbers, unknown or odd commands, a request whose echo exceeds the
frame. Every connection ends with one well-formed answer frame (``ok`` present; refusals
``ok: false`` with an error) or, for a request the client never finished, a close; the server
keeps serving throughout: nothing leaves its task group."""

from __future__ import annotations

import json
import os
import random
import socket
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from atroposd import control
from atroposd.daemon.core import Daemon
from atroposd.daemon.state import DaemonState
from tests import fuzzseed
from tests.daemon.test_control import serve_control

CASES = max(1, int(10_000 * float(os.environ.get("ATROPOSD_FUZZ_SCALE", "1"))))
_LEN = struct.Struct(">I")


class _Reply:
    def send_nowait(self, event: Any) -> None:  # a reload is answered at once
        event.reply.set({"ok": False, "error": "refused", "code": 2})


class _StandIn:
    """What ``Daemon._control`` reads of the daemon; a large head's status (about 1.2 MB)."""

    pid = 4242
    start_time = 1
    state = DaemonState.RUNNING

    def __init__(self) -> None:
        self.stops = 0
        self.asked = 0
        self._events_send = _Reply()
        row = {
            "name": "env",
            "kind": "env",
            "state": "ready",
            "pid": 1,
            "restarts": 0,
            "last_exit": None,
            "log": "/x/" + "y" * 400,
        }
        self._status = {
            "state": "running",
            "pid": 4242,
            "components": [dict(row) for _ in range(40)],
            "nodes": [
                {"node_rank": r, "state": "ready", "components": [dict(row) for _ in range(40)]} for r in range(64)
            ],
        }

    async def status(self) -> dict[str, Any]:
        self.asked += 1  # every 20th a large head's (about 1.3 MB: cut to the frame), else a small one
        return self._status if self.asked % 20 == 1 else {**self._status, "nodes": self._status["nodes"][:2]}

    def request_stop(self, reason: str) -> None:
        self.stops += 1


def _json_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 4 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 1 << 63, -(1 << 63), 10**30, rng.randrange(-1000, 1000)])
    if kind == 3:
        return rng.choice([0.5, -1e308, 1e-300, 3.14])
    if kind == 4:
        return "".join(
            chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x2FFF), 0x1B, 0]))
            for _ in range(rng.randrange(0, 40))
        )
    if kind in (5, 6):
        return [_json_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    return {str(_json_value(rng, 4)): _json_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))}


def _request_body(rng: random.Random) -> bytes:
    """A JSON request: a known command (with odd arguments) or anything else."""
    cmd = rng.choice(
        ["status", "status", "ping", "stop", "reload", "", "STATUS", None, 7, [], {"a": 1}, "x" * rng.randrange(1, 300)]
    )
    req: dict[str, Any] = {"cmd": cmd}
    if cmd == "status" and rng.random() < 0.7:
        req["node"] = rng.choice([0, 3, 63, 64, -1, 1.5, "2", None, True, 1 << 70, [1]])
    for _ in range(rng.randrange(0, 3)):
        req[str(rng.randrange(100))] = _json_value(rng)
    return json.dumps(req).encode()  # the standard encoder: integers beyond 64 bits too


def _case(rng: random.Random) -> tuple[bytes, bool, str]:
    """(bytes to send, whether they make a whole request, the kind of case)."""
    kind = rng.choice(
        [
            "json",
            "json",
            "json",
            "bytes",
            "not_object",
            "deep",
            "bad_utf8",
            "over_limit",
            "short",
            "zero",
            "half_header",
            "lying_short",
            "numbers",
        ]
    )
    if rng.random() < 0.005:  # rare: each moves 2 MiB
        kind = "echo_too_big"
    if kind == "json":
        body = _request_body(rng)
    elif kind == "bytes":
        body = rng.randbytes(rng.randrange(1, 200))
    elif kind == "not_object":
        body = json.dumps(_json_value(rng, 3)).encode() if rng.random() < 0.5 else b"[1, 2]"
    elif kind == "deep":
        n = rng.choice([10, 500, 1024, 1025, 5000])
        body = b"[" * n + b"]" * n if rng.random() < 0.5 else b'{"a":' * n + b"1" + b"}" * n
    elif kind == "bad_utf8":
        body = b'{"cmd": "' + rng.randbytes(8).replace(b'"', b"x").replace(b"\\", b"x") + b'\xff\xfe"}'
    elif kind == "numbers":
        body = rng.choice(
            [
                b'{"cmd": 1e999}',
                b'{"cmd": NaN}',
                b'{"cmd": "status", "node": 1e400}',
                b'{"cmd": "status", "node": 99999999999999999999999}',
                b'{"cmd": -0}',
            ]
        )
    elif kind == "echo_too_big":  # a request just under the limit: the stand-in cannot echo it, status cuts
        body = json.dumps({"cmd": rng.choice(["status", "nope"]), "pad": "p" * (control.MAX_FRAME - 64)}).encode()
    elif kind == "over_limit":
        return (
            _LEN.pack(rng.randrange(control.MAX_FRAME + 1, 1 << 32)) + rng.randbytes(rng.randrange(0, 16)),
            True,
            kind,
        )
    elif kind == "zero":
        return _LEN.pack(0), True, kind
    elif kind == "half_header":
        return rng.randbytes(rng.randrange(0, 4)), False, kind
    elif kind == "lying_short":  # announces more than it sends
        body = _request_body(rng)
        return _LEN.pack(len(body) + rng.randrange(1, 1000)) + body, False, kind
    else:  # "short": announces less than it sends (the rest is ignored)
        body = _request_body(rng)
        cut = rng.randrange(0, len(body))
        return _LEN.pack(cut) + body, True, kind
    return _LEN.pack(len(body)) + body, len(body) <= control.MAX_FRAME, kind


def _exchange(path: Path, data: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(str(path))
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)  # the end of what this client says: no wait for a deadline
        except (BrokenPipeError, ConnectionResetError):  # the server answered and closed first
            pass
        chunks = []
        try:
            while chunk := s.recv(1 << 16):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
        return b"".join(chunks)


@pytest.mark.slow
def test_control_frames_fuzz(short_tmp: Path) -> None:
    rng = fuzzseed.rng("control-frames")
    path = short_tmp / "control.sock"
    stand_in = _StandIn()
    kinds: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()

    async def handler(req: dict[str, Any]) -> dict[str, Any]:
        answer = await Daemon._control(stand_in, req)  # type: ignore[arg-type]
        if req.get("cmd") == "nope":
            return {**answer, "echo": req}  # an answer over the frame
        return answer

    def body() -> None:
        for i in range(CASES):
            data, whole, kind = _case(rng)
            kinds[kind] += 1
            got = _exchange(path, data)
            where = f"case {i} ({kind}, {fuzzseed.replay_hint()}): sent {data[:80]!r}..., got {got[:200]!r}"
            if not got:
                assert not whole or kind == "zero", where  # only an unfinished request is closed unanswered
                outcomes["closed"] += 1
                continue
            (length,) = _LEN.unpack(got[:4])
            assert length == len(got) - 4 <= control.MAX_FRAME, where
            answer = orjson.loads(got[4:])
            assert isinstance(answer, dict) and isinstance(answer.get("ok"), bool), where
            if not answer["ok"]:
                assert isinstance(answer.get("error"), str) and answer["error"], where
            outcomes["ok" if answer["ok"] else "refused"] += 1
            if i % 1000 == 999:  # the server still answers a plain request
                assert control.request(path, {"cmd": "ping"})["ok"] is True, where
        stand_in.asked = 0  # the next is the large head's
        assert control.request(path, {"cmd": "status"})["status"]["truncated"]

    serve_control(path, handler, read_timeout=5.0, body=body)
    print(
        f"\ncontrol frames fuzz: {CASES} cases, {fuzzseed.replay_hint()}; kinds {dict(kinds)}; "
        f"outcomes {dict(outcomes)}; stops asked {stand_in.stops}"
    )
    assert sum(outcomes.values()) == CASES and outcomes["ok"] and outcomes["refused"]

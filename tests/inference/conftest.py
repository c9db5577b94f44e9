"""Fixtures for the inference tests: the builtin:tiny directory, an in-process torch engine, and
`atroposd inference` run as a real child process (HTTP on loopback, control on a Unix socket)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from atroposd.models.tiny import ensure_builtin_model
from tests.support import free_port, spawn, stop_process, write_config

MAX_MODEL_LEN = 256


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_builtin_model(tmp_path_factory.mktemp("tiny-state"), seed=0, max_model_len=MAX_MODEL_LEN)


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    socket: Path
    log: Path
    root: Path

    def http(
        self, method: str, path: str, body: Any = None, *, raw: bytes | None = None, timeout: float = 60
    ) -> tuple[int, Any]:
        """(status, decoded JSON body) of a TCP request."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            payload = exc.read()
            try:
                return exc.code, json.loads(payload)
            except json.JSONDecodeError:
                return exc.code, payload.decode(errors="replace")

    def control(self, method: str, path: str, body: Any = None, timeout: float = 60) -> tuple[int, Any]:
        """(status, JSON) of a request on the weight-control Unix socket."""
        import http.client
        import socket

        class _Conn(http.client.HTTPConnection):
            def connect(inner) -> None:
                inner.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                inner.sock.settimeout(timeout)
                inner.sock.connect(str(self.socket))

        conn = _Conn("inference", timeout=timeout)
        try:
            conn.request(
                method,
                path,
                body=json.dumps(body) if body is not None else None,
                headers={"Content-Type": "application/json"},
            )
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read() or b"null")
        finally:
            conn.close()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


def start_server(
    root: Path,
    model: Path,
    *,
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
    port: int | None = None,
    sections: dict[str, Any] | None = None,
) -> Server:
    """Start `atroposd inference` and wait until /health answers 200 (or the process exits)."""
    port = port or free_port()
    cfg = write_config(
        root / "atroposd.toml",
        {
            "daemon": {"runtime_dir": str(root / "run"), "state_dir": str(root / "state")},
            "inference": {"port": port, "max_model_len": MAX_MODEL_LEN, "model": str(model)},
            "trainer": {"max_token_len": 128},
            **(sections or {}),
        },
    )
    sock = root / "run" / f"inference-{port}.sock"
    log = root / f"inference-{port}.log"
    proc = spawn(
        [sys.executable, "-m", "atroposd", "inference", "-c", str(cfg), "--control-socket", str(sock), *(extra or [])],
        env=env,
        log=log,
    )
    server = Server(proc, f"http://127.0.0.1:{port}", sock, log, root)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"inference server exited {proc.returncode}:\n{server.tail()}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return server
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    stop_process(proc)
    raise AssertionError(f"inference server not healthy within 120 s:\n{server.tail()}")


@pytest.fixture(scope="module")
def server_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="atpd-inf-", dir="/tmp"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def server(server_root: Path, tiny_dir: Path) -> Iterator[Server]:
    """One server for the module's request-level tests."""
    srv = start_server(server_root, tiny_dir)
    try:
        yield srv
    finally:
        code = stop_process(srv.proc)
        assert code == 0, f"inference server exited {code} on SIGTERM:\n{srv.tail()}"
        assert not srv.socket.exists(), "control socket left behind"


def env_with_nonce(nonce: str) -> dict[str, str]:
    return {
        "ATROPOSD_INSTANCE": nonce,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        **{k: v for k, v in os.environ.items() if k == "ATROPOSD_TEST_RUN"},
    }

"""Bad input on an environment's engine socket (SPEC §13, §16): fuzzed and huge bodies are
refused with a Docker API error, a connection dropped in the middle of an upgrade is closed, and
the daemon, the engine and the socket go on serving."""

from __future__ import annotations

import json
import shutil
import socket
import string
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests import fuzzseed
from tests.daemon.conftest import Job, _teardown
from tests.sandbox.conftest import IMAGE, sandbox_env, sandbox_job, socket_of
from tests.sandbox.engine import Podman

docker = pytest.importorskip("docker")
pytestmark = pytest.mark.slow


def raw(path: Path, data: bytes, *, read: bool = True, timeout: float = 10.0) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(data)
        if not read:
            return b""
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and _complete(out):
                    break
        except TimeoutError:
            pass
        return out


def _complete(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def post(path: Path, target: str, body: bytes, extra: str = "") -> tuple[int, bytes]:
    head = f"POST {target} HTTP/1.1\r\nHost: docker\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n"
    answer = raw(path, head.encode() + body)
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0
    return status, answer.partition(b"\r\n\r\n")[2]


def _value(rng: Any, depth: int = 0) -> Any:
    kinds = ["int", "str", "bool", "null", "float"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, -1, 1, 2**63, -(2**63), rng.randint(-1000, 1000)])
    if kind == "str":
        return "".join(rng.choice(string.printable + "ü/:") for _ in range(rng.randint(0, 12)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "float":
        return rng.choice([0.5, -1e308, 1e308])
    if kind == "list":
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(FIELDS): _value(rng, depth + 1) for _ in range(rng.randint(0, 5))}


FIELDS = [
    "Image", "Cmd", "Labels", "HostConfig", "Privileged", "NetworkMode", "PidMode", "IpcMode", "UsernsMode",
    "CapAdd", "Devices", "SecurityOpt", "Binds", "Mounts", "Memory", "VolumesFrom", "Links", "Type", "Source",
    "DriverOpts", "Name", "Driver", "VolumeOptions", "DriverConfig", "Options", "device", "o", "Container",
]  # fmt: skip


@pytest.fixture(scope="module")
def job(podman: Podman) -> Any:
    """One daemon for the module: each test ends by checking it still serves."""
    d = Path(tempfile.mkdtemp(prefix="apd-sb-", dir="/tmp"))
    j = sandbox_job(d, podman, [sandbox_env("box")])
    try:
        assert j.cli("start").returncode == 0
        yield j
    finally:
        _teardown(j)
        shutil.rmtree(d, ignore_errors=True)


def sock(job: Job) -> Path:
    return job.runtime_dir / "sandbox" / "box-0.sock"


def still_serving(job: Job, podman: Podman) -> None:
    """The daemon answers, the engine answers, and the socket runs a container and an exec."""
    assert job.status()["state"] == "running"
    assert podman.podman("info", "--format", "{{.Host.Arch}}").returncode == 0
    c = docker.DockerClient(base_url=socket_of(job, "box-0"), timeout=30)
    try:
        box = c.containers.run(IMAGE, ["sleep", "60"], detach=True)
        # (a short pause first: podman 4.3 itself can lose the output of an exec that ends at once)
        assert box.exec_run(["sh", "-c", "sleep 0.1; echo fine"]).output == b"fine\n"
        box.remove(force=True)
    finally:
        c.close()


def test_fuzzed_bodies_are_refused_or_checked(job: Job, podman: Podman) -> None:
    rng = fuzzseed.rng("sandbox-bodies")
    path = sock(job)
    targets = ["/containers/create", "/v1.41/containers/create", "/volumes/create", "/networks/create"]
    seen: set[int] = set()
    for i in range(150):
        target = rng.choice(targets)
        if i % 3 == 0:
            body = bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
        else:
            value = _value(rng)
            if isinstance(value, dict) and rng.random() < 0.5:
                value["HostConfig"] = _value(rng, 1)
            body = json.dumps(value).encode()
        status, answer = post(path, target, body)
        seen.add(status)
        # answered: our refusal, or the engine's own error passed on (a Docker API error either way)
        assert status != 0, (target, body)
        assert status < 300 or b"message" in answer, (target, body, status, answer)
        if status in (200, 201):  # a body that passed every check: it is the replica's
            created = json.loads(answer).get("Id") or json.loads(answer).get("Name")
            assert created
    assert 400 in seen
    podman.podman("rm", "-a", "-f", "-t", "0")
    still_serving(job, podman)


def test_huge_and_malformed_requests(job: Job, podman: Podman) -> None:
    path = sock(job)
    big = json.dumps({"Image": IMAGE, "Labels": {"x": "y" * (4 << 20)}}).encode()
    status, answer = post(path, "/containers/create", big)
    assert status == 413, answer[:200]
    status, answer = post(path, "/containers/create", b"{not json")
    assert status == 400 and b"not JSON" in answer
    status, answer = post(path, "/libpod/containers/create", b"{}")
    assert status == 403 and b"not served" in answer
    status, answer = post(path, "/containers/create?name=x", b"[1, 2]")
    assert status == 400 and b"JSON object" in answer
    status, answer = post(path, "/containers/..%2F..%2Flibpod%2Finfo/start", b"")
    assert status == 404
    # a head far past the limits, and garbage instead of HTTP
    assert raw(path, b"GET /_ping HTTP/1.1\r\nX: " + b"a" * 100_000 + b"\r\n\r\n")[8:13] == b" 400 "
    assert raw(path, b"\x00\x01\x02 garbage\r\n\r\n")[8:13] == b" 400 "
    still_serving(job, podman)


def test_connections_dropped_mid_upgrade(job: Job, podman: Podman) -> None:
    c = docker.DockerClient(base_url=socket_of(job, "box-0"), timeout=30)
    box = c.containers.run(IMAGE, ["sleep", "300"], detach=True)
    path = sock(job)
    try:
        for cut in range(6):
            eid = c.api.exec_create(box.id, ["sh", "-c", "sleep 2; echo late"], stdin=True)["Id"]
            body = json.dumps({"Detach": False, "Tty": False}).encode()
            head = (
                f"POST /v1.41/exec/{eid}/start HTTP/1.1\r\nHost: docker\r\nContent-Type: application/json\r\n"
                f"Connection: Upgrade\r\nUpgrade: tcp\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(path))
                if cut == 0:
                    s.sendall(head[:20])  # inside the head
                elif cut == 1:
                    s.sendall(head)  # before the body
                elif cut == 2:
                    s.sendall(head + body)  # before the engine's answer
                else:
                    s.sendall(head + body)
                    s.settimeout(10)
                    assert s.recv(12) == b"HTTP/1.1 101"
                    if cut == 4:
                        s.sendall(b"stdin bytes\n" * 1000)
                    if cut == 5:
                        s.shutdown(socket.SHUT_WR)
            # a second client in the middle of it all is served
            assert c.ping()
        attach = c.api.attach_socket(box.id, params={"stdout": 1, "stream": 1})
        underlying = getattr(attach, "_sock", attach)  # docker-py hands a SocketIO over the socket
        attach.close()
        underlying.close()  # an attach dropped at once
        time.sleep(0.5)
    finally:
        box.remove(force=True)
        c.close()
    still_serving(job, podman)

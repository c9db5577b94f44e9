"""Fixtures for the trajectory API tests: the API (and atroposlib's run-api, when installed) as
real child processes on loopback, and a small HTTP client that speaks to both the same way."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO, free_port, spawn, stop_process, wait_http

HAS_ATROPOSLIB = importlib.util.find_spec("atroposlib") is not None
RUN_API = Path(sys.executable).parent / "run-api"


@dataclass
class Reply:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names

    def json(self) -> Any:
        return json.loads(self.body)


class Api:
    """Blocking client: JSON in, Reply out; optional gzip body; GET may carry a JSON body."""

    def __init__(self, url: str, token: str = "") -> None:
        self.url = url.rstrip("/")
        self.token = token

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        gzip_body: bool = False,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 30,
    ) -> Reply:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        h = {"Content-Type": "application/json", **(headers or {})}
        if self.token:
            h.setdefault("Authorization", f"Bearer {self.token}")
        if gzip_body and data is not None:
            data = gzip.compress(data)
            h["Content-Encoding"] = "gzip"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return Reply(resp.status, _decoded(resp.read(), resp.headers), _lower(resp.headers))
        except urllib.error.HTTPError as exc:
            return Reply(exc.code, _decoded(exc.read(), exc.headers), _lower(exc.headers))

    def get(self, path: str, body: Any = None, **kw: Any) -> Reply:
        return self.call("GET", path, body, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> Reply:
        return self.call("POST", path, body, **kw)

    def ok(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        r = self.call(method, path, body, **kw)
        assert r.status == 200, f"{method} {path} -> {r.status}: {r.body[:300]!r}"
        return r.json()

    # the protocol, in the order a job uses it
    def register(self, batch_size: int = 8, max_token_len: int = 64, **over: Any) -> Any:
        body = dict(
            wandb_group="g",
            wandb_project="p",
            batch_size=batch_size,
            max_token_len=max_token_len,
            checkpoint_dir="ckpt",
            save_checkpoint_interval=5,
            starting_step=0,
            num_steps=100,
        )
        body.update(over)
        return self.ok("POST", "/register", body)

    def register_env(
        self,
        group_size: int = 4,
        name: str = "env",
        weight: float = 1.0,
        min_batch_allocation: float | None = None,
        max_token_length: int = 64,
    ) -> Any:
        body: dict[str, Any] = dict(
            max_token_length=max_token_length, desired_name=name, weight=weight, group_size=group_size
        )
        if min_batch_allocation is not None:
            body["min_batch_allocation"] = min_batch_allocation
        return self.ok("POST", "/register-env", body)

    def start(self, batch_size: int = 8, **kw: Any) -> None:
        """Register a trainer and make its first /batch call (opens the env gate)."""
        self.register(batch_size=batch_size, **kw)
        self.ok("GET", "/batch")

    def drain(self) -> list[list[dict[str, Any]]]:
        batches = []
        while True:
            b = self.ok("GET", "/batch")["batch"]
            if b is None:
                return batches
            batches.append(b)


def _lower(headers: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def _decoded(body: bytes, headers: Any) -> bytes:
    if (headers.get("Content-Encoding") or "").lower() == "gzip":
        return gzip.decompress(body)
    return body


def group(
    n: int = 4, *, length: int = 5, env_id: int | None = None, tag: float = 0.0, logprobs: bool = True, **extra: Any
) -> dict[str, Any]:
    """A ScoredData group of ``n`` sequences; ``tag`` makes the scores unique for exactly-once checks."""
    tokens = [[100 + i * 7 + j for j in range(length)] for i in range(n)]
    g: dict[str, Any] = {
        "tokens": tokens,
        "masks": [[-100, -100, *row[2:]] for row in tokens],
        "scores": [tag + i / 1000 for i in range(n)],
    }
    if logprobs:
        g["inference_logprobs"] = [[1.0, 1.0, *[-0.5 - j / 8 for j in range(length - 2)]] for _ in range(n)]
    if env_id is not None:
        g["env_id"] = env_id
    g.update(extra)
    return g


@dataclass
class Server:
    name: str
    api: Api
    proc: Any
    port: int
    log: Path

    @property
    def url(self) -> str:
        return self.api.url


class RegisteredChild:
    """A separate process that registered an environment and stays alive until ``exit()``."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        import subprocess

        code = (
            "import json, sys, urllib.request\n"
            "req = urllib.request.Request(sys.argv[1] + '/register-env', data=sys.argv[2].encode(),\n"
            "                             headers={'Content-Type': 'application/json'})\n"
            "print(urllib.request.urlopen(req).read().decode(), flush=True)\n"
            "sys.stdin.read()\n"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, url, json.dumps(body)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.answer: dict[str, Any] = json.loads(self.proc.stdout.readline())

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit(self) -> None:
        """Ends the process (stdin closed) and reaps it."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def register_env_from_child(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST /register-env from a separate short-lived process: (its pid, the answer)."""
    import subprocess

    code = (
        "import json, sys, urllib.request\n"
        "req = urllib.request.Request(sys.argv[1] + '/register-env', data=sys.argv[2].encode(),\n"
        "                             headers={'Content-Type': 'application/json'})\n"
        "print(urllib.request.urlopen(req).read().decode())"
    )
    child = subprocess.Popen([sys.executable, "-c", code, url, json.dumps(body)], stdout=subprocess.PIPE, text=True)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0, out
    return child.pid, json.loads(out)


def start_atroposd(tmp: Path, *args: str, port: int | None = None, env: dict[str, str] | None = None) -> Server:
    port = port or free_port()
    log = tmp / f"api-{port}.log"
    proc = spawn([sys.executable, "-m", "atroposd", "api", "--port", str(port), *args], log=log, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/info", timeout=30, proc=proc)
    except AssertionError:
        stop_process(proc)
        raise AssertionError(f"atroposd api did not start:\n{log.read_text()[-3000:]}") from None
    token = next((args[i + 1] for i, a in enumerate(args) if a == "--token"), "")
    return Server("atroposd", Api(url, token), proc, port, log)


def start_run_api(tmp: Path) -> Server:
    port = free_port()
    log = tmp / f"run-api-{port}.log"
    proc = spawn([str(RUN_API), "--host", "127.0.0.1", "--port", str(port)], log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/info", timeout=60, proc=proc)
    except AssertionError:
        stop_process(proc)
        raise AssertionError(f"run-api did not start:\n{log.read_text()[-3000:]}") from None
    return Server("run-api", Api(url), proc, port, log)


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("api")


@pytest.fixture(scope="module")
def atroposd_api(module_tmp: Path) -> Iterator[Server]:
    server = start_atroposd(module_tmp, "--max-queued-sequences", "4096")
    try:
        yield server
    finally:
        stop_process(server.proc)


@pytest.fixture(scope="module")
def atroposd_server(module_tmp: Path) -> Iterator[Server]:
    """One atroposd API per module (module scope: up before any test's leak check begins)."""
    server = start_atroposd(module_tmp, "--max-queued-sequences", "4096")
    try:
        yield server
    finally:
        stop_process(server.proc)


@pytest.fixture(scope="module")
def servers(module_tmp: Path, atroposd_server: Server) -> Iterator[dict[str, Server]]:
    """atroposd's API and, when atroposlib is installed, run-api."""
    started = {"atroposd": atroposd_server}
    if not (HAS_ATROPOSLIB and RUN_API.exists()):
        yield started
        return
    started["run-api"] = start_run_api(module_tmp)
    try:
        yield started
    finally:
        stop_process(started["run-api"].proc)


def fresh(server: Server) -> Api:
    """The server's client after /reset_data (modules share one server per kind)."""
    r = server.api.get("/reset_data")
    assert r.status == 200, r
    return server.api


SERVERS: Sequence[Any] = ("atroposd", pytest.param("run-api", marks=pytest.mark.atroposlib))


@pytest.fixture(params=SERVERS)
def any_api(request: pytest.FixtureRequest, servers: dict[str, Server]) -> Api:
    """Each conformance test runs against atroposd and, when installed, against run-api."""
    if request.param not in servers:
        pytest.skip("atroposlib (run-api) is not installed")
    return fresh(servers[request.param])


@pytest.fixture
def both(servers: dict[str, Server]) -> tuple[Api, Api]:
    """(atroposd, run-api), reset: for tests that compare the two answers side by side."""
    if "run-api" not in servers:
        pytest.skip("atroposlib (run-api) is not installed")
    return fresh(servers["atroposd"]), fresh(servers["run-api"])


@pytest.fixture
def api(atroposd_server: Server) -> Api:
    return fresh(atroposd_server)

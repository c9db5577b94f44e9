"""Fixtures for the environment tests: the builtin tokenizer, a real run-api process, a
stand-in /generate server process, and a trainer stand-in that opens the API's gate."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support import free_port, spawn, stop_process, wait_http, write_config

HERE = Path(__file__).resolve().parent
RUN_API = Path(sys.executable).parent / "run-api"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The builtin:tiny tokenizer, saved the way the model builder saves it."""
    from atroposd.models.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(str(path))
    return path


def http_json(method: str, url: str, body: Any = None, timeout: float = 5.0) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


@dataclass
class Api:
    """A trajectory API process (run-api or atroposd api) and a trainer stand-in for it."""

    url: str
    proc: Any
    log: Path
    batches: list[list[dict[str, Any]]] = field(default_factory=list)

    def register_trainer(self, batch_size: int = 16, max_token_len: int = 64, num_steps: int = 100) -> None:
        http_json(
            "POST",
            self.url + "/register",
            {
                "wandb_group": "",
                "wandb_project": "",
                "batch_size": batch_size,
                "max_token_len": max_token_len,
                "checkpoint_dir": "",
                "save_checkpoint_interval": 0,
                "starting_step": 0,
                "num_steps": num_steps,
            },
        )

    def get_batch(self) -> list[dict[str, Any]] | None:
        """One GET /batch (the first opens the env-registration gate)."""
        batch = http_json("GET", self.url + "/batch").get("batch")
        if batch:
            self.batches.append(batch)
        return batch

    def start_trainer(self, **kw: Any) -> None:
        self.register_trainer(**kw)
        self.get_batch()

    def status(self) -> dict[str, Any]:
        return http_json("GET", self.url + "/status")

    def status_env(self, env_id: int) -> dict[str, Any]:
        return http_json("GET", self.url + "/status-env", {"env_id": env_id})


def start_api(kind: str, tmp: Path, port: int | None = None, extra: tuple[str, ...] = ()) -> Api:
    """``kind``: "run-api" (atroposlib's reference) or "atroposd" (``atroposd api``)."""
    port = port or free_port()
    log = tmp / f"{kind}-{port}.log"
    if kind == "run-api":
        cmd = [str(RUN_API), "--host", "127.0.0.1", "--port", str(port), *extra]
    else:
        cmd = [sys.executable, "-m", "atroposd", "api", "--host", "127.0.0.1", "--port", str(port), *extra]
    proc = spawn(cmd, log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/info", timeout=60, proc=proc)
    except BaseException:
        stop_process(proc)
        raise
    return Api(url=url, proc=proc, log=log)


@pytest.fixture(scope="module")
def api_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Api]]:
    """One run-api and one ``atroposd api`` per test module; each test starts from a clean
    state through ``GET /reset_data``."""
    tmp = tmp_path_factory.mktemp("apis")
    servers: dict[str, Api] = {}
    try:
        for kind in ("run-api", "atroposd"):
            servers[kind] = start_api(kind, tmp)
        yield servers
    finally:
        for server in servers.values():
            stop_process(server.proc)


def _clean(api_servers: dict[str, Api], kind: str) -> Api:
    server = api_servers[kind]
    if server.proc.poll() is not None:
        raise AssertionError(f"{kind} exited with {server.proc.returncode}")
    urllib.request.urlopen(server.url + "/reset_data", timeout=10).close()
    server.batches.clear()
    return server


@pytest.fixture(params=["run-api", "atroposd"])
def api(request: pytest.FixtureRequest, api_servers: dict[str, Api]) -> Api:
    """Both APIs, in turn, from a clean state: for the protocol tests."""
    return _clean(api_servers, request.param)


@pytest.fixture
def our_api(api_servers: dict[str, Api]) -> Api:
    """``atroposd api`` from a clean state: for tests of the environment's own behaviour."""
    return _clean(api_servers, "atroposd")


@dataclass
class FakeInference:
    url: str
    proc: Any

    def stats(self) -> dict[str, Any]:
        return http_json("GET", self.url + "/stats")

    def post(self, path: str) -> Any:
        return http_json("POST", self.url + path, {})


def start_fake_inference(
    tmp: Path, policy: str = "oracle", status: int = 200, port: int | None = None, wait: bool = True
) -> FakeInference:
    port = port or free_port()
    proc = spawn(
        [
            sys.executable,
            str(HERE / "fake_inference.py"),
            "--port",
            str(port),
            "--policy",
            policy,
            "--status",
            str(status),
        ],
        log=tmp / f"fake-inference-{port}.log",
    )
    url = f"http://127.0.0.1:{port}"
    if wait:
        try:
            wait_http(url + "/health", timeout=30, proc=proc)
        except BaseException:
            stop_process(proc)
            raise
    return FakeInference(url=url, proc=proc)


@pytest.fixture(scope="module")
def shared_fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeInference]:
    server = start_fake_inference(tmp_path_factory.mktemp("fake"))
    try:
        yield server
    finally:
        stop_process(server.proc)


@pytest.fixture
def fake_inference(shared_fake: FakeInference) -> Callable[..., FakeInference]:
    """``fake_inference(policy="oracle", status=200)``: the module's stand-in /generate server,
    switched to that policy with its counters reset."""

    def configure(policy: str = "oracle", status: int = 200) -> FakeInference:
        http_json("POST", shared_fake.url + "/configure", {"policy": policy, "status": status})
        return shared_fake

    return configure


@dataclass
class EnvProc:
    proc: subprocess.Popen[bytes]
    log: Path

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append({"event": line})
        return out

    def count(self, event: str) -> int:
        return sum(1 for e in self.events() if e.get("event", "").startswith(event))

    def wait_event(self, event: str, n: int = 1, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.count(event) < n:
            if self.proc.poll() is not None:
                raise AssertionError(f"env exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no {event!r} ×{n} in the env log within {timeout}s:\n{self.log.read_text()[-3000:]}"
                )
            time.sleep(0.05)


def held_back_env(
    api: Api, fake_inference: Callable[..., FakeInference], start_env: Callable[..., EnvProc]
) -> tuple[FakeInference, EnvProc]:
    """A built-in environment held back by a full queue: the limit is max_batches_offpolicy (1) ×
    batch (8) / group (4) = 2 groups queued or in flight, both queued when this returns."""
    from tests.support import wait_for

    infer = fake_inference("uniform")
    api.start_trainer(batch_size=8, max_token_len=64)
    env = start_env(api.url, infer.url, group_size=4, concurrency=4, max_batches_offpolicy=1)
    env.wait_event("throttled")
    wait_for(lambda: api.status()["queue_size"] == 2, timeout=20, what="2 groups queued")
    return infer, env


def env_config(tmp: Path, group_size: int = 4, weight: float = 1.0, **options: Any) -> Path:
    return write_config(
        tmp / "atroposd.toml",
        {
            "daemon": {
                "state_dir": str(tmp / "state"),
                "runtime_dir": str(tmp / "run"),
                "log_format": "json",
                "log_level": "debug",
            },  # the gate logs its transitions at debug level
            "trainer": {"batch_size": 16, "micro_batch_size": 8, "max_token_len": 64},
            "env": [
                {
                    "name": "arithmetic",
                    "builtin": "arithmetic",
                    "group_size": group_size,
                    "weight": weight,
                    "options": options,
                }
            ],
        },
    )


@pytest.fixture
def start_env(tmp_path: Path, tokenizer_dir: Path) -> Iterator[Callable[..., EnvProc]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(
        api_url: str,
        inference_url: str,
        *,
        group_size: int = 4,
        replica: int = 0,
        tokenizer: Path | None = None,
        weight: float = 1.0,
        **options: Any,
    ) -> EnvProc:
        cfg = env_config(tmp_path, group_size, weight, **options)
        log = tmp_path / f"env-{len(procs)}.log"
        proc = spawn(
            [
                sys.executable,
                "-m",
                "atroposd",
                "env",
                "arithmetic",
                "-c",
                str(cfg),
                "--replica",
                str(replica),
                "--api-url",
                api_url,
                "--inference-url",
                inference_url,
                "--tokenizer",
                str(tokenizer or tokenizer_dir),
            ],
            log=log,
        )
        procs.append(proc)
        return EnvProc(proc, log)

    try:
        yield start
    finally:
        for proc in procs:
            stop_process(proc)

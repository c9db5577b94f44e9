"""Fixtures for the weight-exchange tests: a tiny Llama (head_dim 64, tied embeddings), a
launch nonce, and a stand-in inference server run as a real child process."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from atroposd.weights.client import WeightControlClient
from tests.support import spawn, stop_process, wait_for

HERE = Path(__file__).resolve().parent
PROMPT = [1, 5, 12, 7, 17, 9, 3, 14, 2, 6]


def tiny_config(**over: Any) -> LlamaConfig:
    kw: dict[str, Any] = dict(
        vocab_size=22,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kw.update(over)
    return LlamaConfig(**kw)


def make_model(seed: int = 0, **over: Any) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**over))
    model.eval()
    return model


def score(model: torch.nn.Module, tokens: list[int] = PROMPT) -> torch.Tensor:
    """log p(tokens[i] | tokens[:i]) for i ≥ 1: [len(tokens) - 1] (on the CPU)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        ids = torch.tensor([tokens], device=device)
        logits = model(input_ids=ids).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].cpu()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: list[int] = PROMPT) -> None:
    """One real optimizer step: maximise the likelihood of ``tokens``."""
    model.train()
    ids = torch.tensor([tokens], device=next(model.parameters()).device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def nonce(monkeypatch: pytest.MonkeyPatch) -> str:
    value = "t" + secrets.token_hex(6)
    monkeypatch.setenv("ATROPOSD_INSTANCE", value)
    return value


@pytest.fixture
def dirs(short_tmp: Path) -> dict[str, Path]:
    d = {"runtime": short_tmp / "run", "state": short_tmp / "state"}
    d["weights"] = d["runtime"] / "weights"
    d["sync"] = d["state"] / "sync"
    d["model"] = short_tmp / "model"
    for p in d.values():
        p.mkdir(parents=True, exist_ok=True, mode=0o700)
    tiny_config().save_pretrained(d["model"])
    return d


@dataclass
class Child:
    proc: subprocess.Popen[bytes]
    socket: Path
    log: Path

    async def call(self, method: str, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        client = WeightControlClient(self.socket, timeout=60)
        try:
            return await client.request(method, route, body)
        finally:
            await client.close()

    async def logprobs(self, tokens: list[int] = PROMPT) -> tuple[torch.Tensor, int | None]:
        out = await self.call("POST", "/logprobs", {"tokens": tokens})
        return torch.tensor(out["logprobs"]), out["weight_version"]


def _post(sock: Path, route: str, body: dict[str, Any]) -> None:
    """A blocking POST over the Unix socket (callable from inside a running event loop)."""
    import http.client
    import json
    import socket

    class Conn(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(60)
            self.sock.connect(str(sock))

    conn = Conn("localhost")
    try:
        conn.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode()
        if resp.status != 200:
            raise AssertionError(f"POST {route} answered {resp.status}: {text}")
    finally:
        conn.close()


def start_child(dirs: dict[str, Path], nonce: str, name: str, env: dict[str, str] | None = None) -> Child:
    sock = dirs["runtime"] / f"{name}.sock"
    log = dirs["runtime"] / f"{name}.log"
    proc = spawn(
        [
            sys.executable,
            str(HERE / "child_server.py"),
            str(dirs["model"]),
            str(sock),
            str(dirs["weights"]),
            str(dirs["sync"]),
        ],
        env={"ATROPOSD_INSTANCE": nonce, "PYTHONPATH": str(HERE.parent.parent), **(env or {})},
        log=log,
    )

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"child server exited {proc.returncode}: {log.read_text()[-2000:]}")
        return sock.exists()

    try:
        wait_for(up, timeout=120, what="child server socket")
    except BaseException:
        stop_process(proc)
        raise
    return Child(proc, sock, log)


class ChildFactory:
    def __init__(self, dirs: dict[str, Path], nonce: str, pooled: Child | None = None) -> None:
        self.dirs = dirs
        self.nonce = nonce
        self.pooled = pooled
        self.children: list[Child] = []

    def start(self, env: dict[str, str] | None = None) -> Child:
        """A new server process of this test's launch (for tests that kill it)."""
        child = start_child(self.dirs, self.nonce, f"inf-{len(self.children)}", env)
        self.children.append(child)
        return child

    def reuse(self) -> Child:
        """The module's server process, reset to a fresh server of this test's launch.

        Starting a process imports torch and transformers (seconds on a loaded machine), so
        tests that do not kill their server share one.
        """
        if self.pooled is None or self.pooled.proc.poll() is not None:
            return self.start()
        _post(
            self.pooled.socket,
            "/reset",
            {"nonce": self.nonce, "weights_dir": str(self.dirs["weights"]), "sync_dir": str(self.dirs["sync"])},
        )
        return self.pooled

    def stop_all(self) -> None:
        for c in self.children:
            stop_process(c.proc)


@pytest.fixture(scope="module")
def pooled_child(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    """One server process per module, started before the per-test leak check records its baseline."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="apw-", dir="/tmp"))
    d = {"runtime": root / "run", "state": root / "state", "model": root / "model"}
    d["weights"], d["sync"] = d["runtime"] / "weights", d["state"] / "sync"
    for p in d.values():
        p.mkdir(parents=True, exist_ok=True, mode=0o700)
    tiny_config().save_pretrained(d["model"])
    child = start_child(d, "pool" + secrets.token_hex(4), "pooled")
    try:
        yield child
    finally:
        stop_process(child.proc)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def child_factory(dirs: dict[str, Path], nonce: str, pooled_child: Child) -> Iterator[ChildFactory]:
    factory = ChildFactory(dirs, nonce, pooled_child)
    try:
        yield factory
    finally:
        factory.stop_all()


def run(fn: Any, *args: Any) -> Any:
    return anyio.run(fn, *args)


def own_resources() -> dict[str, int]:
    maps = Path("/proc/self/maps").read_text().splitlines()
    rss = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "shm_maps": sum(1 for x in maps if "/dev/shm/atroposd" in x),
        "rss": rss,
    }

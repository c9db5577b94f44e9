"""The engine seam (atroposd.inference.engine, docs/ARCHITECTURE.md "Adding an inference engine"):
the engine the server serves is the one the name → factory table makes, an unknown name is
refused naming the known ones, and every engine's weight update goes through the one checked
path (atroposd.weights.receiver.check_update), which refuses a wrong manifest before any weight
is touched.

Real pieces throughout: the real front (``serve``: TCP port, control socket) with an engine
registered in the table, the real torch engine on builtin:tiny, the vLLM engine's own update
path (its checks run before vLLM is reached, so no vLLM is needed), real exported buffers in
POSIX shared memory and their manifests."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import http.client
import json
import secrets
import signal
import socket
import urllib.request
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from atroposd.config import load_config
from atroposd.config.schema import InferenceConfig
from atroposd.inference import engine as engine_module
from atroposd.inference.engine import ENGINE_NAMES, ENGINES, EngineOptions, UnknownEngine, make_engine
from atroposd.inference.gate import WeightGate
from atroposd.inference.schema import GenerateParams, generate_response
from atroposd.inference.server import ServerOptions, serve
from atroposd.weights import receiver as receiver_module
from atroposd.weights.control import BroadcastOp, LoadWeights, UpdateWeights
from atroposd.weights.protocol import WeightUpdateError
from atroposd.weights.receiver import CheckedUpdate, ReceiverState, check_update
from tests.inference.conftest import MAX_MODEL_LEN
from tests.support import free_port, write_config

pytestmark = pytest.mark.anyio


class EchoEngine(WeightGate):
    """An engine of the test's own: answers every generation with its prompt, takes weights
    through the one checked path against a model of one tensor."""

    name = "echo"
    pause_modes: tuple[str, ...] = ("wait",)

    def __init__(self, receiver: ReceiverState, *, await_weights: bool) -> None:
        super().__init__(await_weights=await_weights)
        self.receiver = receiver
        self.max_model_len = MAX_MODEL_LEN
        self.vocab_size = 0
        self.started = self.closed = False

    async def start(self) -> None:
        self.vocab_size = 22
        self.started = True

    async def close(self) -> None:
        self._close_gate()
        self.closed = True

    async def check_health(self) -> None:
        return None

    async def generate(self, request: GenerateParams, *, bypass_pause: bool = False) -> dict[str, Any]:
        from atroposd.inference.schema import Completion

        async with self._admitted(bypass_pause) as version:
            ids = list(request.prompt_ids)[: request.max_tokens]
            done = Completion(token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="length")
            return generate_response(
                request, [done] * request.n, weight_version=version, prompt_text="echo", prompt_logprobs=None
            )

    async def update_weights(self, request: UpdateWeights) -> dict[str, Any]:
        assert self.receiver is not None
        checked = check_update(request, self.receiver, lambda _: ({}, {}), engine=self.name, modes=("copy",))
        return {"weight_version": checked.manifest.weight_version}

    async def load_weights(self, request: LoadWeights) -> dict[str, Any]:
        raise WeightUpdateError(f"the echo engine loads nothing ({request.path})")

    async def broadcast_weights(self, request: BroadcastOp) -> dict[str, Any]:
        raise WeightUpdateError(f"the echo engine takes no broadcast ({request.op})")

    async def weight_info(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version, "paused": self.paused, "engine": self.name}


def _config(root: Path, model: Path, port: int) -> Any:
    path = write_config(
        root / "atroposd.toml",
        {
            "daemon": {"runtime_dir": str(root / "run"), "state_dir": str(root / "state")},
            "inference": {"port": port, "max_model_len": MAX_MODEL_LEN, "model": str(model)},
            "trainer": {"max_token_len": 128},
        },
    )
    return load_config(path)


def _control(sock: Path, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    class _Conn(http.client.HTTPConnection):
        def connect(inner) -> None:
            inner.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            inner.sock.settimeout(30)
            inner.sock.connect(str(sock))

    conn = _Conn("inference", timeout=30)
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


@contextlib.asynccontextmanager
async def serving(cfg: Any, opts: ServerOptions) -> AsyncIterator[None]:
    """``serve`` on this loop until the block ends (then cancelled: its cleanup runs as on a stop)."""
    ready = asyncio.Event()
    task = asyncio.ensure_future(serve(cfg, opts, ready=ready.set))
    loop = asyncio.get_running_loop()
    try:
        waiter = asyncio.ensure_future(ready.wait())
        await asyncio.wait({task, waiter}, timeout=120, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if task.done():
            task.result()  # its error, if it failed
        assert ready.is_set(), "the server did not come up"
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for sig in (signal.SIGTERM, signal.SIGINT):  # serve's own handlers go with it
            loop.remove_signal_handler(sig)


async def test_the_engine_registered_by_name_is_the_one_served(
    tiny_dir: Path, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[EchoEngine] = []

    def factory(cfg: Any, opts: EngineOptions) -> EchoEngine:
        made.append(EchoEngine(opts.receiver, await_weights=opts.await_weights))
        return made[-1]

    monkeypatch.setitem(ENGINES, "echo", factory)
    port = free_port()
    cfg = _config(short_tmp, tiny_dir, port)
    sock = short_tmp / "c.sock"
    opts = ServerOptions(host="127.0.0.1", port=port, control_socket=sock, engine="echo")
    async with serving(cfg, opts):
        assert len(made) == 1 and made[0].started

        def tcp(path: str, body: Any = None) -> Any:
            data = json.dumps(body).encode() if body is not None else None
            req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data)
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.loads(resp.read())

        info = await asyncio.to_thread(tcp, "/info")
        assert info["engine"] == "echo" and info["ready"] is True
        answer = await asyncio.to_thread(
            tcp, "/generate", {"prompt": {"prompt_token_ids": [1, 5, 6, 7]}, "max_tokens": 3, "n": 2}
        )
        assert answer["token_ids"] == [[1, 5, 6], [1, 5, 6]] and answer["weight_version"] == 0
        assert (await asyncio.to_thread(_control, sock, "GET", "/weight_info"))[1]["engine"] == "echo"
        # the pause route asks the engine what it serves: this one drains only
        status, body = await asyncio.to_thread(_control, sock, "POST", "/pause", {"mode": "keep"})
        assert status == 400 and body["error"] == "the echo engine pauses with mode wait only"
        # a weight-control body is refused on arrival, naming the field, before the engine sees it
        status, body = await asyncio.to_thread(_control, sock, "POST", "/update_weights", {"mode": "copy"})
        assert status == 400 and body["error"] == "request is missing 'manifest'"
        status, body = await asyncio.to_thread(_control, sock, "POST", "/resume", {"weight_version": -1})
        assert status == 400 and "weight_version must be a non-negative integer" in body["error"]
        # the engine's own checked update: no manifest of this launch's at that path
        status, body = await asyncio.to_thread(
            _control, sock, "POST", "/update_weights", {"manifest": str(short_tmp / "nope.json"), "mode": "copy"}
        )
        assert status == 400, body
    assert made[0].closed


async def test_an_unknown_engine_is_refused_naming_the_known_ones(tiny_dir: Path, short_tmp: Path) -> None:
    cfg = _config(short_tmp, tiny_dir, free_port())
    with pytest.raises(UnknownEngine, match=r"unknown engine 'sglang' \(known: torch, vllm\)"):
        make_engine(cfg, "sglang", await_weights=False)
    # the command line offers what the table holds; the config's choices are the same names
    from atroposd.inference.cli import add_arguments

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    with pytest.raises(argparse.ArgumentError, match=r"invalid choice: 'sglang' \(choose from '?torch'?, '?vllm'?\)"):
        parser.parse_args(["--engine", "sglang"])
    engine_field = next(f for f in dataclasses.fields(InferenceConfig) if f.name == "engine")
    assert tuple(engine_field.metadata["choices"]) == ENGINE_NAMES == tuple(engine_module.ENGINES)


# ---------------------------------------------------------------------------- the one checked update


@pytest.fixture
def nonce() -> str:
    return "seam" + secrets.token_hex(5)


@pytest.fixture
def receiver(short_tmp: Path, nonce: str) -> ReceiverState:
    weights = short_tmp / "weights"
    weights.mkdir(mode=0o700)
    return ReceiverState(nonce=nonce, weights_dir=weights, sync_dir=short_tmp / "sync")


@pytest.fixture
def wrong_manifest(tiny_dir: Path, receiver: ReceiverState, nonce: str) -> Any:
    """A manifest of this launch's whose last tensor has another shape (as many bytes): another model's."""
    from transformers import AutoModelForCausalLM

    from atroposd.weights.arena import ParameterArena
    from atroposd.weights.manifest import manifest_path

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    arena = ParameterArena.create(model, nonce=nonce)
    try:
        good = arena.manifest(1)
        last = good.tensors[-1].name
        wrong = dataclasses.replace(
            good,
            tensors=tuple(
                dataclasses.replace(t, shape=(t.shape[0] // 2, 2, *t.shape[1:])) if t.name == last else t
                for t in good.tensors
            ),
        )
        path = manifest_path(receiver.weights_dir, nonce)
        wrong.write(path)
        yield path, last
    finally:
        arena.release()


@pytest.fixture
def checked_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, BaseException | CheckedUpdate]]:
    """Every call of the one checked path, with what it answered (engines import it at call time)."""
    calls: list[tuple[str, BaseException | CheckedUpdate]] = []
    real: Callable[..., CheckedUpdate] = check_update

    def spy(request: UpdateWeights | Mapping[str, object], state: ReceiverState, *a: Any, **kw: Any) -> CheckedUpdate:
        try:
            out = real(request, state, *a, **kw)
        except BaseException as exc:
            calls.append((str(kw.get("engine", "torch")), exc))
            raise
        calls.append((str(kw.get("engine", "torch")), out))
        return out

    monkeypatch.setattr(receiver_module, "check_update", spy)
    return calls


async def test_a_wrong_manifest_is_refused_by_the_one_checked_path_on_the_torch_engine(
    tiny_dir: Path, receiver: ReceiverState, wrong_manifest: Any, checked_calls: list[Any]
) -> None:
    from atroposd.inference.torch_engine import TorchEngine

    path, last = wrong_manifest
    eng = TorchEngine(model_dir=tiny_dir, max_model_len=MAX_MODEL_LEN, seed=0, receiver=receiver)
    await eng.start()
    try:
        assert eng.model is not None
        before = {k: v.clone() for k, v in eng.model.state_dict().items()}
        await eng.pause()
        with pytest.raises(WeightUpdateError, match=f"{last}.*shape") as refused:
            await eng.update_weights(UpdateWeights(str(path), "copy", weight_version=1))
        assert checked_calls == [("torch", refused.value)]
        assert all(torch.equal(v, before[k]) for k, v in eng.model.state_dict().items())
        assert receiver.weight_version is None and eng.updates == 0
        await eng.resume()
    finally:
        await eng.close()


async def test_a_wrong_manifest_is_refused_by_the_one_checked_path_on_the_vllm_engine(
    tiny_dir: Path, receiver: ReceiverState, wrong_manifest: Any, checked_calls: list[Any]
) -> None:
    """The vLLM engine checks against the checkpoint-format tensors vLLM loads, before any vLLM
    worker is asked: the same refusal, from the same place (no vLLM is started for it)."""
    from atroposd.inference.vllm_engine import VllmEngine, _expected_tensors

    path, last = wrong_manifest
    eng = VllmEngine(model=str(tiny_dir), max_model_len=MAX_MODEL_LEN, receiver=receiver)
    specs, tied, _ = _expected_tensors(str(tiny_dir), "float32")
    eng._expected = specs, tied
    await eng.pause()  # the gate only: no vLLM engine is running to pause
    with pytest.raises(WeightUpdateError, match=f"{last}.*shape") as refused:
        await eng.update_weights(UpdateWeights(str(path), "copy", weight_version=1))
    assert checked_calls == [("vLLM", refused.value)]
    with pytest.raises(WeightUpdateError, match=r"the vLLM engine only copies weights \(mode 'copy'\), got 'attach'"):
        await eng.update_weights({"manifest": str(path), "mode": "attach"})
    assert receiver.weight_version is None and receiver.buckets is None and eng.updates == 0


# ---------------------------------------------------------------------------- the control bodies


def test_control_bodies_are_checked_on_arrival_naming_the_field() -> None:
    from atroposd.weights.control import ControlBodyError, PauseBody, QuarantineBody, ResumeBody

    for parse, body, message in (
        (UpdateWeights.parse, [], "request must be a JSON object"),
        (UpdateWeights.parse, {"manifest": "/m"}, "request is missing 'mode'"),
        (UpdateWeights.parse, {"manifest": "/m", "mode": "steal"}, "'mode' must be 'attach' or 'copy', got 'steal'"),
        (UpdateWeights.parse, {"manifest": 3, "mode": "copy"}, "'manifest' must be a string, got 3"),
        (
            UpdateWeights.parse,
            {"manifest": "/m", "mode": "copy", "weight_version": "3"},
            "'weight_version' must be an integer, got '3'",
        ),
        (LoadWeights.parse, {"weight_version": 3}, "request is missing 'path'"),
        (LoadWeights.parse, {"path": "/d", "weight_version": True}, "'weight_version' must be an integer, got True"),
        (ResumeBody.parse, {"weight_version": -1}, "weight_version must be a non-negative integer, got -1"),
        (BroadcastOp.parse, {"formation": "f"}, "broadcast request must be a JSON object with an 'op'"),
        (BroadcastOp.parse, {"op": "dance"}, "unknown broadcast op 'dance' (join, receive, finish, leave)"),
        (QuarantineBody.parse, {"quarantine": "yes"}, "quarantine must be true or false"),
    ):
        with pytest.raises(ControlBodyError) as refused:
            parse(body)
        assert str(refused.value) == message and isinstance(refused.value, WeightUpdateError)
    with pytest.raises(ControlBodyError, match="clear_cache must be true or false, got 'no'"):
        PauseBody.parse({"clear_cache": "no"}, engine="torch", modes=("wait", "keep"))
    # no body: the defaults; each body's fields() is what the sending side writes, and reads back
    assert PauseBody.parse(None, engine="torch", modes=("wait", "keep")) == PauseBody()
    assert ResumeBody.parse(None) == ResumeBody() and ResumeBody().fields() == {}
    assert QuarantineBody.parse({"quarantine": True}).reason == "drift over the limit"
    assert UpdateWeights.parse({"manifest": "/m", "mode": "copy", "digest": 1}).digest is False
    for typed in (UpdateWeights("/m", "attach", 3, True), LoadWeights("/d", 4), ResumeBody(2)):
        assert type(typed).parse(json.loads(json.dumps(typed.fields()))) == typed
    keep = PauseBody("keep", False)
    assert PauseBody.parse(keep.fields(), engine="torch", modes=("wait", "keep")) == keep

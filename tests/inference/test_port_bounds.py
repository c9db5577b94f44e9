"""The inference server's TCP port is bounded as the API is (SPEC §13), and a probe is a probe
(SPEC §7): one request cannot take a replica down, whoever sends it.

A real torch engine on builtin:tiny and the real front (``build_tcp_app`` on a capped site),
served by the test's event loop; ``/health`` is polled from another thread throughout, so a
stalled loop shows as a slow answer."""

from __future__ import annotations

import asyncio
import contextlib
import io
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from atroposd.inference import schema
from atroposd.inference import server as server_module
from atroposd.inference.torch_engine import TorchEngine
from atroposd.models.tiny import BOS_ID
from tests.inference.conftest import MAX_MODEL_LEN

PROMPT = [BOS_ID, 5, 14, 7, 17]


@contextlib.asynccontextmanager
async def serving(tiny_dir: Path, **front_fields: Any) -> AsyncIterator[tuple[Any, str, int]]:
    """(front, url, port) of the inference front on a real torch engine, served by this loop."""
    from transformers import AutoTokenizer

    engine = TorchEngine(model_dir=tiny_dir, max_model_len=MAX_MODEL_LEN, seed=0)
    await engine.start()
    front = server_module._Front(model_name="tiny", max_model_len=MAX_MODEL_LEN, info={"model": "tiny"})
    front.tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    for key, value in front_fields.items():
        setattr(front, key, value)
    make_runner = getattr(server_module, "tcp_runner", None)  # as `atroposd inference` runs it
    runner = make_runner(front) if make_runner else web.AppRunner(server_module.build_tcp_app(front), access_log=None)
    await runner.setup()
    try:
        make_site = getattr(server_module, "tcp_site", None)
        site = make_site(runner, front, "127.0.0.1", 0) if make_site else web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        front.engine = engine
        yield front, f"http://127.0.0.1:{port}", port
    finally:
        front.engine = None
        await engine.close()
        await runner.cleanup()


class HealthWatch:
    """``GET /health`` from a thread every 50 ms while it runs; the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst = 0.0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=30) as resp:
                    resp.read()
            except Exception as exc:
                self.failures.append(repr(exc))
            self.worst = max(self.worst, time.monotonic() - t0)
            self._stop.wait(0.05)

    async def __aenter__(self) -> HealthWatch:
        self._thread.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 60)  # the loop answers the last poll meanwhile


async def _post(s: aiohttp.ClientSession, url: str, body: Any, timeout: float = 30) -> tuple[int, Any]:
    data = io.BytesIO(body if isinstance(body, bytes) else orjson.dumps(body))
    async with s.post(
        url, data=data, headers={"Content-Type": "application/json"}, timeout=aiohttp.ClientTimeout(total=timeout)
    ) as r:
        raw = await r.read()
        try:
            return r.status, orjson.loads(raw)
        except orjson.JSONDecodeError:
            return r.status, raw


# ---------------------------------------------------------------------------- the three bodies


HIGH_BODIES = {
    # 8 MiB of text, tokenized on the event loop before its length was checked
    "long text": ("/v1/completions", {"model": "tiny", "prompt": "1+3=" * (2 << 20), "max_tokens": 1}),
    # 200 prompts × n = 256: the per-prompt bound held, the request's did not
    "many prompts": (
        "/v1/completions",
        {"model": "tiny", "prompt": [PROMPT] * 200, "n": 256, "max_tokens": 200, "ignore_eos": True},
    ),
    # a 1 MiB rid echoed once per sample
    "long rid": (
        "/generate",
        {"input_ids": PROMPT, "rid": "r" * (1 << 20), "sampling_params": {"n": 256, "max_new_tokens": 8}},
    ),
    # 100,000 one-token prompts
    "100k prompts": ("/v1/completions", {"model": "tiny", "prompt": [[5]] * 100_000, "max_tokens": 1}),
}


@pytest.mark.parametrize("name", list(HIGH_BODIES))
def test_one_request_cannot_take_the_replica_down(tiny_dir: Path, name: str) -> None:
    """Each is refused (400, naming the bound) at once, and /health answers within 1 s throughout."""
    path, body = HIGH_BODIES[name]
    raw = orjson.dumps(body)

    async def run() -> None:
        async with serving(tiny_dir) as (front, url, _), aiohttp.ClientSession() as s:
            async with HealthWatch(url) as watch:
                await asyncio.sleep(0.1)
                t0 = time.monotonic()
                status, answer = await _post(s, url + path, raw, timeout=20)
                took = time.monotonic() - t0
                await asyncio.sleep(0.1)
            assert status == 400, (status, str(answer)[:300])
            assert took < 5, took
            assert watch.worst < 1.0 and not watch.failures, (watch.worst, watch.failures[:3])
            assert front.inflight.bytes == 0

    asyncio.run(run())


def test_whole_request_bounds_name_the_problem() -> None:
    def params(n: int, max_tokens: int, prompt: int = 4) -> schema.GenerateParams:
        return schema.GenerateParams(prompt_ids=[1] * prompt, n=n, max_tokens=max_tokens)

    schema.check_totals([params(256, 16)] * 256)
    with pytest.raises(schema.BadRequest, match="prompts × n × max_tokens"):
        schema.check_totals([params(256, 4093)] * 200)
    with pytest.raises(schema.BadRequest, match="at most 256"):
        schema.check_totals([params(1, 1)] * 257)
    with pytest.raises(schema.BadRequest, match="prompt tokens exceed"):
        schema.check_totals([params(1, 1, prompt=(1 << 20) // 200 + 1)] * 200)
    with pytest.raises(schema.BadRequest, match="max_model_len × 16"):
        schema.check_text("é" * 2049, max_model_len=256)
    schema.check_text("é" * 2048, max_model_len=256)
    schema.check_texts(["x" * (1 << 20)] * 16, max_model_len=1 << 16)
    with pytest.raises(schema.BadRequest, match="in all"):
        schema.check_texts(["x" * (1 << 20)] * 17, max_model_len=1 << 16)
    body = {"input_ids": [1, 2], "rid": "r" * 257}
    with pytest.raises(schema.BadRequest, match="rid is 257 characters"):
        schema.parse_sglang(body, max_model_len=64, vocab_size=32, encode=lambda t: [1])


# ---------------------------------------------------------------------------- probes


def test_a_probe_is_a_probe() -> None:
    def lane(**kw: Any) -> str:
        body = {"prompt": {"prompt_token_ids": kw.pop("ids", [1, 2])}, **kw}
        return schema.parse_generate(body, max_model_len=512, vocab_size=32).lane

    assert lane(max_tokens=1) == "probe"
    assert lane(max_tokens=1, n=256) == "rollout"
    assert lane(max_tokens=1, ids=[1] * 65) == "rollout"
    assert lane(max_tokens=1, ids=[1] * 64) == "probe"
    assert lane(max_tokens=2) == "rollout"
    p = schema.GenerateParams(prompt_ids=[1] * 90, max_tokens=1)
    assert schema.with_lane(p, template_tokens=30).lane == "probe"  # 64 beyond the template's own
    assert schema.with_lane(p).lane == "rollout"
    assert schema.with_lane(schema.GenerateParams(prompt_ids=[1] * 300, n=4, max_tokens=1), own=True).lane == "own"


@pytest.mark.anyio
async def test_probes_do_not_starve_rollouts(tiny_dir: Path) -> None:
    """Four clients sending n = 256 one-token requests back to back: a rollout is still answered
    promptly (they used to ride the probe lane ahead of it, for as long as they kept coming)."""
    engine = TorchEngine(model_dir=tiny_dir, max_model_len=MAX_MODEL_LEN, seed=0)
    await engine.start()
    stop = asyncio.Event()

    async def flood() -> int:
        sent = 0
        while not stop.is_set():
            await engine.generate({"prompt": {"prompt_token_ids": PROMPT}, "n": 256, "max_tokens": 1})
            sent += 1
        return sent

    try:
        floods = [asyncio.ensure_future(flood()) for _ in range(4)]
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        rollout = {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 4, "ignore_eos": True}
        try:
            answer = await asyncio.wait_for(engine.generate(rollout), 15)
        finally:
            took = time.monotonic() - t0
            stop.set()
            sent = await asyncio.wait_for(asyncio.gather(*floods), 60)
        assert len(answer["token_ids"][0]) == 4
        assert took < 3.0, (took, sent)
    finally:
        await engine.close()


@pytest.mark.anyio
async def test_a_few_probe_rows_a_batch_and_the_daemons_own_first(tiny_dir: Path) -> None:
    """Twenty probes queued: a batch takes at most PROBE_ROWS_PER_BATCH of them, after the
    daemon's own generation, and the rollouts queued behind them still ride in it."""
    engine = TorchEngine(model_dir=tiny_dir, max_model_len=MAX_MODEL_LEN, seed=0)
    await engine.start()
    try:

        def probe(own: bool = False) -> schema.GenerateParams:
            p = schema.GenerateParams(prompt_ids=PROMPT, max_tokens=1)
            return schema.with_lane(p, own=own)

        async with engine._compute:  # the model is busy: what arrives now queues
            first = schema.GenerateParams(prompt_ids=PROMPT, max_tokens=2, n=3)
            tasks = [asyncio.ensure_future(engine.generate(first))]
            for _ in range(10_000):  # until the scheduler took it as a batch (it waits for the model)
                if engine._last_rows == 3 and not engine._queue:
                    break
                await asyncio.sleep(0.001)
            tasks += [asyncio.ensure_future(engine.generate(probe())) for _ in range(20)]
            roll = schema.GenerateParams(prompt_ids=PROMPT, max_tokens=3, n=2)
            tasks.append(asyncio.ensure_future(engine.generate(roll)))
            tasks.append(asyncio.ensure_future(engine.generate(probe(own=True))))
            for _ in range(10_000):
                await asyncio.sleep(0.001)
                if len(engine._queue) == 22:
                    break
            jobs = engine._take_batch()
            lanes = [j.params.lane for j in jobs]
            assert lanes[0] == "own"
            assert lanes.count("probe") == schema.PROBE_ROWS_PER_BATCH
            assert "rollout" in lanes
            engine._queue = [*jobs, *engine._queue]  # back in the queue, to be answered
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
    finally:
        await engine.close()


# ---------------------------------------------------------------------------- bodies in flight


async def _stall_chunked(port: int, path: str, nbytes: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n".encode()
    )
    chunk = 16 << 10
    for start in range(0, nbytes, chunk):
        size = min(chunk, nbytes - start)
        writer.write(b"%x\r\n%s\r\n" % (size, b" " * size))
    await writer.drain()
    return reader, writer


async def _until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_held_uploads_are_bounded_on_the_inference_port(tiny_dir: Path) -> None:
    """Held chunked uploads count as they arrive: past the bound of bytes in flight one more is
    refused (503), and their room comes back when they go; a declared body that does not arrive
    within the deadline is a 408; declared lengths alone hold nothing."""
    from atroposd.httpbounds import Inflight

    async def run() -> None:
        async with (
            serving(tiny_dir, inflight=Inflight(300 << 10), body_timeout=1.0) as (front, url, port),
            aiohttp.ClientSession() as s,
        ):
            held = [await _stall_chunked(port, "/v1/completions", 120 << 10) for _ in range(2)]
            await _until(lambda: front.inflight.bytes >= 240 << 10)
            r3, w3 = await _stall_chunked(port, "/generate", 120 << 10)
            head = await asyncio.wait_for(r3.readuntil(b"\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 503"), head
            w3.close()
            assert front.metrics.refused.labels("inflight")._value.get() == 1
            for _, w in held:
                w.close()
            await _until(lambda: front.inflight.bytes == 0)
            # a declared body that never comes: 408 at the deadline, nothing charged meanwhile
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000000\r\n\r\n"
            )
            await writer.drain()
            await asyncio.sleep(0.2)
            assert front.inflight.bytes == 0
            head = await asyncio.wait_for(reader.readuntil(b"\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 408"), head
            writer.close()
            status, answer = await _post(
                s, url + "/generate", {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 2}
            )
            assert status == 200, answer

    asyncio.run(run())


def test_connections_past_the_cap_get_503_on_the_inference_port(tiny_dir: Path) -> None:
    async def run() -> None:
        async with serving(tiny_dir, max_connections=3) as (front, _, port):
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 5)
            assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer, answer
            writer.close()
            assert front.metrics.refused.labels("connections")._value.get() == 1
            for _, w in idle:
                w.close()

    asyncio.run(run())


def test_a_departed_clients_queued_work_is_dropped(tiny_dir: Path) -> None:
    """A client that goes away while its generation waits takes it with it: the engine never
    runs it."""

    async def run() -> None:
        async with serving(tiny_dir) as (front, url, _), aiohttp.ClientSession() as s:
            engine = front.engine
            before = engine.batched_rows
            async with engine._compute:  # the model is busy: the request queues
                body = {"prompt": {"prompt_token_ids": PROMPT}, "n": 64, "max_tokens": 50, "ignore_eos": True}
                client = asyncio.ensure_future(_post(s, url + "/generate", body, timeout=60))
                # it reached the engine (queued, or taken into the batch that waits for the model)
                await _until(lambda: bool(engine._queue) or engine._last_rows == 64, timeout=30)
                client.cancel()  # the client goes away: its connection closes
                with contextlib.suppress(asyncio.CancelledError):
                    await client
                await _until(lambda: front.metrics.inflight._value.get() == 0, timeout=30)  # its handler ended
            # a request sent after it is answered after it would have been
            status, _ = await _post(s, url + "/generate", {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 1})
            assert status == 200
            # a probe is answered after its batch's first step; the batch is counted when it ends
            await _until(lambda: engine.batched_rows > before, timeout=30)
            assert engine.batched_rows == before + 1, "the departed client's rows were decoded"

    asyncio.run(run())


def test_a_wildcard_inference_host_without_a_token_warns(tmp_path: Path) -> None:
    """As the API's: a host others can reach with no inference token is a warning at config
    check; a token file, or several machines (a token derived from the cluster token), silence it."""
    from atroposd.config import parse_toml

    warning = "inference.host = '0.0.0.0' is not loopback and inference.token_file is empty"
    assert any(warning in w for w in parse_toml('[inference]\nhost = "0.0.0.0"\n').warnings)
    assert not [w for w in parse_toml('[inference]\nhost = "127.0.0.1"\n').warnings if "inference.host" in w]
    token = tmp_path / "token"
    token.write_text("an-inference-token-of-this-job\n")
    token.chmod(0o600)
    cfg = parse_toml(f'[inference]\nhost = "0.0.0.0"\ntoken_file = "{token}"\n')
    assert not [w for w in cfg.warnings if "inference.host" in w]

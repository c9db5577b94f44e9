"""Fuzz the inference server's TCP port as the API's is fuzzed (SPEC §13): every route and every
request shape it serves — vLLM's and SGLang's ``/generate``, TRL's ``/generate/``, the OpenAI
completions and chat routes, the GET routes, unknown paths and methods — with valid, malformed
and extreme bodies (wrong types, extreme numbers, long texts, many prompts, deep nesting, bad
JSON, gzip, chunked and truncated uploads), drawn from the run's fuzz seed (printed;
``--fuzz-seed N`` replays a run).

One real `atroposd inference` (torch engine, builtin:tiny) serves every case. Every answer is
2xx or 4xx — never a 5xx; ``/health`` answers within 1 s throughout (polled from a thread); the
server's resident memory stays bounded; it serves an ordinary request at the end."""

from __future__ import annotations

import gzip
import http.client
import json
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import fuzzseed
from tests.inference.conftest import MAX_MODEL_LEN, Server, start_server
from tests.support import stop_process

pytestmark = pytest.mark.slow

CASES = 500
RSS_GROWTH_LIMIT = 256 << 20
BOS = 1
EXTREME_INTS = [0, -1, 1, 2, 255, 256, 257, 2**31, -(2**31) - 1, 2**53 + 1, 2**63 - 1, 2**64, 10**30]
EXTREME_FLOATS = [0.0, -0.0, 0.5, 1.0000001, -1e-300, 1e308, -1e308, 5e-324, float("nan"), float("inf")]
JUNK: list[Any] = [None, True, False, "", "x", "NaN", [], {}, [[]], [None], {"a": 1}, 1.5, -7]
EXTREMES: list[Any] = EXTREME_INTS + EXTREME_FLOATS + JUNK
SAMPLING = ["n", "max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "stop", "ignore_eos"]


class Health:
    """``GET /health`` from a thread every 50 ms; the slowest answer and any failure."""

    def __init__(self, url: str) -> None:
        self.host, self.port = url.removeprefix("http://").split(":")
        self.worst = 0.0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            conn = http.client.HTTPConnection(self.host, int(self.port), timeout=10)
            try:
                conn.request("GET", "/health")
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    self.failures.append(f"/health answered {resp.status}")
            except OSError as exc:
                self.failures.append(repr(exc))
            finally:
                conn.close()
            self.worst = max(self.worst, time.monotonic() - t0)
            self._stop.wait(0.05)

    def __enter__(self) -> Health:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(30)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    return 0


# ---------------------------------------------------------------------------- what is sent


def _ids(r: random.Random) -> Any:
    pick = r.random()
    if pick < 0.7:
        return [BOS, *(r.randrange(3, 20) for _ in range(r.randint(0, 12)))]
    if pick < 0.8:
        return [r.choice(EXTREMES) for _ in range(r.randint(0, 4))]
    if pick < 0.9:
        return [5] * r.choice((MAX_MODEL_LEN - 1, MAX_MODEL_LEN, 100_000))
    return r.choice(EXTREMES)


def _text(r: random.Random) -> Any:
    pick = r.random()
    if pick < 0.6:
        return "".join(r.choice("0123456789+-*= ") for _ in range(r.randint(1, 20)))
    if pick < 0.75:
        return "1+3=" * r.choice((1000, 1025, 50_000))  # past max_model_len × 16 bytes
    if pick < 0.85:
        return "".join(chr(r.randrange(0x20, 0x2FFFF)) for _ in range(r.randint(1, 50)))
    return r.choice(EXTREMES)


def _sampling(r: random.Random, body: dict[str, Any], keys: list[str] | None = None) -> dict[str, Any]:
    for key in keys or SAMPLING:
        pick = r.random()
        if pick < 0.5:
            continue
        if pick < 0.85:
            sane: dict[str, Any] = {
                "n": r.randint(1, 3),
                "max_tokens": r.randint(1, 4),
                "max_new_tokens": r.randint(1, 4),
                "temperature": r.choice((0.0, 0.7, 1.0)),
                "top_p": r.choice((0.5, 1.0)),
                "top_k": r.choice((0, 5)),
                "seed": r.randint(0, 99),
                "logprobs": r.choice((0, 1, 2)),
                "stop": r.choice(("+", ["=", "-"])),
                "ignore_eos": r.random() < 0.5,
            }
            body[key] = sane.get(key, 1)
        else:
            body[key] = r.choice(EXTREMES)
    if r.random() < 0.05:  # many samples of more tokens than fit: refused before anything generates
        body["n"], body["max_tokens" if "max_tokens" in body or r.random() < 0.5 else "max_new_tokens"] = 256, 4093
    return body


def _vllm(r: random.Random) -> dict[str, Any]:
    body = _sampling(r, {"prompt": {"prompt_token_ids": _ids(r)}})
    if r.random() < 0.2:
        body["prompt_logprobs"] = r.choice((0, 1, 20, 21, -1, None, "x"))
    return body


def _sglang(r: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {"input_ids": _ids(r)} if r.random() < 0.5 else {"text": _text(r)}
    body["sampling_params"] = _sampling(r, {}, ["n", "max_new_tokens", "temperature", "stop", "ignore_eos"])
    if isinstance(body["sampling_params"], dict) and r.random() < 0.9:
        body["sampling_params"].setdefault("max_new_tokens", r.randint(1, 4))  # else SGLang's 128
    for key, values in (
        ("return_logprob", (True, False, "yes")),
        ("top_logprobs_num", (0, 2, 21, -1)),
        ("logprob_start_len", (-1, 0, 2, 10_000)),
        ("return_text_in_logprobs", (True, False)),
        ("rid", ("r1", "r" * 256, "r" * 257, "r" * 100_000, 7)),
    ):
        if r.random() < 0.3:
            body[key] = r.choice(values)
    return body


def _trl(r: random.Random) -> dict[str, Any]:
    count = r.choice((1, 1, 2, 5, 256, 257, 2000))
    prompts: Any = [_text(r) if r.random() < 0.2 else "1+3=" for _ in range(count)]
    if r.random() < 0.1:
        prompts = r.choice(EXTREMES)
    body = _sampling(r, {"prompts": prompts}, ["n", "max_tokens", "temperature", "top_p", "top_k"])
    if count == 256:  # as many as may come: kept cheap to serve
        body.update(n=1, max_tokens=1)
    return body


def _completions(r: random.Random) -> dict[str, Any]:
    pick = r.random()
    if pick < 0.4:
        prompt: Any = _text(r)
    elif pick < 0.6:
        prompt = _ids(r)
    elif pick < 0.8:
        prompt = [r.choice(("1+3=", [BOS, 5, 14])) for _ in range(r.choice((1, 3, 256, 257, 5000)))]
    else:
        prompt = r.choice(EXTREMES)
    body = _sampling(r, {"model": "tiny", "prompt": prompt})
    if isinstance(prompt, list) and len(prompt) == 256:  # as many as may come: kept cheap to serve
        body.update(n=1, max_tokens=1)
    for key, values in (("echo", (True, False)), ("stream", (True, False)), ("return_token_ids", (True, "x"))):
        if r.random() < 0.1:
            body[key] = r.choice(values)
    return body


def _chat(r: random.Random) -> dict[str, Any]:
    messages: Any = [
        {"role": r.choice(("user", "assistant", "system", "tool", "x")), "content": _text(r)}
        for _ in range(r.randint(1, 3))
    ]
    if r.random() < 0.1:
        messages = r.choice(EXTREMES)
    body = _sampling(r, {"model": "tiny", "messages": messages})
    if r.random() < 0.9:
        body.setdefault("max_tokens", r.randint(1, 4))  # else as many as fit
    if r.random() < 0.3:
        fn: dict[str, Any] = {"name": r.choice(("get_weather", "", 7)), "parameters": r.choice(({}, [], None))}
        body["tools"] = [{"type": "function", "function": fn}] * r.choice((1, 2))
        body["tool_choice"] = r.choice(("auto", "none", "required", {"type": "function"}, 3))
    if r.random() < 0.2:
        body["top_logprobs"] = r.choice((0, 2, -1, "x"))
        body["logprobs"] = r.choice((True, False))
    return body


def _nested(depth: int) -> Any:
    out: Any = 1
    for _ in range(depth):
        out = {"a": out}
    return out


ROUTES: list[tuple[str, Callable[[random.Random], dict[str, Any]]]] = [
    ("/generate", _vllm),
    ("/generate", _sglang),
    ("/generate/", _trl),
    ("/v1/completions", _completions),
    ("/v1/chat/completions", _chat),
]


def _case(r: random.Random) -> tuple[str, str, bytes, dict[str, str], str]:
    """(method, path, body, headers, what) of one request."""
    headers = {"Content-Type": "application/json"}
    pick = r.random()
    if pick < 0.08:
        path = r.choice(("/health", "/info", "/v1/models", "/metrics", "/nope", "/generate", "/pause", "/v1"))
        return "GET", path, b"", headers, f"get {path}"
    path, make = r.choice(ROUTES)
    body: Any = make(r)
    what = f"{path} {make.__name__}"
    pick = r.random()
    if pick < 0.05:
        body = r.choice(EXTREMES)  # not an object
        what += " not-object"
    elif pick < 0.08:
        body[r.choice(("extra", "prompt", "messages", "sampling_params"))] = _nested(r.choice((10, 200, 5000)))
        what += " nested"
    elif pick < 0.1:
        body["unknown_field"] = 1
        what += " unknown"
    try:
        raw = json.dumps(body, allow_nan=True).encode()
    except (ValueError, RecursionError):
        raw = b"{"
    pick = r.random()
    if pick < 0.04:
        raw = raw[: r.randrange(len(raw))] if raw else b"{"
        what += " truncated-json"
    elif pick < 0.06:
        raw = gzip.compress(raw)
        headers["Content-Encoding"] = "gzip"
        what += " gzip"
    elif pick < 0.08:
        headers["Content-Type"] = "text/plain"
        what += " text/plain"
    method = "POST" if r.random() > 0.02 else r.choice(("PUT", "DELETE", "PATCH"))
    return method, path, raw, headers, what


def _send(url: str, method: str, path: str, raw: bytes, headers: dict[str, str]) -> int:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=raw or None, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def _raw_socket_cases(url: str, r: random.Random) -> Counter[str]:
    """Uploads that stop halfway, lie about their length or are chunked: the server answers or
    drops them, never a 5xx, never a crash."""
    host, port = url.removeprefix("http://").split(":")
    seen: Counter[str] = Counter()
    for _ in range(20):
        kind = r.choice(("short", "chunked-bad", "chunked", "huge-declared"))
        s = socket.create_connection((host, int(port)), timeout=5)
        try:
            head = f"POST {r.choice(('/generate', '/v1/completions'))} HTTP/1.1\r\nHost: x\r\n"
            if kind == "short":
                s.sendall(head.encode() + b'Content-Length: 100\r\n\r\n{"prompt":')
                s.shutdown(socket.SHUT_WR)
            elif kind == "huge-declared":
                s.sendall(head.encode() + b"Content-Length: 999999999999\r\n\r\n")
            elif kind == "chunked-bad":
                s.sendall(head.encode() + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nxx\r\n")
            else:
                body = json.dumps({"prompt": {"prompt_token_ids": [BOS, 5]}, "max_tokens": 1}).encode()
                s.sendall(
                    head.encode() + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
                )
            answer = b""
            try:
                while len(answer) < 64:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    answer += chunk
            except OSError:
                pass
            status = answer[9:12].decode(errors="replace") if answer.startswith(b"HTTP/1.1 ") else "none"
            assert not status.startswith("5"), (kind, answer[:300])
            seen[f"{kind} {status}"] += 1
        finally:
            s.close()
    return seen


@pytest.fixture(scope="module")
def fuzz_server(server_root: Path, tiny_dir: Path) -> Iterator[Server]:
    srv = start_server(server_root, tiny_dir)
    try:
        yield srv
    finally:
        stop_process(srv.proc)


def test_the_inference_port_under_fuzz(fuzz_server: Server) -> None:
    print(fuzzseed.replay_hint())
    r = fuzzseed.rng("inference-port")
    url = fuzz_server.url
    _send(
        url, "POST", "/generate", json.dumps({"prompt": {"prompt_token_ids": [BOS, 5]}, "max_tokens": 2}).encode(), {}
    )
    before = _rss(fuzz_server.proc.pid)
    statuses: Counter[int] = Counter()
    by_case: Counter[str] = Counter()
    with Health(url) as health:
        for i in range(CASES):
            method, path, raw, headers, what = _case(r)
            try:
                status = _send(url, method, path, raw, headers)
            except OSError as exc:
                raise AssertionError(f"case {i} ({what}): {exc!r}; {fuzzseed.replay_hint()}: {raw[:300]!r}") from None
            statuses[status] += 1
            by_case[f"{what} {status}"] += 1
            assert status < 500, f"case {i} ({what}) answered {status}: {raw[:300]!r}; {fuzzseed.replay_hint()}"
        raw_cases = _raw_socket_cases(url, r)
    grown = _rss(fuzz_server.proc.pid) - before
    print(f"statuses {dict(statuses)}; raw uploads {dict(raw_cases)}")
    print(f"RSS +{grown >> 20} MiB; /health at worst {health.worst:.3f} s")
    print(f"{len(by_case)} kinds of case; {fuzzseed.replay_hint()}")
    assert not health.failures, health.failures[:5]
    assert health.worst < 1.0, health.worst
    assert grown < RSS_GROWTH_LIMIT, grown
    assert statuses[200] > CASES // 20, statuses  # the valid ones were served
    assert fuzz_server.proc.poll() is None, fuzz_server.tail()
    ok = {"prompt": {"prompt_token_ids": [BOS, 5, 14, 7, 17]}, "max_tokens": 3}
    assert _send(url, "POST", "/generate", json.dumps(ok).encode(), {"Content-Type": "application/json"}) == 200

"""Bad input never ends a job (SPEC §13), the API's part: bounded registrations, groups and
bodies, media type and Host checks, the token's sources, and run-api's message shape."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from atroposd.api import peers
from atroposd.api import server as server_module
from atroposd.api.batching import find_groups_summing_to_target
from atroposd.api.bodies import groups_from_body
from atroposd.api.fastparse import parse_groups
from atroposd.api.queue import QueueFull, TrajectoryStore
from atroposd.api.schema import (
    MAX_ENVS,
    MAX_PASSTHROUGH_DEPTH,
    InvalidRequest,
    TrainerRegistration,
    group_from_json,
)
from atroposd.api.server import ApiServer, ApiSettings
from atroposd.config import ApiConfig
from tests.api.conftest import Api, Server, group, start_atroposd
from tests.support import atroposd, free_port, stop_process, wait_for, write_config


def _nested(depth: int) -> Any:
    v: Any = "x"
    for _ in range(depth):
        v = [v]
    return v


def _on_both_paths(body: Any, *, may_decline: bool = False) -> tuple[str, str]:
    """(fast path outcome, full path outcome) for one /scored_data body: 'accepted' or the status."""
    raw = json.dumps(body).encode()  # orjson writes at most 254 levels
    out = []
    for fast in (True, False):
        try:
            if fast:
                got = parse_groups(raw, listed=False, max_token_len=None)
                if got is None and may_decline:  # not its shape: the full path decides alone
                    out.append("declined")
                    continue
                assert got is not None, "the body should be in the fast path's plain shape"
            else:
                group_from_json(json.loads(raw))
            out.append("accepted")
        except InvalidRequest as exc:
            out.append(str(exc.status))
    return out[0], out[1]


# ----------------------------------------------------------------------------- groups


def test_passthrough_depth_is_bounded_on_both_parse_paths() -> None:
    ok = group(2, generation_params={"a": _nested(MAX_PASSTHROUGH_DEPTH - 1)})
    assert _on_both_paths(ok) == ("accepted", "accepted")
    for deep in (MAX_PASSTHROUGH_DEPTH + 1, 300):  # 300: beyond what orjson writes back (254)
        assert _on_both_paths(group(2, generation_params={"a": _nested(deep)})) == ("422", "422")
    # brackets inside strings do not count; an escaped quote takes the decoding path
    text = group(2, generation_params={"s": "[" * 500 + '\\"' + "{" * 100})
    assert _on_both_paths(text) == ("accepted", "accepted")


def test_integers_beyond_64_bits_are_refused_on_both_paths() -> None:
    """Found by the fuzz suite: an env_id or a passthrough integer beyond 64 bits was accepted
    and then failed to encode (500)."""
    for body in (group(2, env_id=2**64), group(2, env_id=-(2**63) - 1), group(2, generation_params=2**64)):
        fast, full = _on_both_paths(body, may_decline=True)
        assert fast in ("declined", "422") and full == "422", body


def test_empty_group_is_refused_on_both_paths() -> None:
    assert _on_both_paths({"tokens": [], "masks": [], "scores": []}) == ("422", "422")


@pytest.mark.parametrize(
    "messages",
    [
        [[{"role": "user"}]],
        [[{"content": "hi"}]],
        [[{"role": "user", "content": "a"}, {}]],
        [["text"]],
        ["text"],
        [{"role": "user", "content": "a"}],
    ],
)
def test_messages_need_role_and_content_on_both_paths(messages: Any) -> None:
    """run-api's ScoredData validator: a 422 whichever path parses the body."""
    assert _on_both_paths(group(2, messages=messages)) == ("422", "422")


def test_messages_with_role_and_content_pass() -> None:
    msgs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "text"}], "reward": 1}]] * 2
    assert _on_both_paths(group(2, messages=msgs)) == ("accepted", "accepted")


def test_groups_count_their_bytes_against_the_budget() -> None:
    """Passthrough fields count: a group larger than the byte budget is refused (413), and one
    that does not fit now waits and is refused when no room comes (503)."""
    big = group_from_json(group(2, messages=[[{"role": "u", "content": "x" * 6000}]] * 2))
    small = group_from_json(group(2))
    store = TrajectoryStore(1000, capacity_bytes=big.nbytes + small.nbytes)

    async def run() -> None:
        with pytest.raises(QueueFull) as too_large:
            await store.reserve(2, 0.01, 2 * big.nbytes + small.nbytes)
        assert too_large.value.too_large
        await store.reserve(big.n, 0.01, big.nbytes)
        store.submit([big])
        assert store.held_bytes == big.nbytes
        with pytest.raises(QueueFull) as full:
            await store.reserve(big.n, 0.01, big.nbytes)
        assert not full.value.too_large
        await store.reserve(small.n, 0.01, small.nbytes)  # fits by bytes and sequences
        store.submit([small])
        assert store.held == 4 and store.status()["queued_bytes"] == big.nbytes + small.nbytes

    asyncio.run(run())


def test_waiting_submissions_are_capped() -> None:
    store = TrajectoryStore(4, max_waiting=2)

    async def run() -> None:
        await store.reserve(4, 0.01)
        waiters = [asyncio.ensure_future(store.reserve(1, 10)) for _ in range(2)]
        await asyncio.sleep(0)
        assert store.waiting == 2
        t0 = time.monotonic()
        with pytest.raises(QueueFull) as exc:
            await store.reserve(1, 10)
        assert exc.value.reason == "waiting" and time.monotonic() - t0 < 1
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert store.waiting == 0

    asyncio.run(run())


# ----------------------------------------------------------------------------- registrations


def _started_store(capacity: int = 64) -> TrajectoryStore:
    store = TrajectoryStore(capacity)
    store.register(TrainerRegistration("g", "p", 8, 64, "c", 5, 0, 10))
    store.started_by_batch()
    return store


BAD_REGISTRATIONS = [
    {"min_batch_allocation": 1e308},
    {"min_batch_allocation": -0.1},
    {"min_batch_allocation": 1.5},
    {"weight": -1.0},
    {"weight": 1e400},
    {"group_size": 0},
    {"group_size": 65},
    {"group_size": 10**12},
    {"max_token_length": 0},
    {"desired_name": "n" * 257},
    {"max_token_length": 2**64},
]


@pytest.mark.parametrize("change", BAD_REGISTRATIONS)
def test_registration_fields_are_bounded(atroposd_server: Server, change: dict[str, Any]) -> None:
    api = Api(atroposd_server.url)
    api.get("/reset_data")
    api.start(batch_size=8)
    body = {"max_token_length": 64, "desired_name": "e", "weight": 1.0, "group_size": 4, **change}
    raw = json.dumps(body).replace("Infinity", "1e400").encode()
    r = api.post("/register-env", raw=raw)
    if change.get("group_size") == 65:  # bounded by max_queued_sequences (4096 on this server)
        assert r.status == 200
        return
    assert r.status in ((400, 422) if "1e400" in raw.decode() else (422,)), (r.status, r.body)
    assert api.ok("GET", "/atroposd/registrations")["envs"] == []


def test_group_size_is_bounded_by_the_queue_cap() -> None:
    store = _started_store(capacity=64)
    req = {"max_token_length": 64, "desired_name": "e", "weight": 1.0, "group_size": 65, "min_batch_allocation": None}
    with pytest.raises(InvalidRequest, match="max_queued_sequences"):
        store.register_env(req)


def test_registrations_are_counted() -> None:
    store = _started_store()
    req = {"max_token_length": 64, "desired_name": "e", "weight": 1.0, "group_size": 4, "min_batch_allocation": None}
    for _ in range(MAX_ENVS):
        assert store.register_env(req)["status"] == "success"
    with pytest.raises(InvalidRequest, match="at most"):
        store.register_env(req)


def test_packing_search_cost_is_bounded() -> None:
    """A huge group size makes the subset-sum search work on bitsets, not on
    (buffered + 1) × (group_size + 1) cells."""
    sizes = [7] * 100 + [3]  # before: 101 × 1,000,001 cells (about 800 MB of list)
    t0 = time.monotonic()
    assert find_groups_summing_to_target(sizes, 1_000_000) == []
    assert find_groups_summing_to_target([5, 7, 3, 9], 19) == [1, 2, 3]
    assert time.monotonic() - t0 < 2.0


# ----------------------------------------------------------------------------- HTTP


def _raw_request(port: int, head: bytes, body: bytes = b"", *, keep_open: float = 0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + body)
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks):
                break
        return b"".join(chunks)


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def _post(port: int, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_content_type_must_be_json(atroposd_server: Server) -> None:
    api = Api(atroposd_server.url)
    api.get("/reset_data")
    api.start(batch_size=8)
    body = json.dumps(group(4)).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        status, _ = _post(atroposd_server.port, "/scored_data", body, {"Content-Type": ctype})
        assert status == 415, ctype
    assert api.ok("GET", "/status")["queued_sequences"] == 0
    for ctype in ("application/json", "application/json; charset=utf-8", "application/vnd.x+json"):
        status, _ = _post(atroposd_server.port, "/scored_data", body, {"Content-Type": ctype})
        assert status == 200, ctype
    # no Content-Type at all: parsed as JSON, as run-api does
    head = (
        f"POST /scored_data HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    assert _status(_raw_request(atroposd_server.port, head, body)) == 200


def test_host_header_is_checked_on_a_loopback_bind(atroposd_server: Server) -> None:
    port = atroposd_server.port
    for host in ("evil.example", "evil.example:80", "10.0.0.1", "[2001:db8::1]:8000"):
        head = f"GET /reset_data HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
        assert _status(_raw_request(port, head)) == 421, host
    for host in (
        "localhost",
        f"localhost:{port}",
        "127.0.0.1",
        f"127.1.2.3:{port}",
        f"[::1]:{port}",
        socket.gethostname(),
    ):
        head = f"GET /info HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
        assert _status(_raw_request(port, head)) == 200, host
    head = b"GET /info HTTP/1.0\r\n\r\n"  # HTTP/1.0 without a Host header
    assert _status(_raw_request(port, head)) == 200


def test_requests_a_web_page_makes_are_refused(atroposd_server: Server) -> None:
    """A page's image or link to /reset_data carries our own Host: the browser's Fetch Metadata
    and Origin headers tell it apart from an API client."""
    port = atroposd_server.port
    for extra in (
        "Sec-Fetch-Site: cross-site",
        "Sec-Fetch-Site: same-site",
        "Origin: http://evil.example",
        "Origin: null",
    ):
        head = (f"GET /reset_data HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{extra}\r\nConnection: close\r\n\r\n").encode()
        assert _status(_raw_request(port, head)) == 403, extra
    for extra in ("Sec-Fetch-Site: same-origin", "Sec-Fetch-Site: none", f"Origin: http://127.0.0.1:{port}"):
        head = (f"GET /info HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{extra}\r\nConnection: close\r\n\r\n").encode()
        assert _status(_raw_request(port, head)) == 200, extra


def test_status_env_takes_env_id_from_the_query(atroposd_server: Server) -> None:
    api = Api(atroposd_server.url)
    api.get("/reset_data")
    api.start(batch_size=8)
    env = api.register_env(group_size=4)["env_id"]
    for body in (None, {}):
        r = api.get(f"/status-env?env_id={env}", body)
        assert r.status == 200 and r.json()["self_queue_size"] == 0, r
    assert api.get("/status-env?env_id=7").status == 404


def test_a_waiting_submission_that_disconnects_gives_its_place_back(tmp_path: Path) -> None:
    server = start_atroposd(tmp_path, "--max-queued-sequences", "4", "--full-wait", "60")
    try:
        api = server.api
        api.start(batch_size=8)
        assert api.ok("POST", "/scored_data", group(4, tag=1.0)) == {"status": "received"}
        body = json.dumps(group(4, tag=2.0)).encode()
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(
            f"POST /scored_data HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(lambda: api.ok("GET", "/status")["waiting_submissions"] == 1, what="a waiting submission")
        s.close()
        wait_for(
            lambda: api.ok("GET", "/status")["waiting_submissions"] == 0,
            timeout=10,
            what="the disconnected submission to leave the wait",
        )
        assert api.ok("GET", "/status")["queued_sequences"] == 4
    finally:
        stop_process(server.proc)


def test_a_body_that_does_not_arrive_gets_408(tmp_path: Path) -> None:
    server = start_atroposd(tmp_path, "--body-timeout", "0.5")
    try:
        head = (
            b"POST /scored_data HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n"
        )
        t0 = time.monotonic()
        reply = _raw_request(server.port, head, b'{"tokens": ')
        assert _status(reply) == 408 and time.monotonic() - t0 < 10
        assert server.api.ok("GET", "/info")  # still serving
    finally:
        stop_process(server.proc)


def test_non_ascii_authorization_is_a_401(tmp_path: Path) -> None:
    server = start_atroposd(tmp_path, "--token", "s3cret")
    try:
        for value in (b"Bearer \xc3\xa9t\xc3\xa9", b"Bearer \xff\xfe", "Bearer s3cret\u00e9".encode()):
            head = (
                b"GET /info HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: " + value + b"\r\nConnection: close\r\n\r\n"
            )
            assert _status(_raw_request(server.port, head)) == 401, value
        assert server.api.ok("GET", "/info")
    finally:
        stop_process(server.proc)


def test_token_from_a_file_or_the_environment(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("token-from-a-file\n")
    token_file.chmod(0o600)
    cases: list[tuple[tuple[str, ...], dict[str, str], str]] = [
        (("--token-file", str(token_file)), {}, "token-from-a-file"),
        ((), {"ATROPOSD_API_TOKEN": "from-env"}, "from-env"),
    ]
    for args, env, token in cases:
        port = free_port()
        server = start_atroposd(tmp_path, *args, port=port, env={**os.environ, **env})
        try:
            assert Api(server.url).get("/info").status == 401
            assert Api(server.url, token).get("/info").status == 200
            assert token not in " ".join(server.proc.args)
        finally:
            stop_process(server.proc)


def test_token_file_from_the_config(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("cfg-token-of-the-api\n")
    port = free_port()
    cfg = write_config(
        tmp_path / "atroposd.toml",
        {
            "daemon": {"state_dir": str(tmp_path / "state"), "runtime_dir": str(tmp_path / "run")},
            "api": {"port": port, "token_file": str(token_file), "spool": False},
            "env": [],
        },
    )
    server = start_atroposd(tmp_path, "-c", str(cfg), port=port)
    try:
        assert Api(server.url).get("/info").status == 401
        assert Api(server.url, "cfg-token-of-the-api").get("/info").status == 200
    finally:
        stop_process(server.proc)
    token_file.write_text("")
    out = atroposd("api", "-c", str(cfg))
    assert out.returncode == 2 and "api.token_file" in out.stderr and "empty" in out.stderr


def test_an_api_host_off_loopback_without_a_token_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The API's token stays optional (unmodified atroposlib environments send none), so a host
    others can reach without one is a warning, not an error; a token, a token file or the
    systemd credential silences it (SPEC §12.3)."""
    from atroposd.config import parse_toml

    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    warning = "api.host = '0.0.0.0' is not loopback and api.token is empty"
    assert warning in parse_toml('[api]\nhost = "0.0.0.0"\n').warnings
    assert not [w for w in parse_toml('[api]\nhost = "127.0.0.1"\n').warnings if "api.host" in w]
    token_file = tmp_path / "token"
    token_file.write_text("a-token-of-the-api-of-this-job\n")
    token_file.chmod(0o600)
    for extra in ('token = "a-token-of-the-api-of-this-job"\n', f'token_file = "{token_file}"\n'):
        assert warning not in parse_toml('[api]\nhost = "0.0.0.0"\n' + extra).warnings, extra
    creds = tmp_path / "credentials"
    creds.mkdir()
    (creds / "atroposd-api.token").write_text("a-token-of-the-api-of-this-job\n")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    assert warning not in parse_toml('[api]\nhost = "0.0.0.0"\n').warnings


def test_spool_fsync_reaches_the_settings() -> None:
    assert ApiSettings.from_config(ApiConfig(spool_fsync=True), "/x").spool_fsync is True
    assert ApiSettings.from_config(ApiConfig(), "/x").spool_fsync is False


# ----------------------------------------------------------------------------- bodies in flight


def _settings(limit: int = 1 << 20) -> ApiSettings:
    return ApiSettings(
        host="127.0.0.1",
        port=0,
        token="",
        max_queued_sequences=64,
        max_request_bytes=limit,
        full_wait=0.1,
        spool_dir=None,
    )


def test_gzip_bodies_inflate_where_their_inflated_size_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small gzip body that inflates to more than the thread threshold is inflated on the
    inflater thread, not on the event loop (decided by ISIZE, not the compressed size)."""
    raw = gzip.compress(orjson.dumps(group(2, generation_params={"pad": "a" * (2 << 20)})))
    assert len(raw) < server_module.GUNZIP_THREAD_MIN_BYTES
    threads: list[str] = []
    real = server_module.gunzip

    def spy(data: bytes, limit: int) -> Any:
        threads.append(threading.current_thread().name)
        return real(data, limit)

    monkeypatch.setattr(server_module, "gunzip", spy)

    async def run() -> None:
        server = ApiServer(TrajectoryStore(64), _settings(8 << 20))
        try:
            body = await server._inflate(raw, True)
            assert len(groups_from_body(body, listed=False, max_token_len=None)) == 1
        finally:
            server._inflater.shutdown(wait=True)

    asyncio.run(run())
    assert threads and threads[0].startswith("api-inflate")


def test_bodies_in_flight_are_bounded_by_bytes() -> None:
    async def run() -> None:
        server = ApiServer(TrajectoryStore(64), _settings(1 << 20))
        try:
            server._charge(server.max_inflight_bytes - 10)
            with pytest.raises(QueueFull) as exc:
                server._charge(100)
            assert exc.value.reason == "inflight"
            server.inflight_bytes = 0
            server._charge(server.max_inflight_bytes * 2)  # one body alone always passes
        finally:
            server._inflater.shutdown(wait=True)

    asyncio.run(run())


# ----------------------------------------------------------------------------- peer lookup


def test_peer_lookup_finds_the_pid_within_its_budget() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    try:
        local = client.getsockname()
        assert peers.find_pid((local[0], local[1]), time.monotonic() + 10) == os.getpid()
        assert peers.find_pid((local[0], local[1]), time.monotonic() - 1) is None  # out of time
    finally:
        client.close()
        listener.close()


def test_only_one_peer_lookup_runs_at_a_time() -> None:
    async def run() -> None:
        server = ApiServer(TrajectoryStore(64), _settings())
        try:

            class Req:
                class transport:
                    @staticmethod
                    def get_extra_info(name: str) -> Any:
                        return ("127.0.0.1", 1)

            async with server.peers.lock:
                assert await server.peers.pid(Req()) is None  # type: ignore[arg-type]
            assert server.metrics.peer_lookups_skipped._value.get() == 1
        finally:
            server._inflater.shutdown(wait=True)

    asyncio.run(run())

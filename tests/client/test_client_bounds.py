"""The client does not take the server's word for sizes (a Content-Length, chunk sizes, a gzip
stream, a shared-memory segment, a JSON batch's layout: each capped by ``max_batch_bytes``
before anything is allocated), and warns once when its token goes in clear text to another
host."""

from __future__ import annotations

import contextlib
import gzip
import warnings
from pathlib import Path
from typing import Any

import orjson
import pytest

from atroposd.client import ApiError, BatchClient, InsecureTokenWarning
from atroposd.client._http import BodyTooLarge, HttpConnection
from atroposd.client.batches import default_max_batch_bytes
from tests.client.test_http import scripted


def _answer(body: bytes, *headers: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in headers)
    return f"HTTP/1.1 200 OK\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


REGISTERED = _answer(b'{"uuid": 1}', "Content-Type: application/json")


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000000\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffff\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n80000\r\n" + b"x" * (512 << 10) + b"\r\n90000\r\n",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b"x" * (2 << 20),
    ],
    ids=["content_length", "chunk_size", "chunks_add_up", "until_close"],
)
def test_announced_sizes_are_capped(answer: bytes) -> None:
    """A server announcing a terabyte gets an error, not a terabyte allocated (the client used
    to allocate whatever Content-Length said)."""
    with scripted([[answer]]) as (port, _):
        conn = HttpConnection("127.0.0.1", port, timeout=10, max_body=1 << 20)
        with pytest.raises(BodyTooLarge):
            conn.request("GET", "/batch")
        conn.close()


@pytest.mark.parametrize("where", ["headers", "trailers"])
def test_headers_and_trailers_are_capped(where: str) -> None:
    """Response headers (and a chunked body's trailers) past 64 KiB are an error, not read on."""
    endless = b"X-Pad: " + b"p" * (256 << 10)  # one header line that never ends
    if where == "headers":
        answer = b"HTTP/1.1 200 OK\r\n" + endless
    else:
        answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n" + endless
    with scripted([[answer]]) as (port, _):
        conn = HttpConnection("127.0.0.1", port, timeout=10, max_body=1 << 20)
        error = "response headers too large" if where == "headers" else "chunked trailers too large"
        with pytest.raises(ConnectionError, match=error):
            conn.request("GET", "/batch")
        conn.close()


def _client(port: int, **kw: Any) -> BatchClient:
    return BatchClient(
        f"http://127.0.0.1:{port}", token="", batch_size=4, max_token_len=64, max_batch_bytes=1 << 20, **kw
    )


def test_a_gzip_answer_inflates_no_further_than_the_cap() -> None:
    bomb = gzip.compress(b"\0" * (64 << 20))
    with scripted([[REGISTERED, _answer(bomb, "Content-Type: application/json", "Content-Encoding: gzip")]]) as (
        port,
        _,
    ):
        with _client(port, transport="json") as c, pytest.raises(ApiError, match="max_batch_bytes"):
            c.get_batch()


def test_a_json_batch_is_not_laid_out_past_the_cap() -> None:
    """1,000 one-token sequences and one of 5,000: padded, 100 MB of arrays from a 20 KB answer."""
    n = 1001
    tokens = [[1]] * (n - 1) + [[1] * 5000]
    batch = {"batch": [{"tokens": tokens, "masks": tokens, "scores": [0.0] * n}]}
    with scripted([[REGISTERED, _answer(orjson.dumps(batch), "Content-Type: application/json")]]) as (port, _):
        with _client(port, transport="json") as c, pytest.raises(ApiError, match="max_batch_bytes"):
            c.get_batch()


def test_a_shared_memory_batch_larger_than_the_cap_is_released() -> None:
    offer = {"shm": {"name": "atroposd-batch-1-x-y", "size": 1 << 44, "batch_id": "b1"}}
    released = _answer(b'{"acknowledged": false, "released": true}', "Content-Type: application/json")
    with scripted([[REGISTERED, _answer(orjson.dumps(offer), "Content-Type: application/json"), released]]) as (
        port,
        seen,
    ):
        with _client(port, transport="shm") as c, pytest.raises(ApiError, match="max_batch_bytes"):
            c.get_batch()
    assert seen[-1].startswith(b"POST /batch/ack"), "given back at once"


def test_default_cap_follows_the_registration() -> None:
    c = BatchClient("http://127.0.0.1:1", batch_size=64, max_token_len=1024)
    assert c.max_batch_bytes == default_max_batch_bytes(64, 1024)
    assert 64 * 1024 * 3072 < c.max_batch_bytes < 64 * 1024 * 3200 + (1 << 30)


def test_a_token_over_plain_http_to_another_host_warns_once() -> None:
    def attempts(url: str, token: str) -> list[warnings.WarningMessage]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c = BatchClient(url, token=token, batch_size=4, max_token_len=64, request_timeout=0.3)
            for _ in range(2):
                with pytest.raises(OSError):
                    c.get_batch()  # nothing listens there: unreachable, after the token was sent
        return [w for w in caught if issubclass(w.category, InsecureTokenWarning)]

    remote = attempts("http://192.0.2.1:9", "secret")  # TEST-NET-1: never this host
    assert len(remote) == 1 and "192.0.2.1" in str(remote[0].message)
    assert attempts("http://127.0.0.1:9", "secret") == []
    assert attempts("http://192.0.2.1:9", "") == []


@pytest.mark.parametrize("framing", ["content_length", "chunked", "until_close"])
def test_an_inference_control_answer_is_read_up_to_its_cap(framing: str, short_tmp: Path) -> None:
    """The inference server's control socket answers small JSON documents: one larger than
    MAX_ANSWER_BYTES, whatever its framing, is a WeightsError, not read whole into memory."""
    import socket
    import threading

    from atroposd.client.weights import MAX_ANSWER_BYTES, InferenceControl, WeightsError

    body = b'{"weight_version": 1, "pad": "' + b"x" * (MAX_ANSWER_BYTES + (1 << 20)) + b'"}'
    if framing == "content_length":
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    elif framing == "chunked":
        answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
    else:
        answer = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body
    path = short_tmp / "inference-1.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(2)
    srv.settimeout(10)

    def serve() -> None:
        for reply in (answer, b'HTTP/1.1 200 OK\r\nContent-Length: 22\r\n\r\n{"weight_version": 3}\n'):
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                buf = b""
                while b"\r\n\r\n" not in buf:
                    buf += conn.recv(4096)
                with contextlib.suppress(OSError):  # the client stops reading at its cap
                    conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        control = InferenceControl(path, short_tmp / "sync", timeout=10)
        with pytest.raises(WeightsError, match=f"more than {MAX_ANSWER_BYTES} bytes"):
            control.weight_version()
        assert control.weight_version() == 3, "an answer within the cap is read"
    finally:
        thread.join(10)
        srv.close()


def test_a_segment_is_mapped_only_when_private_and_as_large_as_announced() -> None:
    """The client maps a batch segment only when it is this user's, mode 0600 and at least as
    large as the API said; another user's mode or a short segment is refused before mapping."""
    import os
    import secrets

    from atroposd.client.batches import _map_segment

    name = f"atroposd-batch-test-{secrets.token_hex(8)}"
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 4096)
        m = _map_segment(name, 4096)
        m.close()
        with pytest.raises(ValueError, match="expected at least 8192"):
            _map_segment(name, 8192)
        os.fchmod(fd, 0o644)
        with pytest.raises(PermissionError, match="expected 0600"):
            _map_segment(name, 4096)
        with pytest.raises(ValueError, match="not an atroposd segment name"):
            _map_segment("../" + name, 4096)
    finally:
        os.close(fd)
        os.unlink(path)

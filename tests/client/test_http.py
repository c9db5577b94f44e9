"""The client's small HTTP/1.1 connection against a scripted server: Content-Length, chunked and
close-delimited bodies, interim answers, and a kept-alive connection the server closed."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from atroposd.client._http import HttpConnection


@contextmanager
def scripted(connections: list[list[bytes]]) -> Iterator[tuple[int, list[bytes]]]:
    """A server that plays, for each connection it accepts in turn, its list of answers (one per
    request read; b"" closes the connection instead). Yields (port, requests received)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(10)
    seen: list[bytes] = []

    def serve() -> None:
        for answers in connections:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                for answer in answers:
                    buf = b""
                    while b"\r\n\r\n" not in buf:
                        data = conn.recv(4096)
                        if not data:
                            return
                        buf += data
                    seen.append(buf)
                    if not answer:
                        break
                    conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield srv.getsockname()[1], seen
    finally:
        srv.close()
        thread.join(10)


def test_bodies_of_every_kind_on_one_connection() -> None:
    answers = [
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\nX-Trailer: 1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end",
    ]
    with scripted([answers]) as (port, seen):
        c = HttpConnection("127.0.0.1", port, timeout=10)
        r = c.request("GET", "/a", {"X-Test": "1"})
        assert (r.status, r.headers["content-type"], bytes(r.body)) == (200, "application/json", b"{}")
        r = c.request("POST", "/b", None, b"payload")
        assert (r.status, bytes(r.body)) == (201, b"abcde")
        r = c.request("GET", "/c")
        assert bytes(r.body) == b"until the end"
        c.close()
    assert seen[0].startswith(b"GET /a HTTP/1.1\r\nHost: 127.0.0.1:") and b"X-Test: 1" in seen[0]
    assert b"Content-Length: 7" in seen[1]


def test_a_closed_keepalive_connection_is_replaced_once() -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n"
    with scripted([[ok + b"1", b""], [ok + b"2"]]) as (port, seen):
        c = HttpConnection("127.0.0.1", port, timeout=10)
        assert bytes(c.request("GET", "/x").body) == b"1"
        assert bytes(c.request("GET", "/y").body) == b"2", "sent again on a new connection"
        c.close()
    assert [s.split(b" ")[1] for s in seen] == [b"/x", b"/y", b"/y"]

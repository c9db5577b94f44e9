"""A batch counts as delivered only once its response was fully written (SPEC §5): a trainer that
goes away in the middle of a response gets the same batch on its next /batch; nothing is lost or
served twice."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import pytest

from tests.api.conftest import group, start_atroposd
from tests.support import stop_process, wait_for

LENGTH = 8192  # 32 × 8192-token sequences: about 8 MB, twice what the socket buffers can take


@pytest.mark.slow  # moves about 30 MB of JSON; the in-process store tests cover the same rule quickly
def test_interrupted_batch_is_served_again(tmp_path: Path) -> None:
    server = start_atroposd(tmp_path)
    api = server.api
    try:
        api.start(batch_size=32, max_token_len=LENGTH)
        for k in range(8):
            api.ok("POST", "/scored_data", group(8, length=LENGTH, tag=float(k)), gzip_body=True)
        # a client that asks for a batch, reads almost nothing, and resets the connection
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", server.port))
        s.sendall(b"GET /batch HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept-Encoding: identity\r\n\r\n")
        s.recv(1024)  # the response has started
        wait_for(
            lambda: api.ok("GET", "/status")["formed_batches"] == 1,
            timeout=20,
            what="the server to be writing the first batch",
        )
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # RST: the write fails
        wait_for(
            lambda: api.ok("GET", "/status")["formed_batches"] == 2,
            timeout=20,
            what="the interrupted batch to go back on top",
        )
        served = [g["scores"][0] for batch in api.drain() for g in batch]
        assert sorted(served) == [float(k) for k in range(8)]
        status = api.ok("GET", "/status")
        assert status["queued_sequences"] == 0 and status["current_step"] == 2
    finally:
        stop_process(server.proc)

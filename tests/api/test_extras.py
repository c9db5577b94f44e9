"""atroposd's additions that unmodified clients ignore: /status fields, /atroposd/registrations
(with the client's pid from the TCP peer) and /metrics."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from tests.api.conftest import Api, group, register_env_from_child, start_atroposd
from tests.api.test_backpressure import metric
from tests.support import stop_process

REGISTER_ENV = {"max_token_length": 64, "desired_name": "child-env", "weight": 1.0, "group_size": 4}


def test_status_extras(api: Api) -> None:
    s = api.ok("GET", "/status")
    assert (s["registered"], s["started"], s["queued_sequences"], s["capacity"]) == (False, False, 0, 4096)
    api.register(batch_size=8)
    assert api.ok("GET", "/status")["registered"] and not api.ok("GET", "/status")["started"]
    api.ok("GET", "/batch")
    api.ok("POST", "/scored_data", group(4))
    s = api.ok("GET", "/status")
    assert s["started"] and s["queued_sequences"] == 4 and s["queue_size"] == 1


def test_registrations_name_the_client_process(api: Api) -> None:
    api.register_env(name="early")  # answered "wait": listed too
    api.start()
    child_pid, answer = register_env_from_child(api.url, REGISTER_ENV)
    assert answer["status"] == "success"
    regs = api.ok("GET", "/atroposd/registrations")["registrations"]
    assert [(r["desired_name"], r["status"], r["env_id"]) for r in regs] == [
        ("early", "wait", None),
        ("child-env", "success", 0),
    ]
    assert regs[0]["peer_pid"] == os.getpid()
    assert regs[1]["peer_pid"] == child_pid
    assert all(isinstance(r["at"], float) for r in regs)


def test_metrics(api: Api) -> None:
    names = (
        "atroposd_api_accepted_groups_total",
        "atroposd_api_batches_served_total",
        'atroposd_api_rejected_total{reason="score_count"}',
        'atroposd_api_rejected_total{reason="invalid_json"}',
    )
    before = {n: _value(api, n) for n in names}  # counters run on across tests (one server per module)
    api.start(batch_size=4)
    api.ok("POST", "/scored_data", group(4))
    api.post("/scored_data", group(4, scores=[1.0]))
    api.post("/scored_data", raw=b"nope")
    api.ok("GET", "/batch")
    r = api.get("/metrics")
    assert r.status == 200 and r.headers["content-type"].startswith("text/plain")
    assert {n: _value(api, n) - before[n] for n in names} == dict.fromkeys(names, 1.0)
    text = r.body.decode()
    assert "atroposd_api_queue_sequences 0.0" in text and "atroposd_api_capacity_sequences 4096.0" in text
    assert 'atroposd_api_request_seconds_count{route="/scored_data"}' in text
    assert metric(api, "atroposd_api_refused_total") == 0


def _value(api: Api, series: str) -> float:
    for line in api.get("/metrics").body.decode().splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _host_address() -> str | None:
    """This host's address on a non-loopback interface (no packet is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            address = str(s.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_gzip_level_by_peer(tmp_path: Path) -> None:
    """Loopback clients get stored-block gzip (cheap), remote ones real compression."""
    address = _host_address()
    if address is None:
        pytest.skip("no non-loopback interface")
    server = start_atroposd(tmp_path, "--host", "0.0.0.0")
    try:
        local = server.api
        local.start(batch_size=4, max_token_len=512)
        local.ok("POST", "/scored_data", group(4, length=500))
        remote = Api(f"http://{address}:{server.port}")
        sizes = {}
        for name, client in (("local", local), ("remote", remote)):
            r = client.get("/latest_example", headers={"Accept-Encoding": "gzip"})
            assert r.status == 200 and r.headers["content-encoding"] == "gzip"
            sizes[name] = int(r.headers["content-length"])
            assert r.json()["tokens"] == group(4, length=500)["tokens"]
        assert sizes["remote"] < sizes["local"] / 2
    finally:
        stop_process(server.proc)

"""Bad input (SPEC §5): a 4xx with a message naming the problem, and the queue untouched."""

from __future__ import annotations

import gzip
import json
import re
import zlib
from typing import Any

import psutil
import pytest

from tests.api.conftest import Api, Server, group, start_atroposd
from tests.support import stop_process


def held(api: Api) -> tuple[int, int]:
    s = api.ok("GET", "/status")
    return s["queue_size"], s["queued_sequences"]


def rejected(api: Api, path: str, body: Any = None, *, status: int, words: str, **kw: Any) -> None:
    before = held(api)
    r = api.post(path, body, **kw)
    assert r.status == status, (r.status, r.body[:300])
    detail = r.json()["detail"]
    assert words in detail, detail
    assert held(api) == before


@pytest.fixture
def registered(api: Api) -> Api:
    api.start(batch_size=8, max_token_len=16)
    api.ok("POST", "/scored_data", group(2, tag=9.0))  # something already accepted stays
    return api


def test_unequal_lengths(registered: Api) -> None:
    g = group(2)
    g["masks"][1] = g["masks"][1][:-1]
    rejected(registered, "/scored_data", g, status=400, words="masks[1] has 4 entries but tokens[1] has 5")
    g = group(2)
    g["inference_logprobs"][0].append(1.0)
    rejected(registered, "/scored_data", g, status=400, words="inference_logprobs[0]")
    g = group(2)
    g["masks"] = g["masks"][:1]
    rejected(registered, "/scored_data", g, status=400, words="masks has 1 sequences but tokens has 2")


def test_score_count_and_non_finite(registered: Api) -> None:
    rejected(registered, "/scored_data", group(2, scores=[1.0]), status=400, words="scores has 1 entries")
    # JSON has no NaN: a client that writes one (Python's json does) gets a 400, as does 1e400
    raw = json.dumps(group(2, scores=[float("nan"), 1.0])).encode()
    rejected(registered, "/scored_data", raw=raw, status=400, words="invalid JSON")
    raw = json.dumps(group(2)).replace('"scores": [0.0', '"scores": [1e400').encode()
    rejected(registered, "/scored_data", raw=raw, status=400, words="invalid JSON")
    rejected(registered, "/scored_data", group(2, scores=["x", 1]), status=422, words="scores")


def test_longer_than_max_token_len(registered: Api) -> None:
    rejected(
        registered, "/scored_data", group(2, length=17), status=400, words="longer than the registered max_token_len 16"
    )
    assert registered.ok("POST", "/scored_data", group(2, length=16)) == {"status": "received"}


def test_schema_errors_are_422(registered: Api) -> None:
    rejected(registered, "/scored_data", {"masks": [[1]], "scores": [1]}, status=422, words="tokens")
    rejected(
        registered,
        "/scored_data",
        group(2, tokens=[[1, 2.5, 3, 4, 5], [1, 2, 3, 4, 5]]),
        status=422,
        words="tokens[0] must hold integers",
    )
    rejected(
        registered, "/scored_data", group(2, tokens=[[1, "a", 3, 4, 5], [1, 2, 3, 4, 5]]), status=422, words="tokens[0]"
    )
    rejected(registered, "/scored_data", [group(2)], status=422, words="JSON object")
    rejected(registered, "/scored_data_list", group(2), status=422, words="JSON list")
    rejected(registered, "/scored_data", group(2, env_id="zero"), status=422, words="env_id")


def test_list_is_all_or_nothing(registered: Api) -> None:
    bad = [group(2, tag=1.0), group(2, tag=2.0, scores=[1.0])]
    rejected(registered, "/scored_data_list", bad, status=400, words="[1].scores has 1 entries")


def test_not_json(registered: Api) -> None:
    rejected(registered, "/scored_data", raw=b"{not json", status=400, words="invalid JSON")
    rejected(registered, "/scored_data", raw=b"", status=400, words="empty request body")
    rejected(
        registered,
        "/scored_data",
        raw=b"\x1f\x8b\x08\x00garbage",
        headers={"Content-Encoding": "gzip"},
        status=400,
        words="Invalid gzip",
    )


def test_registration_body_errors(api: Api) -> None:
    r = api.post("/register", {"batch_size": 8})
    assert r.status == 422 and "field required" in r.json()["detail"]
    r = api.post("/register-env", {"desired_name": "x"})
    assert r.status == 422
    assert api.ok("GET", "/info")["batch_size"] == -1


def test_status_env_unknown_env_is_404(api: Api) -> None:
    api.start()
    r = api.get("/status-env", {"env_id": 3})
    assert r.status == 404 and "unknown env_id 3" in r.json()["detail"]
    assert api.get("/status-env", {}).status == 422


def test_status_env_zero_weight_is_a_default(api: Api) -> None:
    api.start()
    a = api.register_env(weight=0.0, name="a")["env_id"]
    api.register_env(weight=0.0, name="b")
    status = api.ok("GET", "/status-env", {"env_id": a})
    assert status["env_weight"] == pytest.approx(0.5)


def test_body_limits_and_gzip_bomb(tmp_path: Any) -> None:
    """max_request_bytes holds for plain bodies and after decompression; a gzip bomb is refused
    without the server allocating its expanded size."""
    server: Server = start_atroposd(tmp_path, "--max-request-bytes", str(1 << 20))
    try:
        api = server.api
        api.start(batch_size=8, max_token_len=1 << 20)
        rss0 = psutil.Process(server.proc.pid).memory_info().rss
        r = api.post("/scored_data", raw=b" " * ((1 << 20) + 10))
        assert r.status == 413 and "max_request_bytes" in r.json()["detail"]
        # 256 MiB of zeros in about 0.25 MB of gzip
        c = zlib.compressobj(6, zlib.DEFLATED, 31)
        chunk = bytes(4 << 20)
        bomb = b"".join(c.compress(chunk) for _ in range(64)) + c.flush()
        assert len(bomb) < 1 << 20
        r = api.post("/scored_data", raw=bomb, headers={"Content-Encoding": "gzip"})
        assert r.status == 413 and "after decompression" in r.json()["detail"]
        grown = psutil.Process(server.proc.pid).memory_info().rss - rss0
        assert grown < 64 << 20, f"the server grew by {grown >> 20} MiB on a gzip bomb"
        ok = gzip.compress(json.dumps(group(2)).encode())
        assert api.post("/scored_data", raw=ok, headers={"Content-Encoding": "gzip"}).status == 200
        assert api.ok("GET", "/status")["queued_sequences"] == 2
    finally:
        stop_process(server.proc)


def test_bearer_token(tmp_path: Any) -> None:
    server = start_atroposd(tmp_path, "--token", "s3cret")
    try:
        assert server.api.ok("GET", "/info")["batch_size"] == -1
        anonymous = Api(server.url)
        r = anonymous.get("/info")
        assert r.status == 401
        assert Api(server.url, token="wrong").get("/status").status == 401
    finally:
        stop_process(server.proc)


def test_integer_types_as_pydantic_coerces_them() -> None:
    """An integral float is an int; anything that is not an integer, or is out of int64, is refused
    with the field named."""
    from atroposd.api.schema import InvalidRequest, group_from_json

    ok = group_from_json({"tokens": [[1.0, 2], [3, 4]], "masks": [[1, 1], [1, 1]], "scores": [1, 2]})
    assert ok.tokens.flat.tolist() == [1, 2, 3, 4] and ok.scores.tolist() == [1.0, 2.0]
    wide = group_from_json({"tokens": [[2**40, 1]], "masks": [[1, 1]], "scores": [0]})
    assert wide.tokens.flat.tolist() == [2**40, 1]
    for tokens, words in (
        ([[1, 2], [3, -1e20]], "tokens: integer out of range"),
        ([[1, 2], [3, 2**65]], "tokens[1]"),
        ([[1, 2], [3, 0.5]], "tokens[1] must hold integers"),
        ([[1, 2], [3, None]], "tokens[1]"),
        ([[1, [2]], [3, 4]], "tokens[0]"),
    ):
        with pytest.raises(InvalidRequest, match=re.escape(words)):
            group_from_json({"tokens": tokens, "masks": [[1, 1], [1, 1]], "scores": [1, 2]})

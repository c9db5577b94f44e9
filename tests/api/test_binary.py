"""Binary batches (SPEC §5): the safetensors layout, and the same arrays whichever way a batch
travels — JSON, safetensors over HTTP, shared memory — for random groups (ragged lengths, every
optional field, fields that do not fit the layout)."""

from __future__ import annotations

import asyncio
import json
import math
import struct
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atroposd.api import binary
from atroposd.api.bodies import groups_from_body
from atroposd.api.queue import TrajectoryStore
from atroposd.api.schema import dumps, group_from_json, group_to_json
from atroposd.api.shmbatch import ShmBatches
from atroposd.client import BatchClient
from atroposd.client.batches import _map_segment
from tests.api.conftest import Api, group

# ----------------------------------------------------------------------------- random groups

_finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)
_token = st.integers(min_value=-(2**40), max_value=2**40) | st.integers(min_value=0, max_value=50_000)
_json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | _finite | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
    max_leaves=6,
)


@st.composite
def groups(draw: st.DrawFn, n: int | None = None, max_len: int = 12) -> dict[str, Any]:
    """A ScoredData group with any subset of the optional fields."""
    n = draw(st.integers(1, 4)) if n is None else n
    lengths = draw(st.lists(st.integers(0, max_len), min_size=n, max_size=n))
    tokens = [draw(st.lists(_token, min_size=k, max_size=k)) for k in lengths]
    masks = [[t if draw(st.booleans()) else -100 for t in row] for row in tokens]
    g: dict[str, Any] = {"tokens": tokens, "masks": masks, "scores": draw(st.lists(_finite, min_size=n, max_size=n))}

    def rows(same: bool) -> list[list[float]]:
        lens = lengths if same else draw(st.lists(st.integers(0, max_len), min_size=n, max_size=n))
        return [draw(st.lists(_finite, min_size=k, max_size=k)) for k in lens]

    if draw(st.booleans()):
        g["inference_logprobs"] = rows(True)
    for name in ("advantages", "ref_logprobs"):
        choice = draw(st.sampled_from(["absent", "aligned", "ragged", "misfit"]))
        if choice == "aligned":
            g[name] = rows(True)
        elif choice == "ragged":  # row lengths other than the tokens' (not validated upstream)
            g[name] = rows(False)  # laid out when no row is longer than its tokens
        elif choice == "misfit":  # not one row per sequence: kept in groups_json
            g[name] = [draw(st.lists(_finite, max_size=3)) for _ in range(n + 1)]
    if draw(st.booleans()):  # one entry per token (null: none there), as ingestion requires
        k = draw(st.integers(0, 3))
        ids: list[Any] = []
        lps: list[Any] = []
        for p in lengths:
            if draw(st.integers(0, 5)) == 0:
                ids.append(None)
                lps.append(None)
                continue
            ks = [draw(st.integers(0, k)) for _ in range(p)]
            ids.append([draw(st.lists(st.integers(0, 1000), min_size=j, max_size=j)) for j in ks])
            lps.append([draw(st.lists(_finite, min_size=j, max_size=j)) for j in ks])
        g["distill_token_ids"], g["distill_logprobs"] = ids, lps
    if draw(st.booleans()):
        g["overrides"] = [draw(st.dictionaries(st.text(max_size=4), _json_value, max_size=2)) for _ in range(n)]
    if draw(st.booleans()):
        g["group_overrides"] = draw(st.dictionaries(st.text(max_size=4), _json_value, max_size=3))
    if draw(st.booleans()):
        g["generation_params"] = {"temperature": draw(_finite), "top_p": 1.0}
    if draw(st.booleans()):
        g["messages"] = [[{"role": "user", "content": draw(st.text(max_size=10))}] for _ in range(n)]
    if draw(st.booleans()):
        g["env_id"] = draw(st.integers(0, 5))
    return g


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert np.array_equal(a[name], b[name]), name


def json_path(batch: list[Any]) -> dict[str, np.ndarray]:
    """What a JSON client gets: the response as the API writes it, parsed by the stdlib."""
    body = json.loads(dumps({"batch": [group_to_json(g) for g in batch]}))
    return binary.batch_arrays(body["batch"])


def shm_path(batch: list[Any]) -> dict[str, np.ndarray]:
    async def offer() -> dict[str, np.ndarray]:
        shm = ShmBatches(TrajectoryStore(1000), ack_timeout=30.0, spool_dir=None)
        info = await shm.offer(batch, 0, 0)
        try:
            arrays, meta = binary.decode(_map_segment(info["name"], info["size"]))
            assert meta["batch_id"] == info["batch_id"]
            return {k: v.copy() for k, v in arrays.items()}
        finally:
            shm.close()

    return asyncio.run(offer())


# ----------------------------------------------------------------------------- in process


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(groups(), min_size=1, max_size=4))
def test_three_formats_give_identical_arrays(posted: list[dict[str, Any]]) -> None:
    """For random groups, parsed by either of the API's parsers: the safetensors file, the shared-
    memory segment and the JSON response decoded by the client give the same arrays."""
    by_schema = [group_from_json(g) for g in posted]
    by_fast = groups_from_body(orjson.dumps(posted), listed=True, max_token_len=None)
    reference, meta = binary.decode(binary.encode(by_schema))
    assert meta["format"] == binary.FORMAT
    for batch in (by_schema, by_fast):
        assert_same(reference, binary.decode(binary.encode(batch))[0])
        assert_same(reference, json_path(batch))
    assert_same(reference, shm_path(by_fast))
    _check_layout(posted, reference)


def _check_layout(posted: list[dict[str, Any]], a: dict[str, np.ndarray]) -> None:
    """The documented layout, checked against the posted groups themselves."""
    row = 0
    entries = orjson.loads(a["groups_json"].tobytes())
    assert len(entries) == len(posted)
    for gi, g in enumerate(posted):
        for i, toks in enumerate(g["tokens"]):
            k = len(toks)
            assert a["lengths"][row] == k and a["group_index"][row] == gi
            assert a["env_id"][row] == g.get("env_id", -1)
            assert list(a["tokens"][row, :k]) == toks and not a["tokens"][row, k:].any()
            assert list(a["masks"][row, :k]) == g["masks"][i] and (a["masks"][row, k:] == -100).all()
            lp = a["inference_logprobs"][row]
            want = g["inference_logprobs"][i] if "inference_logprobs" in g else [1.0] * k
            assert np.array_equal(lp[:k], np.float32(want)) and (lp[k:] == 1.0).all()
            assert a["scores"][row] == np.float32(g["scores"][i])
            for name in ("advantages", "ref_logprobs"):
                value = g.get(name)
                if _laid_out(g, name):
                    assert a[f"has_{name}"][row] == 1
                    r = value[i]
                    assert np.array_equal(a[name][row, : len(r)], np.float32(r)) and not a[name][row, len(r) :].any()
                elif name in a:
                    assert a[f"has_{name}"][row] == 0 and not a[name][row].any()
            row += 1
        kept = entries[gi]
        for name in ("overrides", "group_overrides", "generation_params", "messages"):
            assert kept.get(name) == g.get(name)
        for name in ("advantages", "ref_logprobs"):
            misfit = g.get(name) is not None and not _laid_out(g, name)
            assert (name in kept) == misfit
    assert row == a["tokens"].shape[0]


def _laid_out(g: dict[str, Any], name: str) -> bool:
    """Whether a per-token float field fits the layout: one row per sequence, none wider than
    its tokens."""
    value = g.get(name)
    return (
        value is not None
        and len(value) == len(g["tokens"])
        and all(len(r) <= len(t) for r, t in zip(value, g["tokens"], strict=True))
    )


def test_layout_of_a_small_batch() -> None:
    g1 = group(2, length=3, env_id=1, group_overrides={"atroposd": {"weight_version": 3}})
    g1["advantages"] = [[0.5, 0.5, 0.5], [1.0]]
    g1["distill_token_ids"] = [[[5, 6], [7], []], [[8, 9], None, []]]
    g1["distill_logprobs"] = [[[-0.1, -0.2], [-0.3], []], [[-0.4, -0.5], None, []]]
    g2 = group(1, length=5, logprobs=False)
    file = binary.encode([group_from_json(g1), group_from_json(g2)], {"batch_id": "b1"})
    (hlen,) = struct.unpack_from("<Q", file)
    assert (8 + hlen) % 8 == 0, "the data starts 8-byte aligned"
    from safetensors.numpy import load

    a = load(file)  # a standard safetensors file
    assert a["tokens"].dtype == np.int64 and a["tokens"].shape == (3, 5)
    assert a["tokens"][0].tolist() == [100, 101, 102, 0, 0]
    assert a["masks"][0].tolist() == [-100, -100, 102, -100, -100]
    assert a["inference_logprobs"].dtype == np.float32
    assert a["inference_logprobs"][2].tolist() == [1.0] * 5, "a group without logprobs: all 1.0"
    assert a["lengths"].tolist() == [3, 3, 5] and a["group_index"].tolist() == [0, 0, 1]
    assert a["env_id"].tolist() == [1, 1, -1]
    assert a["scores"].dtype == np.float32
    assert a["has_advantages"].tolist() == [1, 1, 0] and a["advantages"][1].tolist() == [1.0, 0, 0, 0, 0]
    assert "ref_logprobs" not in a and "has_ref_logprobs" not in a
    assert a["distill_token_ids"].shape == (3, 5, 2)
    assert a["distill_token_ids"][0, :3].tolist() == [[5, 6], [7, -1], [-1, -1]]
    assert math.isclose(float(a["distill_logprobs"][1, 0, 1]), -0.5, rel_tol=1e-6)
    assert orjson.loads(a["groups_json"].tobytes()) == [{"group_overrides": {"atroposd": {"weight_version": 3}}}, {}]
    assert binary.decode(file)[1] == {"format": binary.FORMAT, "batch_id": "b1"}


@pytest.mark.parametrize(
    "bad",
    [
        b"",
        b"\x05\x00\x00\x00\x00\x00\x00\x00{}",
        struct.pack("<Q", 2) + b"[]",
        struct.pack("<Q", 60) + b'{"t": {"dtype": "I64", "shape": [4], "data_offsets": [0, 32]}}   ',
        struct.pack("<Q", 58) + b'{"t": {"dtype": "X9", "shape": [0], "data_offsets": [0, 0]}}   ',
    ],
)
def test_decode_refuses_malformed_files(bad: bytes) -> None:
    with pytest.raises(binary.LayoutError):
        binary.decode(bad)


def test_requested_format() -> None:
    assert binary.requested_format("", None) == "json"
    assert binary.requested_format("application/json", None) == "json"
    assert binary.requested_format("application/vnd.safetensors, */*", None) == "safetensors"
    assert binary.requested_format("application/json", "shm") == "shm"
    with pytest.raises(ValueError, match="format must be one of"):
        binary.requested_format("", "xml")


# ----------------------------------------------------------------------------- over HTTP


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 4).flatmap(lambda n: st.lists(groups(n=n), min_size=1, max_size=3)))
def test_three_transports_give_identical_arrays(api: Api, posted: list[dict[str, Any]]) -> None:
    """The same queue, served three times by a real API: the client's arrays are identical."""
    got = []
    size = sum(len(g["tokens"]) for g in posted)
    for transport in ("shm", "safetensors", "json"):
        api.get("/reset_data")
        api.start(batch_size=size, max_token_len=64)
        api.ok("POST", "/scored_data_list", posted)
        with BatchClient(api.url, batch_size=size, max_token_len=64, transport=transport) as client:
            batch = client.next_batch(timeout=10)
            assert batch.transport == transport and not client.fallbacks
            got.append({k: v.copy() for k, v in batch.arrays.items()})
            assert client.get_batch() is None
    assert_same(got[0], got[1])
    assert_same(got[0], got[2])


def test_empty_queue_and_unregistered_answers(api: Api) -> None:
    for query in ("?format=safetensors", "?format=shm", ""):
        r = api.get("/batch" + query)
        assert r.status == 200 and r.json()["status"] == "error", "no trainer registered: as upstream"
    api.start(batch_size=4)
    for query in ("?format=safetensors", "?format=shm"):
        r = api.get("/batch" + query)
        assert r.status == 200 and r.json() == {"batch": None}
        assert r.headers["content-type"].startswith("application/json")
    r = api.get("/batch", headers={"Accept": binary.CONTENT_TYPE})
    assert r.json() == {"batch": None}
    bad = api.get("/batch?format=xml")
    assert bad.status == 400 and "format must be one of" in bad.json()["detail"]


def test_safetensors_response(api: Api) -> None:
    api.start(batch_size=4)
    api.ok("POST", "/scored_data", group(4, length=6, tag=3.0))
    r = api.get("/batch", headers={"Accept": binary.CONTENT_TYPE, "Accept-Encoding": "gzip"})
    assert r.status == 200 and r.headers["content-type"] == binary.CONTENT_TYPE
    assert "content-encoding" not in r.headers, "no gzip on the same host"
    arrays, meta = binary.decode(r.body)
    assert arrays["tokens"].shape == (4, 6) and meta["format"] == binary.FORMAT
    assert api.ok("GET", "/status")["queued_sequences"] == 0, "delivered"
    assert api.ok("GET", "/batch")["batch"] is None

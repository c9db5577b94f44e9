"""Property-based suite (hypothesis) against one live API with a spool: generated bodies and
registrations (valid, malformed, extreme numbers, deep nesting, gzip, wrong media types).

Every answer is 2xx, 4xx or 503, never a 500; the API stays up; the sequence and byte caps
hold; every accepted group is served exactly once, across a restart with the spool. One server
serves every example (module scope); the examples are drawn from the run's fuzz seed (fresh each run, printed;
``--fuzz-seed N`` replays one)
and the counts are printed at the end (``-s``)."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import random
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from tests import fuzzseed
from tests.api.conftest import Api, Server, start_atroposd
from tests.support import free_port, stop_process

pytestmark = pytest.mark.slow

CAPACITY = 64  # sequences: small, so that full queues (503) are part of the run
CAPACITY_BYTES = 96 << 10
MAX_REQUEST = 64 << 10
BATCH = 8
MAX_TOKEN_LEN = 48
SCALE = float(os.environ.get("ATROPOSD_FUZZ_SCALE", "1"))  # by hand: fewer or more cases
BODIES, LISTS, REGISTRATIONS, OTHERS = (max(1, int(n * SCALE)) for n in (5500, 2000, 2500, 600))
FUZZ = settings(
    deadline=None,
    derandomize=False,
    database=None,
    print_blob=False,
    suppress_health_check=list(HealthCheck),
    phases=(Phase.explicit, Phase.generate, Phase.shrink),
)

EXTREME_INTS = [0, -1, 1, 2**31, -(2**31) - 1, 2**53 + 1, 2**63 - 1, -(2**63), 2**63, 2**64, 10**30]
EXTREME_FLOATS = [
    0.0,
    -0.0,
    0.5,
    1.0000001,
    -1e-300,
    1e308,
    -1e308,
    1.7976931348623157e308,
    5e-324,
    float("nan"),
    float("inf"),
    float("-inf"),
]
JUNK = [None, True, False, "", "x", "NaN", [], {}, [[]], [None], {"a": 1}, 1.5, -7]
EXTREMES = EXTREME_INTS + EXTREME_FLOATS + JUNK


class Fuzz:
    """The live server, a keep-alive connection to it, and what the run saw."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.spool = tmp / "spool"
        self.port = free_port()
        self.server: Server | None = None
        self.conn: http.client.HTTPConnection | None = None
        self.statuses: Counter[int] = Counter()
        self.cases: Counter[str] = Counter()
        self.accepted: dict[float, int] = {}  # tag -> sequences, of tracked groups accepted
        self.served: Counter[float] = Counter()
        self.next_tag = 1_000_000.25
        self.issued: set[float] = set()  # tags of groups posted valid (accepted or refused)
        self.requests = 0
        self.dropped_connections = 0
        self.started = time.monotonic()
        self.start()

    def start(self) -> None:
        self.server = start_atroposd(
            self.tmp,
            "--spool-dir",
            str(self.spool),
            "--max-queued-sequences",
            str(CAPACITY),
            "--max-queued-bytes",
            str(CAPACITY_BYTES),
            "--max-request-bytes",
            str(MAX_REQUEST),
            "--full-wait",
            "0",
            port=self.port,
        )
        self.conn = None

    def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
        if self.server is not None:
            assert stop_process(self.server.proc) == 0
            self.server = None

    @property
    def api(self) -> Api:
        assert self.server is not None
        return self.server.api

    def call(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        self.requests += 1
        for attempt in range(3):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            try:
                self.conn.request(method, path, body=body, headers=headers or {})
                r = self.conn.getresponse()
                data = r.read()
                if r.getheader("Connection", "").lower() == "close":
                    self.conn.close()
                    self.conn = None
                if r.getheader("Content-Encoding") == "gzip":
                    data = gzip.decompress(data)
                return r.status, data
            except (http.client.HTTPException, ConnectionError):
                # the server may close a connection whose body it refused unread (413)
                self.conn.close()
                self.conn = None
                if attempt == 2:
                    self.dropped_connections += 1
                    status = self.api.get("/info").status  # the API is still up
                    assert status == 200
                    return 0, b""
        raise AssertionError("unreachable")

    def check(self, status: int, what: str) -> None:
        self.statuses[status] += 1
        assert status == 0 or 200 <= status < 300 or 400 <= status < 500 or status == 503, (status, what)

    def take_batches(self, limit: int = 4) -> None:
        for _ in range(limit):
            status, body = self.call("GET", "/batch")
            self.check(status, "batch")
            batch = json.loads(body).get("batch")
            if not batch:
                return
            assert sum(len(g["tokens"]) for g in batch) == BATCH
            for g in batch:
                if g["scores"] and g["scores"][0] in self.issued:
                    self.served[g["scores"][0]] += 1

    def caps_hold(self) -> None:
        status, body = self.call("GET", "/status")
        assert status == 200
        s = json.loads(body)
        assert s["queued_sequences"] <= CAPACITY and s["queued_bytes"] <= CAPACITY_BYTES, s

    def tag(self) -> float:
        self.next_tag += 1
        self.issued.add(self.next_tag)
        return self.next_tag


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzz]:
    f = Fuzz(tmp_path_factory.mktemp("fuzz"))
    try:
        f.api.start(batch_size=BATCH, max_token_len=MAX_TOKEN_LEN)
        yield f
    finally:
        f.stop()
        elapsed = time.monotonic() - f.started
        print(
            f"\nfuzz: {sum(f.cases.values())} cases, {f.requests} requests in {elapsed:.1f} s; "
            f"cases {dict(f.cases)}; statuses {dict(sorted(f.statuses.items()))}; "
            f"accepted tracked groups {len(f.accepted)}; connections closed by the server "
            f"{f.dropped_connections}"
        )


# ----------------------------------------------------------------------------- strategies


def valid_group(rnd: random.Random, n: int, length: int, tag: float) -> dict[str, Any]:
    tokens = [[rnd.randrange(0, 50_000) for _ in range(length)] for _ in range(n)]
    g: dict[str, Any] = {
        "tokens": tokens,
        "masks": [[-100, *row[1:]] for row in tokens],
        "scores": [tag] + [rnd.uniform(-1, 1) for _ in range(n - 1)],
    }
    if rnd.random() < 0.5:
        g["inference_logprobs"] = [[1.0] + [-rnd.random() for _ in range(length - 1)] for _ in range(n)]
    if rnd.random() < 0.3:
        g["messages"] = [[{"role": "user", "content": "q" * rnd.randrange(50)}] for _ in range(n)]
    if rnd.random() < 0.2:
        g["group_overrides"] = {"atroposd": {"weight_version": rnd.randrange(10)}}
    return g


def nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


MUTATIONS = (
    "drop_key",
    "key_extreme",
    "row_extreme",
    "length_mismatch",
    "score_count",
    "empty",
    "deep",
    "messages",
    "too_long",
    "env_id",
    "wrong_type",
    "huge_passthrough",
    "duplicate_key",
)


def mutate(g: dict[str, Any], how: str, rnd: random.Random, extreme: Any, depth: int) -> dict[str, Any] | str:
    """A group broken one way (sometimes still valid: an extreme value that is a fine number)."""
    keys = ["tokens", "masks", "scores", "inference_logprobs", "advantages", "messages", "env_id"]
    if how == "drop_key":
        g.pop(rnd.choice(["tokens", "masks", "scores"]), None)
    elif how == "key_extreme":
        g[rnd.choice(keys)] = extreme
    elif how == "row_extreme":
        name = rnd.choice(["tokens", "masks", "inference_logprobs", "scores"])
        target = g.setdefault(name, [[0.0] * len(g["tokens"][0]) for _ in g["tokens"]])
        if name == "scores":
            target[rnd.randrange(len(target))] = extreme
        else:
            row = target[rnd.randrange(len(target))]
            row[rnd.randrange(len(row))] = extreme
    elif how == "length_mismatch":
        rnd.choice(g["masks"]).append(0)
    elif how == "score_count":
        g["scores"] = g["scores"] + [0.0] if rnd.random() < 0.5 else g["scores"][:-1]
    elif how == "empty":
        g.update(tokens=[], masks=[], scores=[])
    elif how == "deep":
        text = json.dumps(g)
        return (
            text[:-1] + f', "{rnd.choice(["messages", "generation_params", "overrides", "images"])}": {nested(depth)}}}'
        )
    elif how == "messages":
        g["messages"] = [[rnd.choice([{"role": "user"}, {"content": "x"}, "text", {}, []])]]
    elif how == "too_long":
        g["tokens"][0] = g["tokens"][0] * (MAX_TOKEN_LEN // len(g["tokens"][0]) + 1)
        g["masks"][0] = [0] * len(g["tokens"][0])
        g.pop("inference_logprobs", None)
    elif how == "env_id":
        g["env_id"] = extreme
    elif how == "wrong_type":
        g[rnd.choice(keys)] = rnd.choice([{"a": 1}, "str", 3, [1, 2], [[[1]]]])
    elif how == "huge_passthrough":
        g["generation_params"] = {"pad": "p" * rnd.choice([1000, 20_000, 40_000, 70_000])}
    elif how == "duplicate_key":
        text = json.dumps(g)
        return text[:-1] + ', "tokens": [[1, 2]]}'
    return g


@st.composite
def group_body(draw: st.DrawFn, fuzz: Fuzz, listed: bool) -> tuple[bytes, list[tuple[float, int]], str]:
    """(JSON text, tracked groups it holds as (tag, sequences), case label)."""
    rnd = random.Random(draw(st.integers(0, 2**32)))
    count = draw(st.integers(1, 3)) if listed else 1
    parts, tracked, labels = [], [], []
    for _ in range(count):
        n = draw(st.sampled_from([1, 2, 4, 8]))
        length = draw(st.integers(1, 12))
        tag = fuzz.tag()
        g = valid_group(rnd, n, length, tag)
        if draw(st.integers(0, 9)) < 3:
            tracked.append((tag, n))
            parts.append(json.dumps(g))
            labels.append("valid")
            continue
        g["scores"][0] = rnd.uniform(-1, 1)  # untracked: it may still be valid (and served)
        how = draw(st.sampled_from(MUTATIONS))
        extreme = draw(st.one_of(st.sampled_from(EXTREMES), st.integers(), st.floats(), st.text(max_size=5)))
        depth = draw(st.sampled_from([1, 10, 63, 64, 65, 200, 255, 300, 1100]))
        out = mutate(g, how, rnd, extreme, depth)
        parts.append(out if isinstance(out, str) else json.dumps(out))
        labels.append(how)
    text = ("[" + ", ".join(parts) + "]") if listed else parts[0]
    return text.encode(), tracked, "+".join(labels)


def _as_json(v: Any) -> tuple[bytes, list[tuple[float, int]], str]:
    return json.dumps(v).encode(), [], "json"


def _as_bytes(b: bytes) -> tuple[bytes, list[tuple[float, int]], str]:
    return b, [], "bytes"


def _json_children(c: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4)


# Built once, with named functions: hypothesis describes a lambda by reading its source, which
# costs a compile() per example when the strategy is built per example.
JUNK_BODY = st.one_of(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10), _json_children, max_leaves=20
    ).map(_as_json),
    st.binary(max_size=200).map(_as_bytes),
    st.sampled_from([b"", b" ", b"{", b"[", b"null", b'{"tokens":', b"\xff\xfe", nested(5000).encode()]).map(_as_bytes),
)


BOMB = gzip.compress(b"[" + b" " * (4 << 20) + b"]", compresslevel=9)


def wrap(body: bytes, how: str) -> tuple[bytes, dict[str, str]]:
    headers = {"Content-Type": "application/json"}
    if how == "plain":
        return body, headers
    if how == "no_type":
        return body, {}
    if how == "text_type":
        return body, {"Content-Type": "text/plain"}
    headers["Content-Encoding"] = "gzip"
    if how == "gzip":
        return gzip.compress(body, compresslevel=1), headers
    if how == "gzip_truncated":
        return gzip.compress(body)[:-5], headers
    if how == "gzip_lying_size":
        z = gzip.compress(body)
        return z[:-4] + (2**32 - 1).to_bytes(4, "little"), headers
    if how == "gzip_garbage":
        return b"\x1f\x8b\x08\x00" + body[:50], headers
    if how == "gzip_two_members":
        half = len(body) // 2
        return gzip.compress(body[:half]) + gzip.compress(body[half:]), headers
    return BOMB, headers  # "bomb": 4 MiB of JSON from a few KiB


WRAPS = ["plain"] * 6 + [
    "no_type",
    "text_type",
    "gzip",
    "gzip",
    "gzip_truncated",
    "gzip_lying_size",
    "gzip_garbage",
    "gzip_two_members",
    "bomb",
]


def post_groups(fuzz: Fuzz, body: bytes, tracked: list[tuple[float, int]], label: str, how: str, listed: bool) -> None:
    data, headers = wrap(body, how)
    path = "/scored_data_list" if listed else "/scored_data"
    status, reply = fuzz.call("POST", path, data, headers)
    fuzz.check(status, f"{path} {label} {how}: {reply[:200]!r}")
    fuzz.cases[f"{'list' if listed else 'group'}:{label.split('+')[0]}"] += 1
    if status == 200 and tracked:
        for tag, n in tracked:
            assert tag not in fuzz.accepted
            fuzz.accepted[tag] = n
    if fuzz.requests % 7 == 0:
        fuzz.caps_hold()
    if status == 503 or fuzz.requests % 3 == 0:
        fuzz.take_batches()


# ----------------------------------------------------------------------------- the properties


@settings(FUZZ, max_examples=BODIES)
@seed(fuzzseed.SEED)
@given(data=st.data())
def test_fuzz_scored_data(fuzz: Fuzz, data: st.DataObject) -> None:
    if data.draw(st.integers(0, 9)) < 8:
        body, tracked, label = data.draw(group_body(fuzz, listed=False))
    else:
        body, tracked, label = data.draw(JUNK_BODY)
    post_groups(fuzz, body, tracked, label, data.draw(st.sampled_from(WRAPS)), listed=False)


@settings(FUZZ, max_examples=LISTS)
@seed(fuzzseed.SEED)
@given(data=st.data())
def test_fuzz_scored_data_list(fuzz: Fuzz, data: st.DataObject) -> None:
    body, tracked, label = data.draw(group_body(fuzz, listed=True))
    post_groups(fuzz, body, tracked, label, data.draw(st.sampled_from(WRAPS)), listed=True)


def field_value(kind: str) -> st.SearchStrategy[Any]:
    base: st.SearchStrategy[Any] = st.sampled_from(EXTREMES)
    if kind == "name":
        return st.one_of(st.text(max_size=300), st.sampled_from(["x" * 256, "x" * 257, "é" * 300]), base)
    if kind == "fraction":
        return st.one_of(st.floats(), st.floats(0, 1), base)
    return st.one_of(st.integers(-10, 10**6), st.integers(), st.floats(), base)


@settings(FUZZ, max_examples=REGISTRATIONS)
@seed(fuzzseed.SEED)
@given(data=st.data())
def test_fuzz_register_env(fuzz: Fuzz, data: st.DataObject) -> None:
    fields = {
        "max_token_length": "int",
        "desired_name": "name",
        "weight": "float",
        "group_size": "int",
        "min_batch_allocation": "fraction",
    }
    valid = {"max_token_length": 64, "desired_name": "fz", "weight": 1.0, "group_size": 4}
    body: dict[str, Any] = dict(valid)
    for name in data.draw(st.lists(st.sampled_from(list(fields)), max_size=3, unique=True)):
        if data.draw(st.booleans()):
            body[name] = data.draw(field_value(fields[name]))
        else:
            body.pop(name, None)
    raw = json.dumps(body).encode()
    data_, headers = wrap(raw, data.draw(st.sampled_from(["plain"] * 8 + ["gzip", "text_type", "gzip_garbage"])))
    status, reply = fuzz.call("POST", "/register-env", data_, headers)
    fuzz.check(status, f"register-env {body!r}: {reply[:200]!r}")
    fuzz.cases["register-env"] += 1
    if status == 200:
        answer = json.loads(reply)
        if answer.get("status") == "success":
            env_id = answer["env_id"]
            s, r = fuzz.call(
                "GET", "/status-env", json.dumps({"env_id": env_id}).encode(), {"Content-Type": "application/json"}
            )
            assert s == 200, r
            assert 0 < json.loads(r)["env_weight"] <= 1.0 or json.loads(r)["env_weight"] == 0.01
            # disconnected at once: a minimum allocation would otherwise hold batches back for good
            s, _ = fuzz.call(
                "POST", "/disconnect-env", json.dumps({"env_id": env_id}).encode(), {"Content-Type": "application/json"}
            )
            assert s == 200
    if fuzz.requests % 5 == 0:
        fuzz.caps_hold()


@settings(FUZZ, max_examples=OTHERS)
@seed(fuzzseed.SEED)
@given(data=st.data())
def test_fuzz_other_routes(fuzz: Fuzz, data: st.DataObject) -> None:
    route = data.draw(st.sampled_from(["/status-env", "/disconnect-env", "/register", "/status-env?env_id="]))
    value = data.draw(st.one_of(st.sampled_from(EXTREMES), st.integers(-5, 2000), st.text(max_size=4)))
    if route == "/register":
        body = {
            "wandb_group": "g",
            "wandb_project": "p",
            "batch_size": BATCH,
            "max_token_len": MAX_TOKEN_LEN,
            "checkpoint_dir": "c",
            "save_checkpoint_interval": 1,
            "starting_step": 0,
            "num_steps": 10,
        }
        body[data.draw(st.sampled_from(sorted(body)))] = value
        method, path, raw = "POST", route, json.dumps(body).encode()
    elif route.endswith("="):
        method, path, raw = "GET", route + urllib.parse.quote(str(value)[:40]), b""
    else:
        method, path = ("GET" if route == "/status-env" else "POST"), route
        raw = json.dumps({"env_id": value} if data.draw(st.booleans()) else value).encode()
    status, reply = fuzz.call(method, path, raw or None, {"Content-Type": "application/json"})
    fuzz.check(status, f"{method} {path} {raw[:100]!r}: {reply[:200]!r}")
    fuzz.cases[route] += 1


def test_every_accepted_group_is_served_once_across_a_restart(fuzz: Fuzz) -> None:
    """Stop the API (SIGTERM), start it on the same spool, drain: every tracked group accepted
    during the run is served exactly once over both lives."""
    assert len(fuzz.accepted) > 500 * SCALE, "the run should have accepted many groups"
    fuzz.take_batches(limit=3)  # some served before the restart
    fuzz.stop()
    fuzz.start()
    try:
        drain_after_restart(fuzz)
    finally:
        fuzz.stop()  # here: a process this test started must be gone when it ends


def drain_after_restart(fuzz: Fuzz) -> None:
    api = fuzz.api
    status = api.ok("GET", "/status")
    assert status["registered"] and status["started"]
    for env in api.ok("GET", "/atroposd/registrations")["envs"]:
        api.ok("POST", "/disconnect-env", {"env_id": env["env_id"]})
    for _ in range(20):
        fuzz.take_batches(limit=1000)
        if api.ok("GET", "/status")["queued_sequences"] == 0:
            break
        for size in (1, 2, 4):  # complete the packs left open (upstream packs by the largest group)
            for _ in range(BATCH // size - 1):
                filler = {"tokens": [[1]] * size, "masks": [[1]] * size, "scores": [0.5] * size}
                r = api.post("/scored_data", filler)
                assert r.status in (200, 503), r
    leftover = api.ok("GET", "/status")
    twice = {t: c for t, c in fuzz.served.items() if c > 1}
    missing = set(fuzz.accepted) - set(fuzz.served)
    unknown = set(fuzz.served) - set(fuzz.accepted)
    assert not twice and not unknown, (twice, unknown)
    assert not missing, (len(missing), leftover)

"""The simdjson path for ScoredData bodies agrees with the full (orjson) path on every body:
the same groups, or the same refusal with the same message; bodies outside its plain shape
are handed to the full path (None), never accepted in a different form."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import orjson
import pytest

from atroposd.api import fastparse
from atroposd.api.fastparse import parse_groups
from atroposd.api.schema import Group, InvalidRequest, dumps, group_from_json, group_to_json


def full_path(raw: bytes, *, listed: bool, max_token_len: int | None) -> list[Group]:
    body = orjson.loads(raw)
    if not listed:
        return [group_from_json(body, max_token_len=max_token_len)]
    if not isinstance(body, list):
        raise InvalidRequest("not a list")
    return [group_from_json(item, max_token_len=max_token_len, where=f"[{i}].") for i, item in enumerate(body)]


def outcome(fn: Any, raw: bytes, *, listed: bool, max_token_len: int | None) -> Any:
    """What a path makes of a body: the groups as run-api would serve them, or the refusal."""
    try:
        groups = fn(raw, listed=listed, max_token_len=max_token_len)
    except InvalidRequest as exc:
        return ("refused", exc.status, exc.reason, str(exc))
    if groups is None:
        return None
    return (
        "accepted",
        [orjson.loads(dumps(group_to_json(g))) for g in groups],
        [(g.tokens.flat.dtype.str, g.masks.flat.dtype.str) for g in groups],
    )


def plain(n: int = 4, length: int = 6, *, seed: int = 0, **over: Any) -> dict[str, Any]:
    rng = random.Random(seed)
    tokens = [[rng.randrange(0, 150_000) for _ in range(length)] for _ in range(n)]
    body: dict[str, Any] = {
        "tokens": tokens,
        "masks": [[-100] * min(2, length) + row[2:] for row in tokens],
        "scores": [rng.choice([0.0, 1.0, -1.5]) for _ in range(n)],
        "inference_logprobs": [
            [1.0] * min(2, length) + [-rng.expovariate(2.0) for _ in range(length - 2)] for _ in range(n)
        ],
        "env_id": 0,
        "messages": None,
        "generation_params": {"temperature": 1.0, "stop": ["[END]"]},
    }
    body.update(over)
    return body


def same_on_both_paths(
    raw: bytes, *, listed: bool = False, max_token_len: int | None = 64, fast_taken: bool | None = None
) -> Any:
    expected = outcome(full_path, raw, listed=listed, max_token_len=max_token_len)
    got = outcome(parse_groups, raw, listed=listed, max_token_len=max_token_len)
    if fast_taken is not None:
        assert (got is not None) == fast_taken, (got, expected)
    if got is not None:
        assert got == expected
    return expected


def enc(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def test_plain_bodies_take_the_fast_path_and_match() -> None:
    for seed in range(20):
        rng = random.Random(seed)
        body = plain(rng.randrange(1, 9), rng.randrange(1, 40), seed=seed)
        result = same_on_both_paths(enc(body), fast_taken=True)
        assert result[0] == "accepted"
        assert result[2] == [("<i4", "<i4")]  # token ids narrowed to int32
    # a list body (/scored_data_list), ragged rows, no logprobs, advantages and ref_logprobs
    items = [
        plain(2, 3, seed=1),
        plain(3, 5, seed=2, inference_logprobs=None),
        plain(1, 4, seed=3, advantages=[[0.5, 1, 2, 3]], ref_logprobs=[[-1, -2.5, 0, 0]]),
    ]
    items[0]["tokens"][1].append(7)
    items[0]["masks"][1].append(7)
    items[0]["inference_logprobs"][1].append(-0.25)
    assert same_on_both_paths(enc(items), listed=True, fast_taken=True)[0] == "accepted"
    # empty rows and an empty group
    assert same_on_both_paths(enc({"tokens": [[]], "masks": [[]], "scores": [1]}), fast_taken=True)[0] == "accepted"
    assert same_on_both_paths(enc({"tokens": [], "masks": [], "scores": []}), fast_taken=True)[0] == "refused"


def test_rule_breaking_plain_bodies_get_the_same_refusal() -> None:
    cases: list[tuple[dict[str, Any], str]] = []
    b = plain()
    b["masks"][1] = b["masks"][1][:-1]
    cases.append((b, "masks[1] has 5 entries but tokens[1] has 6"))
    b = plain()
    b["inference_logprobs"][2].append(0.0)
    cases.append((b, "inference_logprobs[2]"))
    cases.append((plain(scores=[1.0]), "scores has 1 entries"))
    cases.append((plain(length=80), "longer than the registered max_token_len 64"))
    cases.append((plain(scores="x"), "scores must be a list"))
    cases.append((plain(env_id=1.5), "env_id must be an integer"))
    cases.append((plain(1, scores=[[0.0]]), "scores must be a flat list of numbers"))
    for body, words in cases:
        result = same_on_both_paths(enc(body), fast_taken=True)
        assert result[0] == "refused" and words in result[3], result
    bad = [plain(), plain(scores=[1.0])]
    result = same_on_both_paths(enc(bad), listed=True, fast_taken=True)
    assert result[0] == "refused" and result[3].startswith("[1]."), result


@pytest.mark.parametrize(
    "raw",
    [
        # rows nested one level deeper: as_buffer would flatten [3, [4]] into two numbers
        b'{"tokens": [[1, 2], [3, [4]]], "masks": [[1, 1], [1, 1]], "scores": [0, 1]}',
        b'{"tokens": [[1, 2], [3, 4]], "masks": [[1, 1], [1, [1]]], "scores": [0, 1]}',
        b'{"tokens": [[1, 2]], "masks": [[1, 1]], "scores": [0], "inference_logprobs": [[0.5, [0.5]]]}',
        # nesting hidden by an escaped bracket elsewhere in the body
        b'{"tokens": [[1, 2], [3, [4]]], "masks": [[1, 1], [1, 1]], "scores": [0, 1], "messages": "\\u005b"}',
        # duplicate keys: the last one counts (JSON as Python and orjson read it)
        b'{"tokens": [[1, 2]], "tokens": [[1, 2, 3]], "masks": [[1, 1, 1]], "scores": [0]}',
        # integral floats and booleans as token ids, which the upstream model coerces
        b'{"tokens": [[1.0, 2]], "masks": [[true, 1]], "scores": [0]}',
        # numbers beyond 64 bits, strings, objects, a missing or null required field
        b'{"tokens": [[18446744073709551615]], "masks": [[1]], "scores": [0]}',
        b'{"tokens": [["1"]], "masks": [[1]], "scores": [0]}',
        b'{"tokens": {"a": 1}, "masks": [[1]], "scores": [0]}',
        b'{"tokens": [[1]], "scores": [0]}',
        b'{"tokens": [[1]], "masks": null, "scores": [0]}',
        b'{"tokens": [[1]], "masks": [[1]], "scores": null}',
        b'{"tokens": [[1]], "masks": [[1]], "scores": [0], "env_id": [1]}',
        b"[1, 2]",
        b'"text"',
    ],
)
def test_irregular_bodies_go_to_the_full_path(raw: bytes) -> None:
    expected = same_on_both_paths(raw, fast_taken=False)
    assert expected is not None


def test_passthrough_fields_and_unknown_keys_survive() -> None:
    body = plain(
        messages=[[{"role": "user", "content": "[1, [2]] \u00e9"}]],
        overrides=[{"a": [1, 2]}],
        group_overrides={"k": "v"},
        images=None,
        distill_token_ids=[[[1, 2]] * 6, None, None, None],
        extra_key=[[1, [2]]],
    )
    result = same_on_both_paths(json.dumps(body, ensure_ascii=False).encode(), fast_taken=True)
    served = result[1][0]
    assert served["messages"] == body["messages"] and served["overrides"] == body["overrides"]
    assert served["group_overrides"] == {"k": "v"} and served["distill_token_ids"] == body["distill_token_ids"]
    # with non-ASCII escaped (Python's json default) it still takes the fast path
    same_on_both_paths(json.dumps(body).encode(), fast_taken=True)


def test_wide_token_ids_stay_int64() -> None:
    body = plain(1, 3, tokens=[[2**40, 1, 2]], masks=[[1, 1, 1]], scores=[0.0], inference_logprobs=None)
    result = same_on_both_paths(enc(body), fast_taken=True)
    assert result[2] == [("<i8", "<i4")]
    assert result[1][0]["tokens"] == [[2**40, 1, 2]]


def test_fast_path_arrays_are_the_posted_numbers() -> None:
    body = plain(8, 512, seed=7)
    (g,) = parse_groups(enc(body), listed=False, max_token_len=None) or []
    assert np.array_equal(g.tokens.flat, np.array(body["tokens"]).reshape(-1))
    assert np.array_equal(g.masks.flat, np.array(body["masks"]).reshape(-1))
    assert g.logprobs is not None
    assert np.array_equal(g.logprobs.flat, np.array(body["inference_logprobs"]).reshape(-1))
    assert g.tokens.bounds == list(range(0, 8 * 512 + 1, 512))


def test_the_parser_is_reused_and_replaced_when_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """One parser serves body after body (its buffers stay allocated); a document still
    referenced from elsewhere pins it, and then a new parser takes over instead of failing."""
    first, second = enc(plain(2, 5, seed=1)), enc(plain(3, 4, seed=2))
    assert parse_groups(first, listed=False, max_token_len=None) is not None
    parser = fastparse._local.parser
    assert parse_groups(second, listed=False, max_token_len=None) is not None
    assert fastparse._local.parser is parser  # reused
    pinned = fastparse._parse(first)["tokens"]  # a proxy that outlives its parse
    assert outcome(parse_groups, second, listed=False, max_token_len=None) == outcome(
        full_path, second, listed=False, max_token_len=None
    )
    assert fastparse._local.parser is not parser  # replaced, not failed
    assert pinned.as_list() == plain(2, 5, seed=1)["tokens"]  # the old document is intact
    # A body over REUSE_MAX_BYTES gets a parser of its own, which is not kept.
    monkeypatch.setattr(fastparse, "REUSE_MAX_BYTES", len(first) - 1)
    kept = fastparse._local.parser
    assert parse_groups(first, listed=False, max_token_len=None) is not None
    assert fastparse._local.parser is kept

"""Wire conformance with atroposlib 0.4.0's run-api (ATROPOS-PROTOCOL.md §1.1): every endpoint.

``any_api`` tests run against both servers and assert the documented behaviour; ``both`` tests
replay one scenario against each and require identical answers (JSON values)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.api.conftest import Api, group

UPSTREAM_FIELDS = [
    "tokens",
    "masks",
    "scores",
    "advantages",
    "ref_logprobs",
    "messages",
    "generation_params",
    "inference_logprobs",
    "overrides",
    "group_overrides",
    "images",
    "env_id",
    "distill_token_ids",
    "distill_logprobs",
]


def same_answers(both: tuple[Api, Api], scenario: Callable[[Api], Any]) -> Any:
    ours, theirs = (scenario(api) for api in both)
    assert ours == theirs
    return ours


# ----------------------------------------------------------------------------- before registration


def test_root_and_unregistered_state(any_api: Api) -> None:
    assert any_api.ok("GET", "/") == {"message": "AtroposLib API"}
    assert any_api.ok("GET", "/info") == {"batch_size": -1, "max_token_len": -1}
    assert any_api.ok("GET", "/wandb_info") == {"group": None, "project": None}
    status = any_api.ok("GET", "/status")
    assert (status["current_step"], status["queue_size"]) == (0, 0)
    assert any_api.ok("GET", "/latest_example")["tokens"] == []


def test_batch_before_register_is_an_error_answer(any_api: Api) -> None:
    any_api.get("/reset_data")
    # run-api after a reset keeps `started` (False), so only a never-registered server answers
    # the error; both answer 200 with no batch.
    answer = any_api.ok("GET", "/batch")
    assert not answer.get("batch")


def test_register_env_waits_for_the_trainer(any_api: Api) -> None:
    assert any_api.register_env() == {"status": "wait for trainer to start"}
    any_api.register(batch_size=8)
    assert any_api.register_env() == {"status": "wait for trainer to start"}  # registered, no /batch yet
    assert any_api.ok("GET", "/batch") == {"batch": None}
    reg = any_api.register_env(group_size=4, name="gsm8k")
    assert reg == {
        "status": "success",
        "env_id": 0,
        "wandb_name": "gsm8k_0",
        "checkpoint_dir": "ckpt",
        "starting_step": 0,
        "checkpoint_interval": 5,
        "num_steps": 100,
    }
    assert any_api.register_env(name="gsm8k")["wandb_name"] == "gsm8k_1"
    assert any_api.register_env(name="other")["env_id"] == 2


def test_second_register_does_not_reset(any_api: Api) -> None:
    first = any_api.register(batch_size=8, max_token_len=64)["uuid"]
    any_api.ok("GET", "/batch")
    any_api.ok("POST", "/scored_data", group(4))
    second = any_api.register(batch_size=16, max_token_len=128, wandb_group="other")["uuid"]
    assert isinstance(first, int) and isinstance(second, int) and first != second
    assert any_api.ok("GET", "/info") == {"batch_size": 8, "max_token_len": 64}
    assert any_api.ok("GET", "/wandb_info") == {"group": "g", "project": "p"}
    assert any_api.ok("GET", "/status")["queue_size"] == 1


# ----------------------------------------------------------------------------- data and batches


def test_scored_data_and_batch_format(any_api: Api) -> None:
    any_api.start(batch_size=8)
    env = any_api.register_env(group_size=4)["env_id"]
    g = group(4, env_id=env, tag=1.0)
    assert any_api.ok("POST", "/scored_data", g) == {"status": "received"}
    assert any_api.ok("GET", "/batch") == {"batch": None}  # 4 of 8 sequences
    assert any_api.ok("POST", "/scored_data", group(4, env_id=env, tag=2.0)) == {"status": "received"}
    assert any_api.ok("GET", "/status")["queue_size"] == 2
    batch = any_api.ok("GET", "/batch")["batch"]
    assert [list(item) for item in batch] == [UPSTREAM_FIELDS, UPSTREAM_FIELDS]
    assert batch[0]["tokens"] == g["tokens"] and batch[0]["masks"] == g["masks"]
    assert batch[0]["inference_logprobs"] == g["inference_logprobs"]
    assert batch[0]["scores"] == g["scores"] and batch[0]["env_id"] == env
    assert batch[0]["advantages"] is None and batch[0]["messages"] is None
    status = any_api.ok("GET", "/status")
    assert (status["current_step"], status["queue_size"]) == (1, 0)
    assert any_api.ok("GET", "/batch") == {"batch": None}


def test_loose_upstream_posts_are_accepted(any_api: Api) -> None:
    """What upstream clients and tests post: integer scores, masks of 1, over-long advantages,
    no env_id, no logprobs, extra fields."""
    any_api.start(batch_size=2)
    loose = {
        "tokens": [[1, 2, 3], [4, 5, 6]],
        "masks": [[1, 1, 1], [1, 1, 1]],
        "scores": [1, 0],
        "advantages": [[0.5] * 10, [0.1]],
        "ref_logprobs": [[0.0]],
        "messages": [[{"role": "user", "content": "hi"}]] * 2,
        "overrides": [{"temperature": 0.7}, {}],
        "group_overrides": {"group_size": 2},
        "generation_params": {"temperature": 1.0},
        "unknown_field": 3,
    }
    assert any_api.ok("POST", "/scored_data", loose) == {"status": "received"}
    served = any_api.ok("GET", "/batch")["batch"][0]
    assert served["scores"] == [1.0, 0.0]
    assert served["advantages"] == [[0.5] * 10, [0.1]] and served["ref_logprobs"] == [[0.0]]
    assert served["messages"] == loose["messages"] and served["overrides"] == loose["overrides"]
    assert served["group_overrides"] == {"group_size": 2} and served["env_id"] is None
    assert served["inference_logprobs"] is None
    assert "unknown_field" not in served


def test_batches_from_heterogeneous_groups_match_run_api(both: tuple[Api, Api]) -> None:
    """Mixed group sizes, several batches per formation (served LIFO), leftovers."""

    def scenario(api: Api) -> Any:
        api.start(batch_size=8)
        big = api.register_env(group_size=4, name="big")["env_id"]
        small = api.register_env(group_size=2, name="small")["env_id"]
        out = []
        sizes = [
            (4, big),
            (2, small),
            (1, None),
            (4, big),
            (2, small),
            (1, None),
            (2, small),
            (4, big),
            (2, small),
            (4, big),
            (1, None),
            (1, None),
            (4, big),
            (2, None),
        ]
        for k, (n, env) in enumerate(sizes):
            out.append(api.ok("POST", "/scored_data", group(n, env_id=env, tag=float(k))))
        out.append(api.ok("GET", "/status"))
        out.append(api.drain())
        out.append(api.ok("GET", "/status"))
        return [_upstream_view(x) for x in out]

    same_answers(both, scenario)


def test_mixed_size_buffering_matches_run_api(both: tuple[Api, Api]) -> None:
    def scenario(api: Api) -> Any:
        api.start(batch_size=8)
        env = api.register_env(group_size=4)["env_id"]
        out = [
            api.ok("POST", "/scored_data", group(n, env_id=env, tag=float(k)))
            for k, n in enumerate([2, 3, 1, 1, 2, 3, 4])
        ]
        out.append(
            api.ok("POST", "/scored_data_list", [group(n, env_id=env, tag=10.0 + k) for k, n in enumerate([1, 2, 3])])
        )
        out.append(api.ok("POST", "/scored_data_list", [group(4, env_id=env, tag=20.0)]))
        out.append(api.ok("GET", "/status"))
        out.append(api.ok("GET", "/status-env", {"env_id": env}))
        out.append(api.drain())
        return [_upstream_view(x) for x in out]

    answers = same_answers(both, scenario)
    assert answers[0] == {"status": "buffered", "buffer_size": 2}
    assert answers[3] == {"status": "buffered", "buffer_size": 3}  # 2+1+1 moved to the queue


def test_minimum_allocation_batches_match_run_api(both: tuple[Api, Api]) -> None:
    def scenario(api: Api) -> Any:
        api.start(batch_size=8)
        a = api.register_env(group_size=2, name="a", min_batch_allocation=0.5)["env_id"]
        b = api.register_env(group_size=2, name="b")["env_id"]
        out = []
        for k in range(6):
            out.append(api.ok("POST", "/scored_data", group(2, env_id=b, tag=float(k))))
        out.append(api.drain())  # env a has a minimum and nothing queued: no batch
        for k in range(3):
            out.append(api.ok("POST", "/scored_data", group(2, env_id=a, tag=10.0 + k)))
        out.append(api.ok("GET", "/status-env", {"env_id": a}))
        out.append(api.drain())
        api.ok("POST", "/disconnect-env", {"env_id": a})
        out.append(api.ok("GET", "/status-env", {"env_id": b}))
        return [_upstream_view(x) for x in out]

    answers = same_answers(both, scenario)
    assert answers[6] == []
    assert answers[-2], "batches once the minimum can be met"


def test_status_env_matches_run_api(both: tuple[Api, Api]) -> None:
    def scenario(api: Api) -> Any:
        api.start(batch_size=16)
        e0 = api.register_env(group_size=4, name="x", weight=2.0, max_token_length=32)["env_id"]
        e1 = api.register_env(group_size=2, name="y", weight=1.0, max_token_length=64, min_batch_allocation=0.25)[
            "env_id"
        ]
        for k in range(3):
            api.ok("POST", "/scored_data", group(4, env_id=e0, tag=float(k)))
            api.ok("POST", "/scored_data", group(2, env_id=e1, tag=float(k)))
        api.ok("POST", "/scored_data", group(8, env_id=e1, tag=9.0))  # dynamic group size
        return [_upstream_view(api.ok("GET", "/status-env", {"env_id": e})) for e in (e0, e1, e0)]

    same_answers(both, scenario)


def test_disconnect_env_answers(any_api: Api) -> None:
    any_api.start()
    env = any_api.register_env()["env_id"]
    assert any_api.ok("POST", "/disconnect-env", {"env_id": env}) == {"status": "success"}
    failure = any_api.ok("POST", "/disconnect-env", {"env_id": 7})
    assert failure["status"] == "failure" and "error" in failure


def test_latest_example(any_api: Api) -> None:
    any_api.start(batch_size=8)
    any_api.ok("POST", "/scored_data", group(2, tag=1.0))
    last = group(3, tag=2.0)
    any_api.ok("POST", "/scored_data", last)
    example = any_api.ok("GET", "/latest_example")
    assert example["tokens"] == last["tokens"] and example["scores"] == last["scores"]


def test_reset_data(any_api: Api) -> None:
    any_api.start(batch_size=4)
    any_api.register_env()
    any_api.ok("POST", "/scored_data", group(2))
    r = any_api.get("/reset_data")
    assert r.status == 200 and r.body == b"Reset successful"
    # (run-api forgets batch_size but keeps max_token_len; atroposd forgets both)
    assert any_api.ok("GET", "/info")["batch_size"] == -1
    assert any_api.ok("GET", "/status")["queue_size"] == 0
    any_api.start(batch_size=4)  # registers cleanly again
    assert any_api.register_env()["env_id"] == 0


# ----------------------------------------------------------------------------- encodings


def test_gzip_request_and_response(any_api: Api) -> None:
    any_api.start(batch_size=4, max_token_len=512)
    g = group(4, length=200, tag=3.0)
    assert any_api.ok("POST", "/scored_data", g, gzip_body=True) == {"status": "received"}
    r = any_api.get("/batch", headers={"Accept-Encoding": "gzip"})
    assert r.status == 200 and r.headers.get("content-encoding") == "gzip"
    assert json.loads(r.body)["batch"][0]["tokens"] == g["tokens"]
    small = any_api.get("/info", headers={"Accept-Encoding": "gzip"})
    assert "content-encoding" not in small.headers  # below 1000 bytes


def test_invalid_gzip_is_400(any_api: Api) -> None:
    any_api.start()
    r = any_api.post("/scored_data", raw=b"\x1f\x8bnot really gzip", headers={"Content-Encoding": "gzip"})
    assert r.status == 400
    assert any_api.ok("GET", "/status")["queue_size"] == 0


def test_status_env_get_with_json_body(any_api: Api) -> None:
    any_api.start()
    env = any_api.register_env(group_size=4)["env_id"]
    any_api.ok("POST", "/scored_data", group(4, env_id=env))
    # exactly what atroposlib's env sends: GET, JSON body, gzip when ≥ 1 KiB (not here)
    status = any_api.ok("GET", "/status-env", {"env_id": env})
    assert status["queue_size"] == 1 and status["self_queue_size"] == 1 and status["max_group_size"] == 4
    assert status["env_weight"] == pytest.approx(1.0)
    assert set(status) >= {
        "current_step",
        "queue_size",
        "unallocated_fraction",
        "self_queue_size",
        "max_group_size",
        "env_weight",
    }


def test_gzip_of_body_posted_by_atroposlib_client(any_api: Api) -> None:
    """A ≥ 1 KiB list posted gzip'ed, as the env's send path does."""
    any_api.start(batch_size=8, max_token_len=512)
    body = json.dumps([group(4, length=100, tag=float(k)) for k in range(2)]).encode()
    r = any_api.post("/scored_data_list", raw=gzip.compress(body), headers={"Content-Encoding": "gzip"})
    assert r.status == 200 and r.json() == {"status": "received", "groups_processed": 2}


def _upstream_view(x: Any) -> Any:
    """Drop the fields atroposd adds (its answers are a superset of run-api's)."""
    extras = {
        "queued_sequences",
        "capacity",
        "registered",
        "started",
        "buffered_sequences",
        "formed_batches",
        "waiting_submissions",
        "queued_bytes",
        "capacity_bytes",
    }
    if isinstance(x, dict):
        return {k: _upstream_view(v) for k, v in x.items() if k not in extras}
    if isinstance(x, list):
        return [_upstream_view(v) for v in x]
    return x

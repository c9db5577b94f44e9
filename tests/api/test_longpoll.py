"""Long-polls, atroposd's extensions that remove the pipeline's polling bubbles: ``GET
/batch?wait=S`` holds the trainer's request until a batch can be formed, and ``/status-env``
with ``{"wait_s", "dequeued"}`` holds a held-back environment's answer until its groups leave
the queue. Without those fields both answer at once, as run-api does."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from tests.api.conftest import Api, group


def _later(delay: float, fn: Callable[[], Any]) -> threading.Thread:
    """Run ``fn`` after ``delay`` s in a thread (the long-poll under test blocks this one)."""

    def run() -> None:
        time.sleep(delay)
        fn()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.monotonic()
    out = fn()
    return out, time.monotonic() - start


def test_batch_wait_answers_when_the_batch_is_complete(api: Api) -> None:
    api.start(batch_size=8)
    api.ok("POST", "/scored_data", group(4, tag=1.0))
    poster = _later(0.4, lambda: api.ok("POST", "/scored_data", group(4, tag=2.0)))
    answer, took = _timed(lambda: api.ok("GET", "/batch?wait=5"))
    poster.join()
    assert 0.3 <= took < 4, took
    assert sorted(g["scores"][0] for g in answer["batch"]) == [1.0, 2.0]
    assert api.ok("GET", "/batch") == {"batch": None}  # served once


def test_batch_wait_runs_out_with_no_batch(api: Api) -> None:
    api.start(batch_size=8)
    api.ok("POST", "/scored_data", group(4))  # half a batch: never enough
    answer, took = _timed(lambda: api.ok("GET", "/batch?wait=0.3"))
    assert answer == {"batch": None} and 0.25 <= took < 3, took
    # the plain request is answered at once, as run-api answers it
    answer, took = _timed(lambda: api.ok("GET", "/batch"))
    assert answer == {"batch": None} and took < 0.25


def test_batch_wait_is_checked(api: Api) -> None:
    api.start(batch_size=8)
    for bad in ("x", "-1", "31", "nan"):
        r = api.get(f"/batch?wait={bad}")
        assert r.status == 422 and b"wait" in r.body, (bad, r.status, r.body)


def test_status_env_without_wait_is_answered_as_run_api_does(api: Api) -> None:
    api.start(batch_size=8)
    env = api.register_env(group_size=4)["env_id"]
    answer = api.ok("GET", "/status-env", {"env_id": env})
    assert "dequeued" not in answer


def test_status_env_wait_answers_when_the_groups_leave_the_queue(api: Api) -> None:
    api.start(batch_size=8)
    env = api.register_env(group_size=4)["env_id"]
    first = api.ok("GET", "/status-env", {"env_id": env, "wait_s": 5, "dequeued": None})  # at once
    assert first["dequeued"] == 0
    api.ok("POST", "/scored_data", group(4, env_id=env))
    api.ok("POST", "/scored_data", group(4, env_id=env))
    assert api.ok("GET", "/status-env", {"env_id": env})["self_queue_size"] == 2
    taker = _later(0.4, lambda: api.ok("GET", "/batch"))
    answer, took = _timed(lambda: api.ok("GET", "/status-env", {"env_id": env, "wait_s": 5, "dequeued": 0}))
    taker.join()
    assert 0.3 <= took < 4, took
    assert answer["dequeued"] == 2 and answer["self_queue_size"] == 0
    # a count that already moved on is answered at once
    answer, took = _timed(lambda: api.ok("GET", "/status-env", {"env_id": env, "wait_s": 5, "dequeued": 0}))
    assert answer["dequeued"] == 2 and took < 0.25


def test_status_env_wait_ignores_other_changes_and_runs_out(api: Api) -> None:
    api.start(batch_size=8)
    env = api.register_env(group_size=4)["env_id"]
    seen = api.ok("GET", "/status-env", {"env_id": env, "wait_s": 0.5, "dequeued": None})["dequeued"]
    poster = _later(0.1, lambda: api.ok("POST", "/scored_data", group(4, env_id=env)))  # enters, never leaves
    answer, took = _timed(lambda: api.ok("GET", "/status-env", {"env_id": env, "wait_s": 0.5, "dequeued": seen}))
    poster.join()
    assert 0.45 <= took < 3, took
    assert answer["dequeued"] == seen == 0 and answer["self_queue_size"] == 1


def test_status_env_wait_answers_when_the_environments_change(api: Api) -> None:
    """Another environment registering changes every share: the held answer comes at once."""
    api.start(batch_size=8)
    env = api.register_env(group_size=4, name="a")["env_id"]
    other = _later(0.3, lambda: api.register_env(group_size=4, name="b"))
    answer, took = _timed(lambda: api.ok("GET", "/status-env", {"env_id": env, "wait_s": 5, "dequeued": 0}))
    other.join()
    assert 0.2 <= took < 4, took
    assert answer["env_weight"] == 0.5


def test_status_env_wait_answers_at_a_reset(api: Api) -> None:
    api.start(batch_size=8)
    env = api.register_env(group_size=4)["env_id"]
    reset = _later(0.3, lambda: api.get("/reset_data"))
    r, took = _timed(lambda: api.get("/status-env", {"env_id": env, "wait_s": 5, "dequeued": 0}))
    reset.join()
    assert 0.2 <= took < 4, took
    assert r.status == 404  # the environment is gone with the reset: it registers again


def test_status_env_wait_is_checked(api: Api) -> None:
    api.start(batch_size=8)
    env = api.register_env(group_size=4)["env_id"]
    r = api.get("/status-env", {"env_id": env, "wait_s": "soon", "dequeued": 0})
    assert r.status == 422 and b"wait" in r.body
    assert api.get("/status-env", {"env_id": env + 5, "wait_s": 1, "dequeued": 0}).status == 404

"""A held-back built-in environment learns that room opened without polling: against
``atroposd api`` it long-polls ``/status-env`` (answered when its groups leave the queue), so
it asks about once a second while the queue stays full and starts the next group as soon as a
batch is taken; against run-api (no long-poll) it polls as before. Every group carries its
rollout timing in ``group_overrides.atroposd.timing``."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable

from tests.envs.conftest import Api, EnvProc, FakeInference, held_back_env
from tests.support import wait_for


def _status_env_requests(api: Api) -> float:
    with urllib.request.urlopen(api.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith('atroposd_api_request_seconds_count{route="/status-env"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_held_back_environment_long_polls_and_resumes_when_a_batch_is_taken(
    our_api: Api, fake_inference: Callable[..., FakeInference], start_env: Callable[..., EnvProc]
) -> None:
    infer, _env = held_back_env(our_api, fake_inference, start_env)
    time.sleep(0.3)  # settled into its long-poll
    before = _status_env_requests(our_api)
    time.sleep(2.0)
    asked = _status_env_requests(our_api) - before
    assert asked <= 4, f"{asked} /status-env requests in 2 s while held back (polling would ask ~20)"
    assert infer.stats()["requests"] == 2  # nothing generated beyond the limit
    taken = time.monotonic()
    batch = our_api.get_batch()
    assert batch is not None and len(batch) == 2
    wait_for(lambda: infer.stats()["requests"] == 4, timeout=20, what="the next 2 groups generated")
    assert time.monotonic() - taken < 1.0  # woken by the batch, not by the long-poll's timeout
    wait_for(lambda: our_api.status()["queue_size"] == 2, timeout=20, what="2 groups queued again")
    assert infer.stats()["requests"] == 4
    for group in batch:
        timing = group["group_overrides"]["atroposd"]["timing"]
        assert timing["gate_s"] >= 0 and timing["generate_s"] >= 0
        assert abs(timing["posted_at"] - time.time()) < 60


def test_against_run_api_the_gate_polls(
    api: Api, fake_inference: Callable[..., FakeInference], start_env: Callable[..., EnvProc]
) -> None:
    """Both APIs: held back, then resumed by a batch taken (run-api: found by polling)."""
    infer, _env = held_back_env(api, fake_inference, start_env)
    assert len(api.get_batch() or []) == 2
    wait_for(lambda: infer.stats()["requests"] == 4, timeout=20, what="the next 2 groups generated")
    wait_for(lambda: api.status()["queue_size"] == 2, timeout=20, what="2 groups queued again")
    assert infer.stats()["requests"] == 4

"""The restart budget (atroposd/restarts.py), which a child's unit and the trainer group share."""

from __future__ import annotations

import pytest

from atroposd.restarts import RestartBudget


def test_max_restarts_within_the_window_then_exhausted() -> None:
    b = RestartBudget(max_restarts=2, window=10.0)
    assert b.record(0.0) == 1 and not b.exhausted
    assert b.record(1.0) == 2 and not b.exhausted
    assert b.record(2.0) == 3 and b.exhausted  # one more than max_restarts


def test_failures_older_than_the_window_are_forgotten() -> None:
    b = RestartBudget(max_restarts=1, window=10.0)
    b.record(0.0)
    assert b.record(10.0) == 2 and b.exhausted  # exactly the window: still inside
    fresh = RestartBudget(max_restarts=1, window=10.0)
    fresh.record(0.0)
    assert fresh.record(10.5) == 1 and not fresh.exhausted


def test_an_uncounted_failure_only_forgets_old_ones() -> None:
    # the trainer group re-forming while a node is lost: waited for, not counted
    b = RestartBudget(max_restarts=1, window=10.0)
    b.record(0.0)
    assert b.record(5.0, counted=False) == 1
    assert b.record(20.0, counted=False) == 0 and not b.exhausted


def test_backoff_doubles_up_to_the_cap_and_jitter_stretches_it() -> None:
    b = RestartBudget(max_restarts=100, window=1e9, first=1.0, cap=30.0)
    delays = []
    for i in range(7):
        b.record(float(i))
        delays.append(b.backoff())
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    j = RestartBudget(max_restarts=5, window=60.0, first=1.0, cap=30.0, jitter=0.2)
    j.record(0.0)
    j.record(1.0)
    assert j.backoff(0.0) == 2.0 and j.backoff(0.5) == pytest.approx(2.2)
    assert 2.0 <= j.backoff() < 2.4
    assert RestartBudget(max_restarts=5, window=60.0).backoff() == 1.0  # before any failure

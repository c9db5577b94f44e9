"""The daemon's own state machine: legal moves, refused ones, and the daemon going through it."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from atroposd.config import parse_config
from atroposd.daemon.core import Daemon
from atroposd.daemon.state import DaemonState, IllegalMove

S = DaemonState
LEGAL = {
    (S.STARTING, S.RUNNING),
    (S.STARTING, S.STOPPING),
    (S.RUNNING, S.DEGRADED),
    (S.RUNNING, S.STOPPING),
    (S.DEGRADED, S.RUNNING),
    (S.DEGRADED, S.STOPPING),
}


@pytest.mark.parametrize(("old", "new"), sorted(LEGAL))
def test_legal_moves(old: DaemonState, new: DaemonState) -> None:
    assert old.can_move_to(new)
    old.check_move(new)


@pytest.mark.parametrize(("old", "new"), sorted(set(itertools.product(S, S)) - LEGAL))
def test_every_other_move_is_refused(old: DaemonState, new: DaemonState) -> None:
    assert not old.can_move_to(new)
    with pytest.raises(IllegalMove, match=f"{old.value} → {new.value}"):
        old.check_move(new)


def test_serving_states_and_values_are_specs() -> None:
    assert {s.value for s in S} == {"starting", "running", "degraded", "stopping"}  # SPEC §2
    assert {s for s in S if s.serving} == {S.RUNNING, S.DEGRADED}


def test_the_daemon_moves_only_by_legal_moves(short_tmp: Path) -> None:
    cfg = parse_config({"daemon": {"runtime_dir": str(short_tmp / "run"), "state_dir": str(short_tmp / "state")}})
    d = Daemon(cfg)
    try:
        assert d.state is S.STARTING
        with pytest.raises(IllegalMove):
            d._move(S.DEGRADED, "test")
        assert d.state is S.STARTING  # a refused move changes nothing
        d._move(S.RUNNING, "test")
        d._move(S.DEGRADED, "test")
        d._move(S.STOPPING, "test")
        with pytest.raises(IllegalMove):
            d._move(S.RUNNING, "test")
        assert d.state is S.STOPPING
    finally:
        d._close_events()

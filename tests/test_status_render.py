"""The human form of `atroposd status`: what a person reads must carry what --json carries
about refused input and failed checkpoints (SPEC §13)."""

from __future__ import annotations

from typing import Any

from atroposd.commands import _render_status


def _status(**trainer: Any) -> dict[str, Any]:
    base = {
        "state": "training",
        "step": 7,
        "total_steps": 10,
        "waiting_for": None,
        "reward_mean": 0.5,
        "accuracy": None,
        "loss": 0.1,
        "steps_per_s": 2.0,
        "rejected_groups": {},
        "checkpoint_failures": 0,
    }
    base.update(trainer)
    return {
        "state": "running",
        "pid": 1,
        "uptime_s": 3.0,
        "config": "/x.toml",
        "components": [{"name": "api", "state": "ready", "pid": 2, "restarts": 0, "last_exit": None}],
        "trainer": base,
        "queue": {"sequences": 4, "capacity": 8},
    }


def test_rejected_groups_and_checkpoint_failures_are_shown() -> None:
    text = _render_status(
        _status(
            rejected_groups={"token_out_of_range": 3, "score_invalid": 0, "malformed": 1},
            checkpoint_failures=2,
            checkpoint_error="No space left on device",
        )
    )
    assert "rejected groups malformed 1, token_out_of_range 3" in text
    assert "score_invalid" not in text
    assert "2 checkpoint write(s) failed; last: No space left on device" in text


def test_a_clean_run_shows_neither() -> None:
    text = _render_status(_status())
    assert "rejected" not in text and "checkpoint" not in text
    assert "trainer: training step 7/10" in text and "queue: 4 sequences of 8" in text


def test_several_ranks_show_their_count_and_the_group_restarts() -> None:
    text = _render_status(_status(ranks=2, group_restarts=1, last_fault="trainer-1 killed by SIGKILL"))
    assert "trainer: 2 ranks, 1 group restart; last fault: trainer-1 killed by SIGKILL" in text
    waiting = _render_status(_status(state="waiting", waiting_for="ranks", ranks=2, group_restarts=2))
    assert "trainer: waiting step 7/10 (waiting for the trainer ranks to form the group)" in waiting
    assert "trainer: 2 ranks, 2 group restarts" in waiting


def test_one_rank_shows_no_rank_line() -> None:
    assert "ranks" not in _render_status(_status(ranks=1, group_restarts=0, last_fault=None))


def test_the_head_lists_every_node_and_another_node_its_head() -> None:
    st = _status(ranks=2)
    st["nodes"] = [
        {
            "node_rank": 0,
            "host": "n0",
            "state": "ready",
            "reason": None,
            "last_heartbeat_s": None,
            "components": [{"name": "api", "state": "ready"}, {"name": "inference", "state": "ready"}],
        },
        {
            "node_rank": 1,
            "host": "n1",
            "state": "lost",
            "reason": "no heartbeat for 30 s",
            "last_heartbeat_s": 31.2,
            "components": [{"name": "trainer-1", "state": "ready"}],
        },
    ]
    text = _render_status(st)
    assert "0      n0                   ready" in text and "api ready, inference ready" in text
    assert "lost" in text and "31.2s" in text and "trainer-1 ready (no heartbeat for 30 s)" in text
    node = _status()
    node["cluster"] = {"node_rank": 1, "head": "n0:29400", "state": "joined"}
    assert "node 1 of a cluster; head n0:29400 (joined)" in _render_status(node)


def test_filtered_groups_and_the_filtered_wait_are_shown() -> None:
    text = _render_status(_status(state="waiting", waiting_for="filtered", filtered_groups=12))
    assert "12 groups filtered (all scores equal; filter_groups)" in text
    assert "waiting for data: the groups received lately had equal scores" in text
    assert "filtered" not in _render_status(_status(filtered_groups=0))


def test_the_sentinel_line_shows_drift_prompts_and_quarantine() -> None:
    sentinel = {
        "replica_drift": [0.0, 2.5, None],
        "drift_limit": 0.05,
        "canary_source": "environments",
        "canary_prompts": 8,
        "resyncs": 2,
        "restarts": 1,
        "quarantined": {"1": "canary drift 2.5 over"},
    }
    text = _render_status(_status(sentinel=sentinel))
    assert (
        "sentinel: drift [0, 2.5, -] (limit 0.05), canary prompts 8 environments, 2 resyncs, 1 restarts; "
        "quarantined: replica 1"
    ) in text
    assert "sentinel" not in _render_status(_status(sentinel=None))

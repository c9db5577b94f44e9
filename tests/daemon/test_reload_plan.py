"""Reload as a plan (SPEC §6): environments change live, any other key is refused and nothing changes."""

from __future__ import annotations

from typing import Any

import pytest

from atroposd.config import Config, parse_config
from atroposd.daemon.reload import ReloadPlan, env_of, plan_reload


def _env(name: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "builtin": "arithmetic", **kw}


def _config(envs: list[dict[str, Any]], **sections: Any) -> Config:
    raw: dict[str, Any] = {"daemon": {"runtime_dir": "/run/job"}, "env": envs}
    raw.update(sections)
    return parse_config(raw, source="/etc/atroposd.toml")


def test_the_same_config_changes_nothing() -> None:
    cfg = _config([_env("a"), _env("b", replicas=2)])
    again = _config([_env("a"), _env("b", replicas=2)])
    plan = plan_reload(cfg, again)
    assert plan == ReloadPlan() and plan.ok and not plan.stop and not plan.start


def test_environments_added_removed_and_changed_apply_live() -> None:
    old = _config([_env("keep"), _env("drop"), _env("grow", replicas=1)])
    new = _config([_env("keep"), _env("grow", replicas=3), _env("new", group_size=4)])
    plan = plan_reload(old, new)
    assert plan.ok
    assert (plan.added, plan.removed, plan.changed) == (("new",), ("drop",), ("grow",))
    assert plan.stop == {"drop", "grow"}  # a changed environment restarts: its old replicas stop
    assert plan.start == ("new", "grow")  # ... and start again from the new config
    assert "keep" not in plan.stop and "keep" not in plan.start


def test_an_order_change_alone_restarts_nothing() -> None:
    plan = plan_reload(_config([_env("a"), _env("b")]), _config([_env("b"), _env("a")]))
    assert plan == ReloadPlan()


def test_where_the_file_came_from_is_not_a_change() -> None:
    old = _config([_env("a")])
    new = parse_config({"daemon": {"runtime_dir": "/run/job"}, "env": [_env("a")]}, source="/elsewhere.toml")
    assert plan_reload(old, new).ok


@pytest.mark.parametrize(
    ("section", "values", "key"),
    [
        ("trainer", {"steps": 7}, "trainer.steps"),
        ("trainer", {"lr": 1e-3}, "trainer.lr"),
        ("inference", {"model": "/models/other"}, "inference.model"),
        ("inference", {"vllm": {"gpu_memory_utilization": 0.5}}, "inference.vllm"),
        ("api", {"port": 8111}, "api.port"),
        ("daemon", {"runtime_dir": "/run/job", "stop_timeout": 3.0}, "daemon.stop_timeout"),
    ],
)
def test_any_other_key_is_refused_by_name_and_nothing_changes(section: str, values: dict[str, Any], key: str) -> None:
    old = _config([_env("keep")])
    new = _config([_env("keep"), _env("extra")], **{section: values})
    plan = plan_reload(old, new)
    assert not plan.ok and plan.refused == (key,)
    # refused: not even the environment change is applied
    assert (plan.added, plan.removed, plan.changed) == ((), (), ())
    assert not plan.stop and not plan.start
    assert key in plan.refusal() and "nothing was changed" in plan.refusal()


def test_every_refused_key_is_named() -> None:
    new = _config([_env("a")], trainer={"steps": 7, "seed": 3}, api={"port": 8111})
    assert set(plan_reload(_config([_env("a")]), new).refused) == {"trainer.steps", "trainer.seed", "api.port"}


def test_env_of_maps_a_replica_to_its_environment() -> None:
    envs = _config([_env("a", replicas=2), _env("a-1")]).env
    assert env_of("a-0", envs) == "a"
    assert env_of("a-1", envs) == "a"  # replica 1 of "a", not the environment "a-1"
    assert env_of("a-1-0", envs) == "a-1"
    assert env_of("a-2", envs) is None
    assert env_of("api", envs) is None

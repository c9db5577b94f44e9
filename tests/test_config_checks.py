"""The cross-key rules of ``config check`` (atroposd/config/checks.py): every rule registered in
the one ordered list, each a short function, and their problems reported in that order."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest

from atroposd.config import ConfigError, parse_config
from atroposd.config import checks as checks_module
from atroposd.config.checks import CHECKS, ENV_CHECKS

_NO_GROUP = "atroposd-no-such-group-x"


def _problems(raw: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    return [(p.path, p.message) for p in info.value.problems]


def test_problems_of_many_rules_come_in_the_order_of_the_rules(tmp_path: Path) -> None:
    short = tmp_path / "short.token"
    short.write_text("abc")
    raw = {
        "daemon": {"metrics_port": 8000, "socket_group": _NO_GROUP},
        "api": {"url": "http://10.0.0.5:8000", "command": ["run-api", "{nope}"]},
        "inference": {"engine": "vllm", "model": "builtin:big", "token_file": str(short), "device": "bad"},
        "trainer": {
            "clip_eps_high": 0.1,
            "micro_batch_size": 48,
            "weight_sync": "shared",
            "dtype": "bfloat16",
            "optimizer": "adafactor",
        },
        "cluster": {"node_rank": 3},
        "env": [
            {"name": "api", "builtin": "arithmetic", "port_base": 9001, "stop_signal": "BOGUS"},
            {"name": "b", "builtin": "arithmetic", "group_size": 100, "command": ["x"]},
        ],
    }
    got = [path for path, _ in _problems(raw)]
    assert got == [
        "api.url",  # external components
        "trainer.clip_eps_high",  # the trainer's own keys
        "trainer.micro_batch_size",
        "trainer.weight_sync",  # engine × sync × mode
        "trainer.dtype",
        "inference.device",  # devices and model
        "inference.model",
        "daemon.metrics_port",  # the job's ports
        "cluster.node_rank",  # the cluster
        "inference.token_file",  # token files
        "env[0].name",  # each environment's rules, env[0] first
        "env[0].stop_signal",
        "env[0].port_base",  # its ports claimed after the job's
        "env[1]",
        "env[1].group_size",
        "api.command",  # the daemon
        "daemon.socket_group",
    ]


def test_an_environment_port_clash_names_the_first_claim() -> None:
    raw = {
        "env": [
            {"name": "a", "builtin": "arithmetic", "port_base": 7000, "replicas": 2},
            {"name": "b", "builtin": "arithmetic", "port_base": 7001},
        ]
    }
    assert _problems(raw) == [("env[1].port_base", "port 7001 is already used by env[0].port_base")]


def _rule_functions() -> dict[str, ast.FunctionDef]:
    """Every function of checks.py whose first parameter is a ``Checking``."""
    tree = ast.parse(Path(inspect.getfile(checks_module)).read_text(encoding="utf-8"))
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.args.args:
            ann = node.args.args[0].annotation
            if isinstance(ann, ast.Name) and ann.id == "Checking":
                out[node.name] = node
    return out


def test_every_rule_is_registered_once_and_short() -> None:
    rules = _rule_functions()
    registered = [f.__name__ for f in (*CHECKS, *ENV_CHECKS)]
    assert len(registered) == len(set(registered)), "a rule registered twice"
    assert sorted(registered) == sorted(rules), "a rule that never runs, or a registered function that is no rule"
    long = {name: n.end_lineno - n.lineno + 1 for name, n in rules.items() if (n.end_lineno or 0) - n.lineno >= 40}
    assert not long, f"rules of 40 lines or more (split them): {long}"


@pytest.mark.parametrize(
    ("trainer_device", "inference_device", "gpu"),
    [
        ("cuda:0", "cuda:0", "replica 0 on 'cuda:0', trainer rank 0 on 'cuda:0'"),
        ("cuda", ["cuda:1", "cuda:0"], "replica 1 on 'cuda:0', trainer rank 0 on 'cuda'"),
        (["cuda:0", "cuda:1"], ["cuda:2", "cuda:1,cuda:3"], "replica 1 on 'cuda:1', trainer rank 1 on 'cuda:1'"),
    ],
)
def test_broadcast_to_a_replica_on_a_trainer_ranks_gpu_is_refused_naming_the_gpu(
    trainer_device: str | list[str], inference_device: str | list[str], gpu: str
) -> None:
    """NCCL cannot put the trainer's rank and a replica's worker of one group on one GPU."""
    replicas = len(inference_device) if isinstance(inference_device, list) else 1
    raw = {
        "inference": {"device": inference_device, "replicas": replicas},
        "trainer": {"device": trainer_device, "weight_sync": "broadcast"},
    }
    problems = [m for path, m in _problems(raw) if path == "trainer.weight_sync"]
    assert len(problems) == 1, problems
    assert gpu in problems[0] and "NCCL" in problems[0] and '"push"' in problems[0]


def test_broadcast_to_replicas_on_gpus_of_their_own_is_accepted() -> None:
    cfg = parse_config(
        {
            "inference": {"device": ["cuda:2", "cuda:3"], "replicas": 2},
            "trainer": {"device": ["cuda:0", "cuda:1"], "weight_sync": "broadcast"},
        }
    )
    assert cfg.weight_sync == "broadcast"
    # and on the CPU (gloo) a replica beside the trainer is fine
    assert parse_config({"trainer": {"device": "cpu", "weight_sync": "broadcast"}}).weight_sync == "broadcast"

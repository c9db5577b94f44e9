"""Config: ``[inference] replicas`` and a list-valued ``[inference] device`` (SPEC §12.2)."""

from __future__ import annotations

import pytest

from atroposd.config import dump_toml, parse_toml
from atroposd.daemon.runtime import ports_to_check
from tests.support import config_problems


def test_one_replica_is_today() -> None:
    cfg = parse_toml("")
    assert cfg.inference.replicas == 1
    assert cfg.inference_urls == [cfg.inference_url] == ["http://127.0.0.1:9001"]
    assert cfg.inference_devices() == ["auto"]


def test_replica_i_listens_on_port_plus_i() -> None:
    cfg = parse_toml('[inference]\nreplicas = 3\nport = 9100\ndevice = "cpu"\n[trainer]\ndevice = "cpu"\n')
    assert cfg.inference_urls == ["http://127.0.0.1:9100", "http://127.0.0.1:9101", "http://127.0.0.1:9102"]
    assert cfg.inference_devices() == ["cpu"] * 3
    assert [p for _, p, _ in ports_to_check(cfg) if p >= 9100] == [9100, 9101, 9102]


def test_a_device_list_gives_each_replica_its_entry_and_round_trips() -> None:
    text = (
        '[inference]\nreplicas = 2\nengine = "vllm"\ndevice = ["cuda:0", "cuda:2,cuda:3"]\n'
        '[trainer]\ndevice = "cuda:1"\n'
    )
    cfg = parse_toml(text)
    assert cfg.inference_devices() == ["cuda:0", "cuda:2,cuda:3"]
    assert parse_toml(dump_toml(cfg)).inference == cfg.inference


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            '[inference]\nreplicas = 2\ndevice = ["cpu"]\n',
            "inference.device: a list must have exactly inference.replicas (2)",
        ),
        ('[inference]\nreplicas = 1\ndevice = ["cpu", "cpu"]\n', "inference.device: a list must have exactly"),
        ('[inference]\nreplicas = 2\ndevice = ["cpu", "tpu:0"]\n', "inference.device[1]: must be auto, cpu, cuda:N"),
        ('[inference]\nreplicas = 2\ndevice = ["cpu", "cuda:1,"]\n', "inference.device[1]: must be"),
        ('[inference]\ndevice = "cuda:0,cuda:1"\n', "inference.device: must be auto, cpu, cuda:N or a GPU UUID"),
        ("[inference]\ndevice = 3\n", "inference.device: must be a string or an array of strings, got an integer"),
        ("[inference]\ndevice = [1, 2]\n", "inference.device: element 0 must be a string"),
        ("[inference]\nreplicas = 0\n", "inference.replicas: must be ≥ 1"),
        (
            "[inference]\nreplicas = 2\nport = 7999\n",
            "inference.port: port 8000 (inference replica 1: port + 1) is already used by api.port",
        ),
        (
            "[inference]\nreplicas = 3\n[daemon]\nmetrics_port = 9003\n",
            "daemon.metrics_port: port 9003 is already used by inference.port (inference replica 2: port + 2)",
        ),
        (
            '[inference]\nreplicas = 2\n[[env]]\nname = "x"\ncommand = ["x"]\nport_base = 9002\n',
            "env[0].port_base: port 9002 is already used by inference.port (inference replica 1: port + 1)",
        ),
        (
            "[inference]\nreplicas = 3\nport = 65534\n",
            "inference.port: inference.port + inference.replicas - 1 must be",
        ),
        (
            '[inference]\nreplicas = 2\ndevice = ["cpu", "cuda:1"]\n'
            '[trainer]\ndevice = "cpu"\nweight_sync = "shared"\n',
            'trainer.weight_sync: "shared" needs the trainer and every inference replica on one device',
        ),
        (
            '[inference]\nreplicas = 2\nengine = "vllm"\ndevice = ["cuda:1", "cuda:0,cuda:2"]\n[trainer]\n'
            'device = "cuda:0"\n',
            "inference.vllm.gpu_memory_utilization: must be > 0",
        ),
    ],
)
def test_invalid_replica_settings_name_their_key(text: str, fragment: str) -> None:
    problems = config_problems(text)
    assert any(fragment in p for p in problems), problems


def test_shared_with_replicas_on_the_trainers_device_is_valid() -> None:
    cfg = parse_toml('[inference]\nreplicas = 2\ndevice = ["cpu", "cpu"]\n[trainer]\ndevice = "cpu"\n')
    assert cfg.weight_sync == "shared"


def test_the_inference_urls_placeholder_is_known() -> None:
    cfg = parse_toml('[[env]]\nname = "x"\ncommand = ["run", "--servers", "{inference_urls}"]\n')
    assert cfg.env[0].command[-1] == "{inference_urls}"

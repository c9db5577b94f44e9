"""The children's specs from the config: command lines, variables, probes, stop policy (no process)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from atroposd.config import Config, ConfigError, parse_config, parse_toml
from atroposd.daemon.specs import (
    API_READY_TIMEOUT,
    DEVICE_VAR,
    GPUS_VAR,
    TRAINER_GROUP_ENV,
    SpecInputs,
    all_specs,
    api_spec,
    child_base_env,
    env_specs,
    inference_spec,
    inference_specs,
    replica_device,
    trainer_group_env,
    trainer_rank_specs,
)
from atroposd.inference.vllm_engine import tensor_parallel_args
from atroposd.paths import Paths
from atroposd.process.probes import HttpProbe, InferenceProbe, RegisteredProbe, StartedProbe
from atroposd.process.unit import UnitSpec

PY = "/opt/py/bin/python3"
NONCE = "0123456789ab"
BASE_ENV = {"PATH": "/usr/bin", "HOME": "/home/u", "CUDA_VISIBLE_DEVICES": "0,1"}


def _config(**sections: Any) -> Config:
    raw: dict[str, Any] = {"daemon": {"runtime_dir": "/run/job", "state_dir": "/var/job", "stop_timeout": 7.0}}
    raw.update(sections)
    return parse_config(raw)


def _inputs(cfg: Config, base_env: dict[str, str] | None = None) -> SpecInputs:
    return SpecInputs(
        cfg=cfg,
        paths=Paths.of(cfg),
        nonce=NONCE,
        model="/models/m",
        tokenizer="/models/tok",
        base_env=dict(BASE_ENV) if base_env is None else base_env,
        python=PY,
    )


def _atroposd_vars(spec: UnitSpec) -> dict[str, str]:
    return {k: v for k, v in spec.env.items() if k.startswith("ATROPOSD_")}


CHILD_CONFIG = f"/run/job/config-{NONCE}.toml"


def test_built_in_job_with_two_env_replicas() -> None:
    cfg = _config(
        trainer={"seed": 10, "steps": 40, "max_token_len": 256},
        env=[{"name": "math", "builtin": "arithmetic", "replicas": 2, "port_base": 7100, "group_size": 4}],
    )
    ins = _inputs(cfg)
    specs = all_specs(ins)
    assert [s.name for s in specs] == ["api", "inference", "math-0", "math-1"]
    assert [s.kind for s in specs] == ["api", "inference", "env", "env"]
    api, inference, m0, m1 = specs

    assert api.argv == [PY, "-P", "-m", "atroposd", "api", "-c", CHILD_CONFIG]
    assert api.probe == HttpProbe("http://127.0.0.1:8000/info", {})
    assert api.ready_timeout == API_READY_TIMEOUT and api.stop_timeout == 7.0
    assert "ATROPOSD_GROUP_SIZE" not in api.env and api.env["ATROPOSD_NAME"] == "api"

    sock = "/run/job/inference-9001.sock"
    # the trainer is in this job and syncs through shared memory: the server waits for its weights
    assert inference.argv == [
        PY,
        "-P",
        "-m",
        "atroposd",
        "inference",
        "-c",
        CHILD_CONFIG,
        "--control-socket",
        sock,
        "--await-weights",
    ]
    assert inference.probe == InferenceProbe("http://127.0.0.1:9001", Path(sock))
    assert inference.death_signal == signal.SIGTERM
    assert inference.env["CUDA_VISIBLE_DEVICES"] == "0,1"  # device auto: the daemon's list

    for i, spec in enumerate((m0, m1)):
        name = f"math-{i}"
        assert spec.argv == [
            PY,
            "-P",
            "-m",
            "atroposd",
            "env",
            "arithmetic",
            "-c",
            CHILD_CONFIG,
            "--name",
            name,
            "--replica",
            str(i),
        ]
        assert _atroposd_vars(spec) == {
            "ATROPOSD_API_URL": "http://127.0.0.1:8000",
            "ATROPOSD_INFERENCE_URL": "http://127.0.0.1:9001",
            "ATROPOSD_INFERENCE_URLS": "http://127.0.0.1:9001",
            "ATROPOSD_OPENAI_URL": "http://127.0.0.1:9001/v1",
            "ATROPOSD_MODEL": "/models/m",
            "ATROPOSD_TOKENIZER": "/models/tok",
            "ATROPOSD_GROUP_SIZE": "4",
            "ATROPOSD_MAX_TOKEN_LEN": "256",
            "ATROPOSD_STEPS": "40",
            "ATROPOSD_NAME": name,
            "ATROPOSD_REPLICA": str(i),
            "ATROPOSD_SEED": str(10 + i),
            "ATROPOSD_REPLICA_PORT": str(7100 + i),
            "ATROPOSD_INSTANCE": NONCE,
            "ATROPOSD_WEIGHT": "1.0",
            "ATROPOSD_INFERENCE_TOKEN": "",  # the servers require none here
        }
        assert spec.env["PYTHONUNBUFFERED"] == "1" and spec.env["PATH"] == "/usr/bin"
        # two replicas: each is credited by its own name only, not by the environment's
        assert spec.probe == RegisteredProbe("http://127.0.0.1:8000", (name,), fallback=StartedProbe(1.0))
        assert spec.restart == "on-failure" and spec.stop_signal == signal.SIGTERM


def test_external_api_and_inference_with_a_command_environment() -> None:
    cfg = _config(
        api={"enabled": False, "url": "http://10.0.0.5:8000/", "token": "s3cret"},
        inference={"enabled": False, "url": "http://10.0.0.6:9001"},
        trainer={"enabled": False},
        env=[
            {
                "name": "web",
                "replicas": 2,
                "port_base": 7000,
                "ready": "started",
                "start_seconds": 0.5,
                "restart": "always",
                "max_restarts": 2,
                "restart_window": 9.0,
                "stop_signal": "INT",
                "ready_timeout": 33.0,
                "command": [
                    "serve",
                    "--api={api_url}",
                    "{openai_url}",
                    "--port",
                    "{replica_port}",
                    "--seed",
                    "{seed}",
                    "--model",
                    "{model}",
                    "{name}/{replica}",
                    "--weight={weight}",
                ],
                "weight": 0.25,
            }
        ],
    )
    specs = all_specs(_inputs(cfg))
    assert [s.name for s in specs] == ["web-0", "web-1"]  # external components are not supervised
    for i, spec in enumerate(specs):
        assert spec.argv == [
            "serve",
            "--api=http://10.0.0.5:8000",
            "http://10.0.0.6:9001/v1",
            "--port",
            str(7000 + i),
            "--seed",
            str(i),
            "--model",
            "/models/m",
            f"web-{i}/{i}",
            "--weight=0.25",
        ]
        assert spec.env["ATROPOSD_WEIGHT"] == "0.25"
        assert spec.env["ATROPOSD_API_URL"] == "http://10.0.0.5:8000"
        assert spec.env["ATROPOSD_INFERENCE_URL"] == "http://10.0.0.6:9001"
        assert spec.probe == StartedProbe(0.5)
        assert (spec.restart, spec.max_restarts, spec.restart_window) == ("always", 2, 9.0)
        assert spec.stop_signal == signal.SIGINT and spec.ready_timeout == 33.0 and spec.stop_timeout == 7.0


def test_a_single_replica_registers_under_its_name_or_the_environments_with_the_token() -> None:
    cfg = _config(api={"token": "s3cret"}, env=[{"name": "solo", "builtin": "arithmetic"}])
    (spec,) = env_specs(_inputs(cfg), cfg.env[0])
    assert spec.probe == RegisteredProbe(
        "http://127.0.0.1:8000",
        ("solo-0", "solo"),
        fallback=StartedProbe(1.0),
        headers={"Authorization": "Bearer s3cret"},
    )
    assert spec.env["ATROPOSD_REPLICA_PORT"] == ""  # no port_base
    assert api_spec(_inputs(cfg)).probe == HttpProbe("http://127.0.0.1:8000/info", {"Authorization": "Bearer s3cret"})


def test_api_command_gets_its_port() -> None:
    cfg = _config(api={"command": ["my-api", "--port", "{port}", "--model", "{tokenizer}"], "port": 8123})
    assert api_spec(_inputs(cfg)).argv == ["my-api", "--port", "8123", "--model", "/models/tok"]


@pytest.mark.parametrize("sync", ["shared", "push", "reload"])
def test_a_restarted_inference_server_waits_for_weights_in_every_mode(sync: str) -> None:
    cfg = _config(trainer={"weight_sync": sync})
    assert "--await-weights" in inference_spec(_inputs(cfg)).argv  # never the base model


def test_inference_on_a_gpu_by_uuid_without_a_trainer() -> None:
    cfg = _config(inference={"device": "GPU-6f1e", "port": 9100}, trainer={"enabled": False})
    spec = inference_spec(_inputs(cfg))
    assert "--await-weights" not in spec.argv  # nobody will send weights
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "GPU-6f1e"  # device 0 in the child
    assert spec.argv[-4:] == ["--port", "9100", "--device", "cuda:0"]


@pytest.mark.parametrize(
    ("configured", "expected"),
    [("SIGTERM", signal.SIGTERM), ("int", signal.SIGINT), ("SIGUSR1", signal.SIGUSR1), ("HUP", signal.SIGHUP)],
)
def test_stop_signal_names(configured: str, expected: signal.Signals) -> None:
    cfg = _config(env=[{"name": "e", "builtin": "arithmetic", "stop_signal": configured}])
    assert env_specs(_inputs(cfg), cfg.env[0])[0].stop_signal == expected


def test_children_never_inherit_systemds_variables() -> None:
    base = child_base_env(
        {
            **BASE_ENV,
            "NOTIFY_SOCKET": "/run/n",
            "WATCHDOG_USEC": "1",
            "WATCHDOG_PID": "1",
            "LISTEN_FDS": "1",
            "LISTEN_PID": "1",
            "LISTEN_FDNAMES": "x",
        }
    )
    assert base == BASE_ENV
    cfg = _config(env=[{"name": "e", "builtin": "arithmetic"}])
    for spec in all_specs(_inputs(cfg, base)):
        assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "LISTEN_FDS"} & set(spec.env)


def test_specs_are_a_pure_function_of_their_inputs() -> None:
    cfg = _config(env=[{"name": "math", "builtin": "arithmetic", "replicas": 3}])
    base = dict(BASE_ENV)
    ins = _inputs(cfg, base)
    first = all_specs(ins)
    assert all_specs(ins) == first  # same inputs, same specs
    assert base == BASE_ENV  # the daemon's environment is not written to
    for spec in first:
        spec.env["X"] = "1"
    assert all(spec.env is not base and "X" not in s.env for s, spec in zip(all_specs(ins), first, strict=True))


# ---------------------------------------------------------------------------- inference replicas (SPEC §12.2)


def test_two_inference_replicas_each_on_its_port_socket_and_device() -> None:
    cfg = _config(
        inference={"replicas": 2, "port": 9100, "device": ["cpu", "cpu"]},
        trainer={"device": "cpu"},
        env=[{"name": "math", "builtin": "arithmetic", "replicas": 3}],
    )
    specs = all_specs(_inputs(cfg))
    assert [s.name for s in specs] == ["api", "inference-0", "inference-1", "math-0", "math-1", "math-2"]
    for i, spec in enumerate(specs[1:3]):
        sock = f"/run/job/inference-{9100 + i}.sock"
        assert spec.kind == "inference"
        assert spec.argv == [
            PY,
            "-P",
            "-m",
            "atroposd",
            "inference",
            "-c",
            CHILD_CONFIG,
            "--control-socket",
            sock,
            "--port",
            str(9100 + i),
            "--device",
            "cpu",
            "--await-weights",
        ]
        # each replica's readiness: its own health and one real generation through its own socket
        assert spec.probe == InferenceProbe(f"http://127.0.0.1:{9100 + i}", Path(sock))
        assert spec.env["ATROPOSD_NAME"] == f"inference-{i}" and spec.env["ATROPOSD_REPLICA"] == str(i)
        assert spec.death_signal == signal.SIGTERM
    urls = "http://127.0.0.1:9100,http://127.0.0.1:9101"
    for i, spec in enumerate(specs[3:]):
        # environment replica i: inference replica i mod 2, and the list of all of them
        own = f"http://127.0.0.1:{9100 + i % 2}"
        assert spec.env["ATROPOSD_INFERENCE_URL"] == own and spec.env["ATROPOSD_OPENAI_URL"] == own + "/v1"
        assert spec.env["ATROPOSD_INFERENCE_URLS"] == urls
    api = specs[0]
    assert api.env["ATROPOSD_INFERENCE_URL"] == "http://127.0.0.1:9100"


def test_a_command_environment_gets_inference_url_and_urls() -> None:
    cfg = _config(
        inference={"replicas": 3},
        trainer={"enabled": False},
        env=[
            {
                "name": "web",
                "replicas": 4,
                "command": ["serve", "{inference_url}", "--all={inference_urls}", "{openai_url}"],
            }
        ],
    )
    specs = env_specs(_inputs(cfg), cfg.env[0])
    urls = ",".join(f"http://127.0.0.1:{9001 + r}" for r in range(3))
    for i, spec in enumerate(specs):
        own = f"http://127.0.0.1:{9001 + i % 3}"
        assert spec.argv == ["serve", own, f"--all={urls}", own + "/v1"]


def test_one_replica_keeps_todays_name_and_command_line() -> None:
    cfg = _config()
    (spec,) = inference_specs(_inputs(cfg))
    assert spec.name == "inference"
    assert "--port" not in spec.argv and "--device" not in spec.argv
    # a one-entry list is still one replica called "inference", told its device
    cfg = _config(inference={"device": ["cpu"]}, trainer={"device": "cpu"})
    (spec,) = inference_specs(_inputs(cfg))
    assert spec.name == "inference" and spec.argv[-5:] == ["--port", "9001", "--device", "cpu", "--await-weights"]


def test_replica_devices_several_gpus_and_uuids() -> None:
    cfg = _config(
        inference={"replicas": 3, "engine": "vllm", "device": ["cuda:1", "cuda:2,cuda:3", "GPU-6f1e"]},
        trainer={"device": "cuda:0"},
        env=[],
    )
    r0, r1, r2 = inference_specs(_inputs(cfg, {"PATH": "/usr/bin"}))
    # every GPU entry becomes the child's visible GPUs, and the child computes on its cuda:0
    assert r0.argv[r0.argv.index("--device") + 1] == "cuda:0" and r0.env["CUDA_VISIBLE_DEVICES"] == "1"
    assert r1.argv[r1.argv.index("--device") + 1] == "cuda:0" and r1.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert r2.argv[r2.argv.index("--device") + 1] == "cuda:0" and r2.env["CUDA_VISIBLE_DEVICES"] == "GPU-6f1e"
    # the number of GPUs travels to the engine: its tensor-parallel size
    assert [r.env[GPUS_VAR] for r in (r0, r1, r2)] == ["1", "2", "1"]


def test_a_daemon_with_its_own_visible_gpus_translates_every_entry() -> None:
    cfg = _config(
        inference={"replicas": 2, "device": ["cuda:1", "cuda:2,cuda:3"]},
        trainer={"device": ["cuda:0", "cuda:1"], "weight_sync": "push"},
        env=[],
    )
    ins = _inputs(cfg, {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    r0, r1 = inference_specs(ins)
    assert r0.env["CUDA_VISIBLE_DEVICES"] == "5" and r1.env["CUDA_VISIBLE_DEVICES"] == "6,7"
    (rank1,) = trainer_rank_specs(ins, store_address="127.0.0.1:1", secret="s", key=b"k" * 32, joined=lambda r: True)
    assert rank1.env["CUDA_VISIBLE_DEVICES"] == "5" and rank1.env[DEVICE_VAR] == "cuda:0"


def test_cpu_and_auto_keep_the_daemons_visible_gpus() -> None:
    for device in ("cpu", "auto"):
        cfg = _config(inference={"device": device}, trainer={"device": device})
        spec = inference_spec(_inputs(cfg))
        assert spec.env["CUDA_VISIBLE_DEVICES"] == "0,1" and "--device" not in spec.argv
        assert GPUS_VAR not in spec.env


def test_nccl_variables_are_set_over_the_environment_gloos_interface_only_defaulted() -> None:
    cfg = _config(trainer={"device": ["cpu", "cpu"], "weight_sync": "push"}, env=[])
    hostile = {
        "PATH": "/usr/bin",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "GLOO_SOCKET_IFNAME": "eth7",
    }
    (rank1,) = trainer_rank_specs(
        _inputs(cfg, hostile), store_address="127.0.0.1:1", secret="s", key=b"k" * 32, joined=lambda r: True
    )
    assert rank1.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert rank1.env["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert rank1.env["GLOO_SOCKET_IFNAME"] == "eth7"
    assert DEVICE_VAR not in rank1.env  # a CPU rank: nothing narrowed
    assert trainer_group_env(cfg, hostile) == {**TRAINER_GROUP_ENV, "GLOO_SOCKET_IFNAME": "eth7"}
    assert trainer_group_env(cfg, {"PATH": "/usr/bin"}) == TRAINER_GROUP_ENV


@pytest.mark.parametrize(
    ("extra", "gpus", "expected"),
    [
        ([], 1, []),
        ([], 2, ["--tensor-parallel-size", "2"]),
        (["--enable-prefix-caching"], 4, ["--enable-prefix-caching", "--tensor-parallel-size", "4"]),
        (["--tensor-parallel-size", "1"], 2, ["--tensor-parallel-size", "1"]),  # extra_args win
        (["-tp", "1"], 2, ["-tp", "1"]),
        (["--tensor-parallel-size=1"], 2, ["--tensor-parallel-size=1"]),
    ],
)
def test_vllm_tensor_parallel_size_follows_the_replicas_gpus(extra: list[str], gpus: int, expected: list[str]) -> None:
    assert tensor_parallel_args(extra, gpus) == expected


def _problems(raw: dict[str, Any] | str) -> list[str]:
    """What ``config check`` says of a config (none: [])."""
    try:
        parse_toml(raw) if isinstance(raw, str) else parse_config(raw)
    except ConfigError as exc:
        return [str(p) for p in exc.problems]
    return []


def _readme_several_gpu_example() -> str:
    text = (Path(__file__).parents[2] / "README.md").read_text()
    section = text[text.index("One node with 8 GPUs, 4 trainer ranks and 4 vLLM replicas") :]
    return section.split("```toml\n", 1)[1].split("```", 1)[0]


def test_the_readmes_several_gpu_example_places_every_process_on_its_own_gpu() -> None:
    import tomllib

    raw = tomllib.loads(_readme_several_gpu_example())
    assert _problems(_readme_several_gpu_example()) == []
    cfg = parse_config({**raw, "daemon": {"runtime_dir": "/run/job", "state_dir": "/var/job"}})
    ins = _inputs(cfg, {"PATH": "/usr/bin"})
    replicas = inference_specs(ins)
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in replicas] == ["4", "5", "6", "7"]
    assert all(r.argv[r.argv.index("--device") + 1] == "cuda:0" for r in replicas)
    ranks = trainer_rank_specs(ins, store_address="127.0.0.1:1", secret="s", key=b"k" * 32, joined=lambda r: True)
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in ranks] == ["1", "2", "3"]
    assert all(r.env[DEVICE_VAR] == "cuda:0" for r in ranks)
    # without gpu_memory_utilization it is still valid: no replica shares a trainer rank's GPU
    raw["inference"]["vllm"].pop("gpu_memory_utilization")
    assert _problems(raw) == []
    # a replica moved onto a trainer rank's GPU must say how much memory it may take
    raw["inference"]["device"] = ["cuda:3", "cuda:5", "cuda:6", "cuda:7"]
    problems = _problems(raw)
    assert any(
        p.startswith("inference.vllm.gpu_memory_utilization: must be > 0")
        and "replica 0 on 'cuda:3', trainer rank 3 on 'cuda:3'" in p
        for p in problems
    ), problems


@pytest.mark.parametrize(
    ("inference", "trainer", "refused"),
    [
        (["cuda", "cuda:1"], ["cuda:0"], True),  # cuda is cuda:0
        (["cuda:1,cuda:2", "cuda:3"], ["cuda:0", "cuda:2"], True),  # one GPU of a tensor-parallel entry
        (["cuda:1,cuda:2", "cuda:3"], ["cuda:0", "cuda:4"], False),
        (["cpu", "cpu"], ["cuda:0"], False),
    ],
)
def test_vllm_replica_overlapping_a_trainer_rank_is_refused(
    inference: list[str], trainer: list[str], refused: bool
) -> None:
    raw: dict[str, Any] = {
        "inference": {"engine": "vllm", "replicas": 2, "device": inference},
        "trainer": {"device": trainer, "weight_sync": "push"},
    }
    problems = _problems(raw)
    assert any(p.startswith("inference.vllm.gpu_memory_utilization") for p in problems) is refused, problems
    raw["inference"]["vllm"] = {"gpu_memory_utilization": 0.4}
    fixed = _problems(raw)
    assert not any(p.startswith("inference.vllm.gpu_memory_utilization") for p in fixed), fixed


@pytest.mark.parametrize(
    ("entry", "parent", "expected"),
    [
        ("cpu", "", ("cpu", None)),
        ("cuda:3", "4,5,6,7", ("cuda:0", "7")),
        ("cuda:3", "", ("cuda:0", "3")),
        ("cuda", "", ("cuda:0", "0")),
        ("auto", "4,5", ("auto", None)),
        ("cuda:2,cuda:3", "", ("cuda:0", "2,3")),
        ("cuda:2,cuda:3", "4,5,6,7", ("cuda:0", "6,7")),  # the daemon's own numbering
        ("cuda:0,GPU-ab12", "3", ("cuda:0", "3,GPU-ab12")),
        ("GPU-ab12", "", ("cuda:0", "GPU-ab12")),
    ],
)
def test_replica_device(entry: str, parent: str, expected: tuple[str, str | None]) -> None:
    env = {"CUDA_VISIBLE_DEVICES": parent} if parent else {}
    assert replica_device(entry, env) == expected


@pytest.mark.parametrize("engine", ["torch", "vllm"])
def test_every_replica_gets_nccls_error_handling_and_a_vllm_one_spawns_its_workers(engine: str) -> None:
    """SPEC §12.1: every process that may build an NCCL group (a replica: broadcast) has NCCL's
    error handling set over the environment; a vLLM replica starts its engine's workers by
    spawn and asks NVML, not CUDA, whether a GPU is there — whatever the environment said."""
    hostile = {
        "PATH": "/usr/bin",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "fork",
        "PYTORCH_NVML_BASED_CUDA_CHECK": "0",
    }
    extra = {"vllm": {"gpu_memory_utilization": 0.4}} if engine == "vllm" else {}
    cfg = _config(
        inference={"engine": engine, "replicas": 2, "device": ["cuda:1", "cuda:2,cuda:3"], **extra},
        trainer={"device": "cuda:0", "weight_sync": "broadcast" if engine == "torch" else "push"},
        env=[],
    )
    for spec in inference_specs(_inputs(cfg, hostile)):
        assert spec.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
        assert spec.env["TORCH_NCCL_ENABLE_MONITORING"] == "0"
        if engine == "vllm":
            assert spec.env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
            assert spec.env["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
        else:  # the torch engine never forks a CUDA worker: the environment's own values stay
            assert spec.env["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"

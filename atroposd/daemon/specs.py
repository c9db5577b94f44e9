"""The children's specs, built from the config: a pure function, no process started (SPEC §3, §4).

:class:`SpecInputs` holds everything a spec depends on — the config, the paths, the
instance nonce, the resolved model and tokenizer, and the environment the daemon was
given — and :func:`api_spec`, :func:`inference_spec` and :func:`env_specs` turn it into
:class:`~atroposd.process.unit.UnitSpec` objects: command line, environment variables
(the placeholders of SPEC §3 as ``ATROPOSD_*``), readiness probe and stop policy.
"""

from __future__ import annotations

import functools
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from atroposd import gpuenv, heartbeat
from atroposd.config import Config, EnvConfig, fill_placeholders
from atroposd.net import is_loopback
from atroposd.paths import Paths
from atroposd.process.liveness import (
    ActivityLiveCheck,
    HeartbeatBoard,
    HeartbeatLiveCheck,
    HttpLiveCheck,
    InferenceLiveCheck,
    LiveCheck,
    LiveSettings,
)
from atroposd.process.probes import (
    ConditionProbe,
    HttpProbe,
    InferenceProbe,
    Probe,
    RegisteredProbe,
    StartedProbe,
)
from atroposd.process.unit import UnitSpec
from atroposd.pyexec import python_module
from atroposd.trainer.wandb_sink import wandb_group

API_READY_TIMEOUT = 60.0
# systemd's variables are for the daemon alone: no child inherits them.
SYSTEMD_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")


def child_base_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment every child starts from: the daemon's, less systemd's variables."""
    return {k: v for k, v in environ.items() if k not in SYSTEMD_VARS}


@dataclass(frozen=True)
class SpecInputs:
    """Everything the children's specs depend on."""

    cfg: Config
    paths: Paths
    nonce: str
    model: str
    tokenizer: str
    base_env: Mapping[str, str]
    python: str = sys.executable
    # The daemon's heartbeat receiver; None: environments' liveness falls back to CPU use.
    board: HeartbeatBoard | None = None

    @property
    def child_config(self) -> str:
        """The resolved config file the built-in children read (``-c``)."""
        return str(self.paths.child_config(self.nonce))

    @property
    def heartbeat_socket(self) -> Path:
        return self.paths.runtime_dir / heartbeat.SOCKET_NAME


def api_headers(cfg: Config) -> dict[str, str]:
    """The Authorization header for the trajectory API, if it has a token."""
    return {"Authorization": f"Bearer {cfg.api.token}"} if cfg.api.token else {}


def inference_headers(cfg: Config) -> dict[str, str]:
    """The Authorization header for the inference servers' TCP routes, if they require a token
    (``cfg.inference.token``, resolved by the daemon at start; SPEC §12.3)."""
    return {"Authorization": f"Bearer {cfg.inference.token}"} if cfg.inference.token else {}


def placeholder_values(
    ins: SpecInputs, *, name: str = "", replica: int = 0, env: EnvConfig | None = None
) -> dict[str, str]:
    """The values of SPEC §3's placeholders for one child (``{port}`` excepted)."""
    c = ins.cfg
    urls = c.inference_urls
    # An environment replica's own inference replica (replica index mod replicas); others: replica 0.
    url = urls[replica % len(urls)] if env is not None else urls[0]
    values = {
        "api_url": c.api_url,
        "inference_url": url,
        "inference_urls": ",".join(urls),
        "openai_url": url + "/v1",
        "model": ins.model,
        "tokenizer": ins.tokenizer,
        "group_size": str(env.group_size if env else 0),
        "max_token_len": str(c.trainer.max_token_len),
        "steps": str(c.trainer.steps),
        "name": name,
        "replica": str(replica),
        "seed": str(c.trainer.seed + replica),
        "replica_port": str(env.port_base + replica) if env and env.port_base else "",
        # {inference_token} / ATROPOSD_INFERENCE_TOKEN: "" when the servers require none
        "inference_token": c.inference.token,
    }
    group = wandb_group(c)
    if group:  # {wandb_group} / ATROPOSD_WANDB_GROUP: only when there is one
        values["wandb_group"] = group
    if env is not None:
        values["weight"] = str(env.weight)  # {weight} / ATROPOSD_WEIGHT: environments only
    return values


def child_env(ins: SpecInputs, values: Mapping[str, str]) -> dict[str, str]:
    """The base environment plus ``ATROPOSD_<PLACEHOLDER>`` for each value and the nonce."""
    env = dict(ins.base_env)
    env.update({f"ATROPOSD_{k.upper()}": v for k, v in values.items()})
    env["ATROPOSD_INSTANCE"] = ins.nonce
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _atroposd(ins: SpecInputs, *args: str) -> list[str]:
    """``python -m atroposd ARGS`` with the working directory kept off ``sys.path``."""
    return [*python_module("atroposd", executable=ins.python), *args]


def api_spec(ins: SpecInputs) -> UnitSpec:
    """The trajectory API: ``api.command`` with its placeholders, or the built-in server."""
    c = ins.cfg
    values = placeholder_values(ins, name="api")
    if c.api.command:
        argv = fill_placeholders(c.api.command, {"wandb_group": "", **values, "port": str(c.api.port)})
    else:
        argv = _atroposd(ins, "api", "-c", ins.child_config)
    values.pop("group_size")
    live = LiveSettings(c.api.live_interval, c.api.live_timeout, c.api.live_failures)
    return UnitSpec(
        name="api",
        kind="api",
        argv=argv,
        env=child_env(ins, values),
        probe=HttpProbe(f"{c.api_url}/info", api_headers(c)),
        ready_timeout=API_READY_TIMEOUT,
        stop_timeout=c.daemon.stop_timeout,
        live=live,
        live_check=HttpLiveCheck(f"{c.api_url}/info", c.api.live_timeout, api_headers(c)),
    )


def inference_name(cfg: Config, replica: int) -> str:
    """The component name of an inference replica: ``inference`` alone, else ``inference-<i>``."""
    return "inference" if cfg.inference.replicas == 1 else f"inference-{replica}"


def gpu_entries(entry: str) -> list[str]:
    """The GPUs one device entry names (``cuda``, ``cuda:N``, a UUID, a comma-separated list of
    them), or ``[]`` for ``cpu`` and ``auto``."""
    gpus = [g.strip() for g in entry.split(",") if g.strip()]
    if not gpus or any(g in ("cpu", "auto") for g in gpus):
        return []
    return ["cuda:0" if g == "cuda" else g for g in gpus]


def replica_device(entry: str, base_env: Mapping[str, str]) -> tuple[str, str | None]:
    """``(--device for the child, CUDA_VISIBLE_DEVICES for it or None)`` for one device entry.

    Every GPU entry — ``cuda:N``, a GPU UUID, several (``"cuda:2,cuda:3"``, a tensor-parallel
    vLLM replica) — becomes the child's visible GPUs, numbered as the daemon numbers them
    (through the daemon's own CUDA_VISIBLE_DEVICES when it has one), and the child computes on
    its ``cuda:0`` (SPEC §12.2). ``cpu`` and ``auto`` leave the daemon's list alone.
    """
    gpus = gpu_entries(entry)
    if not gpus:
        return entry, None
    parent = [d.strip() for d in base_env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    visible = []
    for gpu in gpus:
        if gpu.startswith("cuda:"):
            index = int(gpu.removeprefix("cuda:"))
            visible.append(parent[index] if parent and index < len(parent) else str(index))
        else:
            visible.append(gpu)
    return "cuda:0", ",".join(visible)


# The number of GPUs a vLLM replica was given (SPEC §12.2): its --tensor-parallel-size unless
# inference.vllm.extra_args sets one.
GPUS_VAR = "ATROPOSD_GPUS"
# The device a trainer rank computes on when the daemon narrowed its visible GPUs (its cuda:0).
DEVICE_VAR = "ATROPOSD_DEVICE"


def inference_spec(ins: SpecInputs, replica: int = 0) -> UnitSpec:
    """One inference replica (replica i on ``port + i``), with its weight-control socket."""
    c = ins.cfg
    port = c.inference.port + replica
    sock = ins.paths.inference_socket(port)
    argv = _atroposd(ins, "inference", "-c", ins.child_config, "--control-socket", str(sock))
    entry = c.inference_devices()[replica]
    device, visible = replica_device(entry, ins.base_env)
    if c.inference.replicas > 1 or isinstance(c.inference.device, list) or visible is not None:
        argv += ["--port", str(port), "--device", device]
    if c.trainer.enabled:
        # Every mode: a (re)started server waits for the trainer's current weights before it
        # serves, never the base model (SPEC §4).
        argv.append("--await-weights")
    name = inference_name(c, replica)
    env = child_env(ins, placeholder_values(ins, name=name, replica=replica))
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
        env[GPUS_VAR] = str(len(gpu_entries(entry)))
    # A replica may join an NCCL group (broadcast); a vLLM one starts its workers by spawn (SPEC §12.1).
    gpuenv.apply(env, vllm=c.inference.engine == "vllm")
    # SIGTERM on the daemon's death: the server shuts its engine (and its process group) down.
    i = c.inference
    live = LiveSettings(i.live_interval, i.live_timeout, i.live_failures)
    check = InferenceLiveCheck(
        c.inference_urls[replica],
        sock,
        timeout=i.live_timeout,
        generate_every=i.live_generate_every,
        failures=i.live_failures,
        headers=inference_headers(c),
    )
    return UnitSpec(
        name=name,
        kind="inference",
        argv=argv,
        env=env,
        probe=InferenceProbe(c.inference_urls[replica], sock, inference_headers(c)),
        ready_timeout=c.inference.ready_timeout,
        stop_timeout=c.daemon.stop_timeout,
        death_signal=signal.SIGTERM,
        live=live,
        live_check=check,
    )


def inference_specs(ins: SpecInputs) -> list[UnitSpec]:
    """Every inference replica, replica 0 first."""
    return [inference_spec(ins, i) for i in range(ins.cfg.inference.replicas)]


# The variables that pin gloo to loopback on one node and keep NCCL from ending the daemon on a
# failed collective (SPEC §12.1): the daemon sets them for itself and gives them to every rank.
# The NCCL ones are set, overriding the environment (its defaults end the process on a failed
# collective, which would pre-empt the group restart); gloo's interface is only a default.
TRAINER_GROUP_ENV = {"GLOO_SOCKET_IFNAME": "lo", **gpuenv.NCCL_ENV}
TRAINER_GROUP_DEFAULTS = ("GLOO_SOCKET_IFNAME",)


def trainer_group_env(cfg: Config, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """TRAINER_GROUP_ENV for this job: gloo stays on loopback unless the nodes are separate
    machines (then the launcher's GLOO_SOCKET_IFNAME, if any, names the interface). With
    ``environ``, a GLOO_SOCKET_IFNAME already there is kept; the NCCL variables never are."""
    env = dict(TRAINER_GROUP_ENV)
    if cfg.cluster.enabled and not is_loopback(cfg.cluster.head):
        del env["GLOO_SOCKET_IFNAME"]
    if environ is not None:
        env.update({k: environ[k] for k in TRAINER_GROUP_DEFAULTS if k in env and k in environ})
    return env


def trainer_rank_specs(
    ins: SpecInputs, *, store_address: str, secret: str, key: bytes, joined: Callable[[int], bool]
) -> list[UnitSpec]:
    """This node's trainer ranks other than 0 (``atroposd trainer-rank``), components
    ``trainer-<global rank>``: ready once joined (``joined(rank)``); never restarted alone — a
    rank's exit restarts the whole group. On a node other than the head, its first rank feeds
    the node's inference replicas (SPEC §12.3). ``key`` (the group's command key) reaches each
    rank through its environment only, never argv or the store."""
    from atroposd.trainer.follower import KEY_VAR, SECRET_VAR, STORE_VAR
    from atroposd.weights.node_feed import NODE_REPLICAS_VAR

    c = ins.cfg
    out = []
    first = c.node_rank * c.trainer.local_ranks
    for local, device in enumerate(c.trainer.devices()):
        rank = first + local
        if rank == 0:
            continue
        name = f"trainer-{rank}"
        env = child_env(ins, {})
        env.update(trainer_group_env(c, ins.base_env))
        env.update({STORE_VAR: store_address, SECRET_VAR: secret, KEY_VAR: key.hex()})
        if local == 0 and c.inference.enabled and c.weight_sync in ("push", "reload"):
            env[NODE_REPLICAS_VAR] = ",".join(
                str(ins.paths.inference_socket(c.inference.port + i)) for i in range(c.inference.replicas)
            )
        own, visible = replica_device(device, ins.base_env)
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
            env[DEVICE_VAR] = own
        argv = _atroposd(ins, "trainer-rank", "-c", ins.child_config, "--rank", str(rank))
        out.append(
            UnitSpec(
                name=name,
                kind="trainer",
                argv=argv,
                env=env,
                probe=ConditionProbe("joined the trainer group", functools.partial(joined, rank)),
                ready_timeout=c.trainer.join_timeout,
                stop_timeout=c.daemon.stop_timeout,
                restart="never",
            )
        )
    return out


def stop_signal_of(e: EnvConfig) -> signal.Signals:
    """``stop_signal`` as configured (``"TERM"`` or ``"SIGTERM"``) as a signal."""
    sig = e.stop_signal.upper()
    return signal.Signals[sig if sig.startswith("SIG") else "SIG" + sig]


def env_specs(ins: SpecInputs, e: EnvConfig) -> list[UnitSpec]:
    """One spec per replica of an ``[[env]]``: ``command`` with its placeholders, or a built-in."""
    specs = []
    stop_signal = stop_signal_of(e)
    # Several machines: replicas are numbered across the nodes (SPEC §12.3), so no two nodes run
    # the same one (names, {replica}, {seed}).
    first = ins.cfg.node_rank * e.replicas
    for i in range(first, first + e.replicas):
        name = f"{e.name}-{i}"
        values = placeholder_values(ins, name=name, replica=i, env=e)
        if e.command:
            argv = fill_placeholders(e.command, {"wandb_group": "", **values})
        else:
            argv = _atroposd(ins, "env", e.builtin, "-c", ins.child_config, "--name", name, "--replica", str(i))
        probe: Probe = StartedProbe(e.start_seconds)
        if e.ready == "registered":
            names = (name, e.name) if e.replicas == 1 else (name,)
            probe = RegisteredProbe(
                ins.cfg.api_url, names, fallback=StartedProbe(e.start_seconds), headers=api_headers(ins.cfg)
            )
        env = _wandb_env(ins, child_env(ins, values))
        if ins.cfg.sandbox.engine:  # SPEC §16: the replica's own engine socket, served by the daemon
            sandbox_env(ins, name, env)
        live, check = env_liveness(ins, e)
        if ins.board is not None:
            env[heartbeat.ENV_SOCKET] = str(ins.heartbeat_socket)
            env[heartbeat.ENV_INTERVAL] = f"{min(1.0, max(0.05, e.live_timeout / 3)):g}"
        specs.append(
            UnitSpec(
                name=name,
                kind="env",
                argv=argv,
                env=env,
                probe=probe,
                ready_timeout=e.ready_timeout,
                stop_timeout=ins.cfg.daemon.stop_timeout,
                stop_signal=stop_signal,
                restart=e.restart,
                max_restarts=e.max_restarts,
                restart_window=e.restart_window,
                live=live,
                live_check=check,
            )
        )
    return specs


def sandbox_env(ins: SpecInputs, name: str, env: dict[str, str]) -> None:
    """``DOCKER_HOST`` on the replica's own socket; the docker CLI's other ways of naming an
    engine (a context, TLS settings) removed so that nothing bypasses it."""
    from atroposd.sandbox.labels import socket_path

    for key in ("DOCKER_CONTEXT", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH"):
        env.pop(key, None)
    env["DOCKER_HOST"] = f"unix://{socket_path(ins.paths.runtime_dir, name)}"


def env_liveness(ins: SpecInputs, e: EnvConfig) -> tuple[LiveSettings, LiveCheck]:
    """A built-in environment heartbeats; a ``command`` one is live while it uses CPU, beats,
    or registers with the API (SPEC §4)."""
    live = LiveSettings(e.live_interval, e.live_timeout, e.live_failures)
    check: LiveCheck
    if e.command or ins.board is None:
        check = ActivityLiveCheck(ins.board, ins.cfg.api_url, e.live_timeout, api_headers(ins.cfg))
    else:
        check = HeartbeatLiveCheck(ins.board, e.live_timeout)
    return live, check


def _wandb_env(ins: SpecInputs, env: dict[str, str]) -> dict[str, str]:
    """An environment's own W&B runs group with the trainer's (and stay offline when it is)."""
    w = ins.cfg.wandb
    if env.get("ATROPOSD_WANDB_GROUP"):
        env["WANDB_RUN_GROUP"] = env["ATROPOSD_WANDB_GROUP"]
    if w.enabled and w.mode == "offline":
        env.setdefault("WANDB_MODE", "offline")
    return env


def all_specs(ins: SpecInputs) -> list[UnitSpec]:
    """Every supervised child of the config, in start order (API, inference, environments)."""
    out: list[UnitSpec] = []
    if ins.cfg.api.enabled:
        out.append(api_spec(ins))
    if ins.cfg.inference.enabled:
        out += inference_specs(ins)
    for e in ins.cfg.env:
        out += env_specs(ins, e)
    return out

"""The children's specs, built from the config: a pure function, no process started (SPEC §3, §4).

:class:`SpecInputs` holds everything a spec depends on — the config, the paths, the
instance nonce, the resolved model and tokenizer, and the environment the daemon was
given — and :func:`api_spec`, :func:`inference_spec` and :func:`env_specs` turn it into
:class:`~atroposd.process.unit.UnitSpec` objects: command line, environment variables
(the placeholders of SPEC §3 as ``ATROPOSD_*``), readiness probe and stop policy.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from atroposd.config import Config, EnvConfig, fill_placeholders
from atroposd.paths import Paths
from atroposd.process.probes import HttpProbe, InferenceProbe, Probe, RegisteredProbe, StartedProbe
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

    @property
    def child_config(self) -> str:
        """The resolved config file the built-in children read (``-c``)."""
        return str(self.paths.child_config(self.nonce))


def api_headers(cfg: Config) -> dict[str, str]:
    """The Authorization header for the trajectory API, if it has a token."""
    return {"Authorization": f"Bearer {cfg.api.token}"} if cfg.api.token else {}


def placeholder_values(ins: SpecInputs, *, name: str = "", replica: int = 0,
                       env: EnvConfig | None = None) -> dict[str, str]:
    """The values of SPEC §3's placeholders for one child (``{port}`` excepted)."""
    c = ins.cfg
    values = {
        "api_url": c.api_url, "inference_url": c.inference_url, "openai_url": c.inference_url + "/v1",
        "model": ins.model, "tokenizer": ins.tokenizer,
        "group_size": str(env.group_size if env else 0), "max_token_len": str(c.trainer.max_token_len),
        "steps": str(c.trainer.steps), "name": name, "replica": str(replica),
        "seed": str(c.trainer.seed + replica),
        "replica_port": str(env.port_base + replica) if env and env.port_base else "",
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
    return UnitSpec(name="api", kind="api", argv=argv, env=child_env(ins, values),
                    probe=HttpProbe(f"{c.api_url}/info", api_headers(c)), ready_timeout=API_READY_TIMEOUT,
                    stop_timeout=c.daemon.stop_timeout)


def inference_spec(ins: SpecInputs) -> UnitSpec:
    """The inference server, with its weight-control socket."""
    c = ins.cfg
    sock = ins.paths.inference_socket(c.inference.port)
    argv = _atroposd(ins, "inference", "-c", ins.child_config, "--control-socket", str(sock))
    if c.trainer.enabled:
        # Every mode: a (re)started server waits for the trainer's current weights before it
        # serves, never the base model (SPEC §4).
        argv.append("--await-weights")
    env = child_env(ins, placeholder_values(ins, name="inference"))
    if c.inference.device.startswith(("GPU-", "MIG-")):
        # A GPU named by UUID is device 0 in the child (cuda:N keeps the daemon's numbering).
        env["CUDA_VISIBLE_DEVICES"] = c.inference.device
    # SIGTERM on the daemon's death: the server shuts its engine (and its process group) down.
    return UnitSpec(name="inference", kind="inference", argv=argv, env=env,
                    probe=InferenceProbe(c.inference_url, sock), ready_timeout=c.inference.ready_timeout,
                    stop_timeout=c.daemon.stop_timeout, death_signal=signal.SIGTERM)


def stop_signal_of(e: EnvConfig) -> signal.Signals:
    """``stop_signal`` as configured (``"TERM"`` or ``"SIGTERM"``) as a signal."""
    sig = e.stop_signal.upper()
    return signal.Signals[sig if sig.startswith("SIG") else "SIG" + sig]


def env_specs(ins: SpecInputs, e: EnvConfig) -> list[UnitSpec]:
    """One spec per replica of an ``[[env]]``: ``command`` with its placeholders, or a built-in."""
    specs = []
    stop_signal = stop_signal_of(e)
    for i, name in enumerate(e.replica_names()):
        values = placeholder_values(ins, name=name, replica=i, env=e)
        if e.command:
            argv = fill_placeholders(e.command, {"wandb_group": "", **values})
        else:
            argv = _atroposd(ins, "env", e.builtin, "-c", ins.child_config, "--name", name, "--replica", str(i))
        probe: Probe = StartedProbe(e.start_seconds)
        if e.ready == "registered":
            names = (name, e.name) if e.replicas == 1 else (name,)
            probe = RegisteredProbe(ins.cfg.api_url, names, fallback=StartedProbe(e.start_seconds),
                                    headers=api_headers(ins.cfg))
        specs.append(UnitSpec(name=name, kind="env", argv=argv, env=_wandb_env(ins, child_env(ins, values)), probe=probe,
                              ready_timeout=e.ready_timeout, stop_timeout=ins.cfg.daemon.stop_timeout,
                              stop_signal=stop_signal, restart=e.restart, max_restarts=e.max_restarts,
                              restart_window=e.restart_window))
    return specs


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
        out.append(inference_spec(ins))
    for e in ins.cfg.env:
        out += env_specs(ins, e)
    return out

"""The rules between keys (``config check``): each rule a function of one ``Checking`` (the built
config, the raw mapping it came from, the problems so far and the ports claimed so far), run in
the order of ``CHECKS``, an environment's rules in the order of ``ENV_CHECKS``, so that the
problems come out in the same order every time."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from atroposd.config.errors import Problem
from atroposd.config.placeholders import unknown_placeholders
from atroposd.config.schema import (
    BUILTIN_MODELS,
    DEVICE_PATTERN,
    ENV_NAME_PATTERN,
    REPLICA_DEVICE_PATTERN,
    RESERVED_NAMES,
    SANDBOX_ENGINE_PATTERN,
    SOCKET_PATH_MAX,
    URL_PATTERN,
    ClusterError,
    Config,
    EnvConfig,
)
from atroposd.config.tokens import CLUSTER_CREDENTIAL, TokenError, read_token_file
from atroposd.devices import same_device
from atroposd.envoptions import BUILTIN_ENVS, validate_options
from atroposd.net import is_loopback

_NAME_RE = re.compile(ENV_NAME_PATTERN)


@dataclass
class Checking:
    """What the rules share while they run: the problems found and the ports claimed so far."""

    cfg: Config
    raw: Mapping[str, Any]
    problems: list[Problem] = field(default_factory=list)
    ports: dict[int, str] = field(default_factory=dict)
    env_names: dict[str, int] = field(default_factory=dict)  # name → the first env[i] with it

    def add(self, path: str, message: str) -> None:
        self.problems.append(Problem(path, message))

    def claim(self, port: int, path: str, who: str = "") -> None:
        """``who``: how the port is derived from ``path`` (an inference replica's port + i)."""
        if port in self.ports:
            self.add(path, f"port {port}{f' ({who})' if who else ''} is already used by {self.ports[port]}")
        else:
            self.ports[port] = f"{path} ({who})" if who else path

    @functools.cached_property
    def sync(self) -> str:
        """The resolved weight-sync mode (computed once, by the first rule that asks)."""
        return self.cfg.weight_sync


def cross_checks(cfg: Config, raw: Mapping[str, Any]) -> list[Problem]:
    """Every rule of ``CHECKS`` on ``cfg``, built from ``raw``: the problems, in order."""
    c = Checking(cfg, raw)
    for check in CHECKS:
        check(c)
    return c.problems


# ---------------------------------------------------------------------------- components


def _external_urls(c: Checking) -> None:
    """External components: ``url`` given exactly when ``enabled = false``."""
    for name, sec in (("api", c.cfg.api), ("inference", c.cfg.inference)):
        if not sec.enabled and not sec.url:
            c.add(f"{name}.url", f"required when {name}.enabled = false")
        if sec.enabled and sec.url:
            c.add(
                f"{name}.url",
                f"must be empty when {name}.enabled = true (the daemon runs it at {name}.host:{name}.port)",
            )
        if sec.url and not re.match(URL_PATTERN, sec.url):
            c.add(f"{name}.url", f"must be an http:// or https:// URL, got {sec.url!r}")


# ---------------------------------------------------------------------------- trainer


def _trainer_loss(c: Checking) -> None:
    t = c.cfg.trainer
    for key in ("clip_eps", "clip_eps_high"):
        value = getattr(t, key)
        if isinstance(value, str) and value != "auto":
            c.add(f"trainer.{key}", f'must be a number or "auto", got {value!r}')
    eps, high = t.clip_range()
    if 0 < high < eps:
        auto = f' (here "auto": {high:g} for loss = "{t.loss}")' if isinstance(t.clip_eps_high, str) else ""
        c.add(
            "trainer.clip_eps_high",
            f"must be ≥ trainer.clip_eps ({eps:g}) or 0 (off){auto}: clip-higher widens the upper bound",
        )
    if t.loss == "awsft":
        for key, default in (("clip_eps_high", 0.0), ("rollout_correction", "none")):
            value = getattr(t, key)
            if value != default and value != "auto":
                c.add(f"trainer.{key}", 'has no effect with trainer.loss = "awsft" (no importance ratio)')


def _trainer_sizes(c: Checking) -> None:
    t, inf = c.cfg.trainer, c.cfg.inference
    if t.micro_batch_size > t.batch_size:
        c.add("trainer.micro_batch_size", f"must be ≤ trainer.batch_size ({t.batch_size})")
    elif t.batch_size % t.micro_batch_size:
        c.add("trainer.micro_batch_size", f"must divide trainer.batch_size ({t.batch_size})")
    if len(t.adam_betas) != 2 or not all(0 <= b < 1 for b in t.adam_betas):
        c.add("trainer.adam_betas", "must be two numbers in [0, 1)")
    if t.max_token_len > inf.max_model_len:
        c.add("trainer.max_token_len", f"must be ≤ inference.max_model_len ({inf.max_model_len})")
    if 0 < t.micro_batch_tokens < t.max_token_len:
        c.add(
            "trainer.micro_batch_tokens",
            f"must be 0 (off) or ≥ trainer.max_token_len ({t.max_token_len}): "
            "every sequence must fit in one micro-batch",
        )
    if t.mode == "lora" and not t.lora_targets:
        c.add("trainer.lora_targets", 'must name at least one module when trainer.mode = "lora"')


# ---------------------------------------------------------------------------- engine × sync × mode (SPEC §7)


def _sync_engine_mode(c: Checking) -> None:
    """The sync modes an engine and a training mode allow."""
    t, inf = c.cfg.trainer, c.cfg.inference
    if not t.enabled:
        return
    if inf.engine == "vllm" and c.sync == "shared":
        c.add(
            "trainer.weight_sync",
            '"shared" is not possible with inference.engine = "vllm" '
            '(vLLM fuses and repacks weights); use "push" or "reload"',
        )
    if t.mode == "lora":
        allowed = ("shared", "reload") if inf.engine == "torch" else ("reload",)
        if c.sync not in allowed:
            c.add(
                "trainer.weight_sync",
                f"must be {' or '.join(map(repr, allowed))} with "
                f'trainer.mode = "lora" and inference.engine = '
                f'"{inf.engine}"',
            )


def _sync_ranks(c: Checking) -> None:
    """What several trainer ranks rule out."""
    t = c.cfg.trainer
    if not t.enabled:
        return
    if t.ranks > 1 and c.sync == "shared":
        c.add(
            "trainer.weight_sync",
            f'"shared" needs one trainer rank (trainer.device lists '
            f"{t.ranks}): sharded parameters cannot be mapped by a server; "
            'use "push" or "reload"',
        )
    if t.ranks > 1 and t.mode == "lora":
        c.add(
            "trainer.mode",
            f'"lora" is not supported with several trainer ranks (trainer.device '
            f"lists {t.ranks}): a LoRA model's adapters are small enough for one "
            "rank; list one device",
        )


def _sync_shared_device(c: Checking) -> None:
    """``shared``: the trainer and every inference replica on one device."""
    cfg, t = c.cfg, c.cfg.trainer
    if not t.enabled:
        return
    if c.sync == "shared" and cfg.inference.enabled and t.ranks == 1:
        for d in dict.fromkeys(cfg.inference_devices()):
            if "," in d or same_device(t.devices()[0], d) is False:
                c.add(
                    "trainer.weight_sync",
                    f'"shared" needs the trainer and every inference '
                    f"replica on one device (trainer.device = {t.device!r}, "
                    f'inference.device = {d!r}); use "push"',
                )
                break


def _sync_dtypes(c: Checking) -> None:
    """The compute dtype a sync mode hands the replicas as it is; the bfloat16 master weights."""
    t, inf = c.cfg.trainer, c.cfg.inference
    if not t.enabled:
        return
    if (
        t.compute_dtype != "auto"
        and inf.dtype != "auto"
        and t.compute_dtype != inf.dtype
        and c.sync in ("shared", "push", "broadcast")
    ):
        c.add(
            "trainer.compute_dtype",
            f"{t.compute_dtype!r} differs from inference.dtype = "
            f"{inf.dtype!r}: replicas receive the trainer's working "
            f"copy as it is with weight_sync = {c.sync!r}; use the "
            'inference dtype or "reload"',
        )
    if t.dtype == "bfloat16" and t.optimizer != "adamw":
        c.add(
            "trainer.dtype",
            f'"bfloat16" needs the compensated AdamW (trainer.optimizer = "adamw"), not {t.optimizer!r}',
        )


def _sync_placement(c: Checking) -> None:
    """The sync modes that need one node, or a local inference server."""
    t, inf = c.cfg.trainer, c.cfg.inference
    if not t.enabled:
        return
    if c.sync == "broadcast" and t.nodes > 1:
        c.add(
            "trainer.weight_sync",
            '"broadcast" runs on one node (cluster.nodes = 1); with several machines use "push" or "reload"',
        )
    if not inf.enabled and c.sync in ("shared", "push", "broadcast"):
        c.add(
            "trainer.weight_sync",
            f'"{c.sync}" needs a local inference server (inference.enabled = true); use "reload"',
        )
    if c.sync == "broadcast" and inf.enabled:
        # NCCL refuses a group with two ranks on one GPU (the trainer's sending rank and the
        # replica's engine worker).
        shared_gpu = _trainer_gpu_overlap(c.cfg)
        if shared_gpu is not None:
            c.add(
                "trainer.weight_sync",
                f'"broadcast" needs every replica on a GPU of its own, not a trainer rank\'s ({shared_gpu}): '
                'NCCL cannot put two ranks of one group on one GPU; use "push" (CUDA IPC on a shared GPU)',
            )


def _vllm_shared_gpu(c: Checking) -> None:
    inf = c.cfg.inference
    if inf.engine == "vllm" and inf.vllm.gpu_memory_utilization == 0.0 and c.cfg.trainer.enabled:
        shared_gpu = _trainer_gpu_overlap(c.cfg)
        if shared_gpu is not None:
            c.add(
                "inference.vllm.gpu_memory_utilization",
                f"must be > 0 when vLLM shares a GPU with the trainer ({shared_gpu}): it says how "
                "much of the GPU's memory the replica may take",
            )


# ---------------------------------------------------------------------------- devices and model


def _inference_device(c: Checking) -> None:
    inf = c.cfg.inference
    if isinstance(inf.device, list):
        if len(inf.device) != inf.replicas:
            c.add(
                "inference.device",
                f"a list must have exactly inference.replicas ({inf.replicas}) "
                f"entries, one per replica; got {len(inf.device)}",
            )
        for i, d in enumerate(inf.device):
            if not re.match(REPLICA_DEVICE_PATTERN, d):
                c.add(
                    f"inference.device[{i}]",
                    f'must be auto, cpu, cuda:N, a GPU UUID or several GPUs ("cuda:2,cuda:3"), got {d!r}',
                )
    elif not re.match(DEVICE_PATTERN, inf.device):
        c.add("inference.device", f"must be auto, cpu, cuda:N or a GPU UUID, got {inf.device!r}")


def _trainer_device(c: Checking) -> None:
    """``trainer.device``: one device, or a list of one per rank — all on the CPU or all distinct GPUs."""
    device = c.cfg.trainer.device
    if isinstance(device, str):
        if not re.match(DEVICE_PATTERN, device):
            c.add("trainer.device", f"must be auto, cpu, cuda:N or a GPU UUID, got {device!r}")
        return
    bad = [i for i, d in enumerate(device) if d == "auto" or not re.match(DEVICE_PATTERN, d)]
    for i in bad:
        c.add(f"trainer.device[{i}]", f"must be cpu, cuda:N or a GPU UUID, got {device[i]!r}")
    if not device:
        c.add("trainer.device", "a list needs at least one device (one per trainer rank)")
    if bad or len(device) < 2:
        return
    kinds = {"cpu" if d == "cpu" else "gpu" for d in device}
    if len(kinds) > 1:
        c.add("trainer.device", f"every trainer rank must be on the CPU or every one on a GPU, got {device}")
    elif kinds == {"gpu"}:
        seen: dict[str, int] = {}
        for i, d in enumerate(device):
            key = "cuda:0" if d == "cuda" else d
            if key in seen:
                c.add(f"trainer.device[{i}]", f"{d!r} is already rank {seen[key]}'s device: one GPU per rank")
            seen.setdefault(key, i)


def _tool_parser(c: Checking) -> None:
    inf = c.cfg.inference
    if inf.enabled and inf.tool_parser:
        # light: reads vLLM's parser names from its source, imports nothing heavy
        from atroposd.toolparsers import parser_problem

        why = parser_problem(inf.tool_parser)
        if why:
            c.add("inference.tool_parser", why)


def _model(c: Checking) -> None:
    model = c.cfg.inference.model
    if not model:
        c.add("inference.model", "must not be empty")
    elif model.startswith("builtin:") and model not in BUILTIN_MODELS:
        c.add("inference.model", f"unknown built-in model {model!r} (known: {', '.join(BUILTIN_MODELS)})")


# ---------------------------------------------------------------------------- ports


def _ports(c: Checking) -> None:
    """The ports of the API, the inference replicas, the metrics and the cluster: distinct (an
    environment's are claimed with its other rules)."""
    cfg, inf = c.cfg, c.cfg.inference
    if cfg.api.enabled:
        c.claim(cfg.api.port, "api.port")
    if inf.enabled:
        if inf.port + inf.replicas - 1 > 65535:
            c.add(
                "inference.port",
                f"inference.port + inference.replicas - 1 must be ≤ 65535 "
                f"(replica i listens on port + i), got {inf.port + inf.replicas - 1}",
            )
        for r in range(inf.replicas):
            c.claim(inf.port + r, "inference.port", f"inference replica {r}: port + {r}" if inf.replicas > 1 else "")
    if cfg.daemon.metrics_port:
        c.claim(cfg.daemon.metrics_port, "daemon.metrics_port")
    if cfg.cluster.enabled:
        c.claim(cfg.cluster.port, "cluster.port")
        c.claim(cfg.cluster.port + 1, "cluster.port", "the trainer ranks' c10d store: port + 1")


# ---------------------------------------------------------------------------- cluster (SPEC §12.3)


def _cluster_addresses(c: Checking) -> None:
    """This node's rank, and ``bind`` and ``head`` as host names or addresses."""
    cl = c.cfg.cluster
    if cl.node_rank >= 0 or cl.enabled:
        try:
            cl.resolve_node_rank()
        except ClusterError as exc:
            c.add("cluster.node_rank", str(exc))
    if cl.bind and ("://" in cl.bind or (":" in cl.bind and not _is_ip(cl.bind))):
        c.add("cluster.bind", f"must be a host name or address without a scheme or port, got {cl.bind!r}")
    if cl.head and ("://" in cl.head or (":" in cl.head and not _is_ip(cl.head))):
        c.add(
            "cluster.head",
            f"must be a host name or address without a scheme or port (the port is cluster.port), got {cl.head!r}",
        )


def _cluster_required(c: Checking) -> None:
    """With several machines: the head, the shared secret and a checkpoint directory every node sees."""
    cl = c.cfg.cluster
    if not cl.enabled:
        return
    if not cl.head:
        c.add("cluster.head", "required when cluster.nodes > 1 (the host of node 0)")
    if not cl.token_path():
        c.add(
            "cluster.token_file",
            "required when cluster.nodes > 1 (a file holding the shared "
            "secret, the same on every node; under systemd, the "
            f"credential {CLUSTER_CREDENTIAL} may give it)",
        )
    else:
        try:
            cl.read_token()
        except ClusterError as exc:
            c.add("cluster.token_file", str(exc).removeprefix("cluster.token_file: "))
    if c.cfg.trainer.enabled and not c.cfg.trainer.checkpoint_dir:
        c.add(
            "trainer.checkpoint_dir",
            "required when cluster.nodes > 1: a directory every node sees "
            "(NFS, Lustre, ...), where every trainer rank writes its shard",
        )


def _cluster_loopback(c: Checking) -> None:
    """With several machines: a loopback API or inference host only beside a loopback head."""
    cl = c.cfg.cluster
    if not cl.enabled or not cl.head:
        return
    head_loopback = is_loopback(cl.head)
    for name, sec in (("api", c.cfg.api), ("inference", c.cfg.inference)):
        if sec.enabled and is_loopback(sec.host) and not head_loopback:
            c.add(
                f"{name}.host",
                f"{sec.host!r} is loopback, which the other nodes cannot reach; "
                f"a loopback host is valid only when cluster.head is loopback "
                f"(one machine), and cluster.head = {cl.head!r}",
            )


def _token_files(c: Checking) -> None:
    """The inference servers' token file: readable, at least MIN_TOKEN_BYTES (the API's is
    read where it is used, at start: ``ApiConfig.bearer_token``)."""
    for key, name in (("inference.token_file", c.cfg.inference.token_file),):
        if name:
            try:
                read_token_file(name, key, TokenError)
            except TokenError as exc:
                c.add(key, str(exc).removeprefix(f"{key}: "))


# ---------------------------------------------------------------------------- environments


def _environments(c: Checking) -> None:
    """Every ``[[env]]`` in turn, each through every rule of ``ENV_CHECKS``, named by its index in
    the file (an entry that is not a table was refused while loading and has no environment)."""
    raw = c.raw.get("env")
    if isinstance(raw, list):
        indexes = [j for j, item in enumerate(raw) if isinstance(item, Mapping)]
    else:
        indexes = list(range(len(c.cfg.env)))
    for i, e in zip(indexes, c.cfg.env, strict=False):
        for check in ENV_CHECKS:
            check(c, i, e)


def _env_name(c: Checking, i: int, e: EnvConfig) -> None:
    pre = f"env[{i}]"
    env_raw = c.raw.get("env", [])[i] if isinstance(c.raw.get("env"), list) else {}
    if "name" not in env_raw or not e.name:
        c.add(f"{pre}.name", "required")
    elif not _NAME_RE.match(e.name):
        c.add(
            f"{pre}.name",
            "must be 1-63 characters of letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit; got {e.name!r}",
        )
    elif e.name in RESERVED_NAMES:
        c.add(f"{pre}.name", f"{e.name!r} is reserved for a daemon component")
    elif e.name in c.env_names:
        c.add(f"{pre}.name", f"duplicate name {e.name!r} (also env[{c.env_names[e.name]}])")
    else:
        c.env_names[e.name] = i


def _env_kind(c: Checking, i: int, e: EnvConfig) -> None:
    """Exactly one of ``builtin`` and ``command``; a built-in that exists, with its options."""
    pre = f"env[{i}]"
    has_builtin, has_cmd = bool(e.builtin), bool(e.command)
    if has_builtin == has_cmd:
        c.add(pre, "exactly one of builtin and command is required")
    if has_builtin and e.builtin not in BUILTIN_ENVS:
        c.add(f"{pre}.builtin", f"unknown built-in environment {e.builtin!r} (known: {', '.join(BUILTIN_ENVS)})")
    if e.options and not has_builtin:
        c.add(f"{pre}.options", "only a builtin environment takes options")
    if has_builtin and e.builtin in BUILTIN_ENVS:
        for path, msg in validate_options(e.builtin, e.options):
            c.add(f"{pre}.options.{path}" if path else f"{pre}.options", msg)


def _env_group_size(c: Checking, i: int, e: EnvConfig) -> None:
    cfg = c.cfg
    if cfg.trainer.enabled and e.group_size > cfg.trainer.batch_size:
        c.add(f"env[{i}].group_size", f"must be ≤ trainer.batch_size ({cfg.trainer.batch_size})")
    t = cfg.trainer
    if t.enabled and t.mini_batches > 1 and e.group_size <= t.batch_size:
        # SPEC §14: mini-batches of whole groups, as many groups in each
        groups = t.batch_size // e.group_size
        if t.batch_size % e.group_size or groups % t.mini_batches:
            c.add(
                "trainer.mini_batches",
                f"must divide the batch's groups: trainer.batch_size ({t.batch_size}) holds "
                f"{t.batch_size / e.group_size:g} groups of env[{i}].group_size ({e.group_size})",
            )
    if e.group_size > cfg.api.max_queued_sequences:
        c.add(f"env[{i}].group_size", f"must be ≤ api.max_queued_sequences ({cfg.api.max_queued_sequences})")


def _env_stop_signal(c: Checking, i: int, e: EnvConfig) -> None:
    import signal

    sig = e.stop_signal.upper()
    if not sig.startswith("SIG"):
        sig = "SIG" + sig
    if sig not in signal.Signals.__members__:
        c.add(f"env[{i}].stop_signal", f"unknown signal {e.stop_signal!r}")


def _env_ports(c: Checking, i: int, e: EnvConfig) -> None:
    if e.port_base:
        if e.port_base + e.replicas - 1 > 65535:
            c.add(f"env[{i}].port_base", "port_base + replicas - 1 must be ≤ 65535")
        for r in range(e.replicas):
            c.claim(e.port_base + r, f"env[{i}].port_base")


def _env_command(c: Checking, i: int, e: EnvConfig) -> None:
    if e.command:
        unknown = unknown_placeholders(e.command)
        if unknown:
            c.add(f"env[{i}].command", "unknown placeholder " + ", ".join("{" + u + "}" for u in unknown))
        if "{replica_port}" in " ".join(e.command) and not e.port_base:
            c.add(f"env[{i}].port_base", "must be > 0 when command uses {replica_port}")


# ---------------------------------------------------------------------------- the daemon


def _api_command(c: Checking) -> None:
    command = c.cfg.api.command
    if command:
        unknown = unknown_placeholders(command, extra=("port",))
        if unknown:
            c.add("api.command", "unknown placeholder " + ", ".join("{" + u + "}" for u in unknown))


def _control_socket(c: Checking) -> None:
    """The control socket's path must fit in sun_path."""
    sock = str(c.cfg.control_socket)
    if len(sock.encode()) > SOCKET_PATH_MAX:
        c.add(
            "daemon.runtime_dir",
            f"control socket path {sock!r} is {len(sock.encode())} bytes; it must fit in {SOCKET_PATH_MAX}",
        )


def _sandbox(c: Checking) -> None:
    """``[sandbox]``: the engine is a Unix socket URL; the memory a size the engines accept."""
    from atroposd.sandbox.labels import SOCKET_TAIL
    from atroposd.sandbox.policy import parse_memory

    sb = c.cfg.sandbox
    if not re.match(SANDBOX_ENGINE_PATTERN, sb.engine):
        c.add("sandbox.engine", f'must be "" (off) or unix:///PATH of the engine\'s socket, got {sb.engine!r}')
    try:
        parse_memory(sb.memory)
    except ValueError as exc:
        c.add("sandbox.memory", str(exc))
    runtime = len(str(c.cfg.runtime_dir).encode())
    if sb.engine and runtime + SOCKET_TAIL > SOCKET_PATH_MAX:
        c.add(
            "daemon.runtime_dir",
            f"is {runtime} bytes; with [sandbox] engine set the environments' sockets in it need it to be "
            f"at most {SOCKET_PATH_MAX - SOCKET_TAIL}",
        )


def _socket_group(c: Checking) -> None:
    group = c.cfg.daemon.socket_group
    if group:
        import grp

        try:
            grp.getgrnam(group)
        except KeyError:
            c.add("daemon.socket_group", f"no such group {group!r}")


# ---------------------------------------------------------------------------- helpers


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    return True


def _is_cuda(device: str) -> bool:
    return device.startswith("cuda") or device.startswith(("GPU-", "MIG-"))


def _trainer_gpu_overlap(cfg: Config) -> str | None:
    """The first inference replica GPU that is also a trainer rank's, described for an error,
    or None. ``cuda`` is ``cuda:0``; a UUID beside an index is compared through ``nvidia-smi``
    where it can be asked."""
    for i, entry in enumerate(cfg.inference_devices()):
        for gpu in (g.strip() for g in entry.split(",")):
            for rank, td in enumerate(cfg.trainer.devices()):
                if _is_cuda(td) and _is_cuda(gpu) and same_device(td, gpu):
                    return f"replica {i} on {gpu!r}, trainer rank {rank} on {td!r}"
    return None


# ---------------------------------------------------------------------------- the order


# The rules in the order their problems are reported.
CHECKS: tuple[Callable[[Checking], None], ...] = (
    _external_urls,
    _trainer_loss,
    _trainer_sizes,
    _sync_engine_mode,
    _sync_ranks,
    _sync_shared_device,
    _sync_dtypes,
    _sync_placement,
    _vllm_shared_gpu,
    _inference_device,
    _trainer_device,
    _tool_parser,
    _model,
    _ports,
    _cluster_addresses,
    _cluster_required,
    _cluster_loopback,
    _token_files,
    _environments,
    _api_command,
    _control_socket,
    _socket_group,
    _sandbox,
)

# An environment's rules, in order (its port claims among them, after the job's own ports).
ENV_CHECKS: tuple[Callable[[Checking, int, EnvConfig], None], ...] = (
    _env_name,
    _env_kind,
    _env_group_size,
    _env_stop_signal,
    _env_ports,
    _env_command,
)

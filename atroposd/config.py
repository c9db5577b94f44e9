"""The one typed configuration of a job: schema, defaults, loading and validation.

Every key of SPEC §3 is a dataclass field here, with its default and the comment that
``atroposd.toml.example`` shows above it; the example file is rendered from this schema
(``render_example``), so defaults are written in exactly one place.

``load_config`` parses a TOML file, rejects unknown keys, type-checks every value and
applies the cross-key rules, collecting *every* problem (``ConfigError.problems``, each
with its key path) before raising.  Nothing here imports torch.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import hmac
import os
import re
import sys
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from atroposd.devices import same_device
from atroposd.envoptions import BUILTIN_ENVS, options_schema, validate_options
from atroposd.net import BindError, address_towards, is_loopback

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

__all__ = [
    "ApiConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DaemonConfig",
    "EnvConfig",
    "HealthConfig",
    "InferenceConfig",
    "Problem",
    "TrainerConfig",
    "VllmConfig",
    "WandbConfig",
    "check_fields",
    "discover_config_path",
    "dump_toml",
    "json_schema",
    "load_config",
    "parse_config",
    "render_example",
]

SOCKET_PATH_MAX = 107
CONTROL_SOCKET_NAME = "control.sock"
DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?|GPU-[0-9a-fA-F-]+)$"
# One entry of a list-valued [inference] device: one device, or several GPUs for one replica
# ("cuda:2,cuda:3": a tensor-parallel vLLM replica, passed to it as CUDA_VISIBLE_DEVICES).
_GPU = r"(cuda:\d+|GPU-[0-9a-fA-F-]+)"
REPLICA_DEVICE_PATTERN = r"^(auto|cpu|cuda|" + _GPU + "(," + _GPU + ")*)$"
MAX_INFERENCE_REPLICAS = 64
BUILTIN_MODELS = ("builtin:tiny",)
# A model is a built-in name or a local directory (anything not starting with "builtin:").
MODEL_PATTERN = "^(" + "|".join(re.escape(m) for m in BUILTIN_MODELS) + "|(?!builtin:).+)$"
URL_PATTERN = r"^https?://[^/\s]+(/.*)?$"
ENV_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
RESERVED_NAMES = ("api", "inference", "trainer", "daemon")
PLACEHOLDERS = (
    "api_url",
    "inference_url",
    "inference_urls",
    "openai_url",
    "model",
    "tokenizer",
    "group_size",
    "max_token_len",
    "steps",
    "name",
    "replica",
    "seed",
    "replica_port",
    "weight",
    "wandb_group",
    "inference_token",
)


def _placeholder_pattern(known: Sequence[str]) -> str:
    """A string whose ``{identifier}`` braces are all known placeholders (other braces are free)."""
    return r"^(?:[^{]|\{(?:" + "|".join(known) + r")\}|\{(?![A-Za-z_][A-Za-z0-9_]*\}))*$"


# ---------------------------------------------------------------------------- schema


def _k(
    default: Any,
    doc: str,
    *,
    choices: Sequence[Any] | None = None,
    min: float | None = None,
    max: float | None = None,
    gt: float | None = None,
    example: bool = True,
    schema: Mapping[str, Any] | None = None,
) -> Any:
    """A config key: its default, the comment shown above it, and simple value rules.

    ``schema``: JSON Schema keywords for rules that ``_cross_checks`` applies to this key alone
    (a pattern, a length), so that ``json_schema`` expresses them too."""
    meta = {
        "doc": doc,
        "choices": choices,
        "min": min,
        "max": max,
        "gt": gt,
        "example": example,
        "schema": dict(schema or {}),
    }
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class DaemonConfig:
    runtime_dir: str = _k(
        "",
        "Control socket, pidfile, weight manifests (mode 0700). Default: $RUNTIME_DIRECTORY\n"
        "(systemd), else /run/atroposd as root, else $XDG_RUNTIME_DIR/atroposd, else\n"
        "/tmp/atroposd-$UID (refused unless ours with mode 0700).",
        schema={"maxLength": SOCKET_PATH_MAX - len("/" + CONTROL_SOCKET_NAME)},
    )
    state_dir: str = _k(
        "",
        "Logs, checkpoints, metrics, spool, crash-recovery records. Default: $STATE_DIRECTORY\n"
        "(systemd), else /var/lib/atroposd as root, else $XDG_STATE_HOME/atroposd\n"
        "(~/.local/state/atroposd).",
    )
    log_level: str = _k("info", "debug | info | warning | error", choices=("debug", "info", "warning", "error"))
    log_format: str = _k(
        "auto",
        "auto: console on a TTY, JSON otherwise (journald-friendly) | console | json",
        choices=("auto", "console", "json"),
    )
    log_max_bytes: int = _k(52428800, "Per component log file, then rotated.", min=4096)
    log_backups: int = _k(5, "Rotated log files kept per component.", min=0)
    stop_timeout: float = _k(30.0, "Seconds for the children's termination, escalation to SIGKILL included.", gt=0)
    checkpoint_timeout: float = _k(120.0, "Seconds a requested stop may spend writing the final checkpoint.", min=0)
    metrics_port: int = _k(0, "Prometheus text format on 127.0.0.1; 0 = off.", min=0, max=65535)
    metrics_token: str = _k(
        "",
        "Bearer token a scrape of metrics_port presents to get the series of the\n"
        "components that require a token (the API with a token, the inference servers with\n"
        "one); empty, or a scrape without it: those series are left out.",
    )
    socket_group: str = _k("", "Optional group allowed to use the control socket (mode 0660).")


@dataclass
class ApiConfig:
    enabled: bool = _k(True, "false: use an API that runs elsewhere, at url.")
    url: str = _k(
        "", "Required when enabled = false, e.g. http://10.0.0.5:8000.", schema={"pattern": "^$|" + URL_PATTERN}
    )
    host: str = _k("127.0.0.1", "Address the API binds.")
    port: int = _k(8000, "Port the API binds.", min=1, max=65535)
    token: str = _k("", "Optional bearer token; binding a non-loopback host without one warns.")
    token_file: str = _k(
        "",
        "Optional file holding the bearer token (read at start; not visible in ps).\n"
        "The ATROPOSD_API_TOKEN environment variable is read when neither is set.",
    )
    max_queued_sequences: int = _k(8192, "Hard cap on sequences held (queue + buffers + formed batches).", min=1)
    max_request_bytes: int = _k(67108864, "Per request, after gzip decompression.", min=1024)
    max_connections: int = _k(
        1024,
        "Connections open at once; a new one past it is answered 503 and closed\n"
        "(kept below the process's file descriptor limit).",
        min=1,
    )
    full_wait: float = _k(30.0, "Seconds a submission may wait for room when the queue is full, then 503.", min=0)
    spool: bool = _k(True, "Accepted groups and registrations survive an API restart.")
    spool_dir: str = _k("", "Default: {state_dir}/spool/api-{port}.")
    spool_fsync: bool = _k(
        False,
        "fsync every spool write (power-loss safe, slower); segment files are\n"
        "created and deleted with a directory sync.",
    )
    shm_ack_timeout: float = _k(
        30.0,
        "Seconds a batch taken through shared memory waits for its acknowledgement,\nthen it is served again.",
        gt=0,
    )
    command: list[str] = _k(
        [],
        "Optional: run another wire-compatible API instead, e.g.\n"
        '["run-api", "--host", "127.0.0.1", "--port", "{port}"]',
        schema={"items": {"type": "string", "pattern": _placeholder_pattern((*PLACEHOLDERS, "port"))}},
    )
    live_interval: float = _k(5.0, "Seconds between liveness probes of the running API (GET /info); 0 = off.", min=0)
    live_timeout: float = _k(5.0, "Seconds a liveness probe may take before it counts as failed.", gt=0)
    live_failures: int = _k(
        3, "Consecutive failed probes before the API is declared hung and restarted; 0 = off.", min=0
    )

    def bearer_token(self) -> str:
        """The token in force: ``token``, else the content of ``token_file``, else the systemd
        credential ``atroposd-api.token`` (``LoadCredential=``), else ``$ATROPOSD_API_TOKEN``,
        else "" (no token). Raises TokenError for a token file that cannot be read, is empty or
        holds fewer than MIN_TOKEN_BYTES."""
        if self.token:
            return self.token
        path = self.token_file or credential_file(API_CREDENTIAL)
        if path:
            raw = read_token_file(path, "api.token_file", TokenError)
            try:
                return raw.decode("utf-8")
            except UnicodeError as exc:
                raise TokenError(f"api.token_file: {path} is not UTF-8 text: {exc}") from None
        return os.environ.get(API_TOKEN_ENV, "").strip()


class TokenError(ValueError):
    """``[api] token_file`` or ``[inference] token_file`` names a file that cannot give a
    token; the message says why."""


API_TOKEN_ENV = "ATROPOSD_API_TOKEN"
INFERENCE_TOKEN_ENV = "ATROPOSD_INFERENCE_TOKEN"
# systemd credentials (the shipped unit's LoadCredential=, from /etc/credstore/): used when the
# token_file key is empty.
CREDENTIALS_ENV = "CREDENTIALS_DIRECTORY"
CLUSTER_CREDENTIAL = "atroposd-cluster.token"
API_CREDENTIAL = "atroposd-api.token"


def credential_file(name: str) -> str:
    """``$CREDENTIALS_DIRECTORY/name`` when systemd passed that credential to the daemon, else ""."""
    directory = os.environ.get(CREDENTIALS_ENV, "")
    if not directory:
        return ""
    path = Path(directory) / name
    return str(path) if path.is_file() else ""


# The shortest secret a token file may hold (SPEC §12.3): anything shorter is guessable.
MIN_TOKEN_BYTES = 16


_INFERENCE_LABEL = b"atroposd inference bearer token v1"


def inference_secret(cluster_token: bytes) -> str:
    """The inference servers' bearer token derived from the cluster token (when ``[inference]
    token_file`` is not set): 64 hex characters, the same on every node, unrelated to the cluster
    endpoint's signing key and the store's prefix (each an HMAC of the token under its own label)."""
    return hmac.new(cluster_token, _INFERENCE_LABEL, hashlib.sha256).hexdigest()


def read_token_file(name: str, key: str, error: type[ValueError]) -> bytes:
    """The secret in the file ``name`` (surrounding whitespace stripped); ``error`` naming
    ``key`` for a file that cannot be read, is empty, or holds fewer than MIN_TOKEN_BYTES."""
    path = Path(name).expanduser()
    try:
        token = path.read_bytes().strip()
    except OSError as exc:
        raise error(f"{key}: cannot read {path}: {exc.strerror or exc}") from None
    if not token:
        raise error(f"{key}: {path} is empty")
    if len(token) < MIN_TOKEN_BYTES:
        raise error(
            f"{key}: {path} holds {len(token)} bytes; a token must have at least {MIN_TOKEN_BYTES} "
            "(make one with: openssl rand -hex 32)"
        )
    return token


def token_file_warning(name: str, key: str) -> str | None:
    """A warning when the token file ``name`` may be read by users other than its owner."""
    path = Path(name).expanduser()
    try:
        mode = path.stat().st_mode
    except OSError:
        return None  # reading it is what fails, and says so
    if mode & 0o044:
        return f"{key}: {path} is readable by other users (mode {mode & 0o777:04o}); make it private: chmod 600 {path}"
    return None


@dataclass
class VllmConfig:
    gpu_memory_utilization: float = _k(
        0.0,
        "Required (> 0) when vLLM shares a GPU with the trainer; on CPU the\n"
        "fraction of host RAM for the KV cache (0 = 0.2 on CPU).",
        min=0,
        max=1,
    )
    enforce_eager: bool = _k(False, "Disable CUDA graphs (always on for the CPU backend).")
    extra_args: list[str] = _k([], 'Extra engine arguments, e.g. ["--max-num-seqs", "64"].')


@dataclass
class InferenceConfig:
    enabled: bool = _k(True, "false: use an inference server that runs elsewhere, at url.")
    url: str = _k(
        "", "Required when enabled = false, e.g. http://10.0.0.6:9001.", schema={"pattern": "^$|" + URL_PATTERN}
    )
    engine: str = _k("torch", "torch: built in, CPU or GPU | vllm: needs atroposd[vllm].", choices=("torch", "vllm"))
    model: str = _k(
        "builtin:tiny",
        "builtin:tiny (built locally, no download) or a local Hugging Face model directory.",
        schema={"pattern": MODEL_PATTERN},
    )
    tokenizer: str = _k("", "Default: the model's. The one source of truth for every component.")
    host: str = _k(
        "127.0.0.1",
        "Address the inference server binds (with cluster.nodes > 1, a wildcard\n"
        "0.0.0.0 or :: binds cluster.bind instead).",
    )
    port: int = _k(9001, "Port the inference server binds.", min=1, max=65535)
    token_file: str = _k(
        "",
        "A file holding the bearer token the inference servers require on their TCP routes\n"
        "(environments get it as {inference_token}). Empty: with cluster.nodes > 1, one derived\n"
        "from the cluster token; else none (the servers listen on loopback).",
    )
    dtype: str = _k(
        "auto",
        "auto: float32 on CPU, bfloat16 on GPU | float32 | bfloat16 | float16",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    device: str | list[str] = _k(
        "auto",
        "auto | cpu | cuda:N | a GPU UUID; the daemon sets CUDA_VISIBLE_DEVICES for the child. With\n"
        "replicas > 1: one device for every replica, or a list of exactly `replicas` entries; an\n"
        'entry may name several GPUs ("cuda:2,cuda:3") for one tensor-parallel vLLM replica.',
        schema={"pattern": DEVICE_PATTERN, "items": {"pattern": REPLICA_DEVICE_PATTERN}},
    )
    replicas: int = _k(
        1,
        "Inference servers (replicas); replica i listens on port + i. Components inference-0,\n"
        "inference-1, ... (just inference when 1).",
        min=1,
        max=MAX_INFERENCE_REPLICAS,
    )
    max_model_len: int = _k(4096, "Longest prompt + completion the server accepts, in tokens.", min=8)
    ready_timeout: float = _k(600.0, "Seconds the server may take to become ready (health + one generation).", gt=0)
    live_interval: float = _k(
        5.0,
        "Seconds between liveness probes of the running server (GET /health; one tiny\n"
        "generation every live_generate_every probes); 0 = off.",
        min=0,
    )
    live_timeout: float = _k(
        5.0, "Seconds a /health probe may take (a generation: live_generate_every times this).", gt=0
    )
    live_failures: int = _k(
        3, "Consecutive failed probes before the server is declared hung and restarted; 0 = off.", min=0
    )
    live_generate_every: int = _k(6, "Every this many liveness probes, one tiny real generation; 0 = never.", min=0)
    tool_parser: str = _k(
        "auto",
        "How a chat completion's tool calls are read from the model's output (OpenAI\n"
        'tool_calls, finish_reason "tool_calls"): auto (the model\'s format, from its chat\n'
        "template and config.json) | a parser name, e.g. hermes (always available; with vLLM\n"
        'installed, any of vLLM\'s tool parsers) | "" (off: tools reach the template, the\n'
        "output stays text).",
    )
    # The bearer token in force (``Config.inference_token``), resolved by the daemon at start and
    # at reload (not a key: never written to the children's config).
    token: str = field(default="", compare=False, repr=False, metadata={"internal": True})
    vllm: VllmConfig = field(default_factory=VllmConfig, metadata={"doc": 'Only read when engine = "vllm".'})


@dataclass
class TrainerConfig:
    enabled: bool = _k(True, "false: API + inference + environments only, for an external trainer.")
    device: str | list[str] = _k(
        "auto",
        "auto | cpu | cuda:N | a GPU UUID, or a list: one trainer rank per entry (FSDP2;\n"
        '["cuda:0", "cuda:1"], or ["cpu", "cpu"] for gloo ranks on a CPU). Rank 0 trains in the daemon.',
        schema={"pattern": DEVICE_PATTERN, "items": {"pattern": DEVICE_PATTERN}, "minItems": 1},
    )
    steps: int = _k(3000, "Optimizer steps; the job stops by itself after the last.", min=1)
    batch_size: int = _k(64, "Sequences per optimizer step.", min=1)
    micro_batch_size: int = _k(32, "Sequences per forward/backward pass (per rank); divides batch_size.", min=1)
    max_token_len: int = _k(512, "Longest sequence (prompt + completion) the trainer accepts, in tokens.", min=2)
    optimizer: str = _k(
        "adamw",
        "adamw | adafactor | adamw_8bit (needs bitsandbytes; never a silent fallback)",
        choices=("adamw", "adafactor", "adamw_8bit"),
    )
    dtype: str = _k(
        "auto",
        "Master weights and optimizer state: auto (float32; shared on a GPU: the\n"
        "inference dtype, with a compensated optimizer) | float32 | bfloat16 (the same\n"
        "Kahan-compensated optimizer in any mode: a large model on a small GPU).",
        choices=("auto", "float32", "bfloat16"),
    )
    compute_dtype: str = _k(
        "auto",
        "The forward and backward: auto (the inference dtype: bf16 on a GPU, float32 on\n"
        "a CPU) | float32 | bfloat16 | float16. Another dtype than the inference one needs\n"
        'weight_sync = "reload".',
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    lr: float = _k(3e-4, "Peak learning rate.", gt=0)
    adam_betas: list[float] = _k(
        [0.9, 0.99],
        "AdamW betas.",
        schema={"minItems": 2, "maxItems": 2, "items": {"type": "number", "minimum": 0, "exclusiveMaximum": 1}},
    )
    weight_decay: float = _k(0.0, "Decoupled weight decay.", min=0)
    warmup_steps: int = _k(0, "Linear warm-up steps, then lr_schedule.", min=0)
    lr_schedule: str = _k(
        "constant",
        "After warmup_steps: constant | linear | cosine (linear and cosine decay to 0 at\n`steps`).",
        choices=("constant", "linear", "cosine"),
    )
    max_grad_norm: float = _k(1.0, "Gradient-norm clip.", gt=0)
    loss: str = _k(
        "grpo",
        "grpo (token-level ratio) | gspo (one ratio per sequence: the mean log-ratio over its\n"
        "completion tokens) | awsft (advantage-weighted SFT)",
        choices=("grpo", "gspo", "awsft"),
    )
    clip_eps: float = _k(0.2, "Importance-ratio clip: [1 - clip_eps, 1 + clip_eps] ...", gt=0, max=1)
    clip_eps_high: float = _k(
        0.0,
        "... unless > 0: the upper bound is 1 + clip_eps_high (DAPO's clip-higher;\nat least clip_eps).",
        min=0,
        max=10,
    )
    loss_agg: str = _k(
        "token-mean",
        "token-mean (every completion token of the batch weighs the same) |\n"
        "seq-mean-token-mean (each sequence weighs the same) | seq-mean-token-sum-norm\n"
        "(Dr.GRPO: token sums over max_token_len x sequences)",
        choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    )
    advantage: str = _k(
        "group-std",
        "group-std: (score - mean) / max(std, adv_std_floor) | group-mean: score - mean\n"
        "(Dr.GRPO) | rloo: score - mean of the others. Advantages an environment sends\n"
        "replace these.",
        choices=("group-std", "group-mean", "rloo"),
    )
    adv_std_floor: float = _k(0.1, "advantage = (score - group mean) / max(group std, adv_std_floor)", gt=0)
    filter_groups: bool = _k(
        False,
        "DAPO's dynamic sampling: a group whose scores are all equal is dropped (counted\n"
        "as filtered_groups) and the batch fills from the queue; not groups with their\n"
        "own advantages or distillation fields.",
    )
    overlong: str = _k(
        "keep",
        'keep | mask: a completion reported truncated (finish_reason = "length") carries\nno loss.',
        choices=("keep", "mask"),
    )
    rollout_correction: str = _k(
        "none",
        "Sampler-trainer mismatch: none | token-tis | seq-tis (weight min(rho, C)) |\n"
        "token-mis | seq-mis (mask rho outside [1/C, C]; token-mis = IcePop); the\n"
        "share corrected is rollout_corrected in metrics.jsonl.",
        choices=("none", "token-tis", "seq-tis", "token-mis", "seq-mis"),
    )
    rollout_correction_threshold: float = _k(2.0, "C of rollout_correction (> 1).", gt=1)
    logprob_chunk: int = _k(
        1024,
        "Completion positions per chunk of the LM head and loss: the full logits never\n"
        "exist at once (forward or backward). Same loss and gradients for any value.",
        min=1,
    )
    micro_batch_tokens: int = _k(
        0,
        "> 0: pack sequences (longest first, first fit) into micro-batches of at most\n"
        "this many tokens, attention never crossing sequences, instead of\n"
        "micro_batch_size padded rows; at least max_token_len. 0 = off.",
        min=0,
    )
    kl_coef: float = _k(0.04, "k3 KL penalty toward kl_reference; logged as mean_kl. 0 = off.", min=0)
    kl_reference: str = _k(
        "initial",
        "initial: a frozen copy of the starting weights | rollout: the sampling policy",
        choices=("initial", "rollout"),
    )
    distill_coef: float = _k(0.0, "> 0 uses distill_token_ids/distill_logprobs from teacher environments.", min=0)
    distill_temperature: float = _k(1.0, "Temperature of the teacher distribution.", gt=0)
    mode: str = _k("full", "full | lora", choices=("full", "lora"))
    lora_r: int = _k(16, "LoRA rank.", min=1)
    lora_alpha: int = _k(32, "LoRA alpha.", min=1)
    lora_targets: list[str] = _k(["q_proj", "v_proj"], "Module names that get LoRA adapters.")
    weight_sync: str = _k(
        "auto",
        "auto | shared | push | reload | broadcast; auto = shared for torch with one\n"
        "trainer rank, push for vllm or several ranks; broadcast (a torch.distributed\n"
        "group per replica: gloo on CPU, NCCL on GPU) is never picked by auto",
        choices=("auto", "shared", "push", "reload", "broadcast"),
    )
    sync_every: int = _k(1, "Steps between weight syncs (push, reload and broadcast).", min=1)
    max_staleness: int = _k(2, "Batches fetched ahead of the step being trained.", min=0)
    data_timeout: float = _k(600.0, "No data and no live or restartable environment this long: the job fails.", gt=0)
    stall_timeout: float = _k(
        300.0,
        "No step for this long: the trainer is stalled; the stuck stage is named and the\n"
        "child to blame restarted. Unresolved for twice this: the job exits 1 (resume\n"
        "follows). 0 = off.",
        min=0,
    )
    checkpoint_every: int = _k(500, "Steps between checkpoints; also at the last step and on a requested stop.", min=1)
    keep_checkpoints: int = _k(3, "Newest complete checkpoints kept.", min=1)
    resume: bool = _k(True, "Continue from the newest complete checkpoint in state_dir.")
    checkpoint_dir: str = _k(
        "",
        "Where checkpoints are written. Default: {state_dir}/checkpoints. With several\n"
        "machines (cluster.nodes > 1) it is required, on a file system every node sees\n"
        "(NFS, Lustre, ...).",
    )
    seed: int = _k(0, "Seeds the model's initialisation, sampling and environments (seed + replica).", min=0)
    activation_checkpointing: bool = _k(
        False,
        "Recompute each decoder layer's activations in the backward pass\n(less memory, more compute; any rank count).",
    )
    sync_bucket_mb: int = _k(
        512,
        "Several ranks, push: weights stream to the inference replicas in buckets of\n"
        "this many MiB (rank 0's extra memory for a sync).",
        min=1,
    )
    push_path: str = _k(
        "auto",
        "push: how each replica copies the weights. auto = through CUDA IPC where the\n"
        "replica computes on the trainer's GPU (shared memory on the CPU), else through one\n"
        "pinned host shared-memory staging buffer filled per bucket (sync_bucket_mb) for\n"
        "all of them; host_staging = through the staging buffer for every replica.",
        choices=("auto", "host_staging"),
    )
    join_timeout: float = _k(300.0, "Seconds every trainer rank may take to join the process group.", gt=0)
    collective_timeout: float = _k(600.0, "Seconds a collective may run before the trainer group is restarted.", gt=0)
    max_restarts: int = _k(
        5,
        "Trainer group restarts (a rank exited, a collective failed or timed out) allowed\n"
        "within restart_window seconds; past that the job fails.",
        min=0,
    )
    restart_window: float = _k(600.0, "Seconds over which max_restarts counts group restarts.", gt=0)

    # ``[cluster] nodes``, copied here by Config (not a key): the trainer group spans every node.
    nodes: int = field(default=1, compare=False, metadata={"internal": True})

    def devices(self) -> list[str]:
        """One device per trainer rank of one node (local rank 0 first)."""
        return list(self.device) if isinstance(self.device, list) else [self.device]

    @property
    def local_ranks(self) -> int:
        """Trainer ranks on each node (the length of ``device``)."""
        return len(self.devices())

    @property
    def ranks(self) -> int:
        """Trainer ranks in the whole job: ranks per node × nodes (global rank =
        node_rank × local_ranks + local rank, SPEC §12.3)."""
        return len(self.devices()) * max(1, self.nodes)

    def device_of(self, rank: int) -> str:
        """The device of global trainer rank ``rank`` (on its own node)."""
        return self.devices()[rank % self.local_ranks]


@dataclass
class WandbConfig:
    project: str = _k(
        "", "Weights & Biases project the trainer logs every metrics row to (needs atroposd[wandb]);\nempty = off."
    )
    entity: str = _k("", "W&B entity (user or team); empty = your default.")
    group: str = _k(
        "",
        "Run group, also given to environments as {wandb_group} / WANDB_RUN_GROUP so their\n"
        "runs group with the trainer's. Empty: atroposd-<run id>.",
    )
    name: str = _k("", "Display name of the run; empty = W&B's.")
    mode: str = _k(
        "online",
        "online | offline (files under {state_dir}/wandb, `wandb sync` later) | disabled",
        choices=("online", "offline", "disabled"),
    )
    tags: list[str] = _k([], "Tags of the run.")

    @property
    def enabled(self) -> bool:
        return bool(self.project) and self.mode != "disabled"


@dataclass
class HealthConfig:
    canary_every: int = _k(
        10,
        "Syncs between canary checks of each replica (greedy generation on fixed prompts,\n"
        "scored by the trainer); 0 = off.",
        min=0,
    )
    canary_prompts: int = _k(8, "Fixed canary prompts, chosen once for the whole job.", min=1, max=64)
    drift_limit: float = _k(
        0.05,
        "Mean |trainer logprob - replica logprob| per canary token above which a\n"
        "replica is quarantined, synced again and checked again (then restarted).",
        gt=0,
    )
    rollback: bool = _k(
        True,
        "A collapse rolls the trainer back to the newest known-good checkpoint (weights,\n"
        "optimizer, schedule) and goes on with the learning rate halved; false: only logged.",
    )
    known_good_after: int = _k(50, "Healthy steps after a checkpoint before it is known-good (kept by pruning).", min=1)
    max_nonfinite_steps: int = _k(
        3, "Non-finite steps (loss or gradient norm) in a row that count as a collapse.", min=1
    )
    max_rollbacks: int = _k(
        3, "Rollbacks within the job (kept across restarts); one more collapse ends it\nwith exit 6.", min=0
    )


CLUSTER_NODE_RANK_ENV = "ATROPOSD_NODE_RANK"
SLURM_NODE_ID_ENV = "SLURM_NODEID"
_TRAILING_ORDINAL = re.compile(r"-(\d+)$")


class ClusterError(ValueError):
    """A ``[cluster]`` value that cannot be resolved (node rank, token file); the message says why."""


@dataclass
class ClusterConfig:
    nodes: int = _k(1, "Machines in the job; one atroposd runs on each (SPEC §12.3). 1 = one machine.", min=1, max=4096)
    node_rank: int = _k(
        -1,
        "This machine's rank, 0 = the head. -1: from ATROPOSD_NODE_RANK, else SLURM_NODEID,\n"
        "else the trailing ordinal of the host name (pod-3 → 3, a Kubernetes StatefulSet).",
        min=-1,
        max=4095,
    )
    head: str = _k(
        "",
        "Host (name or address) of node 0; required when nodes > 1. A loopback api.host or\n"
        "inference.host is valid only with a loopback head (one machine acting as several nodes).",
        schema={"pattern": r"^[^\s/@]*$"},
    )
    port: int = _k(
        29400,
        "Node 0's cluster endpoint (membership, status, heartbeats); port + 1 is the\ntrainer ranks' c10d store.",
        min=1,
        max=65534,
    )
    token_file: str = _k(
        "",
        "A file holding the shared secret of the cluster (every message of the cluster\n"
        "endpoint is authenticated with it); required when nodes > 1.",
    )
    heartbeat_timeout: float = _k(
        30.0,
        "Seconds without a heartbeat after which a node is lost (and a node cut\n"
        "off from its head this long stops its children and exits 1).",
        min=1,
    )
    join_timeout: float = _k(600.0, "Seconds a starting node waits for the head.", gt=0)
    bind: str = _k(
        "",
        "The address every listening port of this node binds: the cluster endpoint, the trainer\n"
        "ranks' store, and an API or inference server whose host is a wildcard. Empty: the address\n"
        "of this host that head is reached through (on the head: the address head resolves to).",
        schema={"pattern": r"^[^\s/@]*$"},
    )

    @property
    def enabled(self) -> bool:
        """More than one machine."""
        return self.nodes > 1

    def resolve_node_rank(self, environ: Mapping[str, str] | None = None, hostname: str | None = None) -> int:
        """This machine's node rank: ``node_rank`` when ≥ 0, else ``$ATROPOSD_NODE_RANK``, else
        ``$SLURM_NODEID``, else the trailing ordinal of the host name (``atroposd-3`` → 3); 0 with
        one node. Raises ClusterError naming the source when it gives no rank below ``nodes``."""
        if self.node_rank >= 0:
            rank, source = self.node_rank, "cluster.node_rank"
        elif self.nodes == 1:
            return 0
        else:
            env = os.environ if environ is None else environ
            rank = -1
            source = ""
            for var in (CLUSTER_NODE_RANK_ENV, SLURM_NODE_ID_ENV):
                value = env.get(var, "").strip()
                if value:
                    if not value.isdigit():
                        raise ClusterError(f"${var} = {value!r} is not a node rank (a non-negative integer)")
                    rank, source = int(value), f"${var}"
                    break
            if not source:
                import socket

                host = socket.gethostname() if hostname is None else hostname
                short = host.split(".", 1)[0]
                m = _TRAILING_ORDINAL.search(short)
                if m is None:
                    raise ClusterError(
                        f"cluster.node_rank = -1 and neither ${CLUSTER_NODE_RANK_ENV} nor "
                        f"${SLURM_NODE_ID_ENV} is set, and the host name {host!r} ends in no "
                        "ordinal (NAME-N); set one of them"
                    )
                rank, source = int(m.group(1)), f"the host name {host!r}"
        if rank >= self.nodes:
            raise ClusterError(f"node rank {rank} (from {source}) must be < cluster.nodes ({self.nodes})")
        return rank

    def token_path(self) -> str:
        """``token_file``, else the systemd credential ``atroposd-cluster.token``, else ""."""
        return self.token_file or credential_file(CLUSTER_CREDENTIAL)

    def read_token(self) -> bytes:
        """The shared secret in ``token_path()`` (surrounding whitespace stripped). Raises
        ClusterError for a file that is not named, cannot be read, is empty or holds fewer than
        MIN_TOKEN_BYTES."""
        path = self.token_path()
        if not path:
            raise ClusterError(
                "cluster.token_file: required when cluster.nodes > 1 (or, under systemd, the "
                f"credential {CLUSTER_CREDENTIAL})"
            )
        return read_token_file(path, "cluster.token_file", ClusterError)


@dataclass
class EnvConfig:
    name: str = _k(
        "",
        "Required, unique; replicas are named NAME-0, NAME-1, ...",
        schema={"pattern": ENV_NAME_PATTERN, "not": {"enum": list(RESERVED_NAMES)}},
    )
    builtin: str = _k("", "A built-in environment (arithmetic). Exactly one of builtin and command is required.")
    command: list[str] = _k(
        [],
        "An environment's command line, with {placeholders}.",
        example=False,
        schema={"items": {"type": "string", "pattern": _placeholder_pattern(PLACEHOLDERS)}},
    )
    options: dict[str, Any] = _k({}, "Options of a built-in environment.")
    group_size: int = _k(8, "Completions per prompt (one group).", min=1)
    weight: float = _k(
        1.0,
        "Share of each batch relative to the other environments (sent in the registration;\n"
        "a command gets it as {weight} / ATROPOSD_WEIGHT).",
        min=0,
    )
    replicas: int = _k(1, "Processes of this environment.", min=1, max=256)
    restart: str = _k(
        "on-failure",
        'on-failure | always | never (a clean exit 0 is "finished" under on-failure)',
        choices=("on-failure", "always", "never"),
    )
    max_restarts: int = _k(5, "Within restart_window seconds, then the component is failed.", min=0)
    restart_window: float = _k(60.0, "Seconds over which max_restarts counts exits.", gt=0)
    ready: str = _k(
        "registered", "registered (with the API) | started (alive for start_seconds)", choices=("registered", "started")
    )
    start_seconds: float = _k(1.0, "Seconds alive that count as started.", min=0)
    ready_timeout: float = _k(120.0, "Seconds the environment may take to become ready.", gt=0)
    stop_signal: str = _k("SIGTERM", "Signal that asks the environment to stop.")
    port_base: int = _k(0, "> 0: replica i gets {replica_port} = port_base + i.", min=0, max=65535)
    live_interval: float = _k(
        5.0,
        "Seconds between liveness checks: a built-in environment's heartbeat; a command's\n"
        "registrations with the API or its CPU use (README, Troubleshooting); 0 = off.",
        min=0,
    )
    live_timeout: float = _k(5.0, "Seconds without a heartbeat (built-in) that count as one failed check.", gt=0)
    live_failures: int = _k(3, "Consecutive failed checks before the environment is declared hung; 0 = off.", min=0)

    def replica_names(self, node_rank: int = 0) -> list[str]:
        """This node's replicas: numbered across the nodes (node_rank × replicas + i)."""
        first = node_rank * self.replicas
        return [f"{self.name}-{i}" for i in range(first, first + self.replicas)]


@dataclass
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    env: list[EnvConfig] = field(default_factory=list)
    # Where the config came from ("<built-in defaults>" when no file was found); not a key.
    source: str = field(default="<built-in defaults>", compare=False, metadata={"internal": True})
    warnings: list[str] = field(default_factory=list, compare=False, metadata={"internal": True})

    def __post_init__(self) -> None:
        self.trainer.nodes = self.cluster.nodes

    @property
    def node_rank(self) -> int:
        """This machine's node rank as set (the daemon resolves ``-1`` into the config it hands
        its children); 0 with one node or while unresolved."""
        return max(0, self.cluster.node_rank) if self.cluster.enabled else 0

    @property
    def is_head(self) -> bool:
        """Node 0: the node that runs the API and trainer rank 0 (every one-node job)."""
        return self.node_rank == 0

    # --------------------------------------------------------------- derived values

    @property
    def runtime_dir(self) -> Path:
        return Path(self.daemon.runtime_dir) if self.daemon.runtime_dir else default_runtime_dir()

    @property
    def state_dir(self) -> Path:
        return Path(self.daemon.state_dir) if self.daemon.state_dir else default_state_dir()

    @property
    def control_socket(self) -> Path:
        return self.runtime_dir / CONTROL_SOCKET_NAME

    @property
    def checkpoint_dir(self) -> Path:
        """``[trainer] checkpoint_dir``, else ``{state_dir}/checkpoints``."""
        return Path(self.trainer.checkpoint_dir) if self.trainer.checkpoint_dir else self.state_dir / "checkpoints"

    @property
    def api_url(self) -> str:
        if not self.api.enabled:
            return self.api.url.rstrip("/")
        if not self.is_head and (self.api.host in ("0.0.0.0", "::", "") or is_loopback(self.api.host)):
            # another node: the API runs on the head (a wildcard or loopback host is the head's)
            return f"http://{_url_host(self.cluster.head)}:{self.api.port}"
        return f"http://{_url_host(self.listen_host(self.api.host))}:{self.api.port}"

    def listen_host(self, host: str) -> str:
        """The address a server of this node whose key says ``host`` binds: with several machines a
        wildcard (0.0.0.0, ::, "") means ``[cluster] bind`` (SPEC §12.3); else ``host`` itself."""
        if self.cluster.enabled and host in ("0.0.0.0", "::", ""):
            c = self.cluster
            return _bind_address(c.bind, c.head, c.port) or host
        return host

    def inference_token(self) -> str:
        """The bearer token the inference servers require on their TCP routes (SPEC §12.3):
        ``[inference] token_file``; else, with several machines, one derived from the cluster
        token; else "" (none). Raises TokenError or ClusterError for a file that cannot give one."""
        if self.inference.token_file:
            raw = read_token_file(self.inference.token_file, "inference.token_file", TokenError)
            return raw.decode("utf-8", errors="replace")
        if self.cluster.enabled:
            return inference_secret(self.cluster.read_token())
        return ""

    @property
    def inference_url(self) -> str:
        if not self.inference.enabled:
            url = self.inference.url.rstrip("/")
            return url[: -len("/v1")] if url.endswith("/v1") else url
        return f"http://{_url_host(self.listen_host(self.inference.host))}:{self.inference.port}"

    @property
    def inference_urls(self) -> list[str]:
        """Every inference replica's URL (no ``/v1``), replica 0 first; one URL when external."""
        if not self.inference.enabled:
            return [self.inference_url]
        host = _url_host(self.listen_host(self.inference.host))
        return [f"http://{host}:{self.inference.port + i}" for i in range(self.inference.replicas)]

    def inference_devices(self) -> list[str]:
        """The device of each inference replica (a single ``device`` repeated; a list as given)."""
        dev = self.inference.device
        if isinstance(dev, list):
            return list(dev)
        return [dev] * self.inference.replicas

    @property
    def spool_dir(self) -> Path:
        if self.api.spool_dir:
            return Path(self.api.spool_dir)
        return self.state_dir / "spool" / f"api-{self.api.port}"

    @property
    def weight_sync(self) -> str:
        """The resolved weight-sync mode (``auto`` → shared for torch when every replica computes
        on the trainer's device, push otherwise (reload for LoRA); SPEC §7)."""
        mode = self.trainer.weight_sync
        if mode == "auto":
            shareable = self.inference.engine == "torch" and self._replicas_on_trainer_device()
            if self.trainer.mode == "lora":
                return "shared" if shareable else "reload"
            if self.trainer.ranks > 1:
                return "push"
            return "shared" if shareable else "push"
        return mode

    def _replicas_on_trainer_device(self) -> bool:
        """Every inference replica may compute on the trainer's own memory: one device entry
        each, none known to be another device than trainer rank 0's."""
        devices = self.trainer.devices()
        if not devices:
            return False  # an empty trainer.device, which config check refuses
        own = devices[0]
        return all("," not in d and same_device(own, d) is not False for d in dict.fromkeys(self.inference_devices()))


@functools.lru_cache(maxsize=8)
def _bind_address(bind: str, head: str, port: int) -> str:
    """The address ``[cluster] bind`` names for these keys (``cluster.head.bind_address``), ""
    when there is none (the cluster endpoint then fails to open, naming why)."""
    if bind:
        return bind
    try:
        return address_towards(head, port) if head else "127.0.0.1"
    except BindError:
        return ""


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def default_runtime_dir() -> Path:
    """$RUNTIME_DIRECTORY (systemd's RuntimeDirectory=), else /run/atroposd as root, else
    $XDG_RUNTIME_DIR/atroposd, else the fallback /tmp/atroposd-$UID."""
    systemd = _systemd_directory("RUNTIME_DIRECTORY")
    if systemd is not None:
        return systemd
    if os.geteuid() == 0:
        return Path("/run/atroposd")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "atroposd"
    return fallback_runtime_dir()


def fallback_runtime_dir() -> Path:
    """The runtime_dir of last resort, in a directory every user may write (checked strictly)."""
    return Path(f"/tmp/atroposd-{os.getuid()}")


def default_state_dir() -> Path:
    """$STATE_DIRECTORY (systemd's StateDirectory=), else /var/lib/atroposd as root, else
    $XDG_STATE_HOME/atroposd (~/.local/state/atroposd)."""
    systemd = _systemd_directory("STATE_DIRECTORY")
    if systemd is not None:
        return systemd
    if os.geteuid() == 0:
        return Path("/var/lib/atroposd")
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / "atroposd"


def _systemd_directory(variable: str) -> Path | None:
    """The first absolute path of a systemd directory variable (a colon-separated list)."""
    first = os.environ.get(variable, "").split(":", 1)[0]
    return Path(first) if first.startswith("/") else None


# The built-in defaults are the embedded CPU job: the schema defaults plus one environment.
DEFAULT_ENVS: tuple[dict[str, Any], ...] = ({"name": "arithmetic", "builtin": "arithmetic"},)

# ---------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(Exception):
    """An invalid configuration; ``problems`` lists every one found."""

    def __init__(self, problems: Sequence[Problem], source: str = "") -> None:
        self.problems = list(problems)
        self.source = source
        head = f"invalid configuration {source}".rstrip() + f" ({len(self.problems)} problem"
        head += "s)" if len(self.problems) != 1 else ")"
        super().__init__(head + ":\n" + "\n".join(f"  {p}" for p in self.problems))


# ---------------------------------------------------------------------------- loading


def discover_config_path(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """SPEC §2: -c FILE, else $ATROPOSD_CONFIG, else ./atroposd.toml, else /etc/atroposd/atroposd.toml."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("ATROPOSD_CONFIG")
    if env:
        return Path(env)
    for candidate in (Path("atroposd.toml"), Path("/etc/atroposd/atroposd.toml")):
        if candidate.is_file():
            return candidate
    return None


def load_config(path: str | os.PathLike[str] | None = None, *, discover: bool = True) -> Config:
    """Load and validate a config; ``None`` follows the discovery order, then built-in defaults."""
    found = discover_config_path(path) if discover else (Path(path) if path else None)
    if found is None:
        cfg = parse_config({"env": [dict(e) for e in DEFAULT_ENVS]}, source="<built-in defaults>")
        return cfg
    try:
        text = found.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([Problem("", f"config file not found: {found}")], str(found)) from None
    except OSError as exc:
        raise ConfigError([Problem("", f"cannot read {found}: {exc.strerror or exc}")], str(found)) from None
    return parse_toml(text, source=str(found.resolve()))


_TOML_POS = re.compile(r"\(at line (\d+), column (\d+)\)")


def parse_toml(text: str, *, source: str = "<string>") -> Config:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        msg = str(exc)
        m = _TOML_POS.search(msg)
        where = f"line {m.group(1)}, column {m.group(2)}" if m else "unknown position"
        base = _TOML_POS.sub("", msg).strip()
        raise ConfigError([Problem("", f"TOML syntax error at {where}: {base}")], source) from None
    return parse_config(raw, source=source)


_SECTIONS = ("daemon", "api", "inference", "trainer", "wandb", "cluster", "health", "env")


def parse_config(raw: Mapping[str, Any], *, source: str = "<dict>") -> Config:
    """Build a validated :class:`Config` from a parsed TOML mapping; raises ConfigError."""
    problems: list[Problem] = []
    sections: dict[str, Any] = {}
    for name in raw:
        if name not in _SECTIONS:
            problems.append(Problem(name, "unknown section" + _suggest(name, _SECTIONS)))
    for name, cls in (
        ("daemon", DaemonConfig),
        ("api", ApiConfig),
        ("inference", InferenceConfig),
        ("trainer", TrainerConfig),
        ("wandb", WandbConfig),
        ("cluster", ClusterConfig),
        ("health", HealthConfig),
    ):
        value = raw.get(name, {})
        if not isinstance(value, Mapping):
            problems.append(Problem(name, f"must be a table, got {_type_name(value)}"))
            value = {}
        sections[name] = _build(cls, value, name, problems)
    envs_raw = raw.get("env", [])
    envs: list[EnvConfig] = []
    if not isinstance(envs_raw, list):
        problems.append(Problem("env", "must be an array of tables ([[env]])"))
        envs_raw = []
    for i, item in enumerate(envs_raw):
        if not isinstance(item, Mapping):
            problems.append(Problem(f"env[{i}]", "must be a table"))
            continue
        envs.append(_build(EnvConfig, item, f"env[{i}]", problems))
    cfg = Config(
        daemon=sections["daemon"],
        api=sections["api"],
        inference=sections["inference"],
        trainer=sections["trainer"],
        wandb=sections["wandb"],
        cluster=sections["cluster"],
        health=sections["health"],
        env=envs,
        source=source,
    )
    problems.extend(_cross_checks(cfg, raw))
    if problems:
        raise ConfigError(problems, source)
    if not cfg.env:
        cfg.warnings.append("no [[env]]: the job has no environments (they must run elsewhere)")
    if (
        cfg.api.enabled
        and not is_loopback(cfg.api.host)
        and not (cfg.api.token or cfg.api.token_file or credential_file(API_CREDENTIAL))
    ):
        cfg.warnings.append(f"api.host = {cfg.api.host!r} is not loopback and api.token is empty")
    for key, name in (
        ("api.token_file", cfg.api.token_file),
        ("inference.token_file", cfg.inference.token_file),
        ("cluster.token_file", cfg.cluster.token_file),
    ):
        if name and (warning := token_file_warning(name, key)) is not None:
            cfg.warnings.append(warning)
    if cfg.wandb.enabled and cfg.trainer.enabled and not _installed("wandb"):
        cfg.warnings.append(
            "wandb.project is set but the wandb package is not installed "
            "(pip install 'atroposd[wandb]'); the job runs without it"
        )
    return cfg


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _type_name(value: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "a table",
    }.get(type(value), type(value).__name__)


def _suggest(name: str, known: Sequence[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _build(cls: type, raw: Mapping[str, Any], prefix: str, problems: list[Problem]) -> Any:
    hints = get_type_hints(cls)
    known = {f.name: f for f in fields(cls) if not f.metadata.get("internal")}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{prefix}.{key}"
        f = known.get(key)
        if f is None:
            problems.append(Problem(path, "unknown key" + _suggest(key, list(known))))
            continue
        typ = hints[f.name]
        if dataclasses.is_dataclass(typ):
            if not isinstance(value, Mapping):
                problems.append(Problem(path, f"must be a table, got {_type_name(value)}"))
                continue
            kwargs[key] = _build(typ, value, path, problems)  # type: ignore[arg-type]
            continue
        err, coerced = _check_value(typ, value, f.metadata)
        if err:
            problems.append(Problem(path, err))
        else:
            kwargs[key] = coerced
    return cls(**kwargs)


def check_fields(section: Any, prefix: str, names: Sequence[str]) -> list[Problem]:
    """Check values set on a built section after loading (command-line flags) against the
    schema's rules for those keys: type, choices and bounds, as ``load_config`` does."""
    hints = get_type_hints(type(section))
    by_name = {f.name: f for f in fields(section)}
    problems = []
    for name in names:
        err, _ = _check_value(hints[name], getattr(section, name), by_name[name].metadata)
        if err:
            problems.append(Problem(f"{prefix}.{name}", err))
    return problems


def _check_value(typ: Any, value: Any, meta: Mapping[str, Any]) -> tuple[str | None, Any]:
    origin = get_origin(typ)
    if origin is types.UnionType:
        # A value of one of several types (a device, or a list of devices): the arm of its own type.
        arms = get_args(typ)
        arm = next((a for a in arms if isinstance(value, get_origin(a) or a)), None)
        if arm is None:
            return "must be " + " or ".join(
                _ARM_NAMES.get(a, str(a)) for a in arms
            ) + f", got {_type_name(value)}", None
        return _check_value(arm, value, meta)
    if typ is bool:
        if not isinstance(value, bool):
            return f"must be true or false, got {_type_name(value)}", None
    elif typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be an integer, got {_type_name(value)}", None
    elif typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number, got {_type_name(value)}", None
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            return "must be a finite number", None
    elif typ is str:
        if not isinstance(value, str):
            return f"must be a string, got {_type_name(value)}", None
    elif origin is list:
        (item,) = get_args(typ)
        if not isinstance(value, list):
            return f"must be an array, got {_type_name(value)}", None
        out = []
        for i, v in enumerate(value):
            err, c = _check_value(item, v, {})
            if err:
                return f"element {i} {err}", None
            out.append(c)
        value = out
    elif origin is dict:
        if not isinstance(value, Mapping):
            return f"must be a table, got {_type_name(value)}", None
        value = dict(value)
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        return "must be one of " + ", ".join(repr(c) for c in choices) + f"; got {value!r}", None
    lo, hi, gt = meta.get("min"), meta.get("max"), meta.get("gt")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if lo is not None and value < lo:
            return f"must be ≥ {_num(lo)}, got {_num(value)}", None
        if gt is not None and value <= gt:
            return f"must be > {_num(gt)}, got {_num(value)}", None
        if hi is not None and value > hi:
            return f"must be ≤ {_num(hi)}, got {_num(value)}", None
    return None, value


_ARM_NAMES: dict[Any, str] = {str: "a string", list[str]: "an array of strings"}


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(v)


_NAME_RE = re.compile(ENV_NAME_PATTERN)


def _trainer_device_problems(device: str | list[str]) -> list[Problem]:
    """``trainer.device``: one device, or a list of one per rank — all on the CPU or all distinct GPUs."""
    if isinstance(device, str):
        if not re.match(DEVICE_PATTERN, device):
            return [Problem("trainer.device", f"must be auto, cpu, cuda:N or a GPU UUID, got {device!r}")]
        return []
    p = [
        Problem(f"trainer.device[{i}]", f"must be cpu, cuda:N or a GPU UUID, got {d!r}")
        for i, d in enumerate(device)
        if d == "auto" or not re.match(DEVICE_PATTERN, d)
    ]
    if not device:
        p.append(Problem("trainer.device", "a list needs at least one device (one per trainer rank)"))
    if p or len(device) < 2:
        return p
    kinds = {"cpu" if d == "cpu" else "gpu" for d in device}
    if len(kinds) > 1:
        p.append(
            Problem("trainer.device", f"every trainer rank must be on the CPU or every one on a GPU, got {device}")
        )
    elif kinds == {"gpu"}:
        seen: dict[str, int] = {}
        for i, d in enumerate(device):
            key = "cuda:0" if d == "cuda" else d
            if key in seen:
                p.append(
                    Problem(f"trainer.device[{i}]", f"{d!r} is already rank {seen[key]}'s device: one GPU per rank")
                )
            seen.setdefault(key, i)
    return p


def _cross_checks(cfg: Config, raw: Mapping[str, Any]) -> list[Problem]:
    import signal as _signal

    p: list[Problem] = []
    t, api, inf = cfg.trainer, cfg.api, cfg.inference
    # external components: url given exactly when enabled = false
    for name, sec in (("api", api), ("inference", inf)):
        if not sec.enabled and not sec.url:
            p.append(Problem(f"{name}.url", f"required when {name}.enabled = false"))
        if sec.enabled and sec.url:
            p.append(
                Problem(
                    f"{name}.url",
                    f"must be empty when {name}.enabled = true (the daemon runs it at {name}.host:{name}.port)",
                )
            )
        if sec.url and not re.match(URL_PATTERN, sec.url):
            p.append(Problem(f"{name}.url", f"must be an http:// or https:// URL, got {sec.url!r}"))
    if 0 < t.clip_eps_high < t.clip_eps:
        p.append(
            Problem(
                "trainer.clip_eps_high",
                f"must be ≥ trainer.clip_eps ({t.clip_eps:g}) or 0 (off): clip-higher widens the upper bound",
            )
        )
    if t.loss == "awsft":
        for key, default in (("clip_eps_high", 0.0), ("rollout_correction", "none")):
            if getattr(t, key) != default:
                p.append(Problem(f"trainer.{key}", 'has no effect with trainer.loss = "awsft" (no importance ratio)'))
    if t.micro_batch_size > t.batch_size:
        p.append(Problem("trainer.micro_batch_size", f"must be ≤ trainer.batch_size ({t.batch_size})"))
    elif t.batch_size % t.micro_batch_size:
        p.append(Problem("trainer.micro_batch_size", f"must divide trainer.batch_size ({t.batch_size})"))
    if len(t.adam_betas) != 2 or not all(0 <= b < 1 for b in t.adam_betas):
        p.append(Problem("trainer.adam_betas", "must be two numbers in [0, 1)"))
    if t.max_token_len > inf.max_model_len:
        p.append(Problem("trainer.max_token_len", f"must be ≤ inference.max_model_len ({inf.max_model_len})"))
    if 0 < t.micro_batch_tokens < t.max_token_len:
        p.append(
            Problem(
                "trainer.micro_batch_tokens",
                f"must be 0 (off) or ≥ trainer.max_token_len ({t.max_token_len}): "
                "every sequence must fit in one micro-batch",
            )
        )
    if t.mode == "lora" and not t.lora_targets:
        p.append(Problem("trainer.lora_targets", 'must name at least one module when trainer.mode = "lora"'))
    # engine × sync × mode (SPEC §7)
    if t.enabled:
        sync = cfg.weight_sync
        if inf.engine == "vllm" and sync == "shared":
            p.append(
                Problem(
                    "trainer.weight_sync",
                    '"shared" is not possible with inference.engine = "vllm" '
                    '(vLLM fuses and repacks weights); use "push" or "reload"',
                )
            )
        if t.mode == "lora":
            allowed = ("shared", "reload") if inf.engine == "torch" else ("reload",)
            if sync not in allowed:
                p.append(
                    Problem(
                        "trainer.weight_sync",
                        f"must be {' or '.join(map(repr, allowed))} with "
                        f'trainer.mode = "lora" and inference.engine = '
                        f'"{inf.engine}"',
                    )
                )
        if t.ranks > 1 and sync == "shared":
            p.append(
                Problem(
                    "trainer.weight_sync",
                    f'"shared" needs one trainer rank (trainer.device lists '
                    f"{t.ranks}): sharded parameters cannot be mapped by a server; "
                    'use "push" or "reload"',
                )
            )
        if t.ranks > 1 and t.mode == "lora":
            p.append(
                Problem(
                    "trainer.mode",
                    f'"lora" is not supported with several trainer ranks (trainer.device '
                    f"lists {t.ranks}): a LoRA model's adapters are small enough for one "
                    "rank; list one device",
                )
            )
        if sync == "shared" and inf.enabled and t.ranks == 1:
            for d in dict.fromkeys(cfg.inference_devices()):
                if "," in d or same_device(t.devices()[0], d) is False:
                    p.append(
                        Problem(
                            "trainer.weight_sync",
                            f'"shared" needs the trainer and every inference '
                            f"replica on one device (trainer.device = {t.device!r}, "
                            f'inference.device = {d!r}); use "push"',
                        )
                    )
                    break
        if (
            t.compute_dtype != "auto"
            and inf.dtype != "auto"
            and t.compute_dtype != inf.dtype
            and sync in ("shared", "push", "broadcast")
        ):
            p.append(
                Problem(
                    "trainer.compute_dtype",
                    f"{t.compute_dtype!r} differs from inference.dtype = "
                    f"{inf.dtype!r}: replicas receive the trainer's working "
                    f"copy as it is with weight_sync = {sync!r}; use the "
                    'inference dtype or "reload"',
                )
            )
        if t.dtype == "bfloat16" and t.optimizer != "adamw":
            p.append(
                Problem(
                    "trainer.dtype",
                    f'"bfloat16" needs the compensated AdamW (trainer.optimizer = "adamw"), not {t.optimizer!r}',
                )
            )
        if sync == "broadcast" and t.nodes > 1:
            p.append(
                Problem(
                    "trainer.weight_sync",
                    '"broadcast" runs on one node (cluster.nodes = 1); with several machines use "push" or "reload"',
                )
            )
        if not inf.enabled and sync in ("shared", "push", "broadcast"):
            p.append(
                Problem(
                    "trainer.weight_sync",
                    f'"{sync}" needs a local inference server (inference.enabled = true); use "reload"',
                )
            )
    if inf.engine == "vllm" and inf.vllm.gpu_memory_utilization == 0.0 and t.enabled:
        shared_gpu = _trainer_gpu_overlap(cfg)
        if shared_gpu is not None:
            p.append(
                Problem(
                    "inference.vllm.gpu_memory_utilization",
                    f"must be > 0 when vLLM shares a GPU with the trainer ({shared_gpu}): it says how "
                    "much of the GPU's memory the replica may take",
                )
            )
    if isinstance(inf.device, list):
        if len(inf.device) != inf.replicas:
            p.append(
                Problem(
                    "inference.device",
                    f"a list must have exactly inference.replicas ({inf.replicas}) "
                    f"entries, one per replica; got {len(inf.device)}",
                )
            )
        for i, d in enumerate(inf.device):
            if not re.match(REPLICA_DEVICE_PATTERN, d):
                p.append(
                    Problem(
                        f"inference.device[{i}]",
                        f'must be auto, cpu, cuda:N, a GPU UUID or several GPUs ("cuda:2,cuda:3"), got {d!r}',
                    )
                )
    elif not re.match(DEVICE_PATTERN, inf.device):
        p.append(Problem("inference.device", f"must be auto, cpu, cuda:N or a GPU UUID, got {inf.device!r}"))
    p.extend(_trainer_device_problems(t.device))
    if inf.enabled and inf.tool_parser:
        # light: reads vLLM's parser names from its source, imports nothing heavy
        from atroposd.toolparsers import parser_problem

        why = parser_problem(inf.tool_parser)
        if why:
            p.append(Problem("inference.tool_parser", why))
    if not inf.model:
        p.append(Problem("inference.model", "must not be empty"))
    elif inf.model.startswith("builtin:") and inf.model not in BUILTIN_MODELS:
        p.append(
            Problem("inference.model", f"unknown built-in model {inf.model!r} (known: {', '.join(BUILTIN_MODELS)})")
        )
    # ports distinct
    ports: dict[int, str] = {}

    def claim(port: int, path: str, who: str = "") -> None:
        """``who``: how the port is derived from ``path`` (an inference replica's port + i)."""
        if port in ports:
            p.append(Problem(path, f"port {port}{f' ({who})' if who else ''} is already used by {ports[port]}"))
        else:
            ports[port] = f"{path} ({who})" if who else path

    if api.enabled:
        claim(api.port, "api.port")
    if inf.enabled:
        if inf.port + inf.replicas - 1 > 65535:
            p.append(
                Problem(
                    "inference.port",
                    f"inference.port + inference.replicas - 1 must be ≤ 65535 "
                    f"(replica i listens on port + i), got {inf.port + inf.replicas - 1}",
                )
            )
        for r in range(inf.replicas):
            claim(inf.port + r, "inference.port", f"inference replica {r}: port + {r}" if inf.replicas > 1 else "")
    if cfg.daemon.metrics_port:
        claim(cfg.daemon.metrics_port, "daemon.metrics_port")
    if cfg.cluster.enabled:
        claim(cfg.cluster.port, "cluster.port")
        claim(cfg.cluster.port + 1, "cluster.port", "the trainer ranks' c10d store: port + 1")
    p.extend(_cluster_checks(cfg))
    p.extend(_token_checks(cfg))
    # environments
    seen: dict[str, int] = {}
    replica_names: set[str] = set()
    for i, e in enumerate(cfg.env):
        pre = f"env[{i}]"
        env_raw = raw.get("env", [])[i] if isinstance(raw.get("env"), list) else {}
        if "name" not in env_raw or not e.name:
            p.append(Problem(f"{pre}.name", "required"))
        elif not _NAME_RE.match(e.name):
            p.append(
                Problem(
                    f"{pre}.name",
                    "must be 1-63 characters of letters, digits, '.', '_' or '-', "
                    f"starting with a letter or digit; got {e.name!r}",
                )
            )
        elif e.name in RESERVED_NAMES:
            p.append(Problem(f"{pre}.name", f"{e.name!r} is reserved for a daemon component"))
        elif e.name in seen:
            p.append(Problem(f"{pre}.name", f"duplicate name {e.name!r} (also env[{seen[e.name]}])"))
        else:
            seen[e.name] = i
            for rn in e.replica_names():
                replica_names.add(rn)
        has_builtin, has_cmd = bool(e.builtin), bool(e.command)
        if has_builtin == has_cmd:
            p.append(Problem(pre, "exactly one of builtin and command is required"))
        if has_builtin and e.builtin not in BUILTIN_ENVS:
            p.append(
                Problem(
                    f"{pre}.builtin", f"unknown built-in environment {e.builtin!r} (known: {', '.join(BUILTIN_ENVS)})"
                )
            )
        if e.options and not has_builtin:
            p.append(Problem(f"{pre}.options", "only a builtin environment takes options"))
        if has_builtin and e.builtin in BUILTIN_ENVS:
            for path, msg in validate_options(e.builtin, e.options):
                p.append(Problem(f"{pre}.options.{path}" if path else f"{pre}.options", msg))
        if t.enabled and e.group_size > t.batch_size:
            p.append(Problem(f"{pre}.group_size", f"must be ≤ trainer.batch_size ({t.batch_size})"))
        if e.group_size > cfg.api.max_queued_sequences:
            p.append(
                Problem(f"{pre}.group_size", f"must be ≤ api.max_queued_sequences ({cfg.api.max_queued_sequences})")
            )
        sig = e.stop_signal.upper()
        if not sig.startswith("SIG"):
            sig = "SIG" + sig
        if sig not in _signal.Signals.__members__:
            p.append(Problem(f"{pre}.stop_signal", f"unknown signal {e.stop_signal!r}"))
        if e.port_base:
            if e.port_base + e.replicas - 1 > 65535:
                p.append(Problem(f"{pre}.port_base", "port_base + replicas - 1 must be ≤ 65535"))
            for r in range(e.replicas):
                claim(e.port_base + r, f"{pre}.port_base")
        if e.command:
            unknown = _unknown_placeholders(e.command)
            if unknown:
                p.append(Problem(f"{pre}.command", "unknown placeholder " + ", ".join("{" + u + "}" for u in unknown)))
            if "{replica_port}" in " ".join(e.command) and not e.port_base:
                p.append(Problem(f"{pre}.port_base", "must be > 0 when command uses {replica_port}"))
    if api.command:
        unknown = _unknown_placeholders(api.command, extra=("port",))
        if unknown:
            p.append(Problem("api.command", "unknown placeholder " + ", ".join("{" + u + "}" for u in unknown)))
    # the control socket path must fit in sun_path
    sock = str(cfg.control_socket)
    if len(sock.encode()) > SOCKET_PATH_MAX:
        p.append(
            Problem(
                "daemon.runtime_dir",
                f"control socket path {sock!r} is {len(sock.encode())} bytes; it must fit in {SOCKET_PATH_MAX}",
            )
        )
    if cfg.daemon.socket_group:
        import grp

        try:
            grp.getgrnam(cfg.daemon.socket_group)
        except KeyError:
            p.append(Problem("daemon.socket_group", f"no such group {cfg.daemon.socket_group!r}"))
    return p


def _token_checks(cfg: Config) -> list[Problem]:
    """The inference servers' token file: readable, at least MIN_TOKEN_BYTES (the API's is
    read where it is used, at start: ``ApiConfig.bearer_token``)."""
    p: list[Problem] = []
    for key, name in (("inference.token_file", cfg.inference.token_file),):
        if name:
            try:
                read_token_file(name, key, TokenError)
            except TokenError as exc:
                p.append(Problem(key, str(exc).removeprefix(f"{key}: ")))
    return p


def _cluster_checks(cfg: Config) -> list[Problem]:
    """The ``[cluster]`` rules of SPEC §12.3 (ports are claimed with the others)."""
    c = cfg.cluster
    p: list[Problem] = []
    if c.node_rank >= 0 or c.enabled:
        try:
            c.resolve_node_rank()
        except ClusterError as exc:
            p.append(Problem("cluster.node_rank", str(exc)))
    if c.bind and ("://" in c.bind or (":" in c.bind and not _is_ip(c.bind))):
        p.append(Problem("cluster.bind", f"must be a host name or address without a scheme or port, got {c.bind!r}"))
    if c.head and ("://" in c.head or (":" in c.head and not _is_ip(c.head))):
        p.append(
            Problem(
                "cluster.head",
                f"must be a host name or address without a scheme or port (the port is cluster.port), got {c.head!r}",
            )
        )
    if not c.enabled:
        return p
    if not c.head:
        p.append(Problem("cluster.head", "required when cluster.nodes > 1 (the host of node 0)"))
    if not c.token_path():
        p.append(
            Problem(
                "cluster.token_file",
                "required when cluster.nodes > 1 (a file holding the shared "
                "secret, the same on every node; under systemd, the "
                f"credential {CLUSTER_CREDENTIAL} may give it)",
            )
        )
    else:
        try:
            c.read_token()
        except ClusterError as exc:
            p.append(Problem("cluster.token_file", str(exc).removeprefix("cluster.token_file: ")))
    if cfg.trainer.enabled and not cfg.trainer.checkpoint_dir:
        p.append(
            Problem(
                "trainer.checkpoint_dir",
                "required when cluster.nodes > 1: a directory every node sees "
                "(NFS, Lustre, ...), where every trainer rank writes its shard",
            )
        )
    if c.head:
        head_loopback = is_loopback(c.head)
        for name, sec in (("api", cfg.api), ("inference", cfg.inference)):
            if sec.enabled and is_loopback(sec.host) and not head_loopback:
                p.append(
                    Problem(
                        f"{name}.host",
                        f"{sec.host!r} is loopback, which the other nodes cannot reach; "
                        f"a loopback host is valid only when cluster.head is loopback "
                        f"(one machine), and cluster.head = {c.head!r}",
                    )
                )
    return p


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    return True


_PLACEHOLDER_RE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _unknown_placeholders(command: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    known = set(PLACEHOLDERS) | set(extra)
    return sorted({m for arg in command for m in _PLACEHOLDER_RE.findall(arg) if m not in known})


def fill_placeholders(command: Sequence[str], values: Mapping[str, str]) -> list[str]:
    """Replace ``{name}`` placeholders (only known names; other braces are left alone)."""
    return [_PLACEHOLDER_RE.sub(lambda m: values.get(m.group(1), m.group(0)), arg) for arg in command]


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


# ---------------------------------------------------------------------------- rendering


def to_dict(cfg: Config, *, resolved: bool = True) -> dict[str, Any]:
    """The config as plain TOML-able data (internal fields dropped; paths resolved if asked)."""

    def conv(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj):
            return {f.name: conv(getattr(obj, f.name)) for f in fields(obj) if not f.metadata.get("internal")}
        if isinstance(obj, list):
            return [conv(x) for x in obj]
        if isinstance(obj, dict):
            return {k: conv(v) for k, v in obj.items()}
        return obj

    out = conv(cfg)
    if resolved:
        out["daemon"]["runtime_dir"] = str(cfg.runtime_dir)
        out["daemon"]["state_dir"] = str(cfg.state_dir)
        if cfg.api.enabled:
            out["api"]["spool_dir"] = str(cfg.spool_dir)
    return dict(out)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e16):
            return f"{v:.6g}".replace("e-0", "e-")
        r = repr(v)
        return r if ("." in r or "e" in r) else r + ".0"
    if isinstance(v, str):
        import json

        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot render {type(v).__name__} as TOML")


def _toml_key(k: str) -> str:
    return k if re.match(r"^[A-Za-z0-9_-]+$", k) else _toml_value(k)


def _render(cfg: Config, *, comments: bool, resolved: bool) -> str:
    data = to_dict(cfg, resolved=resolved)
    out: list[str] = []

    def section(header: str, cls_obj: Any, values: Mapping[str, Any]) -> None:
        out.append(header)
        for f in fields(cls_obj):
            if f.metadata.get("internal") or dataclasses.is_dataclass(getattr(cls_obj, f.name)):
                continue
            value = values[f.name]
            if comments:
                for line in f.metadata["doc"].splitlines():
                    out.append(f"# {line}")
            if comments and not f.metadata.get("example", True) and not value:
                out.append(f'# {f.name} = ["python", "environments/gsm8k_server.py", "serve", ...]')
            elif f.metadata.get("example", True) or value:
                out.append(f"{f.name} = {_toml_value(value)}")
        out.append("")

    section("[daemon]", cfg.daemon, data["daemon"])
    section("[api]", cfg.api, data["api"])
    section("[inference]", cfg.inference, data["inference"])
    if comments:
        out.append("# " + fields(InferenceConfig)[-1].metadata["doc"])
    section("[inference.vllm]", cfg.inference.vllm, data["inference"]["vllm"])
    section("[trainer]", cfg.trainer, data["trainer"])
    section("[wandb]", cfg.wandb, data["wandb"])
    section("[cluster]", cfg.cluster, data["cluster"])
    section("[health]", cfg.health, data["health"])
    for e, ed in zip(cfg.env, data["env"], strict=False):
        section("[[env]]", e, ed)
    return "\n".join(out).rstrip() + "\n"


def dump_toml(cfg: Config) -> str:
    """The effective config as TOML, every key present, paths resolved (``config show``)."""
    return _render(cfg, comments=False, resolved=True)


EXAMPLE_HEADER = """\
#:schema ./atroposd/config.schema.json
# atroposd configuration: every key at its default. These defaults are the embedded CPU job:
# the built-in tiny model learns the built-in arithmetic task, no GPU and no download needed.
# Copy to /etc/atroposd/atroposd.toml (or ./atroposd.toml, or pass -c FILE) and edit.
# `atroposd config check` validates a file; `atroposd config show` prints the effective config.
# The first line points editors (taplo, Even Better TOML) at the JSON Schema of this file, shipped
# as atroposd/config.schema.json; for a copy elsewhere: `atroposd config schema > FILE`, and name FILE.

"""


def render_example() -> str:
    """The text of ``atroposd.toml.example``: built-in defaults, each key with its comment."""
    cfg = load_config(None, discover=False)
    return EXAMPLE_HEADER + _render(cfg, comments=True, resolved=False)


# ---------------------------------------------------------------------------- JSON Schema

_JSON_TYPES: dict[Any, str] = {bool: "boolean", int: "integer", float: "number", str: "string"}
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def _key_schema(typ: Any, f: dataclasses.Field[Any]) -> dict[str, Any]:
    meta = f.metadata
    origin = get_origin(typ)
    out: dict[str, Any]
    if origin is types.UnionType:  # str | list[str]: a JSON type per arm
        out = {"type": [_JSON_TYPES.get(a, "array") for a in get_args(typ)], "items": {"type": "string"}}
    elif origin is list:
        (item,) = get_args(typ)
        out = {"type": "array", "items": {"type": _JSON_TYPES[item]}}
    elif origin is dict:
        out = {"type": "object"}
    else:
        out = {"type": _JSON_TYPES[typ]}
    out["description"] = meta["doc"]
    factory = f.default_factory
    default = factory() if f.default is dataclasses.MISSING and callable(factory) else f.default
    out["default"] = default
    if meta.get("choices") is not None:
        out["enum"] = list(meta["choices"])
    for rule, keyword in (("min", "minimum"), ("max", "maximum"), ("gt", "exclusiveMinimum")):
        if meta.get(rule) is not None:
            out[keyword] = meta[rule]
    for keyword, value in meta.get("schema", {}).items():
        out[keyword] = {**out[keyword], **value} if isinstance(out.get(keyword), dict) else value
    return out


def _section_schema(cls: type, doc: str = "") -> dict[str, Any]:
    hints = get_type_hints(cls)
    props: dict[str, Any] = {}
    for f in fields(cls):
        if f.metadata.get("internal"):
            continue
        typ = hints[f.name]
        props[f.name] = (
            _section_schema(typ, f.metadata.get("doc", ""))
            if isinstance(typ, type) and dataclasses.is_dataclass(typ)
            else _key_schema(typ, f)
        )
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if doc:
        out = {"description": doc, **out}
    return out


def _external() -> dict[str, Any]:
    """``url`` is required exactly when ``enabled = false``."""
    return {
        "if": {"properties": {"enabled": {"const": False}}, "required": ["enabled"]},
        "then": {"properties": {"url": {"minLength": 1}}, "required": ["url"]},
        "else": {"properties": {"url": {"maxLength": 0}}},
    }


def json_schema() -> dict[str, Any]:
    """A JSON Schema (draft 2020-12) of the config file, generated from the dataclasses above:
    every key with its type, default, bounds and comment; unknown keys refused. It expresses
    the rules on one key, and of the cross-key rules those a schema can (``url`` exactly when
    not ``enabled``; exactly one of an environment's ``builtin`` and ``command``; a built-in's
    options). ``atroposd config schema`` prints it; ``config check`` remains the full check."""
    api, inference = _section_schema(ApiConfig), _section_schema(InferenceConfig)
    api["allOf"], inference["allOf"] = [_external()], [_external()]
    env = _section_schema(EnvConfig)
    env["properties"]["builtin"]["enum"] = ["", *BUILTIN_ENVS]
    has_builtin = {"properties": {"builtin": {"minLength": 1}}, "required": ["builtin"]}
    has_command = {"properties": {"command": {"minItems": 1}}, "required": ["command"]}
    env["required"] = ["name"]
    env["oneOf"] = [has_builtin, has_command]
    env["allOf"] = [{"if": {"not": has_builtin}, "then": {"properties": {"options": {"maxProperties": 0}}}}]
    env["allOf"] += [
        {
            "if": {"properties": {"builtin": {"const": name}}, "required": ["builtin"]},
            "then": {"properties": {"options": options_schema(name)}},
        }
        for name in BUILTIN_ENVS
    ]
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        "title": "atroposd configuration",
        "description": "atroposd.toml (SPEC §3). Generated by `atroposd config schema`; `atroposd config check` "
        "also applies the rules between keys that a schema cannot express.",
        "type": "object",
        "properties": {
            "daemon": _section_schema(DaemonConfig),
            "api": api,
            "inference": inference,
            "trainer": _section_schema(TrainerConfig),
            "wandb": _section_schema(WandbConfig),
            "cluster": _section_schema(ClusterConfig),
            "health": _section_schema(HealthConfig),
            "env": {
                "description": "The environments ([[env]]), each run as supervised children.",
                "type": "array",
                "items": env,
            },
        },
        "additionalProperties": False,
    }


def render_json_schema() -> str:
    """The text of ``atroposd/config.schema.json`` (what ``atroposd config schema`` prints)."""
    import json

    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"

"""The schema of the configuration: every key of SPEC §3 a dataclass field, with its default,
its rules on one value and the comment that ``atroposd.toml.example`` shows above it (``_k``);
``Config``, the whole of it, with the values derived from its keys. The example file and the
JSON Schema are rendered from these classes, so defaults are written in exactly one place.
"""

from __future__ import annotations

import copy
import functools
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from atroposd.config.dirs import default_runtime_dir, default_state_dir
from atroposd.config.placeholders import PLACEHOLDERS, placeholder_pattern
from atroposd.config.tokens import (
    API_CREDENTIAL,
    API_TOKEN_ENV,
    CLUSTER_CREDENTIAL,
    TokenError,
    credential_file,
    inference_secret,
    read_token_file,
)
from atroposd.devices import same_device
from atroposd.net import BindError, address_towards, is_loopback

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


_V = TypeVar("_V")


def _k(
    default: _V,
    doc: str,
    *,
    choices: Sequence[Any] | None = None,
    min: float | None = None,
    max: float | None = None,
    gt: float | None = None,
    example: bool = True,
    schema: Mapping[str, Any] | None = None,
) -> _V:
    """A config key: its default, the comment shown above it, and simple value rules.

    ``schema``: JSON Schema keywords for rules that ``checks`` applies to this key alone
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
        schema={"items": {"type": "string", "pattern": placeholder_pattern((*PLACEHOLDERS, "port"))}},
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
    allow_untested: bool = _k(
        False, "Start a vLLM outside the version range atroposd was tested against\n(refused at start otherwise)."
    )


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


# ``clip_eps = "auto"`` / ``clip_eps_high = "auto"``: each loss's own range (SPEC §14)
AUTO_CLIP: dict[str, tuple[float, float]] = {"grpo": (0.2, 0.0), "awsft": (0.2, 0.0), "gspo": (3e-4, 4e-4)}


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
    clip_eps: float | str = _k(
        "auto",
        "Importance-ratio clip: [1 - clip_eps, 1 + clip_eps] ... auto: 0.2 (grpo, awsft),\n"
        "3e-4 (gspo: the GSPO paper's sequence-level range).",
        gt=0,
        max=1,
        schema={"pattern": "^auto$"},
    )
    clip_eps_high: float | str = _k(
        "auto",
        "... unless > 0: the upper bound is 1 + clip_eps_high (DAPO's clip-higher;\nat least clip_eps). "
        "auto: 0 (grpo, awsft), 4e-4 (gspo).",
        min=0,
        max=10,
        schema={"pattern": "^auto$"},
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
    ppo_epochs: int = _k(
        1,
        "Passes over each batch (verl's ppo_epochs, TRL's num_iterations); the weights\nsync once per batch.",
        min=1,
    )
    mini_batches: int = _k(
        1,
        "Optimizer steps per pass: the batch's groups split into this many parts\n"
        "(verl's ppo_mini_batch_size, TRL's steps_per_generation); divides the batch's groups.",
        min=1,
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
    inflight: str = _k(
        "keep",
        "What a weight sync does with the generations in flight. keep = freeze them between\n"
        "two decode steps, swap the weights, let them go on (the tokens after the swap come\n"
        "from the new weights; a response that spans a swap carries weight_versions);\n"
        "drain = admit nothing new and wait until every admitted generation has finished.",
        choices=("keep", "drain"),
    )
    inflight_kv: str = _k(
        "recompute",
        "inflight = keep: recompute = the frozen sequences' KV cache is computed again with\n"
        "the new weights before they go on; keep = they decode over the old KV (faster, staler).",
        choices=("recompute", "keep"),
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

    def clip_range(self) -> tuple[float, float]:
        """(clip_eps, clip_eps_high) in use: a number set in the file as given; ``"auto"`` the
        loss's own (SPEC §14: 0.2 and 0 for grpo and awsft, 3e-4 and 4e-4 for gspo)."""
        eps, high = AUTO_CLIP.get(self.loss, AUTO_CLIP["grpo"])
        return (
            eps if isinstance(self.clip_eps, str) else float(self.clip_eps),
            high if isinstance(self.clip_eps_high, str) else float(self.clip_eps_high),
        )

    @property
    def optimizer_steps_per_batch(self) -> int:
        """Optimizer steps on each batch (SPEC §14: ppo_epochs × mini_batches)."""
        return int(self.ppo_epochs) * int(self.mini_batches)


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


SANDBOX_ENGINE_PATTERN = r"^$|^unix:///.+$"
SANDBOX_MEMORY_PATTERN = r"^\s*\d+(\.\d+)?\s*[kmgtKMGT]?[iI]?[bB]?\s*$"


@dataclass
class SandboxConfig:
    engine: str = _k(
        "",
        'The Docker-compatible engine\'s socket ("unix:///run/podman/podman.sock",\n'
        '"unix:///var/run/docker.sock"); "" = off (no DOCKER_HOST is given). Each environment\n'
        "replica gets DOCKER_HOST on a socket of its own in runtime_dir (docs/SANDBOX.md).",
        schema={"pattern": SANDBOX_ENGINE_PATTERN},
    )
    max_containers: int = _k(32, "Live containers per environment replica; creating more is refused.", min=1)
    memory: str = _k(
        "4g", "Memory limit of a container whose request sets none.", schema={"pattern": SANDBOX_MEMORY_PATTERN}
    )
    max_age: float = _k(3600.0, "Seconds; an older container of the job is removed.", gt=0)
    allow_privileged: bool = _k(
        False,
        "Allow privileged containers, host network/PID/IPC/user/cgroup namespaces, added\n"
        "capabilities, devices, unconfined security options and bind mounts of host paths\n"
        "(a mount of the engine's own socket is refused always).",
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
        schema={"items": {"type": "string", "pattern": placeholder_pattern(PLACEHOLDERS)}},
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
        "registrations with the API or its CPU use (docs/TROUBLESHOOTING.md); 0 = off.",
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
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
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

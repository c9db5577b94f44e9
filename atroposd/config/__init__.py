"""The one typed configuration of a job: schema, defaults, loading and validation.

Every key of SPEC §3 is a dataclass field of ``schema``, with its default and the comment
that ``atroposd.toml.example`` shows above it; the example file is rendered from that schema
(``render_toml``), and so is the JSON Schema (``render_schema``), so defaults are written in
exactly one place.

``load_config`` (``load``) parses a TOML file, rejects unknown keys, type-checks every value
and applies the cross-key rules (``checks``), collecting *every* problem
(``ConfigError.problems``, each with its key path) before raising. Nothing here imports torch.

This package's modules import each other directly; the rest of atroposd imports the names
below from ``atroposd.config``.
"""

from __future__ import annotations

from atroposd.config.dirs import default_runtime_dir, default_state_dir, fallback_runtime_dir
from atroposd.config.errors import ConfigError, Problem
from atroposd.config.load import (
    DEFAULT_ENVS,
    check_fields,
    discover_config_path,
    load_config,
    parse_config,
    parse_toml,
    tomllib,
)
from atroposd.config.placeholders import PLACEHOLDERS, fill_placeholders
from atroposd.config.render_schema import JSON_SCHEMA_DIALECT, json_schema, render_json_schema
from atroposd.config.render_toml import EXAMPLE_HEADER, dump_toml, render_example, to_dict
from atroposd.config.schema import (
    BUILTIN_MODELS,
    CLUSTER_NODE_RANK_ENV,
    CONTROL_SOCKET_NAME,
    DEVICE_PATTERN,
    ENV_NAME_PATTERN,
    MAX_INFERENCE_REPLICAS,
    MODEL_PATTERN,
    REPLICA_DEVICE_PATTERN,
    RESERVED_NAMES,
    SLURM_NODE_ID_ENV,
    SOCKET_PATH_MAX,
    URL_PATTERN,
    ApiConfig,
    ClusterConfig,
    ClusterError,
    Config,
    DaemonConfig,
    EnvConfig,
    HealthConfig,
    InferenceConfig,
    SandboxConfig,
    TrainerConfig,
    VllmConfig,
    WandbConfig,
)
from atroposd.config.tokens import (
    API_CREDENTIAL,
    API_TOKEN_ENV,
    CLUSTER_CREDENTIAL,
    CREDENTIALS_ENV,
    INFERENCE_TOKEN_ENV,
    MIN_TOKEN_BYTES,
    TokenError,
    credential_file,
    inference_secret,
    read_token_file,
    token_file_warning,
)

__all__ = [
    "API_CREDENTIAL",
    "API_TOKEN_ENV",
    "BUILTIN_MODELS",
    "CLUSTER_CREDENTIAL",
    "CLUSTER_NODE_RANK_ENV",
    "CONTROL_SOCKET_NAME",
    "CREDENTIALS_ENV",
    "DEFAULT_ENVS",
    "DEVICE_PATTERN",
    "ENV_NAME_PATTERN",
    "EXAMPLE_HEADER",
    "INFERENCE_TOKEN_ENV",
    "JSON_SCHEMA_DIALECT",
    "MAX_INFERENCE_REPLICAS",
    "MIN_TOKEN_BYTES",
    "MODEL_PATTERN",
    "PLACEHOLDERS",
    "REPLICA_DEVICE_PATTERN",
    "RESERVED_NAMES",
    "SLURM_NODE_ID_ENV",
    "SOCKET_PATH_MAX",
    "URL_PATTERN",
    "ApiConfig",
    "ClusterConfig",
    "ClusterError",
    "Config",
    "ConfigError",
    "DaemonConfig",
    "EnvConfig",
    "HealthConfig",
    "InferenceConfig",
    "Problem",
    "SandboxConfig",
    "TokenError",
    "TrainerConfig",
    "VllmConfig",
    "WandbConfig",
    "check_fields",
    "credential_file",
    "default_runtime_dir",
    "default_state_dir",
    "discover_config_path",
    "dump_toml",
    "fallback_runtime_dir",
    "fill_placeholders",
    "inference_secret",
    "json_schema",
    "load_config",
    "parse_config",
    "parse_toml",
    "read_token_file",
    "render_example",
    "render_json_schema",
    "to_dict",
    "token_file_warning",
    "tomllib",
]

"""Loading a configuration: find the file (SPEC §2), parse its TOML, build the sections while
rejecting unknown keys and checking every value's type and simple rules, then apply the
cross-key rules (``checks``), collecting *every* problem before raising ``ConfigError``."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import types
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, get_args, get_origin, get_type_hints

from atroposd.config.checks import cross_checks
from atroposd.config.errors import ConfigError, Problem
from atroposd.config.schema import (
    ApiConfig,
    ClusterConfig,
    Config,
    DaemonConfig,
    EnvConfig,
    HealthConfig,
    InferenceConfig,
    SandboxConfig,
    TrainerConfig,
    WandbConfig,
)
from atroposd.config.tokens import API_CREDENTIAL, credential_file, token_file_warning
from atroposd.net import is_loopback

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_Section = TypeVar("_Section", bound="DataclassInstance")

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

# The built-in defaults are the embedded CPU job: the schema defaults plus one environment.
DEFAULT_ENVS: tuple[dict[str, Any], ...] = ({"name": "arithmetic", "builtin": "arithmetic"},)


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


_SECTIONS = ("daemon", "api", "inference", "trainer", "wandb", "cluster", "health", "sandbox", "env")


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
        ("sandbox", SandboxConfig),
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
        sandbox=sections["sandbox"],
        env=envs,
        source=source,
    )
    problems.extend(cross_checks(cfg, raw))
    if problems:
        raise ConfigError(problems, source)
    cfg.warnings.extend(_warnings(cfg))
    return cfg


def _warnings(cfg: Config) -> list[str]:
    """What a valid config should still be told about (``Config.warnings``)."""
    warnings: list[str] = []
    if not cfg.env:
        warnings.append("no [[env]]: the job has no environments (they must run elsewhere)")
    if (
        cfg.api.enabled
        and not is_loopback(cfg.api.host)
        and not (cfg.api.token or cfg.api.token_file or credential_file(API_CREDENTIAL))
    ):
        warnings.append(f"api.host = {cfg.api.host!r} is not loopback and api.token is empty")
    if (
        cfg.inference.enabled
        and not is_loopback(cfg.inference.host)
        and not cfg.inference.token_file
        and cfg.cluster.nodes <= 1  # several machines: a token derived from the cluster token
    ):
        warnings.append(
            f"inference.host = {cfg.inference.host!r} is not loopback and inference.token_file is empty: "
            "whoever reaches the port can generate"
        )
    for key, name in (
        ("api.token_file", cfg.api.token_file),
        ("inference.token_file", cfg.inference.token_file),
        ("cluster.token_file", cfg.cluster.token_file),
    ):
        if name and (warning := token_file_warning(name, key)) is not None:
            warnings.append(warning)
    if cfg.wandb.enabled and cfg.trainer.enabled and not _installed("wandb"):
        warnings.append(
            "wandb.project is set but the wandb package is not installed "
            "(pip install 'atroposd[wandb]'); the job runs without it"
        )
    return warnings


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _type_name(value: object) -> str:
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


def _build(cls: type[_Section], raw: Mapping[str, Any], prefix: str, problems: list[Problem]) -> _Section:
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


def check_fields(section: DataclassInstance, prefix: str, names: Sequence[str]) -> list[Problem]:
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


def _check_value(typ: object, value: object, meta: Mapping[str, Any]) -> tuple[str | None, object]:
    origin = get_origin(typ)
    if origin is types.UnionType:
        # A value of one of several types (a device, or a list of devices): the arm of its own type.
        arms = get_args(typ)
        arm = next((a for a in arms if isinstance(value, get_origin(a) or a)), None)
        if arm is None and float in arms and isinstance(value, int) and not isinstance(value, bool):
            arm = float  # a whole number for a number-or-string key ("auto")
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


_ARM_NAMES: dict[Any, str] = {str: "a string", list[str]: "an array of strings", float: "a number"}


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(v)

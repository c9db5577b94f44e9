"""The configuration as TOML: ``config show``'s effective config and the commented example
(``atroposd.toml.example``), both rendered from the schema."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any, cast

from atroposd.config.load import load_config
from atroposd.config.schema import Config, InferenceConfig

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


def to_dict(cfg: Config, *, resolved: bool = True) -> dict[str, Any]:
    """The config as plain TOML-able data (internal fields dropped; paths resolved if asked)."""

    def conv(obj: object) -> object:
        if dataclasses.is_dataclass(obj):
            return {f.name: conv(getattr(obj, f.name)) for f in fields(obj) if not f.metadata.get("internal")}
        if isinstance(obj, list):
            return [conv(x) for x in obj]
        if isinstance(obj, dict):
            return {k: conv(v) for k, v in obj.items()}
        return obj

    out = cast("dict[str, Any]", conv(cfg))  # a dataclass converts to a dict
    if resolved:
        out["daemon"]["runtime_dir"] = str(cfg.runtime_dir)
        out["daemon"]["state_dir"] = str(cfg.state_dir)
        if cfg.api.enabled:
            out["api"]["spool_dir"] = str(cfg.spool_dir)
    return dict(out)


def _toml_value(v: object) -> str:
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

    def section(header: str, cls_obj: DataclassInstance, values: Mapping[str, Any]) -> None:
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
    section("[sandbox]", cfg.sandbox, data["sandbox"])
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

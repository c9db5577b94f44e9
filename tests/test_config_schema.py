"""The config's JSON Schema (``atroposd config schema``): generated from the one schema in
atroposd/config/schema.py, shipped as atroposd/config.schema.json, and agreeing with ``config check`` on
everything a schema can express."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import jsonschema
import pytest

from atroposd.config import ConfigError, json_schema, parse_toml, render_json_schema
from tests.test_config import ENV, EXAMPLE, INVALID, REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib

SHIPPED = REPO / "atroposd" / "config.schema.json"
VALIDATOR = jsonschema.Draft202012Validator(json_schema())

# The invalid configs of test_config.py that only `config check` can refuse: rules between
# keys (batch sizes, ports, engine × sync, max_token_len), uniqueness of names, signal
# names, and a non-finite number (JSON has none).
NOT_EXPRESSIBLE = {
    "trainer.micro_batch_size",
    "env[0].group_size",
    "trainer.weight_sync",
    "inference.port",
    "env[1].name",
    "env[0].stop_signal",
    "trainer.max_token_len",
    "daemon.stop_timeout",
    "trainer.clip_eps_high",
    "trainer.rollout_correction",
}


def _errors(text: str) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(tomllib.loads(text))]


def test_schema_is_a_valid_draft_2020_12_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(json_schema())


def test_shipped_schema_is_up_to_date() -> None:
    assert SHIPPED.read_text() == render_json_schema(), (
        "regenerate with: atroposd config schema > atroposd/config.schema.json"
    )


def test_config_schema_command_prints_it() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "atroposd", "config", "schema"], capture_output=True, text=True, timeout=60, check=False
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == json_schema()


def test_example_points_editors_at_the_schema_and_validates() -> None:
    text = EXAMPLE.read_text()
    first = text.splitlines()[0]
    assert first.startswith("#:schema ")
    assert (EXAMPLE.parent / first.removeprefix("#:schema ").strip()).resolve() == SHIPPED.resolve()
    assert _errors(text) == []


def _walk(schema: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for key, sub in schema.get("properties", {}).items():
        out.append((f"{path}{key}", sub))
        if sub.get("type") == "object" and "properties" in sub:
            out += _walk(sub, f"{path}{key}.")
        if sub.get("type") == "array" and "properties" in sub.get("items", {}):
            out += _walk(sub["items"], f"{path}{key}[].")
    return out


def test_every_key_has_type_default_and_description() -> None:
    keys = _walk(json_schema(), "")
    assert len(keys) > 80
    for path, sub in keys:
        if path.count(".") == 0 or path.endswith(".options") or path == "inference.vllm":
            continue  # sections, and the free-form options table (typed per built-in below)
        assert {"type", "default", "description"} <= sub.keys(), path
    props = dict(keys)
    assert props["api.port"]["minimum"] == 1 and props["api.port"]["maximum"] == 65535
    assert props["trainer.lr"]["exclusiveMinimum"] == 0
    assert props["trainer.loss"]["enum"] == ["grpo", "gspo", "awsft"]
    assert props["daemon"]["additionalProperties"] is False
    assert props["env"]["items"]["additionalProperties"] is False


@pytest.mark.parametrize(("text", "path", "fragment"), INVALID, ids=[c[1] + ":" + c[2][:20] for c in INVALID])
def test_invalid_configs_get_the_same_verdict(text: str, path: str, fragment: str) -> None:
    with pytest.raises(ConfigError):
        parse_toml(text)
    errors = _errors(text)
    if path in NOT_EXPRESSIBLE:
        assert errors == [], f"{path} is listed as beyond a schema, yet it refuses it: {errors}"
    else:
        assert errors, f"the schema accepts what config check refuses ({path}: {fragment})"


@pytest.mark.parametrize(
    "text",
    [
        "",
        ENV,
        '[api]\nenabled = false\nurl = "http://10.0.0.5:8000"\n',
        '[inference]\nmodel = "/srv/models/qwen"\ndevice = "cuda:1"\n[trainer]\ndevice = "GPU-0a1b"\n',
        '[[env]]\nname = "gsm8k"\ncommand = ["python", "gsm.py", "--url", "{api_url}", "--w", "{weight}", "{}"]\n',
        '[[env]]\nname = "a"\nbuiltin = "arithmetic"\noptions = {operators = ["+", "*"], max_tokens = 4}\n'
        "weight = 2.5\n",
    ],
)
def test_valid_configs_pass_both(text: str) -> None:
    parse_toml(text)
    assert _errors(text) == []

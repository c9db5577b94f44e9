"""One daemon trains on an unmodified atroposlib environment of every server type (vllm, sglang,
openai, trl), each started from docs/ENVIRONMENTS.md's `[[env]]` entries exactly ("Atropos
environments of every server type"), which this test also checks against that page's table."""

from __future__ import annotations

import json
import re
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.jobs import daemon_env, job_config, status
from tests.support import REPO, atroposd, wait_for

pytest.importorskip("atroposlib")

SECTION = "## Atropos environments of every server type"
PAGE = REPO / "docs" / "ENVIRONMENTS.md"
TYPES = ("vllm", "sglang", "openai", "trl")


def doc_section() -> str:
    text = PAGE.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end >= 0 else len(text)]


def doc_table() -> dict[str, dict[str, str]]:
    """server_type → the first placeholder of its base_url and model_name cells."""
    rows = {}
    for line in doc_section().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].strip("`") in TYPES:
            first = [re.search(r"\{\w+\}", c) for c in cells[2:]]
            assert all(first), line
            rows[cells[0].strip("`")] = {"base_url": first[0].group(0), "model_name": first[1].group(0)}  # type: ignore[union-attr]
    return rows


def doc_envs() -> list[dict[str, Any]]:
    import tomllib

    block = re.search(r"```toml\n(.*?)```", doc_section(), re.S)
    assert block, "docs/ENVIRONMENTS.md's server-type section has no toml block"
    return list(tomllib.loads(block.group(1))["env"])


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_the_documented_entries_follow_the_table() -> None:
    table, envs = doc_table(), doc_envs()
    assert sorted(table) == sorted(TYPES)
    by_type = {flag(e["command"], "--openai.server_type"): e for e in envs}
    assert sorted(by_type) == sorted(TYPES)
    for server_type, row in table.items():
        command = by_type[server_type]["command"]
        assert flag(command, "--openai.base_url") == row["base_url"], server_type
        assert flag(command, "--openai.model_name") == row["model_name"], server_type
        assert (REPO / command[1]).is_file(), command[1]


def _api(cfg: Path, path: str, body: Any = None) -> Any:
    import tomllib

    port = tomllib.loads(cfg.read_text())["api"]["port"]
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        method="POST" if body is not None else "GET",
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def trained_groups(cfg: Path) -> dict[str, int]:
    """Per registered environment (its name): groups that left the queue into batches."""
    envs = _api(cfg, "/atroposd/registrations")["envs"]
    return {
        e["name"]: _api(cfg, "/status-env", {"env_id": e["env_id"], "wait_s": 0, "dequeued": -1})["dequeued"]
        for e in envs
    }


def inference_requests(cfg: Path) -> dict[str, float]:
    """The inference server's answered requests (outcome ok) by route, from its /metrics."""
    import tomllib
    from prometheus_client.parser import text_string_to_metric_families

    port = tomllib.loads(cfg.read_text())["inference"]["port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        s.labels["route"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "atroposd_inference_requests_total" and s.labels.get("outcome") == "ok"
    }


@pytest.mark.atroposlib
@pytest.mark.slow
def test_an_environment_of_every_server_type_trains(short_tmp: Path) -> None:
    envs = doc_envs()
    for env in envs:
        command = env["command"]
        env["command"] = [sys.executable, str(REPO / command[1]), *command[2:]]
        env["ready_timeout"] = 240.0
        env["group_size"] = 4
    names = [e["name"] for e in envs]
    cfg = job_config(short_tmp, steps=100_000, envs=envs, trainer={"batch_size": 16, "micro_batch_size": 16})
    res = atroposd("start", "-c", str(cfg), env=daemon_env(), timeout=360)
    try:
        assert res.returncode == 0, f"start exited {res.returncode}: {res.stderr[-3000:]}"
        wait_for(
            lambda: all(n > 0 for n in trained_groups(cfg).values()) and len(trained_groups(cfg)) == 4,
            timeout=240,
            interval=1.0,
            what="groups of every environment in trained batches",
        )
        registered = sorted(trained_groups(cfg))  # "{name}" is the replica's name; the API adds "_<i>"
        assert [r.rsplit("-", 1)[0] for r in registered] == sorted(names), registered
        served = inference_requests(cfg)  # each environment reached the route of its own type
        assert all(served.get(route, 0) > 0 for route in ("generate", "sglang", "trl", "completions")), served
        # training (a step may find the trainer a moment between states: waiting for the model)
        wait_for(lambda: status(cfg)["trainer"]["state"] == "training", timeout=60, interval=0.5, what="training")
        st = status(cfg)
        assert st["trainer"]["step"] >= 1, st["trainer"]
        assert all(c["state"] == "ready" for c in st["components"] if c["name"].startswith("atropos-")), st[
            "components"
        ]
    finally:
        assert atroposd("stop", "-c", str(cfg), timeout=120).returncode == 0

"""The example environment (examples/atropos_sandbox_env.py: atroposlib unmodified, scoring in a
container through docker-py) trains 30 steps under the daemon; every score it got from the
container equals the score computed in-process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from atroposd.sandbox.labels import job_id
from tests.e2e.jobs import daemon_env, job_config
from tests.sandbox.engine import IMAGE, Podman
from tests.support import REPO, atroposd, wait_for

pytest.importorskip("atroposlib")
pytest.importorskip("docker")
pytestmark = [pytest.mark.slow, pytest.mark.atroposlib]

EXAMPLE = REPO / "examples" / "atropos_sandbox_env.py"
COMMAND = [
    sys.executable, str(EXAMPLE), "serve", "--env.sandbox_image", IMAGE,
    "--env.tokenizer_name", "{tokenizer}", "--openai.tokenizer_name", "{tokenizer}",
    "--openai.model_name", "{model}", "--openai.server_type", "vllm", "--openai.base_url", "{inference_url}",
    "--openai.api_key", "x", "--env.rollout_server_url", "{api_url}", "--env.total_steps", "{steps}",
    "--env.group_size", "{group_size}", "--env.use_wandb", "false",
]  # fmt: skip
STEPS = 30


def scored(log: Path) -> list[dict[str, object]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith('{"scored"'):
            out.append(json.loads(line)["scored"])
    return out


def test_the_example_scores_in_its_container_as_in_process(podman: Podman, short_tmp: Path) -> None:
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        from atropos_sandbox_env import score  # the example's own in-process rule
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    envs = [{"name": "sandbox-arith", "command": COMMAND, "ready": "registered", "ready_timeout": 180.0}]
    cfg = job_config(
        short_tmp,
        steps=STEPS,
        envs=envs,
        trainer={"batch_size": 8, "micro_batch_size": 8},
        sandbox={"engine": podman.url},
    )
    res = atroposd("start", "-c", str(cfg), env=daemon_env(), timeout=300)
    job = job_id(short_tmp / "state")
    try:
        assert res.returncode == 0, f"start exited {res.returncode}: {res.stderr[-3000:]}"
        boxes = wait_for(lambda: podman.containers(f"label=atroposd.job={job}"), timeout=60, what="its container")
        assert len(boxes) == 1, boxes  # one long-lived container for the replica
        assert boxes[0]["Labels"]["atroposd.env"] == "sandbox-arith"
        # the job ends by itself after its last step (the daemon then stops: `stop` finds none)
        wait_for(
            lambda: (
                (r := atroposd("status", "-c", str(cfg), "--json")).returncode != 0
                or json.loads(r.stdout)["trainer"]["step"] >= STEPS
            ),
            timeout=240,
            interval=0.5,
            what=f"{STEPS} steps on the sandboxed environment's groups",
        )
    finally:
        assert atroposd("stop", "-c", str(cfg), timeout=120).returncode in (0, 3)
    groups = scored(short_tmp / "state" / "logs" / "sandbox-arith-0.log")
    assert len(groups) >= STEPS  # one group a step (batch_size = group_size)
    for g in groups:
        expected = [score(int(g["a"]), int(g["b"]), text) for text in g["completions"]]  # type: ignore[arg-type, union-attr]
        assert g["scores"] == expected, g
    assert any(s > 0 for g in groups for s in g["scores"])  # type: ignore[union-attr]
    assert not podman.containers(f"label=atroposd.job={job}")

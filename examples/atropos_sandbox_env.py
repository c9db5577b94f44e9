"""An Atropos environment (an atroposlib ``BaseEnv`` subclass, atroposlib unmodified) whose scoring
runs the model's answers in a container, through docker-py, as agent environments run tools and
code: one long-lived container per replica, one exec per group.

It asks single-digit sums (``7+5=``). Each group's completions are scored inside the container by
a small awk program, the same rule as :func:`score` here; each scored group is logged as one
``scored`` JSON line (the sum, the completions as sent, the scores), so that the container's
scores can be checked against :func:`score` afterwards.

Nothing in it knows about atroposd. docker-py finds the engine through ``DOCKER_HOST``, which
atroposd sets to the replica's own socket when ``[sandbox] engine`` is set (docs/SANDBOX.md): the
container is labelled with the job, removed when the replica restarts or the job stops, and
removed at the next start if the daemon was killed.

    [sandbox]
    engine = "unix:///run/podman/podman.sock"

    [[env]]
    name = "sandbox-arith"
    command = ["python", "examples/atropos_sandbox_env.py", "serve",
               "--env.sandbox_image", "busybox:1.36",
               "--env.tokenizer_name", "{tokenizer}", "--openai.tokenizer_name", "{tokenizer}",
               "--openai.model_name", "{model}", "--openai.server_type", "vllm",
               "--openai.base_url", "{inference_url}", "--openai.api_key", "x",
               "--env.rollout_server_url", "{api_url}", "--env.total_steps", "{steps}",
               "--env.group_size", "{group_size}", "--env.use_wandb", "false"]
    ready = "registered"

Requires atroposlib and docker-py (``pip install atroposlib docker``) and an image with a POSIX
``awk`` (busybox has one).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any

import docker
from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from pydantic import Field

# The scoring rule, run by awk in the container: ARGV[1..] are the completions, ans the sum.
AWK_SCORE = r"""BEGIN {
  for (i = 1; i < ARGC; i++) {
    t = ARGV[i]; gsub(/^ +| +$/, "", t)
    if (t == ans) s = "1.0"
    else if (t ~ /^[0-9]+$/ && substr(t, 1, 1) == substr(ans, 1, 1)) s = "0.3"
    else if (t ~ /^[0-9]+$/) s = "0.1"
    else s = "0.0"
    print s
  }
}"""


def as_sent(text: str) -> str:
    """A completion as it is passed to the container: printable ASCII, a tab, newline or carriage
    return as a space, anything else as ``?`` (an argument cannot hold every byte)."""
    return "".join(c if " " <= c <= "~" else " " if c in "\t\n\r" else "?" for c in text)


def score(a: int, b: int, completion: str) -> float:
    """1.0 for the exact sum, 0.3 for digits whose first is the sum's, 0.1 for other digits, else 0."""
    answer = str(a + b)
    text = completion.strip(" \t\n\r")
    if text == answer:
        return 1.0
    if re.fullmatch(r"[0-9]+", text) and text[0] == answer[0]:
        return 0.3
    return 0.1 if re.fullmatch(r"[0-9]+", text) else 0.0


class SandboxEnvConfig(BaseEnvConfig):
    sandbox_image: str = Field("busybox:1.36", description="The image scoring runs in (it needs awk)")


class SandboxArithmeticEnv(BaseEnv):
    name = "sandbox_arithmetic"
    env_config_cls = SandboxEnvConfig  # type: ignore[assignment]

    @classmethod
    def config_init(cls) -> tuple[SandboxEnvConfig, list[APIServerConfig]]:
        env_config = SandboxEnvConfig(
            group_size=8,
            use_wandb=False,
            wandb_name=cls.name,  # sent as /register-env's desired_name
            max_token_length=16,
            ensure_scores_are_not_same=False,
            steps_per_eval=1_000_000,
        )
        servers = [
            APIServerConfig(
                model_name="tiny", base_url="http://127.0.0.1:9001", api_key="x", server_type="vllm",
                num_requests_for_eval=0,
            )
        ]  # fmt: skip
        return env_config, servers

    async def setup(self) -> None:
        self.rng = random.Random(0)
        self.docker = docker.from_env()
        image = self.config.sandbox_image  # type: ignore[attr-defined]
        # One long-lived container for the replica: every group is one exec in it (an exec costs
        # a fraction of a second; a container per group would cost a create, start and remove).
        self.box = await asyncio.to_thread(
            self.docker.containers.run, image, ["sh", "-c", "while :; do sleep 3600; done"], detach=True,
            network_disabled=True, mem_limit="64m",
        )  # fmt: skip

    async def get_next_item(self) -> tuple[int, int]:
        return self.rng.randint(0, 9), self.rng.randint(0, 9)

    def _score_in_box(self, answer: int, texts: list[str]) -> list[float]:
        # An engine may lose the output of a very short exec (podman 4.3 does, about one in 60
        # here): a score per completion, or the exec again.
        for _ in range(3):
            result = self.box.exec_run(["awk", "-v", f"ans={answer}", "--", AWK_SCORE, *texts])
            if result.exit_code != 0:
                raise RuntimeError(f"scoring in the container failed ({result.exit_code}): {result.output[-500:]!r}")
            scores = [float(line) for line in result.output.decode().split()]
            if len(scores) == len(texts):
                return scores
        raise RuntimeError(f"the container answered {len(scores)} scores for {len(texts)} completions, three times")

    async def collect_trajectories(self, item: tuple[int, int]) -> tuple[ScoredDataGroup, list[Any]]:
        a, b = item
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            completion = await managed.completion(
                prompt=f"{a}+{b}=", n=self.config.group_size, max_tokens=3, temperature=1.0
            )
            nodes = managed.get_state()["nodes"]
        texts = [as_sent(choice.text) for choice in completion.choices]
        scores = await asyncio.to_thread(self._score_in_box, a + b, texts)
        print(json.dumps({"scored": {"a": a, "b": b, "completions": texts, "scores": scores}}), flush=True)
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[])
        for node, value in zip(nodes, scores, strict=True):
            group["tokens"].append(node.tokens)
            group["masks"].append(node.masked_tokens)
            group["inference_logprobs"].append(node.logprobs)
            group["scores"].append(value)
        return group, []

    async def evaluate(self, *args: object, **kwargs: object) -> None:
        return None


if __name__ == "__main__":
    SandboxArithmeticEnv.cli()

"""An unmodified-style Atropos environment (an atroposlib ``BaseEnv`` subclass) for atroposd.

It asks the policy single-digit sums (``7+5=``) and rewards the exact answer. Nothing in it
knows about atroposd: it is the kind of environment an Atropos user already has, and it runs
under the daemon through ``[[env]] command`` with the placeholders atroposd fills in:

    [[env]]
    name = "atropos-arith"
    command = ["python", "examples/atropos_arithmetic_env.py", "serve",
               "--env.tokenizer_name", "{tokenizer}", "--openai.tokenizer_name", "{tokenizer}",
               "--openai.model_name", "{model}", "--openai.server_type", "vllm",
               "--openai.base_url", "{inference_url}", "--openai.api_key", "x",
               "--env.rollout_server_url", "{api_url}", "--env.total_steps", "{steps}",
               "--env.group_size", "{group_size}", "--env.use_wandb", "false"]
    ready = "registered"

Requires ``pip install atroposlib`` (or ``pip install 'atroposd[atropos]'``).
"""

from __future__ import annotations

import random

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup


def score(a: int, b: int, completion: str) -> float:
    """1.0 for the exact sum, 0.3 for the right first digit, 0.1 for digits only, else 0."""
    answer = str(a + b)
    text = completion.strip()
    if text == answer:
        return 1.0
    if text[:1] == answer[:1] and text.isdigit():
        return 0.3
    return 0.1 if text.isdigit() else 0.0


class ArithmeticEnv(BaseEnv):
    name = "arithmetic_example"

    @classmethod
    def config_init(cls) -> tuple[BaseEnvConfig, list[APIServerConfig]]:
        env_config = BaseEnvConfig(
            group_size=8,
            use_wandb=False,
            # sent as /register-env's desired_name, which the API requires (as run-api does)
            wandb_name=cls.name,
            max_token_length=16,
            # every group is useful to GRPO's KL term and to the accuracy metric
            ensure_scores_are_not_same=False,
            steps_per_eval=1_000_000,
        )
        # A list (not a single config): only then does atroposlib honour --openai.base_url.
        servers = [APIServerConfig(model_name="tiny", base_url="http://127.0.0.1:9001", api_key="x",
                                   server_type="vllm", num_requests_for_eval=0)]
        return env_config, servers

    async def setup(self) -> None:
        self.rng = random.Random(0)

    async def get_next_item(self) -> tuple[int, int]:
        return self.rng.randint(0, 9), self.rng.randint(0, 9)

    async def collect_trajectories(self, item: tuple[int, int]) -> tuple[ScoredDataGroup, list]:
        a, b = item
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            completion = await managed.completion(prompt=f"{a}+{b}=", n=self.config.group_size,
                                                  max_tokens=3, temperature=1.0)
            nodes = managed.get_state()["nodes"]
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[])
        for choice, node in zip(completion.choices, nodes, strict=False):
            group["tokens"].append(node.tokens)
            group["masks"].append(node.masked_tokens)
            group["inference_logprobs"].append(node.logprobs)
            group["scores"].append(score(a, b, choice.text))
        return group, []

    async def evaluate(self, *args: object, **kwargs: object) -> None:
        return None


if __name__ == "__main__":
    ArithmeticEnv.cli()

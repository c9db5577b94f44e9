"""An Atropos environment in the classic text style (an atroposlib ``BaseEnv`` subclass) for atroposd.

Where ``atropos_arithmetic_env.py`` reads token ids and logprobs through ``ManagedServer`` (the
``vllm`` and ``sglang`` server types), this one is written the way environments for the
``openai`` and ``trl`` server types are: it asks ``self.server.completion`` for text and
tokenizes prompt and completion itself (no rollout logprobs; the trainer recomputes them). It
runs unchanged with every ``--openai.server_type``. The task is the same single-digit sums
(``7+5=``), scored as in ``atropos_arithmetic_env.py``:

    [[env]]
    name = "atropos-openai"
    command = ["python", "examples/atropos_text_env.py", "serve",
               "--env.tokenizer_name", "{tokenizer}", "--openai.tokenizer_name", "{tokenizer}",
               "--openai.model_name", "{model}", "--openai.server_type", "openai",
               "--openai.base_url", "{openai_url}", "--openai.api_key", "x",
               "--env.rollout_server_url", "{api_url}", "--env.total_steps", "{steps}",
               "--env.group_size", "{group_size}", "--env.use_wandb", "false"]

docs/ENVIRONMENTS.md ("Atropos environments of every server type") lists the flags each type needs.
Requires ``pip install atroposlib`` (or ``pip install 'atroposd[atropos]'``).
"""

from __future__ import annotations

import random

from atropos_arithmetic_env import (
    score,  # the same task and scoring (the script's directory is on sys.path)
)
from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup


class TextArithmeticEnv(BaseEnv):
    name = "arithmetic_text_example"

    @classmethod
    def config_init(cls) -> tuple[BaseEnvConfig, list[APIServerConfig]]:
        env_config = BaseEnvConfig(group_size=8, use_wandb=False, wandb_name=cls.name, max_token_length=16,
                                   ensure_scores_are_not_same=False, steps_per_eval=1_000_000)
        # A list (not a single config): only then does atroposlib honour --openai.base_url.
        servers = [APIServerConfig(model_name="tiny", base_url="http://127.0.0.1:9001/v1", api_key="x",
                                   server_type="openai", num_requests_for_eval=0)]
        return env_config, servers

    async def setup(self) -> None:
        self.rng = random.Random(0)

    async def get_next_item(self) -> tuple[int, int]:
        return self.rng.randint(0, 9), self.rng.randint(0, 9)

    async def collect_trajectories(self, item: tuple[int, int]) -> tuple[ScoredDataGroup, list]:
        a, b = item
        prompt = f"{a}+{b}="
        completion = await self.server.completion(prompt=prompt, n=self.config.group_size, max_tokens=3,
                                                  temperature=1.0)
        prompt_ids = self.tokenizer.encode(prompt)
        group = ScoredDataGroup(tokens=[], masks=[], scores=[])
        for choice in completion.choices:
            answer = self.tokenizer.encode(choice.text, add_special_tokens=False)
            if choice.finish_reason == "stop" and self.tokenizer.eos_token_id is not None:
                answer.append(self.tokenizer.eos_token_id)
            group["tokens"].append(prompt_ids + answer)
            group["masks"].append([-100] * len(prompt_ids) + answer)
            group["scores"].append(score(a, b, choice.text))
        return group, []

    async def evaluate(self, *args: object, **kwargs: object) -> None:
        return None


if __name__ == "__main__":
    TextArithmeticEnv.cli()

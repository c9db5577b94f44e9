"""atroposlib's own client code against atroposd's API, unmodified: the example trainer's
``check_atropos_api`` / ``register_trainer`` / ``get_batch`` / ``get_data`` and BaseEnv's
``register_env`` / ``get_server_info`` / ``handle_send_to_api`` (gzip'ed list posts) /
``get_status`` (GET with a JSON body). (A whole unmodified environment process is exercised
under the daemon in tests/e2e.)"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from tests.api.conftest import Server, fresh, group

pytestmark = [pytest.mark.atroposlib, pytest.mark.slow]  # imports torch and transformers (tens of seconds)
pytest.importorskip("atroposlib")


class _Servers:
    """What BaseEnv.get_status needs of its inference-server manager (not under test here)."""

    def __init__(self) -> None:
        self.servers = [object()]
        self.weight = 0.0

    async def update_weight(self, weight: float) -> None:
        self.weight = weight


def make_env(url: str, group_size: int) -> Any:
    """A BaseEnv whose protocol methods run unmodified; __init__ (tokenizer download, inference
    servers) is skipped and only the attributes those methods read are set."""
    from atroposlib.envs.base import BaseEnv, BaseEnvConfig

    class ProtocolOnly(BaseEnv):  # the abstract task methods are never called here
        async def get_next_item(self) -> Any:
            raise NotImplementedError

        async def evaluate(self, *args: Any, **kwargs: Any) -> None:
            raise NotImplementedError

    env = object.__new__(ProtocolOnly)
    env.config = BaseEnvConfig(
        rollout_server_url=url,
        group_size=group_size,
        wandb_name="arith",
        max_token_length=64,
        use_wandb=False,
        ensure_scores_are_not_same=True,
        total_steps=100,
    )
    env.max_token_len = -1
    env.completion_lengths = []
    env.items_sent_this_step = 0
    env.jsonl_writer = None
    env.rollouts_for_wandb = []
    env.tokenizer = SimpleNamespace(decode=lambda ids: " ".join(map(str, ids)))
    env.server = _Servers()
    return env


def test_example_trainer_and_base_env_clients(atroposd_server: Server) -> None:
    import torch
    from example_trainer import api as trainer_api
    from example_trainer.data import get_data

    torch.set_num_threads(1)
    api = fresh(atroposd_server)
    url = atroposd_server.url
    assert trainer_api.check_atropos_api(url, timeout=5)
    config = SimpleNamespace(
        atropos_url=url,
        training_steps=10,
        checkpoint_interval=0,
        wandb_group=None,
        wandb_project=None,
        batch_size=4,
        gradient_accumulation_steps=2,
        seq_len=64,
        save_path="ckpt",
    )
    trainer_api.register_trainer(config)
    assert api.ok("GET", "/info") == {"batch_size": 8, "max_token_len": 64}

    env = make_env(url, group_size=4)

    async def env_side() -> None:
        register = asyncio.create_task(env.register_env())
        await asyncio.sleep(0.3)
        assert not register.done()  # waiting for the trainer's first /batch
        assert trainer_api.get_batch(url) == {"batch": None}
        await asyncio.wait_for(register, 10)
        await env.get_server_info()
        assert (env.env_id, env.config.batch_size, env.max_token_len) == (0, 8, 64)
        same = group(4, length=20, tag=0.0, scores=[1.0] * 4)
        await env.handle_send_to_api(same)  # identical scores: atroposlib drops it itself
        await env.handle_send_to_api([group(4, length=20, tag=float(k)) for k in (1, 2)])  # a gzip'ed list
        await env.get_status()
        assert env.status_dict["queue_size"] == 2 and env.status_dict["self_queue_size"] == 2
        assert env.server.weight == pytest.approx(1.0)

    asyncio.run(env_side())
    assert api.ok("GET", "/status")["queued_sequences"] == 8
    batches, _ = get_data(batch_size=4, seq_len=64, atropos_url=url)
    assert len(batches) == 1
    tokens, _labels, _advantages, _temps, logprobs = batches[0]
    assert len(tokens) == 2 and tokens[0].shape[0] == 4  # two micro-batches of 4 sequences
    assert logprobs is not None
    assert api.ok("GET", "/status")["queued_sequences"] == 0

"""The trainer learns: the full loop (TrainerService, real run-api) on the "next digit" task
(``[BOS] d =`` → ``(d+1) mod 10`` then EOS), which plain GRPO solves within a few hundred steps
(EMBEDDED-TASK.md). The rollouts come from a stand-in environment in this process that samples
from the trainer's own current weights — on-policy, versions reported like the built-in envs.

Slow: ~300 optimizer steps of 64 sequences."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson
import pytest
import torch

from atroposd.models.resolve import tokenizer_fingerprint
from atroposd.trainer.service import TrainerService
from atroposd.weights.sync import make_weight_sync
from tests.support import free_port
from tests.trainer.conftest import make_cfg
from tests.trainer.helpers import info_server, run_api

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

BOS, EOS, EQ = 1, 2, 17
DIGIT0 = 4


def sample(
    model: torch.nn.Module, prompts: list[list[int]], n: int, max_tokens: int = 2
) -> tuple[list[list[int]], list[list[float]]]:
    """Temperature-1 sampling, full forward per token (tiny model): ids and their logprobs."""
    rows = [p for p in prompts for _ in range(n)]
    ids = torch.tensor(rows)  # [B, P] (equal prompt lengths)
    out_ids: list[list[int]] = [[] for _ in rows]
    out_lps: list[list[float]] = [[] for _ in rows]
    done = [False] * len(rows)
    with torch.no_grad():
        for _ in range(max_tokens):
            logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), -1)  # [B, V]
            tok = torch.multinomial(logp.exp(), 1)  # [B, 1]
            lp = logp.gather(1, tok)[:, 0]
            for i, (t, v) in enumerate(zip(tok[:, 0].tolist(), lp.tolist(), strict=True)):
                if not done[i]:
                    out_ids[i].append(t)
                    out_lps[i].append(v)
                    done[i] = t == EOS
            ids = torch.cat([ids, tok], 1)
    return out_ids, out_lps


def reward(d: int, completion: list[int]) -> float:
    right = bool(completion) and completion[0] == DIGIT0 + (d + 1) % 10
    return (0.5 if right else 0.0) + (0.5 if right and completion[1:2] == [EOS] else 0.0)


async def environment(api_url: str, service: TrainerService, seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    async with aiohttp.ClientSession() as http:
        env_id = None
        while env_id is None:
            body = {
                "max_token_length": 16,
                "desired_name": "next-digit",
                "weight": 1.0,
                "group_size": 8,
                "min_batch_allocation": None,
            }
            async with http.post(f"{api_url}/register-env", json=body) as resp:
                data = await resp.json()
            env_id = data.get("env_id") if data.get("status") == "success" else None
            if env_id is None:
                await anyio.sleep(0.02)
        while True:
            async with http.get(f"{api_url}/status") as resp:
                if (await resp.json())["queue_size"] >= 8:  # one batch ahead at most
                    await anyio.sleep(0.002)
                    continue
            digits = [rng.randrange(10) for _ in range(8)]
            async with service._lock:  # never sample from weights in the middle of a step
                version = service.progress.weight_version
                ids, lps = sample(service._policy.model, [[BOS, DIGIT0 + d, EQ] for d in digits], 8)
            groups = []
            for g, d in enumerate(digits):
                sl = slice(8 * g, 8 * g + 8)
                prompt = [BOS, DIGIT0 + d, EQ]
                groups.append(
                    {
                        "tokens": [prompt + c for c in ids[sl]],
                        "masks": [[-100] * 3 + c for c in ids[sl]],
                        "inference_logprobs": [[1.0] * 3 + lp for lp in lps[sl]],
                        "scores": [reward(d, c) for c in ids[sl]],
                        "env_id": env_id,
                        "group_overrides": {"atroposd": {"weight_version": version}},
                    }
                )
            async with http.post(f"{api_url}/scored_data_list", json=groups) as resp:
                assert resp.status == 200, await resp.text()


@pytest.mark.timeout(1500)
async def test_the_trainer_learns_the_next_digit(tiny_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    steps = 300
    inf_port = free_port()
    with run_api(tmp_path / "api.log") as (api_url, _proc):
        async with info_server(tokenizer_fingerprint(tiny_dir), inf_port):
            cfg = make_cfg(
                state_dir,
                tiny_dir,
                steps=steps,
                batch_size=64,
                micro_batch_size=32,
                kl_coef=0.0,
                checkpoint_every=1000,
                max_staleness=0,
            )
            cfg.api.enabled, cfg.api.url = False, api_url
            cfg.inference.port = inf_port
            service = TrainerService(
                cfg,
                instance="t",
                weights=make_weight_sync(cfg, nonce="t", control_socket=None),
                envs_alive=lambda: True,
            )
            done = anyio.Event()

            async def trainer(*, task_status: Any) -> None:
                await service.run(task_status=task_status)
                done.set()

            with anyio.fail_after(1400):
                async with anyio.create_task_group() as tg:
                    await tg.start(trainer)
                    tg.start_soon(environment, api_url, service, 0)
                    await done.wait()
                    tg.cancel_scope.cancel()
    assert service.outcome is not None and service.outcome.state == "finished", service.outcome
    rows = [orjson.loads(x) for x in (state_dir / "metrics.jsonl").read_bytes().splitlines()]
    first = sum(r["reward_mean"] for r in rows[:10]) / 10
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    print(f"reward first 10 steps {first:.3f} → last 10 steps {last:.3f}")
    assert last >= 0.9 and last >= first + 0.5, (first, last)
    assert max(r["staleness"] for r in rows) <= 1

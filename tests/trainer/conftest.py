"""Fixtures for the trainer tests: the builtin tiny model on disk, a policy, configs, and
synthetic groups in the API's wire format."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from atroposd.config import Config, parse_config

torch.set_num_threads(1)

BOS, EOS = 1, 2
DIGITS = list(range(4, 14))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """builtin:tiny, built once per session (a normal Hugging Face directory)."""
    from atroposd.models.tiny import ensure_builtin_model

    return ensure_builtin_model(tmp_path_factory.mktemp("models"), 0, 512)


def make_cfg(state_dir: Path, model_dir: Path, **trainer: Any) -> Config:
    """A config for the trainer with ``model_dir`` as the model (no builtin build needed)."""
    t = {
        "steps": 4,
        "batch_size": 16,
        "micro_batch_size": 8,
        "max_token_len": 64,
        "checkpoint_every": 2,
        "keep_checkpoints": 2,
        "weight_sync": "reload",
        "device": "cpu",
    }
    t.update(trainer)
    raw = {
        "daemon": {"state_dir": str(state_dir), "runtime_dir": str(state_dir / "run")},
        "inference": {"model": str(model_dir), "max_model_len": 512},
        "trainer": t,
    }
    return parse_config(raw)


def make_group(
    rng: random.Random,
    *,
    size: int = 8,
    prompt_len: int = 4,
    completion_len: int = 3,
    logprobs: bool = True,
    version: int | None = 0,
    accuracy: float | None = None,
    scores: list[float] | None = None,
) -> dict[str, Any]:
    """A scored group of sequences in run-api's wire format (prompt masked with -100)."""
    tokens, masks, lps = [], [], []
    for _ in range(size):
        prompt = [BOS] + [rng.choice(DIGITS) for _ in range(prompt_len - 1)]
        completion = [rng.choice(DIGITS) for _ in range(completion_len - 1)] + [EOS]
        tokens.append(prompt + completion)
        masks.append([-100] * prompt_len + completion)
        lps.append([1.0] * prompt_len + [round(-rng.uniform(1.5, 4.0), 4) for _ in completion])
    group: dict[str, Any] = {
        "tokens": tokens,
        "masks": masks,
        "scores": scores if scores is not None else [rng.random() for _ in range(size)],
    }
    if logprobs:
        group["inference_logprobs"] = lps
    ext: dict[str, Any] = {}
    if version is not None:
        ext["weight_version"] = version
    if accuracy is not None:
        ext["accuracy"] = accuracy
    if ext:
        group["group_overrides"] = {"atroposd": ext}
    return group


def make_groups(seed: int, n: int = 2, **kw: Any) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [make_group(rng, **kw) for _ in range(n)]


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "state"
    d.mkdir()
    yield d

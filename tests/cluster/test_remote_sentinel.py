"""The head's sentinel on another node's replica (SPEC §15, §12.3), its head side: a node's canary
rows checked before the sentinel reads them, and the sentinel's round over a replica reached
through the cluster link — its drift against the trainer's own scoring, and a drifting one
quarantined, resynced with a push to the other nodes only (``REMOTE_ONLY``) and released, each
word sent to its node. The replica here stands in for the node's answers (the whole path, two
daemons and a real corruption, is ``tests/e2e/test_cluster_sentinel.py``)."""

from __future__ import annotations

import math
from typing import Any

import anyio
import pytest
import torch

from atroposd.daemon.cluster import _canary_row
from atroposd.trainer.sentinel import Sentinel, _completion, _score_all
from atroposd.weights.client import WeightControlError
from atroposd.weights.sync import REMOTE_ONLY

pytestmark = pytest.mark.anyio


def test_a_nodes_canary_rows_are_checked() -> None:
    row = _canary_row({"tokens": [5, 6], "logprobs": [-0.5, -1.0], "weight_version": 3}, 16)
    assert _completion(row) == ([5, 6], [-0.5, -1.0]) and row["weight_version"] == 3
    for bad in (
        {"tokens": [5], "logprobs": [-0.5, -1.0], "weight_version": 3},  # lengths differ
        {"tokens": [-1], "logprobs": [-0.5], "weight_version": 3},  # a negative id
        {"tokens": [True], "logprobs": [-0.5], "weight_version": 3},  # not an id
        {"tokens": [5], "logprobs": [math.nan], "weight_version": 3},  # not finite
        {"tokens": [5], "logprobs": ["x"], "weight_version": 3},
        {"tokens": list(range(17)), "logprobs": [-0.1] * 17, "weight_version": 3},  # past max_tokens
        {"tokens": [5], "logprobs": [-0.5], "weight_version": "3"},
        {"logprobs": [-0.5], "weight_version": 3},
    ):
        with pytest.raises(WeightControlError, match="does not check"):
            _canary_row(bad, 16)


class Stand:
    """A replica of node 1 as the head reaches it: answers the canary with the trainer's own
    logprobs of fixed tokens (plus ``off`` while its weights are wrong), records each word."""

    label = "node 1 replica 0"

    def __init__(self, model: torch.nn.Module, version: int) -> None:
        self.model, self.version = model, version
        self.off = 0.0
        self.words: list[str] = []

    async def canary(self, bodies: Any, within: float) -> list[dict[str, Any]]:
        items = [(list(b["prompt"]["prompt_token_ids"]), [7, 8, 9]) for b in bodies]
        scored = _score_all(self.model, items)
        return [
            _canary_row({"tokens": t, "logprobs": [x + self.off for x in lps], "weight_version": self.version}, 16)
            for (_, t), lps in zip(items, scored, strict=True)
        ]

    async def care(self, op: str, reason: str, within: float) -> bool:
        self.words.append(op)
        return True


class Sync:
    """The weight sync as the sentinel uses it: a resync heals the stand-in."""

    def __init__(self, stand: Stand) -> None:
        self.stand = stand
        self.reattached: list[int | None] = []

    async def reattach(self, model: Any, version: int, replica: int | None = None) -> None:
        self.reattached.append(replica)
        self.stand.off = 0.0


async def _on_thread(fn: Any, *args: Any) -> Any:
    return await anyio.to_thread.run_sync(lambda: fn(*args))


async def test_a_remote_replica_is_checked_quarantined_resynced_and_released() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    stand = Stand(model, version=4)
    sync = Sync(stand)
    sentinel = Sentinel(
        every=1,
        limit=0.05,
        prompts=[[3, 4, 5], [6, 7]],
        sockets=lambda: [],
        run=_on_thread,
        remote=lambda: [stand],
        vocab_size=100,
    )
    assert sentinel.labels() == ["node 1 replica 0"]
    assert await sentinel.check_all(sync, model, 4) == [pytest.approx(0.0, abs=1e-6)]
    assert stand.words == [] and sync.reattached == []
    stand.off = 0.5  # its weights did not arrive
    drift = await sentinel.check_all(sync, model, 4)
    assert drift == [pytest.approx(0.0, abs=1e-6)]  # healed within the round
    assert sync.reattached == [REMOTE_ONLY]  # a push to the other nodes only
    assert stand.words == ["quarantine", "release"]  # by its own node, at the head's word
    assert sentinel.resyncs == 1 and sentinel.restarts == 0 and not sentinel.quarantined
    status = sentinel.status()
    assert status["replicas"] == ["node 1 replica 0"] and status["replica_drift"] == drift

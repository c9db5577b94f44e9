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


# ---------------------------------------------------------------------------- over the real links


class SentinelHost:
    """A node's stand-in daemon as the sentinel's words use it: its paths and its replica restarts."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self.restarts: list[tuple[int, str]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.host, name)

    @property
    def paths(self) -> Any:
        from atroposd.paths import Paths

        return Paths.of(self.host.cfg)

    async def restart_replica(self, replica: int, reason: str) -> bool:
        self.restarts.append((replica, reason))
        return True


async def test_the_sentinels_words_cross_the_links_and_a_node_checks_them(token_file: Any, tmp_path: Any) -> None:
    """A head link and node 1's link over loopback (``tests/cluster/test_links.py``'s stand-in
    daemons): the head reaches node 1's replica by its own request ids; node 1 answers a canary
    its replica cannot give, and one out of bounds or for a replica it does not run, with the
    reason (never generated); it restarts its replica at the head's word; a quarantine its replica
    cannot take is answered as not done."""
    import dataclasses

    from atroposd.cluster.messages import CanaryAnswer, CanaryAsk, Care, Cared
    from atroposd.daemon.cluster import HeadLink, NodeLink
    from tests.cluster.conftest import until
    from tests.cluster.test_links import Host, Trainer, node_config
    from tests.support import free_port_pair

    port = free_port_pair()
    async with anyio.create_task_group() as tg:
        head = HeadLink(Host(node_config(token_file, tmp_path, port, 0), tg, Trainer()))
        await tg.start(head.run)
        node_cfg = node_config(token_file, tmp_path / "node1", port, 1)
        node_cfg.cluster = dataclasses.replace(node_cfg.cluster, port=port)
        node_host = SentinelHost(Host(node_cfg, tg))
        node = NodeLink(node_host)  # type: ignore[arg-type]
        await tg.start(node.run)
        try:
            await until(lambda: head.remote_replicas(), 10, "node 1 joined")
            (replica,) = head.remote_replicas()
            assert replica.label == "node 1 replica 0"
            body = {"prompt": {"prompt_token_ids": [3, 4]}, "max_tokens": 4, "n": 1, "temperature": 0.0, "logprobs": 0}
            with pytest.raises(WeightControlError, match="replica 0"):
                await replica.canary([body], 10)  # nothing listens on its socket here
            for ask, why in (
                (CanaryAsk(request=0, replica=0, prompts=[], max_tokens=4), "does not check"),
                (CanaryAsk(request=0, replica=0, prompts=[{"ids": [-1]}], max_tokens=4), "does not check"),
                (CanaryAsk(request=0, replica=0, prompts=[{"ids": [3]}], max_tokens=10_000), "does not check"),
                (CanaryAsk(request=0, replica=7, prompts=[{"ids": [3]}], max_tokens=4), "no inference replica 7"),
            ):
                answer = await head.ask(1, ask, 10)
                assert isinstance(answer, CanaryAnswer) and why in answer.error and not answer.answers, answer
            assert await replica.care("restart", "canary drift 0.4 over drift_limit 0.05", 10)
            assert node_host.restarts == [(0, "the head's sentinel: canary drift 0.4 over drift_limit 0.05")]
            assert not await replica.care("quarantine", "drift", 10)  # its socket does not answer
            answer = await head.ask(1, Care(request=0, replica=3, op="release"), 10)
            assert isinstance(answer, Cared) and not answer.ok and "no inference replica 3" in answer.detail
            assert head._answers == {}  # every request answered and forgotten
            assert not any(head.dropped().values()) and not any(node.dropped().values())
        finally:
            node_host.stopped.set()
            with anyio.fail_after(10):
                await node.close()
                await head.close()
            tg.cancel_scope.cancel()

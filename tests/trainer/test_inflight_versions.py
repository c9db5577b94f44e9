"""Groups whose completions span a weight swap (SPEC §7, in-flight updates): the trainer checks
their ``weight_versions``, counts the trained tokens sampled after a swap, a rollback drops them
by the versions their tokens were sampled under, and a rollout correction uses each token's own
rollout logprob (a mixed-version sequence's value computed by hand)."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from atroposd.groupext import sampled_versions, version_records
from atroposd.trainer.batch import prepare_batch
from atroposd.trainer.health import DropRule
from atroposd.trainer.learner import Learner, make_strategies
from atroposd.trainer.model import load_policy, token_logprobs
from atroposd.trainer.optim import build_optimizer, build_scheduler
from tests.trainer.conftest import make_cfg, make_group


def _group(versions: Any, *, version: int = 3, size: int = 2, completion_len: int = 4) -> dict[str, Any]:
    g = make_group(random.Random(5), size=size, completion_len=completion_len, version=version, scores=[1.0, 0.0])
    if versions is not None:
        g["group_overrides"]["atroposd"]["weight_versions"] = versions
    return g


def _prepare(groups: list[dict[str, Any]]) -> Any:
    return prepare_batch(groups, micro_batch_size=8, max_token_len=64, adv_std_floor=1e-6)


def test_weight_versions_are_checked_and_swapped_tokens_counted() -> None:
    swapped = _group([[[0, 3], [1, 4]], [[0, 3]]])  # sequence 0: 3 of its 4 tokens after the swap
    plain = _group(None)
    batch = _prepare([swapped, plain])
    assert batch.swapped_tokens == 3 and batch.completion_tokens == 16
    assert batch.weight_versions == [3, 3]  # the admission versions: staleness counts from them
    # a copy first scheduled after the swap its sibling began before: an empty first span, and
    # every one of its tokens sampled after the swap
    late = _group([[[0, 3], [0, 4]], [[0, 3], [3, 4]]])
    assert version_records(late, 2) == [[(0, 3), (0, 4)], [(0, 3), (3, 4)]]
    assert sampled_versions(late) == [3, 4] and sampled_versions(_group([[[0, 3], [0, 4]], [[0, 3], [0, 4]]])) == [4]
    assert _prepare([late]).swapped_tokens == 4 + 1
    for bad, why in (
        ([[[0, 3]]], "one entry per sequence"),
        ([[[0, 3], [0, 4], [0, 5]], [[0, 3]]], "increase"),  # only the first span may be empty
        ([[[0, 3], [2, 4], [2, 5]], [[0, 3]]], "increase"),
        ([[[0, 3], [0, 3]], [[0, 3]]], "versions change"),
        ([[[1, 3]], [[0, 3]]], "start at token 0"),
        ([[[0, 2]], [[0, 3]]], "not weight_version 3"),
        ([[[0, 3], [2, "4"]], [[0, 3]]], "pair"),
        ("all", "one entry per sequence"),
    ):
        with pytest.raises(ValueError, match=why):
            version_records(_group(bad), 2)
        batch = _prepare([_group(bad), plain])
        assert batch.rejected_by_reason == {"weight_versions": 1} and batch.sequences == 2


def test_a_rollback_drops_groups_by_the_versions_their_tokens_were_sampled_under() -> None:
    rule = DropRule(good_version=5, resync_version=9, resync_time=0.0)
    admitted_good_sampled_bad = _group([[[0, 5], [2, 7]], [[0, 5]]], version=5)
    assert sampled_versions(admitted_good_sampled_bad) == [5, 7]
    assert rule.drops(admitted_good_sampled_bad)  # its admission version alone would keep it
    assert not rule.drops(_group(None, version=5))
    assert not rule.drops(_group([[[0, 4], [1, 5]], [[0, 4]]], version=4))
    # sampled on into the resynced weights: its older tokens came from the collapsed ones
    assert rule.drops(_group([[[0, 8], [1, 9]], [[0, 8]]], version=8))
    assert not rule.drops(_group([[[0, 9], [1, 10]], [[0, 9]]], version=9))
    # a malformed record says nothing beyond the admission version
    assert sampled_versions(_group([[[0, 5]]], version=5)) == [5]


@pytest.fixture(scope="module")
def policy(tiny_dir: Path) -> Any:
    return load_policy(tiny_dir, tiny_dir, device=torch.device("cpu"), dtype=torch.float32, lora=None)


def test_a_rollout_correction_with_mixed_versions_equals_the_hand_computed_value(
    policy: Any, tiny_dir: Path, tmp_path: Path
) -> None:
    """token-tis, C = 2: the tokens sampled before the swap carry logprobs log 3 below the
    trainer's (ρ = 3, weighted C), those after it the trainer's own (ρ = 1); one optimizer step,
    so the clipped ratio is 1 and the loss is −Σ A·min(ρ, C) / tokens."""
    torch.set_num_threads(1)
    t = make_cfg(
        tmp_path, tiny_dir, rollout_correction="token-tis", rollout_correction_threshold=2.0, kl_coef=0.0
    ).trainer
    opt = build_optimizer(policy.trainable(), t)
    objective, reference = make_strategies(t)
    learner = Learner(
        policy, opt, build_scheduler(opt, t.warmup_steps), objective=objective, reference=reference, max_grad_norm=1e9
    )
    at = 2  # completion tokens before the swap
    group = _group([[[0, 3], [at, 4]], [[0, 3], [at, 4]]])
    probe = _prepare([group])
    mb = probe.micro[0]
    with torch.no_grad():
        own, _ = token_logprobs(policy.model, mb.input_ids, mb.mask, mb.labels, mb.temperature)
    per_row = mb.mask.sum(-1).tolist()
    own_rows = own.split(per_row)
    for i, lps in enumerate(group["inference_logprobs"]):
        start = len(lps) - per_row[i]
        for k in range(per_row[i]):
            lps[start + k] = float(own_rows[i][k]) - (math.log(3.0) if k < at else 0.0)
    batch = _prepare([group])
    assert batch.swapped_tokens == 2 * (per_row[0] - at)
    # each token's rollout logprob, as sent: no version-wide value anywhere
    sent = torch.tensor([x for lps in group["inference_logprobs"] for x in lps[len(lps) - per_row[0] :]])
    torch.testing.assert_close(batch.micro[0].old_logp[batch.micro[0].mask], sent.float())
    result = learner.compute(batch)
    learner.discard()
    advantages = [1.0, -1.0]  # scores 1, 0: group-std
    weights = [min(3.0, 2.0) if k < at else 1.0 for k in range(per_row[0])]
    expected = -sum(a * w for a in advantages for w in weights) / (2 * per_row[0])
    assert result.loss == pytest.approx(expected, abs=1e-5)
    assert result.rollout_corrected == pytest.approx(at / per_row[0], abs=1e-9)

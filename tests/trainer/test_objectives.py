"""The objective menu (SPEC §14) against hand-computed values on tiny tensors: clip-higher,
GSPO's sequence ratio, the rollout corrections, loss aggregation, the advantages, truncation
masking, the learning-rate schedules and filter_groups' batch filling. The defaults are pinned
to today's loss value for value."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from atroposd.trainer.batch import BatchError, group_advantages, is_truncated, prepare_batch
from atroposd.trainer.feed import GroupFilter, trains_nothing
from atroposd.trainer.learner import GrpoObjective, Tokens
from atroposd.trainer.loss import (
    LOG_RATIO_LIMIT,
    aggregation_weights,
    clip_bounds,
    grpo_loss,
    gspo_log_ratio,
    k3_kl,
    rollout_weights,
    sequence_mean,
)
from atroposd.trainer.optim import build_scheduler, lr_factor
from tests.trainer.conftest import make_group, make_groups

F64 = torch.float64


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def _loss_and_grad(logp0: list[float], old: list[float], adv: list[float], **kw: Any) -> tuple[float, list[float], Any]:
    logp = torch.tensor(logp0, dtype=F64, requires_grad=True)
    kw.setdefault("clip_eps", 0.2)
    kw.setdefault("denom", len(logp0))
    loss, stats = grpo_loss(logp, _t(old), _t(adv), **kw)
    loss.backward()
    assert logp.grad is not None
    return float(loss.detach()), logp.grad.tolist(), stats


# --------------------------------------------------------------------------- today's loss, pinned


def _todays_grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    *,
    clip_eps: float,
    denom: int,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """The loss before the menu existed, copied verbatim: the defaults must give exactly this."""
    delta = (logp - old_logp.detach()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(delta)
    clipped_ratio = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp.detach())
        if kl_coef:
            per_token = per_token + kl_coef * kl
    return per_token.sum() / max(denom, 1)


@pytest.mark.parametrize("kl", [False, True])
def test_defaults_give_todays_loss_value_for_value(kl: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    n = 64
    logp0 = -torch.rand(n, generator=gen, dtype=torch.float32) * 4
    old = logp0 + torch.randn(n, generator=gen) * 0.3  # ratios inside and outside the clip range
    adv = torch.randn(n, generator=gen)
    ref = logp0 + torch.randn(n, generator=gen) * 0.2 if kl else None
    seq = torch.arange(n) // 8
    grads = []
    values = []
    for fn in ("today", "grpo_loss", "objective"):
        logp = logp0.clone().requires_grad_(True)
        if fn == "today":
            loss = _todays_grpo_loss(logp, old, adv, clip_eps=0.2, denom=200, ref_logp=ref, kl_coef=0.04)
        elif fn == "grpo_loss":
            loss, _ = grpo_loss(logp, old, adv, clip_eps=0.2, denom=200, ref_logp=ref, kl_coef=0.04)
        else:  # the objective the default config builds, given the tokens' sequences
            objective = GrpoObjective(clip_eps=0.2, kl_coef=0.04, max_token_len=64)
            loss, _ = objective.loss(logp, old, adv, ref, 200, Tokens(seq=seq, num_seqs=8))
        loss.backward()
        assert logp.grad is not None
        values.append(loss.detach())
        grads.append(logp.grad)
    for v, g in zip(values[1:], grads[1:], strict=True):
        assert torch.equal(v, values[0]) and torch.equal(g, grads[0])


def test_default_advantages_are_todays() -> None:
    scores = [0.1, 0.9, 0.5, 0.5]
    mean = sum(scores) / 4
    std = math.sqrt(sum((s - mean) ** 2 for s in scores) / 4)
    assert group_advantages(scores, 0.1) == [(s - mean) / max(std, 0.1) for s in scores]
    batch = prepare_batch(
        [make_group(random.Random(0), size=4, scores=scores)], micro_batch_size=4, max_token_len=64, adv_std_floor=0.1
    )
    mb = batch.micro[0]
    firsts = mb.advantages[torch.arange(4), mb.mask.float().argmax(1)]
    torch.testing.assert_close(firsts, torch.tensor([(s - mean) / max(std, 0.1) for s in scores]))
    assert mb.loss_weight is None and batch.reward_mean_trained == pytest.approx(batch.reward_mean)


# --------------------------------------------------------------------------- clip-higher


def test_clip_bounds() -> None:
    assert clip_bounds(0.2) == (0.8, 1.2)
    assert clip_bounds(0.2, 0.28) == (0.8, 1.28)


@pytest.mark.parametrize(
    ("ratio", "adv", "high", "loss", "grad", "clipped"),
    [
        (1.25, 1.0, 0.0, -1.2, 0.0, 1),  # symmetric: above 1.2, clipped
        (1.25, 1.0, 0.28, -1.25, -1.25, 0),  # clip-higher: 1.25 < 1.28, trained
        (1.28, 1.0, 0.28, -1.28, -1.28, 0),  # exactly at the upper bound: inside
        (1.3, 1.0, 0.28, -1.28, 0.0, 1),  # above it: clipped
        (0.8, -1.0, 0.28, 0.8, 0.8, 0),  # exactly at the lower bound 1 − ε (unchanged by ε_high)
        (0.7, -1.0, 0.28, 0.8, 0.0, 1),  # below it, A < 0: clipped
    ],
)
def test_clip_higher(ratio: float, adv: float, high: float, loss: float, grad: float, clipped: int) -> None:
    value, g, stats = _loss_and_grad([math.log(ratio)], [0.0], [adv], clip_eps_high=high)
    assert value == pytest.approx(loss, rel=1e-12)
    assert g[0] == pytest.approx(grad, abs=1e-12)
    assert int(stats.clipped) == clipped


def test_every_token_clipped_gives_no_gradient() -> None:
    value, g, stats = _loss_and_grad([math.log(1.5)] * 3, [0.0] * 3, [1.0, 2.0, 0.5], clip_eps_high=0.28)
    assert value == pytest.approx(-1.28 * 3.5 / 3)
    assert g == [0.0, 0.0, 0.0] and int(stats.clipped) == 3


# --------------------------------------------------------------------------- GSPO


def test_sequence_mean_and_gspo_ratio() -> None:
    seq = torch.tensor([0, 0, 1, 1, 1])
    values = _t([0.1, 0.3, 0.0, -0.1, 0.4])
    torch.testing.assert_close(sequence_mean(values, seq, 3), _t([0.2, 0.2, 0.1, 0.1, 0.1]))
    delta = values.clone().requires_grad_(True)
    log_s = gspo_log_ratio(delta, seq, 3)
    torch.testing.assert_close(log_s.detach(), _t([0.2, 0.2, 0.1, 0.1, 0.1]))
    log_s.sum().backward()  # the gradient goes to each token's own log-probability, once
    assert delta.grad is not None and delta.grad.tolist() == [1.0] * 5


def test_gspo_clips_whole_sequences() -> None:
    # sequence 0: log-ratios 0.1, 0.3 → s = e^0.2 ≈ 1.221 > 1.2 with A = 1: clipped, no gradient
    # sequence 1: log-ratios 0.1, −0.1, 0 → s = 1 with A = −1: per token 1, gradient −A·s = 1
    seq = torch.tensor([0, 0, 1, 1, 1])
    value, g, stats = _loss_and_grad(
        [0.1, 0.3, 0.1, -0.1, 0.0], [0.0] * 5, [1.0, 1.0, -1.0, -1.0, -1.0], sequence_level=True, seq=seq, num_seqs=2
    )
    assert value == pytest.approx((-1.2 * 2 + 3.0) / 5)
    assert g == pytest.approx([0.0, 0.0, 0.2, 0.2, 0.2])
    assert int(stats.clipped) == 2
    # token level, the same tokens: token 0 (1.105) inside, token 1 (1.35) clipped
    _, g_token, stats_token = _loss_and_grad([0.1, 0.3, 0.1, -0.1, 0.0], [0.0] * 5, [1.0, 1.0, -1.0, -1.0, -1.0])
    assert g_token[0] == pytest.approx(-math.exp(0.1) / 5) and g_token[1] == 0.0
    assert int(stats_token.clipped) == 1


def test_gspo_of_one_token_sequences_is_grpo() -> None:
    logp, old, adv = [-0.5, -1.0, -2.2], [-0.7, -0.9, -1.5], [1.0, -0.5, 2.0]
    a = _loss_and_grad(logp, old, adv)
    b = _loss_and_grad(logp, old, adv, sequence_level=True, seq=torch.arange(3), num_seqs=3)
    assert a[0] == pytest.approx(b[0], rel=1e-12) and a[1] == pytest.approx(b[1], rel=1e-12)


# --------------------------------------------------------------------------- rollout correction

RHOS = [0.25, 0.5, 1.0, 2.0, 4.0]  # exp(log ρ) is exact for these


@pytest.mark.parametrize(
    ("mode", "weights", "corrected"),
    [
        ("token-tis", [0.25, 0.5, 1.0, 2.0, 2.0], [False, False, False, False, True]),  # min(ρ, C); ρ = C kept
        ("token-mis", [0.0, 1.0, 1.0, 1.0, 0.0], [True, False, False, False, True]),  # 1/C ≤ ρ ≤ C inclusive
    ],
)
def test_token_level_corrections(mode: str, weights: list[float], corrected: list[bool]) -> None:
    w, c = rollout_weights(torch.log(_t(RHOS)), torch.zeros(5, dtype=F64), mode=mode, threshold=2.0)
    assert w.tolist() == weights and c.tolist() == corrected


@pytest.mark.parametrize(
    ("mode", "weights", "corrected"),
    [
        # ρ_seq: sequence 0 exp(mean(log 4, log 1)) = 2, sequence 1 exp(mean(log 0.25)) = 0.25, sequence 2 = 1
        ("seq-tis", [1.5, 1.5, 0.25, 1.0, 1.0], [True, True, False, False, False]),
        ("seq-mis", [0.0, 0.0, 0.0, 1.0, 1.0], [True, True, True, False, False]),
    ],
)
def test_sequence_level_corrections(mode: str, weights: list[float], corrected: list[bool]) -> None:
    log_rho = torch.log(_t([4.0, 1.0, 0.25, 1.0, 1.0]))
    w, c = rollout_weights(
        log_rho, torch.zeros(5, dtype=F64), mode=mode, threshold=1.5, seq=torch.tensor([0, 0, 1, 2, 2]), num_seqs=3
    )
    assert w.tolist() == pytest.approx(weights, rel=1e-12) and c.tolist() == corrected


def test_correction_takes_the_ratio_against_the_trainers_own_logprobs() -> None:
    # ρ = 4 against the sampler, C = 2, A = 1. Uncorrected: ratio 4 clipped at 1.2, no gradient.
    # token-tis: ratio 1 against the trainer's detached logprob, weighted min(4, 2) = 2.
    assert _loss_and_grad([math.log(4.0)], [0.0], [1.0])[:2] == (pytest.approx(-1.2), [0.0])
    value, g, stats = _loss_and_grad([math.log(4.0)], [0.0], [1.0], correction="token-tis", threshold=2.0)
    assert value == pytest.approx(-2.0) and g == pytest.approx([-2.0])
    assert float(stats.ratio_sum) == 1.0 and int(stats.clipped) == 0 and int(stats.corrected) == 1
    value, g, stats = _loss_and_grad([math.log(4.0)], [0.0], [1.0], correction="token-mis", threshold=2.0)
    assert value == 0.0 and g == [0.0] and int(stats.corrected) == 1
    # on-policy (ρ = 1), a correction changes nothing
    base = _loss_and_grad([-1.0, -2.0], [-1.0, -2.0], [1.0, -1.0])
    for mode in ("token-tis", "seq-tis", "token-mis", "seq-mis"):
        got = _loss_and_grad(
            [-1.0, -2.0], [-1.0, -2.0], [1.0, -1.0], correction=mode, seq=torch.tensor([0, 0]), num_seqs=1
        )
        assert got[0] == pytest.approx(base[0]) and got[1] == pytest.approx(base[1]) and int(got[2].corrected) == 0


def test_unknown_correction_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown rollout correction"):
        rollout_weights(torch.zeros(1), torch.zeros(1), mode="token-xyz", threshold=2.0)


# --------------------------------------------------------------------------- loss aggregation


def test_aggregation_weights_and_values() -> None:
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])  # row 2: empty
    assert aggregation_weights(mask, "token-mean", sequences=3, trained_sequences=2, max_token_len=4) is None
    w = aggregation_weights(mask, "seq-mean-token-mean", sequences=3, trained_sequences=2, max_token_len=4)
    assert w is not None and w.tolist() == [[0.25, 0.25, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]]
    w2 = aggregation_weights(mask, "seq-mean-token-sum-norm", sequences=3, trained_sequences=2, max_token_len=4)
    assert w2 is not None
    torch.testing.assert_close(w2, torch.tensor([[1 / 12, 1 / 12, 0.0], [1 / 12, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    # per-token losses 1, 3 | 5 (on-policy, A = −l): seq-mean (2 + 5) / 2; sum-norm 9 / 12
    for weights, expected in ((w, 3.5), (w2, 0.75)):
        value, _, _ = _loss_and_grad([0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-1.0, -3.0, -5.0], weight=weights[mask].to(F64))
        assert value == pytest.approx(expected)
    # a packed row: the same sequences laid end to end, told apart by seq_ids
    packed = torch.tensor([[True, True, True]])
    w3 = aggregation_weights(
        packed,
        "seq-mean-token-mean",
        sequences=2,
        trained_sequences=2,
        max_token_len=4,
        seq_ids=torch.tensor([[0, 0, 1]]),
    )
    assert w3 is not None and w3.tolist() == [[0.25, 0.25, 0.5]]


# --------------------------------------------------------------------------- advantages


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("group-std", [1.0, -1.0, -1.0, 1.0]),
        ("group-mean", [0.5, -0.5, -0.5, 0.5]),
        ("rloo", [2 / 3, -2 / 3, -2 / 3, 2 / 3]),  # 1 − (0 + 0 + 1)/3, 0 − (1 + 0 + 1)/3
    ],
)
def test_advantages(mode: str, expected: list[float]) -> None:
    assert group_advantages([1.0, 0.0, 0.0, 1.0], 0.1, mode) == pytest.approx(expected, rel=1e-15)
    assert group_advantages([0.3, 0.3, 0.3], 0.1, mode) == [0.0, 0.0, 0.0]  # all equal
    assert group_advantages([0.7], 0.1, mode) == [0.0]  # a group of one has no baseline
    rloo_two = group_advantages([1.0, 0.25], 0.1, mode)
    assert rloo_two == pytest.approx(
        {"group-std": [1.0, -1.0], "group-mean": [0.375, -0.375], "rloo": [0.75, -0.75]}[mode]
    )


def test_environment_advantages_replace_every_mode() -> None:
    group = make_group(random.Random(1), size=2, scores=[1.0, 0.0])
    group["advantages"] = [0.3, -0.2]
    for mode in ("group-std", "group-mean", "rloo"):
        mb = prepare_batch([group], micro_batch_size=2, max_token_len=64, adv_std_floor=0.1, advantage=mode).micro[0]
        assert mb.advantages[mb.mask].tolist() == pytest.approx([0.3] * 3 + [-0.2] * 3)


# --------------------------------------------------------------------------- truncation


def test_overlong_mask_trains_no_token_of_a_truncated_completion() -> None:
    group = make_group(random.Random(2), size=3, scores=[1.0, 0.0, 0.5], completion_len=3)
    group["overrides"] = [{"finish_reason": "stop"}, {"finish_reason": "length"}, {}]
    keep = prepare_batch([group], micro_batch_size=4, max_token_len=64, adv_std_floor=0.1)
    mask = prepare_batch([group], micro_batch_size=4, max_token_len=64, adv_std_floor=0.1, overlong="mask")
    assert keep.completion_tokens == 9 and mask.completion_tokens == 6
    assert mask.micro[0].mask[1].sum() == 0 and mask.micro[0].mask[0].sum() == 3
    assert mask.trained_sequences == 2 and keep.trained_sequences == 3 and mask.truncated == 1
    # the advantages still see every score: sequence 0's is that of the group of three
    assert mask.micro[0].advantages[0, mask.micro[0].mask[0]].tolist() == pytest.approx(
        keep.micro[0].advantages[0, keep.micro[0].mask[0]].tolist()
    )
    whole = dict(group, overrides=None, group_overrides={"finish_reason": "length"})
    assert all(is_truncated(whole, i) for i in range(3))
    # overrides[i] has the last word over group_overrides
    assert not is_truncated(dict(whole, overrides=[{"finish_reason": "stop"}]), 0)
    with pytest.raises(BatchError, match="truncated"):  # nothing left to train: the batch is skipped
        prepare_batch([whole], micro_batch_size=4, max_token_len=64, adv_std_floor=0.1, overlong="mask")


# --------------------------------------------------------------------------- schedules


def test_lr_schedules_by_hand() -> None:
    kw = {"warmup_steps": 2, "steps": 10}
    assert [lr_factor(s, schedule="constant", **kw) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    # after warm-up p = (step − 2) / 8
    assert [lr_factor(s, schedule="linear", **kw) for s in (0, 1, 2, 6, 10)] == [0.5, 1.0, 1.0, 0.5, 0.0]
    assert lr_factor(4, schedule="cosine", **kw) == pytest.approx((1 + math.cos(math.pi / 4)) / 2)
    assert lr_factor(6, schedule="cosine", **kw) == pytest.approx(0.5)
    assert lr_factor(10, schedule="cosine", **kw) == pytest.approx(0.0)
    assert lr_factor(3, warmup_steps=0, steps=4, schedule="linear") == 0.25  # no warm-up
    with pytest.raises(ValueError, match="unknown lr_schedule"):
        lr_factor(3, warmup_steps=0, steps=4, schedule="step")


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_schedule_position_survives_a_state_dict_round_trip(schedule: str) -> None:
    def make() -> tuple[torch.optim.Optimizer, Any]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return opt, build_scheduler(opt, 2, schedule, 10)

    opt, sched = make()
    lrs = []
    for _ in range(7):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        if len(lrs) == 4:
            saved = sched.state_dict()  # the checkpoint after step 4
    resumed_opt, resumed = make()  # a resumed trainer: built anew, then the checkpoint's state loaded
    resumed.load_state_dict(saved)
    after = []
    for _ in range(3):
        resumed_opt.step()
        resumed.step()
        after.append(resumed_opt.param_groups[0]["lr"])
    assert after == lrs[4:]
    assert lrs[-1] == pytest.approx(lr_factor(7, warmup_steps=2, steps=10, schedule=schedule)) and lrs[-1] < 0.5


# --------------------------------------------------------------------------- filter_groups


def _group(rng: random.Random, scores: list[float], **extra: Any) -> dict[str, Any]:
    return {**make_group(rng, size=len(scores), scores=scores), **extra}


def test_trains_nothing() -> None:
    rng = random.Random(3)
    assert trains_nothing(_group(rng, [0.5, 0.5]))
    assert trains_nothing(_group(rng, [1.0]))  # a group of one: no baseline
    assert not trains_nothing(_group(rng, [0.5, 0.25]))
    assert not trains_nothing(_group(rng, [0.5, 0.5], advantages=[1.0, -1.0]))  # its own advantages
    assert not trains_nothing(
        _group(rng, [0.5, 0.5], distill_token_ids=[[[1]] * 7] * 2, distill_logprobs=[[[-0.1]] * 7] * 2)
    )
    assert not trains_nothing(_group(rng, [0.5, "0.5"]))  # malformed: batch preparation rejects it
    assert not trains_nothing(_group(rng, [math.nan, math.nan]))
    assert not trains_nothing("not a group")


def test_group_filter_fills_full_batches_and_carries_the_rest() -> None:
    rng = random.Random(4)
    eq1, a, eq2, b, c, d = (
        _group(rng, [1.0, 1.0]),
        _group(rng, [1.0, 0.0]),
        _group(rng, [0.0, 0.0]),
        _group(rng, [0.2, 0.4]),
        _group(rng, [0.3, 0.1]),
        _group(rng, [0.9, 0.8]),
    )
    f = GroupFilter(batch_size=4)
    f.add([eq1, a])
    assert f.take() is None and not f.starved
    f.add([eq2, b, c])
    taken = f.take()
    assert taken is not None
    batch, dropped = taken
    assert batch == [a, b] and dropped == [eq1, eq2] and f.pending == [c] and f.filtered == 2
    f.add([d])
    assert f.take() == ([c, d], [])
    f.add([eq1, eq2])
    assert f.starved and f.take() is None and f.filtered == 4


def test_group_filter_is_starved_behind_kept_groups_too_few_for_a_batch() -> None:
    # one kept group waits for a batch; then only equal groups come: once a batch's worth of
    # them in a row was dropped, the filter (not the data) is why the trainer waits
    rng = random.Random(6)
    f = GroupFilter(batch_size=4)
    f.add([_group(rng, [1.0, 0.0]), _group(rng, [0.5, 0.5])])
    assert f.take() is None and not f.starved  # two of four sequences dropped in a row
    f.add([_group(rng, [0.0, 0.0])])
    assert f.take() is None and f.starved and len(f.pending) == 1
    f.add([_group(rng, [0.2, 0.4])])  # a kept group ends the run
    assert not f.starved
    taken = f.take()
    assert taken is not None and len(taken[0]) == 2 and len(taken[1]) == 2 and not f.starved


def test_dropped_groups_count_in_reward_mean_and_accuracy_not_in_training() -> None:
    rng = random.Random(5)
    kept = make_group(rng, size=2, scores=[1.0, 0.0], accuracy=0.5)
    dropped = make_group(rng, size=2, scores=[0.0, 0.0], accuracy=0.0)
    batch = prepare_batch([kept], micro_batch_size=4, max_token_len=64, adv_std_floor=0.1, filtered=[dropped])
    assert batch.sequences == 2 and batch.filtered_groups == 1
    assert batch.reward_mean == pytest.approx(0.25) and batch.reward_mean_trained == pytest.approx(0.5)
    assert batch.accuracy == pytest.approx(0.25)


def test_make_groups_helper_still_builds_batches() -> None:
    # the shared helpers used above give batches every objective can train on
    batch = prepare_batch(make_groups(0, n=2), micro_batch_size=8, max_token_len=64, adv_std_floor=0.1)
    assert batch.sequences == 16 and batch.trained_sequences == 16


# --------------------------------------------------------------------------- zero-length completions


@pytest.mark.parametrize("keys", [{}, {"sequence_level": True}, {"correction": "seq-tis"}, {"correction": "token-mis"}])
def test_no_trained_token_gives_a_zero_finite_loss(keys: dict[str, Any]) -> None:
    logp = torch.zeros(0, dtype=F64, requires_grad=True)
    loss, stats = grpo_loss(
        logp,
        torch.zeros(0, dtype=F64),
        torch.zeros(0, dtype=F64),
        clip_eps=0.2,
        denom=0,
        seq=torch.zeros(0, dtype=torch.long),
        num_seqs=2,
        **keys,
    )
    assert float(loss.detach()) == 0.0 and float(stats.ratio_sum) == 0.0


def test_a_completion_without_trained_tokens_weighs_nothing() -> None:
    group = make_group(random.Random(6), size=3, scores=[1.0, 0.0, 0.5])
    group["masks"][2] = [-100] * len(group["masks"][2])  # a zero-length completion
    batch = prepare_batch([group], micro_batch_size=4, max_token_len=64, adv_std_floor=0.1)
    assert batch.sequences == 3 and batch.trained_sequences == 2
    mb = batch.micro[0]
    w = aggregation_weights(
        mb.mask,
        "seq-mean-token-mean",
        sequences=batch.sequences,
        trained_sequences=batch.trained_sequences,
        max_token_len=64,
    )
    assert w is not None and float(w[2].sum()) == 0.0 and float(w.sum()) == pytest.approx(1.0)
    # GSPO's mean over a sequence that has no token: the others' are unaffected
    seq = torch.tensor([0, 0, 2])
    torch.testing.assert_close(sequence_mean(_t([0.2, 0.4, -1.0]), seq, 3), _t([0.3, 0.3, -1.0]))

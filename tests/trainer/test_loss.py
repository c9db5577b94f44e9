"""The losses against hand-computed values on tiny tensors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from atroposd.trainer.loss import (
    awsft_loss,
    distill_loss,
    grpo_loss,
    k3_kl,
    normalise_batch_advantages,
)
from atroposd.trainer.model import token_logprobs


def _grad(logp0: list[float], old: list[float], adv: list[float], denom: int, **kw: Any) -> tuple[float, list[float]]:
    logp = torch.tensor(logp0, dtype=torch.float64, requires_grad=True)
    loss, _ = grpo_loss(
        logp,
        torch.tensor(old, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        clip_eps=0.2,
        denom=denom,
        **kw,
    )
    loss.backward()
    assert logp.grad is not None
    return float(loss.detach()), logp.grad.tolist()


def test_on_policy_ratio_one_gives_minus_advantage_gradient() -> None:
    loss, grad = _grad([-1.0, -2.0], [-1.0, -2.0], [1.0, -1.0], denom=2)
    assert loss == pytest.approx(0.0)
    # d(−r·A)/dlogp = −r·A with r = 1, divided once by the batch's token count
    assert grad == pytest.approx([-0.5, 0.5])


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "grad"),
    [
        (1.5, 2.0, -2.4, 0.0),  # A > 0, r above 1+ε: clipped, no gradient
        (1.5, -1.0, 1.5, 1.5),  # A < 0, r above 1+ε: unclipped (pessimistic) branch, gradient −r·A
        (0.5, -1.0, 0.8, 0.0),  # A < 0, r below 1−ε: clipped
        (0.5, 1.0, -0.5, -0.5),  # A > 0, r below 1−ε: unclipped
        (1.1, 1.0, -1.1, -1.1),  # inside the range
    ],
)
def test_clip(ratio: float, adv: float, loss: float, grad: float) -> None:
    value, g = _grad([math.log(ratio) - 1.0], [-1.0], [adv], denom=1)
    assert value == pytest.approx(loss, rel=1e-9)
    assert g[0] == pytest.approx(grad, abs=1e-9)


def test_stats_count_clipped_tokens_and_ratio() -> None:
    logp = torch.log(torch.tensor([1.0, 1.5, 0.5, 1.1]))
    _, stats = grpo_loss(logp, torch.zeros(4), torch.ones(4), clip_eps=0.2, denom=4)
    assert float(stats.clipped) == 2
    assert float(stats.ratio_sum) == pytest.approx(4.1, rel=1e-6)


def test_huge_log_difference_with_zero_advantage_is_finite() -> None:
    logp = torch.tensor([500.0, -500.0], requires_grad=True)
    loss, stats = grpo_loss(
        logp,
        torch.tensor([-400.0, 300.0]),
        torch.zeros(2),
        clip_eps=0.2,
        denom=2,
        ref_logp=torch.tensor([-400.0, 300.0]),
        kl_coef=0.04,
    )
    loss.backward()
    assert math.isfinite(float(loss.detach())) and math.isfinite(float(stats.ratio_sum))
    assert logp.grad is not None and torch.isfinite(logp.grad).all()


def test_k3_kl_hand_value_and_penalty_gradient() -> None:
    logp = torch.tensor([math.log(0.5)], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([math.log(0.25)], dtype=torch.float64)
    kl = k3_kl(logp, ref)
    # d = ref − logp = log 0.5: e^d − d − 1 = 0.5 + log 2 − 1
    assert float(kl.detach()) == pytest.approx(0.5 + math.log(2) - 1)
    assert float(k3_kl(ref, ref)) == 0.0
    loss, stats = grpo_loss(
        logp, logp.detach(), torch.zeros(1, dtype=torch.float64), clip_eps=0.2, denom=1, ref_logp=ref, kl_coef=0.04
    )
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.04 * (0.5 + math.log(2) - 1))
    # d/dlogp [e^(ref−logp) + logp] = 1 − e^(ref−logp) = 0.5
    assert logp.grad is not None and float(logp.grad[0]) == pytest.approx(0.04 * 0.5)
    assert float(stats.kl_sum) == pytest.approx(0.5 + math.log(2) - 1)


def test_denominator_is_the_batch_token_count() -> None:
    logp = torch.zeros(3, requires_grad=True)
    a, _ = grpo_loss(logp[:1], torch.zeros(1), torch.ones(1), clip_eps=0.2, denom=3)
    b, _ = grpo_loss(logp[1:], torch.zeros(2), torch.ones(2), clip_eps=0.2, denom=3)
    whole, _ = grpo_loss(logp, torch.zeros(3), torch.ones(3), clip_eps=0.2, denom=3)
    assert float((a + b).detach()) == pytest.approx(float(whole.detach())) == pytest.approx(-1.0)


def test_temperature_scales_logits_before_log_softmax() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 6, bias=False)

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(6, 4)

        def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> object:
            return type("Out", (), {"last_hidden_state": self.emb(input_ids)})()

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decoder, self.head = Decoder(), head

        def get_decoder(self) -> torch.nn.Module:
            return self.decoder

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.head

    lm = LM()
    ids = torch.tensor([[1, 2, 3], [4, 5, 0]])
    labels = torch.tensor([[2, 3, 4], [5, 1, 0]])
    mask = torch.tensor([[False, True, True], [True, True, False]])
    temps = torch.tensor([0.7, 2.0])
    logp, _ = token_logprobs(lm, ids, mask, labels, temps)
    logits = head(lm.decoder.emb(ids))
    expected = []
    for b in range(2):
        for t in range(3):
            if mask[b, t]:
                expected.append(torch.log_softmax(logits[b, t] / temps[b], -1)[labels[b, t]])
    torch.testing.assert_close(logp, torch.stack(expected))


def test_distill_gradient_vanishes_when_student_equals_renormalised_teacher() -> None:
    ids = torch.tensor([[3, 1, -1], [0, 2, 4]])  # -1 = padding
    teacher = torch.tensor([[math.log(0.6), math.log(0.2), -1e9], [math.log(0.1), math.log(0.1), math.log(0.3)]])
    # teacher over its valid top-k renormalised: row 0 → 0.75/0.25, row 1 → 0.2/0.2/0.6
    student = torch.full((2, 6), -30.0)
    student[0, 3], student[0, 1] = math.log(0.75), math.log(0.25)
    student[1, 0], student[1, 2], student[1, 4] = math.log(0.2), math.log(0.2), math.log(0.6)
    student.requires_grad_(True)
    loss, stats = distill_loss(student, ids, teacher, temperature=1.0, denom=2)
    loss.backward()
    assert stats.tokens == 2
    assert student.grad is not None and student.grad.abs().max() < 1e-6
    entropy = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) - (0.4 * math.log(0.2) + 0.6 * math.log(0.6))
    assert float(loss.detach()) == pytest.approx(entropy / 2, rel=1e-4)

    other = torch.zeros(2, 6, requires_grad=True)  # a uniform student: the loss pulls it
    loss2, _ = distill_loss(other, ids, teacher, temperature=1.0, denom=2)
    loss2.backward()
    assert float(loss2.detach()) > float(loss.detach())
    assert other.grad is not None and other.grad.abs().max() > 0.05
    assert float(other.grad[0, 5]) > 0 and float(other.grad[0, 3]) < 0  # non-teacher ids pushed down


def test_distill_position_without_teacher_ids_contributes_nothing() -> None:
    ids = torch.tensor([[-1, -1]])
    logits = torch.randn(1, 5, requires_grad=True)
    loss, stats = distill_loss(logits, ids, torch.zeros(1, 2), temperature=2.0, denom=1)
    loss.backward()
    assert float(loss.detach()) == 0.0 and stats.tokens == 0
    assert logits.grad is not None and not logits.grad.any()


def test_awsft_weights_and_loss() -> None:
    w = normalise_batch_advantages(torch.tensor([3.0, -3.0, 0.0, 0.0]))
    assert w.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])  # std √4.5 → ±1.41, clipped to ±1
    assert not normalise_batch_advantages(torch.tensor([0.5, 0.5])).any()
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss = awsft_loss(logp, torch.tensor([1.0, -0.5]), denom=2)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-(1.0 * -1.0 + -0.5 * -2.0) / 2)
    assert logp.grad is not None and logp.grad.tolist() == pytest.approx([-0.5, 0.25])

"""The training losses: small pure functions over the completion tokens of one micro-batch.

Every function takes tensors already reduced to the N *trained* tokens of a micro-batch (the
completion positions, flattened in row order) and a ``denom``: the completion-token count of
the **whole optimizer batch**, counted once by the batch preparation. Each function returns
``Σ per-token loss / denom``, so summing the micro-batch losses (and their gradients) gives
exactly the loss of the batch, whatever the micro-batch split — count once, divide once.

Stats are returned as detached *sums* (not means) for the same reason: the step adds them up
over micro-batches and divides by the batch's token count at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "AWSFT_ADV_RANGE",
    "LOG_RATIO_LIMIT",
    "DistillStats",
    "LossStats",
    "awsft_loss",
    "distill_loss",
    "grpo_loss",
    "k3_kl",
    "normalise_batch_advantages",
]

# |log π − log π_old| beyond this is clamped before exp(): e^20 ≈ 5e8 is finite in float32 and
# bf16, so the ratio is never inf and a zero advantage can never produce inf·0 = NaN.
LOG_RATIO_LIMIT = 20.0

# awsft: per-batch normalised advantages are clipped to this range, as in verl's recipe, so a
# single outlier sequence cannot dominate the weighted likelihood.
AWSFT_ADV_RANGE = (-1.0, 1.0)


@dataclass
class LossStats:
    """Detached sums over the micro-batch's N tokens (divide by the batch token count)."""

    ratio_sum: torch.Tensor  # [] Σ r
    clipped: torch.Tensor  # [] Σ [r ∉ [1-ε, 1+ε]]
    kl_sum: torch.Tensor  # [] Σ k3 (0 when no reference)


@dataclass
class DistillStats:
    loss_sum: torch.Tensor  # [] Σ over valid positions of the per-position cross-entropy
    tokens: int  # positions with at least one valid teacher id


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π ‖ π_ref) per token: e^(ref−logp) − (ref−logp) − 1 ≥ 0.

    logp, ref_logp: [N]. The log-difference is clamped like the ratio's, so the result is finite.
    """
    d = (ref_logp - logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # [N]
    return torch.exp(d) - d - 1.0


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, *, clip_eps: float,
              denom: int, ref_logp: torch.Tensor | None = None,
              kl_coef: float = 0.0) -> tuple[torch.Tensor, LossStats]:
    """Clipped-ratio policy gradient (PPO/GRPO) with an optional k3 KL penalty.

    logp:     [N] log π_θ(token) at the rollout's temperature (requires grad)
    old_logp: [N] the rollout policy's log-probability of the same tokens (no grad)
    adv:      [N] advantage of each token (its sequence's, broadcast)
    ref_logp: [N] reference log-probabilities for the KL term, or None
    denom:    completion tokens in the whole optimizer batch (≥ 1)

    per token: −min(r·A, clip(r, 1−ε, 1+ε)·A) + β·k3, with r = exp(clamp(logp − old_logp)).
    """
    delta = (logp - old_logp.detach()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # [N]
    ratio = torch.exp(delta)  # [N], finite
    clipped_ratio = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)  # [N]
    per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)  # [N]
    kl = torch.zeros_like(per_token)
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp.detach())  # [N]
        if kl_coef:
            per_token = per_token + kl_coef * kl
    loss = per_token.sum() / max(denom, 1)
    with torch.no_grad():
        outside = (ratio < 1.0 - clip_eps) | (ratio > 1.0 + clip_eps)
        stats = LossStats(ratio_sum=ratio.detach().sum(), clipped=outside.sum().to(ratio.dtype),
                          kl_sum=kl.detach().sum())
    return loss, stats


def awsft_loss(logp: torch.Tensor, adv: torch.Tensor, *, denom: int) -> torch.Tensor:
    """Advantage-weighted SFT: −Σ w·log π(token) / denom.

    logp: [N] (requires grad); adv: [N] weights, already normalised per batch and clipped
    (:func:`normalise_batch_advantages`). No ratio, no rollout logprobs needed.
    """
    return -(adv.detach() * logp).sum() / max(denom, 1)


def normalise_batch_advantages(adv: torch.Tensor, *, floor: float = 1e-6) -> torch.Tensor:
    """awsft's weights: the sequence advantages of one batch scaled to unit std, then clipped.

    adv: [S] one advantage per sequence of the batch → [S]. A batch whose advantages are all
    equal gets zeros (nothing to prefer).
    """
    if adv.numel() < 2:
        return torch.zeros_like(adv)
    std = adv.std(unbiased=False)
    if float(std) <= floor:
        return torch.zeros_like(adv)
    lo, hi = AWSFT_ADV_RANGE
    return (adv / std).clamp(lo, hi)


def distill_loss(logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor, *,
                 temperature: float, denom: int) -> tuple[torch.Tensor, DistillStats]:
    """Cross-entropy from the teacher's renormalised top-k to the student, at M positions.

    logits:           [M, V] the student's raw logits at the positions that predict each label
    teacher_ids:      [M, K] the teacher's top-k token ids for the same label; id < 0 = padding
    teacher_logprobs: [M, K] the teacher's log-probabilities of those ids
    denom:            positions with a teacher distribution in the whole batch (≥ 1)

    p_T = softmax(teacher_logprobs / τ) over the valid ids; log q_S = log_softmax(logits / τ)
    over the full vocabulary; per position −Σ_k p_T·log q_S. Positions without any valid id
    contribute nothing. The gradient vanishes exactly when q_S equals p_T.
    """
    valid = teacher_ids >= 0  # [M, K]
    has_any = valid.any(dim=1)  # [M]
    scaled = logits.float() / temperature  # [M, V]
    log_q = scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)  # [M, V]
    student = log_q.gather(1, teacher_ids.clamp(min=0))  # [M, K]
    t_scores = (teacher_logprobs.float() / temperature).masked_fill(~valid, float("-inf"))  # [M, K]
    # A row with no valid id would be softmax(-inf…) = NaN: give it a harmless dummy row.
    t_scores = torch.where(has_any[:, None], t_scores, torch.zeros_like(t_scores))
    p_teacher = torch.softmax(t_scores, dim=-1) * valid  # [M, K], rows sum to 1 or 0
    per_pos = -(p_teacher * student).sum(dim=-1) * has_any  # [M]
    loss = per_pos.sum() / max(denom, 1)
    return loss, DistillStats(loss_sum=per_pos.detach().sum(), tokens=int(has_any.sum()))

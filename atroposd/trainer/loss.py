"""The training losses: small pure functions over the completion tokens of one micro-batch.

Every function takes tensors already reduced to the N *trained* tokens of a micro-batch (the
completion positions, flattened in row order) and a ``denom``: the completion-token count of
the **whole optimizer batch**, counted once by the batch preparation. Each function returns
``Σ per-token loss / denom``, so summing the micro-batch losses (and their gradients) gives
exactly the loss of the batch, whatever the micro-batch split — count once, divide once.

Stats are returned as detached *sums* (not means) for the same reason: the step adds them up
over micro-batches and divides by the batch's token count at the end.

The objective menu (SPEC §14) is built from small pieces here, each with its formula and the
anchor it follows: :func:`clip_bounds` (clip-higher), :func:`gspo_log_ratio` (GSPO's sequence
ratio), :func:`rollout_weights` (truncated / masked importance sampling against the sampler),
:func:`aggregation_weights` (``loss_agg``), all combined by :func:`grpo_loss`, whose defaults
are the token-level clipped GRPO loss unchanged. Sequence-level pieces take ``seq``: [N] the
index of each token's sequence within the micro-batch (a sequence is never split over
micro-batches, so every per-sequence quantity is local to one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "AWSFT_ADV_RANGE",
    "LOG_RATIO_LIMIT",
    "LOSS_AGGS",
    "ROLLOUT_CORRECTIONS",
    "DistillStats",
    "LossStats",
    "aggregation_weights",
    "awsft_loss",
    "clip_bounds",
    "distill_loss",
    "grpo_loss",
    "gspo_log_ratio",
    "k3_kl",
    "normalise_batch_advantages",
    "rollout_weights",
    "sequence_mean",
]

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ROLLOUT_CORRECTIONS = ("none", "token-tis", "seq-tis", "token-mis", "seq-mis")

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
    corrected: torch.Tensor | None = None  # [] Σ tokens a rollout correction truncated or masked


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


def clip_bounds(clip_eps: float, clip_eps_high: float = 0.0) -> tuple[float, float]:
    """The ratio's clip range: [1 − ε, 1 + ε], or [1 − ε, 1 + ε_high] when ε_high > 0.

    Anchor: DAPO's clip-higher (``clip_ratio_low`` / ``clip_ratio_high`` in verl, AReaL's
    ``eps_clip_higher``): a larger upper bound lets unlikely tokens with a positive advantage
    grow faster, against entropy collapse.
    """
    return 1.0 - clip_eps, 1.0 + (clip_eps_high if clip_eps_high > 0 else clip_eps)


def sequence_mean(values: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Each token's value replaced by the mean over its sequence's tokens.

    values: [N]; seq: [N] long, the sequence of each token in [0, num_seqs) → [N]. A sequence
    without tokens has no entry (nothing to average).
    """
    sums = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(0, seq, values)  # [S]
    counts = torch.zeros(num_seqs, dtype=values.dtype, device=values.device).index_add(
        0, seq, torch.ones_like(values)
    )  # [S]
    return (sums / counts.clamp(min=1.0))[seq]  # [N]


def gspo_log_ratio(delta: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """GSPO's sequence-level log-ratio in its token form: per token
    ``log s_i = sg(mean_{t∈i} δ_t) + δ_t − sg(δ_t)``, δ = log π − log π_old.

    Its value is the sequence's mean log-ratio (one ratio s_i per sequence, so the clip acts on
    whole sequences); its gradient is ∇log π of the token, scaled by s_i once exponentiated.
    Anchor: GSPO (Zheng et al. 2025) as verl's ``policy_loss.loss_mode = "gspo"`` writes it.
    delta: [N] (requires grad) → [N].
    """
    mean = sequence_mean(delta.detach(), seq, num_seqs)  # [N]
    return mean + delta - delta.detach()


def rollout_weights(
    logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    *,
    mode: str,
    threshold: float,
    seq: torch.Tensor | None = None,
    num_seqs: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rollout correction's weight per token and which tokens it truncated or masked.

    logp: [N] the trainer's log-probabilities (detached here); sampler_logp: [N] the sampler's
    (inference) log-probabilities; seq/num_seqs: each token's sequence (the seq-* modes).
    ρ = exp(log π_trainer − log π_sampler) per token; ρ_seq = exp(mean of the log-ratio over the
    sequence); C = ``threshold``.

    * ``token-tis``: min(ρ, C) — truncated importance sampling (verl ``rollout_is = "token"``);
    * ``seq-tis``: min(ρ_seq, C) — the same on the sequence's ratio (verl ``"sequence"``);
    * ``token-mis``: 1 where 1/C ≤ ρ ≤ C, else 0 — masked IS, IcePop (verl/SkyRL ``"mask"``);
    * ``seq-mis``: 1 where 1/C ≤ ρ_seq ≤ C, else 0.

    Returns (weights [N], corrected [N] bool: ρ > C for tis, outside [1/C, C] for mis).
    """
    log_rho = (logp.detach() - sampler_logp.detach()).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # [N]
    level, _, kind = mode.partition("-")
    if level == "seq":
        assert seq is not None, "a sequence-level correction needs each token's sequence"
        log_rho = sequence_mean(log_rho, seq, num_seqs)
    elif level != "token" or kind not in ("tis", "mis"):
        raise ValueError(f"unknown rollout correction {mode!r}")
    rho = torch.exp(log_rho)  # [N]
    if kind == "tis":
        corrected = rho > threshold
        return rho.clamp(max=threshold), corrected
    corrected = (rho < 1.0 / threshold) | (rho > threshold)
    return (~corrected).to(rho.dtype), corrected


def aggregation_weights(
    mask: torch.Tensor,
    mode: str,
    *,
    sequences: int,
    trained_sequences: int,
    max_token_len: int,
    seq_ids: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``loss_agg``'s weight of each trained token, from one micro-batch's mask and batch totals.

    mask: [B, T] bool; seq_ids: [B, T] long, each position's sequence in the micro-batch (None:
    one sequence per row); sequences: sequences of the whole batch; trained_sequences: those
    with at least one trained token. → [B, T] or None.

    * ``token-mean`` → None: Σ per-token loss / the batch's token count (today's; every token
      weighs the same; TRL's and verl's default);
    * ``seq-mean-token-mean``: 1 / (|y_i| · trained_sequences): the mean over each sequence,
      then over the sequences (each sequence weighs the same; GRPO's paper, verl);
    * ``seq-mean-token-sum-norm``: 1 / (max_token_len · sequences): token sums over a constant
      (Dr.GRPO: no length bias; verl's name).
    """
    if mode == "token-mean":
        return None
    m = mask.to(torch.float32)
    if mode == "seq-mean-token-mean":
        if seq_ids is None:
            lengths = m.sum(dim=1, keepdim=True).expand_as(m)  # [B, T]
        else:
            per_seq = torch.zeros(int(seq_ids.max()) + 1 if seq_ids.numel() else 0).index_add(
                0, seq_ids.reshape(-1), m.reshape(-1)
            )  # [S] trained tokens per sequence
            lengths = per_seq[seq_ids]  # [B, T]
        return m / (lengths.clamp(min=1.0) * max(trained_sequences, 1))
    if mode == "seq-mean-token-sum-norm":
        return m / float(max_token_len * max(sequences, 1))
    raise ValueError(f"unknown loss_agg {mode!r}")


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    *,
    clip_eps: float,
    denom: int,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    clip_eps_high: float = 0.0,
    sequence_level: bool = False,
    seq: torch.Tensor | None = None,
    num_seqs: int = 0,
    weight: torch.Tensor | None = None,
    correction: str = "none",
    threshold: float = 2.0,
    policy_old: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Clipped-ratio policy gradient (PPO/GRPO) with an optional k3 KL penalty.

    logp:     [N] log π_θ(token) at the rollout's temperature (requires grad)
    old_logp: [N] the rollout policy's log-probability of the same tokens (no grad)
    adv:      [N] advantage of each token (its sequence's, broadcast)
    ref_logp: [N] reference log-probabilities for the KL term, or None
    denom:    completion tokens in the whole optimizer batch (≥ 1)

    per token: −min(r·A, clip(r, 1−ε, 1+ε)·A) + β·k3, with r = exp(clamp(logp − old_logp)).
    With the defaults that is the whole loss, summed over the tokens and divided by ``denom``.

    The menu (SPEC §14): ``clip_eps_high`` > 0 raises the upper bound (:func:`clip_bounds`);
    ``sequence_level`` takes GSPO's ratio per sequence (:func:`gspo_log_ratio`, needs ``seq``);
    ``correction`` ≠ "none" takes the ratio against the trainer's own detached logprobs
    (verl's decoupled form: its value is 1 on the first pass) and weights each token's policy
    term by :func:`rollout_weights` against the sampler's ``old_logp``; ``weight`` [N] (from
    :func:`aggregation_weights`) replaces ``/ denom`` by Σ weight · per-token loss.

    Several optimizer steps per batch (SPEC §14): ``policy_old`` [N] is π_old, the trainer's own
    logprobs before the batch's first update (None: ``logp`` detached, its value in the first
    step). With a correction the ratio is clipped against it and ρ compares it with the sampler.
    """
    lo, hi = clip_bounds(clip_eps, clip_eps_high)
    is_weight: torch.Tensor | None = None
    corrected: torch.Tensor | None = None
    if correction != "none":
        anchor = logp.detach() if policy_old is None else policy_old.detach()
        is_weight, corrected = rollout_weights(
            anchor, old_logp, mode=correction, threshold=threshold, seq=seq, num_seqs=num_seqs
        )
    else:
        anchor = old_logp.detach()
    delta = (logp - anchor).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # [N]
    if sequence_level:
        assert seq is not None, "the sequence-level ratio needs each token's sequence"
        delta = gspo_log_ratio(delta, seq, num_seqs)
    ratio = torch.exp(delta)  # [N], finite
    clipped_ratio = ratio.clamp(lo, hi)  # [N]
    per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)  # [N]
    if is_weight is not None:
        per_token = per_token * is_weight
    kl = torch.zeros_like(per_token)
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp.detach())  # [N]
        if kl_coef:
            per_token = per_token + kl_coef * kl
    loss = per_token.sum() / max(denom, 1) if weight is None else (per_token * weight).sum()
    with torch.no_grad():
        outside = (ratio < lo) | (ratio > hi)
        stats = LossStats(
            ratio_sum=ratio.detach().sum(),
            clipped=outside.sum().to(ratio.dtype),
            kl_sum=kl.detach().sum(),
            corrected=None if corrected is None else corrected.sum().to(ratio.dtype),
        )
    return loss, stats


def awsft_loss(
    logp: torch.Tensor, adv: torch.Tensor, *, denom: int, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Advantage-weighted SFT: −Σ w·log π(token) / denom.

    logp: [N] (requires grad); adv: [N] weights, already normalised per batch and clipped
    (:func:`normalise_batch_advantages`). No ratio, no rollout logprobs needed. ``weight`` [N]
    (:func:`aggregation_weights`) replaces ``/ denom``.
    """
    per_token = -(adv.detach() * logp)
    return per_token.sum() / max(denom, 1) if weight is None else (per_token * weight).sum()


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


def distill_loss(
    logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor, *, temperature: float, denom: int
) -> tuple[torch.Tensor, DistillStats]:
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

"""The compute half of a step (runs in the worker thread): loss over micro-batches, backward,
gradient clip, and — only when everything is finite — the optimizer step.

Strategies, chosen once from the config and passed in (the loop never tests modes):

* ``Objective``: ``GrpoObjective`` (clipped ratio + k3 KL) or ``AwsftObjective``;
* ``Reference``: where the KL term's reference logprobs come from — ``InitialReference``
  (the frozen starting weights), ``RolloutReference`` (the sampling policy's logprobs) or
  ``NoReference`` (``kl_coef = 0``).

A step whose loss or gradient norm is not finite is *skipped*: gradients are dropped, the
optimizer and scheduler are not stepped, so weights and optimizer state stay bit-identical.
In shared mode the inference server computes on these very weights, where one NaN step
would be unrecoverable (ATROPOS-PROTOCOL.md §2 (b)).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from atroposd.trainer.batch import MicroBatch, RolloutBatch
from atroposd.trainer.loss import (
    LossStats,
    awsft_loss,
    distill_loss,
    grpo_loss,
    normalise_batch_advantages,
)
from atroposd.trainer.model import Policy, token_logprobs
from atroposd.trainer.ranks import OneRank, Ranks, Share, full_tensor

if TYPE_CHECKING:
    from atroposd.config import TrainerConfig

__all__ = ["AwsftObjective", "GrpoObjective", "InitialReference", "Learner", "NoReference", "Objective",
           "Reference", "RolloutReference", "StepResult", "make_strategies"]


@dataclass
class StepResult:
    """What one step's compute produced (all floats, ready for the metrics line)."""

    loss: float
    grad_norm: float
    finite: bool
    mean_ratio: float
    clipped_fraction: float
    mean_kl: float
    tokens: int
    compute_s: float
    distill_loss: float | None = None
    distill_token_count: int = 0
    # mean |log π_trainer − log π_rollout| over tokens that carry a rollout logprob: ~0 for
    # on-policy data; a large value with staleness 0 means the two sides score tokens differently
    logprob_diff_abs_mean: float | None = None


class Reference(Protocol):
    def logprobs(self, policy: Policy, mb: MicroBatch, old_logp: torch.Tensor) -> torch.Tensor | None: ...


class NoReference:
    def logprobs(self, policy: Policy, mb: MicroBatch, old_logp: torch.Tensor) -> torch.Tensor | None:
        return None


class RolloutReference:
    """KL toward the sampling policy: its logprobs are already in the batch (no extra memory)."""

    def logprobs(self, policy: Policy, mb: MicroBatch, old_logp: torch.Tensor) -> torch.Tensor | None:
        return old_logp


class InitialReference:
    """KL toward the frozen starting weights (GRPO's reference model, EMBEDDED-TASK.md)."""

    def logprobs(self, policy: Policy, mb: MicroBatch, old_logp: torch.Tensor) -> torch.Tensor | None:
        ref = policy.reference_model
        assert ref is not None, "kl_reference = initial needs Policy.reference"
        with torch.no_grad(), policy.reference_context():
            logp, _ = token_logprobs(ref, mb.input_ids, mb.mask, mb.labels, mb.temperature)
        return logp


class Objective(Protocol):
    def prepare(self, batch: RolloutBatch) -> None: ...
    def loss(self, logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, ref: torch.Tensor | None,
             denom: int) -> tuple[torch.Tensor, LossStats]: ...


class GrpoObjective:
    def __init__(self, *, clip_eps: float, kl_coef: float) -> None:
        self.clip_eps = clip_eps
        self.kl_coef = kl_coef

    def prepare(self, batch: RolloutBatch) -> None:
        pass

    def loss(self, logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, ref: torch.Tensor | None,
             denom: int) -> tuple[torch.Tensor, LossStats]:
        return grpo_loss(logp, old_logp, adv, clip_eps=self.clip_eps, denom=denom, ref_logp=ref,
                         kl_coef=self.kl_coef)


class AwsftObjective:
    """Advantage-weighted SFT; advantages re-normalised over the batch's sequences first."""

    def __init__(self, *, kl_coef: float) -> None:
        self.kl_coef = kl_coef

    def prepare(self, batch: RolloutBatch) -> None:
        # One advantage per sequence (its first trained position) → normalised over the batch.
        firsts = [mb.advantages[torch.arange(mb.mask.shape[0]), mb.mask.float().argmax(1)] for mb in batch.micro]
        weights = normalise_batch_advantages(torch.cat(firsts))
        offset = 0
        for mb in batch.micro:
            n = mb.mask.shape[0]
            mb.advantages = weights[offset:offset + n, None].expand_as(mb.advantages).contiguous()
            offset += n

    def loss(self, logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, ref: torch.Tensor | None,
             denom: int) -> tuple[torch.Tensor, LossStats]:
        from atroposd.trainer.loss import k3_kl

        loss = awsft_loss(logp, adv, denom=denom)
        kl = k3_kl(logp, ref.detach()) if ref is not None else torch.zeros_like(logp)
        if ref is not None and self.kl_coef:
            loss = loss + self.kl_coef * kl.sum() / max(denom, 1)
        zero = torch.zeros((), dtype=logp.dtype)
        return loss, LossStats(ratio_sum=torch.ones_like(logp).sum(), clipped=zero, kl_sum=kl.detach().sum())


def make_strategies(tcfg: TrainerConfig) -> tuple[Objective, Reference]:
    objective: Objective
    if tcfg.loss == "awsft":
        objective = AwsftObjective(kl_coef=tcfg.kl_coef)
    else:
        objective = GrpoObjective(clip_eps=tcfg.clip_eps, kl_coef=tcfg.kl_coef)
    reference: Reference
    if tcfg.kl_coef <= 0:
        reference = NoReference()
    elif tcfg.kl_reference == "initial":
        reference = InitialReference()
    else:
        reference = RolloutReference()
    return objective, reference


class Learner:
    """Owns the policy, optimizer and scheduler; ``compute`` then ``apply`` or ``discard``.

    ``ranks``: the trainer's ranks (:mod:`atroposd.trainer.ranks`). On rank 0 ``compute``,
    ``apply`` and ``discard`` also tell the other ranks to do the same; the other ranks call
    ``compute_share`` and the ``apply_local`` / ``discard_local`` halves when told."""

    def __init__(self, policy: Policy, optimizer: torch.optim.Optimizer, scheduler: Any, *,
                 objective: Objective, reference: Reference, max_grad_norm: float,
                 distill_coef: float = 0.0, distill_temperature: float = 1.0,
                 ranks: Ranks | None = None) -> None:
        self.policy = policy
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.objective = objective
        self.reference = reference
        self.max_grad_norm = max_grad_norm
        self.distill_coef = distill_coef
        self.distill_temperature = distill_temperature
        self.params = policy.trainable()
        self.ranks: Ranks = ranks if ranks is not None else OneRank()

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def compute(self, batch: RolloutBatch) -> StepResult:
        """Forward/backward over every micro-batch (dealt over the ranks) and clip; gradients are
        left for apply()."""
        start = time.perf_counter()
        self.objective.prepare(batch)  # on the whole batch (AWSFT normalises over it)
        self.ranks.command("compute")
        share = self.ranks.share(batch.micro, max(batch.completion_tokens, 1), batch.distill_positions)
        return self.compute_share(share, start=start)

    def compute_share(self, share: Share, *, start: float | None = None) -> StepResult:
        """This rank's passes; the loss and statistics summed over the ranks."""
        start = time.perf_counter() if start is None else start
        self.optimizer.zero_grad(set_to_none=True)
        denom = share.denom
        # FSDP2 averages gradients over the ranks: scaled by the rank count, the average of the
        # ranks' sums is the sum one rank computes over the whole batch.
        scale = float(self.ranks.world)
        total = torch.zeros((), dtype=torch.float64)
        ratio_sum = clipped = kl_sum = 0.0
        d_loss = 0.0
        d_tokens = 0
        diff_sum, diff_n = 0.0, 0
        device = self.policy.device
        for mb_cpu, weight in share.passes_with_weight():
            mb = mb_cpu.to(device)
            distill = self.distill_coef > 0 and mb.distill_ids is not None
            d_mask = (mb.distill_ids >= 0).any(-1) & mb.mask if distill and mb.distill_ids is not None else None
            logp, d_logits = token_logprobs(self.policy.model, mb.input_ids, mb.mask, mb.labels, mb.temperature,
                                            want_logits=d_mask)  # [N], [M, V]
            old = mb.old_logp[mb.mask]  # [N]
            present = ~torch.isnan(old)  # [N]
            old = torch.where(present, old, logp.detach())  # missing → on-policy
            adv = mb.advantages[mb.mask]  # [N]
            ref = self.reference.logprobs(self.policy, mb, old)
            loss, stats = self.objective.loss(logp, old, adv, ref, denom)
            if d_mask is not None and d_logits is not None and mb.distill_ids is not None \
                    and mb.distill_lp is not None:
                dl, dstats = distill_loss(d_logits, mb.distill_ids[d_mask], mb.distill_lp[d_mask],
                                          temperature=self.distill_temperature,
                                          denom=max(share.distill_positions, 1))
                loss = loss + self.distill_coef * dl
                if weight:
                    d_loss += float(dstats.loss_sum)
                    d_tokens += dstats.tokens
            if loss.requires_grad:
                (loss * (scale * weight) if scale * weight != 1.0 else loss).backward()
            if not weight:
                continue  # a zero-weight pass: its collectives ran, it counts for nothing
            diff_sum += float((logp.detach() - old)[present].abs().sum())
            diff_n += int(present.sum())
            total += loss.detach().double().cpu()
            ratio_sum += float(stats.ratio_sum)
            clipped += float(stats.clipped)
            kl_sum += float(stats.kl_sum)
        grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)))
        loss_value, ratio_sum, clipped, kl_sum, d_loss, d_tokens_f, diff_sum, diff_n_f = self.ranks.sum(
            [float(total), ratio_sum, clipped, kl_sum, d_loss, d_tokens, diff_sum, diff_n])
        d_tokens, diff_n = int(d_tokens_f), int(diff_n_f)
        finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
        return StepResult(loss=loss_value, grad_norm=grad_norm, finite=finite, mean_ratio=ratio_sum / denom,
                          clipped_fraction=clipped / denom, mean_kl=kl_sum / denom, tokens=denom,
                          compute_s=time.perf_counter() - start,
                          distill_loss=(d_loss / max(d_tokens, 1)) if d_tokens else None,
                          distill_token_count=d_tokens,
                          logprob_diff_abs_mean=diff_sum / diff_n if diff_n else None)

    def apply(self) -> None:
        """The optimizer step (in shared mode: while the inference server is paused)."""
        self.ranks.command("apply")
        self.apply_local()

    def apply_local(self) -> None:
        """This rank's optimizer step (rank 0 told the others in apply)."""
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def discard(self) -> None:
        """Drop this step's gradients: weights, optimizer and scheduler untouched."""
        self.ranks.command("discard")
        self.discard_local()

    def discard_local(self) -> None:
        """This rank's gradients dropped (rank 0 told the others in discard)."""
        self.optimizer.zero_grad(set_to_none=True)

"""The compute half of a step (runs in the worker thread): loss over micro-batches, backward,
gradient clip, and — only when everything is finite — the optimizer step.

Strategies, chosen once from the config and passed in (the loop never tests modes):

* ``Objective``: ``GrpoObjective`` (clipped ratio + k3 KL; with SPEC §14's menu: GSPO's
  sequence ratio, clip-higher, ``loss_agg``, a rollout correction) or ``AwsftObjective``;
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from atroposd.logs import get_logger
from atroposd.trainer.batch import MicroBatch, RolloutBatch
from atroposd.trainer.group import Apply, Compute, Discard, Score
from atroposd.trainer.logprobs import teacher_probs
from atroposd.trainer.loss import (
    LossStats,
    aggregation_weights,
    awsft_loss,
    grpo_loss,
    normalise_batch_advantages,
)
from atroposd.trainer.model import DEFAULT_CHUNK, Policy, token_logprobs, token_scores
from atroposd.trainer.ranks import OneRank, Ranks, Share, full_tensor

if TYPE_CHECKING:
    from atroposd.config import TrainerConfig

log = get_logger(__name__)

__all__ = [
    "AwsftObjective",
    "GrpoObjective",
    "InitialReference",
    "Learner",
    "NoReference",
    "Objective",
    "Reference",
    "RolloutReference",
    "StepResult",
    "Tokens",
    "make_strategies",
    "set_aggregation",
    "trained_tokens",
]


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
    # share of the batch's tokens a rollout correction truncated or masked (None: no correction)
    rollout_corrected: float | None = None
    # the policy's mean entropy per completion token, at the rollout temperature (SPEC §14)
    entropy: float | None = None
    # optimizer steps this batch took (SPEC §14: ppo_epochs × mini_batches; 1 by default)
    optimizer_steps: int = 1


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
    """KL toward the frozen starting weights (GRPO's reference model, EMBEDDED-TASK.md); its LM
    head, too, over ``chunk`` positions at a time."""

    def __init__(self, chunk: int = DEFAULT_CHUNK) -> None:
        self.chunk = chunk

    def logprobs(self, policy: Policy, mb: MicroBatch, old_logp: torch.Tensor) -> torch.Tensor | None:
        ref = policy.reference_model
        assert ref is not None, "kl_reference = initial needs Policy.reference"
        with torch.no_grad(), policy.reference_context():
            logp, _ = token_logprobs(
                ref, mb.input_ids, mb.mask, mb.labels, mb.temperature, seq_lens=mb.seq_lens, chunk=self.chunk
            )
        return logp


@dataclass
class Tokens:
    """Where one micro-batch's N trained tokens come from: ``seq`` [N] long, each token's
    sequence in [0, num_seqs); ``weight`` [N], ``loss_agg``'s weight per token, or None."""

    seq: torch.Tensor
    num_seqs: int
    weight: torch.Tensor | None = None


def trained_tokens(mb: MicroBatch) -> Tokens:
    """The sequence of each trained token of ``mb`` (padded rows or one packed row), in
    ``mb.mask`` order."""
    seq = mb.sequence_ids()[mb.mask]  # [N]
    weight = mb.loss_weight[mb.mask] if mb.loss_weight is not None else None
    return Tokens(seq=seq, num_seqs=mb.num_sequences, weight=weight)


def set_aggregation(batch: RolloutBatch, loss_agg: str, max_token_len: int) -> None:
    """Each micro-batch's ``loss_weight`` for ``loss_agg``, from the whole batch's counts (so a
    split over micro-batches or ranks changes nothing)."""
    for mb in batch.micro:
        mb.loss_weight = aggregation_weights(
            mb.mask,
            loss_agg,
            sequences=batch.sequences,
            trained_sequences=batch.trained_sequences,
            max_token_len=max_token_len,
            seq_ids=mb.sequence_ids(),
        )


class Objective(Protocol):
    def prepare(self, batch: RolloutBatch) -> None: ...
    def aggregate(self, batch: RolloutBatch) -> None: ...
    def loss(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        adv: torch.Tensor,
        ref: torch.Tensor | None,
        denom: int,
        tokens: Tokens | None = None,
        policy_old: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, LossStats]: ...


class GrpoObjective:
    """``loss = "grpo"`` or ``"gspo"`` (``sequence_level``) with the rest of SPEC §14's menu;
    the defaults are today's token-level clipped GRPO loss."""

    def __init__(
        self,
        *,
        clip_eps: float,
        kl_coef: float,
        clip_eps_high: float = 0.0,
        sequence_level: bool = False,
        loss_agg: str = "token-mean",
        max_token_len: int = 0,
        correction: str = "none",
        threshold: float = 2.0,
    ) -> None:
        self.clip_eps = clip_eps
        self.kl_coef = kl_coef
        self.clip_eps_high = clip_eps_high
        self.sequence_level = sequence_level
        self.loss_agg = loss_agg
        self.max_token_len = max_token_len
        self.correction = correction
        self.threshold = threshold

    def prepare(self, batch: RolloutBatch) -> None:
        set_aggregation(batch, self.loss_agg, self.max_token_len)

    def aggregate(self, batch: RolloutBatch) -> None:
        """``loss_agg``'s weights over one mini-batch (its loss is normalised over itself)."""
        set_aggregation(batch, self.loss_agg, self.max_token_len)

    def loss(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        adv: torch.Tensor,
        ref: torch.Tensor | None,
        denom: int,
        tokens: Tokens | None = None,
        policy_old: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, LossStats]:
        seq, num_seqs, weight = (tokens.seq, tokens.num_seqs, tokens.weight) if tokens is not None else (None, 0, None)
        return grpo_loss(
            logp,
            old_logp,
            adv,
            clip_eps=self.clip_eps,
            denom=denom,
            ref_logp=ref,
            kl_coef=self.kl_coef,
            clip_eps_high=self.clip_eps_high,
            sequence_level=self.sequence_level,
            seq=seq,
            num_seqs=num_seqs,
            weight=weight,
            correction=self.correction,
            threshold=self.threshold,
            policy_old=policy_old,
        )


def _combine(results: list[StepResult], batch: RolloutBatch, seconds: float) -> StepResult:
    """One metrics row of a batch's optimizer steps (SPEC §14): the batch's means (the loss over
    the steps; ratio, KL, entropy and the shares over their tokens), the last step's
    ``clipped_fraction`` and ``grad_norm``."""
    last = results[-1]
    tokens = sum(r.tokens for r in results) or 1

    def mean(name: str) -> float | None:
        values = [(float(getattr(r, name)), r.tokens) for r in results if getattr(r, name) is not None]
        if not values:
            return None
        return sum(v * n for v, n in values) / max(sum(n for _, n in values), 1)

    d_tokens = sum(r.distill_token_count for r in results)
    return StepResult(
        loss=sum(r.loss for r in results) / len(results),
        grad_norm=last.grad_norm,
        finite=True,
        mean_ratio=sum(r.mean_ratio * r.tokens for r in results) / tokens,
        clipped_fraction=last.clipped_fraction,
        mean_kl=sum(r.mean_kl * r.tokens for r in results) / tokens,
        tokens=batch.completion_tokens,
        compute_s=seconds,
        distill_loss=(
            sum((r.distill_loss or 0.0) * r.distill_token_count for r in results) / d_tokens if d_tokens else None
        ),
        distill_token_count=d_tokens,
        logprob_diff_abs_mean=mean("logprob_diff_abs_mean"),
        rollout_corrected=mean("rollout_corrected"),
        entropy=mean("entropy"),
        optimizer_steps=len(results),
    )


def _first_positions(mb: MicroBatch) -> torch.Tensor:
    """[S] the flat index of each sequence's first trained position (its first position when it
    has none), for padded rows and packed sequences alike."""
    seq = mb.sequence_ids().reshape(-1)  # [B*T]
    size = seq.numel()
    idx = torch.arange(size, device=seq.device)
    key = torch.where(mb.mask.reshape(-1), idx, idx + size)  # trained positions first
    first = torch.full((mb.num_sequences,), 2 * size, dtype=torch.long, device=seq.device)
    return first.scatter_reduce(0, seq, key, "amin") % size


class AwsftObjective:
    """Advantage-weighted SFT; advantages re-normalised over the batch's sequences first."""

    def __init__(self, *, kl_coef: float, loss_agg: str = "token-mean", max_token_len: int = 0) -> None:
        self.kl_coef = kl_coef
        self.loss_agg = loss_agg
        self.max_token_len = max_token_len

    def prepare(self, batch: RolloutBatch) -> None:
        set_aggregation(batch, self.loss_agg, self.max_token_len)
        # One advantage per sequence (its first trained position) → normalised over the batch.
        firsts = [mb.advantages.reshape(-1)[_first_positions(mb)] for mb in batch.micro]
        weights = normalise_batch_advantages(torch.cat(firsts))
        offset = 0
        for mb in batch.micro:
            n = mb.num_sequences
            mb.advantages = weights[offset : offset + n][mb.sequence_ids()].contiguous()  # [B, T]
            offset += n

    def aggregate(self, batch: RolloutBatch) -> None:
        """``loss_agg``'s weights over one mini-batch (its advantages were normalised over the batch)."""
        set_aggregation(batch, self.loss_agg, self.max_token_len)

    def loss(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        adv: torch.Tensor,
        ref: torch.Tensor | None,
        denom: int,
        tokens: Tokens | None = None,
        policy_old: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, LossStats]:
        from atroposd.trainer.loss import k3_kl

        weight = tokens.weight if tokens is not None else None
        loss = awsft_loss(logp, adv, denom=denom, weight=weight)
        kl = k3_kl(logp, ref.detach()) if ref is not None else torch.zeros_like(logp)
        if ref is not None and self.kl_coef:
            loss = loss + self.kl_coef * (kl.sum() / max(denom, 1) if weight is None else (kl * weight).sum())
        zero = torch.zeros((), dtype=logp.dtype)
        return loss, LossStats(ratio_sum=torch.ones_like(logp).sum(), clipped=zero, kl_sum=kl.detach().sum())


def make_strategies(tcfg: TrainerConfig) -> tuple[Objective, Reference]:
    objective: Objective
    if tcfg.loss == "awsft":
        objective = AwsftObjective(kl_coef=tcfg.kl_coef, loss_agg=tcfg.loss_agg, max_token_len=tcfg.max_token_len)
    else:
        clip_eps, clip_eps_high = tcfg.clip_range()
        objective = GrpoObjective(
            clip_eps=clip_eps,
            kl_coef=tcfg.kl_coef,
            clip_eps_high=clip_eps_high,
            sequence_level=tcfg.loss == "gspo",
            loss_agg=tcfg.loss_agg,
            max_token_len=tcfg.max_token_len,
            correction=tcfg.rollout_correction,
            threshold=tcfg.rollout_correction_threshold,
        )
    reference: Reference
    if tcfg.kl_coef <= 0:
        reference = NoReference()
    elif tcfg.kl_reference == "initial":
        reference = InitialReference(chunk=tcfg.logprob_chunk)
    else:
        reference = RolloutReference()
    return objective, reference


class Learner:
    """Owns the policy, optimizer and scheduler; ``compute`` then ``apply`` or ``discard``.

    ``ranks``: the trainer's ranks (:mod:`atroposd.trainer.ranks`). On rank 0 ``compute``,
    ``apply`` and ``discard`` also tell the other ranks to do the same; the other ranks call
    ``compute_share`` and the ``apply_local`` / ``discard_local`` halves when told."""

    def __init__(
        self,
        policy: Policy,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        *,
        objective: Objective,
        reference: Reference,
        max_grad_norm: float,
        distill_coef: float = 0.0,
        distill_temperature: float = 1.0,
        ranks: Ranks | None = None,
        logprob_chunk: int = DEFAULT_CHUNK,
        ppo_epochs: int = 1,
        mini_batches: int = 1,
        seed: int = 0,
        micro_batch_size: int = 32,
        micro_batch_tokens: int = 0,
    ) -> None:
        self.policy = policy
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.objective = objective
        self.reference = reference
        self.max_grad_norm = max_grad_norm
        self.distill_coef = distill_coef
        self.distill_temperature = distill_temperature
        self.logprob_chunk = logprob_chunk  # completion positions per chunk of the LM head (SPEC §14)
        self.params = policy.trainable()
        self.ranks: Ranks = ranks if ranks is not None else OneRank()
        # Called before every optimizer step: a checkpoint being written has read the weights
        # (the checkpointer's fence; SPEC §12.1, checkpoints in the background)
        self.fence: Callable[[], None] | None = None
        # SPEC §14: optimizer steps per batch (``train``), and how its mini-batches are formed
        self.ppo_epochs = max(1, int(ppo_epochs))
        self.mini_batches = max(1, int(mini_batches))
        self.seed = int(seed)
        self.micro_batch_size = max(1, int(micro_batch_size))
        self.micro_batch_tokens = int(micro_batch_tokens)
        # the logprobs a capturing pass left (π_old of the batch's flat positions, every rank's summed)
        self.captured: torch.Tensor | None = None

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps on each batch: ppo_epochs × mini_batches (1: ``compute`` then ``apply``;
        more: ``train`` takes them all)."""
        return self.ppo_epochs * self.mini_batches

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps the weights have taken (the schedule's position: kept in checkpoints)."""
        return int(getattr(self.scheduler, "last_epoch", 0))

    def compute(self, batch: RolloutBatch) -> StepResult:
        """Forward/backward over every micro-batch (dealt over the ranks) and clip; gradients are
        left for apply()."""
        start = time.perf_counter()
        self.objective.prepare(batch)  # on the whole batch (AWSFT normalises over it)
        self.ranks.command(Compute())
        share = self.ranks.share(batch.micro, max(batch.completion_tokens, 1), batch.distill_positions)
        return self.compute_share(share, start=start)

    def compute_share(self, share: Share, *, start: float | None = None, capture: int = 0) -> StepResult:
        """This rank's passes; the loss and statistics summed over the ranks. ``capture`` > 0: the
        passes' logprobs, before any update, are π_old of the batch's ``capture`` flat positions
        (``captured``, summed over the ranks)."""
        start = time.perf_counter() if start is None else start
        buf = torch.zeros(capture, dtype=torch.float32) if capture else None
        self.optimizer.zero_grad(set_to_none=True)
        denom = share.denom
        # FSDP2 averages gradients over the ranks: scaled by the rank count, the average of the
        # ranks' sums is the sum one rank computes over the whole batch.
        scale = float(self.ranks.world)
        total = torch.zeros((), dtype=torch.float64)
        ratio_sum = clipped = kl_sum = corrected = 0.0
        corrects = getattr(self.objective, "correction", "none") != "none"
        d_loss = 0.0
        d_tokens = 0
        diff_sum, diff_n = 0.0, 0
        entropy_sum = 0.0
        device = self.policy.device
        for mb_cpu, weight in share.passes_with_weight():
            mb = mb_cpu.to(device)
            teacher = None
            if self.distill_coef > 0 and mb.distill_ids is not None and mb.distill_lp is not None:
                t_ids = mb.distill_ids[mb.mask]  # [N, K]
                teacher = (t_ids, teacher_probs(t_ids, mb.distill_lp[mb.mask], self.distill_temperature))
            # the LM head over logprob_chunk positions at a time: logp [N], entropy [N], distill [N]
            scores = token_scores(
                self.policy.model,
                mb.input_ids,
                mb.mask,
                mb.labels,
                mb.temperature,
                seq_lens=mb.seq_lens,
                teacher=teacher,
                chunk=self.logprob_chunk,
                tau=self.distill_temperature,
                entropy=True,
            )
            logp = scores.logp
            old = mb.old_logp[mb.mask]  # [N]
            present = ~torch.isnan(old)  # [N]
            pi_old = None
            if mb.policy_old is not None:  # a later optimizer step on the batch: π_old where known
                known = mb.policy_old[mb.mask]  # [N]
                pi_old = torch.where(torch.isnan(known), logp.detach(), known)
            old = torch.where(present, old, logp.detach() if pi_old is None else pi_old)  # missing → on-policy
            adv = mb.advantages[mb.mask]  # [N]
            ref = self.reference.logprobs(self.policy, mb, old)
            if pi_old is None:
                loss, stats = self.objective.loss(logp, old, adv, ref, denom, trained_tokens(mb))
            else:
                loss, stats = self.objective.loss(logp, old, adv, ref, denom, trained_tokens(mb), policy_old=pi_old)
            if teacher is not None and scores.distill is not None:
                # Σ over the positions with a teacher of −Σ_k p_T·log q_S (0 elsewhere) / the batch's count
                loss = loss + self.distill_coef * scores.distill.sum() / max(share.distill_positions, 1)
                if weight:
                    d_loss += float(scores.distill.detach().sum())
                    d_tokens += int((teacher[0] >= 0).any(-1).sum())
            if loss.requires_grad:
                (loss * (scale * weight) if scale * weight != 1.0 else loss).backward()
            if not weight:
                continue  # a zero-weight pass: its collectives ran, it counts for nothing
            if buf is not None and mb.flat_index is not None:
                buf[mb.flat_index[mb.mask].cpu()] = logp.detach().float().cpu()
            diff_sum += float((logp.detach() - old)[present].abs().sum())
            diff_n += int(present.sum())
            total += loss.detach().double().cpu()
            ratio_sum += float(stats.ratio_sum)
            clipped += float(stats.clipped)
            kl_sum += float(stats.kl_sum)
            if scores.entropy is not None:
                entropy_sum += float(scores.entropy.sum())
            if stats.corrected is not None:
                corrected += float(stats.corrected)
        grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)))
        loss_value, ratio_sum, clipped, kl_sum, d_loss, d_tokens_f, diff_sum, diff_n_f, corrected, entropy_sum = (
            self.ranks.sum(
                [float(total), ratio_sum, clipped, kl_sum, d_loss, d_tokens, diff_sum, diff_n, corrected, entropy_sum]
            )
        )
        d_tokens, diff_n = int(d_tokens_f), int(diff_n_f)
        if buf is not None:
            self.captured = self.ranks.sum_tensor(buf)
        finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
        return StepResult(
            loss=loss_value,
            grad_norm=grad_norm,
            finite=finite,
            mean_ratio=ratio_sum / denom,
            clipped_fraction=clipped / denom,
            mean_kl=kl_sum / denom,
            tokens=denom,
            compute_s=time.perf_counter() - start,
            distill_loss=(d_loss / max(d_tokens, 1)) if d_tokens else None,
            distill_token_count=d_tokens,
            logprob_diff_abs_mean=diff_sum / diff_n if diff_n else None,
            rollout_corrected=corrected / denom if corrects else None,
            entropy=entropy_sum / denom,
        )

    def score_share(self, share: Share, size: int) -> torch.Tensor:
        """This rank's passes without gradients: their logprobs in a buffer of the batch's ``size``
        flat positions, summed over the ranks (π_old of a batch's later mini-batches)."""
        buf = torch.zeros(size, dtype=torch.float32)
        device = self.policy.device
        with torch.no_grad():
            for mb_cpu, weight in share.passes_with_weight():
                mb = mb_cpu.to(device)
                logp, _ = token_logprobs(
                    self.policy.model,
                    mb.input_ids,
                    mb.mask,
                    mb.labels,
                    mb.temperature,
                    seq_lens=mb.seq_lens,
                    chunk=self.logprob_chunk,
                )
                if weight and mb.flat_index is not None:
                    buf[mb.flat_index[mb.mask].cpu()] = logp.detach().float().cpu()
        return self.ranks.sum_tensor(buf)

    def score(self, batch: RolloutBatch, size: int) -> torch.Tensor:
        """Rank 0: π_old of ``batch``'s positions with every rank (``score_share``)."""
        self.ranks.command(Score(size))
        share = self.ranks.share(batch.micro, max(batch.completion_tokens, 1), batch.distill_positions)
        return self.score_share(share, size)

    def _compute_mini(self, mini: RolloutBatch, capture: int) -> StepResult:
        self.ranks.command(Compute(capture))
        share = self.ranks.share(mini.micro, max(mini.completion_tokens, 1), mini.distill_positions)
        return self.compute_share(share, capture=capture)

    def order(self, step: int, epoch: int, groups: int) -> list[list[int]]:
        """The mini-batches of pass ``epoch`` over batch ``step``: its groups in a fresh random
        order (the same for the same seed, step and pass: a resumed run takes the same steps),
        split into ``mini_batches`` parts of whole groups (as even as the count allows)."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 1_009 + epoch)
        perm = torch.randperm(groups, generator=gen).tolist()
        parts = min(self.mini_batches, max(groups, 1))
        size, extra = divmod(len(perm), parts)
        out, at = [], 0
        for i in range(parts):
            n = size + (1 if i < extra else 0)
            out.append(perm[at : at + n])
            at += n
        return [p for p in out if p]

    def train(self, batch: RolloutBatch, step: int) -> StepResult:
        """Several optimizer steps on one batch (SPEC §14): ``ppo_epochs`` passes, each over the
        batch's groups in a fresh random order, split into ``mini_batches`` mini-batches; each
        mini-batch's loss normalised over itself, its gradient applied at once. π_old (the
        trainer's logprobs before the first update) comes from the first step's own pass, and a
        pass without gradients over the rest of the batch (before it) when it has several
        mini-batches; it is
        needed with a rollout correction and where the sampler's logprobs are missing. A first
        step that is not finite skips the batch (nothing applied); a later one ends its steps there.
        ``batch`` from ``prepare_batch(keep_rows=True)``; ``step`` is the batch's step number."""
        start = time.perf_counter()
        size = batch.flat_size()
        mbs, mbt = self.micro_batch_size, self.micro_batch_tokens
        whole = batch.mini_batch(range(batch.groups), micro_batch_size=mbs, micro_batch_tokens=mbt)
        self.objective.prepare(whole)  # awsft: advantages normalised over the whole batch
        advantages = torch.zeros(size, dtype=torch.float32)
        for mb in whole.micro:
            assert mb.flat_index is not None
            advantages[mb.flat_index[mb.mask]] = mb.advantages[mb.mask].float()
        del whole
        corrects = getattr(self.objective, "correction", "none") != "none"
        needs_old = corrects or batch.missing_logprobs > 0
        policy_old: torch.Tensor | None = None
        results: list[StepResult] = []
        for epoch in range(self.ppo_epochs):
            parts = self.order(step, epoch, batch.groups)
            for part in parts:
                first = not results
                mini = batch.mini_batch(
                    part, micro_batch_size=mbs, micro_batch_tokens=mbt, advantages=advantages, policy_old=policy_old
                )
                self.objective.aggregate(mini)
                rest_old = None
                rest = [g for p in parts if p is not part for g in p]
                if first and needs_old and rest:
                    # the rest of the batch before the first update, without gradients (first: no
                    # gradient of the step is pending while it runs)
                    rest_batch = batch.mini_batch(rest, micro_batch_size=mbs, micro_batch_tokens=mbt)
                    rest_old = self.score(rest_batch, size)
                r = self._compute_mini(mini, size if first and needs_old else 0)
                if first and needs_old:
                    policy_old, self.captured = self.captured, None
                    if policy_old is not None and rest_old is not None:
                        policy_old = policy_old + rest_old
                if not r.finite:
                    self.discard()
                    if first:
                        r.compute_s = time.perf_counter() - start
                        r.optimizer_steps = 0
                        return r  # nothing applied: the batch is skipped
                    log.warning(
                        "a later optimizer step on the batch was not finite: the batch's steps end here",
                        step=step,
                        optimizer_steps=len(results),
                        loss=r.loss,
                        grad_norm=r.grad_norm,
                    )
                    return _combine(results, batch, time.perf_counter() - start)
                self.apply()
                results.append(r)
        return _combine(results, batch, time.perf_counter() - start)

    def apply(self) -> None:
        """The optimizer step (in shared mode: while the inference server is paused)."""
        self.ranks.command(Apply())
        self.apply_local()

    def apply_local(self) -> None:
        """This rank's optimizer step (rank 0 told the others in apply). A checkpoint being written
        from the live weights has read them first (``fence``, set by the checkpointer)."""
        if self.fence is not None:
            self.fence()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def discard(self) -> None:
        """Drop this step's gradients: weights, optimizer and scheduler untouched."""
        self.ranks.command(Discard())
        self.discard_local()

    def discard_local(self) -> None:
        """This rank's gradients dropped (rank 0 told the others in discard)."""
        self.optimizer.zero_grad(set_to_none=True)

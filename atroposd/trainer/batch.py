"""From the API's batch (a list of scored groups, ATROPOS-PROTOCOL.md §1.1) to padded tensors.

Conventions of the wire format: ``tokens`` holds prompt + completion, ``masks`` holds -100 at
prompt positions and the token id at completion positions, ``inference_logprobs`` is aligned
with ``tokens`` with the sentinel 1.0 at masked positions (and sometimes, as padding, at
unmasked ones). Position t of the model's input predicts token t+1, so labels, rollout
logprobs, per-token advantages and teacher top-k are all shifted by one.

Advantages, per group (SPEC §3): ``(score − mean) / max(std, adv_std_floor)``, population
std; equal scores give exactly 0. A **group of one sequence has no baseline**: its advantage
is 0 (it still contributes its KL term) — unlike the predecessor, which used the raw reward.
Per-token ``advantages`` sent by the environment replace the computed ones;
``overrides[i].set_advantage_to_zero`` forces 0. A group with a non-finite score, or whose
fields disagree in length, is rejected (counted in ``rejected``), never trained on.

A rollout logprob that is missing (no ``inference_logprobs``, or the 1.0 sentinel at a
completion position — a log-probability is never positive) is NaN in ``old_logp``; the loss
then uses the current policy's own (detached) logprob there: ratio 1, on-policy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

__all__ = ["BatchError", "MicroBatch", "RolloutBatch", "SequenceRow", "group_advantages", "prepare_batch"]

IGNORE = -100

log = structlog.get_logger("trainer", component="trainer")  # lazy: bound at first use


class BatchError(ValueError):
    """A batch that cannot be trained on (the message says why)."""


@dataclass
class SequenceRow:
    """One sequence, unpadded, already shifted (length L = len(tokens) − 1)."""

    input_ids: list[int]  # tokens[:-1]
    labels: list[int]  # tokens[1:]
    mask: list[bool]  # masks[1:] != -100
    old_logp: list[float]  # inference_logprobs[1:], NaN where missing
    advantages: list[float]  # per position
    temperature: float
    distill_ids: list[list[int]] | None = None  # [L][K], -1 = padding
    distill_lp: list[list[float]] | None = None  # [L][K]


@dataclass
class MicroBatch:
    """One forward/backward pass, right-padded to its own longest row.

    input_ids:   [B, T] long, pad 0 (right padding needs no attention mask in a causal LM)
    labels:      [B, T] long, the next token (0 where not trained)
    mask:        [B, T] bool, completion positions (trained)
    old_logp:    [B, T] float32, rollout logprobs (NaN = missing)
    advantages:  [B, T] float32
    temperature: [B] float32
    distill_ids: [B, T, K] long (-1 = none) or None
    distill_lp:  [B, T, K] float32 or None
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    temperature: torch.Tensor
    distill_ids: torch.Tensor | None = None
    distill_lp: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> MicroBatch:
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return MicroBatch(*(mv(getattr(self, f)) for f in  # type: ignore[arg-type]
                            ("input_ids", "labels", "mask", "old_logp", "advantages", "temperature",
                             "distill_ids", "distill_lp")))


@dataclass
class RolloutBatch:
    """One optimizer step's data and what the metrics need about it."""

    micro: list[MicroBatch]
    sequences: int
    completion_tokens: int  # Σ mask over the batch: the loss denominator
    distill_positions: int  # positions with a teacher distribution: distill's denominator
    reward_mean: float
    reward_std: float
    accuracy: float | None  # mean of the groups' reported exact-match accuracy, when any
    weight_versions: list[int] = field(default_factory=list)  # per group that reported one
    rejected: int = 0  # groups dropped (non-finite scores, malformed, too long)
    missing_logprobs: int = 0  # completion tokens without a rollout logprob


def group_advantages(scores: Sequence[float], std_floor: float) -> list[float]:
    """(s − mean) / max(std, std_floor) per sequence; 0 for equal scores and for groups of one."""
    n = len(scores)
    if n < 2 or max(scores) == min(scores):
        return [0.0] * n
    mean = math.fsum(scores) / n
    std = math.sqrt(math.fsum((s - mean) ** 2 for s in scores) / n)
    return [(s - mean) / max(std, std_floor) for s in scores]


def _temperature(group: Mapping[str, Any], i: int) -> float:
    """overrides[i].temperature > generation_params.temperature > group_overrides.temperature > 1."""
    for source in (_index(group.get("overrides"), i), group.get("generation_params"),
                   group.get("group_overrides")):
        if isinstance(source, Mapping) and source.get("temperature") is not None:
            t = float(source["temperature"])
            return t if t > 0 and math.isfinite(t) else 1.0
    return 1.0


def _index(seq: Any, i: int) -> Any:
    return seq[i] if isinstance(seq, list) and i < len(seq) else None


def _extension(group: Mapping[str, Any]) -> Mapping[str, Any]:
    ext = (group.get("group_overrides") or {}).get("atroposd") if isinstance(group.get("group_overrides"),
                                                                            Mapping) else None
    return ext if isinstance(ext, Mapping) else {}


def _rows_of_group(group: Mapping[str, Any], *, std_floor: float, max_token_len: int,
                   use_distill: bool) -> list[SequenceRow]:
    """The group's sequences as shifted rows; raises BatchError when the group is unusable."""
    tokens, masks, scores = group.get("tokens"), group.get("masks"), group.get("scores")
    if not isinstance(tokens, list) or not isinstance(masks, list) or not isinstance(scores, list):
        raise BatchError("group without tokens, masks and scores")
    if not (len(tokens) == len(masks) == len(scores)) or not tokens:
        raise BatchError(f"group has {len(tokens)} token lists, {len(masks)} masks, {len(scores)} scores")
    score_values = [float(s) for s in scores]
    if not all(math.isfinite(s) for s in score_values):
        raise BatchError(f"non-finite score in {score_values}")
    advs = group_advantages(score_values, std_floor)
    logprobs = group.get("inference_logprobs")
    env_advantages = group.get("advantages")
    d_ids = group.get("distill_token_ids") if use_distill else None
    d_lps = group.get("distill_logprobs") if use_distill else None
    rows = []
    for i, (tok, msk) in enumerate(zip(tokens, masks, strict=True)):
        if len(tok) != len(msk):
            raise BatchError(f"sequence {i}: {len(tok)} tokens but {len(msk)} mask entries")
        if len(tok) < 2:
            raise BatchError(f"sequence {i}: fewer than 2 tokens")
        if len(tok) > max_token_len:
            raise BatchError(f"sequence {i}: {len(tok)} tokens > trainer.max_token_len {max_token_len}")
        lp = _index(logprobs, i)
        if lp is not None and len(lp) != len(tok):
            raise BatchError(f"sequence {i}: {len(lp)} inference_logprobs for {len(tok)} tokens")
        mask = [m != IGNORE for m in msk[1:]]
        old = [float(x) if (lp is not None and x is not None and x <= 0.0) else math.nan
               for x in (lp[1:] if lp is not None else [None] * (len(tok) - 1))]
        over = _index(group.get("overrides"), i)
        zero = isinstance(over, Mapping) and bool(over.get("set_advantage_to_zero"))
        env_adv = _index(env_advantages, i)
        if zero:
            adv = [0.0] * (len(tok) - 1)
        elif isinstance(env_adv, list) and len(env_adv) == len(tok):
            adv = [float(a) for a in env_adv[1:]]
            if not all(math.isfinite(a) for a in adv):
                raise BatchError(f"sequence {i}: non-finite advantages")
        elif isinstance(env_adv, (int, float)) and not isinstance(env_adv, bool):
            adv = [float(env_adv)] * (len(tok) - 1)
        else:
            adv = [advs[i]] * (len(tok) - 1)
        row = SequenceRow(input_ids=[int(t) for t in tok[:-1]], labels=[int(t) for t in tok[1:]], mask=mask,
                          old_logp=old, advantages=adv, temperature=_temperature(group, i))
        ids_i, lps_i = _index(d_ids, i), _index(d_lps, i)
        if isinstance(ids_i, list) and isinstance(lps_i, list):
            if len(ids_i) != len(tok) or len(lps_i) != len(tok):
                raise BatchError(f"sequence {i}: distill_token_ids/distill_logprobs not aligned with tokens")
            # Entry t is the teacher's top-k for token t: the input position t-1 predicts it.
            row.distill_ids = [[int(x) for x in (e or [])] for e in ids_i[1:]]
            row.distill_lp = [[float(x) for x in (e or [])] for e in lps_i[1:]]
        rows.append(row)
    return rows


def _pad(rows: Sequence[SequenceRow]) -> MicroBatch:
    # Padded Python lists, then one tensor per field: far cheaper than per-row tensor writes.
    t = max(len(r.input_ids) for r in rows)

    def padded(values: Sequence[Any], fill: Any) -> list[Any]:
        return list(values) + [fill] * (t - len(values))

    input_ids = torch.tensor([padded(r.input_ids, 0) for r in rows], dtype=torch.long)  # [B, T]
    labels = torch.tensor([padded(r.labels, 0) for r in rows], dtype=torch.long)  # [B, T]
    mask = torch.tensor([padded(r.mask, False) for r in rows], dtype=torch.bool)  # [B, T]
    old = torch.tensor([padded(r.old_logp, math.nan) for r in rows], dtype=torch.float32)  # [B, T]
    adv = torch.tensor([padded(r.advantages, 0.0) for r in rows], dtype=torch.float32)  # [B, T]
    temp = torch.tensor([r.temperature for r in rows], dtype=torch.float32)  # [B]
    k = max((len(e) for r in rows if r.distill_ids for e in r.distill_ids), default=0)
    d_ids = d_lp = None
    if k:
        d_ids = torch.full((len(rows), t, k), -1, dtype=torch.long)  # [B, T, K]
        d_lp = torch.full((len(rows), t, k), -1e9, dtype=torch.float32)  # [B, T, K]
        for i, r in enumerate(rows):
            if not (r.distill_ids and r.distill_lp):
                continue
            for pos, (ids, lps) in enumerate(zip(r.distill_ids, r.distill_lp, strict=False)):
                if ids and r.mask[pos]:
                    d_ids[i, pos, :len(ids)] = torch.tensor(ids)
                    d_lp[i, pos, :len(lps)] = torch.tensor(lps)
    return MicroBatch(input_ids, labels, mask, old, adv, temp, d_ids, d_lp)


def prepare_batch(groups: Sequence[Mapping[str, Any]], *, micro_batch_size: int, max_token_len: int,
                  adv_std_floor: float, use_distill: bool = False) -> RolloutBatch:
    """Validate the groups, compute advantages and pad into micro-batches of ≤ micro_batch_size."""

    rows: list[SequenceRow] = []
    scores: list[float] = []
    accuracies: list[float] = []
    versions: list[int] = []
    rejected = 0
    for gi, group in enumerate(groups):
        try:
            group_rows = _rows_of_group(group, std_floor=adv_std_floor, max_token_len=max_token_len,
                                        use_distill=use_distill)
        except (BatchError, TypeError, ValueError) as exc:
            rejected += 1
            log.warning("group rejected", group=gi, reason=str(exc))
            continue
        rows.extend(group_rows)
        scores.extend(float(s) for s in group["scores"])
        ext = _extension(group)
        if isinstance(ext.get("accuracy"), (int, float)):
            accuracies.append(float(ext["accuracy"]))
        if isinstance(ext.get("weight_version"), int):
            versions.append(int(ext["weight_version"]))
    if not rows:
        raise BatchError(f"no usable sequence in the batch ({rejected} group(s) rejected)")
    micro = [_pad(rows[i:i + micro_batch_size]) for i in range(0, len(rows), micro_batch_size)]
    completion = int(sum(int(m.mask.sum()) for m in micro))
    missing = int(sum(int((m.mask & m.old_logp.isnan()).sum()) for m in micro))
    distill_positions = sum(int((m.distill_ids >= 0).any(-1).sum()) for m in micro if m.distill_ids is not None)
    mean = math.fsum(scores) / len(scores)
    std = math.sqrt(math.fsum((s - mean) ** 2 for s in scores) / len(scores))
    return RolloutBatch(micro=micro, sequences=len(rows), completion_tokens=completion,
                        distill_positions=distill_positions, reward_mean=mean, reward_std=std,
                        accuracy=(math.fsum(accuracies) / len(accuracies)) if accuracies else None,
                        weight_versions=versions, rejected=rejected, missing_logprobs=missing)

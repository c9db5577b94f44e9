"""From the API's batch (a list of scored groups, ATROPOS-PROTOCOL.md §1.1) to padded tensors.

Conventions of the wire format: ``tokens`` holds prompt + completion, ``masks`` holds -100 at
prompt positions and the token id at completion positions, ``inference_logprobs`` is aligned
with ``tokens`` with the sentinel 1.0 at masked positions (and sometimes, as padding, at
unmasked ones). Position t of the model's input predicts token t+1, so labels, rollout
logprobs, per-token advantages and teacher top-k are all shifted by one.

Advantages, per group (SPEC §3, §14 ``advantage``): ``group-std`` ``(score − mean) /
max(std, adv_std_floor)``, population std; ``group-mean`` ``score − mean`` (Dr.GRPO);
``rloo`` ``score − mean of the others`` (RLOO). Equal scores give exactly 0. A **group of one
sequence has no baseline**: its advantage is 0 (it still contributes its KL term) — unlike the
predecessor, which used the raw reward. Per-token ``advantages`` sent by the environment
replace the computed ones, whatever ``advantage`` says; ``overrides[i].set_advantage_to_zero``
forces 0. With ``overlong = "mask"`` a completion the group reports as truncated
(``finish_reason = "length"`` in ``overrides[i]`` or ``group_overrides``) trains no token.

**A bad group is rejected, never the job failed** (SPEC §13): each group is checked before it
is used, and a group that fails a check is dropped and counted by reason (``REASONS``) —
token ids outside ``[0, vocab_size)``, distillation ids outside ``[-1, vocab_size)`` or more
than ``MAX_DISTILL_K`` of them at a position, non-finite, positive or absurd teacher logprobs, non-finite or
absurd scores (|s| > 1e15) and advantages (|A| > 1e4), rollout logprobs below −1e4, fields
of the wrong type or of disagreeing lengths, sequences longer than ``max_token_len``. Any
other exception from one group's preparation is a rejection too (reason ``error``). What
passes the checks pads into tensors without error and gives a finite loss.

The group's shape is checked by the schema the API checked it with (:mod:`atroposd.groups`:
the fields present and of their types, equal row lengths, one finite score per sequence, the
distillation fields' shape and top-k bound), with the same messages naming the same field;
the trainer's own checks (vocabulary, magnitudes, at least two tokens) follow. A group the
schema refuses is ``malformed``, or ``score_invalid`` / ``distill_invalid`` / ``too_long``
where the schema names that defect.

A rollout logprob that is missing (no ``inference_logprobs``, or the 1.0 sentinel at a
completion position — a log-probability is never positive) is NaN in ``old_logp``; the loss
then uses the current policy's own (detached) logprob there: ratio 1, on-policy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np
import structlog
import torch

from atroposd.groupext import extension, version_records
from atroposd.groups import DISTILL, MAX_DISTILL_K, Group, SchemaError, check_distill_values, group_from_json

__all__ = [
    "ADVANTAGES",
    "MAX_DISTILL_K",
    "REASONS",
    "BatchError",
    "GroupRejected",
    "MicroBatch",
    "RolloutBatch",
    "SequenceRow",
    "group_advantages",
    "is_truncated",
    "pack_rows",
    "prepare_batch",
    "rows_of_group",
    "typed_group",
]

ADVANTAGES = ("group-std", "group-mean", "rloo")

IGNORE = -100
MAX_ABS_ADVANTAGE = 1e4  # SPEC §13: a larger advantage is absurd
MAX_ABS_SCORE = 1e15  # beyond this, float64 sums of scores lose unit precision (and squares overflow)
MIN_LOGPROB = -1e4  # a sampled token is never this unlikely: a lower rollout logprob is garbage
# A teacher's top-k logprob: at most 0 (a little above for rounding), and within float32's range.
MIN_TEACHER_LOGPROB, MAX_TEACHER_LOGPROB = -1e30, 1e-3
# A temperature outside [MIN, MAX] is treated like an invalid one (≤ 0, non-finite): 1.0. Below
# MIN a sampler is greedy (vLLM's epsilon); above MAX the distribution is uniform in float32.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-5, 1e4

LOGGED_PER_BATCH = 3  # rejections logged one by one per batch; the rest in one line with the counts

# Why a group was rejected (the keys of ``rejected_groups``).
REASONS = (
    "malformed",
    "too_long",
    "token_out_of_range",
    "score_invalid",
    "advantage_invalid",
    "logprob_invalid",
    "distill_invalid",
    "weight_versions",
    "error",
)

T = TypeVar("T")

log = structlog.get_logger("trainer", component="trainer")  # lazy: bound at first use


class BatchError(ValueError):
    """A batch that cannot be trained on (the message says why); ``rejected``: by reason."""

    def __init__(self, message: str, rejected: Mapping[str, int] | None = None) -> None:
        super().__init__(message)
        self.rejected = dict(rejected or {})


class GroupRejected(ValueError):
    """One group that cannot be trained on: ``reason`` is one of ``REASONS``, ``field`` the
    group's field at fault (None: the group as a whole)."""

    def __init__(self, reason: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.field = field


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
    """One forward/backward pass, right-padded to its own longest row (or one packed row).

    input_ids:   [B, T] long, pad 0 (right padding needs no attention mask in a causal LM)
    labels:      [B, T] long, the next token (0 where not trained)
    mask:        [B, T] bool, completion positions (trained)
    old_logp:    [B, T] float32, rollout logprobs (NaN = missing)
    advantages:  [B, T] float32
    temperature: [B] float32 (one per sequence)
    distill_ids: [B, T, K] long (-1 = none) or None
    distill_lp:  [B, T, K] float32 or None
    loss_weight: [B, T] float32, ``loss_agg``'s weight of each trained token (set by the
                 objective over the whole batch), or None: Σ loss / the batch's token count
    seq_lens:    None for padded rows (one sequence per row); for a packed micro-batch
                 (``micro_batch_tokens``) [S] long, the lengths of the S sequences laid end to end
                 in its one row (B = 1, T = Σ seq_lens, no padding); ``temperature`` is then [S]
    flat_index:  several optimizer steps per batch (SPEC §14): [B, T] long, each position's place
                 in the batch's flat positions (:meth:`RolloutBatch.flat_size`; -1 = padding), or None
    policy_old:  several optimizer steps per batch: [B, T] float32, π_old — the trainer's own
                 logprobs before the batch's first update (NaN = not known yet), or None
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    temperature: torch.Tensor
    distill_ids: torch.Tensor | None = None
    distill_lp: torch.Tensor | None = None
    loss_weight: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    flat_index: torch.Tensor | None = None
    policy_old: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        """Sequences in this micro-batch: its rows, or the packed row's sequences."""
        return int(self.mask.shape[0]) if self.seq_lens is None else int(self.seq_lens.numel())

    def sequence_ids(self) -> torch.Tensor:
        """[B, T] long: each position's sequence in [0, num_sequences) — its row when padded, its
        place in the packed row when packed."""
        b, t = self.mask.shape
        if self.seq_lens is None:
            return torch.arange(b, device=self.mask.device)[:, None].expand(b, t)
        ids = torch.arange(len(self.seq_lens), device=self.mask.device)
        return torch.repeat_interleave(ids, self.seq_lens.to(self.mask.device))[None, :]

    def to(self, device: torch.device | str) -> MicroBatch:
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return MicroBatch(
            *(
                mv(getattr(self, f))
                for f in (  # type: ignore[arg-type]
                    "input_ids",
                    "labels",
                    "mask",
                    "old_logp",
                    "advantages",
                    "temperature",
                    "distill_ids",
                    "distill_lp",
                    "loss_weight",
                    "seq_lens",
                    "flat_index",
                    "policy_old",
                )
            )
        )


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
    # trained completion tokens sampled after a weight swap (groups carrying weight_versions, SPEC §7)
    swapped_tokens: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)  # groups dropped, by reason
    missing_logprobs: int = 0  # completion tokens without a rollout logprob
    trained_sequences: int = 0  # sequences with at least one trained token
    reward_mean_trained: float | None = None  # over the trained groups (reward_mean: every received)
    filtered_groups: int = 0  # groups received for this step and dropped by filter_groups
    truncated: int = 0  # sequences reported truncated (finish_reason = "length")
    # several optimizer steps per batch (``prepare_batch(keep_rows=True)``): the sequences and,
    # per trained group, the indices of its rows — what mini-batches are formed from
    rows: list[SequenceRow] = field(default_factory=list)
    group_rows: list[list[int]] = field(default_factory=list)

    @property
    def rejected(self) -> int:
        return sum(self.rejected_by_reason.values())

    @property
    def groups(self) -> int:
        """Trained groups (kept rows only)."""
        return len(self.group_rows)

    def flat_size(self) -> int:
        """Positions of the batch's rows laid end to end (the flat buffers of π_old and advantages)."""
        return sum(len(r.input_ids) for r in self.rows)

    def mini_batch(
        self,
        groups: Sequence[int],
        *,
        micro_batch_size: int,
        micro_batch_tokens: int = 0,
        advantages: torch.Tensor | None = None,
        policy_old: torch.Tensor | None = None,
    ) -> RolloutBatch:
        """The batch of the groups ``groups`` (indices into ``group_rows``), in that order, as
        micro-batches formed like :func:`prepare_batch`'s, each with its ``flat_index``;
        ``advantages`` / ``policy_old`` [flat_size()] replace the rows' advantages / give π_old.
        Counts are the mini-batch's own (its loss is normalised over itself); the rewards and
        accuracy are the whole batch's."""
        offsets = [0]
        for r in self.rows:
            offsets.append(offsets[-1] + len(r.input_ids))
        sel = [i for g in groups for i in self.group_rows[g]]
        rows = [self.rows[i] for i in sel]
        if micro_batch_tokens > 0:
            bins = [[sel[j] for j in b] for b in pack_rows([len(r.input_ids) for r in rows], micro_batch_tokens)]
            micro = [_pack([self.rows[i] for i in b]) for b in bins]
            for mb, b in zip(micro, bins, strict=True):
                mb.flat_index = torch.cat([torch.arange(offsets[i], offsets[i + 1], dtype=torch.long) for i in b])[
                    None, :
                ]  # [1, T]
        else:
            bins = [sel[i : i + micro_batch_size] for i in range(0, len(sel), micro_batch_size)]
            micro = [_pad([self.rows[i] for i in b]) for b in bins]
            for mb, b in zip(micro, bins, strict=True):
                index = torch.full(mb.mask.shape, -1, dtype=torch.long)  # [B, T]
                for row, i in enumerate(b):
                    index[row, : offsets[i + 1] - offsets[i]] = torch.arange(offsets[i], offsets[i + 1])
                mb.flat_index = index
        for mb in micro:
            assert mb.flat_index is not None
            index = mb.flat_index
            valid = index >= 0
            at = index.clamp(min=0)
            if advantages is not None:
                mb.advantages = torch.where(valid, advantages[at], torch.zeros((), dtype=advantages.dtype))
            if policy_old is not None:
                mb.policy_old = torch.where(valid, policy_old[at], torch.full((), math.nan)).to(torch.float32)
        return RolloutBatch(
            micro=micro,
            sequences=len(rows),
            completion_tokens=int(sum(int(m.mask.sum()) for m in micro)),
            distill_positions=sum(int((m.distill_ids >= 0).any(-1).sum()) for m in micro if m.distill_ids is not None),
            reward_mean=self.reward_mean,
            reward_std=self.reward_std,
            accuracy=self.accuracy,
            weight_versions=self.weight_versions,
            missing_logprobs=int(sum(int((m.mask & m.old_logp.isnan()).sum()) for m in micro)),
            trained_sequences=sum(any(r.mask) for r in rows),
            reward_mean_trained=self.reward_mean_trained,
        )


def group_advantages(scores: Sequence[float], std_floor: float, mode: str = "group-std") -> list[float]:
    """One advantage per sequence of a group; 0 for equal scores and for groups of one.

    * ``group-std``: (s − mean) / max(std, std_floor), population std (GRPO; today's);
    * ``group-mean``: s − mean (Dr.GRPO: no std, no difficulty bias);
    * ``rloo``: s − mean of the other n − 1 scores (RLOO, Ahmadian et al. 2024; TRL, verl).
    """
    n = len(scores)
    if n < 2 or max(scores) == min(scores):
        return [0.0] * n
    total = math.fsum(scores)
    mean = total / n
    if mode == "group-mean":
        return [s - mean for s in scores]
    if mode == "rloo":
        return [s - (total - s) / (n - 1) for s in scores]
    if mode != "group-std":
        raise ValueError(f"unknown advantage {mode!r}")
    std = math.sqrt(math.fsum((s - mean) ** 2 for s in scores) / n)
    return [(s - mean) / max(std, std_floor) for s in scores]


def is_truncated(group: Mapping[str, Any], i: int) -> bool:
    """Whether sequence ``i`` is reported truncated: ``finish_reason = "length"`` in
    ``overrides[i]``, else in ``group_overrides``."""
    for source in (_index(group.get("overrides"), i), group.get("group_overrides")):
        if isinstance(source, Mapping) and source.get("finish_reason") is not None:
            return source.get("finish_reason") == "length"
    return False


def _truncated(group: Mapping[str, Any], n: int) -> int:
    """How many of the group's ``n`` sequences are reported truncated (:func:`is_truncated`)."""
    if group.get("overrides") is None and group.get("group_overrides") is None:
        return 0
    return sum(is_truncated(group, i) for i in range(n))


def _temperatures(group: Mapping[str, Any], n: int) -> list[float]:
    """Per sequence: overrides[i].temperature > generation_params.temperature >
    group_overrides.temperature > 1."""
    overrides = group.get("overrides")
    shared: list[float] = []  # the group's own temperature, once it is needed

    def group_temperature() -> float:
        if not shared:
            shared.append(_temperature_of((group.get("generation_params"), group.get("group_overrides"))))
        return shared[0]

    if not isinstance(overrides, list):
        return [group_temperature()] * n
    out = []
    for i in range(n):
        over = _index(overrides, i)
        if isinstance(over, Mapping) and over.get("temperature") is not None:
            out.append(_temperature_of((over,)))
        else:
            out.append(group_temperature())
    return out


def _temperature_of(sources: tuple[object, ...]) -> float:
    """The first temperature given in ``sources`` (mappings), within bounds (else 1.0); 1.0 when none."""
    for source in sources:
        if isinstance(source, Mapping) and source.get("temperature") is not None:
            t = _number(source["temperature"], "malformed", "temperature")
            return t if MIN_TEMPERATURE <= t <= MAX_TEMPERATURE else 1.0
    return 1.0


def _index(seq: object, i: int) -> object:
    return seq[i] if isinstance(seq, list) and i < len(seq) else None


def _number(x: object, reason: str, what: str) -> float:
    """``x`` as a float: an int or a float (not a bool, not a string), else rejected."""
    if type(x) is float:
        return x
    if type(x) is int:
        try:
            return float(x)
        except OverflowError:
            raise GroupRejected(reason, f"{what}: {x} is too large") from None
    raise GroupRejected("malformed", f"{what}: {type(x).__name__} is not a number")


def _ids(values: object, vocab_size: int | None, what: str, *, low: int = 0, field: str | None = None) -> list[int]:
    """A list of int token ids in ``[low, vocab_size)`` (``[low, 2**31)`` without a vocabulary)."""
    if not isinstance(values, list) or not all(type(v) is int for v in values):
        raise GroupRejected("malformed", f"{what} is not a list of integers", field)
    high = vocab_size if vocab_size is not None else 2**31
    if values and (min(values) < low or max(values) >= high):
        bad = next(v for v in values if v < low or v >= high)
        reason = "distill_invalid" if low < 0 else "token_out_of_range"
        raise GroupRejected(reason, f"{what}: id {bad} outside [{low}, {vocab_size})", field)
    return values


def _list(x: object, n: int, what: str, field: str | None = None) -> list[object]:
    if not isinstance(x, list) or len(x) != n:
        raise GroupRejected("malformed", f"{what}: expected a list of {n} entries", field)
    return x


# The trainer's reason for a group the shared schema refuses (by the schema's reason); any other: malformed.
_SCHEMA_REASONS = {"non_finite_score": "score_invalid", "distill_invalid": "distill_invalid", "too_long": "too_long"}
# What the trainer reads through the schema besides tokens, masks and scores. ``advantages`` is
# read on its own: the trainer also takes one number per sequence there (an atroposd extension),
# and ``overrides``, ``generation_params`` and ``group_overrides`` are passthrough JSON to the
# schema, read leniently where they are used.
_TRAINED_FIELDS = ("inference_logprobs",)


def typed_group(group: object, *, use_distill: bool = False) -> Group:
    """``group`` checked by the schema the API checked it with (:func:`atroposd.groups.group_from_json`)
    and in its typed form; GroupRejected (the trainer's reason, the schema's message and field)
    when the schema refuses it. The distillation fields are checked when ``use_distill``."""
    if not isinstance(group, Mapping):
        raise GroupRejected("malformed", f"a group is an object, not {type(group).__name__}")
    try:
        typed = group_from_json(group, fields=_TRAINED_FIELDS)
        if use_distill:
            given = {name: group[name] for name in DISTILL if group.get(name) is not None}
            if given:
                check_distill_values(given, typed.tokens.lengths())
    except SchemaError as exc:
        raise GroupRejected(_SCHEMA_REASONS.get(exc.reason, "malformed"), str(exc), exc.field) from None
    return typed


def rows_of_group(
    group: object,
    *,
    std_floor: float,
    max_token_len: int,
    use_distill: bool,
    vocab_size: int | None = None,
    advantage: str = "group-std",
    mask_truncated: bool = False,
) -> list[SequenceRow]:
    """The group's sequences as shifted rows; raises GroupRejected when the group is unusable:
    first the schema's checks (:func:`typed_group`), then the trainer's own (vocabulary, bounds
    on scores, advantages, logprobs and teacher logprobs, at least two tokens a sequence)."""
    # A sequence longer than the trainer takes is too_long whatever else is wrong with it.
    sequences = group.get("tokens") if isinstance(group, Mapping) else None
    for i, tok in enumerate(sequences if isinstance(sequences, list) else ()):
        if isinstance(tok, list) and len(tok) > max_token_len:
            raise GroupRejected(
                "too_long", f"sequence {i}: {len(tok)} tokens > trainer.max_token_len {max_token_len}", "tokens"
            )
    typed = typed_group(group, use_distill=use_distill)
    assert isinstance(group, Mapping)  # typed_group said so
    bounds = typed.tokens.bounds
    n = typed.n
    for i in range(n):
        if bounds[i + 1] - bounds[i] < 2:
            raise GroupRejected("malformed", f"sequence {i}: fewer than 2 tokens", "tokens")
    flat = typed.tokens.flat
    high = vocab_size if vocab_size is not None else 2**31
    out = (flat < 0) | (flat >= high)
    if out.any():
        at = int(np.argmax(out))
        i = int(np.searchsorted(bounds, at, side="right")) - 1
        raise GroupRejected(
            "token_out_of_range", f"sequence {i}: tokens: id {int(flat[at])} outside [0, {vocab_size})", "tokens"
        )
    scores = typed.scores
    if float(np.abs(scores).max()) > MAX_ABS_SCORE:
        raise GroupRejected(
            "score_invalid", f"non-finite or absurd (|s| > {MAX_ABS_SCORE:g}) score in {scores[:8].tolist()}", "scores"
        )
    advs = group_advantages(scores.tolist(), std_floor, advantage)
    tokens = flat.tolist()
    masks = (typed.masks.flat != IGNORE).tolist()
    logprobs: list[float] | None = None
    if typed.logprobs is not None:
        lp = typed.logprobs.flat
        low = lp < MIN_LOGPROB  # NaN is not: it is a missing logprob
        low[bounds[:-1]] = False  # a sequence's first entry predicts nothing
        if low.any():
            i = int(np.searchsorted(bounds, int(np.argmax(low)), side="right")) - 1
            raise GroupRejected(
                "logprob_invalid", f"sequence {i}: a rollout logprob < {MIN_LOGPROB:g}", "inference_logprobs"
            )
        # missing: the 1.0 sentinel (a log-probability is never positive), NaN, +inf
        logprobs = np.where(lp <= 0.0, lp, math.nan).tolist()
    env_advantages = group.get("advantages")
    overrides = group.get("overrides")
    d_ids = group.get("distill_token_ids") if use_distill else None
    d_lps = group.get("distill_logprobs") if use_distill else None
    for name, value in (("advantages", env_advantages), ("overrides", overrides)):
        if value is not None and not isinstance(value, list):
            raise GroupRejected("malformed", f"{name} is not a list", name)
    distilled = d_ids is not None or d_lps is not None
    rows = []
    for i in range(n):
        a, b = bounds[i], bounds[i + 1]
        length = b - a
        mask = masks[a + 1 : b]
        if mask_truncated and is_truncated(group, i):
            mask = [False] * (length - 1)  # a truncated completion carries no loss (DAPO's overlong masking)
        old = logprobs[a + 1 : b] if logprobs is not None else [math.nan] * (length - 1)
        over = _index(overrides, i) if overrides is not None else None
        zero = over is not None and isinstance(over, Mapping) and bool(over.get("set_advantage_to_zero"))
        env_adv = _index(env_advantages, i) if env_advantages is not None else None
        if zero:
            adv = [0.0] * (length - 1)
        elif isinstance(env_adv, list):
            values = _list(env_adv, length, f"sequence {i}: advantages", "advantages")[1:]
            if all(type(a) is float for a in values):  # the usual case needs no conversion
                adv = cast("list[float]", values)
            else:
                adv = [_number(a, "advantage_invalid", f"sequence {i}: advantages") for a in values]
        elif env_adv is not None:
            adv = [_number(env_adv, "advantage_invalid", f"sequence {i}: advantage")] * (length - 1)
        else:
            adv = [advs[i]] * (length - 1)
        if not (abs(adv[0]) <= MAX_ABS_ADVANTAGE if env_adv is None else all(abs(a) <= MAX_ABS_ADVANTAGE for a in adv)):
            raise GroupRejected(
                "advantage_invalid",
                f"sequence {i}: non-finite or absurd advantage (|A| > {MAX_ABS_ADVANTAGE:g})",
                "advantages",
            )
        tok = tokens[a:b]
        row = SequenceRow(
            input_ids=tok[:-1],
            labels=tok[1:],
            mask=mask,
            old_logp=old,
            advantages=adv,
            temperature=1.0,  # below
        )
        if distilled:
            ids_i, lps_i = _index(d_ids, i), _index(d_lps, i)
            if ids_i is not None or lps_i is not None:
                row.distill_ids, row.distill_lp = _distill_rows(ids_i, lps_i, length, vocab_size, i)
        rows.append(row)
    for row, t in zip(rows, _temperatures(group, n), strict=True):
        row.temperature = t
    return rows


def _distill_rows(
    ids_i: object, lps_i: object, length: int, vocab_size: int | None, i: int
) -> tuple[list[list[int]], list[list[float]]]:
    """The teacher's top-k of one sequence, shifted: ids in [-1, vocab) (-1 = padding), logprobs
    within a log-probability's range (their shape the schema checked: :func:`typed_group`)."""
    what = f"sequence {i}: distill_token_ids/distill_logprobs"
    ids_i, lps_i = _list(ids_i, length, what, DISTILL[0]), _list(lps_i, length, what, DISTILL[1])
    out_ids: list[list[int]] = []
    out_lps: list[list[float]] = []
    # Entry t is the teacher's top-k for token t: the input position t-1 predicts it.
    for e_ids, e_lps in zip(ids_i[1:], lps_i[1:], strict=True):
        ids = _ids(e_ids or [], vocab_size, what, low=-1, field=DISTILL[0])
        lps = [_number(x, "distill_invalid", what) for x in _list(e_lps or [], len(ids), what, DISTILL[1])]
        # A log-probability is never positive, and one beyond float32's range (3.5e38) would
        # become infinite in the tensor: both are garbage, not a teacher's output.
        if not all(
            math.isfinite(x) and MIN_TEACHER_LOGPROB <= x <= MAX_TEACHER_LOGPROB
            for x, k in zip(lps, ids, strict=True)
            if k >= 0
        ):
            raise GroupRejected(
                "distill_invalid",
                f"{what}: non-finite, positive or absurd (< {MIN_TEACHER_LOGPROB:g}) teacher logprob",
                DISTILL[1],
            )
        out_ids.append(ids)
        out_lps.append([x if k >= 0 else -1e9 for x, k in zip(lps, ids, strict=True)])
    return out_ids, out_lps


def _pad(rows: Sequence[SequenceRow]) -> MicroBatch:
    # Padded Python lists, then one tensor per field: far cheaper than per-row tensor writes.
    t = max(len(r.input_ids) for r in rows)

    def padded(values: Sequence[T], fill: T) -> list[T]:
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
                    d_ids[i, pos, : len(ids)] = torch.tensor(ids)
                    d_lp[i, pos, : len(lps)] = torch.tensor(lps)
    return MicroBatch(input_ids, labels, mask, old, adv, temp, d_ids, d_lp)


def _pack(rows: Sequence[SequenceRow]) -> MicroBatch:
    """The rows laid end to end in one row (``MicroBatch.seq_lens``): no padding at all."""
    merged = SequenceRow(
        input_ids=[x for r in rows for x in r.input_ids],
        labels=[x for r in rows for x in r.labels],
        mask=[x for r in rows for x in r.mask],
        old_logp=[x for r in rows for x in r.old_logp],
        advantages=[x for r in rows for x in r.advantages],
        temperature=1.0,
    )
    if any(r.distill_ids for r in rows):
        merged.distill_ids = [x for r in rows for x in (r.distill_ids or [[]] * len(r.input_ids))]
        merged.distill_lp = [x for r in rows for x in (r.distill_lp or [[]] * len(r.input_ids))]
    mb = _pad([merged])
    mb.temperature = torch.tensor([r.temperature for r in rows], dtype=torch.float32)  # [S]
    mb.seq_lens = torch.tensor([len(r.input_ids) for r in rows], dtype=torch.long)  # [S]
    return mb


def pack_rows(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: the indices of ``lengths`` in bins of at most ``budget`` tokens, longest
    first (a length above the budget gets a bin of its own)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        n = lengths[i]
        for b, left in enumerate(room):
            if n <= left:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return bins


def prepare_batch(
    groups: Sequence[Any],
    *,
    micro_batch_size: int,
    max_token_len: int,
    adv_std_floor: float,
    use_distill: bool = False,
    vocab_size: int | None = None,
    micro_batch_tokens: int = 0,
    advantage: str = "group-std",
    overlong: str = "keep",
    filtered: Sequence[Any] = (),
    keep_rows: bool = False,
) -> RolloutBatch:
    """Validate the groups, compute advantages and pad into micro-batches of ≤ micro_batch_size.

    vocab_size: the model's vocabulary (token ids must be below it); None checks only ≥ 0.
    micro_batch_tokens: > 0 packs the sequences first-fit (longest first) into micro-batches of
    at most this many tokens, one row each (:func:`pack_rows`), instead of ``micro_batch_size``
    padded rows.
    advantage: ``group-std`` | ``group-mean`` | ``rloo`` (:func:`group_advantages`).
    overlong: ``keep`` | ``mask`` (a sequence reported truncated trains no token).
    filtered: groups received for this step but dropped by ``filter_groups`` (all scores equal):
    never trained, but their scores and accuracy count in ``reward_mean`` and ``accuracy``.
    keep_rows: keep the sequences and each group's rows in the batch (``RolloutBatch.mini_batch``:
    several optimizer steps per batch, SPEC §14).
    Raises BatchError (with the rejections by reason) when no group is usable.
    """

    rows: list[SequenceRow] = []
    scores: list[float] = []
    accuracies: list[float] = []
    versions: list[int] = []
    swapped = 0
    rejected: dict[str, int] = {}
    truncated = 0
    group_index: list[list[int]] = []  # each kept group's rows
    for gi, group in enumerate(groups):
        try:
            group_rows = rows_of_group(
                group,
                std_floor=adv_std_floor,
                max_token_len=max_token_len,
                use_distill=use_distill,
                vocab_size=vocab_size,
                advantage=advantage,
                mask_truncated=overlong == "mask",
            )
            ext = extension(group)
            acc, version = ext.get("accuracy"), ext.get("weight_version")
            try:
                records = version_records(group, len(group_rows))
            except ValueError as exc:
                raise GroupRejected("weight_versions", str(exc)) from None
        except GroupRejected as exc:
            rejected[exc.reason] = rejected.get(exc.reason, 0) + 1
            if sum(rejected.values()) <= LOGGED_PER_BATCH:
                log.warning("group rejected", group=gi, reason=exc.reason, detail=str(exc)[:300])
            continue
        except Exception as exc:  # one group's preparation never fails the job (SPEC §13)
            rejected["error"] = rejected.get("error", 0) + 1
            if sum(rejected.values()) <= LOGGED_PER_BATCH:
                log.warning(
                    "group rejected",
                    group=gi,
                    reason="error",
                    detail=f"{type(exc).__name__}: {exc}"[:300],
                    exc_info=True,
                )
            continue
        group_index.append(list(range(len(rows), len(rows) + len(group_rows))))
        rows.extend(group_rows)
        scores.extend(float(s) for s in group["scores"])
        truncated += _truncated(group, len(group_rows))
        if isinstance(acc, (int, float)) and not isinstance(acc, bool) and 0 <= acc <= 1:
            accuracies.append(float(acc))  # an accuracy: anything else is ignored
        if type(version) is int and 0 <= version < 2**53:
            versions.append(version)
        for row, record in zip(group_rows, records or (), strict=False):
            if len(record) > 1:  # its trained tokens from the first swap's index on
                swapped += max(0, sum(row.mask) - record[1][0])
    if sum(rejected.values()) > LOGGED_PER_BATCH:
        log.warning("groups rejected in this batch", by_reason=rejected, logged=LOGGED_PER_BATCH)
    trained_scores = list(scores)
    for group in filtered:  # dropped for all-equal scores: counted in reward_mean, never trained
        ext = extension(group)
        scores.extend(float(s) for s in group["scores"])
        acc = ext.get("accuracy")
        if isinstance(acc, (int, float)) and not isinstance(acc, bool) and 0 <= acc <= 1:
            accuracies.append(float(acc))
    if not rows:
        total = sum(rejected.values())
        raise BatchError(f"no usable sequence in the batch ({total} group(s) rejected: {rejected})", rejected)
    if overlong == "mask" and truncated and not any(any(r.mask) for r in rows):
        raise BatchError(
            f'every completion of the batch is truncated ({truncated} with finish_reason = "length") '
            'and trainer.overlong = "mask": no token to train',
            rejected,
        )
    if micro_batch_tokens > 0:
        micro = [_pack([rows[i] for i in b]) for b in pack_rows([len(r.input_ids) for r in rows], micro_batch_tokens)]
    else:
        micro = [_pad(rows[i : i + micro_batch_size]) for i in range(0, len(rows), micro_batch_size)]
    completion = int(sum(int(m.mask.sum()) for m in micro))
    missing = int(sum(int((m.mask & m.old_logp.isnan()).sum()) for m in micro))
    distill_positions = sum(int((m.distill_ids >= 0).any(-1).sum()) for m in micro if m.distill_ids is not None)
    mean = math.fsum(scores) / len(scores)
    std = math.sqrt(math.fsum((s - mean) ** 2 for s in scores) / len(scores))
    return RolloutBatch(
        micro=micro,
        sequences=len(rows),
        completion_tokens=completion,
        distill_positions=distill_positions,
        reward_mean=mean,
        reward_std=std,
        accuracy=(math.fsum(accuracies) / len(accuracies)) if accuracies else None,
        weight_versions=versions,
        swapped_tokens=swapped,
        rejected_by_reason=rejected,
        missing_logprobs=missing,
        trained_sequences=sum(any(r.mask) for r in rows),
        reward_mean_trained=math.fsum(trained_scores) / len(trained_scores),
        filtered_groups=len(filtered),
        truncated=truncated,
        rows=rows if keep_rows else [],
        group_rows=group_index if keep_rows else [],
    )

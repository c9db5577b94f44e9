"""Property-based checks of the trainer's batch preparation (SPEC §13: one group never ends a job).

Generated groups — valid ones, and ones with token ids outside the vocabulary or negative,
NaN/inf/huge scores and advantages, mismatched lengths, bad distillation ids, wrong types —
are prepared in batches. The properties: ``prepare_batch`` returns a batch or raises
``BatchError`` and nothing else; every group is either trained on or counted under one
reason; groups are judged independently of their neighbours; what is accepted pads into
in-range, finite tensors; and on the tiny model it gives a finite loss and gradient.

Case counts: ``CASES`` batches (about 5,000 groups, each also prepared alone) and
``LOSS_CASES`` batches through the model, drawn from the run's fuzz seed (fresh each run, printed; ``--fuzz-seed N``
replays it). The
module takes about 15 s on an idle 2-core machine, 20-30 s on a loaded one.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

from atroposd.trainer.batch import REASONS, BatchError, RolloutBatch, prepare_batch
from tests import fuzzseed

VOCAB = 22  # builtin:tiny
MAX_TOKEN_LEN = 16
CASES = 2000  # batches of 1-4 groups: about 5,000 groups per run
LOSS_CASES = 250  # batches also run through the tiny model's loss and backward

FUZZ = settings(
    max_examples=CASES,
    deadline=None,
    database=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Values of the wrong type, or of the right type and absurd.
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=3),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.lists(st.integers(-3, 30), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)
numbers = st.one_of(
    st.floats(-2.0, 2.0),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**80), 2**80),
    st.sampled_from([1e308, -1e308, 1e4, -1e4, 1e4 + 1, 1e15, 1e16, -0.0, 5e-324]),
)
good_ids = st.integers(0, VOCAB - 1)
bad_ids = st.one_of(st.integers(max_value=-1), st.integers(min_value=VOCAB), st.sampled_from([2**63, -(2**63) - 1]))


def _maybe(draw: st.DrawFn, valid: Any, bad: st.SearchStrategy[Any] = junk, p_bad: int = 12) -> Any:
    """``valid`` most of the time, else something drawn from ``bad``."""
    return draw(bad) if draw(st.integers(0, p_bad)) == 0 else valid


@st.composite
def sequence_fields(draw: st.DrawFn, length: int) -> dict[str, Any]:
    """One sequence's fields: the valid bulk from a drawn seed (cheap), the defects drawn."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    prompt = rng.randint(1, length - 1)
    tokens = [rng.randrange(VOCAB) for _ in range(length)]
    if draw(st.integers(0, 8)) == 0:
        tokens[rng.randrange(length)] = draw(bad_ids)
    masks = [-100] * prompt + tokens[prompt:]
    logprobs: list[Any] = [1.0] * prompt + [-rng.uniform(0.0, 8.0) for _ in range(length - prompt)]
    if draw(st.integers(0, 8)) == 0:
        logprobs[rng.randrange(length)] = draw(st.one_of(numbers, st.none(), junk))
    k = rng.randint(1, 3)
    d_ids: list[Any] = [
        None if rng.random() < 0.3 else [rng.randrange(-1, VOCAB) for _ in range(k)] for _ in range(length)
    ]
    if draw(st.integers(0, 6)) == 0:
        d_ids[rng.randrange(length)] = [draw(bad_ids)] * k
    d_lps: list[Any] = [None if e is None else [-rng.uniform(0.0, 10.0) for _ in range(k)] for e in d_ids]
    if draw(st.integers(0, 8)) == 0:
        d_lps[rng.randrange(length)] = draw(st.one_of(junk, st.lists(numbers, min_size=k, max_size=k)))
    adv: Any = None
    choice = draw(st.integers(0, 3))
    if choice == 1:
        adv = draw(numbers)
    elif choice == 2:
        adv = [rng.uniform(-3.0, 3.0) for _ in range(length)]
        if draw(st.integers(0, 4)) == 0:
            adv[rng.randrange(length)] = draw(numbers)
    elif choice == 3:
        adv = draw(st.lists(numbers, max_size=3))  # most likely the wrong length
    return {"tokens": tokens, "masks": masks, "logprobs": logprobs, "d_ids": d_ids, "d_lps": d_lps, "adv": adv}


@st.composite
def groups(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 40)) == 0:
        return draw(junk)  # not even an object
    size = draw(st.integers(1, 4))
    seqs = [draw(sequence_fields(draw(st.integers(2, MAX_TOKEN_LEN + 2)))) for _ in range(size)]
    group: dict[str, Any] = {
        "tokens": _maybe(draw, [s["tokens"] for s in seqs]),
        "masks": _maybe(draw, [s["masks"] for s in seqs]),
        "scores": _maybe(
            draw,
            [draw(st.sampled_from([0.0, 1.0, 0.5, -1, 2])) if draw(st.integers(0, 8)) else draw(numbers) for _ in seqs],
        ),
    }
    if draw(st.booleans()):
        group["inference_logprobs"] = _maybe(draw, [s["logprobs"] for s in seqs])
    if draw(st.integers(0, 3)) == 0:
        group["advantages"] = _maybe(draw, [s["adv"] for s in seqs])
    if draw(st.integers(0, 3)) == 0:
        group["distill_token_ids"] = _maybe(draw, [s["d_ids"] for s in seqs])
        group["distill_logprobs"] = _maybe(draw, [s["d_lps"] for s in seqs])
    if draw(st.integers(0, 3)) == 0:
        group["overrides"] = _maybe(
            draw,
            [
                {"temperature": draw(st.one_of(numbers, junk)), "set_advantage_to_zero": draw(st.booleans())}
                for _ in seqs
            ],
        )
    if draw(st.integers(0, 3)) == 0:
        group["generation_params"] = _maybe(draw, {"temperature": draw(st.one_of(st.floats(0.1, 2.0), numbers))})
    if draw(st.integers(0, 2)) == 0:
        group["group_overrides"] = _maybe(
            draw,
            {
                "atroposd": {
                    "weight_version": draw(st.one_of(st.integers(0, 5), st.integers(-(2**70), 2**70), junk)),
                    "accuracy": draw(st.one_of(numbers, junk)),
                }
            },
        )
    lists = sorted(k for k in group if isinstance(group[k], list))
    if lists and draw(st.integers(0, 10)) == 0:  # mismatched lengths at the group level
        victim = draw(st.sampled_from(lists))
        group[victim] = group[victim][:-1] if group[victim] else [1]
    return group


def _prepare(batch_groups: list[Any], use_distill: bool) -> RolloutBatch | BatchError:
    try:
        return prepare_batch(
            batch_groups,
            micro_batch_size=3,
            max_token_len=MAX_TOKEN_LEN,
            adv_std_floor=0.1,
            use_distill=use_distill,
            vocab_size=VOCAB,
        )
    except BatchError as exc:  # anything else fails the property
        return exc


def _check_batch(batch: RolloutBatch) -> None:
    assert batch.sequences == sum(m.input_ids.shape[0] for m in batch.micro)
    for m in batch.micro:
        assert int(m.input_ids.min()) >= 0 and int(m.input_ids.max()) < VOCAB
        assert int(m.labels.min()) >= 0 and int(m.labels.max()) < VOCAB
        assert torch.isfinite(m.advantages).all() and float(m.advantages.abs().max()) <= 1e4
        assert torch.isfinite(m.temperature).all() and bool((m.temperature > 0).all())
        assert not bool((m.old_logp < -1e4).any()) and not bool((m.old_logp > 0).any())
        if m.distill_ids is not None and m.distill_lp is not None:
            assert int(m.distill_ids.min()) >= -1 and int(m.distill_ids.max()) < VOCAB
            assert torch.isfinite(m.distill_lp[m.distill_ids >= 0]).all()
    assert math.isfinite(batch.reward_mean) and math.isfinite(batch.reward_std)
    assert batch.accuracy is None or 0.0 <= batch.accuracy <= 1.0


@pytest.mark.slow  # a whole job or a long search: run by .ci/run, not in the default run
@FUZZ
@seed(fuzzseed.SEED)
@given(batch_groups=st.lists(groups(), min_size=1, max_size=4), use_distill=st.booleans())
def test_generated_groups_are_trained_on_or_rejected_by_reason(batch_groups: list[Any], use_distill: bool) -> None:
    result = _prepare(batch_groups, use_distill)
    rejected = result.rejected if isinstance(result, BatchError) else result.rejected_by_reason
    assert set(rejected) <= set(REASONS), rejected
    # each group is judged alone: the batch is the sum of the groups prepared one by one
    alone = [_prepare([g], use_distill) for g in batch_groups]
    accepted = [r for r in alone if isinstance(r, RolloutBatch)]
    by_reason: dict[str, int] = {}
    for r in alone:
        if isinstance(r, BatchError):
            assert sum(r.rejected.values()) == 1, r.rejected
            for reason, n in r.rejected.items():
                by_reason[reason] = by_reason.get(reason, 0) + n
    assert rejected == by_reason
    for reason in by_reason:
        event(f"group rejected: {reason}")
    event(f"groups accepted: {len(accepted)} of {len(batch_groups)}")
    if isinstance(result, BatchError):
        assert not accepted
        return
    assert sum(b.sequences for b in accepted) == result.sequences
    assert result.rejected == len(batch_groups) - len(accepted)
    _check_batch(result)


@pytest.fixture(scope="module")
def fuzz_learner(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from atroposd.trainer.learner import Learner, make_strategies
    from atroposd.trainer.model import load_policy
    from atroposd.trainer.optim import build_optimizer, build_scheduler
    from tests.trainer.conftest import make_cfg

    cfg = make_cfg(tmp_path_factory.mktemp("fuzz"), tiny_dir, kl_coef=0.05, distill_coef=0.5)
    t = cfg.trainer
    policy = load_policy(tiny_dir, tiny_dir, device=torch.device("cpu"), dtype=torch.float32, need_reference=True)
    assert policy.vocab_size == VOCAB
    opt = build_optimizer(policy.trainable(), t)
    objective, reference = make_strategies(t)
    return Learner(
        policy,
        opt,
        build_scheduler(opt, t.warmup_steps),
        objective=objective,
        reference=reference,
        max_grad_norm=t.max_grad_norm,
        distill_coef=t.distill_coef,
    )


@settings(FUZZ, max_examples=LOSS_CASES)
@seed(fuzzseed.SEED)
@given(batch_groups=st.lists(groups(), min_size=1, max_size=3))
def test_accepted_groups_give_a_finite_loss_and_gradient(fuzz_learner: Any, batch_groups: list[Any]) -> None:
    result = _prepare(batch_groups, True)
    event("batch rejected" if isinstance(result, BatchError) else "batch trained")
    if isinstance(result, BatchError):
        return
    step = fuzz_learner.compute(result)
    fuzz_learner.discard()  # the weights stay as loaded: every case starts from the same model
    assert step.finite, (step.loss, step.grad_norm)

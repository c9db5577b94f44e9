"""Every objective of SPEC §14 on the real tiny model: the same batch split 1, 2 and 4 ways (and
packed) gives the same loss and gradients (float32, within 1e-5 relative by norm, as SPEC
§12.1 measures); and each choice changes the gradient of the default (it is wired, not ignored)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from atroposd.trainer.batch import RolloutBatch, prepare_batch
from atroposd.trainer.learner import Learner, make_strategies
from atroposd.trainer.model import load_policy, token_logprobs
from atroposd.trainer.optim import build_optimizer, build_scheduler
from tests.trainer.conftest import make_cfg, make_group

TOL = 1e-5  # SPEC §12.1: relative by norm, float32 on CPU

OBJECTIVES: dict[str, dict[str, Any]] = {
    "default": {},
    "gspo": {"loss": "gspo"},
    "clip-higher": {"clip_eps_high": 0.28},
    "seq-mean-token-mean": {"loss_agg": "seq-mean-token-mean"},
    "seq-mean-token-sum-norm": {"loss_agg": "seq-mean-token-sum-norm"},
    "group-mean": {"advantage": "group-mean"},
    "rloo": {"advantage": "rloo"},
    "overlong-mask": {"overlong": "mask"},
    "token-tis": {"rollout_correction": "token-tis"},
    "seq-tis": {"rollout_correction": "seq-tis", "rollout_correction_threshold": 1.5},
    "token-mis": {"rollout_correction": "token-mis"},
    "seq-mis": {"rollout_correction": "seq-mis", "rollout_correction_threshold": 1.5},
    "awsft-seq-mean": {"loss": "awsft", "loss_agg": "seq-mean-token-mean"},
    "gspo-rloo-sum-norm-tis": {
        "loss": "gspo",
        "advantage": "rloo",
        "loss_agg": "seq-mean-token-sum-norm",
        "rollout_correction": "token-tis",
        "clip_eps_high": 0.28,
    },
}


def _groups() -> list[dict[str, Any]]:
    """16 sequences of varied completion lengths; one group all equal, some truncated."""
    rng = random.Random(11)
    groups = [
        make_group(rng, size=4, completion_len=1 + i, scores=scores)
        for i, scores in enumerate(
            ([1.0, 0.0, 0.5, 0.25], [0.3, 0.3, 0.3, 0.3], [0.9, 0.1, 0.1, 0.4], [0.0, 1.0, 1.0, 0.0])
        )
    ]
    groups[0]["overrides"] = [{"finish_reason": "length"}, {"finish_reason": "stop"}, {}, {}]
    groups[2]["group_overrides"] = {**groups[2].get("group_overrides", {}), "finish_reason": "length"}
    # far off the trainer's logprobs (~ −3): ρ ≫ C in group 3, ρ ≪ 1/C in group 1
    for g, value in ((groups[3], -7.0), (groups[1], -0.01)):
        g["inference_logprobs"] = [[x if x == 1.0 else value for x in lp] for lp in g["inference_logprobs"]]
    return groups


@pytest.fixture(scope="module")
def policy(tiny_dir: Path) -> Any:
    return load_policy(
        tiny_dir, tiny_dir, device=torch.device("cpu"), dtype=torch.float32, lora=None, need_reference=True
    )


def _learner(policy: Any, tmp_path: Path, tiny_dir: Path, **trainer: Any) -> tuple[Learner, Any]:
    t = make_cfg(tmp_path, tiny_dir, **trainer).trainer
    opt = build_optimizer(policy.trainable(), t)
    objective, reference = make_strategies(t)
    return Learner(
        policy, opt, build_scheduler(opt, t.warmup_steps), objective=objective, reference=reference, max_grad_norm=1e9
    ), t


def _batch(t: Any, **split: int) -> RolloutBatch:
    return prepare_batch(
        _groups(),
        max_token_len=t.max_token_len,
        adv_std_floor=t.adv_std_floor,
        advantage=t.advantage,
        overlong=t.overlong,
        **{"micro_batch_size": 16, **split},
    )


def _run(learner: Learner, batch: RolloutBatch) -> tuple[float, torch.Tensor, Any]:
    r = learner.compute(batch)
    grads = torch.cat([p.grad.reshape(-1) for p in learner.params if p.grad is not None])
    learner.discard()
    return r.loss, grads, r


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(a.norm()), 1e-12))


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_micro_batch_split_and_packing_change_nothing(name: str, policy: Any, tiny_dir: Path, tmp_path: Path) -> None:
    learner, t = _learner(policy, tmp_path, tiny_dir, **OBJECTIVES[name])
    loss1, g1, r1 = _run(learner, _batch(t))
    assert g1.norm() > 0 and len(_batch(t).micro) == 1
    for split in ({"micro_batch_size": 8}, {"micro_batch_size": 4}, {"micro_batch_tokens": 64}):
        batch = _batch(t, **split)
        assert len(batch.micro) > 1
        loss, g, r = _run(learner, batch)
        assert abs(loss - loss1) <= TOL * max(abs(loss1), 1e-3), (split, loss, loss1)
        assert _rel(g1, g) <= TOL, (split, _rel(g1, g))
        assert r.clipped_fraction == pytest.approx(r1.clipped_fraction, abs=1e-9)
        assert r.rollout_corrected == pytest.approx(r1.rollout_corrected, abs=1e-9)
    if "rollout_correction" in OBJECTIVES[name]:
        assert r1.rollout_corrected is not None and 0 < r1.rollout_corrected < 1  # some tokens corrected
    else:
        assert r1.rollout_corrected is None


def _skewed(learner: Learner, t: Any) -> RolloutBatch:
    """The batch with rollout logprobs 0.22 (± 0.1) below the trainer's: ratio e^0.22 ≈ 1.246 is
    inside clip-higher's 1.28 but outside the default 1.2."""
    batch = _batch(t)
    with torch.no_grad():
        for mb in batch.micro:
            lp, _ = token_logprobs(learner.policy.model, mb.input_ids, mb.mask, mb.labels, mb.temperature)
            wobble = torch.tensor([0.0, 0.1, -0.1]).repeat(lp.numel())[: lp.numel()]  # GSPO's mean ≠ each token's
            mb.old_logp[mb.mask] = lp - 0.22 - wobble
    return batch


def test_each_choice_changes_the_default_gradient(policy: Any, tiny_dir: Path, tmp_path: Path) -> None:
    learner, t = _learner(policy, tmp_path, tiny_dir)
    _, base, _ = _run(learner, _skewed(learner, t))
    for name, keys in OBJECTIVES.items():
        if name == "default":
            continue
        learner, t = _learner(policy, tmp_path, tiny_dir, **keys)
        _, g, _ = _run(learner, _skewed(learner, t))
        assert _rel(base, g) > 1e-3, name


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_checkpoint_and_resume_keep_the_schedules_position(schedule: str, tiny_dir: Path, tmp_path: Path) -> None:
    from atroposd.trainer.optim import lr_factor
    from atroposd.trainer.setup import build_learner, load_for_training

    cfg = make_cfg(tmp_path / "state", tiny_dir, lr_schedule=schedule, warmup_steps=1, steps=6, lr=1e-3, kl_coef=0.0)
    setup = load_for_training(cfg)
    learner = build_learner(cfg, setup)
    lrs = []
    for _ in range(3):
        assert learner.compute(_batch(cfg.trainer)).finite
        learner.apply()
        lrs.append(learner.lr)
    setup.checkpointer(learner).save(3, 3, 0)
    assert lrs == pytest.approx([1e-3 * lr_factor(s, warmup_steps=1, steps=6, schedule=schedule) for s in (1, 2, 3)])
    resumed = build_learner(cfg, load_for_training(cfg))
    assert resumed.lr == lrs[-1]  # the position, not the start of the schedule
    assert resumed.compute(_batch(cfg.trainer)).finite
    resumed.apply()
    learner.compute(_batch(cfg.trainer))
    learner.apply()
    assert resumed.lr == learner.lr == pytest.approx(1e-3 * lr_factor(4, warmup_steps=1, steps=6, schedule=schedule))

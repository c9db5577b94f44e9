"""The learner on the real tiny model: logprobs, micro-batch invariance, the NaN guard, the
frozen reference, LoRA."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from atroposd.trainer.batch import prepare_batch
from atroposd.trainer.learner import Learner, make_strategies
from atroposd.trainer.model import Policy, load_policy, token_logprobs
from atroposd.trainer.optim import build_optimizer, build_scheduler
from tests.trainer.conftest import make_cfg, make_groups


def _learner(tiny_dir: Path, tmp_path: Path, **trainer: object) -> Learner:
    cfg = make_cfg(tmp_path, tiny_dir, **trainer)
    t = cfg.trainer
    lora = {"r": t.lora_r, "alpha": t.lora_alpha, "targets": t.lora_targets} if t.mode == "lora" else None
    policy = load_policy(
        tiny_dir,
        tiny_dir,
        device=torch.device("cpu"),
        dtype=torch.float32,
        lora=lora,
        need_reference=t.kl_coef > 0 and t.kl_reference == "initial",
    )
    opt = build_optimizer(policy.trainable(), t)
    objective, reference = make_strategies(t)
    return Learner(
        policy,
        opt,
        build_scheduler(opt, t.warmup_steps),
        objective=objective,
        reference=reference,
        max_grad_norm=t.max_grad_norm,
    )


def _snapshot(policy: Policy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in policy.model.state_dict().items()}


def test_selected_position_logprobs_equal_full_logits(tiny_dir: Path, tmp_path: Path) -> None:
    learner = _learner(tiny_dir, tmp_path)
    mb = prepare_batch(make_groups(0, n=2), micro_batch_size=16, max_token_len=64, adv_std_floor=0.1).micro[0]
    mb.temperature[:] = 0.7
    with torch.no_grad():
        fast, _ = token_logprobs(learner.policy.model, mb.input_ids, mb.mask, mb.labels, mb.temperature)
        logits = learner.policy.model(input_ids=mb.input_ids).logits / 0.7  # [B, T, V]
        full = torch.log_softmax(logits, -1).gather(2, mb.labels[..., None])[..., 0][mb.mask]
    torch.testing.assert_close(fast, full, atol=1e-5, rtol=0)


def test_on_policy_rollout_logprobs_give_ratio_one_and_no_logprob_difference(tiny_dir: Path, tmp_path: Path) -> None:
    learner = _learner(tiny_dir, tmp_path)
    batch = prepare_batch(make_groups(15, n=2), micro_batch_size=8, max_token_len=64, adv_std_floor=0.1)
    with torch.no_grad():  # the rollout logprobs the trainer itself would have sampled with
        for mb in batch.micro:
            lp, _ = token_logprobs(learner.policy.model, mb.input_ids, mb.mask, mb.labels, mb.temperature)
            mb.old_logp[mb.mask] = lp
    r = learner.compute(batch)
    assert r.logprob_diff_abs_mean is not None and r.logprob_diff_abs_mean < 1e-6
    assert r.mean_ratio == pytest.approx(1.0, abs=1e-6) and r.clipped_fraction == 0.0
    skewed = prepare_batch(make_groups(15, n=2), micro_batch_size=8, max_token_len=64, adv_std_floor=0.1)
    diff = learner.compute(skewed).logprob_diff_abs_mean
    assert diff is not None and diff > 0.1  # synthetic logprobs differ


def test_micro_batch_split_does_not_change_loss_or_gradient(tiny_dir: Path, tmp_path: Path) -> None:
    groups = make_groups(1, n=2)
    results = []
    for micro in (16, 4):
        learner = _learner(tiny_dir, tmp_path)
        batch = prepare_batch(groups, micro_batch_size=micro, max_token_len=64, adv_std_floor=0.1)
        r = learner.compute(batch)
        grads = torch.cat([p.grad.reshape(-1) for p in learner.params if p.grad is not None])
        results.append((r.loss, r.grad_norm, grads))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5, abs=1e-7)
    assert results[0][1] == pytest.approx(results[1][1], rel=1e-4)
    torch.testing.assert_close(results[0][2], results[1][2], atol=1e-6, rtol=1e-4)


def test_nan_in_a_batch_skips_the_step_and_leaves_weights_bit_identical(tiny_dir: Path, tmp_path: Path) -> None:
    learner = _learner(tiny_dir, tmp_path)
    learner.compute(prepare_batch(make_groups(2), micro_batch_size=8, max_token_len=64, adv_std_floor=0.1))
    learner.apply()  # a real step first, so the optimizer has state to keep
    before = _snapshot(learner.policy)
    opt_before = copy.deepcopy(learner.optimizer.state_dict())
    batch = prepare_batch(make_groups(3), micro_batch_size=8, max_token_len=64, adv_std_floor=0.1)
    batch.micro[1].advantages[0, -1] = float("nan")  # one poisoned token
    r = learner.compute(batch)
    assert not r.finite
    learner.discard()
    after = _snapshot(learner.policy)
    for k in before:
        assert torch.equal(before[k], after[k]), k
    opt_after = learner.optimizer.state_dict()
    for idx, st in opt_before["state"].items():
        for key, value in st.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_after["state"][idx][key]))
    assert all(p.grad is None for p in learner.params)


def test_kl_toward_the_initial_model_starts_at_zero_and_grows(tiny_dir: Path, tmp_path: Path) -> None:
    learner = _learner(tiny_dir, tmp_path, kl_coef=0.04, kl_reference="initial", lr=3e-3)
    batch = prepare_batch(make_groups(4), micro_batch_size=8, max_token_len=64, adv_std_floor=0.1)
    first = learner.compute(batch)
    assert first.finite and first.mean_kl == pytest.approx(0.0, abs=1e-6)
    learner.apply()
    for seed in (5, 6, 7):
        learner.compute(prepare_batch(make_groups(seed), micro_batch_size=8, max_token_len=64, adv_std_floor=0.1))
        learner.apply()
    later = learner.compute(batch)
    assert later.mean_kl > 1e-5
    assert learner.policy.reference is not None
    ref = dict(learner.policy.reference.named_parameters())
    assert all(not p.requires_grad for p in ref.values())


def test_training_raises_the_likelihood_of_preferred_completions(tiny_dir: Path, tmp_path: Path) -> None:
    learner = _learner(tiny_dir, tmp_path, lr=3e-3)
    groups = make_groups(8, n=2)
    batch = prepare_batch(groups, micro_batch_size=16, max_token_len=64, adv_std_floor=0.1)
    mb = batch.micro[0]

    def weighted_logp() -> float:
        with torch.no_grad():
            lp, _ = token_logprobs(learner.policy.model, mb.input_ids, mb.mask, mb.labels, mb.temperature)
        return float((lp * mb.advantages[mb.mask]).sum())

    start = weighted_logp()
    for _ in range(5):
        # on-policy: no rollout logprobs, so the ratio is 1 and only the advantages steer
        for m in batch.micro:
            m.old_logp[:] = float("nan")
        assert learner.compute(batch).finite
        learner.apply()
    assert weighted_logp() > start + 0.1


def test_lora_trains_only_the_adapters(tiny_dir: Path, tmp_path: Path) -> None:
    learner = _learner(
        tiny_dir, tmp_path, mode="lora", weight_sync="reload", lr=1e-2, lora_r=4, kl_coef=0.04, kl_reference="initial"
    )
    names = [n for n, p in learner.policy.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    before = _snapshot(learner.policy)
    batch = prepare_batch(make_groups(9), micro_batch_size=8, max_token_len=64, adv_std_floor=0.1)
    for _ in range(2):
        r = learner.compute(batch)
        assert r.finite
        learner.apply()
    after = _snapshot(learner.policy)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)
    assert any("lora_B" in k for k in changed)
    assert r.mean_kl > 0  # the reference is the base model with the adapters off


def test_distillation_changes_the_gradient(tiny_dir: Path, tmp_path: Path) -> None:
    groups = make_groups(10, n=1)
    teacher_ids, teacher_lps = [], []
    for seq in groups[0]["tokens"]:
        teacher_ids.append([None] + [[5, 6, 7]] * (len(seq) - 1))
        teacher_lps.append([None] + [[-0.1, -2.5, -4.0]] * (len(seq) - 1))
    groups[0]["distill_token_ids"], groups[0]["distill_logprobs"] = teacher_ids, teacher_lps
    grads = []
    for coef in (0.0, 0.5):
        learner = _learner(tiny_dir, tmp_path)
        learner.distill_coef = coef
        batch = prepare_batch(groups, micro_batch_size=8, max_token_len=64, adv_std_floor=0.1, use_distill=True)
        r = learner.compute(batch)
        assert r.finite
        if coef:
            assert r.distill_token_count == batch.completion_tokens == 24 and r.distill_loss is not None
            assert r.distill_loss > 0
        grads.append(torch.cat([p.grad.reshape(-1) for p in learner.params if p.grad is not None]))
    assert (grads[0] - grads[1]).abs().max() > 1e-4  # not a no-op


def test_awsft_objective_trains(tiny_dir: Path, tmp_path: Path) -> None:
    learner = _learner(tiny_dir, tmp_path, loss="awsft", lr=3e-3)
    batch = prepare_batch(make_groups(11), micro_batch_size=8, max_token_len=64, adv_std_floor=0.1)
    before = _snapshot(learner.policy)
    r = learner.compute(batch)
    assert r.finite and r.grad_norm > 0 and r.clipped_fraction == 0.0
    learner.apply()
    after = _snapshot(learner.policy)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_optimizers(tiny_dir: Path, tmp_path: Path) -> None:
    from atroposd.trainer.optim import OptimizerError

    learner = _learner(tiny_dir, tmp_path, optimizer="adafactor")
    assert type(learner.optimizer).__name__ == "Adafactor"
    learner.compute(prepare_batch(make_groups(12), micro_batch_size=8, max_token_len=64, adv_std_floor=0.1))
    learner.apply()
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        with pytest.raises(OptimizerError, match="needs bitsandbytes"):
            _learner(tiny_dir, tmp_path, optimizer="adamw_8bit")


def test_warmup_schedule(tiny_dir: Path, tmp_path: Path) -> None:
    learner = _learner(tiny_dir, tmp_path, warmup_steps=4, lr=1e-3)
    lrs = []
    batch = prepare_batch(make_groups(13), micro_batch_size=8, max_token_len=64, adv_std_floor=0.1)
    for _ in range(5):
        lrs.append(learner.lr)
        learner.compute(batch)
        learner.apply()
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])

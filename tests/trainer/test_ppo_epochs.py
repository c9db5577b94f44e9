"""Several optimizer steps per batch (SPEC §14: ``ppo_epochs``, ``mini_batches``) and each loss's
own clip range (``clip_eps = "auto"``).

Hand-valued: a policy of one free logit per token of a two-token vocabulary, so that every
ratio, clipped fraction and SGD update of two optimizer steps on one batch is a few lines of
arithmetic here, with and without a rollout correction. On the real tiny model: packed equals
padded, the learning-rate schedule counts optimizer steps, ``optimizer_steps`` counts them, and a
run resumed from a checkpoint between batches takes bit-identical steps. Two ranks equal one
(real processes, a real gloo group) is marked ``slow``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from atroposd.trainer.batch import RolloutBatch, prepare_batch
from atroposd.trainer.learner import GrpoObjective, Learner, NoReference, make_strategies
from atroposd.trainer.logprobs import TokenScores
from atroposd.trainer.model import ROOT_ATTR, Policy
from atroposd.trainer.setup import build_learner, load_for_training
from tests.trainer.conftest import make_cfg, make_groups

# ---------------------------------------------------------------------------- the hand-valued policy


class Logits(torch.nn.Module):
    """A policy whose next-token distribution is softmax(b) whatever the context: b [2]."""

    def __init__(self) -> None:
        super().__init__()
        self.b = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))

    def scores(self, input_ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, *a: Any, **k: Any) -> Any:
        logp = torch.log_softmax(self.b, -1)[labels[mask]].float()  # [N]
        return TokenScores(logp=logp, entropy=None)


def _hand_policy() -> Policy:
    model = Logits()
    object.__setattr__(model, ROOT_ATTR, model.scores)  # token_scores goes through it
    return Policy(
        model=model, tokenizer=None, source=Path("."), device=torch.device("cpu"), dtype=torch.float32, lora=False
    )


def _hand_batch(sampler: tuple[float, float]) -> RolloutBatch:
    """One group of two sequences, a prompt token and one completion token each: A samples token
    0 and scores 1, B samples token 1 and scores 0 (advantages +1 and -1); ``sampler``: the
    sampler's probabilities of A's and B's tokens."""
    group = {
        "tokens": [[0, 0], [0, 1]],
        "masks": [[-100, 0], [-100, 1]],
        "scores": [1.0, 0.0],
        "inference_logprobs": [[1.0, math.log(sampler[0])], [1.0, math.log(sampler[1])]],
    }
    return prepare_batch([group], micro_batch_size=2, max_token_len=8, adv_std_floor=0.1, keep_rows=True)


def _hand_learner(lr: float, correction: str = "none", epochs: int = 2) -> Learner:
    policy = _hand_policy()
    opt = torch.optim.SGD(policy.trainable(), lr=lr)
    return Learner(
        policy,
        opt,
        torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0),
        objective=GrpoObjective(clip_eps=0.2, kl_coef=0.0, correction=correction, threshold=2.0),
        reference=NoReference(),
        max_grad_norm=1e9,
        ppo_epochs=epochs,
        mini_batches=1,
        micro_batch_size=2,
    )


def _by_hand(lr: float, sampler: tuple[float, float], correction: str) -> list[dict[str, Any]]:
    """Two SGD steps on the batch of :func:`_hand_batch`, written out: per step the loss, the
    ratios, the clipped fraction and the logits after the step."""
    b0 = b1 = 0.0
    adv = (1.0, -1.0)
    lo, hi = 0.8, 1.2
    old_policy = (math.log(0.5), math.log(0.5))  # π_old: softmax(0, 0) before the first update
    sampler_lp = (math.log(sampler[0]), math.log(sampler[1]))
    if correction == "none":
        anchor, weight = sampler_lp, (1.0, 1.0)
    else:  # token-tis, C = 2: min(ρ, C), ρ = π_old / sampler
        anchor = old_policy
        weight = tuple(min(math.exp(o - s), 2.0) for o, s in zip(old_policy, sampler_lp, strict=True))
    steps = []
    for _ in range(2):
        p0 = math.exp(b0) / (math.exp(b0) + math.exp(b1))
        logp = (math.log(p0), math.log(1 - p0))
        dlogp = ((1 - p0, -(1 - p0)), (-p0, p0))  # d log p(token 0) / db, d log p(token 1) / db
        ratio = [math.exp(lp - a) for lp, a in zip(logp, anchor, strict=True)]
        loss, grad = 0.0, [0.0, 0.0]
        for i in range(2):
            r, a, w = ratio[i], adv[i], weight[i]
            clipped_r = min(max(r, lo), hi)
            loss += -w * min(r * a, clipped_r * a) / 2
            if r * a <= clipped_r * a:  # the unclipped term is the minimum: its gradient flows
                for j in range(2):
                    grad[j] += -w * a * r * dlogp[i][j] / 2
        b0, b1 = b0 - lr * grad[0], b1 - lr * grad[1]
        steps.append(
            {
                "loss": loss,
                "ratio": ratio,
                "clipped_fraction": sum(not lo <= r <= hi for r in ratio) / 2,
                "b": (b0, b1),
            }
        )
    return steps


class Recorder:
    """Wraps ``compute_share`` to keep each optimizer step's result and the logits after it."""

    def __init__(self, learner: Learner) -> None:
        self.learner = learner
        self.results: list[Any] = []
        self.after: list[tuple[float, float]] = []
        inner_compute, inner_apply = learner.compute_share, learner.apply_local

        def compute_share(share: Any, **kw: Any) -> Any:
            r = inner_compute(share, **kw)
            self.results.append(r)
            return r

        def apply_local() -> None:
            inner_apply()
            b = getattr(learner.policy.model, "b", None)
            if isinstance(b, torch.Tensor):
                self.after.append((float(b.detach()[0]), float(b.detach()[1])))

        learner.compute_share = compute_share  # type: ignore[method-assign]
        learner.apply_local = apply_local  # type: ignore[method-assign]


@pytest.mark.parametrize("correction", ["none", "token-tis"])
@pytest.mark.parametrize(("lr", "sampler"), [(0.3, (0.5, 0.5)), (1.0, (0.5, 0.5)), (0.6, (0.4, 0.55))])
def test_two_optimizer_steps_on_one_batch_by_hand(lr: float, sampler: tuple[float, float], correction: str) -> None:
    learner = _hand_learner(lr, correction)
    rec = Recorder(learner)
    result = learner.train(_hand_batch(sampler), step=1)
    expected = _by_hand(lr, sampler, correction)
    assert result.optimizer_steps == 2 and learner.optimizer_steps == 2
    assert len(rec.results) == 2
    for got, after, want in zip(rec.results, rec.after, expected, strict=True):
        assert got.loss == pytest.approx(want["loss"], abs=1e-6)
        assert got.mean_ratio == pytest.approx(sum(want["ratio"]) / 2, abs=1e-6)
        assert got.clipped_fraction == want["clipped_fraction"]
        assert after == pytest.approx(want["b"], abs=1e-6)
    # the batch's row: the mean loss, the last step's clipped fraction
    assert result.loss == pytest.approx((expected[0]["loss"] + expected[1]["loss"]) / 2, abs=1e-6)
    assert result.clipped_fraction == expected[1]["clipped_fraction"]
    if correction != "none":
        # the first step's ratio is 1 (against π_old): the clip acts only from the second on
        assert rec.results[0].clipped_fraction == 0.0
        assert rec.results[0].mean_ratio == pytest.approx(1.0, abs=1e-7)


def test_the_second_step_clips_where_the_first_cannot() -> None:
    """With a correction the first step's clipped fraction is 0 by construction; a large enough
    first step puts both ratios outside [0.8, 1.2] and their gradients stop."""
    learner = _hand_learner(1.0, "token-tis")
    rec = Recorder(learner)
    learner.train(_hand_batch((0.5, 0.5)), step=1)
    assert [r.clipped_fraction for r in rec.results] == [0.0, 1.0]
    assert rec.after[1] == rec.after[0]  # every term clipped: the second step moves nothing


def test_one_optimizer_step_is_the_compute_and_apply_of_before() -> None:
    """ppo_epochs = 1 through ``train`` gives the loss and update of ``compute`` + ``apply``."""
    a, b = _hand_learner(0.5, epochs=1), _hand_learner(0.5, epochs=1)
    ra = a.train(_hand_batch((0.4, 0.55)), step=1)
    rb = b.compute(_hand_batch((0.4, 0.55)))
    b.apply()
    assert ra.loss == rb.loss
    assert torch.equal(a.policy.model.b, b.policy.model.b)  # type: ignore[union-attr]


# ---------------------------------------------------------------------------- the tiny model


def _tiny_learner(tiny_dir: Path, state: Path, **trainer: Any) -> Learner:
    cfg = make_cfg(state, tiny_dir, **trainer)
    return build_learner(cfg, load_for_training(cfg))


def _batch(learner: Learner, seed: int, *, tokens: int = 0, groups: int = 4, **kw: Any) -> RolloutBatch:
    return prepare_batch(
        make_groups(seed, n=groups, size=4, **kw),
        micro_batch_size=4,
        micro_batch_tokens=tokens,
        max_token_len=64,
        adv_std_floor=0.1,
        keep_rows=True,
    )


def _params(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.policy.model.state_dict().items()}


@pytest.mark.parametrize("correction", ["none", "seq-tis"])
def test_packed_equals_padded_with_several_steps(tiny_dir: Path, tmp_path: Path, correction: str) -> None:
    kw = {"ppo_epochs": 2, "mini_batches": 2, "lr": 3e-3, "kl_coef": 0.0, "rollout_correction": correction}
    padded = _tiny_learner(tiny_dir, tmp_path / "a", micro_batch_size=4, **kw)
    packed = _tiny_learner(tiny_dir, tmp_path / "b", micro_batch_size=4, micro_batch_tokens=64, **kw)
    packed.micro_batch_tokens = 64
    ra = padded.train(_batch(padded, 7), step=1)
    rb = packed.train(_batch(packed, 7, tokens=64), step=1)
    assert ra.optimizer_steps == rb.optimizer_steps == 4
    assert abs(ra.loss - rb.loss) <= 1e-5 * max(1.0, abs(ra.loss))
    pa, pb = _params(padded), _params(packed)
    worst = max(float((pa[n] - pb[n]).norm() / max(float(pa[n].norm()), 1e-12)) for n in pa)
    assert worst <= 1e-5


def test_lora_takes_several_steps_on_its_adapters_only(tiny_dir: Path, tmp_path: Path) -> None:
    learner = _tiny_learner(
        tiny_dir, tmp_path, mode="lora", lora_r=4, lr=1e-2, kl_coef=0.0, ppo_epochs=2, rollout_correction="token-tis"
    )
    before = _params(learner)
    result = learner.train(_batch(learner, 5), step=1)
    assert result.finite and result.optimizer_steps == 2 and learner.optimizer_steps == 2
    after = _params(learner)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed), sorted(changed)[:5]


def test_the_schedule_counts_optimizer_steps(tiny_dir: Path, tmp_path: Path) -> None:
    # 2 batches × 2 passes × 2 mini-batches: the linear schedule reaches 0 at optimizer step 8
    learner = _tiny_learner(
        tiny_dir, tmp_path, steps=2, ppo_epochs=2, mini_batches=2, lr_schedule="linear", lr=1e-3, kl_coef=0.0
    )
    assert learner.lr == pytest.approx(1e-3)
    learner.train(_batch(learner, 1), step=1)
    assert learner.optimizer_steps == 4
    assert learner.lr == pytest.approx(1e-3 * (1 - 4 / 8))
    learner.train(_batch(learner, 2), step=2)
    assert learner.optimizer_steps == 8 and learner.lr == pytest.approx(0.0)


def test_mini_batches_are_whole_groups_in_a_fresh_order_each_pass(tiny_dir: Path, tmp_path: Path) -> None:
    learner = _tiny_learner(tiny_dir, tmp_path, ppo_epochs=3, mini_batches=2, kl_coef=0.0)
    orders = [learner.order(5, epoch, 8) for epoch in range(3)]
    for parts in orders:
        assert [len(p) for p in parts] == [4, 4]
        assert sorted(g for p in parts for g in p) == list(range(8))
    assert len({tuple(map(tuple, parts)) for parts in orders}) > 1  # a fresh order per pass
    assert learner.order(5, 1, 8) == orders[1]  # the same for the same step: a resume takes the same steps
    assert learner.order(6, 1, 8) != orders[1]


def test_resume_between_batches_is_bit_identical(tiny_dir: Path, tmp_path: Path) -> None:
    kw = {"ppo_epochs": 2, "mini_batches": 2, "lr": 3e-3, "rollout_correction": "token-mis", "checkpoint_every": 1}
    state = tmp_path / "state"
    cfg = make_cfg(state, tiny_dir, **kw)
    setup = load_for_training(cfg)
    learner = build_learner(cfg, setup)
    checkpointer = setup.checkpointer(learner)
    learner.train(_batch(learner, 1), step=1)
    checkpointer.save(1, 1, 0)
    straight = learner.train(_batch(learner, 2), step=2)
    want = _params(learner)
    cfg2 = make_cfg(state, tiny_dir, **kw)
    setup2 = load_for_training(cfg2)
    assert setup2.step == 1
    resumed = build_learner(cfg2, setup2)
    assert resumed.optimizer_steps == 4
    again = resumed.train(_batch(resumed, 2), step=2)
    assert again.loss == straight.loss and again.grad_norm == straight.grad_norm  # bit-exact
    got = _params(resumed)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_correction_with_two_epochs_clips_in_later_steps(tiny_dir: Path, tmp_path: Path) -> None:
    """With a rollout correction and one step per batch the clipped fraction is 0 at every step;
    with two passes the second pass's ratio moves away from 1."""
    one = _tiny_learner(tiny_dir, tmp_path / "a", lr=3e-2, rollout_correction="token-tis", kl_coef=0.0)
    result = one.compute(_batch(one, 3))
    assert result.clipped_fraction == 0.0 and result.mean_ratio == pytest.approx(1.0)
    two = _tiny_learner(tiny_dir, tmp_path / "b", lr=3e-2, rollout_correction="token-tis", kl_coef=0.0, ppo_epochs=2)
    rec = Recorder(two)
    two.train(_batch(two, 3), step=1)
    assert rec.results[0].clipped_fraction == 0.0
    assert rec.results[1].clipped_fraction > 0.0
    assert rec.results[1].mean_ratio != pytest.approx(1.0, abs=1e-4)


def test_missing_sampler_logprobs_take_pi_old_in_later_steps(tiny_dir: Path, tmp_path: Path) -> None:
    learner = _tiny_learner(tiny_dir, tmp_path, lr=3e-2, kl_coef=0.0, ppo_epochs=2, mini_batches=2)
    rec = Recorder(learner)
    result = learner.train(_batch(learner, 4, logprobs=False), step=1)
    assert result.optimizer_steps == 4
    assert rec.results[0].mean_ratio == pytest.approx(1.0)
    assert any(r.mean_ratio != pytest.approx(1.0, abs=1e-5) for r in rec.results[2:])


# ---------------------------------------------------------------------------- config


def test_auto_clip_range_is_each_losss_own(tmp_path: Path, tiny_dir: Path) -> None:
    assert make_cfg(tmp_path, tiny_dir).trainer.clip_range() == (0.2, 0.0)
    assert make_cfg(tmp_path, tiny_dir, loss="awsft").trainer.clip_range() == (0.2, 0.0)
    assert make_cfg(tmp_path, tiny_dir, loss="gspo").trainer.clip_range() == (3e-4, 4e-4)
    gspo = make_cfg(tmp_path, tiny_dir, loss="gspo", clip_eps=0.2, clip_eps_high=0)
    assert gspo.trainer.clip_range() == (0.2, 0.0)  # a number in the file is used as given
    objective, _ = make_strategies(make_cfg(tmp_path, tiny_dir, loss="gspo").trainer)
    assert isinstance(objective, GrpoObjective)
    assert (objective.clip_eps, objective.clip_eps_high) == (3e-4, 4e-4)


def test_config_check_refuses_mini_batches_that_do_not_divide_the_groups(tmp_path: Path, tiny_dir: Path) -> None:
    from atroposd.config import ConfigError, parse_config

    def problems(**trainer: Any) -> list[str]:
        raw = {
            "daemon": {"state_dir": str(tmp_path), "runtime_dir": str(tmp_path / "run")},
            "inference": {"model": str(tiny_dir), "max_model_len": 512},
            "trainer": {"batch_size": 16, "micro_batch_size": 8, "max_token_len": 64, **trainer},
            "env": [{"name": "arith", "builtin": "arithmetic", "group_size": 4}],
        }
        try:
            parse_config(raw)
        except ConfigError as exc:
            return [str(p) for p in exc.problems]
        return []

    assert not [p for p in problems(mini_batches=2) if "mini_batches" in p]
    assert not [p for p in problems(mini_batches=4) if "mini_batches" in p]
    bad = [p for p in problems(mini_batches=3) if "mini_batches" in p]
    assert bad and "divide the batch's groups" in bad[0] and "4 groups" in bad[0], bad
    bad = [p for p in problems(clip_eps="wide") if "clip_eps" in p]
    assert bad and '"auto"' in bad[0], bad
    # gspo's own upper bound (auto: 4e-4) below a lower clip_eps set in the file: named
    bad = [p for p in problems(loss="gspo", clip_eps=0.2) if "clip_eps_high" in p]
    assert bad and '"auto": 0.0004 for loss = "gspo"' in bad[0], bad
    assert not problems(loss="gspo", clip_eps=0.2, clip_eps_high=0.28)


# ---------------------------------------------------------------------------- two ranks


@pytest.mark.slow  # two rank-0 runs with a real gloo group
def test_two_epochs_on_two_ranks_equal_one_rank(tiny_dir: Path, tmp_path: Path) -> None:
    from tests.trainer.test_ranks import LOSS_TOL, PARAM_TOL, _config, _run, _worst

    menu = {"ppo_epochs": 2, "mini_batches": 2, "rollout_correction": "token-tis", "steps": 3}
    one = _run(_config(tmp_path, "one", tiny_dir, "cpu", **menu), tmp_path / "one.pt", "--steps", "1")
    two = _run(_config(tmp_path, "two", tiny_dir, ["cpu", "cpu"], **menu), tmp_path / "two.pt", "--steps", "1")
    for a, b in zip(one["losses"], two["losses"], strict=True):
        assert abs(a - b) <= LOSS_TOL, (one["losses"], two["losses"])
    assert _worst(one["params"], two["params"]) <= PARAM_TOL
    assert two["follower_codes"] == [0]

"""The LM head in chunks (SPEC §14 ``logprob_chunk``): the same values and gradients as the full
logits, for any chunk size, and the full logits never held at once."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from atroposd.trainer.batch import RolloutBatch, prepare_batch
from atroposd.trainer.learner import GrpoObjective, Learner, NoReference
from atroposd.trainer.logprobs import head_scores, teacher_probs
from atroposd.trainer.loss import distill_loss, grpo_loss
from atroposd.trainer.model import Policy, load_policy, token_scores
from tests.trainer.conftest import BOS, DIGITS, EOS

TOL = 1e-5  # SPEC §14: relative by norm, float32 on CPU


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def full_scores(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    labels: torch.Tensor,
    temps: torch.Tensor,
    ids: torch.Tensor,
    lps: torch.Tensor,
    tau: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unchunked computation: the whole [N, V] logits, autograd's gradients."""
    logits = head(hidden).float()  # [N, V]
    scaled = logits / temps[:, None]
    logp = scaled.gather(1, labels[:, None])[:, 0] - torch.logsumexp(scaled, -1)
    entropy = -(torch.softmax(scaled, -1) * torch.log_softmax(scaled, -1)).sum(-1)
    has = (ids >= 0).any(-1)
    ce = torch.zeros_like(logp)
    if has.any():
        log_q = torch.log_softmax(logits[has] / tau, -1)
        p = teacher_probs(ids[has], lps[has], tau)
        ce = ce.index_put((has.nonzero()[:, 0],), -(p * log_q.gather(1, ids[has].clamp(min=0))).sum(-1))
    return logp, entropy.detach(), ce


@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 0])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_head_equals_the_full_logits_in_values_and_gradients(chunk: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(chunk * 2 + bias)
    n, h, v, k = 23, 16, 50, 4  # 23 positions: no chunk size above divides them
    head = torch.nn.Linear(h, v, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=gen))
        if head.bias is not None:
            head.bias.copy_(torch.randn(v, generator=gen))
    hidden = torch.randn(n, h, generator=gen)
    labels = torch.randint(0, v, (n,), generator=gen)
    temps = torch.rand(n, generator=gen) + 0.5
    ids = torch.randint(0, v, (n, k), generator=gen)
    ids[::3, 2:] = -1  # padding in the teacher's top-k
    ids[1::5] = -1  # positions without a teacher
    lps = -torch.rand(n, k, generator=gen) * 4
    g_logp, g_ce = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    tau = 1.7

    results = []
    for chunked in (True, False):
        head.zero_grad()
        x = hidden.clone().requires_grad_(True)
        if chunked:
            s = head_scores(
                x, head, labels, temps, chunk=chunk, teacher=(ids, teacher_probs(ids, lps, tau)), tau=tau, entropy=True
            )
            assert s.entropy is not None and s.distill is not None and not s.entropy.requires_grad
            logp, entropy, ce = s.logp, s.entropy, s.distill
        else:
            logp, entropy, ce = full_scores(x, head, labels, temps, ids, lps, tau)
        ((logp * g_logp).sum() + (ce * g_ce).sum()).backward()
        assert x.grad is not None and head.weight.grad is not None
        grads = [x.grad, head.weight.grad] + (
            [head.bias.grad] if head.bias is not None and head.bias.grad is not None else []
        )
        results.append([logp.detach(), entropy, ce.detach(), *grads])
    assert len(results[0]) == len(results[1]) == 5 + bias
    for name, a, b in zip(
        ("logp", "entropy", "distill", "grad hidden", "grad weight", "grad bias"), results[0], results[1], strict=False
    ):
        assert rel(a, b) < TOL, name


def test_a_head_that_is_not_linear_goes_through_per_chunk_checkpoints() -> None:
    """A LoRA-wrapped head (not a plain Linear) takes the checkpointed path: same results."""
    gen = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(8, 30, bias=False)
    seq = torch.nn.Sequential(lin)  # the same weights behind a module that is not a Linear
    hidden = torch.randn(11, 8, generator=gen)
    labels = torch.randint(0, 30, (11,), generator=gen)
    temps = torch.full((11,), 0.8)
    out = []
    for head in (lin, seq):
        lin.zero_grad()
        x = hidden.clone().requires_grad_(True)
        s = head_scores(x, head, labels, temps, chunk=4, entropy=True)
        s.logp.sum().backward()
        assert x.grad is not None and lin.weight.grad is not None and s.entropy is not None
        out.append((s.logp.detach(), s.entropy, x.grad, lin.weight.grad.clone()))
    for a, b in zip(out[0], out[1], strict=True):
        assert rel(a, b) < TOL


def test_the_backward_never_holds_more_than_a_chunk_of_logits() -> None:
    """Every logits tensor the head computes, in the forward and in the backward, is one chunk's
    [C, V], never the [N, V] of all positions (a probe on the head's matmul)."""
    n, h, v, chunk = 512, 8, 4096, 32
    head = torch.nn.Linear(h, v, bias=False)
    x = torch.randn(n, h, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    temps = torch.ones(n)
    biggest = 0
    real_linear = torch.nn.functional.linear

    def probe(*args: Any, **kw: Any) -> torch.Tensor:
        nonlocal biggest
        out = real_linear(*args, **kw)
        biggest = max(biggest, out.numel())
        return out

    torch.nn.functional.linear = probe  # type: ignore[assignment]
    try:
        s = head_scores(x, head, labels, temps, chunk=chunk, entropy=True)
        s.logp.sum().backward()
    finally:
        torch.nn.functional.linear = real_linear
    assert biggest == chunk * v  # every logits tensor, forward and backward, is one chunk's


# ------------------------------------------------------------------ the learner on the tiny model


def varied_groups(
    seed: int, *, n_groups: int = 3, size: int = 4, max_completion: int = 20, distill: bool = False
) -> list[dict[str, Any]]:
    """Groups of varied prompt and completion lengths and temperatures (rows longer than a chunk)."""
    rng = random.Random(seed)
    groups = []
    for _ in range(n_groups):
        tokens, masks, lps, overrides, d_ids, d_lps = [], [], [], [], [], []
        for _ in range(size):
            p_len, c_len = rng.randint(2, 8), rng.randint(2, max_completion)
            prompt = [BOS] + [rng.choice(DIGITS) for _ in range(p_len - 1)]
            completion = [rng.choice(DIGITS) for _ in range(c_len - 1)] + [EOS]
            tokens.append(prompt + completion)
            masks.append([-100] * p_len + completion)
            lps.append([1.0] * p_len + [-rng.uniform(0.5, 4.0) for _ in completion])
            overrides.append({"temperature": rng.choice([0.7, 1.0, 1.3])})
            d_ids.append([[] for _ in range(p_len)] + [rng.sample(range(22), 3) for _ in completion])
            d_lps.append([[] for _ in range(p_len)] + [[-rng.uniform(0.1, 5.0) for _ in range(3)] for _ in completion])
        group: dict[str, Any] = {
            "tokens": tokens,
            "masks": masks,
            "scores": [rng.random() for _ in range(size)],
            "inference_logprobs": lps,
            "overrides": overrides,
        }
        if distill:
            group["distill_token_ids"], group["distill_logprobs"] = d_ids, d_lps
        groups.append(group)
    return groups


@pytest.fixture(scope="module")
def tiny_policy(tiny_dir: Path) -> Policy:
    return load_policy(tiny_dir, tiny_dir, device=torch.device("cpu"), dtype=torch.float32)


def learner_for(policy: Policy, chunk: int, distill_coef: float = 0.0) -> Learner:
    opt = torch.optim.SGD(policy.trainable(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _s: 1.0)
    return Learner(
        policy,
        opt,
        sched,
        objective=GrpoObjective(clip_eps=0.2, kl_coef=0.0),
        reference=NoReference(),
        max_grad_norm=1e9,
        distill_coef=distill_coef,
        distill_temperature=1.5,
        logprob_chunk=chunk,
    )


def reference_step(policy: Policy, batch: RolloutBatch, distill_coef: float) -> tuple[float, torch.Tensor]:
    """The unchunked, unpacked step written out: full [B, T, V] logits, loss.py's functions."""
    model = policy.model
    model.zero_grad(set_to_none=True)
    total = 0.0
    for mb in batch.micro:
        assert mb.seq_lens is None
        logits = model(input_ids=mb.input_ids).logits.float()  # [B, T, V]
        scaled = logits / mb.temperature[:, None, None]
        logp = torch.log_softmax(scaled, -1).gather(2, mb.labels[..., None])[..., 0][mb.mask]
        old = mb.old_logp[mb.mask]
        old = torch.where(torch.isnan(old), logp.detach(), old)
        loss, _ = grpo_loss(logp, old, mb.advantages[mb.mask], clip_eps=0.2, denom=batch.completion_tokens)
        if distill_coef and mb.distill_ids is not None and mb.distill_lp is not None:
            d = (mb.distill_ids >= 0).any(-1) & mb.mask
            dl, _ = distill_loss(
                logits[d], mb.distill_ids[d], mb.distill_lp[d], temperature=1.5, denom=max(batch.distill_positions, 1)
            )
            loss = loss + distill_coef * dl
        loss.backward()
        total += float(loss.detach())
    return total, torch.cat([p.grad.reshape(-1) for p in policy.trainable() if p.grad is not None])


def learner_step(learner: Learner, batch: RolloutBatch) -> tuple[float, torch.Tensor, float | None]:
    r = learner.compute(batch)
    grads = torch.cat([p.grad.reshape(-1) for p in learner.params if p.grad is not None])
    return r.loss, grads, r.entropy


@pytest.mark.parametrize(("chunk", "micro", "distill"), [(1, 4, False), (5, 4, True), (7, 1, False), (1024, 12, True)])
def test_learner_chunked_step_equals_the_full_logits_step(
    tiny_policy: Policy, chunk: int, micro: int, distill: bool
) -> None:
    """Loss and every gradient within 1e-5 relative by norm: chunks of 1, 5 (dividing no row), 7,
    1024 (one chunk); micro-batches of one row; distillation."""
    groups = varied_groups(chunk, distill=distill)
    batch = prepare_batch(groups, micro_batch_size=micro, max_token_len=64, adv_std_floor=0.1, use_distill=distill)
    assert max(int(mb.mask.sum(1).max()) for mb in batch.micro) > chunk or chunk == 1024  # rows longer than a chunk
    coef = 0.5 if distill else 0.0
    want_loss, want_grads = reference_step(tiny_policy, batch, coef)
    loss, grads, entropy = learner_step(learner_for(tiny_policy, chunk, coef), batch)
    assert loss == pytest.approx(want_loss, rel=TOL)
    assert rel(grads, want_grads) < TOL
    assert entropy is not None and 0 < entropy < float(torch.log(torch.tensor(22.0))) + 1e-4


def test_entropy_is_the_mean_over_completion_tokens_at_the_rollout_temperature(tiny_policy: Policy) -> None:
    batch = prepare_batch(varied_groups(3), micro_batch_size=4, max_token_len=64, adv_std_floor=0.1)
    _, _, entropy = learner_step(learner_for(tiny_policy, 3), batch)
    total = 0.0
    with torch.no_grad():
        for mb in batch.micro:
            scaled = tiny_policy.model(input_ids=mb.input_ids).logits / mb.temperature[:, None, None]
            ent = -(torch.softmax(scaled, -1) * torch.log_softmax(scaled, -1)).sum(-1)  # [B, T]
            total += float(ent[mb.mask].sum())
    assert entropy == pytest.approx(total / batch.completion_tokens, rel=1e-5)
    with torch.no_grad():  # a hotter rollout has a flatter distribution
        mb = batch.micro[0]
        hot = token_scores(
            tiny_policy.model, mb.input_ids, mb.mask, mb.labels, mb.temperature * 3, chunk=3, entropy=True
        ).entropy
        cold = token_scores(
            tiny_policy.model, mb.input_ids, mb.mask, mb.labels, mb.temperature, chunk=3, entropy=True
        ).entropy
    assert hot is not None and cold is not None and bool((hot > cold).all())

"""The LM head and what the loss needs of its distribution, over chunks of completion positions.

At real lengths the trainer's largest tensor would be the head's logits: ``[N, V]`` float32 for
the N completion positions of a micro-batch (32k positions and a 151,936-token vocabulary: about
19 GB, and the backward holds more). :class:`ChunkedHead` never holds more than ``chunk`` rows of
them: the forward computes each chunk's logits, keeps what it needs of them (the label's
logprob, the log-normaliser, the entropy, the distillation term) and drops them; the backward
recomputes each chunk's logits from the saved hidden states and turns them into the gradient in
place. The values and gradients are those of the unchunked computation (SPEC §14):

* ``logp = s[label] − logsumexp(s)`` with ``s = logits / T`` (T: the rollout temperature of the
  position's sequence); ``∂logp/∂logits = (onehot(label) − softmax(s)) / T``;
* ``entropy = logsumexp(s) − Σ softmax(s)·s`` (a metric: no gradient);
* ``distill = −Σ_k p_k · log_softmax(logits / τ)[id_k]`` (``p``: the teacher's renormalised
  top-k, :func:`teacher_probs`); ``∂distill/∂logits = (softmax(logits/τ)·Σ_k p_k − Σ_k p_k·onehot(id_k)) / τ``.

The head must be a plain ``nn.Linear`` (any Hugging Face LM head, tied or not, unsharded by
FSDP2 around the call); any other head (a LoRA-wrapped one) goes through
:func:`checkpointed_scores`, which recomputes per chunk with ``torch.utils.checkpoint`` — the
same bound on the logits, more temporaries per chunk.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

__all__ = ["ChunkedHead", "TokenScores", "checkpointed_scores", "head_scores", "teacher_probs"]


class TokenScores(NamedTuple):
    """Per completion position (N, in row order): ``logp`` (differentiable), ``entropy`` (detached,
    None unless asked) and ``distill`` (the per-position distillation cross-entropy, 0 where the
    position has no teacher; None without a teacher)."""

    logp: torch.Tensor
    entropy: torch.Tensor | None = None
    distill: torch.Tensor | None = None


def teacher_probs(ids: torch.Tensor, logprobs: torch.Tensor, tau: float) -> torch.Tensor:
    """The teacher's top-k renormalised at τ: softmax(logprobs / τ) over the valid ids (id ≥ 0),
    0 at padding and for positions without any valid id. ids, logprobs: [N, K] → [N, K] float32."""
    valid = ids >= 0  # [N, K]
    has_any = valid.any(dim=1, keepdim=True)  # [N, 1]
    scores = (logprobs.float() / tau).masked_fill(~valid, float("-inf"))  # [N, K]
    scores = torch.where(has_any, scores, torch.zeros_like(scores))  # a row without ids: no NaN
    return torch.softmax(scores, dim=-1) * valid


def _spans(n: int, chunk: int) -> list[tuple[int, int]]:
    step = chunk if chunk > 0 else max(n, 1)
    return [(i, min(i + step, n)) for i in range(0, n, step)]


class _HeadCtx(Protocol):
    """What :class:`ChunkedHead` keeps from its forward for its backward: torch's function
    context, with the chunking and distillation settings set on it."""

    chunk: int
    tau: float
    distill: bool
    compute_dtype: torch.dtype
    saved_tensors: tuple[torch.Tensor, ...]
    needs_input_grad: tuple[bool, ...]

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None: ...
    def mark_non_differentiable(self, *args: torch.Tensor) -> None: ...


class ChunkedHead(torch.autograd.Function):
    """``(hidden [N, H], weight [V, H], bias [V] | None, labels [N], temps [N], chunk, teacher ids
    [N, K] | None, teacher probs [N, K] | None, τ, want entropy)`` → ``(logp [N], entropy [N] or
    [0], distill [N] or [0])``, float32. Only ``logp`` and ``distill`` carry gradients."""

    @staticmethod
    def forward(
        ctx: _HeadCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        temps: torch.Tensor,
        chunk: int,
        t_ids: torch.Tensor | None,
        t_probs: torch.Tensor | None,
        tau: float,
        want_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        dev = hidden.device
        logp = torch.empty(n, dtype=torch.float32, device=dev)
        lse = torch.empty(n, dtype=torch.float32, device=dev)
        entropy = torch.empty(n if want_entropy else 0, dtype=torch.float32, device=dev)
        distill = t_ids is not None and t_probs is not None
        ce = torch.zeros(n if distill else 0, dtype=torch.float32, device=dev)
        lse_t = torch.zeros(n if distill else 0, dtype=torch.float32, device=dev)
        compute_dtype = hidden.dtype
        for a, b in _spans(n, chunk):
            logits = F.linear(hidden[a:b], weight, bias)  # [C, V] (autocast's dtype under autocast)
            compute_dtype = logits.dtype
            logits = logits.float()
            if distill:
                assert t_ids is not None and t_probs is not None
                ce[a:b], lse_t[a:b] = _distill_forward(logits, t_ids[a:b], t_probs[a:b], tau)
            # One pass of exp over the chunk for the normaliser and the entropy: with m the row's
            # maximum, u = s − m (in place), z = Σ exp(u): lse = m + log z, logp = u[label] − log z,
            # entropy = log z − Σ exp(u)·u / z.
            s = logits.div_(temps[a:b, None])  # [C, V], in place: ``logits`` is this chunk's own
            m = s.amax(dim=-1)  # [C]
            u = s.sub_(m[:, None])  # [C, V]
            e = u.exp()  # [C, V]
            log_z = e.sum(-1).log_()  # [C]
            lse[a:b] = m + log_z
            logp[a:b] = u.gather(1, labels[a:b, None])[:, 0] - log_z
            if want_entropy:
                entropy[a:b] = log_z - torch.bmm(e[:, None, :], u[:, :, None])[:, 0, 0] / log_z.exp()
            del s, u, e, logits
        ctx.save_for_backward(hidden, weight, bias, labels, temps, lse, t_ids, t_probs, lse_t)
        ctx.chunk, ctx.tau, ctx.distill, ctx.compute_dtype = chunk, tau, distill, compute_dtype
        ctx.mark_non_differentiable(entropy)
        return logp, entropy, ce

    @staticmethod
    def backward(
        ctx: _HeadCtx, g_logp: torch.Tensor | None, _g_entropy: torch.Tensor | None, g_ce: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, labels, temps, lse, t_ids, t_probs, lse_t = ctx.saved_tensors
        cd: torch.dtype = ctx.compute_dtype
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        w = weight.to(cd)  # the dtype the forward's matmul ran in (a copy only under autocast)
        h_all = hidden.to(cd)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = (
            torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
            if need_b and bias is not None
            else None
        )
        use_ce = ctx.distill and g_ce is not None
        for a, b in _spans(hidden.shape[0], ctx.chunk):
            h = h_all[a:b]
            logits = F.linear(h, w, None if bias is None else bias.to(cd)).float()  # [C, V], recomputed
            g_logits = torch.zeros_like(logits) if g_logp is None else None
            if use_ce:
                assert g_ce is not None
                g_logits = _distill_backward(logits, t_ids[a:b], t_probs[a:b], lse_t[a:b], ctx.tau, g_ce[a:b])
            if g_logp is not None:
                # ∂logp/∂s = onehot(label) − softmax(s); ∂s/∂logits = 1/T — all in place in ``logits``
                coef = g_logp[a:b] / temps[a:b]  # [C]: g / T
                s = logits.div_(temps[a:b, None])
                p = s.sub_(lse[a:b, None]).exp_()  # softmax(s)
                p.mul_(-coef[:, None])
                p.scatter_add_(1, labels[a:b, None], coef[:, None])
                g_logits = p if g_logits is None else g_logits.add_(p)
            assert g_logits is not None
            g_cd = g_logits.to(cd)
            if grad_h is not None:
                grad_h[a:b] = (g_cd @ w).to(hidden.dtype)
            if grad_w is not None:
                grad_w.addmm_(g_logits.t(), h.float())
            if grad_b is not None:
                grad_b += g_logits.sum(0)
            del logits, g_logits, g_cd
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None or bias is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def _distill_forward(
    logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, tau: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position −Σ_k p_k · log_softmax(logits/τ)[id_k] and logsumexp(logits/τ), for the rows
    with a teacher (the others: 0, and their normaliser is never used)."""
    ce = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    lse = torch.zeros_like(ce)
    rows = (ids >= 0).any(dim=1).nonzero()[:, 0]
    if rows.numel():
        s = logits[rows] / tau  # [M, V]
        lse_r = torch.logsumexp(s, dim=-1)
        student = s.gather(1, ids[rows].clamp(min=0)) - lse_r[:, None]  # [M, K]
        ce[rows] = -(probs[rows] * student).sum(-1)
        lse[rows] = lse_r
    return ce, lse


def _distill_backward(
    logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, lse: torch.Tensor, tau: float, g: torch.Tensor
) -> torch.Tensor:
    """g · ∂distill/∂logits for one chunk: [C, V] (zero rows where there is no teacher)."""
    out = torch.zeros_like(logits)
    rows = (ids >= 0).any(dim=1).nonzero()[:, 0]
    if rows.numel():
        q = (logits[rows] / tau).sub_(lse[rows, None]).exp_()  # softmax(logits/τ) [M, V]
        p = probs[rows]  # [M, K], 0 at padding
        gr = g[rows]
        q.mul_((p.sum(-1) * gr)[:, None])
        q.scatter_add_(1, ids[rows].clamp(min=0), -(p * gr[:, None]))
        out[rows] = q.div_(tau)
    return out


def checkpointed_scores(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    labels: torch.Tensor,
    temps: torch.Tensor,
    *,
    chunk: int,
    teacher: tuple[torch.Tensor, torch.Tensor] | None,
    tau: float,
    entropy: bool,
) -> TokenScores:
    """:class:`ChunkedHead`'s results for a head that is not a plain linear layer: each chunk under
    ``torch.utils.checkpoint`` (its logits recomputed in the backward, one chunk at a time)."""
    from torch.utils.checkpoint import checkpoint

    def one(
        h: torch.Tensor, lab: torch.Tensor, t: torch.Tensor, ids: torch.Tensor | None, probs: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = head(h).float()  # [C, V]
        s = logits / t[:, None]
        lse = torch.logsumexp(s, dim=-1)
        lp = s.gather(1, lab[:, None])[:, 0] - lse
        with torch.no_grad():
            ent = lse - (torch.softmax(s, -1) * s).sum(-1) if entropy else lse.new_zeros(0)
        ce = lse.new_zeros(0)
        if ids is not None and probs is not None:
            log_q = torch.log_softmax(logits / tau, dim=-1)
            ce = -(probs * log_q.gather(1, ids.clamp(min=0))).sum(-1)
        return lp, ent, ce

    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for a, b in _spans(hidden.shape[0], chunk):
        ids = teacher[0][a:b] if teacher is not None else None
        probs = teacher[1][a:b] if teacher is not None else None
        args = (hidden[a:b], labels[a:b], temps[a:b], ids, probs)
        out = checkpoint(one, *args, use_reentrant=False) if torch.is_grad_enabled() else one(*args)
        parts.append(out)
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return TokenScores(empty, empty if entropy else None, empty if teacher is not None else None)
    return TokenScores(
        torch.cat([p[0] for p in parts]),
        torch.cat([p[1] for p in parts]) if entropy else None,
        torch.cat([p[2] for p in parts]) if teacher is not None else None,
    )


def head_scores(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    labels: torch.Tensor,
    temps: torch.Tensor,
    *,
    chunk: int,
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
    tau: float = 1.0,
    entropy: bool = False,
) -> TokenScores:
    """The head's scores at N positions, ``chunk`` positions at a time (``chunk <= 0``: one chunk).

    hidden: [N, H]; labels: [N] long; temps: [N]; teacher: (ids [N, K] with −1 = none, the
    teacher's probabilities [N, K] from :func:`teacher_probs`) or None; τ: the distillation
    temperature."""
    temps = temps.to(torch.float32)
    if isinstance(head, torch.nn.Linear) and isinstance(head.weight, torch.Tensor):
        ids, probs = teacher if teacher is not None else (None, None)
        logp, ent, ce = ChunkedHead.apply(
            hidden, head.weight, head.bias, labels, temps, chunk, ids, probs, float(tau), entropy
        )
        return TokenScores(logp, ent if entropy else None, ce if teacher is not None else None)
    return checkpointed_scores(hidden, head, labels, temps, chunk=chunk, teacher=teacher, tau=tau, entropy=entropy)

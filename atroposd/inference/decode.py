"""The torch engine's decode kernel: a batch of requests generated together with the model's
KV cache (:mod:`atroposd.inference.torch_engine` calls :func:`decode_batch` on its compute
thread).

Prompts are left-padded and run once; each request's cache is fanned out to its ``n`` rows;
rows that finish leave the batch. Sampling (:class:`_Sampler`) is vectorised over the batch:
temperature, top-p, top-k, per-request seeds; the reported logprob of a sampled token is
``log_softmax(logits / temperature)`` over the full vocabulary (SPEC §7). ``prompt_logprobs``
are teacher-forced with the same scaling.

In-flight weight updates (SPEC §7): a :class:`Freezer` stops the batch between two decode steps
(after a step's tokens are sampled and recorded, before the next forward pass) while the
weights change, and lets it go on: nothing sampled is lost or resampled, each token's logprob
is the one of the weights that sampled it, and each row records from which token on it was
sampled under which version (``Completion.versions``). With ``recompute`` the frozen rows'
KV cache is computed again with the new weights (one prefill over prompt and tokens so far)
before they go on; without it they decode over the old KV.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from atroposd.inference.schema import Completion, GenerateParams

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from atroposd.inference.steppers import HFStepper, LlamaStepper

__all__ = ["Freezer", "FrozenAbort", "Thaw", "decode_batch"]


class FrozenAbort(RuntimeError):
    """A frozen batch was told not to go on (the server is stopping)."""


@dataclass(frozen=True)
class Thaw:
    """How a frozen batch goes on: the weight version it now decodes with (None: unchanged),
    whether to recompute its KV cache with the new weights, or to stop (``abort``)."""

    version: int | None = None
    recompute: bool = False
    abort: bool = False


class Freezer:
    """Stops a batch between two decode steps and lets it go on (thread-safe).

    The event loop calls :meth:`request`; the compute thread, at the next point between two
    steps, calls :meth:`park`, which calls ``on_parked`` (from the compute thread) and blocks
    until :meth:`thaw` gives it a :class:`Thaw`."""

    def __init__(self, on_parked: Callable[[], object] | None = None) -> None:
        self.on_parked = on_parked
        self._want = threading.Event()
        self._go = threading.Event()
        self._thaw = Thaw()
        self.parks = 0

    def request(self) -> None:
        self._want.set()

    def requested(self) -> bool:
        return self._want.is_set()

    def park(self) -> Thaw:
        """Compute thread: freeze here until thawed."""
        self._want.clear()  # a request after this point freezes the batch again
        self.parks += 1
        if self.on_parked is not None:
            self.on_parked()
        self._go.wait()
        self._go.clear()
        thaw = self._thaw
        if thaw.abort:
            self._go.set()  # every later park returns at once too
        return thaw

    def thaw(self, thaw: Thaw) -> None:
        self._thaw = thaw
        self._go.set()


@dataclass
class _Row:
    """One sequence being generated (row ``index`` of the batch) for request ``job``."""

    job: int
    params: GenerateParams
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: str | None = None
    text: str | None = None  # set when a stop string ended the row
    versions: list[list[int]] = field(default_factory=list)  # [[token_index, weight_version], ...]


def decode_batch(
    model: PreTrainedModel,
    requests: list[GenerateParams],
    *,
    tokenizer: PreTrainedTokenizerBase,
    eos_ids: frozenset[int],
    generator: torch.Generator | None,
    fast: bool = True,
    early: Callable[..., None] | None = None,
    versions: list[int] | None = None,
    freezer: Freezer | None = None,
) -> tuple[list[list[Completion]], list[list[dict[str, float] | None] | None]]:
    """Generate every request's ``n`` completions in one batch with a KV cache.

    The prompt of a request is run once and its cache fanned out to its ``n`` rows; rows that
    finish leave the batch. ``fast``: use the flat Llama forward where it applies
    (:mod:`atroposd.inference.steppers`). Returns, per request, its completions and its prompt
    logprobs (None when not asked). ``early(j, completions, prompt_logprobs)`` is called after the
    first step for each request ``j`` that is done by then (a probe's one token), and its rows
    leave the batch. ``versions``: each request's weight version (its rows' records start with
    it); ``freezer``: stops the batch between two steps for an in-flight weight update (the
    module docstring).
    """
    import torch

    from atroposd.inference.steppers import HFStepper, make_stepper

    embedding = model.get_input_embeddings().weight
    assert isinstance(embedding, torch.Tensor)
    device = embedding.device
    stepper = make_stepper(model) if fast else HFStepper(model)
    rows = [_Row(j, p) for j, p in enumerate(requests) for _ in range(p.n)]
    if versions is not None:
        for r in rows:
            r.versions.append([0, int(versions[r.job])])
    lengths = [len(p.prompt_ids) for p in requests]
    width = max(lengths)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # Left padding: every prompt's last token sits in the last column.
    ids = torch.full((len(requests), width), pad, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for j, p in enumerate(requests):
        ids[j, width - lengths[j] :] = torch.tensor(p.prompt_ids)
        mask[j, width - lengths[j] :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [R, W]
    want_prompt = any(p.prompt_logprobs is not None for p in requests)

    logits = stepper.prefill(ids, mask, positions, all_logits=want_prompt)  # [R, W or 1, V]
    prompt_lps: list[list[dict[str, float] | None] | None] = (
        _prompt_logprobs(logits, requests, width) if want_prompt else [None] * len(requests)
    )
    # Fan each request's prompt out to its n rows: [R, ...] → [B, ...].
    fan = torch.tensor([r.job for r in rows], device=device)  # [B]
    if len(rows) != len(requests):
        stepper.select(fan)
    full = logits[:, -1, :].float()[fan]  # [B, V]
    next_pos = positions[fan][:, -1:] + 1  # [B, 1]
    temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32, device=device)  # [B]
    sampler = _Sampler(rows, requests, temps, generator, device)
    active = list(range(len(rows)))  # rows still in the cache, in cache order
    for _step in range(max(p.max_tokens for p in requests)):
        tokens, lps = sampler.sample(full)  # [B], [B] (finished rows sample too; ignored)
        alternatives = sampler.alternatives()
        token_list, lp_list = tokens.tolist(), lps.tolist()
        for i in active:
            if rows[i].finish is None:  # a finished row still in the cache decodes padding: ignore it
                _advance(
                    rows[i], token_list[i], lp_list[i], alternatives[i] if alternatives else None, eos_ids, tokenizer
                )
        keep = [k for k, i in enumerate(active) if rows[i].finish is None]  # positions in the cache
        first_done = _step == 0 and early is not None and len(keep) < len(active)
        if first_done:
            assert early is not None
            for j in sorted({rows[i].job for i in active if rows[i].finish is not None}):
                mine = [r for r in rows if r.job == j]
                if all(r.finish is not None for r in mine):
                    early(j, _collect(mine, requests, tokenizer)[j], prompt_lps[j])
        if not keep:
            break
        # Shrinking the cache copies it: worth it only once a good share of the rows is done (or
        # at the first step, the prompt's cache alone, when probes are done).
        if first_done or len(active) - len(keep) >= max(1, len(active) // 4):
            index = torch.tensor(keep, device=device)
            stepper.select(index)
            next_pos = next_pos[index]
            active = [active[k] for k in keep]
        # Finished rows still in the cache decode padding; their results are final.
        feed = torch.tensor(
            [token_list[i] if rows[i].finish is None else pad for i in active], dtype=torch.long, device=device
        )[:, None]  # [A, 1]
        recomputed = None
        if freezer is not None and freezer.requested():
            # Between two steps: every token so far is sampled and recorded; the weights may change now.
            thaw = freezer.park()
            if thaw.abort:
                raise FrozenAbort("the inference server is shutting down")
            changed = thaw.version is not None and _swapped(rows, active, thaw.version)
            if changed and thaw.recompute:
                recomputed = _recompute(stepper, rows, active, pad, device)
        step_logits = stepper.step(feed, next_pos).float() if recomputed is None else recomputed  # [A, V]
        next_pos = next_pos + 1
        if len(active) == len(rows):
            full = step_logits
        else:
            full = torch.zeros_like(full)
            full[torch.tensor(active, device=device)] = step_logits
    return _collect(rows, requests, tokenizer), prompt_lps


def _swapped(rows: list[_Row], active: list[int], version: int) -> bool:
    """Record ``version`` from the next token on in every unfinished row; whether any row changed."""
    changed = False
    for i in active:
        r = rows[i]
        if r.finish is None and r.versions and r.versions[-1][1] != version:
            r.versions.append([len(r.tokens), version])
            changed = True
        elif r.finish is None and not r.versions:
            changed = True
    return changed


def _recompute(
    stepper: HFStepper | LlamaStepper, rows: list[_Row], active: list[int], pad: int, device: torch.device
) -> torch.Tensor:
    """The cache of rows ``active`` (in cache order) computed again with the current weights: one
    left-padded prefill over each row's prompt and every token it sampled (the last one, not yet
    fed, included); returns the next token's logits [A, V] (what ``step`` would have given)."""
    import torch

    seqs = [list(rows[i].params.prompt_ids) + rows[i].tokens for i in active]
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for k, x in enumerate(seqs):
        ids[k, width - len(x) :] = torch.tensor(x)
        mask[k, width - len(x) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = stepper.prefill(ids, mask, positions, all_logits=False)  # [A, 1, V]
    return logits[:, -1, :].float()


def _advance(
    r: _Row,
    token: int,
    lp: float,
    alts: list[tuple[int, float]] | None,
    eos_ids: frozenset[int],
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    p = r.params
    r.tokens.append(token)
    r.logprobs.append(lp)
    if alts is not None:
        r.top.append(alts)
    if (token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
        r.finish = "stop"
    elif p.stop:
        text = str(tokenizer.decode(r.tokens, skip_special_tokens=p.skip_special_tokens))
        hit = min(((text.find(s), s) for s in p.stop if s in text), default=None)
        if hit is not None:
            cut = hit[0] + (len(hit[1]) if p.include_stop_str_in_output else 0)
            r.text = text[:cut]
            r.finish = "stop"
    if r.finish is None and len(r.tokens) >= p.max_tokens:
        r.finish = "length"


def _collect(
    rows: list[_Row], requests: list[GenerateParams], tokenizer: PreTrainedTokenizerBase
) -> list[list[Completion]]:
    texts = _decode_texts(tokenizer, rows)
    out: list[list[Completion]] = [[] for _ in requests]
    for r, decoded in zip(rows, texts, strict=True):
        text = r.text if r.text is not None else decoded
        out[r.job].append(
            Completion(
                token_ids=r.tokens,
                logprobs=r.logprobs,
                finish_reason=r.finish or "length",
                text=text,
                top=r.top if r.params.logprobs else [],
                versions=r.versions,
            )
        )
    return out


def _decode_texts(tokenizer: PreTrainedTokenizerBase, rows: list[_Row]) -> list[str]:
    """Every row's text; one call into a fast tokenizer's backend per batch where possible."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    plain = not getattr(tokenizer, "clean_up_tokenization_spaces", False)
    if backend is not None and plain:
        texts: list[str] = [""] * len(rows)
        for skip in (True, False):
            idx = [i for i, r in enumerate(rows) if r.params.skip_special_tokens is skip]
            if idx:
                for i, t in zip(
                    idx, backend.decode_batch([rows[i].tokens for i in idx], skip_special_tokens=skip), strict=True
                ):
                    texts[i] = t
        return texts
    return [str(tokenizer.decode(r.tokens, skip_special_tokens=r.params.skip_special_tokens)) for r in rows]


def noise_generator(generator: torch.Generator | None, device: torch.device | str) -> torch.Generator | None:
    """The generator a batch draws its unseeded noise from, on ``device``: the engine's own when it
    is there already, else one seeded by a single draw from it (the engine's seed still decides
    every batch's noise, one scalar a batch crosses from the host)."""
    import torch

    if generator is None:
        return None
    dev = torch.device(device)
    gdev = generator.device
    if gdev.type == dev.type and (dev.index is None or gdev.index in (None, dev.index)):
        return generator
    seed = int(torch.randint(0, 2**62, (), generator=generator))
    return torch.Generator(device=dev).manual_seed(seed)


class _Sampler:
    """Vectorised sampling over the batch; per-request generators for seeded requests."""

    def __init__(
        self,
        rows: list[_Row],
        requests: list[GenerateParams],
        temps: torch.Tensor,
        generator: torch.Generator | None,
        device: torch.device,
    ) -> None:
        import torch

        self.temps = temps
        self.greedy = temps == 0  # [B]
        self.any_greedy = bool(self.greedy.any())
        self.scale = torch.where(self.greedy, torch.ones_like(temps), temps)[:, None]  # [B, 1]
        self.top_p = torch.tensor([r.params.top_p for r in rows], device=device)[:, None]  # [B, 1]
        self.top_k = [r.params.top_k for r in rows]
        self.truncate = any(r.params.top_p < 1.0 for r in rows) or any(k > 0 for k in self.top_k)
        self.want_alts = max((r.params.logprobs for r in rows), default=0)
        self.device = device
        # The [B, V] noise is drawn on the model's device (on the CPU it would cost each decode
        # step a vocabulary's worth of host random numbers and a copy).
        self.generator = noise_generator(generator, device)
        # Rows of a seeded request draw their noise from that request's own generator, on the
        # model's device too: the same seed gives the same tokens on the same device.
        self.seeded: list[tuple[int, int, torch.Generator]] = []
        start = 0
        for p in requests:
            if p.seed is not None:
                self.seeded.append((start, start + p.n, torch.Generator(device=device).manual_seed(p.seed)))
            start += p.n
        self.logp: torch.Tensor | None = None

    def sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, V] → (token ids [B], their log_softmax(logits / T) [B])."""
        import torch

        logp = torch.log_softmax(logits / self.scale, dim=-1)  # [B, V], untruncated
        self.logp = logp
        probs = logp.exp()
        if self.truncate:
            probs = self._truncate(probs)
        # Exponential race: argmax(p / E), E ~ Exp(1), draws from p (one vectorised op per step).
        noise = torch.empty(probs.shape, dtype=torch.float32, device=probs.device).exponential_(
            generator=self.generator
        )
        for lo, hi, gen in self.seeded:
            noise[lo:hi].exponential_(generator=gen)
        tokens = (probs / noise.clamp_min(1e-30)).argmax(dim=-1)  # [B]
        if self.any_greedy:
            tokens = torch.where(self.greedy, logits.argmax(dim=-1), tokens)
        return tokens, logp.gather(1, tokens[:, None])[:, 0]

    def _truncate(self, probs: torch.Tensor) -> torch.Tensor:
        import torch

        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always).
        before = sorted_p.cumsum(-1) - sorted_p
        keep = before < self.top_p
        ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        k = torch.tensor([kk if kk > 0 else probs.shape[-1] for kk in self.top_k], device=probs.device)[:, None]
        keep &= ranks < k
        return torch.zeros_like(probs).scatter(1, order, sorted_p * keep)

    def alternatives(self) -> list[list[tuple[int, float]]] | None:
        """The top ``logprobs`` alternatives of the last sampled step, per row."""
        if not self.want_alts or self.logp is None:
            return None
        vals, idx = self.logp.topk(self.want_alts, dim=-1)
        return [list(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)]


def _prompt_logprobs(
    logits: torch.Tensor, requests: list[GenerateParams], width: int
) -> list[list[dict[str, float] | None] | None]:
    """Teacher-forced logprobs of every prompt token: [None, {id: lp, ...}, ...] per request
    (the actual token, then the top-k alternatives). ``logits``: [R, W, V], one row per request."""
    import torch

    out: list[list[dict[str, float] | None] | None] = []
    for row, p in enumerate(requests):
        if p.prompt_logprobs is None:
            out.append(None)
            continue
        length = len(p.prompt_ids)
        t = p.temperature if p.temperature > 0 else 1.0
        # Column c predicts the token of column c + 1: the prompt's columns W-L .. W-2.
        lp = torch.log_softmax(logits[row, width - length : width - 1].float() / t, dim=-1)  # [L-1, V]
        actual = torch.tensor(p.prompt_ids[1:], device=lp.device)
        chosen = lp.gather(1, actual[:, None])[:, 0].tolist()
        top_vals: list[list[float]] = []
        top_idx: list[list[int]] = []
        if p.prompt_logprobs > 0:
            vals, idx = lp.topk(min(p.prompt_logprobs, lp.shape[-1]), dim=-1)
            top_vals, top_idx = vals.tolist(), idx.tolist()
        entries: list[dict[str, float] | None] = [None]
        for j, tok in enumerate(p.prompt_ids[1:]):
            entry = {str(tok): chosen[j]}
            if top_idx:
                for a, b in zip(top_idx[j], top_vals[j], strict=True):
                    entry.setdefault(str(a), b)
            entries.append(entry)
        out.append(entries)
    return out

"""The policy: loading, dtype and device, sanity checks, LoRA, the frozen reference, logprobs.

Any local Hugging Face causal LM (``builtin:tiny`` is one, built by ``atroposd.models``).
Checks that the predecessor lacked (LESSONS.md §3.1, §3.2, §3.8):

* the dtype is chosen from ``[inference] dtype`` and the device, and must be one of
  float32 / bfloat16 / float16 — the trainer and the inference server hold the same weights;
* no parameter or buffer is left on the meta device, nothing is silently zero-filled or
  randomly initialised: a weight the model has and the directory lacks refuses the model
  (strict load; tied aliases such as a tied ``lm_head`` are not missing). Tensors in the
  files that the model does not use are logged and ignored;
* every rotary ``inv_freq`` equals what the model's own rotary class computes from its config;
* the trainer's and the inference server's tokenizers have the same fingerprint (vocabulary
  and special ids) before any rollout — :func:`check_tokenizers`.

``token_scores`` computes log π(label) (and the entropy, the distillation term) only at the
trained positions: the decoder runs on the padded or packed batch, the vocabulary projection on
the N completion positions alone, at most ``logprob_chunk`` of them at a time
(:mod:`atroposd.trainer.logprobs`), so neither the ``[B, T, V]`` nor the ``[N, V]`` logits are
ever materialised, in the forward or the backward.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import structlog
import torch

from atroposd.trainer.logprobs import TokenScores, head_scores

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_CHUNK",
    "SEGMENT_SDPA",
    "LogprobModule",
    "ModelLoadError",
    "Policy",
    "TokenScores",
    "check_loading_info",
    "check_materialised",
    "check_rotary",
    "check_tokenizers",
    "load_policy",
    "packed_inputs",
    "token_logprobs",
    "token_scores",
    "use_segment_attention",
    "vocab_rows",
]

log = structlog.get_logger("trainer", component="trainer")  # lazy: bound at first use


class ModelLoadError(RuntimeError):
    """The model, its dtype/device or its tokenizer cannot be used; the message says why."""


@dataclass
class Policy:
    """What the loop trains: the model (PEFT-wrapped in LoRA mode), its tokenizer and source.

    reference: the frozen starting weights for ``kl_reference = "initial"`` in full mode (a
    separate copy); in LoRA mode the base model with the adapters disabled serves, at no
    memory cost; None when no reference is needed.
    """

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    source: Path
    device: torch.device
    dtype: torch.dtype
    lora: bool
    reference: torch.nn.Module | None = None
    use_adapter_off_reference: bool = False

    def reference_context(self) -> AbstractContextManager[Any]:
        """Context under which ``reference_model`` computes the reference logprobs."""
        if self.use_adapter_off_reference:
            ctx: AbstractContextManager[Any] = self.model.disable_adapter()  # type: ignore[operator]
            return ctx
        return nullcontext()

    @property
    def reference_model(self) -> torch.nn.Module | None:
        if self.use_adapter_off_reference:
            return self.model
        return self.reference

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding and of the output head (the smaller): valid ids are below it."""
        return vocab_rows(self.model)

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def preload(model_dir: Path) -> None:
    """Import what :func:`load_policy` will need for the model at ``model_dir`` (transformers, the
    model's own modeling module), reading no weights: seconds of imports that a caller can overlap
    with other work. Errors are left to :func:`load_policy`, which reports them."""
    try:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(str(model_dir)))]
    except Exception:  # an unreadable or unknown model: load_policy names the problem
        return


def load_policy(
    model_dir: Path,
    tokenizer_dir: Path,
    *,
    device: torch.device,
    dtype: torch.dtype,
    lora: Mapping[str, Any] | None = None,
    need_reference: bool = False,
    seed: int = 0,
    precision: Mapping[str, str] | None = None,
) -> Policy:
    """Load the model and tokenizer from local directories, checked, ready to train.

    lora: ``{"r", "alpha", "targets"}`` to wrap the model in PEFT LoRA adapters (only the
    adapters train); None for full fine-tuning.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {tokenizer_dir}: {exc}") from exc
    torch.manual_seed(seed)
    model: torch.nn.Module
    try:
        # with output_loading_info: (the model, what its loading found); transformers types the model alone
        model, info = cast(
            "tuple[torch.nn.Module, dict[str, Any]]",
            AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, output_loading_info=True),
        )
    except Exception as exc:  # OSError, ValueError, a size mismatch's RuntimeError, safetensors' own errors
        raise ModelLoadError(f"cannot load the model from {model_dir}: {type(exc).__name__}: {exc}") from exc
    check_loading_info(info, model_dir)
    check_materialised(model)  # before .to(): a meta tensor cannot be copied anywhere
    use_segment_attention(model)  # packed micro-batches attend per sequence (the reference copy too)
    model.to(device)
    model.eval()  # no dropout: the trainer must score tokens exactly as the sampler did
    check_rotary(model)
    vocab = len(tokenizer)
    rows = vocab_rows(model)
    if vocab > rows:
        raise ModelLoadError(
            f"the tokenizer at {tokenizer_dir} has {vocab} tokens but the model's embedding "
            f"(or output head) has only {rows} rows"
        )
    reference = None
    if need_reference and lora is None:
        reference = copy.deepcopy(model)
        reference.requires_grad_(False)
        reference.eval()
    if lora is not None:
        model = _wrap_lora(model, lora)
    policy = Policy(
        model=model,
        tokenizer=tokenizer,
        source=model_dir,
        device=device,
        dtype=dtype,
        lora=lora is not None,
        reference=reference,
        use_adapter_off_reference=need_reference and lora is not None,
    )
    log.info(
        "model loaded",
        source=str(model_dir),
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        parameters=sum(p.numel() for p in model.parameters()),
        trainable=sum(p.numel() for p in policy.trainable()),
        lora=policy.lora,
        **(precision or {}),
    )
    return policy


def vocab_rows(model: torch.nn.Module) -> int:
    """The number of token ids the model can embed and score: min(embedding rows, head rows)."""
    rows = [
        int(m.weight.shape[0])
        for m in (
            model.get_input_embeddings(),  # type: ignore[operator]
            getattr(model, "get_output_embeddings", lambda: None)(),
        )
        if m is not None and isinstance(getattr(m, "weight", None), torch.Tensor)
    ]
    if not rows:
        raise ModelLoadError("the model has no input embedding to read its vocabulary size from")
    return min(rows)


def _wrap_lora(model: torch.nn.Module, lora: Mapping[str, Any]) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    targets = list(lora["targets"])
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in names]
    if missing:
        raise ModelLoadError(
            f"trainer.lora_targets: no module named {', '.join(map(repr, missing))} in the model "
            f"(modules include {', '.join(sorted(n for n in names if n and not n.isdigit())[:12])})"
        )
    config = LoraConfig(
        r=int(lora["r"]),
        lora_alpha=int(lora["alpha"]),
        target_modules=targets,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    peft_model.eval()
    return peft_model


def check_loading_info(info: Mapping[str, Any], model_dir: Path) -> None:
    """Refuse weights the model has and the directory lacks (they would be random), or that
    differ in shape; log the directory's tensors the model does not use."""
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys") or ())
    if missing or mismatched:
        detail = "; ".join(
            part
            for part in (
                f"{len(missing)} missing ({', '.join(missing[:8])})" if missing else "",
                f"{len(mismatched)} of another shape ({', '.join(mismatched[:8])})" if mismatched else "",
            )
            if part
        )
        raise ModelLoadError(
            f"the model directory {model_dir} does not hold every weight of the model: {detail}; "
            "they would be initialised at random"
        )
    unexpected = sorted(info.get("unexpected_keys") or ())
    if unexpected:
        log.warning(
            "the model directory holds tensors the model does not use (ignored)",
            model=str(model_dir),
            count=len(unexpected),
            names=unexpected[:8],
        )


def check_materialised(model: torch.nn.Module) -> None:
    """Refuse a model with any tensor still on the meta device (never zero-fill it)."""
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ModelLoadError(
            f"{len(meta)} tensor(s) were not loaded (still on the meta device): " + ", ".join(meta[:8])
        )


def check_rotary(model: torch.nn.Module) -> None:
    """Every rotary ``inv_freq`` must equal what its own class computes from the config."""
    for name, module in model.named_modules():
        inv = getattr(module, "inv_freq", None)
        config = getattr(module, "config", None)
        if not isinstance(inv, torch.Tensor) or config is None or not name.endswith("rotary_emb"):
            continue
        expected = type(module)(config).inv_freq
        if expected.shape != inv.shape or not torch.allclose(
            inv.detach().float().cpu(), expected.float(), rtol=1e-5, atol=1e-7
        ):
            raise ModelLoadError(f"{name}.inv_freq differs from the model's own rotary initialisation")


def check_tokenizers(local: Mapping[str, Any], remote: Mapping[str, Any], *, local_name: str, remote_name: str) -> None:
    """Refuse to train when the two tokenizer fingerprints differ (vocabulary or special ids)."""
    keys = ("vocab_size", "fingerprint", "special_ids")
    diffs = [k for k in keys if local.get(k) != remote.get(k)]
    if diffs:
        detail = "; ".join(f"{k}: trainer {local.get(k)!r} vs inference {remote.get(k)!r}" for k in diffs)
        raise ModelLoadError(
            f"tokenizer mismatch between the trainer ({local_name}) and the inference server ({remote_name}): {detail}"
        )


def _decoder_and_head(model: torch.nn.Module) -> tuple[Callable[..., Any], torch.nn.Module] | None:
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    decoder, head = get_decoder(), get_head()
    if decoder is None or head is None or decoder is model:
        return None
    return decoder, head


DEFAULT_CHUNK = 1024  # [trainer] logprob_chunk's default


class LogprobModule(torch.nn.Module):
    """:func:`token_scores` as one module call. With several ranks it is FSDP2's root unit
    around the model (the model's own embedding, norm and head are gathered by its hooks around
    the whole computation); ``token_scores`` on the model then goes through it."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        labels: torch.Tensor,
        temperature: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
        teacher_ids: torch.Tensor | None = None,
        teacher_probs: torch.Tensor | None = None,
        *,
        chunk: int = DEFAULT_CHUNK,
        tau: float = 1.0,
        entropy: bool = False,
    ) -> TokenScores:
        return _token_scores(
            self.model,
            input_ids,
            mask,
            labels,
            temperature,
            seq_lens=seq_lens,
            teacher=(teacher_ids, teacher_probs) if teacher_ids is not None and teacher_probs is not None else None,
            chunk=chunk,
            tau=tau,
            entropy=entropy,
        )

    def install(self) -> None:
        """Route ``token_scores(model, ...)`` through this module (a plain attribute, not a
        submodule: the model must not contain its own wrapper)."""
        object.__setattr__(self.model, ROOT_ATTR, self)


ROOT_ATTR = "_atroposd_logprob_root"


def token_scores(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    labels: torch.Tensor,
    temperature: torch.Tensor,
    *,
    seq_lens: torch.Tensor | None = None,
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
    chunk: int = DEFAULT_CHUNK,
    tau: float = 1.0,
    entropy: bool = False,
) -> TokenScores:
    """The policy's scores at the N positions where ``mask`` is set, the LM head applied
    ``chunk`` positions at a time (:mod:`atroposd.trainer.logprobs`; through the model's
    :class:`LogprobModule` when it has one).

    input_ids, labels: [B, T] long; mask: [B, T] bool; temperature: one per sequence — [B] for
    padded rows, [S] for one packed row of S sequences of ``seq_lens`` [S] tokens (attention
    never crosses them, positions restart at 0 in each). teacher: (ids [N, K], probabilities
    [N, K]) at the masked positions, for the distillation term at temperature ``tau``.
    """
    root = model.__dict__.get(ROOT_ATTR)
    if root is not None:
        t_ids, t_probs = teacher if teacher is not None else (None, None)
        out: TokenScores = root(
            input_ids, mask, labels, temperature, seq_lens, t_ids, t_probs, chunk=chunk, tau=tau, entropy=entropy
        )
        return out
    return _token_scores(
        model,
        input_ids,
        mask,
        labels,
        temperature,
        seq_lens=seq_lens,
        teacher=teacher,
        chunk=chunk,
        tau=tau,
        entropy=entropy,
    )


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    labels: torch.Tensor,
    temperature: torch.Tensor,
    *,
    seq_lens: torch.Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / T)[label] at the N positions where ``mask`` is set, and the entropy
    there when asked (:func:`token_scores`). Returns (logp [N] float32, entropy [N] or None)."""
    scores = token_scores(model, input_ids, mask, labels, temperature, seq_lens=seq_lens, chunk=chunk, entropy=entropy)
    return scores.logp, scores.entropy


SEGMENT_SDPA = "atroposd_segment_sdpa"  # the trainer's attention on CPU and GPU without flash attention


def _segment_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """SDPA, and for one packed row (``cu_seq_lens_q``: the sequences' bounds) causal SDPA over each
    sequence alone — what flash attention's varlen kernel does, without the ``[T, T]`` block mask
    whose fully masked blocks SDPA would compute anyway."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:
        out: tuple[torch.Tensor, None] = sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            position_bias=position_bias,
            **kwargs,
        )
        return out
    # One split per tensor, not a slice per sequence: a slice's backward writes its gradient into a
    # zeroed tensor of the whole row (S sequences: S full-length zero-fills and adds per tensor and
    # layer, most of the packed row's attention time); a split's backward is one concatenation.
    sizes = [b - a for a, b in itertools.pairwise(int(x) for x in cu_seq_lens_q.tolist())]
    parts = [
        sdpa_attention_forward(
            module,
            q,
            k,
            v,
            None,
            dropout=dropout,
            scaling=scaling,
            is_causal=True,
            position_bias=position_bias,
            **kwargs,
        )[0]  # [1, L, heads, D]
        for q, k, v, n in zip(query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2), sizes, strict=True)
        if n > 0
    ]
    return torch.cat(parts, dim=1), None


def use_segment_attention(model: torch.nn.Module) -> bool:
    """Give an SDPA model :func:`_segment_sdpa` (the same attention for padded rows, per sequence for
    packed ones). Models with sliding-window layers keep theirs (packed, they take the block mask)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", SEGMENT_SDPA):
        return False
    windowed = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    if windowed or any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SEGMENT_SDPA, _segment_sdpa)
    AttentionMaskInterface.register(SEGMENT_SDPA, sdpa_mask)
    model.set_attn_implementation(SEGMENT_SDPA)  # type: ignore[operator]
    return True


def packed_inputs(model: torch.nn.Module, seq_lens: torch.Tensor, length: int) -> dict[str, Any]:
    """The decoder's keyword arguments for one row of packed sequences (``seq_lens`` [S] summing to
    ``length``): positions restarting at 0 in each sequence, and attention that never crosses
    them — by the sequences' bounds for flash attention's varlen kernel (GPU) and for
    :func:`_segment_sdpa`; by a block-diagonal causal mask otherwise (SDPA: a boolean
    ``[1, 1, T, T]`` one; eager attention: an additive one)."""
    device = seq_lens.device
    starts = torch.cumsum(seq_lens, 0) - seq_lens  # [S]
    seq = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), seq_lens)  # [T]
    positions = torch.arange(length, device=device) - starts[seq]  # [T]
    out: dict[str, Any] = {"position_ids": positions[None, :]}
    impl = str(getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa")
    if impl.startswith("flash_attention") or impl == SEGMENT_SDPA:
        bounds = torch.cat([starts, starts[-1:] + seq_lens[-1:]]).to(torch.int32)  # [S + 1]
        longest = int(seq_lens.max())
        out.update(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=longest, max_length_k=longest)
        if impl == SEGMENT_SDPA:  # a padding mask of ones: no causal mask is built, none detected from positions
            out["attention_mask"] = torch.ones(1, length, dtype=torch.long, device=device)
        return out  # flash attention (GPU; not run here): the varlen kernel takes the bounds
    idx = torch.arange(length, device=device)
    allowed = (seq[:, None] == seq[None, :]) & (idx[None, :] <= idx[:, None])  # [T, T] same sequence, causal
    if impl == "eager":
        dtype = next(model.parameters()).dtype
        out["attention_mask"] = torch.full(
            (length, length), torch.finfo(dtype).min, dtype=dtype, device=device
        ).masked_fill(allowed, 0.0)[None, None]
    else:
        out["attention_mask"] = allowed[None, None]
    return out


def _token_scores(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    labels: torch.Tensor,
    temperature: torch.Tensor,
    *,
    seq_lens: torch.Tensor | None,
    teacher: tuple[torch.Tensor, torch.Tensor] | None,
    chunk: int,
    tau: float,
    entropy: bool,
) -> TokenScores:
    if seq_lens is None:
        temps = temperature[:, None].expand_as(mask)[mask]  # [N]
        extra: dict[str, Any] = {}
    else:
        temps = torch.repeat_interleave(temperature, seq_lens)[None, :].expand_as(mask)[mask]  # [N]
        extra = packed_inputs(model, seq_lens, int(mask.shape[1]))
    parts = _decoder_and_head(model)
    if parts is not None:
        decoder, head = parts
        hidden = decoder(input_ids=input_ids, use_cache=False, **extra).last_hidden_state  # [B, T, H]
        return head_scores(
            hidden[mask], head, labels[mask], temps, chunk=chunk, teacher=teacher, tau=tau, entropy=entropy
        )
    # A model without a separable head: its full logits, then the same scores from them.
    logits = model(input_ids=input_ids, use_cache=False, **extra).logits[mask].float()  # [N, V]
    return head_scores(
        logits, torch.nn.Identity(), labels[mask], temps, chunk=chunk, teacher=teacher, tau=tau, entropy=entropy
    )

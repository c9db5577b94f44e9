"""Forward passes with a KV cache, as the torch engine's decoding loop needs them.

A stepper runs the prompt (``prefill``), then one token per row at a time (``step``), and can
reorder or shrink its batch (``select``). Two implementations:

* :class:`HFStepper` — the model's own forward with ``past_key_values``: any Hugging Face
  causal LM.
* :class:`LlamaStepper` — the same arithmetic as transformers' Llama written out flat, for
  plain Llama models (default RoPE, no biases, SiLU, plain ``nn.Linear`` projections). A tiny
  model spends most of a forward pass in Python module overhead, which this avoids
  (``benchmarks/bench_inference.py`` measures it). It reads the weights from the model's modules at every call,
  so weights rebound into shared memory are used as they are. Anything else (LoRA layers,
  rope scaling, biases) goes through :class:`HFStepper`; :func:`make_stepper` decides per batch.

Shapes: B rows, T new tokens per row, S cached positions, V vocabulary.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.cache_utils import Cache

__all__ = ["HFStepper", "LlamaStepper", "make_stepper"]


def make_stepper(model: PreTrainedModel) -> HFStepper | LlamaStepper:
    return LlamaStepper(model) if LlamaStepper.supports(model) else HFStepper(model)


class HFStepper:
    """The model's own forward with its cache object."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.cache: Cache | None = None
        self.mask: torch.Tensor | None = None  # [B, S] 1 = a real token
        # transformers 5.24 renamed the cache argument and output field ``past_key_values`` to
        # ``cache`` (the old name warns); older releases only know the old one.
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, *, all_logits: bool
    ) -> torch.Tensor:
        """ids, mask, positions [B, T] (left-padded) → logits [B, T, V] (or [B, 1, V])."""
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
        )
        self.cache, self.mask = _returned_cache(out), mask
        logits: torch.Tensor = out.logits
        return logits

    def select(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (in that order; repeats fan a row out)."""
        assert self.mask is not None and self.cache is not None
        self.cache.reorder_cache(index)  # type: ignore[arg-type]  # a long tensor (LongTensor is no static type)
        self.mask = self.mask[index]

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions [B, 1] → logits of the next token [B, V]."""
        assert self.mask is not None
        self.mask = torch.cat([self.mask, torch.ones_like(tokens)], dim=1)
        out = self.model(
            input_ids=tokens,
            attention_mask=self.mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_arg: self.cache},
        )
        self.cache = _returned_cache(out)
        last: torch.Tensor = out.logits[:, -1, :]
        return last


def _returned_cache(out: object) -> Cache:
    """The cache a forward returned: ``out.cache`` (transformers ≥ 5.24), else ``out.past_key_values``."""
    if "cache" in getattr(out, "__dataclass_fields__", {}):
        cache: Cache = getattr(out, "cache")  # noqa: B009 (transformers < 5.24 has no such field)
        return cache
    past: Cache = getattr(out, "past_key_values")  # noqa: B009
    return past


class LlamaStepper:
    """transformers' Llama forward, flat (see the module docstring for when it applies)."""

    def __init__(self, model: PreTrainedModel) -> None:
        cfg = model.config
        self.model = model
        self.layers = list(model.model.layers)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.eps = float(cfg.rms_norm_eps)
        embedding = model.get_input_embeddings().weight
        assert isinstance(embedding, torch.Tensor)
        device = embedding.device
        theta = float(_rope(cfg)["rope_theta"])
        self.inv_freq = 1.0 / theta ** (
            torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        )  # [D/2]
        self.keys: list[torch.Tensor] = []  # per layer [B, Hkv, S, D]
        self.values: list[torch.Tensor] = []
        self.valid: torch.Tensor | None = None  # [B, S] bool: a real token

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        cfg = getattr(model, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) != "llama":
            return False
        rope = _rope(cfg)
        if not rope or rope.get("rope_type", "default") != "default" or "rope_theta" not in rope:
            return False
        if set(rope) - {"rope_theta", "rope_type"}:
            return False  # any scaling parameter: leave it to the model's own rotary embedding
        if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
            return False
        if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
            return False
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or type(model.lm_head) is not torch.nn.Linear:
            return False
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
            if any(type(x) is not torch.nn.Linear or x.bias is not None for x in linears):
                return False  # e.g. LoRA layers: only the model's own forward applies them
        return True

    def prefill(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, *, all_logits: bool
    ) -> torch.Tensor:
        valid = mask.bool()  # [B, T]
        width = ids.shape[1]
        causal = torch.ones((width, width), dtype=torch.bool, device=ids.device).tril()
        eye = torch.eye(width, dtype=torch.bool, device=ids.device)
        # A padding query sees itself only: every row of the softmax keeps a finite value.
        attend = (causal[None] & valid[:, None, :]) | eye[None]  # [B, T, T]
        self.keys, self.values, self.valid = [], [], valid
        hidden = self._forward(ids, positions, attend[:, None], prefill=True)  # [B, T, H]
        if not all_logits:
            hidden = hidden[:, -1:]
        return F.linear(hidden, self.model.lm_head.weight)

    def select(self, index: torch.Tensor) -> None:
        assert self.valid is not None
        self.keys = [k[index] for k in self.keys]
        self.values = [v[index] for v in self.values]
        self.valid = self.valid[index]

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert self.valid is not None
        self.valid = torch.cat([self.valid, torch.ones_like(tokens, dtype=torch.bool)], dim=1)  # [B, S+1]
        hidden = self._forward(tokens, positions, self.valid[:, None, None, :], prefill=False)  # [B, 1, H]
        return F.linear(hidden[:, -1], self.model.lm_head.weight)

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor, *, prefill: bool
    ) -> torch.Tensor:
        batch, width = ids.shape
        x = F.embedding(ids, self.model.model.embed_tokens.weight)  # [B, T, H]
        cos, sin = self._rotary(positions, x.dtype)  # [B, 1, T, D]
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            h = self._norm(x, layer.input_layernorm.weight)
            q = F.linear(h, a.q_proj.weight).view(batch, width, self.heads, self.head_dim).transpose(1, 2)
            k = F.linear(h, a.k_proj.weight).view(batch, width, self.kv_heads, self.head_dim).transpose(1, 2)
            v = F.linear(h, a.v_proj.weight).view(batch, width, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            if prefill:
                self.keys.append(k)
                self.values.append(v)
            else:
                self.keys[i] = k = torch.cat([self.keys[i], k], dim=2)  # [B, Hkv, S+1, D]
                self.values[i] = v = torch.cat([self.values[i], v], dim=2)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attend, enable_gqa=self.kv_heads != self.heads
            )  # [B, Hq, T, D]
            x = x + F.linear(out.transpose(1, 2).reshape(batch, width, -1), a.o_proj.weight)
            h = self._norm(x, layer.post_attention_layernorm.weight)
            m = layer.mlp
            x = x + F.linear(
                F.silu(F.linear(h, m.gate_proj.weight)) * F.linear(h, m.up_proj.weight), m.down_proj.weight
            )
        return self._norm(x, self.model.model.norm.weight)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # As LlamaRMSNorm: normalise in float32, scale in the input's dtype.
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rope(cfg: object) -> dict[str, Any]:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if isinstance(params, dict) and params:
        return params
    theta = getattr(cfg, "rope_theta", None)
    return {"rope_theta": theta, "rope_type": "default"} if theta is not None else {}

"""FSDP2 for the trainer ranks (SPEC §12.1): how a model is sharded (``shard_model``: one unit per
decoder layer, then the root), its activations recomputed (``checkpoint_activations``), and full
tensors gathered back from the shards (``gather_full``, ``full_tensor``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["checkpoint_activations", "decoder_layers", "full_tensor", "gather_full", "shard_model"]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter; a collective for a DTensor."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def gather_full(model: torch.nn.Module, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The full tensors ``names`` of a sharded model, on every rank (collectives, in the same
    order on every rank). Each FSDP2 unit that holds one of them is unsharded once — one
    all-gather for the whole unit, not one per tensor — its tensors copied out, then resharded."""
    from torch.distributed.fsdp import FSDPModule

    from atroposd.trainer.model import ROOT_ATTR

    units = sorted(
        ((prefix + ".", m) for prefix, m in model.named_modules() if prefix and isinstance(m, FSDPModule)),
        key=lambda u: -len(u[0]),
    )
    root = model.__dict__.get(ROOT_ATTR)
    by_unit: dict[int, tuple[Any, list[str]]] = {}
    order: list[int] = []
    for name in names:
        unit = next((m for prefix, m in units if name.startswith(prefix)), root)
        key = id(unit)
        if key not in by_unit:
            by_unit[key] = (unit, [])
            order.append(key)
        by_unit[key][1].append(name)
    out: dict[str, torch.Tensor] = {}
    for key in order:
        unit, members = by_unit[key]
        if isinstance(unit, FSDPModule):
            unit.unshard()
        try:
            for name in members:
                out[name] = full_tensor(_named_tensor(model, name).detach()).clone()
        finally:
            if isinstance(unit, FSDPModule):
                unit.reshard()
    return out


def _named_tensor(model: torch.nn.Module, name: str) -> torch.Tensor:
    try:
        return model.get_parameter(name)
    except AttributeError:
        return model.get_buffer(name)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM (``model.model.layers`` and the like)."""
    base: object = model
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        base = get_decoder() or model
    layers = getattr(base, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers):
        return list(layers)
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    return list(lists[0]) if lists else []


def checkpoint_activations(layers: Sequence[torch.nn.Module]) -> None:
    """Recompute each layer's activations in the backward pass (the layer's names unchanged)."""
    from torch.utils.checkpoint import checkpoint

    for layer in layers:
        forward = layer.forward

        def wrapped(*args: object, _forward: Callable[..., object] = forward, **kwargs: Any) -> object:
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = wrapped


def shard_model(model: torch.nn.Module, *, mixed_precision: bool) -> None:
    """FSDP2: ``fully_shard`` per decoder layer, then the root; ``mixed_precision``: bf16
    parameters and float32 reduction (on a GPU; any device may ask for it), the root's own
    inputs never cast.

    The root unit is the model's :class:`~atroposd.trainer.model.LogprobModule`: the trainer
    calls the decoder and the head itself (never the full logits), so the hooks that gather
    the embedding, norm and head must surround that whole call."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from atroposd.trainer.model import LogprobModule

    kw: dict[str, Any] = {}
    root_kw: dict[str, Any] = {}
    if mixed_precision:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # The root's inputs stay as the trainer gives them: the policy would cast every
        # floating-point argument (cast_forward_inputs), the sampling temperature (0.7 becomes
        # 0.69921875) and the teacher's probabilities with them (SPEC §12.1).
        root_kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    for layer in decoder_layers(model):
        fully_shard(layer, **kw)
    root = LogprobModule(model)
    fully_shard(root, **root_kw)
    root.install()

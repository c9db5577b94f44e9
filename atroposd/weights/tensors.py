"""Which tensors of a model travel, under which names, and how they are checked.

Both sides call :func:`model_tensors` on their own model, so exporter and importer agree on
names without either one guessing: every parameter and every *persistent* buffer, each
storage once (a tied ``lm_head.weight`` is an alias of ``model.embed_tokens.weight``, not a
second tensor). PEFT's wrapper prefix ``base_model.model.`` is dropped so that a trainer's
PEFT model and an inference model with the same adapters injected use the same names.
Non-persistent buffers (rotary ``inv_freq``) are never exported: each side computes its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from atroposd.weights.manifest import ALLOWED_DTYPES, ManifestError, TensorSpec, match_tensors

__all__ = [
    "CHECKSUM_ELEMENTS",
    "ModelTensors",
    "checksum",
    "dtype_name",
    "lora_spec",
    "match_tensors",
    "model_tensors",
    "tensor_digest",
    "torch_dtype",
]

CHECKSUM_ELEMENTS = 4096
PEFT_PREFIX = "base_model.model."

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ManifestError(f"dtype {dtype} cannot be exchanged (allowed: {', '.join(ALLOWED_DTYPES)})")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ManifestError(f"dtype {name!r} is not allowed (allowed: {', '.join(ALLOWED_DTYPES)})") from None


def checksum(t: torch.Tensor) -> float:
    """float64 sum of the first CHECKSUM_ELEMENTS elements (any shape; NaN-safe compare)."""
    flat = t.detach().reshape(-1)[:CHECKSUM_ELEMENTS]
    return float(flat.to(torch.float64).sum().item())


def same_checksum(a: float | None, b: float) -> bool:
    if a is None:
        return True
    if a != a and b != b:  # both NaN
        return True
    return abs(a - b) <= 1e-9 * max(1.0, abs(a))


@dataclass
class ModelTensors:
    """A model's exchangeable tensors.

    tensors: canonical name → the live tensor (a Parameter or a persistent buffer).
    tied: alias name → canonical name (same storage).
    owners: canonical name → (module, attribute, is_parameter), for rebinding.
    """

    tensors: dict[str, torch.Tensor]
    tied: dict[str, str]
    owners: dict[str, list[tuple[torch.nn.Module, str, bool]]]

    def specs(self) -> dict[str, TensorSpec]:
        return {n: TensorSpec(dtype_name(t.dtype), tuple(t.shape)) for n, t in self.tensors.items()}

    def rebind(self, name: str, new: torch.Tensor) -> None:
        """Point the canonical tensor ``name`` (and every alias of it) at ``new``'s memory.

        new: a tensor of the same dtype and shape. Parameters keep their identity (optimizer
        state stays attached); only their ``.data`` changes.
        """
        for module, attr, is_param in self.owners[name]:
            if is_param:
                module._parameters[attr].data = new  # type: ignore[union-attr]
            else:
                module._buffers[attr] = new
        self.tensors[name] = _current(self.owners[name][0])


def _current(owner: tuple[torch.nn.Module, str, bool]) -> torch.Tensor:
    module, attr, is_param = owner
    t = module._parameters[attr] if is_param else module._buffers[attr]
    assert t is not None
    return t


def _strip(name: str) -> str:
    return name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name


def model_tensors(model: torch.nn.Module) -> ModelTensors:
    """Collect a model's parameters and persistent buffers, each storage once."""
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    owners: dict[str, list[tuple[torch.nn.Module, str, bool]]] = {}
    by_id: dict[int, str] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is None:
                continue
            full = _strip(f"{mod_name}.{attr}" if mod_name else attr)
            _add(full, p, (module, attr, True), tensors, tied, owners, by_id)
        for attr, b in module._buffers.items():
            if b is None:
                continue
            if attr in module._non_persistent_buffers_set:
                continue
            raw = f"{mod_name}.{attr}" if mod_name else attr
            _add(_strip(raw), b, (module, attr, False), tensors, tied, owners, by_id)
    return ModelTensors(tensors, tied, owners)


def _add(
    name: str,
    t: torch.Tensor,
    owner: tuple[torch.nn.Module, str, bool],
    tensors: dict[str, torch.Tensor],
    tied: dict[str, str],
    owners: dict[str, list[tuple[torch.nn.Module, str, bool]]],
    by_id: dict[int, str],
) -> None:
    canonical = by_id.get(id(t))
    if canonical is None:
        by_id[id(t)] = name
        tensors[name] = t
        owners[name] = [owner]
        return
    if name != canonical and name not in tied:
        tied[name] = canonical
    if owner not in owners[canonical]:
        owners[canonical].append(owner)


def lora_spec(model: torch.nn.Module) -> dict[str, Any] | None:
    """The LoRA structure of a PEFT model (what an importer must inject), or None."""
    peft_config = getattr(model, "peft_config", None)
    if not peft_config:
        return None
    cfg = peft_config.get("default") or next(iter(peft_config.values()))
    targets = cfg.target_modules
    return {
        "r": int(cfg.r),
        "alpha": int(cfg.lora_alpha),
        "targets": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets,
        "dropout": float(getattr(cfg, "lora_dropout", 0.0) or 0.0),
    }


def ensure_lora(model: torch.nn.Module, spec: Mapping[str, Any] | None) -> None:
    """Inject the exporter's LoRA adapters into an importer's plain model (once)."""
    if spec is None:
        return
    if any("lora_A" in n for n, _ in model.named_parameters()):
        return
    from peft import LoraConfig, inject_adapter_in_model

    cfg = LoraConfig(
        r=int(spec["r"]),
        lora_alpha=int(spec["alpha"]),
        target_modules=spec["targets"],
        lora_dropout=float(spec.get("dropout", 0.0)),
    )
    inject_adapter_in_model(cfg, model)


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (contiguous, on the CPU): equal digests, equal bits."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()

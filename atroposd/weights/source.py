"""Where a weight sync reads the trainer's weights from: a :class:`TensorSource`.

A source hands out the trainer's *full* (unsharded) tensors in the model's canonical naming,
as :func:`atroposd.weights.tensors.model_tensors` sees them: every storage once (a tied alias
such as ``lm_head.weight`` is not a tensor of its own but an entry of ``tied()``), plus the
LoRA structure of a PEFT model. With one trainer rank the source is the model itself
(:class:`ModelSource`: ``gather`` returns the live tensors, nothing is copied); with several
FSDP2 ranks a source gathers the named tensors' shards (``full_tensor()``) on every rank and
returns them on rank 0.

The bucketed push and the sharded reload ask for the tensors a bucket at a time
(:func:`plan_buckets`), so the extra memory a sync needs on the trainer's side is one bucket,
never a second model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from atroposd.weights.manifest import ALIGNMENT, TensorSpec, itemsize
from atroposd.weights.tensors import dtype_name, lora_spec, model_tensors

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "ModelSource",
    "SourceCache",
    "SourceFor",
    "TensorSource",
    "bucket_bytes_of",
    "check_gathered",
    "plan_buckets",
    "spec_nbytes",
]

# ``[trainer] sync_bucket_mb`` = 512
DEFAULT_BUCKET_BYTES = 512 << 20


@runtime_checkable
class TensorSource(Protocol):
    """The trainer's full tensors, by canonical name (see the module docstring)."""

    def specs(self) -> dict[str, TensorSpec]:
        """Every canonical tensor's dtype name and full (unsharded) shape, in the model's order."""
        ...

    def tied(self) -> dict[str, str]:
        """Alias name → canonical name (the same storage; the alias is never gathered)."""
        ...

    def lora(self) -> dict[str, Any] | None:
        """The LoRA structure an importer must inject (``tensors.lora_spec``), or None."""
        ...

    async def gather(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The full tensors ``names`` (a subset of ``specs()``), on the trainer's device.

        The caller only reads them and drops them before the next call."""
        ...


class ModelSource:
    """One trainer rank: the model's own tensors (``gather`` copies nothing)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def specs(self) -> dict[str, TensorSpec]:
        return model_tensors(self.model).specs()

    def tied(self) -> dict[str, str]:
        return dict(model_tensors(self.model).tied)

    def lora(self) -> dict[str, Any] | None:
        return lora_spec(self.model)

    async def gather(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        tensors = model_tensors(self.model).tensors
        missing = [n for n in names if n not in tensors]
        if missing:
            raise KeyError(f"the model has no tensor {missing[0]!r}")
        return {n: tensors[n].detach() for n in names}


#: The trainer's function giving a model's tensor source (``ModelSource`` with one rank; with
#: several, a source that gathers the ranks' shards), given to the weight sync when it is made.
SourceFor = Callable[[torch.nn.Module], TensorSource]


class SourceCache:
    """``source_for(model)``, made once per model (a new model: a new source)."""

    def __init__(self, source_for: SourceFor = ModelSource) -> None:
        self.source_for = source_for
        self._source: tuple[torch.nn.Module, TensorSource] | None = None

    def __call__(self, model: torch.nn.Module) -> TensorSource:
        if self._source is None or self._source[0] is not model:
            self._source = (model, self.source_for(model))
        return self._source[1]

    def forget(self) -> None:
        self._source = None


def spec_nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * itemsize(spec.dtype)


def _aligned(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def plan_buckets(specs: Mapping[str, TensorSpec], bucket_bytes: int) -> list[list[str]]:
    """Cut the tensors, in order, into buckets of at most ``bucket_bytes`` (each tensor counted
    with its 64-byte alignment, as it lies in the staging buffer); a tensor larger than a bucket
    gets a bucket of its own. Every name appears exactly once."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[str]] = []
    used = 0
    for name, spec in specs.items():
        size = _aligned(spec_nbytes(spec))
        if not buckets or (used + size > bucket_bytes and buckets[-1]):
            buckets.append([])
            used = 0
        buckets[-1].append(name)
        used += size
    return buckets


def bucket_bytes_of(specs: Mapping[str, TensorSpec], names: Sequence[str]) -> int:
    """The bytes ``names`` take in a staging buffer (each tensor 64-byte aligned)."""
    return sum(_aligned(spec_nbytes(specs[n])) for n in names)


def check_gathered(specs: Mapping[str, TensorSpec], names: Sequence[str], got: Mapping[str, torch.Tensor]) -> None:
    """Raise ValueError unless ``got`` holds exactly ``names``, each with its spec's dtype and shape."""
    if set(got) != set(names):
        missing = sorted(set(names) - set(got))
        extra = sorted(set(got) - set(names))
        raise ValueError(f"the tensor source returned the wrong tensors (missing {missing}, extra {extra})")
    for n in names:
        t, spec = got[n], specs[n]
        if dtype_name(t.dtype) != spec.dtype or tuple(t.shape) != tuple(spec.shape):
            raise ValueError(
                f"the tensor source returned {n!r} as {dtype_name(t.dtype)} {list(t.shape)}; its spec "
                f"says {spec.dtype} {list(spec.shape)} (a shard instead of the full tensor?)"
            )

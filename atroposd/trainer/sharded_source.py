"""The weight sync's view of the trainer's sharded model (SPEC §12.1, §12.3): full tensors gathered
on rank 0's compute thread with every rank taking part."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from atroposd.trainer.fsdp import gather_full
from atroposd.trainer.group import Command, Gather, Push, Reload

if TYPE_CHECKING:
    from atroposd.trainer.compute import ComputeThread

__all__ = ["ShardedSource"]


class Ranks(Protocol):
    """What the source needs of the trainer's ranks (``atroposd.trainer.ranks.Ranks``): rank 0's
    commands to the others."""

    def command(self, command: Command) -> None: ...


class ShardedSource:
    """The weight sync's view of a sharded model (SPEC §12.1; a ``weights.source.TensorSource``):
    full tensors gathered on rank 0's compute thread, every rank taking part (``gather``
    command), one bucket at a time. ``specs`` and ``tied`` were taken before sharding."""

    def __init__(
        self, model: torch.nn.Module, ranks: Ranks, compute: ComputeThread, specs: dict[str, Any], tied: dict[str, str]
    ) -> None:
        self.model = model
        self.ranks = ranks
        self.compute = compute
        self._specs = specs
        self._tied = tied
        self._next: dict[str, int] | None = None

    def specs(self) -> dict[str, Any]:
        return dict(self._specs)

    def announce(self, index: int, count: int, version: int) -> None:
        """The next gather is bucket ``index`` of ``count`` of a push of ``version``: the other
        nodes' first ranks feed their own replicas from it (SPEC §12.3, Weights)."""
        self._next = {"index": index, "count": count, "version": version}

    def tied(self) -> dict[str, str]:
        return dict(self._tied)

    def lora(self) -> dict[str, Any] | None:
        return None  # LoRA is refused with several ranks (config check)

    async def announce_reload(self, path: Path, version: int) -> None:
        """A ``reload`` wrote ``version`` at ``path`` (on the shared file system): the other nodes'
        first ranks have their own replicas load it."""
        await self.compute.run(self.ranks.command, Reload(str(path), version))

    def _gather(self, names: Sequence[str], push: dict[str, int] | None) -> dict[str, torch.Tensor]:
        self.ranks.command(Gather(tuple(names), None if push is None else Push(**push)))
        return gather_full(self.model, names)

    async def gather(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        push, self._next = self._next, None
        return await self.compute.run(self._gather, list(names), push)

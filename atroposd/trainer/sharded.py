"""Checkpoints of several trainer ranks (SPEC §12.1): the model gathered in Hugging Face layout,
the optimizer state sharded through torch.distributed.checkpoint (DCP).

``step-N/`` keeps the one-rank layout (``model.safetensors``, config, tokenizer,
``trainer_state.pt``, ``checksums.json``) — the gathered weights are written by rank 0 — plus
``optimizer/``: every rank's optimizer shard and DCP's metadata. ``trainer_state.pt`` then
holds ``"optimizer": None``, ``"ranks": N`` and ``"optimizer_dcp": "optimizer"``. The directory
is renamed complete by rank 0 after every rank finished writing (DCP's save ends with a
collective), so a complete ``step-N`` always holds every shard.

Resume with any rank count: the weights are loaded in full before sharding; the optimizer state
comes from DCP (resharded by it to the new rank count, or gathered into one process without a
process group) or, from a one-rank checkpoint, from its index-keyed state dict turned into
parameter names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from atroposd.logs import get_logger

__all__ = ["OPTIMIZER_DIR", "check_shards", "gathered_weights", "load_optimizer", "save_optimizer", "tied_aliases"]

log = get_logger(__name__)

OPTIMIZER_DIR = "optimizer"


def tied_aliases(model: torch.nn.Module) -> set[str]:
    """Names of the state dict that alias an earlier tensor (a tied ``lm_head.weight``): dropped
    from the written weights as Hugging Face does. Call before sharding."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    aliases: set[str] = set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:
            aliases.add(name)
        seen.add(key)
    return aliases


def gathered_weights(model: torch.nn.Module, aliases: set[str]) -> dict[str, torch.Tensor]:
    """Every rank calls this (collectives); rank 0 gets the full weights on the CPU, the others {}."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.contiguous() for k, v in full.items() if k not in aliases and isinstance(v, torch.Tensor)}


def save_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Every rank writes its optimizer shard under ``path`` (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optimizer)
    dcp.save({"optimizer": osd}, checkpoint_id=str(path))


def check_shards(path: Path, world: int) -> None:
    """Raise CheckpointError unless ``path`` holds DCP's metadata and one shard file of every
    rank (``__<rank>_0.distcp``): with several machines a ``checkpoint_dir`` that is not shared
    leaves the other nodes' shards on their own disks."""
    from atroposd.trainer.checkpoint import CheckpointError

    expected = [".metadata", *(f"__{r}_0.distcp" for r in range(world))]
    missing = [name for name in expected if not (path / name).is_file()]
    if missing:
        shown = ", ".join(str(path / name) for name in missing[:4]) + (" ..." if len(missing) > 4 else "")
        raise CheckpointError(f"the checkpoint misses {len(missing)} of its {world} ranks' files: {shown}; "
                              "trainer.checkpoint_dir must be a directory every node sees (a shared file system)")


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                   checkpoint: Path, *, world: int) -> None:
    """Restore the optimizer of a (sharded or not) model from either checkpoint layout."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    saved_ranks = int(state.get("ranks", 1))
    if state.get("optimizer_dcp"):
        import torch.distributed.checkpoint as dcp

        osd = get_optimizer_state_dict(model, optimizer)
        box = {"optimizer": osd}
        dcp.load(box, checkpoint_id=str(checkpoint / str(state["optimizer_dcp"])),
                 no_dist=world == 1)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=box["optimizer"])
    elif world == 1:
        optimizer.load_state_dict(state["optimizer"])
    else:
        full = _named_optimizer_state(model, optimizer, state["optimizer"])
        set_optimizer_state_dict(model, optimizer, optim_state_dict=full,
                                 options=StateDictOptions(full_state_dict=True))
    if saved_ranks != world:
        log.info("optimizer state resharded", checkpoint=str(checkpoint), saved_ranks=saved_ranks, ranks=world)


def _named_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                           indexed: dict[str, Any]) -> dict[str, Any]:
    """A one-rank optimizer state dict (keyed by parameter index, in the optimizer's order) keyed
    by parameter name instead, as torch.distributed.checkpoint's full state dicts are."""
    names = {id(p): n for n, p in model.named_parameters()}
    ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    groups = []
    for g in indexed["param_groups"]:
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": [ordered[i] for i in g["params"]]})
    state = {ordered[int(i)]: dict(v) for i, v in indexed["state"].items()}
    return {"state": state, "param_groups": groups}

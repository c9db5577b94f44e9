"""One rank of a real gloo group that shards the tiny model with FSDP2's mixed-precision policy
switched on (bf16 parameters, float32 reduction: what a GPU rank gets) and scores one batch
through the model's root unit, recording the dtypes the root's forward received.

    python -m tests.trainer.mixed_peer MODEL_DIR RANK WORLD STORE_FILE OUT

Rank 0 also scores the batch on one rank, unsharded, with a bf16 working copy of the same
weights (what one rank computes on a GPU). OUT (torch.save): {"dtypes": {argument: dtype name},
"logp": [N] float32, "distill": [N] float32, and on rank 0 "one_rank_logp", "one_rank_distill"}.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# Sampling temperatures one bf16 rounding moves (0.7 → 0.69921875), a teacher's float32 probabilities.
TEMPERATURES = (0.7, 0.9)


def batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(4, 14, (2, 12), generator=gen)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 6:] = True
    labels = torch.roll(ids, -1, dims=1)
    n = int(mask.sum())
    teacher_ids = torch.randint(4, 14, (n, 3), generator=gen)
    teacher_probs = torch.softmax(torch.randn(n, 3, generator=gen), dim=-1) * 0.9
    return {
        "input_ids": ids,
        "mask": mask,
        "labels": labels,
        "temperature": torch.tensor(TEMPERATURES, dtype=torch.float32),
        "teacher_ids": teacher_ids,
        "teacher_probs": teacher_probs,
    }


def scores(model: torch.nn.Module, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    from atroposd.trainer.model import token_scores

    with torch.no_grad():
        out = token_scores(
            model,
            b["input_ids"],
            b["mask"],
            b["labels"],
            b["temperature"],
            teacher=(b["teacher_ids"], b["teacher_probs"]),
            tau=0.8,
        )
    assert out.distill is not None
    return out.logp.float().clone(), out.distill.float().clone()


def main() -> int:
    from atroposd.trainer.fsdp import shard_model
    from atroposd.trainer.model import ROOT_ATTR, load_policy

    model_dir, rank, world, store_file, out = (
        Path(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        sys.argv[5],
    )
    torch.set_num_threads(1)
    policy = load_policy(model_dir, model_dir, device=torch.device("cpu"), dtype=torch.float32, seed=0)
    b = batch()
    result: dict[str, Any] = {}
    if rank == 0:
        one = copy.deepcopy(policy.model).to(torch.bfloat16)
        result["one_rank_logp"], result["one_rank_distill"] = scores(one, b)
        del one
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    try:
        shard_model(policy.model, mixed_precision=True)
        root = policy.model.__dict__[ROOT_ATTR]
        seen: dict[str, str] = {}

        def record(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            # after FSDP's own pre-forward hook: what the root's forward computes with
            names = ("input_ids", "mask", "labels", "temperature", "seq_lens", "teacher_ids", "teacher_probs")
            for name, value in zip(names, args, strict=False):
                if isinstance(value, torch.Tensor):
                    seen[name] = str(value.dtype).removeprefix("torch.")
            seen["embedding"] = str(policy.model.get_input_embeddings().weight.dtype).removeprefix("torch.")

        root.register_forward_pre_hook(record, with_kwargs=True)
        result["logp"], result["distill"] = scores(policy.model, b)
        result["dtypes"] = seen
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

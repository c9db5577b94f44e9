"""Optimizers and the learning-rate schedule (linear warm-up, then constant).

``adamw`` (torch), ``adafactor`` (transformers, with the configured lr: no relative step) and
``adamw_8bit`` (bitsandbytes). A missing bitsandbytes is an error, never a silent fallback.
Only parameters that require grad are optimised (LoRA: the adapters).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from atroposd.config import TrainerConfig

__all__ = ["OptimizerError", "build_optimizer", "build_scheduler"]


class OptimizerError(RuntimeError):
    pass


def build_optimizer(params: Sequence[torch.nn.Parameter], tcfg: TrainerConfig) -> torch.optim.Optimizer:
    """The optimizer named by ``trainer.optimizer`` over ``params``."""
    params = list(params)
    if not params:
        raise OptimizerError("no trainable parameters")
    betas = (float(tcfg.adam_betas[0]), float(tcfg.adam_betas[1]))
    if tcfg.optimizer == "adamw":
        # The fused kernel is one pass over each tensor instead of a dozen small ops (2-3x
        # cheaper for a small model, where the optimizer's Python overhead shows).
        fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
        return torch.optim.AdamW(params, lr=tcfg.lr, betas=betas, weight_decay=tcfg.weight_decay, eps=1e-8,
                                 fused=fused or None)
    if tcfg.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=tcfg.lr, scale_parameter=False, relative_step=False, warmup_init=False,
                         weight_decay=tcfg.weight_decay)
    if tcfg.optimizer == "adamw_8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as exc:
            raise OptimizerError("trainer.optimizer = \"adamw_8bit\" needs bitsandbytes, which is not installed "
                                 "(pip install bitsandbytes), or choose \"adamw\"") from exc
        opt: torch.optim.Optimizer = bnb.optim.AdamW8bit(params, lr=tcfg.lr, betas=betas,
                                                         weight_decay=tcfg.weight_decay)
        return opt
    raise OptimizerError(f"unknown optimizer {tcfg.optimizer!r}")


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """lr · min(1, (step + 1) / warmup_steps): linear warm-up, then constant."""
    warmup = max(0, int(warmup_steps))

    def factor(step: int) -> float:
        return 1.0 if warmup == 0 else min(1.0, (step + 1) / warmup)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

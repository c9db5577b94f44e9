"""Optimizers and the learning-rate schedule (linear warm-up, then constant, linear or cosine).

``adamw`` (torch), ``adafactor`` (transformers, with the configured lr: no relative step) and
``adamw_8bit`` (bitsandbytes). A missing bitsandbytes is an error, never a silent fallback.
Only parameters that require grad are optimised (LoRA: the adapters).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from atroposd.config import TrainerConfig
    from atroposd.trainer.precision import Precision

__all__ = ["OptimizerError", "build_optimizer", "build_scheduler", "lr_factor"]


class OptimizerError(RuntimeError):
    pass


def build_optimizer(
    params: Sequence[torch.nn.Parameter], tcfg: TrainerConfig, *, precision: Precision | None = None
) -> torch.optim.Optimizer:
    """The optimizer named by ``trainer.optimizer`` over ``params``. ``adamw`` over bf16/fp16
    parameters is :class:`~atroposd.trainer.precision.PrecisionAdamW` (float32 master weights),
    or, where ``precision`` says to compensate, torch-optimi's AdamW with Kahan summation (SPEC §12.1)."""
    params = list(params)
    if not params:
        raise OptimizerError("no trainable parameters")
    betas = (float(tcfg.adam_betas[0]), float(tcfg.adam_betas[1]))
    if tcfg.optimizer == "adamw" and any(p.dtype in (torch.bfloat16, torch.float16) for p in params):
        from atroposd.trainer.precision import PrecisionAdamW, compensated_adamw

        if precision is not None and precision.compensated:
            return compensated_adamw(params, lr=tcfg.lr, betas=betas, weight_decay=tcfg.weight_decay, eps=1e-8)
        return PrecisionAdamW(params, lr=tcfg.lr, betas=betas, weight_decay=tcfg.weight_decay, eps=1e-8)
    if tcfg.optimizer == "adamw":
        # The fused kernel is one pass over each tensor instead of a dozen small ops (2-3x
        # cheaper for a small model, where the optimizer's Python overhead shows).
        fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
        return torch.optim.AdamW(
            params, lr=tcfg.lr, betas=betas, weight_decay=tcfg.weight_decay, eps=1e-8, fused=fused or None
        )
    if tcfg.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(
            params,
            lr=tcfg.lr,
            scale_parameter=False,
            relative_step=False,
            warmup_init=False,
            weight_decay=tcfg.weight_decay,
        )
    if tcfg.optimizer == "adamw_8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as exc:
            raise OptimizerError(
                'trainer.optimizer = "adamw_8bit" needs bitsandbytes, which is not installed '
                '(pip install bitsandbytes), or choose "adamw"'
            ) from exc
        opt: torch.optim.Optimizer = bnb.optim.AdamW8bit(
            params, lr=tcfg.lr, betas=betas, weight_decay=tcfg.weight_decay
        )
        return opt
    raise OptimizerError(f"unknown optimizer {tcfg.optimizer!r}")


def lr_factor(step: int, *, warmup_steps: int, schedule: str = "constant", steps: int = 0) -> float:
    """The learning rate's multiplier for the optimizer step ``step`` (0 = the first).

    Warm-up: min(1, (step + 1) / warmup_steps) while step < warmup_steps. After it, with
    p = (step − warmup_steps) / (steps − warmup_steps) in [0, 1]:
    ``constant`` 1; ``linear`` 1 − p; ``cosine`` (1 + cos(π·p)) / 2 — both reach 0 at ``steps``
    (the schedules of transformers' ``get_linear_schedule_with_warmup`` /
    ``get_cosine_schedule_with_warmup``, verl's and TRL's ``lr_scheduler_type``).
    """
    warmup = max(0, int(warmup_steps))
    if warmup and step < warmup:
        return min(1.0, (step + 1) / warmup)
    if schedule == "constant":
        return 1.0
    p = min(1.0, max(0.0, (step - warmup) / max(1, steps - warmup)))
    if schedule == "linear":
        return 1.0 - p
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"unknown lr_schedule {schedule!r}")


def build_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, schedule: str = "constant", steps: int = 0
) -> torch.optim.lr_scheduler.LambdaLR:
    """lr · :func:`lr_factor`: linear warm-up, then ``schedule`` (to 0 at ``steps``). Its position
    is the scheduler's ``last_epoch``, saved in the checkpoint and restored at resume."""

    def factor(step: int) -> float:
        return lr_factor(step, warmup_steps=warmup_steps, schedule=schedule, steps=steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

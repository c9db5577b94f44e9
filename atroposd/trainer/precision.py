"""The trainer's precision (SPEC §12.1): master weights, optimizer state and compute dtype.

The model the trainer computes with is its working copy, in the compute dtype (bf16 on a
GPU, float32 on a CPU: ``[trainer] compute_dtype = "auto"``); it is also what a replica
receives, so a sync hands over weights already in the inference dtype. The optimizer holds
the rest:

* ``dtype = "auto"`` (float32 master weights): :class:`PrecisionAdamW` keeps a float32 master
  copy of every low-precision parameter in its state, applies the update there, and casts the
  result into the working copy after each step. An update below bf16's resolution still moves
  the master weights; it reaches the working copy once the master has moved far enough.
* ``dtype = "bfloat16"`` (a large model on a small GPU), and ``shared`` weights on a GPU (one
  bf16 copy for the trainer and every replica): no master copy; torch-optimi's AdamW with Kahan
  summation (:func:`compensated_adamw`) keeps what rounding to bf16 dropped in a buffer of the
  parameter's dtype and adds it to the next update, so small updates accumulate instead of
  vanishing.

With a master copy the moments are float32 (per bf16 parameter: 2 bytes of working copy plus 12
of state); compensated, everything is in the parameter's dtype (2 + 6). Float32 parameters take
plain AdamW steps. The state is ordinary optimizer state (tensors), saved and restored with the
checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, overload

import torch

__all__ = ["COMPUTE_DTYPES", "MASTER_DTYPES", "Precision", "PrecisionAdamW", "compensated_adamw", "resolve_precision"]

MASTER_DTYPES = ("auto", "float32", "bfloat16")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Precision:
    """What the trainer holds: the working copy's dtype (``compute``), the master weights'
    (``master``), and whether the optimizer compensates low-precision updates instead of
    keeping a float32 master copy."""

    compute: str
    master: str
    compensated: bool

    def describe(self) -> dict[str, str]:
        """For the log line that loads the model."""
        how = (
            "kahan-compensated"
            if self.compensated
            else ("float32 master copy" if self.compute != "float32" else "plain")
        )
        return {"compute_dtype": self.compute, "master_dtype": self.master, "optimizer_precision": how}


def resolve_precision(
    *, device_type: str, dtype: str, compute_dtype: str, inference_dtype: str, weight_sync: str
) -> Precision:
    """The trainer's :class:`Precision` for a device (``"cpu"``/``"cuda"``), ``[trainer] dtype``,
    ``[trainer] compute_dtype``, the resolved inference dtype and the weight-sync mode.

    The working copy is what replicas receive, so it is the inference dtype unless
    ``compute_dtype`` names another (``reload`` casts when it writes). ``shared`` on a GPU
    and ``dtype = "bfloat16"`` compensate instead of keeping a master copy.
    """
    if dtype not in MASTER_DTYPES:
        raise ValueError(f"trainer.dtype = {dtype!r}: expected one of {', '.join(MASTER_DTYPES)}")
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"trainer.compute_dtype = {compute_dtype!r}: expected one of {', '.join(COMPUTE_DTYPES)}")
    compute = inference_dtype if compute_dtype == "auto" else compute_dtype
    low = compute != "float32"
    compensated = low and (dtype == "bfloat16" or (weight_sync == "shared" and device_type == "cuda"))
    if dtype == "bfloat16" and not low:
        # a float32 working copy with bf16 master weights would be the worst of both: keep float32
        compensated = False
    master = compute if compensated else "float32"
    return Precision(compute=compute, master=master, compensated=compensated)


def compensated_adamw(
    params: Iterable[torch.nn.Parameter],
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """AdamW with Kahan summation for low-precision parameters, from torch-optimi (decoupled
    weight decay scaled by the learning rate, as ``torch.optim.AdamW``).

    ``triton=False``: torch-optimi's default (None) compiles a Triton kernel at the first step
    on a GPU, which needs a C compiler and Python's headers at run time; its foreach path
    takes the same step without them."""
    from optimi import AdamW

    opt: torch.optim.Optimizer = AdamW(
        params,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        decouple_lr=False,
        kahan_sum=True,
        triton=False,
    )
    return opt


class PrecisionAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments, as ``torch.optim.AdamW``) with
    float32 moments and a float32 master copy of each bf16/fp16 parameter."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid AdamW settings: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Every state tensor keeps its own dtype (torch's loading casts floating-point state
        to the parameter's, which would round the float32 master weights and moments of a bf16
        parameter to bf16)."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params, strict=True):
            for key, value in saved.get(i, {}).items():
                if key != "step" and isinstance(value, torch.Tensor):
                    self.state[p][key] = value.detach().to(device=p.device, copy=True)

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2) = float(group["lr"]), group["betas"]
            eps, wd = float(group["eps"]), float(group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                low = p.dtype in (torch.bfloat16, torch.float16)
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    if low:
                        state["master"] = p.detach().to(torch.float32, copy=True)
                state["step"] += 1
                t = float(state["step"])
                grad = p.grad.to(torch.float32)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (v / (1 - beta2**t)).sqrt_().add_(eps)
                step_size = lr / (1 - beta1**t)
                master = state.get("master")
                if master is not None:  # float32 master weights; the working copy is their cast
                    master.mul_(1 - lr * wd).addcdiv_(m, denom, value=-step_size)
                    p.copy_(master)
                    continue
                # a float32 parameter: plain AdamW
                p.mul_(1 - lr * wd).addcdiv_(m, denom, value=-step_size)
        return loss

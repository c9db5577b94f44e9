"""Mixed precision (SPEC §12.1): float32 master weights under bf16 compute, and the Kahan-
compensated AdamW for bf16 parameters, on the real tiny model and real optimizer steps (CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from atroposd.config import ConfigError, parse_config
from atroposd.trainer.model import token_logprobs
from atroposd.trainer.precision import (
    Precision,
    PrecisionAdamW,
    compensated_adamw,
    resolve_precision,
)
from atroposd.trainer.setup import build_learner, load_for_training
from tests.trainer.conftest import make_cfg

# Far below bf16's resolution for every weight of the tiny model that is not nearly zero.
TINY_LR = 1e-7


def _loss(model: torch.nn.Module) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 14, (4, 12), generator=gen)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 6:] = True
    labels = torch.roll(ids, -1, dims=1)
    logp, _ = token_logprobs(model, ids, mask, labels, torch.ones(4))
    return -logp.float().mean()


def _bf16_setup(tmp_path: Path, tiny_dir: Path, **trainer: Any) -> Any:
    cfg = make_cfg(tmp_path / "state", tiny_dir, lr=TINY_LR, weight_decay=0.0, resume=False, **trainer)
    cfg.inference.dtype = "bfloat16"  # the replicas' dtype: the trainer's working copy follows it
    setup = load_for_training(cfg)
    return setup, build_learner(cfg, setup)


def test_bf16_compute_keeps_an_update_below_its_resolution_in_the_float32_master(
    tmp_path: Path, tiny_dir: Path
) -> None:
    setup, learner = _bf16_setup(tmp_path, tiny_dir)
    assert setup.precision == Precision(compute="bfloat16", master="float32", compensated=False)
    model, optimizer = setup.policy.model, learner.optimizer
    assert isinstance(optimizer, PrecisionAdamW)
    params = [p for p in model.parameters() if p.requires_grad]
    assert all(p.dtype == torch.bfloat16 for p in params)  # bf16 compute
    before = [p.detach().float().clone() for p in params]
    _loss(model).backward()
    optimizer.step()
    masters = [optimizer.state[p]["master"] for p in params]
    assert all(m.dtype == torch.float32 for m in masters)
    moved = sum(int((m != b).sum()) for m, b in zip(masters, before, strict=True))
    total = sum(b.numel() for b in before)
    assert moved > 0.9 * total  # the master weights took the update
    # ... where a pure-bf16 trainer's weights do not move: the same step with torch's AdamW
    pure = [b.to(torch.bfloat16).requires_grad_() for b in before]
    for q, p in zip(pure, params, strict=True):
        q.grad = p.grad.clone()
    torch.optim.AdamW(pure, lr=TINY_LR, weight_decay=0.0).step()
    lost = sum(int((q.float() == b).sum()) for q, b in zip(pure, before, strict=True))
    assert lost > 0.99 * total
    norm = next(p for n, p in model.named_parameters() if n.endswith("norm.weight"))
    idx = next(i for i, p in enumerate(params) if p is norm)
    assert torch.equal(pure[idx].float(), before[idx]) and not torch.equal(masters[idx], before[idx])


def test_the_master_weights_survive_a_state_dict_round_trip(tmp_path: Path, tiny_dir: Path) -> None:
    setup, learner = _bf16_setup(tmp_path, tiny_dir)
    _loss(setup.policy.model).backward()
    learner.optimizer.step()
    saved = learner.optimizer.state_dict()
    params = list(setup.policy.trainable())
    fresh = PrecisionAdamW(params, lr=TINY_LR)
    fresh.load_state_dict(saved)
    for p in params:
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert fresh.state[p][key].dtype == torch.float32
            assert torch.equal(fresh.state[p][key], learner.optimizer.state[p][key])


def test_the_compensated_optimizer_keeps_small_updates_on_bf16_parameters() -> None:
    """Each step's update (1e-4) is below half of bf16's resolution at 1.0 (2⁻⁸): plain AdamW on
    bf16 never moves; the compensated one follows a float32 reference to within one bf16 step."""
    steps, lr = 200, 1e-4
    start = torch.ones(64)
    grad = torch.linspace(0.5, 2.0, 64)
    plain = start.to(torch.bfloat16).requires_grad_()
    kahan = start.to(torch.bfloat16).requires_grad_()
    ref = start.clone().requires_grad_()
    optimizers = [
        torch.optim.AdamW([plain], lr=lr, weight_decay=0.0),
        compensated_adamw([kahan], lr=lr),
        torch.optim.AdamW([ref], lr=lr, weight_decay=0.0),
    ]
    for _ in range(steps):
        for p, opt in zip((plain, kahan, ref), optimizers, strict=True):
            p.grad = grad.to(p.dtype)
            opt.step()
    assert torch.equal(plain.float(), start)  # every update lost
    assert "master" not in optimizers[1].state[kahan]  # one bf16 copy: no master
    assert all(t.dtype == torch.bfloat16 for t in optimizers[1].state[kahan].values() if t.dim())
    assert float((start - ref.detach()).mean()) == pytest.approx(steps * lr, rel=0.05)
    ulp = 2.0**-7
    assert float((kahan.detach().float() - ref.detach()).abs().max()) <= ulp
    assert float((start - kahan.detach().float()).mean()) > 0.5 * steps * lr


def test_float32_parameters_take_torchs_adamw_steps() -> None:
    torch.manual_seed(0)
    a = torch.randn(32, requires_grad=True)
    b = a.detach().clone().requires_grad_()
    mine = PrecisionAdamW([a], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    theirs = torch.optim.AdamW([b], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    for i in range(5):
        g = torch.randn(32, generator=torch.Generator().manual_seed(i))
        a.grad, b.grad = g.clone(), g.clone()
        mine.step()
        theirs.step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        (
            {
                "device_type": "cpu",
                "dtype": "auto",
                "compute_dtype": "auto",
                "inference_dtype": "float32",
                "weight_sync": "shared",
            },
            Precision("float32", "float32", False),
        ),
        (
            {
                "device_type": "cuda",
                "dtype": "auto",
                "compute_dtype": "auto",
                "inference_dtype": "bfloat16",
                "weight_sync": "push",
            },
            Precision("bfloat16", "float32", False),
        ),
        (
            {
                "device_type": "cuda",
                "dtype": "auto",
                "compute_dtype": "auto",
                "inference_dtype": "bfloat16",
                "weight_sync": "shared",
            },
            Precision("bfloat16", "bfloat16", True),
        ),
        (
            {
                "device_type": "cuda",
                "dtype": "bfloat16",
                "compute_dtype": "auto",
                "inference_dtype": "bfloat16",
                "weight_sync": "push",
            },
            Precision("bfloat16", "bfloat16", True),
        ),
        (
            {
                "device_type": "cpu",
                "dtype": "auto",
                "compute_dtype": "float32",
                "inference_dtype": "bfloat16",
                "weight_sync": "reload",
            },
            Precision("float32", "float32", False),
        ),
    ],
)
def test_resolve_precision(kw: dict[str, str], expected: Precision) -> None:
    assert resolve_precision(**kw) == expected


@pytest.mark.parametrize(
    ("trainer", "inference", "key"),
    [
        ({"dtype": "float16"}, {}, "trainer.dtype"),
        ({"compute_dtype": "int8"}, {}, "trainer.compute_dtype"),
        ({"compute_dtype": "float32", "weight_sync": "push"}, {"dtype": "bfloat16"}, "trainer.compute_dtype"),
        ({"dtype": "bfloat16", "optimizer": "adafactor"}, {}, "trainer.dtype"),
    ],
)
def test_config_check_names_the_precision_key(trainer: dict[str, Any], inference: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"trainer": trainer, "inference": inference})
    assert any(str(p).startswith(key + ":") for p in info.value.problems), info.value.problems


@pytest.mark.gpu
@pytest.mark.parametrize("compensated", [False, True])
def test_precision_adamw_on_a_gpu_takes_the_cpus_steps(compensated: bool) -> None:
    """The same bf16 parameter and gradients on cuda:0 and on the CPU: the same master weights
    (or compensation) and the same bf16 weights after each step, to float32 rounding."""
    start = torch.linspace(-1.0, 1.0, 4096).to(torch.bfloat16)
    params = [start.clone().requires_grad_(), start.to("cuda:0").requires_grad_()]
    opts = [
        compensated_adamw([p], lr=1e-5, weight_decay=0.01)
        if compensated
        else PrecisionAdamW([p], lr=1e-5, weight_decay=0.01)
        for p in params
    ]
    for i in range(20):
        g = torch.randn(4096, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        for p, opt in zip(params, opts, strict=True):
            p.grad = g.to(p.device)
            opt.step()
    cpu, gpu = params[0].detach(), params[1].detach().cpu()
    assert float((cpu.float() - gpu.float()).abs().max()) <= 2.0**-7
    # the value the optimizer tracks: the master weights, or the bf16 weights plus what rounding dropped
    tracked = [
        opt.state[p]["kahan_comp"].float().cpu() + p.detach().float().cpu()
        if compensated
        else opt.state[p]["master"].cpu()
        for p, opt in zip(params, opts, strict=True)
    ]
    torch.testing.assert_close(tracked[0], tracked[1], rtol=0, atol=1e-5)


def test_the_trainer_builds_the_compensated_optimizer_where_precision_says_so() -> None:
    from optimi import AdamW as OptimiAdamW

    from atroposd.trainer.optim import build_optimizer

    tcfg = parse_config({}).trainer
    bf16 = [torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))]
    compensated = build_optimizer(bf16, tcfg, precision=Precision("bfloat16", "bfloat16", True))
    assert isinstance(compensated, OptimiAdamW) and compensated.param_groups[0]["kahan_sum"] is True
    assert compensated.param_groups[0]["lr"] == tcfg.lr
    master = build_optimizer(bf16, tcfg, precision=Precision("bfloat16", "float32", False))
    assert isinstance(master, PrecisionAdamW)


def test_the_compensated_optimizer_resumes_from_its_state_dict_exactly() -> None:
    # what a checkpoint holds (the moments and the compensation) continues the same steps
    import io

    grads = [torch.randn(64, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16) for i in range(6)]
    a = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    opt_a = compensated_adamw([a], lr=1e-4, weight_decay=0.01)
    for g in grads[:3]:
        a.grad = g.clone()
        opt_a.step()
    buf = io.BytesIO()
    torch.save({"p": a.detach().clone(), "opt": opt_a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    b = torch.nn.Parameter(saved["p"])
    opt_b = compensated_adamw([b], lr=1e-4, weight_decay=0.01)
    opt_b.load_state_dict(saved["opt"])
    assert torch.count_nonzero(opt_b.state[b]["kahan_comp"]) > 0  # the compensation came back
    for g in grads[3:]:
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    assert torch.equal(a.detach(), b.detach())
    assert torch.equal(opt_a.state[a]["kahan_comp"], opt_b.state[b]["kahan_comp"])


def test_the_compensated_adamw_never_compiles_triton() -> None:
    """torch-optimi compiles a Triton kernel at the first GPU step unless told not to (a C
    compiler and Python's headers at run time): the compensated AdamW is built with it off."""
    p = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    opt = compensated_adamw([p], lr=1e-3)
    assert [g["triton"] for g in opt.param_groups] == [False]
    assert opt.defaults["triton"] is False
    assert opt.defaults["kahan_sum"] is True

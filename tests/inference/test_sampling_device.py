"""The torch engine's sampling noise is drawn on the model's device (a [B, V] draw a decode step;
on the host it measures the CPU's random-number generator at a large vocabulary), and seeded
requests still reproduce: the same seed gives the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from atroposd.inference.decode import _Row, _Sampler, decode_batch, noise_generator
from atroposd.inference.schema import GenerateParams
from atroposd.models.tiny import BOS_ID, EOS_ID


def _sampler(device: torch.device, seeds: list[int | None], engine_seed: int = 0) -> _Sampler:
    reqs = [GenerateParams(prompt_ids=[BOS_ID, 5], n=2, max_tokens=4, seed=s) for s in seeds]
    rows = [_Row(j, p) for j, p in enumerate(reqs) for _ in range(p.n)]
    temps = torch.ones(len(rows), device=device)
    return _Sampler(rows, reqs, temps, torch.Generator().manual_seed(engine_seed), device)


def _draws(device: torch.device, seeds: list[int | None], engine_seed: int = 0) -> torch.Tensor:
    sampler = _sampler(device, seeds, engine_seed)
    logits = torch.zeros(2 * len(seeds), 4096, device=device)  # uniform: the noise alone decides
    return torch.stack([sampler.sample(logits)[0] for _ in range(8)]).cpu()


def _check_on(device: torch.device) -> None:
    sampler = _sampler(device, [7, None])
    assert sampler.generator.device.type == device.type  # the unseeded rows' noise
    assert [g.device.type for _, _, g in sampler.seeded] == [device.type]  # the seeded request's
    a, b, c = _draws(device, [7, None]), _draws(device, [7, None], engine_seed=1), _draws(device, [8, None])
    assert torch.equal(a[:, :2], b[:, :2])  # the seeded request's rows: its seed alone decides
    assert not torch.equal(a[:, :2], c[:, :2])
    assert not torch.equal(a[:, 2:], b[:, 2:])  # the unseeded rows follow the engine's generator
    assert torch.equal(a, _draws(device, [7, None]))  # the engine's seed reproduces them too


def test_noise_is_drawn_on_the_models_device_and_seeds_reproduce_on_the_cpu() -> None:
    _check_on(torch.device("cpu"))
    engine = torch.Generator().manual_seed(3)
    assert noise_generator(engine, "cpu") is engine  # already there: the engine's own stream


def test_seeded_generation_reproduces_through_the_decode_loop(tiny_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))

    def run(seed: int, engine_seed: int) -> list[list[int]]:
        reqs = [GenerateParams(prompt_ids=[BOS_ID, 4, 5], n=3, max_tokens=6, seed=seed, ignore_eos=True)]
        with torch.inference_mode():
            done, _ = decode_batch(
                model,
                reqs,
                tokenizer=tok,
                eos_ids=frozenset({EOS_ID}),
                generator=torch.Generator().manual_seed(engine_seed),
            )
        return [c.token_ids for c in done[0]]

    first = run(11, 0)
    assert run(11, 5) == first
    assert run(12, 0) != first


@pytest.mark.gpu
def test_noise_is_drawn_on_the_gpu_and_seeds_reproduce_there() -> None:
    _check_on(torch.device("cuda:0"))
    derived = noise_generator(torch.Generator().manual_seed(3), torch.device("cuda:0"))
    assert derived.device.type == "cuda"
    again = noise_generator(torch.Generator().manual_seed(3), torch.device("cuda:0"))
    assert derived.initial_seed() == again.initial_seed()

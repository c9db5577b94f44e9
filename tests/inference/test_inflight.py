"""In-flight weight updates on the torch engine (SPEC §7): a keep-pause freezes the running batch
between two decode steps, the weights change, resume lets it go on; each token's logprob is the
one of the weights that sampled it, and ``weight_versions`` names the swap."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from atroposd.inference.schema import BadRequest, GenerateParams, chat_response, sglang_response
from atroposd.inference.torch_engine import NotPaused, ShuttingDown, TorchEngine
from atroposd.models.tiny import BOS_ID
from atroposd.trainer.sentinel import score_completion
from atroposd.weights.receiver import ReceiverState
from atroposd.weights.reload import write_sync_dir
from tests.inference.conftest import MAX_MODEL_LEN

pytestmark = pytest.mark.anyio

PROMPT = [BOS_ID, 5, 14, 7, 17]


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """The reference forward passes on one thread, as the engine's (the machine's cores are shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
async def engine(tiny_dir: Path, tmp_path: Path) -> AsyncIterator[TorchEngine]:
    receiver = ReceiverState(nonce="inflighttest", weights_dir=tmp_path / "weights", sync_dir=tmp_path / "sync")
    eng = TorchEngine(model_dir=tiny_dir, max_model_len=MAX_MODEL_LEN, seed=0, receiver=receiver)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.close()


def req(**kw: Any) -> dict[str, Any]:
    return {"prompt": {"prompt_token_ids": PROMPT}, "logprobs": 0, **kw}


def logprobs_of(resp: dict[str, Any], i: int) -> list[float]:
    return [float(next(iter(item[0].values()))) for item in resp["logprobs"][i]]


def new_weights(tiny_dir: Path, seed: int = 1) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


async def started(eng: TorchEngine) -> None:
    deadline = time.monotonic() + 30
    while eng._freezer is None:  # the engine exposes no event for a started batch
        assert time.monotonic() < deadline, "the batch never started"
        await asyncio.sleep(0.0005)


async def swap_in_flight(
    eng: TorchEngine, tiny_dir: Path, tmp_path: Path, body: dict[str, Any], *, clear_cache: bool | None = None
) -> tuple[dict[str, Any], Any]:
    """Start a generation, freeze it, load other weights as version 1, resume; its response and the new model."""
    old = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
    gen = asyncio.ensure_future(eng.generate(body))
    await started(eng)
    paused = await eng.pause(mode="keep", clear_cache=clear_cache)
    assert paused["paused"] and paused["mode"] == "keep" and paused["frozen"] == 1
    assert not gen.done(), "the generation finished instead of freezing (too short?)"
    model = new_weights(tiny_dir)
    path = write_sync_dir(model, tmp_path / "sync", 1)
    await eng.load_weights({"path": str(path), "weight_version": 1})  # refused while a batch computes
    await eng.resume(1)
    resp = await asyncio.wait_for(gen, 60)
    assert eng.frozen_syncs == 1
    old_model = new_weights(tiny_dir)
    old_model.load_state_dict(old)
    return resp, (old_model, model)


async def test_a_generation_spanning_a_swap_has_each_weights_logprobs(
    engine: TorchEngine, tiny_dir: Path, tmp_path: Path
) -> None:
    body = req(n=3, max_tokens=200, temperature=1.0, ignore_eos=True)
    resp, (old, new) = await swap_in_flight(engine, tiny_dir, tmp_path, body)
    assert resp["weight_version"] == 0  # the admission version: the staleness bound counts from it
    records = resp["weight_versions"]
    assert len(records) == 3
    for i, record in enumerate(records):
        ids, lps = resp["token_ids"][i], logprobs_of(resp, i)
        assert len(ids) == 200  # nothing lost, nothing sampled twice
        assert record[0] == [0, 0] and len(record) == 2 and record[1][1] == 1
        at = record[1][0]
        assert 0 < at < 200, record
        before = score_completion(old, PROMPT, ids)
        after = score_completion(new, PROMPT, ids)
        assert max(abs(a - b) for a, b in zip(lps[:at], before[:at], strict=True)) < 1e-5
        assert max(abs(a - b) for a, b in zip(lps[at:], after[at:], strict=True)) < 1e-5
        # and the two weights do give other logprobs: the check above could fail
        assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 1e-2
    # every later generation is the new weights' alone, with one version
    later = await engine.generate(req(max_tokens=4, ignore_eos=True))
    assert later["weight_version"] == 1 and "weight_versions" not in later


async def test_inflight_kv_keep_decodes_over_the_frozen_old_kv(
    engine: TorchEngine, tiny_dir: Path, tmp_path: Path
) -> None:
    from atroposd.inference.steppers import HFStepper

    body = req(max_tokens=200, temperature=1.0, ignore_eos=True)
    resp, (old, new) = await swap_in_flight(engine, tiny_dir, tmp_path, body, clear_cache=False)
    ids, lps = resp["token_ids"][0], logprobs_of(resp, 0)
    (_, v0), (at, v1) = resp["weight_versions"][0]
    assert (v0, v1) == (0, 1) and 0 < at < 200
    # The reference: the old weights' cache of the prompt and the tokens fed before the swap,
    # then the new weights decoding over it, one token at a time.
    seq = PROMPT + ids
    stepper = HFStepper(old)
    with torch.no_grad():
        upto = len(PROMPT) + at - 1  # the last token sampled before the swap is fed after it
        ids_t = torch.tensor([seq[:upto]])
        stepper.prefill(ids_t, torch.ones_like(ids_t), torch.arange(upto)[None], all_logits=False)
        stepper.model = new
        ref = []
        for pos in range(upto, len(seq) - 1):
            logits = stepper.step(torch.tensor([[seq[pos]]]), torch.tensor([[pos]])).float()
            ref.append(float(torch.log_softmax(logits[0], -1)[seq[pos + 1]]))
    assert max(abs(a - b) for a, b in zip(lps[at:], ref, strict=True)) < 1e-4
    # ...which is not what the new weights compute from scratch (recompute would give that)
    recomputed = score_completion(new, PROMPT, ids)[at:]
    assert max(abs(a - b) for a, b in zip(ref, recomputed, strict=True)) > 1e-3
    assert max(abs(a - b) for a, b in zip(lps[at:], recomputed, strict=True)) > 1e-3


async def test_a_refused_update_resumes_on_the_old_weights_and_says_so(
    engine: TorchEngine, tiny_dir: Path, tmp_path: Path
) -> None:
    gen = asyncio.ensure_future(engine.generate(req(max_tokens=200, temperature=1.0, ignore_eos=True)))
    await started(engine)
    await engine.pause(mode="keep")
    with pytest.raises(Exception, match="sync"):  # a directory that is not a complete sync: nothing loaded
        await engine.load_weights({"path": str(tmp_path / "sync" / "nowhere"), "weight_version": 1})
    await engine.resume(0)  # the daemon resumes a refused replica with what it had
    resp = await asyncio.wait_for(gen, 60)
    assert resp["weight_version"] == 0 and "weight_versions" not in resp
    ids, lps = resp["token_ids"][0], logprobs_of(resp, 0)
    ref = score_completion(engine.model, PROMPT, ids)
    assert max(abs(a - b) for a, b in zip(lps, ref, strict=True)) < 1e-5


async def test_queued_requests_begin_after_the_swap_under_the_new_version(engine: TorchEngine) -> None:
    await engine.pause(mode="keep")  # nothing running: the gate closes, nothing begins
    held = asyncio.ensure_future(engine.generate(req(max_tokens=3)))
    await asyncio.sleep(0.05)
    assert not held.done()
    with pytest.raises(BadRequest, match="pause mode"):
        await engine.pause(mode="later")
    await engine.resume(5)
    resp = await asyncio.wait_for(held, 30)
    assert resp["weight_version"] == 5 and "weight_versions" not in resp


async def test_drain_pause_still_refuses_updates_in_flight(engine: TorchEngine) -> None:
    gen = asyncio.ensure_future(engine.generate(req(max_tokens=200, ignore_eos=True)))
    await started(engine)
    await engine.pause()  # wait: returns once answered
    assert gen.done()
    engine._inflight += 1
    try:
        with pytest.raises(NotPaused):
            await engine.load_weights({"path": "/nowhere", "weight_version": 1})
    finally:
        engine._inflight -= 1
    await engine.resume(1)


async def test_close_while_frozen_answers_the_frozen_requests(tiny_dir: Path) -> None:
    eng = TorchEngine(model_dir=tiny_dir, max_model_len=MAX_MODEL_LEN)
    await eng.start()
    gen = asyncio.ensure_future(eng.generate(req(n=2, max_tokens=200, ignore_eos=True)))
    await started(eng)
    await eng.pause(mode="keep")
    t0 = time.monotonic()
    await asyncio.wait_for(eng.close(), 30)
    assert time.monotonic() - t0 < 10
    with pytest.raises(ShuttingDown):
        await asyncio.wait_for(gen, 5)


def test_weight_versions_reach_every_answer_shape() -> None:
    from atroposd.inference.schema import completion_response, parse_sglang

    gen = {
        "text": ["ab", "c"],
        "token_ids": [[3, 4], [5]],
        "logprobs": [[[{"3": -0.1}], [{"4": -0.2}]], [[{"5": -0.3}]]],
        "finish_reasons": ["length", "length"],
        "weight_version": 2,
        "weight_versions": [[[0, 2], [1, 3]], [[0, 2]]],
        "prompt_token_ids": [1, 2],
    }
    decode = str
    chat = chat_response("m", gen, want_logprobs=True, decode=decode)
    assert chat["choices"][0]["weight_versions"] == [[0, 2], [1, 3]]
    assert "weight_versions" not in chat["choices"][1] and chat["weight_version"] == 2
    comp = completion_response("m", gen, want_logprobs=False, decode=decode)
    assert comp["choices"][0]["weight_versions"] == [[0, 2], [1, 3]]
    sg = parse_sglang(
        {"input_ids": [1, 2], "sampling_params": {"n": 2, "max_new_tokens": 2}, "return_logprob": True},
        max_model_len=64,
        vocab_size=16,
        encode=lambda s: [1],
    )
    out = sglang_response(sg, gen, decode=lambda ids, skip: "x")
    assert isinstance(out, list)
    assert out[0]["meta_info"]["weight_versions"] == [[0, 2], [1, 3]]
    assert "weight_versions" not in out[1]["meta_info"]
    assert isinstance(GenerateParams, type)

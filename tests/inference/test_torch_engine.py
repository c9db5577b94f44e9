"""The torch engine in this process: sampling, logprobs, batching, stops, the pause gate."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from atroposd.inference.schema import BadRequest
from atroposd.inference.torch_engine import NotPaused, TorchEngine
from atroposd.models.tiny import BOS_ID, EOS_ID
from tests.inference.conftest import MAX_MODEL_LEN

pytestmark = pytest.mark.anyio

PROMPT = [BOS_ID, 5, 14, 7, 17]  # "[BOS]1+3="


@pytest.fixture
async def engine(tiny_dir: Path) -> AsyncIterator[TorchEngine]:
    eng = TorchEngine(model_dir=tiny_dir, max_model_len=MAX_MODEL_LEN, seed=0)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.close()


def req(prompt: list[int] = PROMPT, **kw: Any) -> dict[str, Any]:
    return {"prompt": {"prompt_token_ids": prompt}, "logprobs": 0, **kw}


def sampled(resp: dict[str, Any], i: int = 0) -> tuple[list[int], list[float]]:
    """(token ids, logprobs) of completion i, read the way atroposlib reads them (from the dict keys)."""
    ids = [int(next(iter(item[0]))) for item in resp["logprobs"][i]]
    lps = [float(next(iter(item[0].values()))) for item in resp["logprobs"][i]]
    return ids, lps


def reference_logprobs(model: Any, tokens: list[int], start: int, temperature: float) -> list[float]:
    """log_softmax(logits / T) of tokens[start:], teacher-forced in one plain forward pass."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return [float(lp[i - 1, tokens[i]]) for i in range(start, len(tokens))]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_sampled_logprobs_match_teacher_forcing(engine: TorchEngine, temperature: float) -> None:
    resp = await engine.generate(req(n=4, max_tokens=8, temperature=temperature, ignore_eos=True))
    assert len(resp["logprobs"]) == 4 and resp["weight_version"] == 0
    for i in range(4):
        ids, lps = sampled(resp, i)
        assert ids == resp["token_ids"][i] and len(ids) == 8
        full = PROMPT + ids
        ref = reference_logprobs(engine.model, full, len(PROMPT), temperature)
        assert max(abs(a - b) for a, b in zip(lps, ref, strict=True)) < 2e-3
        # The server's own teacher-forced prompt_logprobs of the same sequence agree too.
        echo = await engine.generate(req(full, max_tokens=1, temperature=temperature, prompt_logprobs=0))
        pl = echo["prompt_logprobs"]
        assert pl[0] is None and len(pl) == len(full)
        forced = [pl[j][str(full[j])] for j in range(len(PROMPT), len(full))]
        assert max(abs(a - b) for a, b in zip(lps, forced, strict=True)) < 2e-3


async def test_top_p_truncates_sampling_but_not_logprobs(engine: TorchEngine) -> None:
    greedy = await engine.generate(req(max_tokens=6, temperature=0.0, ignore_eos=True))
    nucleus = await engine.generate(req(n=3, max_tokens=6, temperature=1.0, top_p=1e-6, ignore_eos=True))
    for i in range(3):
        ids, lps = sampled(nucleus, i)
        assert ids == greedy["token_ids"][0]  # only the most likely token survives top_p → 0
        ref = reference_logprobs(engine.model, PROMPT + ids, len(PROMPT), 1.0)
        assert max(abs(a - b) for a, b in zip(lps, ref, strict=True)) < 2e-3
        assert all(lp < -0.05 for lp in lps)  # untruncated: not renormalised to log 1 = 0
    _, glps = sampled(greedy)
    ref = reference_logprobs(engine.model, PROMPT + greedy["token_ids"][0], len(PROMPT), 1.0)
    assert max(abs(a - b) for a, b in zip(glps, ref, strict=True)) < 2e-3


async def test_seeds_reproduce_and_n_rows_differ(engine: TorchEngine) -> None:
    a = await engine.generate(req(n=8, max_tokens=6, seed=123, ignore_eos=True))
    b = await engine.generate(req(n=8, max_tokens=6, seed=123, ignore_eos=True))
    c = await engine.generate(req(n=8, max_tokens=6, seed=124, ignore_eos=True))
    assert a["token_ids"] == b["token_ids"]
    assert a["token_ids"] != c["token_ids"]
    assert len({tuple(t) for t in a["token_ids"]}) > 1  # the n rows are separate samples
    assert len(a["text"]) == len(a["finish_reasons"]) == 8


async def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(engine: TorchEngine) -> None:
    prompts = [[BOS_ID, *range(4, 4 + k)] for k in range(1, 17)]  # 16 different prompt lengths
    alone = [await engine.generate(req(p, n=2, max_tokens=5, seed=k, ignore_eos=True)) for k, p in enumerate(prompts)]
    batches_before = engine.batches
    together = await asyncio.gather(
        *(engine.generate(req(p, n=2, max_tokens=5, seed=k, ignore_eos=True)) for k, p in enumerate(prompts))
    )
    used = engine.batches - batches_before
    assert used <= 2, f"16 simultaneous requests took {used} batches"
    for one, many, p in zip(alone, together, prompts, strict=True):
        assert many["prompt_token_ids"] == p
        assert many["token_ids"] == one["token_ids"]  # left padding does not change the result
        for i in range(2):
            _, l1 = sampled(one, i)
            _, l2 = sampled(many, i)
            assert max(abs(a - b) for a, b in zip(l1, l2, strict=True)) < 1e-4


async def test_stop_strings_stop_token_ids_eos_and_length(engine: TorchEngine) -> None:
    tok = engine.tokenizer

    seed = 0

    def gen(**kw: Any) -> Any:  # seeded sampling: the same tokens up to wherever a stop cuts
        return engine.generate(req(max_tokens=8, seed=seed, ignore_eos=kw.pop("ignore_eos", True), **kw))

    for seed in range(50):  # noqa: B007 - gen() reads it: a sample with a character first seen after the start
        base = await gen()
        ids, text = base["token_ids"][0], base["text"][0]
        chars = [tok.decode([t]) for t in ids]
        k = next((i for i in range(1, 8) if chars[i] and chars[i] not in "".join(chars[:i])), None)
        if k is not None:
            break
    assert k is not None
    assert base["finish_reasons"] == ["length"] and len(ids) == 8
    assert text == tok.decode(ids, skip_special_tokens=True)
    stopped = await gen(stop=[chars[k]])
    assert stopped["finish_reasons"] == ["stop"]
    assert stopped["token_ids"][0] == ids[: k + 1]  # the token that completed the stop string is kept
    assert stopped["text"][0] == "".join(chars[:k])  # the stop string itself is not in the text
    kept = await gen(stop=chars[k], include_stop_str_in_output=True)
    assert kept["text"][0] == "".join(chars[: k + 1])
    by_id = await gen(stop_token_ids=[ids[k]])
    assert by_id["finish_reasons"] == ["stop"] and by_id["token_ids"][0] == ids[: k + 1]
    assert engine.eos_ids == {EOS_ID}
    engine.eos_ids = frozenset({ids[k]})  # make that token the end of sequence
    eos = await gen(ignore_eos=False)
    assert eos["finish_reasons"] == ["stop"] and eos["token_ids"][0] == ids[: k + 1]
    assert len(eos["logprobs"][0]) == k + 1  # a sampled EOS is the last token, with its logprob
    ignored = await gen()
    assert ignored["token_ids"][0] == ids and ignored["finish_reasons"] == ["length"]


async def test_prompt_logprobs_with_alternatives(engine: TorchEngine) -> None:
    resp = await engine.generate(req(max_tokens=1, temperature=0.0, prompt_logprobs=3))
    pl = resp["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(PROMPT)
    ref = reference_logprobs(engine.model, PROMPT, 1, 1.0)
    for j in range(1, len(PROMPT)):
        entry = pl[j]
        assert str(PROMPT[j]) in entry and 3 <= len(entry) <= 4
        assert abs(entry[str(PROMPT[j])] - ref[j - 1]) < 2e-3
    alts = await engine.generate(req(max_tokens=2, logprobs=2, ignore_eos=True))
    for item in alts["logprobs"][0]:
        assert len(item) == 3 and all(len(d) == 1 for d in item)  # sampled first, then the top 2


@pytest.mark.parametrize(
    "body, message",
    [
        ({"prompt": "1+1="}, "prompt must be"),
        (req([]), "prompt must be"),
        (req([1, 99]), "outside the vocabulary"),
        (req(max_tokens=0), "max_tokens"),
        (req(max_tokens=MAX_MODEL_LEN), "exceeds max_model_len"),
        (req(n=0), "n must be"),
        (req(temperature=-1), "temperature"),
        (req(top_p=0), "top_p"),
        (req(stop=[3]), "stop must be"),
        (req(seed="x"), "seed must be"),
        (req(frequency_penalty=0.5), "not supported"),
        (req(bogus=1), "unknown field"),
        ([1, 2], "JSON object"),
    ],
)
async def test_bad_requests_are_refused(engine: TorchEngine, body: Any, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        await engine.generate(body)


async def test_pause_waits_for_inflight_and_holds_new_requests(engine: TorchEngine) -> None:
    long = asyncio.ensure_future(engine.generate(req(n=16, max_tokens=60, ignore_eos=True)))
    deadline = time.monotonic() + 30
    while engine.stats()["inflight"] == 0:  # the engine exposes no event for admission
        assert time.monotonic() < deadline, "the generation was never admitted"
        await asyncio.sleep(0)
    paused = await engine.pause()
    assert long.done(), "pause returned before the in-flight generation finished"
    assert paused == {"paused": True, "weight_version": 0}
    held = asyncio.ensure_future(engine.generate(req(max_tokens=2)))
    probe = await engine.generate(req(max_tokens=1), bypass_pause=True)  # the readiness probe passes
    assert probe["weight_version"] == 0
    assert not held.done()
    with pytest.raises(NotPaused):
        engine._inflight += 1  # an admitted request: updates must wait for it
        try:
            await engine.load_weights({"path": "/nowhere", "weight_version": 1})
        finally:
            engine._inflight -= 1
    await engine.resume(7)
    resp = await asyncio.wait_for(held, 30)
    assert resp["weight_version"] == 7
    with pytest.raises(NotPaused):
        await engine.load_weights({"path": "/nowhere", "weight_version": 8})
    assert (await engine.weight_info())["weight_version"] == 7


async def test_await_weights_starts_paused(tiny_dir: Path) -> None:
    eng = TorchEngine(model_dir=tiny_dir, max_model_len=MAX_MODEL_LEN, await_weights=True)
    await eng.start()
    try:
        await eng.check_health()
        info = await eng.weight_info()
        assert info["paused"] and info["awaiting_weights"]
        held = asyncio.ensure_future(eng.generate(req(max_tokens=1)))
        # The readiness probe's generation passes the closed gate (a deadline, not a hang, if not).
        probe = await asyncio.wait_for(eng.generate(req(max_tokens=1), bypass_pause=True), 30)
        assert probe["weight_version"] == 0
        assert not held.done() and (await eng.weight_info())["waiting"] == 1
        await eng.resume(3)
        assert (await asyncio.wait_for(held, 30))["weight_version"] == 3
        assert not (await eng.weight_info())["awaiting_weights"]
    finally:
        await eng.close()


async def test_awaiting_server_takes_its_first_weights_by_reload(tiny_dir: Path, tmp_path: Path) -> None:
    """reload mode: a (restarted) server started awaiting weights serves nothing until the
    trainer's /load and /resume, and then serves the loaded weights (SPEC §4)."""
    from transformers import AutoModelForCausalLM

    from atroposd.weights.receiver import ReceiverState
    from atroposd.weights.reload import write_sync_dir

    sync_dir = tmp_path / "sync"
    receiver = ReceiverState(nonce="reloadtest", weights_dir=tmp_path / "weights", sync_dir=sync_dir)
    eng = TorchEngine(model_dir=tiny_dir, max_model_len=MAX_MODEL_LEN, await_weights=True, receiver=receiver)
    await eng.start()
    try:
        probe = req(max_tokens=1, prompt_logprobs=0)
        base = (await eng.generate(probe, bypass_pause=True))["prompt_logprobs"]
        held = asyncio.ensure_future(eng.generate(probe))
        trained = AutoModelForCausalLM.from_pretrained(str(tiny_dir))
        with torch.no_grad():
            trained.get_input_embeddings().weight.mul_(1.5)
        path = write_sync_dir(trained, sync_dir, 4)
        loaded = await eng.load_weights({"path": str(path), "weight_version": 4})
        assert loaded["weight_version"] == 4
        assert not held.done() and (await eng.weight_info())["awaiting_weights"]
        await eng.resume(4)
        answer = await asyncio.wait_for(held, 30)
        assert answer["weight_version"] == 4 and answer["prompt_logprobs"] != base
        assert (await eng.weight_info())["updates"] == 1
    finally:
        await eng.close()


def test_flat_llama_forward_matches_the_models_own(tiny_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from atroposd.inference.schema import GenerateParams
    from atroposd.inference.steppers import LlamaStepper
    from atroposd.inference.torch_engine import decode_batch

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    assert LlamaStepper.supports(model)
    reqs = [
        GenerateParams(
            prompt_ids=[BOS_ID, *range(4, 4 + k)],
            n=1 + k % 3,
            max_tokens=4 + k,
            seed=k,
            prompt_logprobs=1 if k % 2 else None,
        )
        for k in range(1, 7)
    ]
    results = []
    for fast in (True, False):
        with torch.inference_mode():
            results.append(
                decode_batch(
                    model,
                    reqs,
                    tokenizer=tok,
                    eos_ids=frozenset({EOS_ID}),
                    generator=torch.Generator().manual_seed(0),
                    fast=fast,
                )
            )
    (fast_c, fast_p), (hf_c, hf_p) = results
    for a, b in zip(fast_c, hf_c, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-4
    for a, b in zip(fast_p, hf_p, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert a[0] is None and b[0] is None
            assert all(abs(a[j][k] - b[j][k]) < 1e-4 for j in range(1, len(a)) for k in a[j])


def test_flat_forward_declines_what_it_does_not_implement(tiny_dir: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from atroposd.inference.steppers import LlamaStepper

    cfg = AutoConfig.from_pretrained(str(tiny_dir))
    cfg.attention_bias = True
    assert not LlamaStepper.supports(AutoModelForCausalLM.from_config(cfg))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir))
    model.model.layers[0].self_attn.q_proj = torch.nn.Sequential(model.model.layers[0].self_attn.q_proj)
    assert not LlamaStepper.supports(model)  # a wrapped projection (LoRA, for one) needs the model's forward


async def test_a_failing_batch_answers_its_requests_and_the_engine_goes_on(engine: TorchEngine) -> None:
    real = engine.model.forward
    engine.model.forward = None  # every forward pass raises TypeError
    engine.fast = False
    try:
        results = await asyncio.gather(*(engine.generate(req(max_tokens=2)) for _ in range(3)), return_exceptions=True)
        assert all(isinstance(r, TypeError) for r in results)
    finally:
        engine.model.forward = real
    await engine.check_health()
    assert len((await engine.generate(req(max_tokens=2, ignore_eos=True)))["token_ids"][0]) == 2


async def test_close_waits_for_the_running_batch_and_answers_it(tiny_dir: Path) -> None:
    eng = TorchEngine(model_dir=tiny_dir, max_model_len=MAX_MODEL_LEN)
    await eng.start()
    long = asyncio.ensure_future(eng.generate(req(n=16, max_tokens=60, ignore_eos=True)))
    deadline = time.monotonic() + 30
    while eng._running is None:  # the engine exposes no event for a started batch
        assert time.monotonic() < deadline, "the batch never started"
        await asyncio.sleep(0.001)
    await eng.close()
    assert eng._running.done()  # close() returned only after the forward passes ended
    result = await asyncio.wait_for(long, 30)
    assert len(result["token_ids"]) == 16  # and the batch was delivered


async def test_rows_that_stop_early_get_nothing_after_their_stop(engine: TorchEngine) -> None:
    """Rows of one batch finish at different steps; a finished row stays in the cache (decoding
    padding) until enough rows are done, and none of that may reach its completion."""
    stops = [6, 9, 12]  # three of the 22 ids: some rows stop at each step, most go on
    resp = await engine.generate(req(n=48, max_tokens=8, temperature=1.0, seed=3, stop_token_ids=stops))
    stops.append(EOS_ID)
    early = 0
    for i, (ids, reason) in enumerate(zip(resp["token_ids"], resp["finish_reasons"], strict=True)):
        enders = [*stops, EOS_ID]
        assert not any(t in enders for t in ids[:-1]), f"completion {i} goes on after a stop token: {ids}"
        if reason == "stop":
            assert ids[-1] in enders
            early += len(ids) < 8
        else:
            assert reason == "length" and len(ids) == 8
        got_ids, lps = sampled(resp, i)
        assert got_ids == ids
        ref = reference_logprobs(engine.model, PROMPT + ids, len(PROMPT), 1.0)
        assert max(abs(a - b) for a, b in zip(lps, ref, strict=True)) < 2e-3
    assert early >= 3, "the sample should hold rows that stopped before max_tokens"

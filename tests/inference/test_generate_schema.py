"""One ``/generate`` parser for every engine: the same bodies sent to the torch engine's and
the vLLM engine's validation get the same answers, except what an engine states it cannot
honour (the vLLM engine: ``top_p < 1``, ``top_k > 0``, SPEC §7). Neither engine is started:
the vLLM engine's mapping runs without vllm installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from atroposd.inference import schema
from atroposd.inference.schema import BadRequest
from atroposd.inference.torch_engine import TorchEngine
from atroposd.inference.vllm_engine import REFUSED, VllmEngine, sampling_kwargs

VOCAB = 22
MAX_LEN = 64
PROMPT = [1, 7, 14]


def req(**kw: Any) -> dict[str, Any]:
    return {"prompt": {"prompt_token_ids": PROMPT}, **kw}


# Bodies every engine accepts.
VALID = [
    req(),
    req(n=4, max_tokens=8, temperature=0.7, seed=3),
    req(n=schema.MAX_N, max_tokens=1),
    req(max_new_tokens=5),
    req(max_completion_tokens=5),
    req(best_of=2, n=2),
    req(temperature=0.0),
    req(stop="x"),
    req(stop=["a", "b"]),
    req(stop_token_ids=[2, 3]),
    req(logprobs=None),
    req(logprobs=0),
    req(logprobs=schema.MAX_LOGPROBS),
    req(prompt_logprobs=0),
    req(prompt_logprobs=schema.MAX_LOGPROBS),
    req(ignore_eos=True, skip_special_tokens=False, include_stop_str_in_output=True),
    req(model="m"),
    req(presence_penalty=0.0, frequency_penalty=0, repetition_penalty=1.0, min_p=0.0, min_tokens=0),
    req(top_p=1.0, top_k=0),
    req(top_k=-1),
]

# Bodies every engine refuses (with the same message).
INVALID = [
    None,
    [1],
    {},
    {"prompt": "text"},
    req(bogus=1),
    {"prompt": {"prompt_token_ids": []}},
    {"prompt": {"prompt_token_ids": [1, VOCAB]}},
    {"prompt": {"prompt_token_ids": [-1]}},
    {"prompt": {"prompt_token_ids": [True]}},
    req(n=0),
    req(n=schema.MAX_N + 1),
    req(n=1.5),
    req(best_of=3, n=2),
    req(max_tokens=0),
    req(max_tokens=MAX_LEN),
    req(max_tokens="8"),
    req(temperature=-0.1),
    req(temperature=float("nan")),
    req(top_p=0.0),
    req(top_p=1.5),
    req(top_k=-2),
    req(stop=[1]),
    req(stop=""),
    req(stop_token_ids=[VOCAB]),
    req(seed=1.5),
    req(seed="1"),
    req(logprobs=-1),
    req(logprobs=schema.MAX_LOGPROBS + 1),
    req(prompt_logprobs=schema.MAX_LOGPROBS + 1),
    req(prompt_logprobs=-1),
    req(ignore_eos=1),
    req(min_tokens=2),
    req(presence_penalty=0.5),
    req(repetition_penalty=1.1),
    req(min_p=0.1),
]

# Valid bodies the vLLM engine states it cannot honour.
VLLM_REFUSED = [req(top_p=0.9), req(top_k=5), req(top_p=0.5, top_k=2)]


def _answer(validate: Any, body: Any) -> tuple[str, Any]:
    try:
        parsed = validate(body)
    except BadRequest as exc:
        return "400", str(exc)
    return "ok", parsed[0] if isinstance(parsed, tuple) else parsed


@pytest.fixture
def engines(tmp_path: Path) -> tuple[TorchEngine, VllmEngine]:
    torch_engine = TorchEngine(model_dir=tmp_path, max_model_len=MAX_LEN)
    vllm_engine = VllmEngine(model=str(tmp_path), max_model_len=MAX_LEN)
    torch_engine.vocab_size = vllm_engine.vocab_size = VOCAB  # what each reads from the model at start
    return torch_engine, vllm_engine


@pytest.mark.parametrize("body", VALID + INVALID, ids=repr)
def test_both_engines_answer_alike(engines: tuple[TorchEngine, VllmEngine], body: Any) -> None:
    torch_engine, vllm_engine = engines
    torch_answer, vllm_answer = _answer(torch_engine.validate, body), _answer(vllm_engine.validate, body)
    assert torch_answer == vllm_answer
    assert torch_answer[0] == ("ok" if body in VALID else "400"), torch_answer


@pytest.mark.parametrize("body", VLLM_REFUSED, ids=repr)
def test_vllm_engine_states_what_it_cannot_honour(engines: tuple[TorchEngine, VllmEngine], body: Any) -> None:
    torch_engine, vllm_engine = engines
    assert isinstance(torch_engine.validate(body), schema.GenerateParams)
    with pytest.raises(BadRequest, match="top_p < 1 and top_k > 0 are not supported"):
        vllm_engine.validate(body)
    assert REFUSED == ("top_p < 1", "top_k > 0")


def test_vllm_mapping_carries_every_field() -> None:
    params = schema.parse_generate(
        req(
            n=3,
            max_tokens=7,
            temperature=0.5,
            stop="x",
            stop_token_ids=[4],
            seed=9,
            logprobs=2,
            prompt_logprobs=1,
            ignore_eos=True,
            skip_special_tokens=False,
            include_stop_str_in_output=True,
        ),
        max_model_len=MAX_LEN,
        vocab_size=VOCAB,
    )
    assert sampling_kwargs(params) == {
        "n": 3,
        "max_tokens": 7,
        "temperature": 0.5,
        "stop": ["x"],
        "stop_token_ids": [4],
        "seed": 9,
        "logprobs": 2,
        "prompt_logprobs": 1,
        "ignore_eos": True,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
    }
    plain = sampling_kwargs(schema.parse_generate(req(), max_model_len=MAX_LEN, vocab_size=VOCAB))
    assert plain == {
        "n": 1,
        "max_tokens": schema.DEFAULT_MAX_TOKENS,
        "temperature": 1.0,
        "logprobs": 0,
        "ignore_eos": False,
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
    }


def test_generated_tokens_per_request_are_bounded() -> None:
    long = 1 << 16
    n = schema.MAX_REQUEST_TOKENS // long
    schema.parse_generate(req(n=n, max_tokens=long), max_model_len=long + 8, vocab_size=VOCAB)
    with pytest.raises(BadRequest, match="n × max_tokens"):
        schema.parse_generate(req(n=n + 1, max_tokens=long), max_model_len=long + 8, vocab_size=VOCAB)

"""Wire formats of the inference server: the Atropos ``/generate`` request and response
(SPEC §7, ATROPOS-PROTOCOL.md §1.4) and the OpenAI-style shapes built on top of them.

A request is validated completely here, before anything is queued: a malformed one raises
:class:`BadRequest` (the server answers 400 with its message). This is the one parser of
``/generate`` for every engine: :func:`parse_generate` gives a :class:`GenerateParams`, and
each engine maps that to its own sampling parameters, refusing (with a ``BadRequest``) only
what it cannot honour — the vLLM engine refuses ``top_p < 1`` and ``top_k > 0`` (SPEC §7).

Bounds that keep one request from allocating without limit (SPEC §13): ``n ≤ MAX_N``,
``logprobs`` and ``prompt_logprobs ≤ MAX_LOGPROBS`` (vLLM's ``max_logprobs`` default),
``n × max_tokens ≤ MAX_REQUEST_TOKENS``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MAX_LOGPROBS", "MAX_N", "MAX_REQUEST_TOKENS", "BadRequest", "Completion", "GenerateParams",
           "chat_response", "completion_response", "generate_response", "parse_generate"]

DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default, which /generate inherits


class BadRequest(ValueError):
    """A request that must be answered with HTTP 400 and this message."""


@dataclass(frozen=True)
class GenerateParams:
    """One validated ``/generate`` request."""

    prompt_ids: list[int]
    n: int = 1
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # ≤ 0: off
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: int = 0  # top alternatives per token besides the sampled one
    prompt_logprobs: int | None = None  # None: not asked
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


@dataclass
class Completion:
    """One generated sequence. ``logprobs[i]`` is the sampled token's logprob at step i;
    ``top[i]`` the requested alternatives ``[(id, logprob), ...]`` (empty when not asked)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    text: str = ""
    top: list[list[tuple[int, float]]] = field(default_factory=list)


# Fields vLLM's SamplingParams accepts that are meaningful here only at their neutral value:
# anything else would change the sampling distribution without the trainer knowing.
_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
            "min_tokens": 0}
_KNOWN = {"prompt", "n", "max_tokens", "max_new_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "stop", "stop_token_ids", "seed", "logprobs", "prompt_logprobs", "ignore_eos", "skip_special_tokens",
          "include_stop_str_in_output", "model", "best_of", *_NEUTRAL}
MAX_N = 256
# vLLM's ``ModelConfig.max_logprobs`` default (its processor refuses more, for logprobs and
# prompt_logprobs alike): a larger k would materialise k entries per position.
MAX_LOGPROBS = 20
# Generated tokens one request may ask for (n × max_tokens): 64 completions of 16k tokens.
MAX_REQUEST_TOKENS = 1 << 20


def parse_generate(body: Any, *, max_model_len: int, vocab_size: int) -> GenerateParams:
    """Validate an Atropos ``/generate`` body (see the module docstring)."""
    if not isinstance(body, Mapping):
        raise BadRequest("request must be a JSON object")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(unknown)}")
    prompt = body.get("prompt")
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, Mapping) else None
    if not isinstance(ids, list) or not ids or not all(_is_int(i) for i in ids):
        raise BadRequest('prompt must be {"prompt_token_ids": [token ids, at least one]}')
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise BadRequest(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return sampling_params(body, ids, max_model_len=max_model_len, vocab_size=vocab_size)


def sampling_params(body: Mapping[str, Any], ids: list[int], *, max_model_len: int, vocab_size: int,
                    default_max_tokens: int | None = DEFAULT_MAX_TOKENS) -> GenerateParams:
    """The sampling fields shared by ``/generate`` and the OpenAI routes."""
    for key, neutral in _NEUTRAL.items():
        value = body.get(key)
        if value is not None and value != neutral:
            raise BadRequest(f"{key} = {value!r} is not supported (the trainer's logprobs do not apply it); "
                             f"leave it at {neutral}")
    n = _int(body, "n", 1, lo=1, hi=MAX_N)
    if body.get("best_of") not in (None, n):
        raise BadRequest("best_of is not supported")
    raw_max = next((body[k] for k in ("max_tokens", "max_new_tokens", "max_completion_tokens")
                    if body.get(k) is not None), None)
    room = max_model_len - len(ids)
    if raw_max is None and default_max_tokens is None:
        raw_max = room  # OpenAI routes: "as many as fit"
    max_tokens = _int({"max_tokens": raw_max}, "max_tokens", DEFAULT_MAX_TOKENS, lo=1)
    if max_tokens > room:
        raise BadRequest(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                         f"({max_model_len}); nothing is truncated")
    if n * max_tokens > MAX_REQUEST_TOKENS:
        raise BadRequest(f"n × max_tokens = {n} × {max_tokens} exceeds {MAX_REQUEST_TOKENS} generated tokens per "
                         "request; split the request")
    stop_raw = body.get("stop")
    if isinstance(stop_raw, str):
        stop_raw = [stop_raw]
    if stop_raw is not None and (not isinstance(stop_raw, list) or not all(isinstance(s, str) and s for s in stop_raw)):
        raise BadRequest("stop must be a non-empty string or a list of them")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(i) and 0 <= i < vocab_size for i in stop_ids):
        raise BadRequest(f"stop_token_ids must be a list of token ids (0..{vocab_size - 1})")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise BadRequest(f"seed must be an integer, got {seed!r}")
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is not None:
        prompt_logprobs = _int(body, "prompt_logprobs", 0, lo=0, hi=min(vocab_size, MAX_LOGPROBS))
    return GenerateParams(
        prompt_ids=list(ids), n=n, max_tokens=max_tokens,
        temperature=_float(body, "temperature", 1.0, lo=0.0),
        top_p=_float(body, "top_p", 1.0, lo=0.0, hi=1.0, open_lo=True),
        top_k=_int(body, "top_k", 0, lo=-1),
        stop=tuple(stop_raw or ()), stop_token_ids=tuple(stop_ids), seed=seed,
        logprobs=_int({"logprobs": body.get("logprobs") or 0}, "logprobs", 0, lo=0, hi=min(vocab_size, MAX_LOGPROBS)),
        prompt_logprobs=prompt_logprobs,
        ignore_eos=_bool(body, "ignore_eos", False),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: Mapping[str, Any], key: str, default: int, *, lo: int | None = None, hi: int | None = None) -> int:
    v = body.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise BadRequest(f"{key} must be an integer, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"{key} must be in [{lo}, {hi if hi is not None else '∞'}], got {v}")
    return int(v)


def _float(body: Mapping[str, Any], key: str, default: float, *, lo: float, hi: float | None = None,
           open_lo: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise BadRequest(f"{key} must be a number, got {v!r}")
    if v < lo or (open_lo and v == lo) or (hi is not None and v > hi):
        raise BadRequest(f"{key} must be in {'(' if open_lo else '['}{lo}, {hi if hi is not None else '∞'}], got {v}")
    return float(v)


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{key} must be true or false, got {v!r}")
    return v


# ---------------------------------------------------------------------------- responses


def generate_response(params: GenerateParams, completions: Sequence[Completion], *, weight_version: int,
                      prompt_text: str, prompt_logprobs: list[dict[str, float] | None] | None) -> dict[str, Any]:
    """The Atropos ``/generate`` response: ``logprobs[completion][token] = [{"<id>": lp}, ...]``
    (the sampled token first; atroposlib reads ``item[0]``)."""
    logprobs = [[[{str(tid): lp}, *({str(a): b} for a, b in (c.top[i] if c.top else ()))]
                 for i, (tid, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True))] for c in completions]
    body: dict[str, Any] = {
        "text": [c.text for c in completions],
        "token_ids": [c.token_ids for c in completions],
        "logprobs": logprobs,
        "finish_reasons": [c.finish_reason for c in completions],
        "weight_version": weight_version,
        "prompt": prompt_text,
        "prompt_token_ids": params.prompt_ids,
    }
    if params.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    return body


def _choice_tokens(gen: Mapping[str, Any], i: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """(token id, logprob, alternatives) per token of completion ``i`` of a /generate response."""
    out = []
    for entry in gen["logprobs"][i]:
        (tid, lp), *alts = (next(iter(d.items())) for d in entry)
        out.append((int(tid), float(lp), [(int(a), float(b)) for a, b in alts]))
    return out


def _usage(gen: Mapping[str, Any]) -> dict[str, int]:
    prompt = len(gen.get("prompt_token_ids") or [])
    completion = sum(len(t) for t in gen["token_ids"])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_response(model: str, gen: Mapping[str, Any], *, want_logprobs: bool, decode: Any) -> dict[str, Any]:
    """OpenAI ``text_completion`` from a /generate response (one prompt)."""
    def logprobs(i: int) -> dict[str, Any]:
        toks = _choice_tokens(gen, i)
        tokens = [decode(t) for t, _, _ in toks]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in toks],
                "top_logprobs": [{decode(a): b for a, b in alts} for _, _, alts in toks],
                "text_offset": offsets, "token_ids": [t for t, _, _ in toks]}

    return {
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": i, "text": text, "finish_reason": reason,
                     "logprobs": logprobs(i) if want_logprobs else None}
                    for i, (text, reason) in enumerate(zip(gen["text"], gen["finish_reasons"], strict=True))],
        "usage": _usage(gen),
        "weight_version": gen["weight_version"],
    }


def chat_response(model: str, gen: Mapping[str, Any], *, want_logprobs: bool, decode: Any) -> dict[str, Any]:
    """OpenAI ``chat.completion`` from a /generate response; logprobs in the ``content`` form."""
    def item(tid: int, lp: float, alts: list[tuple[int, float]]) -> dict[str, Any]:
        tok = decode(tid)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "token_id": tid,
                "top_logprobs": [{"token": decode(a), "logprob": b, "bytes": list(decode(a).encode())}
                                 for a, b in alts]}

    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                     "logprobs": {"content": [item(*t) for t in _choice_tokens(gen, i)]} if want_logprobs else None}
                    for i, (text, reason) in enumerate(zip(gen["text"], gen["finish_reasons"], strict=True))],
        "usage": _usage(gen),
        "weight_version": gen["weight_version"],
    }

"""Wire formats of the inference server: the Atropos ``/generate`` request and response
(SPEC §7, ATROPOS-PROTOCOL.md §1.4) and the OpenAI-style shapes built on top of them.

A request is validated completely here, before anything is queued: a malformed one raises
:class:`BadRequest` (the server answers 400 with its message). This is the one parser of
``/generate`` for every engine: :func:`parse_generate` gives a :class:`GenerateParams`, and
each engine maps that to its own sampling parameters, refusing (with a ``BadRequest``) only
what it cannot honour — the vLLM engine refuses ``top_p < 1`` and ``top_k > 0`` (SPEC §7).

Bounds that keep one request from allocating without limit (SPEC §13): ``n ≤ MAX_N``,
``logprobs`` and ``prompt_logprobs ≤ MAX_LOGPROBS`` (vLLM's ``max_logprobs`` default), and
for the whole request, whatever its number of prompts: at most ``MAX_PROMPTS`` prompts,
``Σ prompts × n × max_tokens ≤ MAX_REQUEST_TOKENS`` (:func:`check_totals`), at most
``MAX_REQUEST_TOKENS`` prompt tokens in all; a prompt given as text at most ``max_model_len ×
TEXT_BYTES_PER_TOKEN`` bytes, refused before it is tokenized (:func:`check_text`); SGLang's
``rid`` at most ``MAX_RID_CHARS`` characters (it is echoed once per sample).

A request is a probe (:data:`LANES`: ``probe``) when it asks for ``max_tokens ≤ 1``, ``n = 1``
and at most ``PROBE_MAX_PROMPT_TOKENS`` prompt tokens beyond the chat template's own
(:func:`with_lane`, SPEC §7): the engines answer at most ``PROBE_ROWS_PER_BATCH`` of them
ahead of each batch of rollouts. The daemon's own generations on the weight-control socket
(readiness, liveness, canaries) have a lane of their own (``own``), never capped.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_PROMPTS",
    "MAX_REQUEST_TOKENS",
    "MAX_RID_CHARS",
    "PROBE_MAX_PROMPT_TOKENS",
    "PROBE_MAX_TOKENS",
    "PROBE_ROWS_PER_BATCH",
    "TEXT_BYTES_PER_TOKEN",
    "BadRequest",
    "Completion",
    "GenerateParams",
    "SglangRequest",
    "chat_response",
    "check_text",
    "check_totals",
    "completion_response",
    "generate_response",
    "is_sglang",
    "parse_generate",
    "parse_sglang",
    "parse_trl",
    "sglang_response",
    "trl_response",
    "with_lane",
]

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
    #: the engine's queue it waits in (one of :data:`LANES`); set by the front, never by a body
    lane: str = "rollout"


@dataclass
class Completion:
    """One generated sequence. ``logprobs[i]`` is the sampled token's logprob at step i;
    ``top[i]`` the requested alternatives ``[(id, logprob), ...]`` (empty when not asked);
    ``versions`` the weight versions that sampled it, ``[[token_index, version], ...]`` (SPEC §7).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    text: str = ""
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)


# Fields vLLM's SamplingParams accepts that are meaningful here only at their neutral value:
# anything else would change the sampling distribution without the trainer knowing.
_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0}
_KNOWN = {
    "prompt",
    "n",
    "max_tokens",
    "max_new_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stop_token_ids",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "model",
    "best_of",
    *_NEUTRAL,
}
MAX_N = 256
# vLLM's ``ModelConfig.max_logprobs`` default (its processor refuses more, for logprobs and
# prompt_logprobs alike): a larger k would materialise k entries per position.
MAX_LOGPROBS = 20
# Generated tokens one request may ask for (Σ prompts × n × max_tokens): 64 completions of 16k
# tokens; and the prompt tokens one request may give, all its prompts together.
MAX_REQUEST_TOKENS = 1 << 20
MAX_PROMPTS = 256  # prompts in one request (the completions route's list, TRL's prompts)
MAX_RID_CHARS = 256  # SGLang's rid, echoed in every sample's meta_info
# A prompt given as text is refused past max_model_len × this many bytes before it is tokenized
# (no tokenizer makes a token of more than a few bytes of ordinary text).
TEXT_BYTES_PER_TOKEN = 16
# Probes (SPEC §7): what one may ask, and how many rows of them go ahead of each batch.
PROBE_MAX_PROMPT_TOKENS = 64
PROBE_ROWS_PER_BATCH = 4
LANES = ("rollout", "probe", "own")


def check_text(text: str, *, max_model_len: int, what: str = "prompt") -> None:
    """A prompt given as text: :class:`BadRequest` past ``max_model_len × TEXT_BYTES_PER_TOKEN``
    bytes (UTF-8), checked before anything tokenizes it."""
    limit = max_model_len * TEXT_BYTES_PER_TOKEN
    if len(text) > limit or (4 * len(text) > limit and len(text.encode("utf-8", "surrogatepass")) > limit):
        raise BadRequest(
            f"{what} is longer than max_model_len × {TEXT_BYTES_PER_TOKEN} = {limit} bytes; it cannot fit "
            f"max_model_len ({max_model_len}) tokens"
        )


def check_texts(texts: Sequence[str], *, max_model_len: int, what: str = "prompt") -> None:
    """Several prompts given as text: each within :func:`check_text`'s bound, and all of them
    together within ``MAX_REQUEST_TOKENS × TEXT_BYTES_PER_TOKEN`` characters (before any is
    tokenized)."""
    total = 0
    for i, text in enumerate(texts):
        check_text(text, max_model_len=max_model_len, what=f"{what}[{i}]")
        total += len(text)
    if total > MAX_REQUEST_TOKENS * TEXT_BYTES_PER_TOKEN:
        raise BadRequest(
            f"the request's prompts hold {total} characters; at most {MAX_REQUEST_TOKENS * TEXT_BYTES_PER_TOKEN} "
            "in all: split the request"
        )


def check_count(count: int, what: str = "prompts") -> None:
    """At most :data:`MAX_PROMPTS` prompts in one request (checked before any is read)."""
    if count > MAX_PROMPTS:
        raise BadRequest(f"{count} {what} in one request; at most {MAX_PROMPTS}: split the request")


def check_totals(requests: Sequence[GenerateParams]) -> None:
    """The whole request's bounds: at most :data:`MAX_PROMPTS` prompts, ``Σ n × max_tokens ≤
    MAX_REQUEST_TOKENS`` and at most ``MAX_REQUEST_TOKENS`` prompt tokens in all."""
    check_count(len(requests))
    generated = sum(p.n * p.max_tokens for p in requests)
    if generated > MAX_REQUEST_TOKENS:
        raise BadRequest(
            f"prompts × n × max_tokens = {generated} exceeds {MAX_REQUEST_TOKENS} generated tokens per "
            "request; split the request"
        )
    prompt = sum(len(p.prompt_ids) for p in requests)
    if prompt > MAX_REQUEST_TOKENS:
        raise BadRequest(f"{prompt} prompt tokens exceed {MAX_REQUEST_TOKENS} per request; split the request")


def with_lane(params: GenerateParams, *, template_tokens: int = 0, own: bool = False) -> GenerateParams:
    """``params`` in its lane: ``own`` (the daemon's own generation of at most
    ``PROBE_MAX_TOKENS``), ``probe`` (``max_tokens ≤ PROBE_MAX_TOKENS``, ``n = 1``, at most
    ``PROBE_MAX_PROMPT_TOKENS`` prompt tokens beyond the chat template's ``template_tokens``), or
    ``rollout``."""
    short = params.max_tokens <= PROBE_MAX_TOKENS
    if own and short:
        lane = "own"
    elif short and params.n == 1 and len(params.prompt_ids) <= PROBE_MAX_PROMPT_TOKENS + max(0, template_tokens):
        lane = "probe"
    else:
        lane = "rollout"
    return params if params.lane == lane else replace(params, lane=lane)


def _check_fields(body: object, known: Collection[str]) -> Mapping[str, Any]:
    """A request body is a JSON object of known fields only (each route's first check)."""
    if not isinstance(body, Mapping):
        raise BadRequest("request must be a JSON object")
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(unknown)}")
    return body


def parse_generate(raw: object, *, max_model_len: int, vocab_size: int) -> GenerateParams:
    """Validate an Atropos ``/generate`` body (see the module docstring)."""
    body = _check_fields(raw, _KNOWN)
    prompt = body.get("prompt")
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, Mapping) else None
    ids = _check_ids(ids, max_model_len, 'prompt must be {"prompt_token_ids": [token ids, at least one]}')
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise BadRequest(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return with_lane(sampling_params(body, ids, max_model_len=max_model_len, vocab_size=vocab_size))


def _check_ids(ids: object, max_model_len: int, message: str) -> list[int]:
    """A prompt of token ids: a non-empty list of integers, refused at once when it is longer
    than ``max_model_len`` (before its ids are looked at one by one)."""
    if not isinstance(ids, list) or not ids:
        raise BadRequest(message)
    if len(ids) >= max_model_len:
        raise BadRequest(f"prompt ({len(ids)} tokens) leaves no room below max_model_len ({max_model_len})")
    if not all(_is_int(i) for i in ids):
        raise BadRequest(message)
    return ids


def sampling_params(
    body: Mapping[str, Any],
    ids: list[int],
    *,
    max_model_len: int,
    vocab_size: int,
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
) -> GenerateParams:
    """The sampling fields shared by ``/generate`` and the OpenAI routes."""
    for key, neutral in _NEUTRAL.items():
        value = body.get(key)
        if value is not None and value != neutral:
            raise BadRequest(
                f"{key} = {value!r} is not supported (the trainer's logprobs do not apply it); leave it at {neutral}"
            )
    n = _int(body, "n", 1, lo=1, hi=MAX_N)
    if body.get("best_of") not in (None, n):
        raise BadRequest("best_of is not supported")
    max_key = next(
        (k for k in ("max_tokens", "max_new_tokens", "max_completion_tokens") if body.get(k) is not None), "max_tokens"
    )
    raw_max = body.get(max_key)
    room = max_model_len - len(ids)
    if raw_max is None and default_max_tokens is None:
        raw_max = room  # OpenAI routes: "as many as fit"
    max_tokens = _int({max_key: raw_max}, max_key, DEFAULT_MAX_TOKENS, lo=1)
    if max_tokens > room:
        raise BadRequest(
            f"prompt ({len(ids)} tokens) + {max_key} ({max_tokens}) exceeds max_model_len "
            f"({max_model_len}); nothing is truncated"
        )
    if n * max_tokens > MAX_REQUEST_TOKENS:
        raise BadRequest(
            f"n × max_tokens = {n} × {max_tokens} exceeds {MAX_REQUEST_TOKENS} generated tokens per "
            "request; split the request"
        )
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
        prompt_ids=list(ids),
        n=n,
        max_tokens=max_tokens,
        temperature=_float(body, "temperature", 1.0, lo=0.0),
        top_p=_float(body, "top_p", 1.0, lo=0.0, hi=1.0, open_lo=True),
        top_k=_int(body, "top_k", 0, lo=-1),
        stop=tuple(stop_raw or ()),
        stop_token_ids=tuple(stop_ids),
        seed=seed,
        logprobs=_int({"logprobs": body.get("logprobs") or 0}, "logprobs", 0, lo=0, hi=min(vocab_size, MAX_LOGPROBS)),
        prompt_logprobs=prompt_logprobs,
        ignore_eos=_bool(body, "ignore_eos", False),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
    )


def _is_int(v: object) -> bool:
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


def _float(
    body: Mapping[str, Any], key: str, default: float, *, lo: float, hi: float | None = None, open_lo: bool = False
) -> float:
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


def generate_response(
    params: GenerateParams,
    completions: Sequence[Completion],
    *,
    weight_version: int,
    prompt_text: str,
    prompt_logprobs: list[dict[str, float] | None] | None,
) -> dict[str, Any]:
    """The Atropos ``/generate`` response: ``logprobs[completion][token] = [{"<id>": lp}, ...]``
    (the sampled token first; atroposlib reads ``item[0]``)."""
    logprobs = [
        [
            [{str(tid): lp}, *({str(a): b} for a, b in (c.top[i] if c.top else ()))]
            for i, (tid, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True))
        ]
        for c in completions
    ]
    body: dict[str, Any] = {
        "text": [c.text for c in completions],
        "token_ids": [c.token_ids for c in completions],
        "logprobs": logprobs,
        "finish_reasons": [c.finish_reason for c in completions],
        "weight_version": weight_version,
        "prompt": prompt_text,
        "prompt_token_ids": params.prompt_ids,
    }
    records = [c.versions or [[0, weight_version]] for c in completions]
    if any(len(r) > 1 for r in records):  # only a response with a completion that spans a swap carries it
        body["weight_versions"] = records
    if params.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    return body


def spans_of(gen: Mapping[str, Any], i: int) -> list[list[int]] | None:
    """Completion ``i``'s ``[[token_index, version], ...]`` when it spans a weight swap, else None."""
    records = gen.get("weight_versions")
    record = records[i] if isinstance(records, list) and i < len(records) else None
    return record if isinstance(record, list) and len(record) > 1 else None


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


def completion_response(
    model: str, gen: Mapping[str, Any], *, want_logprobs: bool, decode: Callable[[int], str]
) -> dict[str, Any]:
    """OpenAI ``text_completion`` from a /generate response (one prompt)."""

    def logprobs(i: int) -> dict[str, Any]:
        toks = _choice_tokens(gen, i)
        tokens = [decode(t) for t, _, _ in toks]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in toks],
            "top_logprobs": [{decode(a): b for a, b in alts} for _, _, alts in toks],
            "text_offset": offsets,
            "token_ids": [t for t, _, _ in toks],
        }

    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            _with_spans(
                {"index": i, "text": text, "finish_reason": reason, "logprobs": logprobs(i) if want_logprobs else None},
                gen,
                i,
            )
            for i, (text, reason) in enumerate(zip(gen["text"], gen["finish_reasons"], strict=True))
        ],
        "usage": _usage(gen),
        "weight_version": gen["weight_version"],
    }


def _with_spans(choice: dict[str, Any], gen: Mapping[str, Any], i: int) -> dict[str, Any]:
    """An OpenAI choice with ``weight_versions`` (an extension field) when its completion spans a swap."""
    spans = spans_of(gen, i)
    if spans is not None:
        choice["weight_versions"] = spans
    return choice


def chat_response(
    model: str, gen: Mapping[str, Any], *, want_logprobs: bool, decode: Callable[[int], str]
) -> dict[str, Any]:
    """OpenAI ``chat.completion`` from a /generate response; logprobs in the ``content`` form."""

    def item(tid: int, lp: float, alts: list[tuple[int, float]]) -> dict[str, Any]:
        tok = decode(tid)
        return {
            "token": tok,
            "logprob": lp,
            "bytes": list(tok.encode()),
            "token_id": tid,
            "top_logprobs": [{"token": decode(a), "logprob": b, "bytes": list(decode(a).encode())} for a, b in alts],
        }

    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            _with_spans(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": reason,
                    "logprobs": {"content": [item(*t) for t in _choice_tokens(gen, i)]} if want_logprobs else None,
                },
                gen,
                i,
            )
            for i, (text, reason) in enumerate(zip(gen["text"], gen["finish_reasons"], strict=True))
        ],
        "usage": _usage(gen),
        "weight_version": gen["weight_version"],
    }


# ---------------------------------------------------------------------------- probes

PROBE_MAX_TOKENS = 1  # a generation request asking for at most this many tokens may be a probe


# ---------------------------------------------------------------------------- SGLang's /generate

# SGLang's sampling_params → this server's names (the rest keep theirs).
_SGLANG_RENAMED = {
    "max_new_tokens": "max_new_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
    "no_stop_trim": "include_stop_str_in_output",
}
_SGLANG_SAMPLING = {
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "seed",
    "ignore_eos",
    "skip_special_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    *_SGLANG_RENAMED,
}
# Fields SGLang accepts that change nothing here at these values.
_SGLANG_NEUTRAL = {"spaces_between_special_tokens": True}
_SGLANG_FIELDS = {
    "input_ids",
    "text",
    "sampling_params",
    "return_logprob",
    "return_text_in_logprobs",
    "logprob_start_len",
    "top_logprobs_num",
    "rid",
    "stream",
    "model",
}
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's own default


def is_sglang(body: object) -> bool:
    """Whether a ``/generate`` body is SGLang's (``input_ids`` or ``text``, ``sampling_params``)
    rather than vLLM's (``prompt``): the two share the route and are told apart by the body."""
    return (
        isinstance(body, Mapping)
        and "prompt" not in body
        and any(k in body for k in ("input_ids", "text", "sampling_params"))
    )


@dataclass(frozen=True)
class SglangRequest:
    """One validated SGLang ``/generate`` request."""

    params: GenerateParams
    return_logprob: bool = False
    text_in_logprobs: bool = False
    logprob_start_len: int = -1  # -1: logprobs of the output only
    top_logprobs_num: int = 0
    rid: str | None = None


def parse_sglang(
    raw: object, *, max_model_len: int, vocab_size: int, encode: Callable[[str], list[int]]
) -> SglangRequest:
    """Validate an SGLang ``/generate`` body (SPEC §7); ``encode`` tokenizes ``text`` as
    SGLang does (special tokens added). Errors name the SGLang field."""
    body = _check_fields(raw, _SGLANG_FIELDS)
    if body.get("stream"):
        raise BadRequest("stream = true is not supported; ask for the whole response")
    if body.get("input_ids") is not None and body.get("text") is not None:
        raise BadRequest("give input_ids or text, not both")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest(f"rid must be a string, got {rid!r:.100}")
    if rid is not None and len(rid) > MAX_RID_CHARS:
        raise BadRequest(f"rid is {len(rid)} characters long; at most {MAX_RID_CHARS}")
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        _check_ids(
            ids, max_model_len, "input_ids must be a non-empty list of token ids (one prompt; batches are not served)"
        )
    elif body.get("text") is not None:
        if not isinstance(body["text"], str) or not body["text"]:
            raise BadRequest("text must be a non-empty string (one prompt; batches are not served)")
        check_text(body["text"], max_model_len=max_model_len, what="text")
        ids = list(encode(body["text"]))
    else:
        raise BadRequest("input_ids or text is required")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise BadRequest(f"input_ids: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    sp = body.get("sampling_params")
    if sp is None:
        sp = {}
    if not isinstance(sp, Mapping):
        raise BadRequest("sampling_params must be an object")
    unknown = sorted(set(sp) - _SGLANG_SAMPLING - set(_SGLANG_NEUTRAL))
    if unknown:
        raise BadRequest(f"sampling_params: unknown or unsupported field(s): {', '.join(unknown)}")
    for key, neutral in _SGLANG_NEUTRAL.items():
        if sp.get(key) is not None and sp[key] != neutral:
            raise BadRequest(f"sampling_params.{key} = {sp[key]!r} is not supported; leave it at {neutral}")
    if sp.get("seed") is not None and sp.get("sampling_seed") is not None:
        raise BadRequest("sampling_params: give seed or sampling_seed, not both")
    canonical: dict[str, Any] = {
        _SGLANG_RENAMED.get(str(k), str(k)): v for k, v in sp.items() if k not in _SGLANG_NEUTRAL
    }
    canonical.setdefault("max_new_tokens", min(SGLANG_DEFAULT_MAX_NEW_TOKENS, max(1, max_model_len - len(ids))))
    try:
        params = sampling_params(canonical, ids, max_model_len=max_model_len, vocab_size=vocab_size)
    except BadRequest as exc:
        message = str(exc)
        for theirs, ours in _SGLANG_RENAMED.items():  # name the field as the client sent it
            if theirs in sp and message.startswith(f"{ours} "):
                message = theirs + message[len(ours) :]
        raise BadRequest(f"sampling_params: {message}") from None
    top = _int(body, "top_logprobs_num", 0, lo=0, hi=min(vocab_size, MAX_LOGPROBS))
    start = _int(body, "logprob_start_len", -1, lo=-1, hi=len(ids) - 1)
    want = _bool(body, "return_logprob", False)
    params = replace(params, logprobs=top if want else 0, prompt_logprobs=(top if want and start >= 0 else None))
    params = with_lane(params)
    return SglangRequest(
        params=params,
        return_logprob=want,
        text_in_logprobs=_bool(body, "return_text_in_logprobs", False),
        logprob_start_len=start,
        top_logprobs_num=top if want else 0,
        rid=rid,
    )


def sglang_response(
    req: SglangRequest, gen: Mapping[str, Any], *, decode: Callable[[list[int], bool], str]
) -> dict[str, Any] | list[dict[str, Any]]:
    """SGLang's answer from a ``/generate`` response: one object per sample, a list when n > 1.
    ``meta_info`` carries ``output_token_logprobs`` as ``[logprob, token_id, text | null]``,
    ``finish_reason`` as SGLang's object (``{"type": "stop", "matched": token id | stop string}``
    or ``{"type": "length", "length": max_new_tokens}``), the token counts and the
    ``weight_version``. ``decode(ids, skip_special_tokens)`` is the tokenizer's decode."""
    p = req.params

    def text_of(tid: int) -> str | None:
        return decode([tid], False) if req.text_in_logprobs else None

    def finish(tokens: list[int], reason: str) -> dict[str, Any]:
        if reason != "stop":
            return {"type": reason, "length": p.max_tokens} if reason == "length" else {"type": reason}
        if p.stop:
            text = decode(tokens, p.skip_special_tokens)
            hits = sorted((text.find(s), s) for s in p.stop if s in text)
            if hits:
                return {"type": "stop", "matched": hits[0][1]}
        return {"type": "stop", "matched": tokens[-1] if tokens else None}

    out: list[dict[str, Any]] = []
    prompt = p.prompt_ids
    for i, (text, reason) in enumerate(zip(gen["text"], gen["finish_reasons"], strict=True)):
        toks = _choice_tokens(gen, i)
        ids = [t for t, _, _ in toks]
        meta: dict[str, Any] = {
            "id": (f"{req.rid}-{i}" if p.n > 1 else req.rid) if req.rid else uuid.uuid4().hex,
            "finish_reason": finish(ids, reason),
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "weight_version": gen["weight_version"],
        }
        spans = spans_of(gen, i)
        if spans is not None:
            meta["weight_versions"] = spans
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, text_of(t)] for t, lp, _ in toks]
            if req.top_logprobs_num:
                meta["output_top_logprobs"] = [[[b, a, text_of(a)] for a, b in alts] for _, _, alts in toks]
            if req.logprob_start_len >= 0:
                entries = gen.get("prompt_logprobs") or [None] * len(prompt)
                span = range(req.logprob_start_len, len(prompt))
                meta["input_token_logprobs"] = [
                    [entries[j][str(prompt[j])] if entries[j] else None, prompt[j], text_of(prompt[j])] for j in span
                ]
                if req.top_logprobs_num:
                    meta["input_top_logprobs"] = [
                        None
                        if not entries[j]
                        else [
                            [lp, int(t), text_of(int(t))] for t, lp in sorted(entries[j].items(), key=lambda e: -e[1])
                        ][: req.top_logprobs_num]
                        for j in span
                    ]
        out.append({"text": text, "output_ids": ids, "meta_info": meta})
    return out if p.n > 1 else out[0]


# ---------------------------------------------------------------------------- TRL's /generate/

_TRL_FIELDS = {
    "prompts",
    "images",
    "n",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "guided_decoding_regex",
    "generation_kwargs",
}


def parse_trl(
    raw: object, *, max_model_len: int, vocab_size: int, encode: Callable[[str], list[int]]
) -> list[GenerateParams]:
    """Validate TRL ``vllm-serve``'s ``/generate/`` body (SPEC §7): one request per prompt, each
    with ``n`` samples; ``encode`` tokenizes a prompt as vLLM does (special tokens added)."""
    body = _check_fields(raw, _TRL_FIELDS)
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise BadRequest("prompts must be a non-empty list of non-empty strings")
    check_count(len(prompts))
    check_texts(prompts, max_model_len=max_model_len, what="prompts")
    for key in ("images", "guided_decoding_regex"):
        if body.get(key) is not None:
            raise BadRequest(f"{key} is not supported")
    extra = body.get("generation_kwargs") or {}
    if not isinstance(extra, Mapping):
        raise BadRequest("generation_kwargs must be an object")
    clash = sorted(set(extra) & set(body))
    if clash:
        raise BadRequest(f"generation_kwargs repeats field(s): {', '.join(clash)}")
    fields = {k: v for k, v in body.items() if k not in ("prompts", "generation_kwargs")}
    fields.update(extra)
    known = _KNOWN - {"prompt", "max_new_tokens", "max_completion_tokens", "model"}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise BadRequest(f"generation_kwargs: unknown field(s): {', '.join(unknown)}")
    out = []
    for prompt in prompts:
        ids = list(encode(prompt))
        if not ids:
            raise BadRequest(f"prompt {prompt!r:.100} encodes to no tokens")
        out.append(sampling_params(fields, ids, max_model_len=max_model_len, vocab_size=vocab_size))
    check_totals(out)
    return [with_lane(p) for p in out] if len(out) == 1 else out


def trl_response(gens: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """TRL's answer: ``completion_ids`` (every prompt's n completions in order), with
    ``prompt_ids`` and the sampled tokens' ``logprobs`` as newer TRL servers give them, and the
    ``weight_version``."""
    return {
        "prompt_ids": [list(g["prompt_token_ids"]) for g in gens for _ in g["token_ids"]],
        "completion_ids": [list(ids) for g in gens for ids in g["token_ids"]],
        "logprobs": [[lp for _, lp, _ in _choice_tokens(g, i)] for g in gens for i in range(len(g["token_ids"]))],
        "weight_version": min(int(g["weight_version"]) for g in gens),
    }

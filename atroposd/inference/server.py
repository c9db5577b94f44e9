"""The inference server's HTTP front, shared by every engine.

TCP (``host:port``): ``GET /health``, ``POST /generate`` (SPEC §7: vLLM's body, or SGLang's, told
apart by the body), ``POST /generate/`` (TRL's ``vllm-serve``), ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /info``. A generation request with
``max_tokens ≤ 1``, ``n = 1`` and a short prompt is a probe (the health checks of atroposlib's
server classes; ``schema.with_lane``): the engines answer a few of them ahead of queued
rollouts, and ``/metrics`` counts them apart.

The TCP port is bounded as the API is (SPEC §13, :mod:`atroposd.httpbounds`): connections are
capped, request bodies are charged against one bound of bytes in flight as they arrive and
must arrive within a deadline. Every request is bounded as a whole (``schema.check_totals``),
text is refused past ``max_model_len × 16`` bytes before it is tokenized, and tokenizing,
chat-template rendering and answer building run on worker threads (each with its own copy of
the tokenizer), never on the event loop. A client that goes away takes its request with it:
its handler is cancelled, and so is its queued generation.

Weight control, only on a Unix socket (0600; it carries shared-memory handles): ``POST
/pause``, ``POST /resume``, ``POST /update_weights``, ``POST /load``, ``GET /weight_info``,
``POST /probe_generate`` (one short generation that bypasses the pause a server started
with ``--await-weights`` is in: the daemon's readiness and liveness probes; while the trainer
holds generation paused for a weight update it answers ``skipped`` without generating, since
an update refuses to run beside a generation in flight).

The TCP port is bound before the model loads, so a port in use fails at once; ``/health``
answers 503 until the engine is up. An engine is what :class:`~atroposd.inference.engine.Engine`
says, made by name from :data:`~atroposd.inference.engine.ENGINES`; the front calls nothing
else of it. The OpenAI routes translate to ``/generate`` requests, so they work with every
engine. Weight-control bodies are decoded on arrival (:mod:`atroposd.weights.control`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import errno
import os
import signal
import socket
import stat
import struct
import threading
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import orjson
from aiohttp import web
from aiohttp.typedefs import Middleware

from atroposd.httpbounds import RETRY_AFTER_S, BodyRefused, CappedSite, Charge, Inflight, connection_cap, read_body
from atroposd.inference import schema, tools
from atroposd.inference.engine import Engine, make_engine
from atroposd.inference.gate import NotPaused, ShuttingDown
from atroposd.logs import get_logger
from atroposd.weights.control import BroadcastOp, LoadWeights, PauseBody, QuarantineBody, ResumeBody, UpdateWeights
from atroposd.weights.protocol import WeightUpdateError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from atroposd.config import Config
    from atroposd.inference.metrics import InferenceMetrics

__all__ = [
    "ControlSocketInUse",
    "Engine",
    "PortInUse",
    "ServerOptions",
    "build_control_app",
    "build_tcp_app",
    "make_engine",
    "peer_uid",
    "serve",
]

log = get_logger("inference")

MAX_REQUEST_BYTES = 64 * 1024 * 1024
MAX_CONNECTIONS = 1024  # connections open at once on the TCP port
BODY_TIMEOUT_S = 30.0  # a request body must arrive within this
INFLIGHT_BODIES = 4  # bytes of bodies in flight (read, being parsed): this many MAX_REQUEST_BYTES
PARSE_THREAD_MIN_BYTES = 1 << 20  # a body this large is parsed on a worker thread
SMALL_WORK_TOKENS = 1 << 14  # requests of fewer tokens (prompt + generated) use the small-work thread
BIG_BODY_BYTES = 256 << 10  # bodies this large are prepared on the large-work thread


@dataclass
class ServerOptions:
    host: str
    port: int
    control_socket: Path
    engine: str = "torch"
    await_weights: bool = False
    threads: int | None = None
    token: str = ""  # the bearer token every TCP route requires ("" = none)


@dataclass
class _Front:
    """State the routes share: the engine once it is up, the tokenizer, the /info body."""

    model_name: str
    max_model_len: int
    await_weights: bool = False
    engine: Engine | None = None
    tokenizer: PreTrainedTokenizerBase | None = None
    info: dict[str, Any] = field(default_factory=dict)
    #: requests answered on /generate and the OpenAI routes (``/health``: load per replica)
    generations: int = 0
    #: ``[inference] tool_parser``'s parser (atroposd.inference.tools), None when off
    tool_parser: tools.ToolParser | None = None
    metrics: InferenceMetrics | None = None  # made by build_tcp_app
    #: the bearer token every TCP route requires ("" = none; SPEC §12.3)
    token: str = ""
    #: SPEC §15: why the trainer's sentinel quarantined this replica (None: serving); while
    #: set, every generation route answers 503 and only the control socket's canary generates
    quarantined: str | None = None
    #: the TCP port's bounds (SPEC §13): bytes of bodies in flight, a body's deadline, its size
    inflight: Inflight = field(default_factory=lambda: Inflight(INFLIGHT_BODIES * MAX_REQUEST_BYTES))
    body_timeout: float = BODY_TIMEOUT_S
    max_request_bytes: int = MAX_REQUEST_BYTES
    max_connections: int = MAX_CONNECTIONS
    #: the chat template's own tokens around one user message (a probe may add 64 more)
    template_tokens: int | None = None
    _workers: dict[str, ThreadPoolExecutor] = field(default_factory=dict, repr=False)
    _local: threading.local = field(default_factory=threading.local, repr=False)

    def worker(self, big: bool) -> ThreadPoolExecutor:
        """The thread that tokenizes, renders templates and builds answers: one for small work
        (probes, ordinary rollouts), one for large, so that a large request never holds up a
        probe's preparation. Each has its own copy of the tokenizer (a fast tokenizer is not
        to be shared between threads)."""
        name = "big" if big else "small"
        pool = self._workers.get(name)
        if pool is None:
            pool = self._workers[name] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"inference-{name}")
        return pool

    async def off_loop(self, big: bool, fn: Callable[..., _T], *args: object) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self.worker(big), fn, *args)

    def tok(self) -> PreTrainedTokenizerBase:
        """This worker thread's copy of the tokenizer."""
        mine: PreTrainedTokenizerBase | None = getattr(self._local, "tokenizer", None)
        if mine is None or getattr(self._local, "of", None) is not self.tokenizer:
            mine = self._local.tokenizer = copy.deepcopy(self.tokenizer)
            self._local.of = self.tokenizer
        if mine is None:
            raise RuntimeError("the tokenizer is still loading")
        return mine

    def ready(self) -> Engine:
        """The engine; the routes that need one are refused with 503 until it is up (``_route``)."""
        if self.engine is None:
            raise ShuttingDown("the engine is still loading")
        return self.engine

    def counted(self) -> InferenceMetrics:
        if self.metrics is None:
            raise RuntimeError("the metrics are made with the TCP app")
        return self.metrics

    def close_workers(self) -> None:
        for pool in self._workers.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._workers.clear()


_T = TypeVar("_T")


# ---------------------------------------------------------------------------- helpers


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(
        body=orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS), status=status, content_type="application/json"
    )


def _error(status: int, message: str, *, openai: bool = False) -> web.Response:
    if openai:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return _json({"error": {"message": message, "type": kind, "code": status}}, status)
    return _json({"error": message}, status)


async def _read_json(request: web.Request, *, empty_ok: bool = False) -> object:
    raw = await request.read()
    if not raw and empty_ok:
        return {}
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise schema.BadRequest(f"invalid JSON body: {exc}") from None


async def _read_tcp_json(front: _Front, request: web.Request) -> object:
    """A TCP request's JSON body: read within the body deadline, its bytes charged against the
    port's bound as they arrive (and while it is parsed), parsed on a worker thread when large."""
    charge = Charge(front.inflight)
    try:
        raw = await read_body(request, limit=front.max_request_bytes, charge=charge, timeout=front.body_timeout)
        request[BODY_BYTES] = len(raw)
        if len(raw) >= PARSE_THREAD_MIN_BYTES:
            return await front.off_loop(True, _loads, raw)
        return _loads(raw)
    finally:
        charge.release()


def _loads(raw: bytes | bytearray) -> object:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise schema.BadRequest(f"invalid JSON body: {exc}") from None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: what a route answers: a response, or a JSON object (answered 200)
Answer = web.StreamResponse | dict[str, Any]
# What a generation route notes on its request: a probe (counted apart), the route's name when
# the body decides it (SGLang's /generate), the body's size as it arrived.
PROBE = web.RequestKey("probe", bool)
ROUTE = web.RequestKey("route", str)
BODY_BYTES = web.RequestKey("body_bytes", int)


def _route(
    front: _Front, fn: Callable[[web.Request], Awaitable[Answer]], *, openai: bool = False, needs_engine: bool = True
) -> Handler:
    """Wrap a route: engine readiness, JSON errors, the status of each refusal."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if needs_engine and front.engine is None:
            return _error(503, "the engine is still loading", openai=openai)
        try:
            result = await fn(request)
        except web.HTTPException:
            raise
        except schema.BadRequest as exc:
            return _error(400, str(exc), openai=openai)
        except BodyRefused as exc:
            if front.metrics is not None:
                front.metrics.refused.labels(exc.reason).inc()
            resp = _error(exc.status, str(exc), openai=openai)
            if exc.status == 503:
                resp.headers["Retry-After"] = str(RETRY_AFTER_S)
            return resp
        except NotPaused as exc:
            return _error(409, str(exc), openai=openai)
        except WeightUpdateError as exc:
            return _error(400, str(exc), openai=openai)
        except ShuttingDown as exc:
            return _error(503, str(exc), openai=openai)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an engine failure: answer 500 with the reason and keep serving
            log.exception("request failed", path=request.path)
            return _error(500, f"{type(exc).__name__}: {exc}", openai=openai)
        return result if isinstance(result, web.StreamResponse) else _json(result)

    return handler


# ---------------------------------------------------------------------------- TCP routes


def _counted(front: _Front, route: str, handler: Handler) -> Handler:
    """A generation route, counted in the server's metrics (latency, in flight, tokens); a probe
    (``max_tokens ≤ 1``, marked by the handler) apart from the rollouts."""

    async def counted(request: web.Request) -> web.StreamResponse:
        if front.quarantined is not None:  # the clients route around it (or retry)
            return _error(
                503, f"this replica is quarantined: {front.quarantined}", openai=route in ("completions", "chat")
            )
        metrics = front.counted()
        start = metrics.begin()
        response: web.StreamResponse | None = None
        try:
            response = await handler(request)
            return response
        finally:
            metrics.end(
                request.get(ROUTE, route),
                start,
                ok=response is not None and response.status < 400,
                probe=bool(request.get(PROBE)),
            )

    return counted


def build_tcp_app(front: _Front) -> web.Application:
    from atroposd.inference.metrics import InferenceMetrics

    app = web.Application(client_max_size=front.max_request_bytes, middlewares=[_bearer_guard(front)])
    if front.metrics is None:
        front.metrics = InferenceMetrics(lambda: front.engine)
    metrics_of = front.metrics

    async def close_workers(_: web.Application) -> None:
        front.close_workers()

    app.on_cleanup.append(close_workers)

    async def health(_: web.Request) -> web.Response:
        engine = front.engine
        if engine is None:
            return _error(503, "the engine is still loading")
        try:
            await engine.check_health()
        except Exception as exc:  # the engine's own error types: report them, keep the front up
            return _error(503, f"engine unhealthy: {exc}")
        return _json(
            {
                "status": "ok",
                "weight_version": engine.weight_version,
                "generations": front.generations,
                "quarantined": front.quarantined is not None,
            }
        )

    def served(request: web.Request, answer: Mapping[str, object]) -> None:
        """Count a rollout's samples and tokens; a probe is counted apart (``_counted``)."""
        if not request.get(PROBE):
            metrics_of.served(answer)
            front.generations += 1

    def lanes(request: web.Request, params: list[schema.GenerateParams]) -> None:
        request[PROBE] = len(params) == 1 and params[0].lane == "probe"

    async def generate(request: web.Request) -> Answer:
        body = await _read_tcp_json(front, request)
        engine = front.ready()
        if schema.is_sglang(body):  # SGLang's /generate shares the route, told apart by the body
            request[ROUTE] = "sglang"
            req = await front.off_loop(_big_body(request), _sglang_request, front, body)
            lanes(request, [req.params])
            gen = await engine.generate(req.params)
            gen.setdefault("prompt_token_ids", req.params.prompt_ids)
            served(request, gen)
            return await front.off_loop(_big([req.params]), _sglang_answer, front, req, gen)
        params = await front.off_loop(
            _big_body(request), _parse_generate, body, engine.max_model_len, engine.vocab_size
        )
        lanes(request, [params])
        gen = await engine.generate(params)
        served(request, gen)
        return await front.off_loop(_big([params]), _dump, gen)

    async def trl_generate(request: web.Request) -> Answer:
        body = await _read_tcp_json(front, request)
        requests = await front.off_loop(_big_body(request), _trl_requests, front, body)
        lanes(request, requests)
        gens = await _generate_all(front, requests)
        for gen in gens:
            served(request, gen)
        return await front.off_loop(_big(requests), lambda: _dump(schema.trl_response(gens)))

    async def completions(request: web.Request) -> Answer:
        body = await _read_tcp_json(front, request)
        requests = await front.off_loop(_big_body(request), _completion_requests, front, body)
        lanes(request, requests)
        gens = await _generate_all(front, requests)
        out = await front.off_loop(_big(requests), _completion_answer, front, body, gens)
        served(request, out[1])
        return out[0]

    async def chat(request: web.Request) -> Answer:
        body = await _read_tcp_json(front, request)
        prepared = await front.off_loop(_big_body(request), _chat_request, front, body)
        lanes(request, [prepared.params])
        gen = await front.ready().generate(prepared.params)
        gen.setdefault("prompt_token_ids", prepared.params.prompt_ids)
        out = await front.off_loop(_big([prepared.params]), _chat_answer, front, body, prepared, gen)
        served(request, out[1])
        return out[0]

    async def models(_: web.Request) -> Answer:
        return {
            "object": "list",
            "data": [
                {
                    "id": front.model_name,
                    "object": "model",
                    "owned_by": "atroposd",
                    "max_model_len": front.max_model_len,
                }
            ],
        }

    async def info(_: web.Request) -> Answer:
        if not front.info:
            return _error(503, "the model is still being resolved")
        engine = front.engine
        if engine is None:  # loading: the tokenizer can already be compared
            return {**front.info, "weight_version": None, "awaiting_weights": front.await_weights, "ready": False}
        weights = await engine.weight_info()
        return {
            **front.info,
            "weight_version": weights.get("weight_version"),
            "awaiting_weights": bool(weights.get("awaiting_weights", False)),
            "ready": True,
            "quarantined": front.quarantined is not None,
        }

    async def metrics(_: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return web.Response(body=metrics_of.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/generate", _counted(front, "generate", _route(front, generate)))
    app.router.add_post("/generate/", _counted(front, "trl", _route(front, trl_generate)))
    app.router.add_post("/v1/completions", _counted(front, "completions", _route(front, completions, openai=True)))
    app.router.add_post("/v1/chat/completions", _counted(front, "chat", _route(front, chat, openai=True)))
    app.router.add_get("/v1/models", _route(front, models, openai=True, needs_engine=False))
    app.router.add_get("/info", _route(front, info, needs_engine=False))
    return app


def tcp_runner(front: _Front) -> web.AppRunner:
    """The TCP app's runner. A client that goes away cancels its handler (``handler_cancellation``),
    and with it its generation, queued or waiting: the engines drop a cancelled request's work."""
    return web.AppRunner(
        build_tcp_app(front), access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S, handler_cancellation=True
    )


def tcp_site(runner: web.AppRunner, front: _Front, host: str, port: int) -> CappedSite:
    """The TCP port's listening site, its connections capped (SPEC §13)."""
    refused = front.metrics.refused.labels("connections") if front.metrics is not None else None
    return CappedSite(
        runner, host, port, cap=connection_cap(front.max_connections), refused=refused, what="inference server"
    )


# ---------------------------------------------------------------------------- worker-thread steps
# Each runs on one of the front's worker threads (``_Front.off_loop``), with its own tokenizer.


def _big_body(request: web.Request) -> bool:
    """Whether preparing a request is large work, by its body's size as it arrived."""
    return int(request.get(BODY_BYTES, 0)) >= BIG_BODY_BYTES


def _big(requests: list[schema.GenerateParams]) -> bool:
    return sum(len(p.prompt_ids) + p.n * p.max_tokens for p in requests) > SMALL_WORK_TOKENS


def _parse_generate(body: object, max_model_len: int, vocab_size: int) -> schema.GenerateParams:
    return schema.parse_generate(body, max_model_len=max_model_len, vocab_size=vocab_size)


def _dump(answer: object) -> web.Response:
    return _json(answer)


async def _generate_all(front: _Front, requests: list[schema.GenerateParams]) -> list[dict[str, Any]]:
    """Every request's generation, in order; when one fails or the client goes away the others
    are cancelled (their queued work dropped)."""
    engine = front.ready()
    tasks = [asyncio.ensure_future(engine.generate(p)) for p in requests]
    try:
        gens = list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    for gen, params in zip(gens, requests, strict=True):
        gen.setdefault("prompt_token_ids", params.prompt_ids)  # for usage; not every engine echoes it
    return gens


_OPENAI_SAMPLING = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
)


def _generate_body(body: Mapping[str, Any], ids: list[int], *, max_tokens: object, logprobs: int) -> dict[str, Any]:
    if body.get("stream"):
        raise schema.BadRequest("stream = true is not supported; ask for the whole response")
    out: dict[str, Any] = {"prompt": {"prompt_token_ids": ids}, "logprobs": logprobs}
    out.update({k: body[k] for k in _OPENAI_SAMPLING if body.get(k) is not None})
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    return out


def _openai_prompts(front: _Front, prompt: object) -> list[list[int]]:
    """A completions ``prompt``: a string, token ids, or a list of either (at most
    ``MAX_PROMPTS``, each text within its byte bound before it is tokenized)."""
    tok = front.tok()
    limit = front.max_model_len
    if isinstance(prompt, str):
        schema.check_text(prompt, max_model_len=limit)
        return [tok.encode(prompt)]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) and not isinstance(prompt[0], bool):
        return [prompt]  # one prompt of token ids: its length, then its ids, checked as /generate's
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        schema.check_count(len(prompt))
        if not all(isinstance(p, (str, list)) for p in prompt):
            raise schema.BadRequest("prompt must be a string, a list of token ids, or a list of those")
        for i, p in enumerate(prompt):
            if isinstance(p, list) and (not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p)):
                raise schema.BadRequest(f"prompt[{i}] must be a string or a non-empty list of token ids")
        schema.check_texts([p for p in prompt if isinstance(p, str)], max_model_len=limit)
        return [tok.encode(p) if isinstance(p, str) else list(p) for p in prompt]
    raise schema.BadRequest("prompt must be a string, a list of token ids, or a list of those")


def _completion_requests(front: _Front, body: object) -> list[schema.GenerateParams]:
    if not isinstance(body, Mapping):
        raise schema.BadRequest("request must be a JSON object")
    if body.get("echo"):
        raise schema.BadRequest("echo = true is not supported")
    k = body.get("logprobs")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise schema.BadRequest(f"logprobs must be a non-negative integer or null, got {k!r}")
    prompts = _openai_prompts(front, body.get("prompt"))
    max_tokens = body.get("max_tokens", schema.DEFAULT_MAX_TOKENS)
    engine = front.ready()
    requests = [
        schema.parse_generate(
            _generate_body(body, ids, max_tokens=max_tokens, logprobs=k or 0),
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
        )
        for ids in prompts
    ]
    schema.check_totals(requests)
    if len(requests) > 1:  # several prompts are rollouts, whatever their size
        requests = [replace(p, lane="rollout") for p in requests]
    return requests


def _completion_answer(front: _Front, body: Mapping[str, Any], gens: list[dict[str, Any]]) -> tuple[web.Response, Any]:
    k = body.get("logprobs")
    decode = _decoder(front)
    out = tools.with_token_ids(
        schema.completion_response(front.model_name, gens[0], want_logprobs=k is not None, decode=decode),
        gens[0],
        body,
    )
    for gen in gens[1:]:  # several prompts: their choices follow in order
        more = tools.with_token_ids(
            schema.completion_response(front.model_name, gen, want_logprobs=k is not None, decode=decode), gen, body
        )
        for choice in more["choices"]:
            choice["index"] = len(out["choices"])
            out["choices"].append(choice)
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            out["usage"][key] += more["usage"][key]
    return _json(out), out


@dataclass(frozen=True)
class _Chat:
    params: schema.GenerateParams
    tool_req: tools.ToolRequest | None
    parse: bool
    want: bool


def _template_tokens(front: _Front) -> int:
    """The chat template's own tokens around one empty user message (computed once)."""
    if front.template_tokens is None:
        try:
            ids = front.tok().apply_chat_template(
                [{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            front.template_tokens = len(list(ids))
        except Exception:  # no template: chat requests are refused anyway
            front.template_tokens = 0
    return front.template_tokens


def _chat_request(front: _Front, body: object) -> _Chat:
    if not isinstance(body, Mapping):
        raise schema.BadRequest("request must be a JSON object")
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages)
    ):
        raise schema.BadRequest("messages must be a non-empty list of {role, content} objects")
    tool_req = tools.parse_tool_request(body)
    # What the template renders is bounded before it renders: the messages and tools as text.
    size = len(orjson.dumps(messages)) + (len(orjson.dumps(body.get("tools"))) if tool_req is not None else 0)
    limit = front.max_model_len * schema.TEXT_BYTES_PER_TOKEN
    if size > limit:
        raise schema.BadRequest(
            f"messages and tools are {size} bytes, longer than max_model_len × {schema.TEXT_BYTES_PER_TOKEN} = "
            f"{limit}; they cannot fit max_model_len ({front.max_model_len}) tokens"
        )
    if tool_req is not None and front.tool_parser is not None:
        front.tool_parser.check(tool_req)  # once per request, before anything is generated
    given: list[dict[str, Any] | Callable[..., Any]] | None = (
        list(tool_req.tools) if tool_req is not None and tool_req.tools else None
    )
    tok = front.tok()
    try:
        rendered = tok.apply_chat_template(
            tools.template_messages(messages), add_generation_prompt=True, tokenize=True, return_dict=False, tools=given
        )
    except schema.BadRequest:
        raise
    except Exception as exc:  # jinja and tokenizer errors: the client's messages did not fit the template
        raise schema.BadRequest(f"cannot apply the chat template: {exc}") from None
    ids = list(cast("list[int]", rendered))  # tokenize=True, return_dict=False: the token ids
    want = bool(body.get("logprobs"))
    top = body.get("top_logprobs") or 0
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise schema.BadRequest(f"top_logprobs must be a non-negative integer, got {top!r}")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = max(1, front.max_model_len - len(ids))
    parse = front.tool_parser is not None and tool_req is not None and tool_req.parse_calls
    request = _generate_body(body, ids, max_tokens=max_tokens, logprobs=top if want else 0)
    if parse and body.get("skip_special_tokens") is None:
        request["skip_special_tokens"] = False  # a model may mark its tool-call tags special (as vLLM does)
    engine = front.ready()
    params = schema.parse_generate(request, max_model_len=engine.max_model_len, vocab_size=engine.vocab_size)
    params = schema.with_lane(params, template_tokens=_template_tokens(front))
    return _Chat(params, tool_req, parse, want)


def _chat_answer(front: _Front, body: Mapping[str, Any], chat: _Chat, gen: dict[str, Any]) -> tuple[web.Response, Any]:
    out = schema.chat_response(front.model_name, gen, want_logprobs=chat.want, decode=_decoder(front))
    if chat.parse and chat.tool_req is not None and front.tool_parser is not None:
        tools.apply_tool_calls(out, gen, front.tool_parser, chat.tool_req, front.tok())
    out = tools.with_token_ids(out, gen, body)
    return _json(out), out


def _sglang_request(front: _Front, body: object) -> schema.SglangRequest:
    """SGLang's ``/generate``, parsed by the one SGLang parser (text tokenized here)."""
    engine = front.ready()
    return schema.parse_sglang(
        body, max_model_len=engine.max_model_len, vocab_size=engine.vocab_size, encode=front.tok().encode
    )


def _sglang_answer(front: _Front, req: schema.SglangRequest, gen: dict[str, Any]) -> web.Response:
    """SGLang's answer (``schema.sglang_response``)."""
    tok = front.tok()

    def decode(ids: list[int], skip_special_tokens: bool) -> str:
        return str(tok.decode(ids, skip_special_tokens=skip_special_tokens))

    return _json(schema.sglang_response(req, gen, decode=decode))


def _trl_requests(front: _Front, body: object) -> list[schema.GenerateParams]:
    """TRL ``vllm-serve``'s ``/generate/``: one engine request per prompt, in order."""
    engine = front.ready()
    return schema.parse_trl(
        body, max_model_len=engine.max_model_len, vocab_size=engine.vocab_size, encode=front.tok().encode
    )


def _decoder(front: _Front) -> Callable[[int], str]:
    tok = front.tok()

    def decode(tid: int) -> str:
        return str(tok.decode([tid]))

    return decode


# ---------------------------------------------------------------------------- control routes


CONTROL_SEND_TIMEOUT_S = 30.0


def build_control_app(
    front: _Front, *, send_timeout: float = CONTROL_SEND_TIMEOUT_S, allowed_uids: frozenset[int] | None = None
) -> web.Application:
    """The weight-control routes; served only to ``allowed_uids`` (default: this user and root)."""
    allowed = allowed_uids if allowed_uids is not None else frozenset({os.geteuid(), 0})
    app = web.Application(client_max_size=1024 * 1024, middlewares=[_control_guard(allowed, send_timeout)])

    async def pause(request: web.Request) -> Answer:
        # optional {"mode": "wait" | "keep", "clear_cache": bool}: an engine lists what it
        # serves in ``pause_modes``; no body is "wait" (drain), on every engine
        engine = front.ready()
        modes = engine.pause_modes
        body = PauseBody.parse(await _read_json(request, empty_ok=True), engine=engine.name, modes=modes)
        if len(modes) == 1 or (body.mode is None and body.clear_cache is None):
            return await engine.pause()
        return await engine.pause(mode=body.mode or "wait", clear_cache=body.clear_cache)

    async def resume(request: web.Request) -> Answer:
        body = ResumeBody.parse(await _read_json(request, empty_ok=True))
        return await front.ready().resume(body.weight_version)

    async def update(request: web.Request) -> Answer:
        return await front.ready().update_weights(UpdateWeights.parse(await _read_json(request)))

    async def load(request: web.Request) -> Answer:
        return await front.ready().load_weights(LoadWeights.parse(await _read_json(request)))

    async def weight_info(_: web.Request) -> Answer:
        return await front.ready().weight_info()

    async def broadcast(request: web.Request) -> Answer:
        return await front.ready().broadcast_weights(BroadcastOp.parse(await _read_json(request)))

    async def probe(request: web.Request) -> Answer:
        body = await _read_json(request, empty_ok=True)
        engine = front.ready()
        if engine.held_for_update:
            # The trainer paused generation to change the weights: a probe's generation now
            # would be in flight when the update arrives, which refuses it (409). The control
            # socket answering is the sign of life until the trainer resumes.
            return {
                "skipped": "generation is paused for a weight update",
                "paused": True,
                "weight_version": engine.weight_version,
            }
        if not body:
            first = front.info.get("tokenizer", {}).get("special_ids", {}).get("bos")
            body = {"prompt": {"prompt_token_ids": [first if first is not None else 0]}, "max_tokens": 1}
        return await engine.generate(_own(front, body), bypass_pause=True)

    app.router.add_post("/pause", _route(front, pause))
    app.router.add_post("/resume", _route(front, resume))
    app.router.add_post("/update_weights", _route(front, update))
    app.router.add_post("/load", _route(front, load))
    app.router.add_get("/weight_info", _route(front, weight_info))
    app.router.add_post("/broadcast", _route(front, broadcast))

    async def quarantine(request: web.Request) -> Answer:
        body = QuarantineBody.parse(await _read_json(request))
        front.quarantined = body.reason if body.quarantine else None
        log.warning(
            "quarantined: generation requests get 503" if body.quarantine else "back in rotation",
            reason=front.quarantined,
        )
        return {"quarantined": front.quarantined is not None, "weight_version": front.ready().weight_version}

    async def canary(request: web.Request) -> Answer:
        # SPEC §15: the sentinel's greedy generation; served while quarantined, waits at a
        # paused gate like any generation (so it carries exactly one weight_version)
        body = await _read_json(request)
        if not isinstance(body, Mapping):
            raise schema.BadRequest("the canary body must be a /generate body")
        return await front.ready().generate(_own(front, {**body, "temperature": 0.0}))

    app.router.add_post("/probe_generate", _route(front, probe))
    app.router.add_post("/quarantine", _route(front, quarantine))
    app.router.add_post("/canary", _route(front, canary))
    return app


def _own(front: _Front, body: object) -> schema.GenerateParams:
    """A generation of the daemon's own (readiness, liveness, canary) in its own lane: never
    behind the clients' probes, whatever their number (SPEC §7)."""
    engine = front.ready()
    params = schema.parse_generate(body, max_model_len=engine.max_model_len, vocab_size=engine.vocab_size)
    return schema.with_lane(params, own=True)


# ---------------------------------------------------------------------------- serve


SHUTDOWN_GRACE_S = 2.0  # what a stopping server still gives a request in flight


class PortInUse(RuntimeError):
    pass


async def serve(cfg: Config, opts: ServerOptions, *, ready: Callable[[], None] | None = None) -> int:
    """Run the server until SIGTERM/SIGINT; 0 on a requested stop."""
    front = _Front(
        model_name=cfg.inference.model,
        max_model_len=cfg.inference.max_model_len,
        await_weights=opts.await_weights,
        token=opts.token,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tcp = tcp_runner(front)
    control = web.AppRunner(build_control_app(front), access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
    sock = opts.control_socket
    engine: Engine | None = None
    sock_ours = False
    try:
        await tcp.setup()
        try:
            await tcp_site(tcp, front, opts.host, opts.port).start()
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(f"port {opts.port} on {opts.host} is already in use") from None
            raise
        await control.setup()
        await _start_unix_site(control, sock)
        sock_ours = True
        log.info(
            "listening; loading the engine",
            host=opts.host,
            port=opts.port,
            control_socket=str(sock),
            engine=opts.engine,
            await_weights=opts.await_weights,
        )
        # torch is imported from here on (after the port is ours, so a port in use fails fast).
        # The tokenizer's fingerprint is known before the model loads: /info answers early.
        front.info, tokenizer = await asyncio.to_thread(_info, cfg, opts)
        front.tool_parser = await asyncio.to_thread(_tool_parser, cfg, tokenizer)
        engine = await asyncio.to_thread(
            make_engine, cfg, opts.engine, await_weights=opts.await_weights, threads=opts.threads
        )
        await _wait_or_stop(engine.start(), stop)
        if stop.is_set():
            return 0
        front.tokenizer = tokenizer
        front.engine = engine
        log.info("ready", model=cfg.inference.model, engine=opts.engine)
        if ready is not None:
            ready()
        await stop.wait()
        log.info("stopping")
        return 0
    finally:
        # New requests get 503 at once; the engine's close answers every admitted or waiting
        # generation (the running batch finishes, queued ones and ones waiting at a paused gate
        # are refused), so the runners' cleanup does not wait for generations that would not end.
        front.engine = None
        if engine is not None:
            await engine.close()
        await control.cleanup()
        await tcp.cleanup()
        if sock_ours:  # never a path that named something else when this server started
            with contextlib.suppress(FileNotFoundError):
                sock.unlink()


async def _wait_or_stop(work: Awaitable[object], stop: asyncio.Event) -> None:
    """Await ``work`` unless a stop request comes first (then cancel it)."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return
    task.result()


async def _start_unix_site(runner: web.AppRunner, path: Path) -> None:
    """Serve on a Unix socket created 0600 (never world-accessible, not even briefly).

    What the path names already is removed only when it is a stale socket of ours (owned by
    this user, nobody listening): anything else — a live server's socket, a file, a link,
    another user's socket — is left alone and the start fails naming it.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    _remove_stale_socket(path)
    old = os.umask(0o177)
    try:
        await web.UnixSite(runner, str(path)).start()
    finally:
        os.umask(old)
    os.chmod(path, 0o600)


class ControlSocketInUse(RuntimeError):
    """The control socket's path names something that is not a stale socket of ours."""


def _remove_stale_socket(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ControlSocketInUse(f"control socket path {path} exists and is not a socket; not removing it")
    if st.st_uid != os.geteuid():
        raise ControlSocketInUse(f"control socket {path} belongs to uid {st.st_uid}; not removing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # stale: its server is gone
    except OSError as exc:
        raise ControlSocketInUse(f"control socket {path} cannot be probed ({exc}); not removing it") from None
    else:
        raise ControlSocketInUse(f"control socket {path} is served by another live process")
    finally:
        probe.close()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def peer_uid(request: web.Request) -> int | None:
    """The uid of the process at the other end of a Unix-socket request (SO_PEERCRED)."""
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def _bearer_guard(front: _Front) -> Middleware:
    """The TCP routes' middleware: with a token configured, every route (whatever it is) answers
    401 to a request without ``Authorization: Bearer <token>`` (compared in constant time),
    before its body is read. Refusals are logged at most once every 10 s."""
    import hmac
    import time

    last_log = [-float("inf"), 0]  # when the last refusal was logged, refusals since

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if front.token:
            given = request.headers.get("Authorization", "")
            scheme, _, value = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), front.token.encode()):
                last_log[1] += 1
                now = time.monotonic()
                if now - last_log[0] >= 10.0:
                    log.warning(
                        "request without the inference token refused",
                        path=request.path,
                        peer=request.remote,
                        refused_since_last_log=last_log[1],
                    )
                    last_log[0], last_log[1] = now, 0
                openai = request.path.startswith("/v1/")
                resp = _error(401, "missing or wrong bearer token (inference.token_file)", openai=openai)
                resp.headers["WWW-Authenticate"] = "Bearer"
                return resp
        return await handler(request)

    return guard


def _control_guard(allowed_uids: frozenset[int], send_timeout: float) -> Middleware:
    """The control socket's middleware: only this user (or root) is served (SO_PEERCRED), and
    each answer is sent within ``send_timeout`` (a client that stops reading is dropped, it
    does not hold the handler)."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        uid = peer_uid(request)
        if uid is None or uid not in allowed_uids:
            log.warning("control request from another user refused", peer_uid=uid, path=request.path)
            return _error(403, "the weight-control socket serves only its own user")
        resp = await handler(request)
        try:
            await asyncio.wait_for(_send(request, resp), send_timeout)
        except (asyncio.TimeoutError, ConnectionError) as exc:
            log.warning("control answer not delivered; connection dropped", path=request.path, error=type(exc).__name__)
            if request.transport is not None:
                request.transport.abort()
        return resp

    return guard


async def _send(request: web.Request, resp: web.StreamResponse) -> None:
    await resp.prepare(request)
    await resp.write_eof()


def _info(cfg: Config, opts: ServerOptions) -> tuple[dict[str, Any], PreTrainedTokenizerBase]:
    """The /info body and the tokenizer (for the OpenAI routes), before the engine loads.

    The fingerprint is computed from the loaded tokenizer, exactly as the trainer does.
    """
    from transformers import AutoTokenizer

    from atroposd.models.resolve import fingerprint_of, resolve_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_tokenizer(cfg)))
    info = {
        "model": cfg.inference.model,
        "engine": opts.engine,
        "max_model_len": cfg.inference.max_model_len,
        "tokenizer": fingerprint_of(tokenizer),
        "pid": os.getpid(),
    }
    return info, tokenizer


def _tool_parser(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> tools.ToolParser | None:
    """``[inference] tool_parser``'s parser for the chat route (None: off, or ``auto`` found no
    format); raises :class:`tools.ToolParserUnavailable` (a usage error)."""
    from atroposd.models.resolve import resolve_model

    parser = tools.make_parser(cfg.inference.tool_parser, tokenizer, resolve_model(cfg))
    log.info(
        "tool calls",
        tool_parser=cfg.inference.tool_parser,
        parser=None if parser is None else f"{parser.name} ({type(parser).__name__})",
    )
    return parser

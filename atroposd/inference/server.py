"""The inference server's HTTP front, shared by every engine.

TCP (``host:port``): ``GET /health``, ``POST /generate`` (SPEC §7: vLLM's body, or SGLang's, told
apart by the body), ``POST /generate/`` (TRL's ``vllm-serve``), ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /info``. A generation request with
``max_tokens ≤ 1`` is a probe (the health checks of atroposlib's server classes): the engines
answer it ahead of queued rollouts, and ``/metrics`` counts it apart from them.

Weight control, only on a Unix socket (0600; it carries shared-memory handles): ``POST
/pause``, ``POST /resume``, ``POST /update_weights``, ``POST /load``, ``GET /weight_info``,
``POST /probe_generate`` (one short generation that bypasses the pause a server started
with ``--await-weights`` is in: the daemon's readiness and liveness probes; while the trainer
holds generation paused for a weight update it answers ``skipped`` without generating, since
an update refuses to run beside a generation in flight).

The TCP port is bound before the model loads, so a port in use fails at once; ``/health``
answers 503 until the engine is up. An engine is any object with the methods of
:class:`Engine`; the OpenAI routes translate to ``/generate`` requests, so they work with
every engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import stat
import struct
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from aiohttp import web

from atroposd.inference import schema, tools
from atroposd.inference.gate import NotPaused, ShuttingDown
from atroposd.logs import get_logger
from atroposd.weights.protocol import WeightUpdateError

if TYPE_CHECKING:
    from atroposd.config import Config

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


class Engine(Protocol):
    """What the front needs of an engine (TorchEngine, VllmEngine)."""

    name: str
    weight_version: int

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def check_health(self) -> None: ...
    async def generate(
        self, request: Mapping[str, Any] | schema.GenerateParams, *, bypass_pause: bool = False
    ) -> dict[str, Any]: ...
    async def pause(self) -> dict[str, Any]: ...
    async def resume(self, weight_version: int | None = None) -> dict[str, Any]: ...
    async def update_weights(self, request: Mapping[str, Any]) -> dict[str, Any]: ...
    async def load_weights(self, request: Mapping[str, Any]) -> dict[str, Any]: ...
    async def weight_info(self) -> dict[str, Any]: ...


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
    engine: Any = None
    tokenizer: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    #: requests answered on /generate and the OpenAI routes (``/health``: load per replica)
    generations: int = 0
    #: ``[inference] tool_parser``'s parser (atroposd.inference.tools), None when off
    tool_parser: Any = None
    metrics: Any = None  # InferenceMetrics, made by build_tcp_app
    #: the bearer token every TCP route requires ("" = none; SPEC §12.3)
    token: str = ""
    #: SPEC §15: why the trainer's sentinel quarantined this replica (None: serving); while
    #: set, every generation route answers 503 and only the control socket's canary generates
    quarantined: str | None = None


def make_engine(cfg: Config, name: str, *, await_weights: bool, threads: int | None = None) -> Any:
    """The engine named ``name`` for ``cfg``. vLLM is imported only here.

    Every engine answers a bad request with :class:`schema.BadRequest`, a refused weight
    update with :class:`WeightUpdateError` and an update outside a pause with
    :class:`NotPaused`: the routes catch exactly these."""
    from atroposd import gpuenv
    from atroposd.weights.receiver import ReceiverState

    # Before the device is resolved (a CUDA query), a broadcast group is built or vLLM starts
    # its workers, whoever started this server (SPEC §12.1).
    gpuenv.apply(os.environ, vllm=name == "vllm")
    receiver = ReceiverState.from_config(cfg)
    if name == "torch":
        from atroposd.inference.torch_engine import TorchEngine

        return TorchEngine.from_config(cfg, receiver=receiver, await_weights=await_weights, threads=threads)
    if name == "vllm":
        from atroposd.inference.vllm_engine import VllmEngine

        return VllmEngine.from_config(cfg, receiver=receiver, await_weights=await_weights)
    raise ValueError(f"unknown engine {name!r} (known: torch, vllm)")


# ---------------------------------------------------------------------------- helpers


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS), status=status, content_type="application/json"
    )


def _error(status: int, message: str, *, openai: bool = False) -> web.Response:
    if openai:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return _json({"error": {"message": message, "type": kind, "code": status}}, status)
    return _json({"error": message}, status)


async def _read_json(request: web.Request, *, empty_ok: bool = False) -> Any:
    raw = await request.read()
    if not raw and empty_ok:
        return {}
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise schema.BadRequest(f"invalid JSON body: {exc}") from None


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _route(
    front: _Front, fn: Callable[[web.Request], Awaitable[Any]], *, openai: bool = False, needs_engine: bool = True
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
        start = front.metrics.begin()
        response: web.StreamResponse | None = None
        try:
            response = await handler(request)
            return response
        finally:
            front.metrics.end(
                request.get("route", route),
                start,
                ok=response is not None and response.status < 400,
                probe=bool(request.get("probe")),
            )

    return counted


def build_tcp_app(front: _Front) -> web.Application:
    from atroposd.inference.metrics import InferenceMetrics

    app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[_bearer_guard(front)])
    if front.metrics is None:
        front.metrics = InferenceMetrics(lambda: front.engine)

    async def health(_: web.Request) -> web.Response:
        if front.engine is None:
            return _error(503, "the engine is still loading")
        try:
            await front.engine.check_health()
        except Exception as exc:  # the engine's own error types: report them, keep the front up
            return _error(503, f"engine unhealthy: {exc}")
        return _json(
            {
                "status": "ok",
                "weight_version": front.engine.weight_version,
                "generations": front.generations,
                "quarantined": front.quarantined is not None,
            }
        )

    def served(request: web.Request, answer: Any) -> None:
        """Count a rollout's samples and tokens; a probe is counted apart (``_counted``)."""
        if not request.get("probe"):
            front.metrics.served(answer)
            front.generations += 1

    async def generate(request: web.Request) -> Any:
        body = await _read_json(request)
        request["probe"] = schema.is_probe(body)
        if schema.is_sglang(body):  # SGLang's /generate shares the route, told apart by the body
            request["route"] = "sglang"
            gen, out = await _sglang_generate(front, body)
        else:
            gen = out = await front.engine.generate(body)
        served(request, gen)
        return out

    async def trl_generate(request: web.Request) -> Any:
        body = await _read_json(request)
        request["probe"] = schema.is_probe(body)
        gens = await _trl_generate(front, body)
        for gen in gens:
            served(request, gen)
        return schema.trl_response(gens)

    async def completions(request: web.Request) -> Any:
        body = await _read_json(request)
        request["probe"] = schema.is_probe(body)
        out = await _openai_completions(front, body)
        served(request, out)
        return out

    async def chat(request: web.Request) -> Any:
        body = await _read_json(request)
        request["probe"] = schema.is_probe(body)
        out = await _openai_chat(front, body)
        served(request, out)
        return out

    async def models(_: web.Request) -> Any:
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

    async def info(_: web.Request) -> Any:
        if not front.info:
            return _error(503, "the model is still being resolved")
        if front.engine is None:  # loading: the tokenizer can already be compared
            return {**front.info, "weight_version": None, "awaiting_weights": front.await_weights, "ready": False}
        weights = await front.engine.weight_info()
        return {
            **front.info,
            "weight_version": weights.get("weight_version"),
            "awaiting_weights": bool(weights.get("awaiting_weights", False)),
            "ready": True,
            "quarantined": front.quarantined is not None,
        }

    async def metrics(_: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return web.Response(body=front.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/generate", _counted(front, "generate", _route(front, generate)))
    app.router.add_post("/generate/", _counted(front, "trl", _route(front, trl_generate)))
    app.router.add_post("/v1/completions", _counted(front, "completions", _route(front, completions, openai=True)))
    app.router.add_post("/v1/chat/completions", _counted(front, "chat", _route(front, chat, openai=True)))
    app.router.add_get("/v1/models", _route(front, models, openai=True, needs_engine=False))
    app.router.add_get("/info", _route(front, info, needs_engine=False))
    return app


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


def _generate_body(
    front: _Front, body: Mapping[str, Any], ids: list[int], *, max_tokens: Any, logprobs: int
) -> dict[str, Any]:
    if body.get("stream"):
        raise schema.BadRequest("stream = true is not supported; ask for the whole response")
    out: dict[str, Any] = {"prompt": {"prompt_token_ids": ids}, "logprobs": logprobs}
    out.update({k: body[k] for k in _OPENAI_SAMPLING if body.get(k) is not None})
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    return out


def _openai_prompts(front: _Front, prompt: Any) -> list[list[int]]:
    """A completions ``prompt``: a string, token ids, or a list of either."""
    tok = front.tokenizer
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [ids for p in prompt for ids in _openai_prompts(front, p)]
    raise schema.BadRequest("prompt must be a string, a list of token ids, or a list of those")


async def _openai_completions(front: _Front, body: Any) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        raise schema.BadRequest("request must be a JSON object")
    if body.get("echo"):
        raise schema.BadRequest("echo = true is not supported")
    k = body.get("logprobs")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise schema.BadRequest(f"logprobs must be a non-negative integer or null, got {k!r}")
    prompts = _openai_prompts(front, body.get("prompt"))
    max_tokens = body.get("max_tokens", schema.DEFAULT_MAX_TOKENS)
    gens = await asyncio.gather(
        *(
            front.engine.generate(_generate_body(front, body, ids, max_tokens=max_tokens, logprobs=k or 0))
            for ids in prompts
        )
    )
    for gen, ids in zip(gens, prompts, strict=True):
        gen.setdefault("prompt_token_ids", ids)  # for usage; not every engine echoes the prompt
    out = tools.with_token_ids(
        schema.completion_response(front.model_name, gens[0], want_logprobs=k is not None, decode=_decoder(front)),
        gens[0],
        body,
    )
    for gen in gens[1:]:  # several prompts: their choices follow in order
        more = tools.with_token_ids(
            schema.completion_response(front.model_name, gen, want_logprobs=k is not None, decode=_decoder(front)),
            gen,
            body,
        )
        for choice in more["choices"]:
            choice["index"] = len(out["choices"])
            out["choices"].append(choice)
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            out["usage"][key] += more["usage"][key]
    return out


async def _openai_chat(front: _Front, body: Any) -> dict[str, Any]:
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
    extra = {"tools": tool_req.tools} if tool_req is not None and tool_req.tools else {}
    try:
        ids = front.tokenizer.apply_chat_template(
            tools.template_messages(messages), add_generation_prompt=True, tokenize=True, return_dict=False, **extra
        )
    except schema.BadRequest:
        raise
    except Exception as exc:  # jinja and tokenizer errors: the client's messages did not fit the template
        raise schema.BadRequest(f"cannot apply the chat template: {exc}") from None
    ids = list(ids)
    want = bool(body.get("logprobs"))
    top = body.get("top_logprobs") or 0
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise schema.BadRequest(f"top_logprobs must be a non-negative integer, got {top!r}")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = max(1, front.max_model_len - len(ids))
    parse = front.tool_parser is not None and tool_req is not None and tool_req.parse_calls
    request = _generate_body(front, body, ids, max_tokens=max_tokens, logprobs=top if want else 0)
    if parse and body.get("skip_special_tokens") is None:
        request["skip_special_tokens"] = False  # a model may mark its tool-call tags special (as vLLM does)
    gen = await front.engine.generate(request)
    gen.setdefault("prompt_token_ids", ids)
    out = schema.chat_response(front.model_name, gen, want_logprobs=want, decode=_decoder(front))
    if parse and tool_req is not None:
        tools.apply_tool_calls(out, gen, front.tool_parser, tool_req, front.tokenizer)
    return tools.with_token_ids(out, gen, body)


async def _sglang_generate(front: _Front, body: Any) -> tuple[dict[str, Any], Any]:
    """SGLang's ``/generate``: parsed by the one SGLang parser, generated by the engine, answered
    as SGLang answers (``schema.sglang_response``). Returns (the engine's response, the answer)."""
    engine = front.engine
    req = schema.parse_sglang(
        body, max_model_len=engine.max_model_len, vocab_size=engine.vocab_size, encode=front.tokenizer.encode
    )
    gen = await engine.generate(req.params)
    gen.setdefault("prompt_token_ids", req.params.prompt_ids)
    tok = front.tokenizer

    def decode(ids: list[int], skip_special_tokens: bool) -> str:
        return str(tok.decode(ids, skip_special_tokens=skip_special_tokens))

    return gen, schema.sglang_response(req, gen, decode=decode)


async def _trl_generate(front: _Front, body: Any) -> list[dict[str, Any]]:
    """TRL ``vllm-serve``'s ``/generate/``: one engine request per prompt, in order."""
    engine = front.engine
    requests = schema.parse_trl(
        body, max_model_len=engine.max_model_len, vocab_size=engine.vocab_size, encode=front.tokenizer.encode
    )
    gens = await asyncio.gather(*(engine.generate(params) for params in requests))
    for gen, params in zip(gens, requests, strict=True):
        gen.setdefault("prompt_token_ids", params.prompt_ids)
    return list(gens)


def _decoder(front: _Front) -> Callable[[int], str]:
    tok = front.tokenizer

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

    async def pause(request: web.Request) -> Any:
        # optional {"mode": "wait" | "keep", "clear_cache": bool}: an engine lists what it
        # serves in ``pause_modes``; no body is "wait" (drain), on every engine
        body = await _read_json(request, empty_ok=True)
        body = body if isinstance(body, Mapping) else {}
        mode, clear = body.get("mode"), body.get("clear_cache")
        if mode is None and clear is None:
            return await front.engine.pause()
        modes = getattr(front.engine, "pause_modes", ("wait",))
        if mode not in (None, *modes) or (clear is not None and len(modes) == 1):
            raise schema.BadRequest(f"the {front.engine.name} engine pauses with mode {' or '.join(modes)} only")
        return await front.engine.pause(mode=mode or "wait", clear_cache=clear)

    async def resume(request: web.Request) -> Any:
        body = await _read_json(request, empty_ok=True)
        version = body.get("weight_version") if isinstance(body, Mapping) else None
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise schema.BadRequest(f"weight_version must be a non-negative integer, got {version!r}")
        return await front.engine.resume(version)

    async def update(request: web.Request) -> Any:
        return await front.engine.update_weights(await _read_json(request))

    async def load(request: web.Request) -> Any:
        return await front.engine.load_weights(await _read_json(request))

    async def weight_info(_: web.Request) -> Any:
        return await front.engine.weight_info()

    async def broadcast(request: web.Request) -> Any:
        engine = front.engine
        if not hasattr(engine, "broadcast_weights"):
            raise schema.BadRequest(f"the {engine.name} engine does not take weights by broadcast")
        return await engine.broadcast_weights(await _read_json(request))

    async def probe(request: web.Request) -> Any:
        body = await _read_json(request, empty_ok=True)
        if getattr(front.engine, "held_for_update", False):
            # The trainer paused generation to change the weights: a probe's generation now
            # would be in flight when the update arrives, which refuses it (409). The control
            # socket answering is the sign of life until the trainer resumes.
            return {
                "skipped": "generation is paused for a weight update",
                "paused": True,
                "weight_version": front.engine.weight_version,
            }
        if not body:
            first = front.info.get("tokenizer", {}).get("special_ids", {}).get("bos")
            body = {"prompt": {"prompt_token_ids": [first if first is not None else 0]}, "max_tokens": 1}
        return await front.engine.generate(body, bypass_pause=True)

    app.router.add_post("/pause", _route(front, pause))
    app.router.add_post("/resume", _route(front, resume))
    app.router.add_post("/update_weights", _route(front, update))
    app.router.add_post("/load", _route(front, load))
    app.router.add_get("/weight_info", _route(front, weight_info))
    app.router.add_post("/broadcast", _route(front, broadcast))

    async def quarantine(request: web.Request) -> Any:
        body = await _read_json(request)
        if not isinstance(body, Mapping) or not isinstance(body.get("quarantine"), bool):
            raise schema.BadRequest("quarantine must be true or false")
        reason = body.get("reason")
        front.quarantined = (str(reason) if reason else "drift over the limit") if body["quarantine"] else None
        log.warning(
            "quarantined: generation requests get 503" if body["quarantine"] else "back in rotation",
            reason=front.quarantined,
        )
        return {"quarantined": front.quarantined is not None, "weight_version": front.engine.weight_version}

    async def canary(request: web.Request) -> Any:
        # SPEC §15: the sentinel's greedy generation; served while quarantined, waits at a
        # paused gate like any generation (so it carries exactly one weight_version)
        body = await _read_json(request)
        if not isinstance(body, Mapping):
            raise schema.BadRequest("the canary body must be a /generate body")
        return await front.engine.generate({**body, "temperature": 0.0})

    app.router.add_post("/probe_generate", _route(front, probe))
    app.router.add_post("/quarantine", _route(front, quarantine))
    app.router.add_post("/canary", _route(front, canary))
    return app


# ---------------------------------------------------------------------------- serve


SHUTDOWN_GRACE_S = 2.0  # what a stopping server still gives a request in flight


class PortInUse(RuntimeError):
    pass


async def serve(cfg: Any, opts: ServerOptions, *, ready: Callable[[], None] | None = None) -> int:
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
    tcp = web.AppRunner(build_tcp_app(front), access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
    control = web.AppRunner(build_control_app(front), access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
    sock = opts.control_socket
    engine = None
    sock_ours = False
    try:
        await tcp.setup()
        try:
            await web.TCPSite(tcp, opts.host, opts.port).start()
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


async def _wait_or_stop(work: Awaitable[Any], stop: asyncio.Event) -> None:
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


def _bearer_guard(front: _Front) -> Any:
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


def _control_guard(allowed_uids: frozenset[int], send_timeout: float) -> Any:
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


def _info(cfg: Any, opts: ServerOptions) -> tuple[dict[str, Any], Any]:
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


def _tool_parser(cfg: Any, tokenizer: Any) -> Any:
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

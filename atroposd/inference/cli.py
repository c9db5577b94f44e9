"""`atroposd inference`: flags and entry point (imports nothing heavy at module level).

With ``-c FILE`` the ``[inference]`` section is read, else the built-in defaults; flags
override either. The weight-control socket defaults to ``{runtime_dir}/inference-<port>.sock``.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from atroposd.exitcodes import Exit
from atroposd.inference.engine import ENGINE_NAMES

if TYPE_CHECKING:
    from atroposd.config import Config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this child's flags to its sub-parser (`-c` is already there)."""
    parser.add_argument("--host", help="address to bind (default [inference] host)")
    parser.add_argument("--port", type=int, help="port to bind (default [inference] port)")
    parser.add_argument("--model", help="builtin:tiny or a local Hugging Face model directory")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the model's)")
    parser.add_argument("--engine", choices=ENGINE_NAMES, help="inference engine (default [inference] engine)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--device", help="auto | cpu | cuda:N | a GPU UUID")
    parser.add_argument("--max-model-len", type=int, metavar="N", help="longest prompt + completion, in tokens")
    parser.add_argument("--seed", type=int, help="sampling seed and builtin:tiny's initialisation (trainer.seed)")
    parser.add_argument(
        "--control-socket",
        metavar="PATH",
        help="Unix socket for the weight-control routes (default {runtime_dir}/inference-<port>.sock)",
    )
    parser.add_argument(
        "--await-weights", action="store_true", help="start paused: /generate waits until the first /resume"
    )
    parser.add_argument("--threads", type=int, metavar="N", help="torch threads (default 1 on CPU)")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"))


# Flags that set an [inference] key of the same name; checked by the key's schema rules.
_FLAGS = ("host", "port", "model", "tokenizer", "engine", "dtype", "device", "max_model_len")


def config_from(args: argparse.Namespace) -> Config:
    """The config (``-c``, else discovered, else defaults) with the flags applied; exits 2 if invalid.

    Flags are applied to the validated config directly: a standalone server need not satisfy
    the job-wide cross checks (distinct ports, trainer limits) the flags could trip.
    """
    from atroposd.clargs import apply_flags, load_or_exit

    cfg = load_or_exit(args)
    problems = apply_flags(cfg.inference, "inference", args, {f: f for f in _FLAGS})
    problems += apply_flags(cfg.trainer, "trainer", args, {"seed": "seed"})
    if isinstance(cfg.inference.device, list):
        # A list (one entry per replica) without --device: this server is replica 0. The daemon
        # passes each replica its own --device and --port.
        cfg.inference.device = cfg.inference_devices()[0]
    if args.threads is not None and args.threads < 1:
        problems.append(f"--threads must be ≥ 1, got {args.threads}")
    if problems:
        print("atroposd inference: " + "; ".join(problems), file=sys.stderr)
        raise SystemExit(Exit.USAGE)
    return cfg


def main(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from atroposd.config import SOCKET_PATH_MAX
    from atroposd.devices import DeviceError
    from atroposd.inference.server import ControlSocketInUse, PortInUse, ServerOptions, serve
    from atroposd.inference.tools import ToolParserUnavailable
    from atroposd.inference.vllm_range import UntestedVllm
    from atroposd.logs import configure_logging, get_logger
    from atroposd.models.resolve import BUILTIN_TINY, ModelError, resolve_model, resolve_tokenizer
    from atroposd.paths import Paths

    cfg = config_from(args)
    configure_logging(args.log_level or cfg.daemon.log_level, cfg.daemon.log_format, component="inference")
    inf = cfg.inference
    sock = Path(args.control_socket) if args.control_socket else Paths.of(cfg).inference_socket(inf.port)
    if len(str(sock).encode()) > SOCKET_PATH_MAX:
        print(f"atroposd inference: control socket path {sock} is longer than {SOCKET_PATH_MAX} bytes", file=sys.stderr)
        return Exit.USAGE
    try:
        if inf.model != BUILTIN_TINY:  # a local directory: check it now, before anything is loaded
            resolve_model(cfg)
            resolve_tokenizer(cfg)
    except ModelError as exc:
        print(f"atroposd inference: {exc}", file=sys.stderr)
        return Exit.USAGE
    try:
        token = inference_token(cfg)
    except ValueError as exc:  # TokenError, ClusterError: a token file that cannot give one
        print(f"atroposd inference: {exc}", file=sys.stderr)
        return Exit.USAGE
    opts = ServerOptions(
        host=cfg.listen_host(inf.host),
        port=inf.port,
        control_socket=sock,
        engine=inf.engine,
        await_weights=args.await_weights,
        threads=args.threads,
        token=token,
    )
    try:
        code = asyncio.run(serve(cfg, opts))
    except (ModelError, DeviceError, ToolParserUnavailable, UntestedVllm) as exc:
        print(f"atroposd inference: {exc}", file=sys.stderr)
        return Exit.USAGE
    except (PortInUse, ControlSocketInUse) as exc:
        get_logger("inference").error("cannot start", error=str(exc))
        print(f"atroposd inference: {exc}", file=sys.stderr)
        return Exit.RUNTIME
    _exit_now(code)
    return code


def inference_token(cfg: Config) -> str:
    """The bearer token this server requires: ``$ATROPOSD_INFERENCE_TOKEN`` (the daemon's, SPEC §3's
    ``{inference_token}``), else the config's (``Config.inference_token``)."""
    import os

    from atroposd.config import INFERENCE_TOKEN_ENV

    return os.environ.get(INFERENCE_TOKEN_ENV, "").strip() or cfg.inference_token()


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown: everything is closed by now, and unloading
    torch's native libraries can take seconds, which would eat into the supervisor's stop budget."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

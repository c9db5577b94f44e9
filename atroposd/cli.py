"""The ``atroposd`` command line: argument parsing only; each command is a small function.

Control commands (start, stop, status, reload, logs, config) and the API child never import
torch, transformers or vllm: handlers import what they need lazily.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from atroposd import __version__
from atroposd.api import cli as api_cli
from atroposd.clargs import add_config as _add_config
from atroposd.clargs import load_or_exit
from atroposd.envs import cli as env_cli
from atroposd.exitcodes import Exit
from atroposd.inference import cli as inference_cli
from atroposd.trainer import cli as trainer_cli


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad usage already; keep its message format."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="atroposd", description="Run an Atropos reinforcement-learning job as one supervised service."
    )
    parser.add_argument("--version", action="version", version=f"atroposd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def cmd(name: str, help: str, handler: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        _add_config(p)
        p.set_defaults(handler=handler)
        return p

    cmd("run", "run the job in the foreground (what systemd's ExecStart runs)", _run)
    cmd("start", "start the daemon in the background; return once it is READY or has failed", _start)
    p = cmd("stop", "stop the daemon gracefully; return when every process is gone", _stop)
    p.add_argument(
        "--timeout", type=float, metavar="S", help="seconds to wait (default: checkpoint_timeout + stop_timeout + 10)"
    )
    p = cmd("status", "components, trainer progress, queue", _status)
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("-w", "--watch", action="store_true", help="redraw every second until Ctrl-C")
    p.add_argument(
        "--node",
        type=int,
        metavar="N",
        help="several machines: only node N's row, with all its "
        "components (a large head's status leaves the nodes' component rows out)",
    )
    cmd("reload", "re-read the config and apply environment changes live", _reload)
    p = cmd("logs", "show a component's log", _logs)
    p.add_argument("name", nargs="?", default="daemon", help="component (default: daemon)")
    p.add_argument("-f", "--follow", action="store_true", help="follow, across rotation")
    p.add_argument("-n", "--lines", type=int, default=50, help="lines to show first (default 50)")

    cfg = sub.add_parser("config", help="check or show the configuration")
    cfg_sub = cfg.add_subparsers(dest="config_command", metavar="ACTION")
    cfg_sub.required = True
    for name, helptext, handler in (
        ("check", "validate; exit 0, or 2 with every problem listed", _config_check),
        ("show", "the effective config as TOML, defaults filled in", _config_show),
        ("example", "print the commented example (the built-in defaults)", _config_example),
        ("schema", "print the config file's JSON Schema (for editors: keys, types, defaults, bounds)", _config_schema),
    ):
        p = cfg_sub.add_parser(name, help=helptext, description=helptext)
        _add_config(p)
        p.set_defaults(handler=handler)

    p = cmd(
        "plot",
        "draw metrics.jsonl (reward, accuracy, loss, KL, clipped fraction, staleness, time per step, "
        "tokens/s) to a PNG; several runs overlay",
        _plot,
    )
    p.add_argument(
        "runs",
        nargs="*",
        metavar="RUN",
        help="state dirs or metrics files to overlay (default: the config's state_dir)",
    )
    p.add_argument(
        "-o",
        "--output",
        metavar="PNG",
        help="output file (default: {state_dir}/metrics.png; ./metrics.png with RUN arguments)",
    )
    p.add_argument("--metrics", metavar="JSONL", help="metrics file (default: {state_dir}/metrics.jsonl)")

    p = cmd(
        "export",
        "a checkpoint (default: the newest complete one) as a Hugging Face model directory "
        "(config, safetensors weights, tokenizer) that transformers loads",
        _export,
    )
    p.add_argument("--step", type=int, metavar="N", help="the checkpoint of step N (default: the newest complete one)")
    p.add_argument("dir", metavar="DIR", help="the directory to write (must not exist, or be empty)")

    # Child entry points: each package owns its flags (its cli module imports nothing heavy).
    for name, mod, helptext in (
        ("api", api_cli, "the trajectory API server (wire-compatible with run-api)"),
        ("inference", inference_cli, "the inference server (/generate, OpenAI routes)"),
        ("env", env_cli, "a built-in environment"),
        ("trainer-rank", trainer_cli, "a trainer rank 1..N-1 (started by the daemon)"),
    ):
        p = sub.add_parser(name, help=helptext, description=helptext)
        _add_config(p)
        mod.add_arguments(p)
        p.set_defaults(handler=mod.main)
    return parser


# ----------------------------------------------------------------------------- handlers


def _config_check(args: argparse.Namespace) -> int:
    cfg = load_or_exit(args)
    for w in cfg.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(f"{cfg.source}: ok")
    return Exit.OK


def _config_show(args: argparse.Namespace) -> int:
    from atroposd.config import dump_toml

    cfg = load_or_exit(args)
    print(f"# effective configuration from {cfg.source}")
    sys.stdout.write(dump_toml(cfg))
    return Exit.OK


def _config_example(args: argparse.Namespace) -> int:
    from atroposd.config import render_example

    sys.stdout.write(render_example())
    return Exit.OK


def _config_schema(args: argparse.Namespace) -> int:
    from atroposd.config import render_json_schema

    sys.stdout.write(render_json_schema())
    return Exit.OK


def _run(args: argparse.Namespace) -> int:
    from atroposd import commands

    return commands.run(load_or_exit(args), args)


def _start(args: argparse.Namespace) -> int:
    from atroposd import commands

    return commands.start(load_or_exit(args), args)


def _stop(args: argparse.Namespace) -> int:
    from atroposd import commands

    return commands.stop(load_or_exit(args), args)


def _status(args: argparse.Namespace) -> int:
    from atroposd import commands

    return commands.status(load_or_exit(args), args)


def _reload(args: argparse.Namespace) -> int:
    from atroposd import commands

    return commands.reload(load_or_exit(args), args)


def _logs(args: argparse.Namespace) -> int:
    from atroposd import commands

    return commands.logs(load_or_exit(args), args)


def _plot(args: argparse.Namespace) -> int:
    from atroposd import plot

    return plot.main(load_or_exit(args), args)


def _export(args: argparse.Namespace) -> int:
    from atroposd.trainer import export

    return export.main(load_or_exit(args), args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return Exit.OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

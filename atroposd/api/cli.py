"""`atroposd api`: flags and entry point (imports nothing heavy at module level).

With ``-c FILE`` the ``[api]`` section is read (spool on by default, in ``{state_dir}/spool/api-{port}``
unless ``spool_dir`` says otherwise); without it the built-in defaults apply and nothing is spooled
unless ``--spool-dir`` is given. Flags override either.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from atroposd.exitcodes import Exit

TOKEN_ENV = "ATROPOSD_API_TOKEN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this child's flags to its sub-parser (`-c` is already there)."""
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to bind (default 8000)")
    parser.add_argument("--max-queued-sequences", type=int, metavar="N",
                        help="hard cap on sequences held (queue + buffers + formed batches)")
    parser.add_argument("--full-wait", type=float, metavar="S",
                        help="seconds a submission may wait for room before a 503")
    parser.add_argument("--spool-dir", metavar="D", help="keep accepted groups and registrations here "
                                                         "across restarts (turns the spool on)")
    parser.add_argument("--no-spool", action="store_true", help="keep nothing across restarts")
    parser.add_argument("--max-request-bytes", type=int, metavar="B",
                        help="largest request body, after gzip decompression")
    parser.add_argument("--token", help="require 'Authorization: Bearer TOKEN' (default: [api] token); visible "
                                        "in ps: prefer --token-file or ATROPOSD_API_TOKEN")
    parser.add_argument("--token-file", metavar="F", help="read the bearer token from this file "
                                                          "(default: [api] token_file)")
    parser.add_argument("--body-timeout", type=float, metavar="S", help=argparse.SUPPRESS)
    parser.add_argument("--max-queued-bytes", type=int, metavar="B", help=argparse.SUPPRESS)
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"))


def settings_from(args: argparse.Namespace) -> tuple[Any, str, str]:
    """(ApiSettings, log level, log format) from -c and the flags. The token: ``--token``, else
    ``--token-file``, else ``[api] token``, else ``[api] token_file``, else ``$ATROPOSD_API_TOKEN``."""
    from atroposd.api.server import ApiSettings
    from atroposd.config import ApiConfig, DaemonConfig

    if getattr(args, "config", None):
        from atroposd.config import ConfigError, load_config

        try:
            cfg = load_config(args.config)
        except ConfigError as exc:
            print(f"atroposd api: {exc}", file=sys.stderr)
            raise SystemExit(Exit.USAGE) from None
        s = ApiSettings.from_config(cfg.api, str(cfg.spool_dir) if cfg.api.spool else None)
        level, fmt = cfg.daemon.log_level, cfg.daemon.log_format
        token_file = cfg.api.token_file
    else:  # standalone: the built-in defaults, and no spool unless --spool-dir (SPEC §2)
        s = ApiSettings.from_config(ApiConfig(), None)
        level, fmt = DaemonConfig().log_level, DaemonConfig().log_format
        token_file = ""
    for flag, attr in (("host", "host"), ("port", "port"), ("max_queued_sequences", "max_queued_sequences"),
                       ("full_wait", "full_wait"), ("spool_dir", "spool_dir"),
                       ("max_request_bytes", "max_request_bytes"), ("token", "token"),
                       ("body_timeout", "body_timeout"), ("max_queued_bytes", "max_queued_bytes")):
        value = getattr(args, flag, None)
        if value is not None:
            setattr(s, attr, value)
    if getattr(args, "no_spool", False):
        s.spool_dir = None
    if getattr(args, "token", None) is None:
        token_file = getattr(args, "token_file", None) or (token_file if not s.token else "")
        if token_file:
            s.token = _read_token(token_file)
        elif not s.token:
            s.token = os.environ.get(TOKEN_ENV, "").strip()
    return s, args.log_level or level, fmt


def _read_token(path: str) -> str:
    try:
        token = Path(path).expanduser().read_text(encoding="utf-8").strip()
    except (OSError, UnicodeError) as exc:
        print(f"atroposd api: cannot read the token file {path}: {exc}", file=sys.stderr)
        raise SystemExit(Exit.USAGE) from None
    if not token:
        print(f"atroposd api: the token file {path} is empty", file=sys.stderr)
        raise SystemExit(Exit.USAGE)
    return token


def _check(s: Any) -> list[str]:
    problems = []
    if not 1 <= s.port <= 65535:
        problems.append(f"--port must be in 1..65535, got {s.port}")
    if s.max_queued_sequences < 1:
        problems.append(f"--max-queued-sequences must be at least 1, got {s.max_queued_sequences}")
    if s.full_wait < 0:
        problems.append(f"--full-wait must be ≥ 0, got {s.full_wait}")
    if not s.token.isascii() or any(c.isspace() for c in s.token):
        problems.append("the token must be printable ASCII without spaces")
    if s.body_timeout <= 0:
        problems.append(f"--body-timeout must be > 0, got {s.body_timeout}")
    if s.max_request_bytes < 1024:
        problems.append(f"--max-request-bytes must be at least 1024, got {s.max_request_bytes}")
    return problems


def main(args: argparse.Namespace) -> int:
    settings, level, fmt = settings_from(args)
    problems = _check(settings)
    if problems:
        for p in problems:
            print(f"atroposd api: {p}", file=sys.stderr)
        return int(Exit.USAGE)
    from atroposd.logs import configure_logging

    configure_logging(level, fmt, component="api")
    from atroposd.api.app import run

    return run(settings)

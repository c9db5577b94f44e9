"""`atroposd api`: flags and entry point (imports nothing heavy at module level).

With ``-c FILE`` the ``[api]`` section is read (spool on by default, in ``{state_dir}/spool/api-{port}``
unless ``spool_dir`` says otherwise); without it the built-in defaults apply and nothing is spooled
unless ``--spool-dir`` is given. Flags override either.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from atroposd.exitcodes import Exit

if TYPE_CHECKING:
    from atroposd.api.settings import ApiSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this child's flags to its sub-parser (`-c` is already there)."""
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to bind (default 8000)")
    parser.add_argument(
        "--max-queued-sequences",
        type=int,
        metavar="N",
        help="hard cap on sequences held (queue + buffers + formed batches)",
    )
    parser.add_argument(
        "--full-wait", type=float, metavar="S", help="seconds a submission may wait for room before a 503"
    )
    parser.add_argument(
        "--spool-dir",
        metavar="D",
        help="keep accepted groups and registrations here across restarts (turns the spool on)",
    )
    parser.add_argument("--no-spool", action="store_true", help="keep nothing across restarts")
    parser.add_argument(
        "--max-request-bytes", type=int, metavar="B", help="largest request body, after gzip decompression"
    )
    parser.add_argument(
        "--token",
        help="require 'Authorization: Bearer TOKEN' (default: [api] token); visible "
        "in ps: prefer --token-file or ATROPOSD_API_TOKEN",
    )
    parser.add_argument(
        "--token-file", metavar="F", help="read the bearer token from this file (default: [api] token_file)"
    )
    parser.add_argument("--body-timeout", type=float, metavar="S", help=argparse.SUPPRESS)
    parser.add_argument("--max-queued-bytes", type=int, metavar="B", help=argparse.SUPPRESS)
    parser.add_argument(
        "--max-connections", type=int, metavar="N", help="connections open at once; past it a new one is answered 503"
    )
    parser.add_argument(
        "--shm-ack-timeout",
        type=float,
        metavar="S",
        help="seconds a shared-memory batch waits for its acknowledgement before it is served again",
    )
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"))


# Flags that set an [api] key: (argparse attribute, key); checked by the key's schema rules.
_FLAGS = {
    "host": "host",
    "port": "port",
    "max_queued_sequences": "max_queued_sequences",
    "full_wait": "full_wait",
    "max_request_bytes": "max_request_bytes",
    "token": "token",
    "token_file": "token_file",
    "shm_ack_timeout": "shm_ack_timeout",
    "max_connections": "max_connections",
}


def settings_from(args: argparse.Namespace) -> tuple[ApiSettings, str, str, list[str]]:
    """(ApiSettings, log level, log format, problems with the flags) from -c and the flags. The
    token: ``--token``, else ``--token-file``, else ``[api] token``, else ``[api] token_file``,
    else ``$ATROPOSD_API_TOKEN``."""
    from atroposd.api.server import ApiSettings
    from atroposd.clargs import apply_flags
    from atroposd.config import ApiConfig, DaemonConfig

    if getattr(args, "config", None):
        from atroposd.clargs import load_or_exit

        cfg = load_or_exit(args)
        api, spool = cfg.api, str(cfg.spool_dir) if cfg.api.spool else None
        level, fmt = cfg.daemon.log_level, cfg.daemon.log_format
    else:  # standalone: the built-in defaults, and no spool unless --spool-dir (SPEC §2)
        api, spool = ApiConfig(), None
        level, fmt = DaemonConfig().log_level, DaemonConfig().log_format
    if getattr(args, "token", None) is None and getattr(args, "token_file", None) is not None:
        api.token = ""  # --token-file overrides a token from the file
    problems = apply_flags(api, "api", args, _FLAGS)
    s = ApiSettings.from_config(api, spool)
    if getattr(args, "config", None):
        s.host = cfg.listen_host(s.host)  # several machines: a wildcard host binds [cluster] bind
    for flag in ("spool_dir", "body_timeout", "max_queued_bytes"):
        value = getattr(args, flag, None)
        if value is not None:
            setattr(s, flag, value)
    if getattr(args, "no_spool", False):
        s.spool_dir = None
    if not s.token:
        from atroposd.config import TokenError

        try:
            s.token = api.bearer_token()  # [api] token_file, else $ATROPOSD_API_TOKEN
        except TokenError as exc:
            problems.append(str(exc))
    problems += _check(s)
    return s, args.log_level or level, fmt, problems


def _check(s: ApiSettings) -> list[str]:
    """What the config schema cannot check: the token's characters and the hidden test flags."""
    problems = []
    if not s.token.isascii() or any(c.isspace() for c in s.token):
        problems.append("the token must be printable ASCII without spaces")
    if s.body_timeout <= 0:
        problems.append(f"--body-timeout must be > 0, got {s.body_timeout}")
    return problems


def main(args: argparse.Namespace) -> int:
    settings, level, fmt, problems = settings_from(args)
    if problems:
        for p in problems:
            print(f"atroposd api: {p}", file=sys.stderr)
        return int(Exit.USAGE)
    from atroposd.logs import configure_logging

    configure_logging(level, fmt, component="api")
    from atroposd.api.app import run

    return run(settings)

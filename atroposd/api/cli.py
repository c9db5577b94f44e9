"""`atroposd api`: flags and entry point (imports nothing heavy at module level).

With ``-c FILE`` the ``[api]`` section is read (spool on by default, in ``{state_dir}/spool/api-{port}``
unless ``spool_dir`` says otherwise); without it the built-in defaults apply and nothing is spooled
unless ``--spool-dir`` is given. Flags override either.
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from typing import Any

LOOPBACK_NAMES = ("localhost",)


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
    parser.add_argument("--shm-ack-timeout", type=float, metavar="S",
                        help="seconds a shared-memory batch waits for its acknowledgement before it is served again")
    parser.add_argument("--token", help="require 'Authorization: Bearer TOKEN' (default: [api] token)")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"))


def settings_from(args: argparse.Namespace) -> tuple[Any, str, str]:
    """(ApiSettings, log level, log format) from -c and the flags."""
    from atroposd.api.server import ApiSettings
    from atroposd.config import ApiConfig, DaemonConfig

    if getattr(args, "config", None):
        from atroposd.cli import load_or_exit

        cfg = load_or_exit(args)
        s = ApiSettings.from_config(cfg.api, str(cfg.spool_dir) if cfg.api.spool else None)
        level, fmt = cfg.daemon.log_level, cfg.daemon.log_format
    else:  # standalone: the built-in defaults, and no spool unless --spool-dir (SPEC §2)
        s = ApiSettings.from_config(ApiConfig(), None)
        level, fmt = DaemonConfig().log_level, DaemonConfig().log_format
    for flag, attr in (("host", "host"), ("port", "port"), ("max_queued_sequences", "max_queued_sequences"),
                       ("full_wait", "full_wait"), ("spool_dir", "spool_dir"),
                       ("max_request_bytes", "max_request_bytes"), ("token", "token"),
                       ("shm_ack_timeout", "shm_ack_timeout")):
        value = getattr(args, flag, None)
        if value is not None:
            setattr(s, attr, value)
    if getattr(args, "no_spool", False):
        s.spool_dir = None
    return s, args.log_level or level, fmt


def _check(s: Any) -> list[str]:
    problems = []
    if not 1 <= s.port <= 65535:
        problems.append(f"--port must be in 1..65535, got {s.port}")
    if s.max_queued_sequences < 1:
        problems.append(f"--max-queued-sequences must be at least 1, got {s.max_queued_sequences}")
    if s.full_wait < 0:
        problems.append(f"--full-wait must be ≥ 0, got {s.full_wait}")
    if s.shm_ack_timeout <= 0:
        problems.append(f"--shm-ack-timeout must be > 0, got {s.shm_ack_timeout}")
    if s.max_request_bytes < 1024:
        problems.append(f"--max-request-bytes must be at least 1024, got {s.max_request_bytes}")
    return problems


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(args: argparse.Namespace) -> int:
    settings, level, fmt = settings_from(args)
    problems = _check(settings)
    if problems:
        for p in problems:
            print(f"atroposd api: {p}", file=sys.stderr)
        return 2
    from atroposd.logs import configure_logging

    configure_logging(level, fmt, component="api")
    from atroposd.api.app import run

    return run(settings)

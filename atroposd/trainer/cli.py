"""`atroposd trainer-rank`: flags and entry point of trainer ranks 1..N-1 (imports nothing heavy)."""

from __future__ import annotations

import argparse

from atroposd.exitcodes import Exit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rank", type=int, required=True, help="this process's trainer rank (1..N-1)")


def main(args: argparse.Namespace) -> int:
    import os

    from atroposd.clargs import load_or_exit
    from atroposd.logs import configure_logging

    cfg = load_or_exit(args)
    configure_logging(cfg.daemon.log_level, cfg.daemon.log_format, component=f"trainer-{args.rank}")
    from atroposd import gpuenv

    # before the group is built, whoever started this rank (the daemon gives them too; SPEC §12.1)
    gpuenv.apply(os.environ)
    from atroposd.trainer.follower import serve

    try:
        code = serve(cfg, int(args.rank))
    except KeyboardInterrupt:
        code = Exit.OK
    except Exception as exc:  # the group failed (rank 0 gone, a collective failed): exit 1, restarted
        from atroposd.logs import get_logger

        get_logger("atroposd.trainer.rank").error(
            "trainer rank failed", rank=args.rank, error=f"{type(exc).__name__}: {exc}"
        )
        code = Exit.RUNTIME
    # Without the interpreter's teardown: torch's libraries take seconds to unload, and a
    # process group of a dead peer may hang in its destructor.
    os._exit(int(code))

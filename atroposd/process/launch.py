"""Exec a child with a parent-death signal (run as a script: ``python -I -S launch.py SIG PPID -- ARGV``).

asyncio has no ``preexec_fn`` that is safe with threads, so the daemon execs this tiny launcher
(in its own session, from the event-loop thread, which is the thread the kernel watches for
PR_SET_PDEATHSIG).  It sets the signal, checks that the daemon did not die in between, and
execs the real command in place: the pid the daemon holds is the child's pid.

Standard library only and no ``site``: it must start in milliseconds. It runs as a script
(``-I``: the package is not on its path), so it loads the exit codes' leaf module by its file.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from typing import TYPE_CHECKING

PR_SET_PDEATHSIG = 1


def _load_exit_codes() -> type[Exit]:
    """``atroposd.exitcodes.Exit``, loaded from its file (run as a script, the package is not importable)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "exitcodes.py")
    spec = importlib.util.spec_from_file_location("_atroposd_exitcodes", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    exit_codes: type[Exit] = module.Exit
    return exit_codes


if TYPE_CHECKING or __name__ != "__main__":
    from atroposd.exitcodes import Exit
else:
    Exit = _load_exit_codes()


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        sys.stderr.write("usage: launch.py SIGNAL PARENT_PID -- COMMAND...\n")
        return int(Exit.USAGE)
    sig, parent = int(argv[0]), int(argv[1])
    command = argv[3:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        sys.stderr.write(f"atroposd launcher: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}\n")
        return int(Exit.EXEC_FAILED)
    # The parent may have died before prctl took effect: then no signal will ever come.
    if os.getppid() != parent:
        return int(Exit.EXEC_FAILED)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        sys.stderr.write(f"atroposd launcher: cannot execute {command[0]!r}: {exc.strerror or exc}\n")
    return int(Exit.EXEC_FAILED)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Checks that need an unprivileged user, run from root too (CI runs as root, and root ignores
file permissions): the check runs in a child that drops to ``nobody`` before it starts."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tests.support import REPO

NOBODY = 65534


def is_root() -> bool:
    return os.geteuid() == 0


def run_unprivileged(
    code: str, args: Sequence[str] = (), *, setup: str = "", timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -c CODE ARGS`` as this user, or, when this user is root, in a child that runs
    ``setup`` (imports: the interpreter's own files may be out of an unprivileged user's reach,
    as under /root) and then drops to ``nobody`` (uid and gid 65534, no supplementary groups)
    before ``code``."""
    drop = f"import os\nos.setgroups([])\nos.setgid({NOBODY})\nos.setuid({NOBODY})\n" if is_root() else ""
    return subprocess.run(
        [sys.executable, "-c", f"{setup}\n{drop}{code}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "HOME": "/"},
    )


@contextmanager
def shared_dir() -> Iterator[Path]:
    """A fresh directory under /tmp that the unprivileged child can reach and own: owned by
    ``nobody`` when this user is root (pytest's own temporary directories are root's, 0700)."""
    d = Path(tempfile.mkdtemp(prefix="atpd-unpriv-", dir="/tmp"))
    try:
        if is_root():
            os.chown(d, NOBODY, NOBODY)
        yield d
    finally:
        subprocess.run(["rm", "-rf", str(d)], check=False)

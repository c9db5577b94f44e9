"""Checks that need an unprivileged user, run as root too (CI runs as root, and root ignores
file permissions): while the check runs, this process's effective user and group are
``nobody``'s, and the kernel checks the permissions as it would for that user."""

from __future__ import annotations

import os
import shutil
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
    ``setup`` (imports: the interpreter's own files may be out of an unprivileged user's reach)
    and then drops to ``nobody`` (uid and gid 65534, no supplementary groups) before ``code`` —
    for a check that must be another process (another user's process reaching for ours)."""
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
def unprivileged() -> Iterator[None]:
    """As root: the effective uid and gid are ``nobody``'s inside the block (the real and saved
    ones stay root's, so they come back after it, whatever the block raised). As any other
    user: nothing changes, this user is unprivileged already."""
    if not is_root():
        yield
        return
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


@contextmanager
def shared_dir() -> Iterator[Path]:
    """A fresh directory under /tmp that an unprivileged block can reach and write: owned by
    ``nobody`` when this user is root (pytest's own temporary directories are root's, 0700)."""
    d = Path(tempfile.mkdtemp(prefix="atpd-unpriv-", dir="/tmp"))
    try:
        if is_root():
            os.chown(d, NOBODY, NOBODY)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)

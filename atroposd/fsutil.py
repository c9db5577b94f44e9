"""File writes shared by every layer: atomic replacement of a small file.

A leaf module (standard library only).
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def write_atomic(path: Path, data: bytes | str, mode: int = 0o600, *, durable: bool = False) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file beside it, then rename.

    Readers see the old file or the new one, never a part. The temporary file is created
    exclusively and without following links (a link planted at its name fails the write
    instead of redirecting it). ``durable`` adds an fsync of the file and of its directory,
    for files that must survive a power loss.
    """
    if isinstance(data, str):
        data = data.encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """fsync a directory so that a create, rename or unlink in it is durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""Where a job's runtime and state directories are when the config leaves them empty: systemd's,
root's or the user's (XDG) defaults."""

from __future__ import annotations

import os
from pathlib import Path


def default_runtime_dir() -> Path:
    """$RUNTIME_DIRECTORY (systemd's RuntimeDirectory=), else /run/atroposd as root, else
    $XDG_RUNTIME_DIR/atroposd, else the fallback /tmp/atroposd-$UID."""
    systemd = _systemd_directory("RUNTIME_DIRECTORY")
    if systemd is not None:
        return systemd
    if os.geteuid() == 0:
        return Path("/run/atroposd")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "atroposd"
    return fallback_runtime_dir()


def fallback_runtime_dir() -> Path:
    """The runtime_dir of last resort, in a directory every user may write (checked strictly)."""
    return Path(f"/tmp/atroposd-{os.getuid()}")


def default_state_dir() -> Path:
    """$STATE_DIRECTORY (systemd's StateDirectory=), else /var/lib/atroposd as root, else
    $XDG_STATE_HOME/atroposd (~/.local/state/atroposd)."""
    systemd = _systemd_directory("STATE_DIRECTORY")
    if systemd is not None:
        return systemd
    if os.geteuid() == 0:
        return Path("/var/lib/atroposd")
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / "atroposd"


def _systemd_directory(variable: str) -> Path | None:
    """The first absolute path of a systemd directory variable (a colon-separated list)."""
    first = os.environ.get(variable, "").split(":", 1)[0]
    return Path(first) if first.startswith("/") else None

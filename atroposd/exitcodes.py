"""Exit codes of every atroposd command and child (SPEC §2), written once.

A leaf module: it imports nothing of the package, so every layer may use it.
"""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    """What a process's exit status means (SPEC §2 "Exit codes")."""

    OK = 0
    """Success: steps finished, a requested stop completed, a command did what it was asked."""
    RUNTIME = 1
    """Runtime failure: trainer exception, data_timeout, a failed API or inference server."""
    USAGE = 2
    """Bad usage or invalid config; nothing started or changed."""
    NOT_RUNNING = 3
    """No daemon is running for this config."""
    ALREADY_RUNNING = 4
    """A daemon is already running for this config."""
    STOP_TIMEOUT = 5
    """`stop --timeout` passed before every process was gone."""
    COLLAPSED = 6
    """The run collapsed past ``[health] max_rollbacks`` (SPEC §15); the shipped unit does not restart."""
    EXEC_FAILED = 127
    """A child's program could not be executed (the shell's convention)."""

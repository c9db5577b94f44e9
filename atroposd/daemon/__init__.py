"""The daemon: desired state, one reconciler, start order, signals, status (SPEC §4).

A package by concern:

- :mod:`.core` — :class:`Daemon`, the lifecycle: start order, the main loop, signals, stop;
- :mod:`.state` — the daemon's state machine and the typed events of its main loop;
- :mod:`.specs` — the children's specs from the config (a pure function);
- :mod:`.reload` — reload as a diff of two configs into a plan (a pure function);
- :mod:`.recovery` — crash recovery and this daemon's recovery record;
- :mod:`.status` — ``status --json``, the sd_notify line, Prometheus metrics;
- :mod:`.runtime` — pidfile lock, port checks, the children's config file.
"""

from __future__ import annotations

from atroposd.daemon.core import Daemon, run_foreground
from atroposd.daemon.runtime import (
           AlreadyRunning,
           StartFailed,
           check_port,
           lock_pidfile,
           read_pidfile,
)
from atroposd.daemon.specs import API_READY_TIMEOUT

__all__ = ["API_READY_TIMEOUT", "AlreadyRunning", "Daemon", "StartFailed", "check_port", "lock_pidfile",
           "read_pidfile", "run_foreground"]

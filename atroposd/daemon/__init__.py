"""The daemon: desired state, one reconciler, start order, signals, status (SPEC §4).

A package by concern:

- :mod:`.core` — :class:`Daemon`, the lifecycle: start order, the main loop, signals, stop;
- :mod:`.state` — the daemon's state machine and the typed events of its main loop;
- :mod:`.specs` — the children's specs from the config (a pure function);
- :mod:`.reload` — reload as a diff of two configs into a plan (a pure function);
- :mod:`.recovery` — crash recovery and this daemon's recovery record;
- :mod:`.status` — ``status --json``, the sd_notify line, Prometheus metrics;
- :mod:`.runtime` — pidfile lock, port checks, the children's config file;
- :mod:`.cluster` — the head's and the nodes' side of a job on several machines;
- :mod:`.watchdog`, :mod:`.metrics`, :mod:`.replicas` — the stall watchdog, ``/metrics``, the
  replicas' units.

It imports none of them (each importer names its module): a module of the package that
imports another never goes through this one, so no import circle runs through here.
"""

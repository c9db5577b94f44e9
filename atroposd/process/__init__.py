"""Managed children: the unit state machine (unit.py), readiness probes (probes.py), the
launcher that sets the parent-death signal (launch.py), log files (logfiles.py), and the
subreaper, descendant tracking and crash recovery (reaper.py)."""

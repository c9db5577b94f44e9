"""Containers the environments start (SPEC §16): each environment replica's own Docker Engine
API socket, labels on everything created through it, the checks on create bodies, and the
removal of a job's containers on a replica's restart, on stop and after a crash.

    labels.py   the four labels, the job's id, ownership
    policy.py   create bodies checked field by field (privileges, mounts, memory)
    engine.py   the daemon's own small client of the engine (list, kill, remove)
    proxy.py    one replica's socket: the Docker API forwarded, upgrades and streams included
    reaper.py   kill-then-remove in parallel within a deadline; sweeps by label; max_age
    manager.py  what the daemon holds: the replicas' proxies, counts, status and metrics

Only the daemon imports this package, and only with ``[sandbox] engine`` set; the control
commands never do.
"""

"""The labels of SPEC §16 and who owns what.

``atroposd.job`` is the job's instance id: the same in every launch of a job, derived from its
resolved ``state_dir``; ``atroposd.launch`` is the daemon's per-launch nonce.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JOB = "atroposd.job"
ENV = "atroposd.env"
REPLICA = "atroposd.replica"
LAUNCH = "atroposd.launch"
PREFIX = "atroposd."


def job_id(state_dir: Path | str) -> str:
    """The job's instance id: a digest of its resolved ``state_dir`` (16 hex digits)."""
    resolved = os.path.realpath(os.path.abspath(os.fspath(state_dir)))
    return hashlib.sha256(resolved.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Owner:
    """One environment replica of one launch of one job: what its objects are labelled with."""

    job: str
    env: str
    replica: int
    launch: str

    @property
    def labels(self) -> dict[str, str]:
        return {JOB: self.job, ENV: self.env, REPLICA: str(self.replica), LAUNCH: self.launch}

    @property
    def unit(self) -> str:
        """The replica's component name (``NAME-i``)."""
        return f"{self.env}-{self.replica}"

    def owns(self, labels: Mapping[str, Any] | None) -> bool:
        """Whether an object with these labels is this replica's (its job, env and replica; any
        launch: a replica reaches nothing of an earlier launch only because those are removed)."""
        if not isinstance(labels, Mapping):
            return False
        return labels.get(JOB) == self.job and labels.get(ENV) == self.env and labels.get(REPLICA) == str(self.replica)

    def filters(self) -> list[str]:
        """``label`` filters selecting this replica's objects on the engine."""
        return [f"{JOB}={self.job}", f"{ENV}={self.env}", f"{REPLICA}={self.replica}"]


def with_labels(given: Mapping[str, str] | None, owner: Owner) -> dict[str, str]:
    """A client's labels with ours set over them (a client cannot set ``atroposd.*`` itself)."""
    out = {k: v for k, v in (given or {}).items() if not str(k).startswith(PREFIX)}
    out.update(owner.labels)
    return out


SOCKET_DIR = "sandbox"


def socket_path(runtime_dir: Path, unit: str) -> Path:
    """An environment replica's engine socket: ``{runtime_dir}/sandbox/{NAME-i}.sock``, or a
    digest of the name where that would not fit in ``sun_path`` (107 bytes)."""
    path = Path(runtime_dir) / SOCKET_DIR / f"{unit}.sock"
    if len(os.fsencode(path)) <= 107:
        return path
    return Path(runtime_dir) / SOCKET_DIR / f"{hashlib.sha256(unit.encode()).hexdigest()[:12]}.sock"


# The longest tail socket_path adds to runtime_dir: "/sandbox/" + 12 hex digits + ".sock".
SOCKET_TAIL = len(f"/{SOCKET_DIR}/") + 12 + len(".sock")


def engine_path(engine: str) -> str:
    """The engine socket's path from ``[sandbox] engine`` (``unix:///run/podman/podman.sock``)."""
    return engine[len("unix://") :] if engine.startswith("unix://") else engine

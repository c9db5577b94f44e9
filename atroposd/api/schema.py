"""Wire formats of the trajectory API (ATROPOS-PROTOCOL.md §1.1): the registrations, the request
parameters and the API's JSON encoder. The scored group itself (:class:`Group`, its parsing and
checks) is the schema the trainer shares, :mod:`atroposd.groups`, re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from atroposd.groups import (
    DISTILL,
    FLOAT_ROWS,
    MAX_DISTILL_K,
    MAX_PASSTHROUGH_DEPTH,
    PASSTHROUGH,
    Group,
    Ragged,
    SchemaError,
    assemble_group,
    check_distill,
    check_passthrough,
    encode_passthrough,
    group_from_json,
    group_to_json,
    narrow_rows,
    text_depth,
    value_depth,
)

__all__ = [
    "DISTILL",
    "FLOAT_ROWS",
    "MAX_DISTILL_K",
    "MAX_ENVS",
    "MAX_NAME_CHARS",
    "MAX_PASSTHROUGH_DEPTH",
    "PASSTHROUGH",
    "EnvRegistration",
    "Group",
    "InvalidRequest",
    "Ragged",
    "TrainerRegistration",
    "assemble_group",
    "check_distill",
    "check_passthrough",
    "dumps",
    "encode_passthrough",
    "env_id_of",
    "group_from_json",
    "group_to_json",
    "narrow_rows",
    "text_depth",
    "value_depth",
    "wait_seconds",
]

_I64 = np.iinfo(np.int64)
_NUMPY = orjson.OPT_SERIALIZE_NUMPY

# Registration bounds (SPEC §13).
MAX_ENVS = 1024
MAX_NAME_CHARS = 256

#: A request the API refuses, a group's or any other body's: the schema's error (``status``: the
#: HTTP code; ``reason``: the rejection metric's label; ``field``: what it names).
InvalidRequest = SchemaError


def dumps(obj: object) -> bytes:
    return orjson.dumps(obj, option=_NUMPY)


# ----------------------------------------------------------------------------- registrations


def _present(obj: Mapping[str, object], name: str) -> object:
    if name not in obj or obj[name] is None:
        raise InvalidRequest(f"field required: {name}")
    return obj[name]


def _str(obj: Mapping[str, object], name: str) -> str:
    v = _present(obj, name)
    if not isinstance(v, str):
        raise InvalidRequest(f"{name} must be a string")
    return v


def _number(obj: Mapping[str, object], name: str) -> int | float:
    v = _present(obj, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidRequest(f"{name} must be a number")
    return v


def _int(obj: Mapping[str, object], name: str) -> int:
    v = _number(obj, name)
    if not math.isfinite(v) or v != int(v):
        raise InvalidRequest(f"{name} must be an integer")
    if not _I64.min <= int(v) <= _I64.max:
        raise InvalidRequest(f"{name}: integer out of range")
    return int(v)


def _float(obj: Mapping[str, object], name: str, *, optional: bool = False) -> float | None:
    if optional and (name not in obj or obj[name] is None):
        return None
    v = _number(obj, name)
    if not math.isfinite(v):
        raise InvalidRequest(f"{name} must be a finite number")
    return float(v)


def _object(obj: object, what: str) -> Mapping[str, object]:
    if not isinstance(obj, Mapping):
        raise InvalidRequest(f"body must be a JSON object ({what})")
    return obj


@dataclass(slots=True)
class TrainerRegistration:
    """``POST /register``: all fields required, as upstream's pydantic model."""

    wandb_group: str
    wandb_project: str
    batch_size: int
    max_token_len: int
    checkpoint_dir: str
    save_checkpoint_interval: int
    starting_step: int
    num_steps: int

    @classmethod
    def from_json(cls, obj: object) -> TrainerRegistration:
        o = _object(obj, "Registration")
        reg = cls(
            wandb_group=_str(o, "wandb_group"),
            wandb_project=_str(o, "wandb_project"),
            batch_size=_int(o, "batch_size"),
            max_token_len=_int(o, "max_token_len"),
            checkpoint_dir=_str(o, "checkpoint_dir"),
            save_checkpoint_interval=_int(o, "save_checkpoint_interval"),
            starting_step=_int(o, "starting_step"),
            num_steps=_int(o, "num_steps"),
        )
        if reg.batch_size < 1:
            raise InvalidRequest("batch_size must be at least 1")
        return reg

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


@dataclass(slots=True)
class EnvRegistration:
    """One registered environment (upstream's ``app.state.envs`` entry)."""

    max_context_len: int
    weight: float
    desired_name: str
    real_name: str
    registered_id: int
    group_size: int
    min_batch_allocation: float | None
    connected: bool = True
    last_update: float = 0.0
    # The registering process (loopback clients), so that a restart can tell whether it still runs.
    peer_pid: int | None = None
    peer_start: int | float | None = None  # pids.Start: ticks since boot (a float: older wall-clock form)

    @staticmethod
    def parse_request(obj: object) -> dict[str, Any]:
        """Validate a ``POST /register-env`` body (RegisterEnv)."""
        o = _object(obj, "RegisterEnv")
        req: dict[str, Any] = {
            "max_token_length": _int(o, "max_token_length"),
            "desired_name": _str(o, "desired_name"),
            "weight": _float(o, "weight"),
            "group_size": _int(o, "group_size"),
            "min_batch_allocation": _float(o, "min_batch_allocation", optional=True),
        }
        if req["max_token_length"] < 1:
            raise InvalidRequest(f"max_token_length must be at least 1, got {req['max_token_length']}")
        if len(req["desired_name"]) > MAX_NAME_CHARS:
            raise InvalidRequest(f"desired_name is longer than {MAX_NAME_CHARS} characters")
        if req["weight"] < 0:
            raise InvalidRequest(f"weight must be ≥ 0, got {req['weight']}")
        if req["group_size"] < 1:
            raise InvalidRequest(f"group_size must be at least 1, got {req['group_size']}")
        mba = req["min_batch_allocation"]
        if mba is not None and not 0.0 <= mba <= 1.0:
            raise InvalidRequest(f"min_batch_allocation must be between 0 and 1, got {mba}")
        return req

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}

    @classmethod
    def from_saved(cls, obj: Mapping[str, Any], capacity: int = 1 << 31) -> EnvRegistration:
        """A registration from the spool, its fields clamped into the bounds a request gets
        (a spool written before the bounds existed may hold anything)."""
        env = cls(**{k: obj[k] for k in cls.__slots__ if k in obj})
        env.max_context_len = max(1, _finite_int(env.max_context_len, 1))
        w = env.weight
        env.weight = float(w) if isinstance(w, (int, float)) and math.isfinite(w) and w >= 0 else 0.0
        env.group_size = min(max(1, _finite_int(env.group_size, 1)), capacity)
        m = env.min_batch_allocation
        env.min_batch_allocation = (
            min(1.0, max(0.0, float(m))) if isinstance(m, (int, float)) and math.isfinite(m) else None
        )
        env.desired_name = str(env.desired_name)[:MAX_NAME_CHARS]
        if (
            isinstance(env.peer_start, bool)
            or not isinstance(env.peer_start, (int, float))
            or not isinstance(env.peer_pid, int)
            or isinstance(env.peer_pid, bool)
        ):
            env.peer_pid, env.peer_start = None, None  # no identity to check: treated as unknown
        return env


def _finite_int(v: object, default: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return default
    return int(v)


# ----------------------------------------------------------------------------- request parameters


def env_id_of(body: object) -> int:
    """The ``env_id`` of a request body (an integer, or an integral number or string)."""
    if not isinstance(body, dict) or body.get("env_id") is None:
        raise InvalidRequest("field required: env_id")
    value = body["env_id"]
    if not isinstance(value, (int, float, str)):
        raise InvalidRequest("env_id must be an integer")
    try:
        env_id = int(value)
    except (TypeError, ValueError):
        raise InvalidRequest("env_id must be an integer") from None
    if isinstance(value, bool) or (isinstance(value, float) and value != env_id):
        raise InvalidRequest("env_id must be an integer")
    return env_id


# The longest a long-poll (GET /batch?wait=, /status-env "wait_s") is held.
MAX_WAIT_S = 30.0


def wait_seconds(value: object) -> float:
    """A long-poll's wait: a number of seconds in [0, MAX_WAIT_S]; absent: 0 (answer at once)."""
    if value is None:
        return 0.0
    if not isinstance(value, (int, float, str)):
        raise InvalidRequest(f"wait must be a number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise InvalidRequest(f"wait must be a number of seconds, got {value!r}") from None
    if isinstance(value, bool) or not 0 <= seconds <= MAX_WAIT_S:
        raise InvalidRequest(f"wait must be between 0 and {MAX_WAIT_S:g} seconds, got {value!r}")
    return seconds

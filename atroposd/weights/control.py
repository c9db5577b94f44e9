"""The inference server's weight-control bodies (its Unix socket, SPEC §7): one frozen dataclass
per body, and its strict decoding on arrival.

``POST /pause`` (:class:`PauseBody`), ``POST /resume`` (:class:`ResumeBody`), ``POST
/update_weights`` (:class:`UpdateWeights`), ``POST /load`` (:class:`LoadWeights`), ``POST
/broadcast`` (:class:`BroadcastOp`: its ``op``; the rest is read by :mod:`atroposd.weights.broadcast`)
and ``POST /quarantine`` (:class:`QuarantineBody`). Each ``parse`` takes the JSON document as it
arrived and returns the typed body, or raises :class:`ControlBodyError` naming the field that
is missing or of the wrong type (the server answers 400 with its message). Fields a body does
not name are ignored. ``/pause`` and ``/resume`` take no body at all as their defaults. Each
body's ``fields()`` is the JSON object it travels as (what the sending side writes).

Torch-free and a leaf (the standard library and :mod:`atroposd.weights.protocol`): the front
decodes bodies before any engine module is imported, and the receiver
(:mod:`atroposd.weights.receiver`) decodes the same types for callers in the same process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from atroposd.weights.protocol import WeightUpdateError

__all__ = [
    "BROADCAST_OPS",
    "UPDATE_MODES",
    "BroadcastOp",
    "ControlBodyError",
    "LoadWeights",
    "PauseBody",
    "QuarantineBody",
    "ResumeBody",
    "UpdateWeights",
]

UpdateMode = Literal["attach", "copy"]
UPDATE_MODES: tuple[UpdateMode, ...] = ("attach", "copy")
BroadcastOpName = Literal["join", "receive", "finish", "leave"]
BROADCAST_OPS: tuple[BroadcastOpName, ...] = ("join", "receive", "finish", "leave")
QUARANTINE_REASON = "drift over the limit"


class ControlBodyError(WeightUpdateError):
    """A weight-control body refused on arrival (HTTP 400), naming the field; nothing was changed."""


def _object(body: object, what: str = "request must be a JSON object") -> Mapping[str, object]:
    if not isinstance(body, Mapping):
        raise ControlBodyError(what)
    return body


def _required_str(body: Mapping[str, object], key: str) -> str:
    if key not in body:
        raise ControlBodyError(f"request is missing {key!r}")
    value = body[key]
    if not isinstance(value, str):
        raise ControlBodyError(f"{key!r} must be a string, got {value!r}")
    return value


def _optional_int(body: Mapping[str, object], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ControlBodyError(f"{key!r} must be an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class PauseBody:
    """``{"mode"?: "wait" | "keep", "clear_cache"?: bool}``; no body: ``wait`` (drain), on every engine.

    An engine lists the modes it serves (``Engine.pause_modes``); an engine that serves ``wait``
    only takes neither ``mode`` (but ``"wait"``) nor ``clear_cache``."""

    mode: str | None = None
    clear_cache: bool | None = None

    @classmethod
    def parse(cls, body: object, *, engine: str, modes: tuple[str, ...]) -> PauseBody:
        if not isinstance(body, Mapping):
            return cls()
        mode, clear = body.get("mode"), body.get("clear_cache")
        if mode not in (None, *modes) or (clear is not None and len(modes) == 1):
            raise ControlBodyError(f"the {engine} engine pauses with mode {' or '.join(modes)} only")
        if clear is not None and not isinstance(clear, bool):
            raise ControlBodyError(f"clear_cache must be true or false, got {clear!r}")
        assert mode is None or isinstance(mode, str)
        return cls(mode, clear)

    def fields(self) -> dict[str, object]:
        out: dict[str, object] = {}
        if self.mode is not None:
            out["mode"] = self.mode
        if self.clear_cache is not None:
            out["clear_cache"] = self.clear_cache
        return out


@dataclass(frozen=True)
class ResumeBody:
    """``{"weight_version"?: int ≥ 0}``; no body (or no version): resume with the version served."""

    weight_version: int | None = None

    @classmethod
    def parse(cls, body: object) -> ResumeBody:
        version = body.get("weight_version") if isinstance(body, Mapping) else None
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ControlBodyError(f"weight_version must be a non-negative integer, got {version!r}")
        return cls(version)

    def fields(self) -> dict[str, object]:
        return {} if self.weight_version is None else {"weight_version": self.weight_version}


@dataclass(frozen=True)
class UpdateWeights:
    """``{"manifest": path, "mode": "attach" | "copy", "weight_version"?: int, "digest"?: bool}``
    (``shared`` / ``push`` mode; :mod:`atroposd.weights.receiver` says what each means).
    ``digest``: a bucket's answer carries the sha256 of each tensor it filled."""

    manifest: str
    mode: UpdateMode
    weight_version: int | None = None
    digest: bool = False

    @classmethod
    def parse(cls, body: object) -> UpdateWeights:
        if isinstance(body, UpdateWeights):
            return body
        fields = _object(body)
        mode = _required_str(fields, "mode")
        for known in UPDATE_MODES:
            if mode == known:
                manifest = _required_str(fields, "manifest")
                return cls(manifest, known, _optional_int(fields, "weight_version"), fields.get("digest") is True)
        raise ControlBodyError(f"'mode' must be 'attach' or 'copy', got {mode!r}")

    def fields(self) -> dict[str, object]:
        out: dict[str, object] = {"manifest": self.manifest, "mode": self.mode}
        if self.weight_version is not None:
            out["weight_version"] = self.weight_version
        if self.digest:
            out["digest"] = True
        return out


@dataclass(frozen=True)
class LoadWeights:
    """``{"path": directory, "weight_version"?: int}`` (``reload`` mode): a directory the trainer
    wrote under ``{state_dir}/sync``."""

    path: str
    weight_version: int | None = None

    @classmethod
    def parse(cls, body: object) -> LoadWeights:
        if isinstance(body, LoadWeights):
            return body
        fields = body if isinstance(body, Mapping) else {}
        if not isinstance(fields.get("path"), str):
            raise ControlBodyError("request is missing 'path'")
        return cls(str(fields["path"]), _optional_int(fields, "weight_version"))

    def fields(self) -> dict[str, object]:
        out: dict[str, object] = {"path": self.path}
        if self.weight_version is not None:
            out["weight_version"] = self.weight_version
        return out


@dataclass(frozen=True)
class BroadcastOp:
    """``{"op": "join" | "receive" | "finish" | "leave", ...}`` (``broadcast`` mode). ``body`` is the
    whole document: each op's own fields are checked by :mod:`atroposd.weights.broadcast`."""

    op: BroadcastOpName
    body: Mapping[str, object] = field(default_factory=dict)

    @classmethod
    def parse(cls, body: object) -> BroadcastOp:
        if isinstance(body, BroadcastOp):
            return body
        fields = _object(body, "broadcast request must be a JSON object with an 'op'")
        op = fields.get("op")
        if not isinstance(op, str):
            raise ControlBodyError("broadcast request must be a JSON object with an 'op'")
        for known in BROADCAST_OPS:
            if op == known:
                return cls(known, fields)
        raise ControlBodyError(f"unknown broadcast op {op!r} ({', '.join(BROADCAST_OPS)})")


@dataclass(frozen=True)
class QuarantineBody:
    """``{"quarantine": bool, "reason"?: text}`` (SPEC §15): ``reason`` is what a quarantined
    replica's generation routes answer with (default: drift over the limit)."""

    quarantine: bool
    reason: str = QUARANTINE_REASON

    @classmethod
    def parse(cls, body: object) -> QuarantineBody:
        fields = _object(body, "quarantine must be true or false")
        on = fields.get("quarantine")
        if not isinstance(on, bool):
            raise ControlBodyError("quarantine must be true or false")
        reason = fields.get("reason")
        return cls(on, str(reason) if reason else QUARANTINE_REASON)

"""The cluster endpoint's messages (SPEC §12.3): one frozen dataclass per type, and their strict
decoding.

Each type has a direction (``H2N``: the head to a node; ``N2H``: a node to the head) and a fixed
set of typed fields. ``decode`` turns a message's type and fields (as they arrived, inside a
checked envelope: ``wire``) into its dataclass, or raises :class:`BadMessage` naming the problem:
an unknown type, a type that is not sent in that direction, a field missing, one too many, or one
of the wrong type. ``fields`` gives the JSON object a message travels as. Bounds on what the
values hold (rows, string lengths, escapes) are the receiver's (``membership.clean_*``).

A leaf of the ``cluster`` package: standard library only.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

__all__ = [
    "DIRECTIONS",
    "H2N",
    "MESSAGES",
    "N2H",
    "REASONS",
    "Ack",
    "BadMessage",
    "Beat",
    "CanaryAnswer",
    "CanaryAsk",
    "Care",
    "Cared",
    "Hello",
    "Join",
    "LineTooLong",
    "Message",
    "RankExit",
    "Ranks",
    "RanksStopped",
    "Refused",
    "Replaced",
    "Report",
    "Resync",
    "Stop",
    "Stopped",
    "Welcome",
    "WrongToken",
    "decode",
    "fields",
]

H2N, N2H = "h2n", "n2h"
DIRECTIONS = (H2N, N2H)
_FROM = {H2N: "the head to a node", N2H: "a node to the head"}

# Why a message was dropped (the counter's labels, SPEC §12.3): a signature that does not verify,
# a message of the other direction, another session, a sequence number not above the last one,
# a join signed for another connection's challenge, fields that do not check, a line that is not
# a message of the protocol at all.
MAC, DIRECTION, SESSION, SEQUENCE, CHALLENGE, FIELDS, FRAMING = (
    "mac",
    "direction",
    "session",
    "sequence",
    "challenge",
    "fields",
    "framing",
)
REASONS = (MAC, DIRECTION, SESSION, SEQUENCE, CHALLENGE, FIELDS, FRAMING)

_HEX32 = re.compile(r"[0-9a-f]{32}")


class BadMessage(ValueError):
    """A line or message refused, never acted on; ``reason`` (one of ``REASONS``) says why."""

    def __init__(self, message: str, reason: str = FRAMING) -> None:
        super().__init__(message)
        self.reason = reason


class WrongToken(BadMessage):
    """A message whose signature does not verify: the peer holds another cluster token (or the
    line was edited on its way)."""

    def __init__(self, message: str, reason: str = MAC) -> None:
        super().__init__(message, reason)


class LineTooLong(BadMessage):
    """A line past the connection's bound: the rest of the stream cannot be read as lines."""


@dataclass(frozen=True)
class Message:
    TYPE: ClassVar[str] = ""
    DIRECTION: ClassVar[str] = ""


# ---------------------------------------------------------------------------- the handshake


@dataclass(frozen=True)
class Hello(Message):
    """The head's first line on a new connection (unsigned): the challenge the join must sign."""

    TYPE: ClassVar[str] = "hello"
    DIRECTION: ClassVar[str] = H2N
    challenge: str


@dataclass(frozen=True)
class Join(Message):
    """A node's first message: signed under a key of this connection's challenge; ``nonce`` is
    the node's part of the session keys."""

    TYPE: ClassVar[str] = "join"
    DIRECTION: ClassVar[str] = N2H
    challenge: str
    nonce: str
    node_rank: int
    host: str
    pid: int
    instance: str
    units: dict[str, Any]
    components: list[dict[str, Any]]
    ready: bool
    rejoin: bool
    head_instance: str


@dataclass(frozen=True)
class Welcome(Message):
    TYPE: ClassVar[str] = "welcome"
    DIRECTION: ClassVar[str] = H2N
    head_instance: str
    head_host: str
    nodes: int
    interval: float


@dataclass(frozen=True)
class Refused(Message):
    """The head turns a node away (signed; unsigned only to a peer whose join did not verify)."""

    TYPE: ClassVar[str] = "refused"
    DIRECTION: ClassVar[str] = H2N
    reason: str
    fatal: bool = True


# ---------------------------------------------------------------------------- a session


@dataclass(frozen=True)
class Beat(Message):
    TYPE: ClassVar[str] = "beat"
    DIRECTION: ClassVar[str] = N2H


@dataclass(frozen=True)
class Ack(Message):
    """The head's answer to a beat: the beat's sequence number."""

    TYPE: ClassVar[str] = "ack"
    DIRECTION: ClassVar[str] = H2N
    beat: int


@dataclass(frozen=True)
class Report(Message):
    TYPE: ClassVar[str] = "report"
    DIRECTION: ClassVar[str] = N2H
    components: list[dict[str, Any]] = field(default_factory=list)
    ready: bool = False


@dataclass(frozen=True)
class Stop(Message):
    TYPE: ClassVar[str] = "stop"
    DIRECTION: ClassVar[str] = H2N


@dataclass(frozen=True)
class Stopped(Message):
    """A node's processes are gone after the head's stop."""

    TYPE: ClassVar[str] = "stopped"
    DIRECTION: ClassVar[str] = N2H


@dataclass(frozen=True)
class Leave(Message):
    TYPE: ClassVar[str] = "leave"
    DIRECTION: ClassVar[str] = N2H
    reason: str


@dataclass(frozen=True)
class Replaced(Message):
    """A newer start of the same node joined in this connection's place."""

    TYPE: ClassVar[str] = "replaced"
    DIRECTION: ClassVar[str] = H2N
    by_pid: int


@dataclass(frozen=True)
class Ranks(Message):
    """Start (for ``generation`` of the head's ``launch``: its nonce, in the store prefix and the
    command key) or stop a node's trainer ranks."""

    TYPE: ClassVar[str] = "ranks"
    DIRECTION: ClassVar[str] = H2N
    op: Literal["start", "stop"]
    generation: int = 0
    launch: str = ""


@dataclass(frozen=True)
class RanksStopped(Message):
    TYPE: ClassVar[str] = "ranks_stopped"
    DIRECTION: ClassVar[str] = N2H


@dataclass(frozen=True)
class RankExit(Message):
    """A node's trainer rank exited on its own: the head restarts the group."""

    TYPE: ClassVar[str] = "rank_exit"
    DIRECTION: ClassVar[str] = N2H
    name: str
    how: str


@dataclass(frozen=True)
class Resync(Message):
    """A node's inference replica restarted: it needs a full push."""

    TYPE: ClassVar[str] = "resync"
    DIRECTION: ClassVar[str] = N2H
    replica: int


# ---------------------------------------------------------------------------- the sentinel (SPEC §15)


@dataclass(frozen=True)
class CanaryAsk(Message):
    """The head's replica sentinel: the node's inference replica ``replica`` generates greedily
    from the canary ``prompts`` (rows ``{"ids": [token ids]}``), ``max_tokens`` each; the node
    answers with a :class:`CanaryAnswer` of the same ``request``. The node scores nothing."""

    TYPE: ClassVar[str] = "canary"
    DIRECTION: ClassVar[str] = H2N
    request: int
    replica: int
    prompts: list[dict[str, Any]]
    max_tokens: int


@dataclass(frozen=True)
class CanaryAnswer(Message):
    """A node's replica's greedy tokens for the head's :class:`CanaryAsk`: one row per prompt,
    ``{"tokens": [ids], "logprobs": [numbers], "weight_version": int or null}``; ``error``: why
    there is none (the replica did not answer)."""

    TYPE: ClassVar[str] = "canary_answer"
    DIRECTION: ClassVar[str] = N2H
    request: int
    replica: int
    answers: list[dict[str, Any]]
    error: str = ""


@dataclass(frozen=True)
class Care(Message):
    """The head's sentinel's word on a node's replica: ``quarantine`` it (its generation routes
    answer 503), ``release`` it, or ``restart`` it; answered by :class:`Cared`."""

    TYPE: ClassVar[str] = "care"
    DIRECTION: ClassVar[str] = H2N
    request: int
    replica: int
    op: Literal["quarantine", "release", "restart"]
    reason: str = ""


@dataclass(frozen=True)
class Cared(Message):
    """A node did what :class:`Care` asked (``ok``), or not (``detail`` says why)."""

    TYPE: ClassVar[str] = "cared"
    DIRECTION: ClassVar[str] = N2H
    request: int
    replica: int
    ok: bool
    detail: str = ""


MESSAGES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        Join,
        Welcome,
        Refused,
        Beat,
        Ack,
        Report,
        Stop,
        Stopped,
        Leave,
        Replaced,
        Ranks,
        RanksStopped,
        RankExit,
        Resync,
        CanaryAsk,
        CanaryAnswer,
        Care,
        Cared,
    )
}


# ---------------------------------------------------------------------------- checks


def _kind(value: object) -> str:
    return (
        "null"
        if value is None
        else {
            bool: "a boolean",
            int: "an integer",
            float: "a number",
            str: "a string",
            list: "a list",
            dict: "an object",
        }.get(type(value), type(value).__name__)
    )


def _show(name: object) -> str:
    text = str(name)
    text = "".join(c if c.isprintable() else "?" for c in text[:40])
    return repr(text + ("…" if len(str(name)) > 40 else ""))


Check = typing.Callable[[object], "tuple[bool, object]"]


def _is_int(v: object) -> tuple[bool, object]:
    return isinstance(v, int) and not isinstance(v, bool), v


def _is_float(v: object) -> tuple[bool, object]:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return True, float(v)
    return False, v


def _is_str(v: object) -> tuple[bool, object]:
    return isinstance(v, str), v


def _is_bool(v: object) -> tuple[bool, object]:
    return isinstance(v, bool), v


def _is_object(v: object) -> tuple[bool, object]:
    return isinstance(v, dict), v


def _is_rows(v: object) -> tuple[bool, object]:
    return isinstance(v, list) and all(isinstance(r, dict) for r in v), v


def _checker(hint: object) -> tuple[Check, str]:
    if hint is int:
        return _is_int, "an integer"
    if hint is float:
        return _is_float, "a number"
    if hint is str:
        return _is_str, "a string"
    if hint is bool:
        return _is_bool, "a boolean"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is dict:
        return _is_object, "an object"
    if origin is list and args and typing.get_origin(args[0]) is dict:
        return _is_rows, "a list of objects"
    if origin is Literal:
        choices = tuple(args)
        return (lambda v: (isinstance(v, str) and v in choices, v)), " or ".join(repr(c) for c in choices)
    raise TypeError(f"no check for {hint!r}")


# type → [(field, check, what it must be)]; every field travels (defaults are for the sender's code)
_SPECS: dict[str, list[tuple[str, Check, str]]] = {}
for _cls in MESSAGES.values():
    _hints = typing.get_type_hints(_cls)
    _SPECS[_cls.TYPE] = [(f.name, *_checker(_hints[f.name])) for f in dataclasses.fields(_cls)]


def fields(msg: Message) -> dict[str, Any]:
    """The JSON object ``msg`` travels as (every field, defaults included)."""
    return {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}


def decode(kind: Any, values: Any, direction: str) -> Message:
    """The message of type ``kind`` with ``values`` (a JSON object), sent in ``direction``; every
    field present, none more, each of its type. BadMessage (reason ``fields``) naming the problem."""
    if not isinstance(kind, str) or kind not in MESSAGES:
        raise BadMessage(f"unknown message type {_show(kind)}", FIELDS)
    cls = MESSAGES[kind]
    if cls.DIRECTION != direction:
        raise BadMessage(f"a {kind!r} is sent from {_FROM[cls.DIRECTION]}, not from {_FROM[direction]}", FIELDS)
    if not isinstance(values, dict):
        raise BadMessage(f"the fields of a {kind!r} must be an object, not {_kind(values)}", FIELDS)
    spec = _SPECS[kind]
    known = {name for name, *_ in spec}
    extra = [k for k in values if k not in known]
    if extra:
        raise BadMessage(f"a {kind!r} has no field {', '.join(_show(k) for k in extra[:5])}", FIELDS)
    out: dict[str, Any] = {}
    for name, check, what in spec:
        if name not in values:
            raise BadMessage(f"a {kind!r} without its field {name!r}", FIELDS)
        ok, value = check(values[name])
        if not ok:
            raise BadMessage(f"a {kind!r} whose {name!r} is {_kind(values[name])}, not {what}", FIELDS)
        out[name] = value
    if kind in (Hello.TYPE, Join.TYPE):
        for name in ("challenge", "nonce") if kind == Join.TYPE else ("challenge",):
            if not _HEX32.fullmatch(out[name]):
                raise BadMessage(f"a {kind!r} whose {name!r} is not 32 hex digits", FIELDS)
    return cls(**out)

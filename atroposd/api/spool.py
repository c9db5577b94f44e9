"""The API's spool: accepted groups and registrations survive a restart (SPEC §5, durability).

An append-only log split into segment files ``seg-NNNNNNNN.log`` in the spool directory. Each
record is framed ``<payload length u32><crc32 u32><type byte><payload>``. Damage (a torn tail
after a crash mid-write, or bad bytes in the middle) costs only the damaged bytes: the replay
resynchronises at the next valid frame, and a record that is framed correctly but cannot be
replayed is skipped. Either is copied to ``bad/`` first (``set_aside`` counts them, the log
names them) and the segment is rewritten without it, so a spool never stops the API starting.

Records:
  ``S`` state   the registration, environments, ``started`` and the delivered step (JSON);
                written at the head of every segment and whenever the registration changes.
  ``E`` env     ``{"i": index, "env": {...}}``: one environment registered or changed (every
                segment starts with a full ``S``, so these never outlive it).
  ``G`` group   one accepted group (JSON header + raw arrays + passthrough fields as received),
                with its acceptance number ``seq`` and queue position ``qpos`` (-1: not yet in
                the queue).
  ``Q`` queued  ``[[seq, qpos], ...]``: groups that entered the queue (from a mixed-size buffer,
                or right after acceptance).
  ``A`` ack     ``{"seqs": [...], "step": N}``: a batch whose response was fully written (a
                shared-memory batch's also carries its ``batch_id``: a repeated
                acknowledgement after a restart is answered the same).

Replay rebuilds the queue (by ``qpos``) and the buffers from the groups not acknowledged; a
batch formed but not delivered before a crash goes back to the queue, so every accepted group is
served exactly once. Compaction: a segment is deleted as soon as none of its groups is still
held; when the spool grows past twice the live data (and a few segments), the live groups of the
oldest segment are copied to the active one and the oldest is deleted — nothing is rewritten in
place. Records reach the kernel (``os.write``) before the client is answered, so a killed API
loses nothing; ``fsync = True`` (``[api] spool_fsync``) also syncs each write for power loss.
Creating and deleting a segment syncs the directory.
"""

from __future__ import annotations

import fcntl
import os
import re
import struct
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from atroposd.api.schema import EnvRegistration, Group, Ragged, TrainerRegistration
from atroposd.fsutil import fsync_dir, write_atomic
from atroposd.logs import get_logger

__all__ = ["Spool", "SpoolError", "SpoolState"]

_FRAME = struct.Struct("<IIc")
_HEADER_LEN = struct.Struct("<I")
_SEGMENT = re.compile(r"^seg-(\d{8})\.log$")
_KINDS = frozenset((b"S", b"E", b"G", b"Q", b"A"))
BAD_DIR = "bad"  # damaged bytes and records that cannot be replayed, kept for a post-mortem
log = get_logger("api.spool")
ACKED_IDS_KEPT = 1024


class SpoolError(RuntimeError):
    """The spool cannot be used (locked by another process, unreadable)."""


@dataclass
class SpoolState:
    """What a replay recovered."""

    registration: TrainerRegistration | None = None
    started: bool = False
    step: int = 0
    envs: list[EnvRegistration] = field(default_factory=list)
    queue: list[Group] = field(default_factory=list)
    buffers: dict[int, list[Group]] = field(default_factory=dict)
    next_seq: int = 0
    next_qpos: int = 0
    dropped_bytes: int = 0  # damaged bytes skipped (torn tails included)
    set_aside: int = 0  # damaged regions and records that could not be replayed, copied to bad/
    acked_batch_ids: list[str] = field(default_factory=list)  # shared-memory batches, newest last


@dataclass
class _Segment:
    number: int
    path: Path
    size: int = 0
    live: int = 0  # groups whose newest record is here and that are still held


# ----------------------------------------------------------------------------- record codec


def _frame(kind: bytes, payload: bytes) -> bytes:
    return _FRAME.pack(len(payload), zlib.crc32(payload, zlib.crc32(kind)), kind) + payload


def _encode_group(g: Group) -> bytes:
    arrays: list[np.ndarray] = [g.tokens.flat, g.masks.flat, g.scores]
    # Passthrough fields go after the arrays as the bytes received: a replay never re-encodes them.
    header: dict[str, Any] = {
        "seq": g.seq,
        "qpos": g.qpos,
        "env_id": g.env_id,
        "b": g.tokens.bounds,
        "t": g.tokens.flat.dtype.str,
        "m": g.masks.flat.dtype.str,
        "xl": [[k, len(v)] for k, v in g.extras.items()],
    }
    for key, ragged in (("lp", g.logprobs), ("adv", g.advantages), ("ref", g.ref_logprobs)):
        if ragged is not None:
            header[key] = ragged.bounds
            arrays.append(ragged.flat)
    head = orjson.dumps(header)
    return _frame(
        b"G", b"".join([_HEADER_LEN.pack(len(head)), head, *(a.tobytes() for a in arrays), *g.extras.values()])
    )


def _decode_group(payload: bytes) -> Group:
    (hlen,) = _HEADER_LEN.unpack_from(payload)
    header = orjson.loads(payload[4 : 4 + hlen])
    offset = 4 + hlen
    bounds: list[int] = header["b"]

    def take(dtype: str, count: int) -> np.ndarray:
        nonlocal offset
        dt = np.dtype(dtype)
        a = np.frombuffer(payload, dtype=dt, count=count, offset=offset)
        offset += count * dt.itemsize
        return a

    tokens = Ragged(take(header["t"], bounds[-1]), bounds)
    masks = Ragged(take(header["m"], bounds[-1]), bounds)
    scores = take("<f8", len(bounds) - 1)
    extra: dict[str, Ragged | None] = {}
    for key in ("lp", "adv", "ref"):
        b = header.get(key)
        extra[key] = Ragged(take("<f8", b[-1]), b) if b is not None else None
    kept: dict[str, bytes] = {}
    if "xl" in header:
        for name, size in header["xl"]:
            kept[str(name)] = payload[offset : offset + size]
            offset += size
    else:  # written before passthrough fields were kept as received
        kept = {k: orjson.dumps(v) for k, v in header["x"].items()}
    if offset != len(payload):
        raise ValueError(f"group record of {len(payload)} bytes holds {offset}")
    g = Group(
        tokens=tokens,
        masks=masks,
        scores=scores,
        logprobs=extra["lp"],
        advantages=extra["adv"],
        ref_logprobs=extra["ref"],
        extras=kept,
        env_id=header["env_id"],
        seq=int(header["seq"]),
        qpos=int(header["qpos"]),
    )
    if g.n < 1 or g.masks.bounds != bounds or (g.env_id is not None and not isinstance(g.env_id, int)):
        raise ValueError("group record does not hold a valid group")
    return g


def _frame_at(data: bytes, pos: int, *, resync: bool = False) -> int:
    """The end of a valid frame starting at ``pos``, or -1. While resynchronising after damage,
    a cheap test comes first: the bytes after the candidate must start another frame (or end)."""
    if pos + _FRAME.size > len(data):
        return -1
    length, crc, kind = _FRAME.unpack_from(data, pos)
    end: int = pos + _FRAME.size + length
    if kind not in _KINDS or end > len(data):
        return -1
    if resync and end + _FRAME.size <= len(data) and data[end + 8 : end + 9] not in _KINDS:
        return -1
    if zlib.crc32(data[pos + _FRAME.size : end], zlib.crc32(kind)) != crc:
        return -1
    return end


def _read_records(data: bytes) -> tuple[list[tuple[bytes, bytes, int, int]], list[tuple[int, int]]]:
    """(records as (type, payload, offset, framed size), damaged regions as (offset, end)). After
    damage the scan resynchronises at the next offset where a valid frame starts."""
    records: list[tuple[bytes, bytes, int, int]] = []
    bad: list[tuple[int, int]] = []
    pos = 0
    while pos < len(data):
        end = _frame_at(data, pos)
        if end < 0:
            start = pos
            pos += 1
            while pos < len(data) and _frame_at(data, pos, resync=True) < 0:
                pos += 1
            bad.append((start, pos))
            continue
        records.append((data[pos + 4 + 4 : pos + 9], data[pos + _FRAME.size : end], pos, end - pos))
        pos = end
    return records, bad


# ----------------------------------------------------------------------------- spool


class Spool:
    def __init__(
        self, directory: str | os.PathLike[str], *, segment_bytes: int = 32 << 20, fsync: bool = False
    ) -> None:
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self._segments: list[_Segment] = []
        self._where: dict[int, tuple[_Segment, int]] = {}  # seq -> (segment, record size)
        self._groups: dict[int, Group] = {}  # held groups by seq (for compaction)
        self._live_bytes = 0
        self._state: dict[str, Any] = {}
        self._fd = -1
        self._lock_fd = -1
        self._next_number = 0
        self._state_segment: _Segment | None = None  # holds the newest state record
        self.write_errors = 0
        self.ack_failures = 0  # acknowledgements not written (their groups replay after a crash)
        self.set_aside = 0  # damaged regions and unreplayable records set aside at open

    # ------------------------------------------------------------------ open / replay

    def open(self) -> SpoolState:
        """Lock the directory, replay every segment, and start a new active segment."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock()
        state = self._replay()
        self._start_segment()
        log.info(
            "spool replayed",
            dir=str(self.directory),
            queued_groups=len(state.queue),
            buffered_groups=sum(len(b) for b in state.buffers.values()),
            step=state.step,
            registered=state.registration is not None,
            segments=len(self._segments),
            dropped_bytes=state.dropped_bytes,
            set_aside=state.set_aside,
        )
        return state

    def _lock(self) -> None:
        fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SpoolError(f"spool {self.directory} is in use by another API process") from None
        self._lock_fd = fd

    def _segment_files(self) -> list[tuple[int, Path]]:
        found = []
        for p in self.directory.iterdir():
            m = _SEGMENT.match(p.name)
            if m:
                found.append((int(m.group(1)), p))
        return sorted(found)

    def _replay(self) -> SpoolState:
        groups: dict[int, Group] = {}
        snapshot: dict[str, Any] = {}
        step = 0
        max_seq = max_qpos = -1
        dropped = set_aside = 0
        acked_ids: list[str] = []
        for number, path in self._segment_files():
            seg = _Segment(number, path)
            data = path.read_bytes()
            records, damaged = _read_records(data)
            bad = [(start, data[start:end]) for start, end in damaged]
            dropped += sum(end - start for start, end in damaged)
            kept: list[bytes] = []
            self._segments.append(seg)
            self._next_number = number + 1
            for kind, payload, offset, size in records:
                try:
                    if kind == b"G":
                        g = _decode_group(payload)
                        old = self._where.get(g.seq)
                        if old is not None:
                            old[0].live -= 1
                        groups[g.seq] = g
                        self._where[g.seq] = (seg, size)
                        seg.live += 1
                        max_seq = max(max_seq, g.seq)
                        max_qpos = max(max_qpos, g.qpos)
                    elif kind == b"Q":
                        for seq, qpos in orjson.loads(payload):
                            if seq in groups:
                                groups[seq].qpos = int(qpos)
                            max_qpos = max(max_qpos, int(qpos))
                    elif kind == b"A":
                        ack = orjson.loads(payload)
                        for seq in ack["seqs"]:
                            self._forget(seq, groups)
                            max_seq = max(max_seq, int(seq))
                        step = int(ack["step"])
                        if isinstance(ack.get("batch_id"), str):
                            acked_ids.append(ack["batch_id"])
                    elif kind == b"S":
                        new = orjson.loads(payload)
                        if not isinstance(new, dict):
                            raise ValueError("state record is not an object")
                        snapshot = new
                        step = int(snapshot.get("step", step))
                    elif kind == b"E":
                        change = orjson.loads(payload)
                        envs = snapshot.setdefault("envs", [])
                        i = int(change["i"])
                        if not 0 <= i <= len(envs) or not isinstance(change["env"], dict):
                            raise ValueError(f"environment record {i} does not follow {len(envs)} environments")
                        if i == len(envs):
                            envs.append(change["env"])
                        else:
                            envs[i] = change["env"]
                except (ValueError, TypeError, KeyError, IndexError, orjson.JSONDecodeError) as exc:
                    log.error(
                        "spool record cannot be replayed; set aside",
                        segment=path.name,
                        offset=offset,
                        record=kind.decode(errors="replace"),
                        error=str(exc) or repr(exc),
                    )
                    bad.append((offset, data[offset : offset + size]))
                    continue
                kept.append(data[offset : offset + size])
            if bad:
                set_aside += len(bad)
                self._set_aside(path, bad)
                good = b"".join(kept)
                write_atomic(path, good, durable=True)
                seg.size = len(good)
            else:
                seg.size = len(data)
        self._groups = groups
        self._live_bytes = sum(size for _, size in self._where.values())
        try:
            state = self._rebuild(snapshot, step, groups, max_seq + 1, max_qpos + 1, dropped)
        except (ValueError, TypeError, KeyError) as exc:  # a state that does not describe a run
            log.error("spool state cannot be replayed; starting unregistered", error=str(exc) or repr(exc))
            set_aside += 1
            snapshot = {"step": step}
            state = self._rebuild(snapshot, step, groups, max_seq + 1, max_qpos + 1, dropped)
        self._state = snapshot
        state.set_aside = self.set_aside = set_aside
        state.acked_batch_ids = acked_ids[-ACKED_IDS_KEPT:]
        return state

    def _set_aside(self, path: Path, bad: list[tuple[int, bytes]]) -> None:
        """Copy damaged bytes to ``bad/`` before the segment is rewritten without them."""
        where = self.directory / BAD_DIR
        where.mkdir(mode=0o700, exist_ok=True)
        for offset, chunk in bad:
            target = where / f"{path.stem}-{offset:010d}.bad"
            write_atomic(target, chunk, durable=True)
            log.warning("spool bytes set aside", segment=path.name, offset=offset, bytes=len(chunk), copy=str(target))

    def _forget(self, seq: int, groups: dict[int, Group]) -> None:
        groups.pop(seq, None)
        where = self._where.pop(seq, None)
        if where is not None:
            where[0].live -= 1
            self._live_bytes -= where[1]

    @staticmethod
    def _rebuild(
        snapshot: dict[str, Any], step: int, groups: dict[int, Group], next_seq: int, next_qpos: int, dropped: int
    ) -> SpoolState:
        reg = snapshot.get("registration")
        envs = [EnvRegistration.from_saved(e) for e in snapshot.get("envs", [])]
        for i, e in enumerate(envs):
            e.registered_id = i
        state = SpoolState(
            registration=TrainerRegistration(**reg) if reg else None,
            started=bool(snapshot.get("started", False)),
            step=step,
            envs=envs,
            next_seq=next_seq,
            dropped_bytes=dropped,
        )
        queued = sorted((g for g in groups.values() if g.qpos >= 0), key=lambda g: g.qpos)
        for g in sorted((g for g in groups.values() if g.qpos < 0), key=lambda g: g.seq):
            env = envs[g.env_id] if g.env_id is not None and 0 <= g.env_id < len(envs) else None
            if env is not None and g.n != env.group_size:
                state.buffers.setdefault(env.registered_id, []).append(g)
            else:  # its queue entry was never recorded: it goes to the back of the queue
                g.qpos, next_qpos = next_qpos, next_qpos + 1
                queued.append(g)
        state.queue = queued
        state.next_qpos = next_qpos
        return state

    # ------------------------------------------------------------------ writing

    def _start_segment(self) -> None:
        number = self._next_number
        path = self.directory / f"seg-{number:08d}.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._sync_dir()
        self._next_number += 1
        old, self._fd = self._fd, fd
        self._segments.append(_Segment(number, path, size=os.fstat(fd).st_size))
        if old >= 0:
            os.close(old)
        self._write_state_record()

    def _write_state_record(self) -> None:
        self._append(_frame(b"S", orjson.dumps(self._state)))
        self._state_segment = self._active

    def _sync_dir(self) -> None:
        if self.fsync:
            fsync_dir(self.directory)

    @property
    def _active(self) -> _Segment:
        return self._segments[-1]

    def _append(self, data: bytes) -> None:
        """Write all of ``data`` or nothing (a partial write is cut off again)."""
        seg = self._active
        view = memoryview(data)
        try:
            while view:
                written = os.write(self._fd, view)
                view = view[written:]
            if self.fsync:
                os.fdatasync(self._fd)
        except OSError:
            self.write_errors += 1
            try:
                os.ftruncate(self._fd, seg.size)
            except OSError as exc:
                log.error("cannot cut a failed spool write off", segment=seg.path.name, error=str(exc))
            raise
        seg.size += len(data)

    def write_groups(self, groups: Sequence[Group]) -> None:
        """Append accepted groups (all or nothing); raises OSError (e.g. disk full)."""
        records = [_encode_group(g) for g in groups]
        self._append(b"".join(records))
        seg = self._active
        for g, rec in zip(groups, records, strict=True):
            self._where[g.seq] = (seg, len(rec))
            self._groups[g.seq] = g
            self._live_bytes += len(rec)
            seg.live += 1
        self._maybe_rotate()

    def write_queued(self, groups: Iterable[Group]) -> None:
        """Record queue entries; a failure only costs the exact queue order after a restart."""
        self._try(_frame(b"Q", orjson.dumps([[g.seq, g.qpos] for g in groups])), "queued")

    def write_ack(self, batch: Iterable[Group], step: int, batch_id: str | None = None) -> None:
        """Acknowledge a delivered batch and drop its groups from the spool."""
        seqs = [g.seq for g in batch]
        record: dict[str, Any] = {"seqs": seqs, "step": step}
        if batch_id is not None:
            record["batch_id"] = batch_id
        if not self._try(_frame(b"A", orjson.dumps(record)), "ack"):
            self.ack_failures += 1
        for seq in seqs:
            self._forget(seq, self._groups)
        self._state["step"] = step
        self._collect()

    def write_state(self, snapshot: dict[str, Any]) -> None:
        """Record registrations and flags; raises OSError (the change is then refused)."""
        previous, self._state = self._state, snapshot
        try:
            self._write_state_record()
        except OSError:
            self._state = previous
            raise
        self._maybe_rotate()

    def write_env(self, index: int, env: dict[str, Any]) -> None:
        """Record one environment registered or changed; raises OSError (the change is then
        refused)."""
        envs = list(self._state.get("envs", []))
        if index == len(envs):
            envs.append(env)
        else:
            envs[index] = env
        self._append(_frame(b"E", orjson.dumps({"i": index, "env": env})))
        self._state = {**self._state, "envs": envs}
        self._maybe_rotate()

    def _try(self, data: bytes, what: str) -> bool:
        try:
            self._append(data)
        except OSError as exc:
            # The groups are already accepted or delivered; refusing now would lose or repeat
            # them. After a crash this record's absence replays them (logged, counted).
            log.error("spool write failed", record=what, error=str(exc))
            return False
        return True

    def reset(self, snapshot: dict[str, Any]) -> None:
        """``/reset_data``: drop every segment and start again from ``snapshot``."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        for seg in self._segments:
            seg.path.unlink(missing_ok=True)
        self._sync_dir()
        self._segments = []
        self._where.clear()
        self._groups.clear()
        self._live_bytes = 0
        self._state = snapshot
        self._start_segment()

    # ------------------------------------------------------------------ compaction

    def _maybe_rotate(self) -> None:
        if self._active.size < self.segment_bytes:
            return
        try:
            self._start_segment()
        except OSError as exc:
            # What was just written is kept; the active segment grows until rotation succeeds.
            log.error("spool segment rotation failed", error=str(exc))
            return
        self._collect()

    def _collect(self) -> None:
        """Delete old segments that hold nothing live; copy the live groups of the oldest
        segment forward while the spool is much larger than what it keeps."""
        try:
            self._compact()
        except OSError as exc:
            # Nothing is lost: the old segment stays until a later compaction succeeds.
            log.error("spool compaction failed", error=str(exc))

    def _compact(self) -> None:
        while len(self._segments) > 1:
            oldest = self._segments[0]
            if oldest is self._state_segment:
                return
            if oldest.live > 0 and not self._too_big():
                return
            if oldest.live > 0:
                self._copy_forward(oldest)
            oldest.path.unlink(missing_ok=True)
            self._sync_dir()
            self._segments.pop(0)

    def _too_big(self) -> bool:
        total = sum(s.size for s in self._segments)
        return total > max(4 * self.segment_bytes, 2 * self._live_bytes)

    def _copy_forward(self, seg: _Segment) -> None:
        moving = [self._groups[seq] for seq, (s, _) in self._where.items() if s is seg]
        records = [_encode_group(g) for g in moving]
        self._append(b"".join(records))
        active = self._active
        for g, rec in zip(moving, records, strict=True):
            self._live_bytes += len(rec) - self._where[g.seq][1]
            self._where[g.seq] = (active, len(rec))
            active.live += 1
        seg.live = 0

    # ------------------------------------------------------------------ info / close

    def stats(self) -> dict[str, Any]:
        return {
            "segments": len(self._segments),
            "bytes": sum(s.size for s in self._segments),
            "live_bytes": self._live_bytes,
            "live_groups": len(self._where),
            "write_errors": self.write_errors,
            "ack_failures": self.ack_failures,
            "set_aside": self.set_aside,
        }

    def segments(self) -> Iterator[Path]:
        return (s.path for s in self._segments)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

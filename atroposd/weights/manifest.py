"""The weight manifest: what the trainer exported, where, and by whom.

A manifest is one JSON file, ``{weights_dir}/manifest-<nonce>.json`` (mode 0600, written to a
temporary name and renamed), describing every exported tensor of one export:

```
{"format": 1, "nonce": "<daemon nonce>", "exporter_pid": 4242, "exporter_start_time": 268735,
 "export_id": 3, "weight_version": 17, "transport": "shm" | "cuda_ipc", "created_at": 1.7e9,
 "segments": [{"index": 0, "name": "atroposd-<nonce>-<tag>-0", "size": 1327104, "handle": null,
               "device_uuid": null}],
 "tensors": [{"name": "model.embed_tokens.weight", "dtype": "float32", "shape": [22, 128],
              "stride": [128, 1], "segment": 0, "offset": 0, "nbytes": 11264,
              "checksum": 0.123}],
 "tied": {"lm_head.weight": "model.embed_tokens.weight"},
 "lora": null,
 "bucket": null}
```

A **bucket** manifest (``"bucket": {"index": i, "count": n}``, the bucketed push of several
trainer ranks) describes part of the model: bucket ``i`` of the ``n`` that together hold every
tensor once. Its ``tied`` map is the whole model's (an alias's tensor may lie in another
bucket); the importer checks each tensor the bucket names (known, same dtype and shape) and,
at the last bucket, that the ``n`` buckets covered every tensor of its model
(``Manifest.check_bucket``, ``weights/receiver.py``).

The importer checks all of it before it touches memory (``Manifest.load`` + ``check_against``):
the nonce is the one it was started with, the exporter (pid + start time) is alive, the file
is owned by this user and not readable by others, every dtype is in ``ALLOWED_DTYPES`` and
equal to the importer's own, every shape equals the importer's, every tensor lies inside its
segment, no tensor is missing and none is extra. Any mismatch raises :class:`ManifestError`
naming the tensor. Nothing is zero-filled, skipped or looked up anywhere else.
"""

from __future__ import annotations

import base64
import math
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from atroposd import pids
from atroposd.fsutil import write_atomic

__all__ = [
    "ALLOWED_DTYPES",
    "FORMAT_VERSION",
    "BucketRef",
    "CudaIpcHandle",
    "Manifest",
    "ManifestError",
    "SegmentRef",
    "TensorEntry",
    "TensorSpec",
    "manifest_path",
    "match_tensors",
    "process_start_time",
    "staging_manifest_path",
]

FORMAT_VERSION = 1
ALLOWED_DTYPES = ("float32", "bfloat16", "float16")
NONCE_RE = re.compile(r"^[A-Za-z0-9_-]{4,64}$")
# A shm segment's name after ``atroposd-<nonce>-`` (atroposd.weights.shm.segment_name).
SEGMENT_TAIL_RE = re.compile(r"^[0-9a-f]{16}-[0-9]+$")
# Tensors start on this boundary inside a segment (cache line; enough for every allowed dtype).
ALIGNMENT = 64
MAX_MANIFEST_BYTES = 64 * 1024 * 1024


class ManifestError(ValueError):
    """A manifest that must not be used; the message names the tensor or field at fault."""


@dataclass(frozen=True)
class CudaIpcHandle:
    """The fields of torch's CUDA IPC export of one flat ``uint8`` buffer
    (``torch.multiprocessing.reductions.reduce_tensor``), carried as plain JSON values: the
    manifest holds no pickle. The importer supplies the classes itself (``torch.Tensor``,
    ``TypedStorage``, ``uint8``) and its own index of the GPU named by ``device_uuid``."""

    numel: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool

    _INTS = ("numel", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset")

    def to_dict(self) -> dict[str, Any]:
        return {
            "numel": self.numel,
            "storage_handle": _b64(self.storage_handle),
            "storage_size_bytes": self.storage_size_bytes,
            "storage_offset_bytes": self.storage_offset_bytes,
            "ref_counter_handle": _b64(self.ref_counter_handle),
            "ref_counter_offset": self.ref_counter_offset,
            "event_handle": _b64(self.event_handle) if self.event_handle is not None else None,
            "event_sync_required": self.event_sync_required,
        }

    @classmethod
    def from_dict(cls, raw: object, what: str) -> CudaIpcHandle:
        fields = (
            "numel",
            "storage_handle",
            "storage_size_bytes",
            "storage_offset_bytes",
            "ref_counter_handle",
            "ref_counter_offset",
            "event_handle",
            "event_sync_required",
        )
        if not isinstance(raw, dict) or set(raw) != set(fields):
            raise ManifestError(
                f"{what}: a CUDA IPC handle must be an object with exactly the fields {', '.join(fields)}"
            )
        for key in cls._INTS:
            if _int(raw[key], f"{what} {key}") < 0:
                raise ManifestError(f"{what} {key} must be ≥ 0")
        if not isinstance(raw["event_sync_required"], bool):
            raise ManifestError(f"{what} event_sync_required must be true or false")
        event = raw["event_handle"]
        return cls(
            numel=raw["numel"],
            storage_handle=_unb64(raw["storage_handle"], f"{what} storage_handle"),
            storage_size_bytes=raw["storage_size_bytes"],
            storage_offset_bytes=raw["storage_offset_bytes"],
            ref_counter_handle=_unb64(raw["ref_counter_handle"], f"{what} ref_counter_handle"),
            ref_counter_offset=raw["ref_counter_offset"],
            event_handle=_unb64(event, f"{what} event_handle") if event is not None else None,
            event_sync_required=raw["event_sync_required"],
        )


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(value: object, what: str) -> bytes:
    if not isinstance(value, str):
        raise ManifestError(f"{what} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        raise ManifestError(f"{what} is not valid base64") from None


@dataclass(frozen=True)
class SegmentRef:
    """One exported flat buffer: a POSIX shm segment (``name``) or a CUDA IPC handle."""

    index: int
    name: str
    size: int
    # CUDA IPC only: the export's fields, and the physical GPU.
    handle: CudaIpcHandle | None = None
    device_uuid: str | None = None


@dataclass(frozen=True)
class TensorEntry:
    """One tensor inside a segment: ``nbytes`` bytes at ``offset``, contiguous ``shape``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    segment: int
    offset: int
    nbytes: int
    # float64 sum of the first CHECKSUM_ELEMENTS elements at export time (None: not recorded).
    checksum: float | None = None


@dataclass(frozen=True)
class BucketRef:
    """Bucket ``index`` of the ``count`` buckets of one bucketed push."""

    index: int
    count: int


@dataclass(frozen=True)
class TensorSpec:
    """What the importer expects of a tensor: its own dtype name and shape."""

    dtype: str
    shape: tuple[int, ...]


def process_start_time(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (:func:`atroposd.pids.start_ticks`:
    no clock step moves it), or None when it does not exist."""
    return pids.start_ticks(pid)


def exporter_alive(pid: int, start_time: int) -> bool:
    """True when ``pid`` runs and started at ``start_time`` (so it is not a recycled pid)."""
    return pids.same_process(pid, start_time) is not None


def manifest_path(weights_dir: Path, nonce: str) -> Path:
    if not NONCE_RE.match(nonce):
        raise ManifestError(f"invalid nonce {nonce!r}: expected 4-64 letters, digits, '_' or '-'")
    return weights_dir / f"manifest-{nonce}.json"


def staging_manifest_path(weights_dir: Path, nonce: str) -> Path:
    """The host-staging buffer's manifest of a push (SPEC §7), written while the exported
    buffers' own manifest serves the replicas that copy from them directly."""
    return manifest_path(weights_dir, nonce).with_name(f"manifest-{nonce}-staging.json")


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride: list[int] = []
    acc = 1
    for dim in reversed(shape):
        stride.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(stride))


def itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


@dataclass(frozen=True)
class Manifest:
    nonce: str
    exporter_pid: int
    exporter_start_time: int  # clock ticks since boot (process_start_time)
    export_id: int
    weight_version: int
    transport: str
    segments: tuple[SegmentRef, ...]
    tensors: tuple[TensorEntry, ...]
    tied: Mapping[str, str] = field(default_factory=dict)
    # LoRA structure the importer must reproduce (r, alpha, targets); None for a full model.
    lora: Mapping[str, Any] | None = None
    created_at: float = 0.0
    # A bucket of a bucketed push (part of the model); None: the whole model.
    bucket: BucketRef | None = None
    format: int = FORMAT_VERSION

    # ------------------------------------------------------------------ (de)serialisation

    def to_json(self) -> bytes:
        data = {
            "format": self.format,
            "nonce": self.nonce,
            "exporter_pid": self.exporter_pid,
            "exporter_start_time": self.exporter_start_time,
            "export_id": self.export_id,
            "weight_version": self.weight_version,
            "transport": self.transport,
            "created_at": self.created_at,
            "segments": [
                {
                    "index": s.index,
                    "name": s.name,
                    "size": s.size,
                    "handle": s.handle.to_dict() if s.handle is not None else None,
                    "device_uuid": s.device_uuid,
                }
                for s in self.segments
            ],
            "tensors": [
                {
                    "name": t.name,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "stride": list(t.stride),
                    "segment": t.segment,
                    "offset": t.offset,
                    "nbytes": t.nbytes,
                    "checksum": t.checksum,
                }
                for t in self.tensors
            ],
            "tied": dict(self.tied),
            "lora": dict(self.lora) if self.lora is not None else None,
            "bucket": {"index": self.bucket.index, "count": self.bucket.count} if self.bucket is not None else None,
        }
        return orjson.dumps(data)

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ManifestError(f"manifest is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ManifestError("manifest must be a JSON object")
        try:
            if data.get("format") != FORMAT_VERSION:
                raise ManifestError(f"unsupported manifest format {data.get('format')!r} (expected {FORMAT_VERSION})")
            segments = tuple(
                SegmentRef(
                    index=_int(s["index"], "segment index"),
                    name=str(s["name"]),
                    size=_int(s["size"], f"segment {s['name']} size"),
                    handle=(
                        CudaIpcHandle.from_dict(s["handle"], f"segment {s['name']} handle")
                        if s.get("handle") is not None
                        else None
                    ),
                    device_uuid=_opt_str(s.get("device_uuid"), f"segment {s['name']} device_uuid"),
                )
                for s in data["segments"]
            )
            tensors = tuple(
                TensorEntry(
                    name=str(t["name"]),
                    dtype=str(t["dtype"]),
                    shape=tuple(_int(d, f"{t['name']} shape") for d in t["shape"]),
                    stride=tuple(_int(d, f"{t['name']} stride") for d in t["stride"]),
                    segment=_int(t["segment"], f"{t['name']} segment"),
                    offset=_int(t["offset"], f"{t['name']} offset"),
                    nbytes=_int(t["nbytes"], f"{t['name']} nbytes"),
                    checksum=t.get("checksum"),
                )
                for t in data["tensors"]
            )
            tied = data.get("tied") or {}
            if not isinstance(tied, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in tied.items()
            ):
                raise ManifestError("'tied' must map tensor names to tensor names")
            raw_bucket = data.get("bucket")
            bucket = None
            if raw_bucket is not None:
                if not isinstance(raw_bucket, dict) or set(raw_bucket) != {"index", "count"}:
                    raise ManifestError("'bucket' must be an object with exactly the fields index, count")
                bucket = BucketRef(_int(raw_bucket["index"], "bucket index"), _int(raw_bucket["count"], "bucket count"))
            return cls(
                nonce=str(data["nonce"]),
                exporter_pid=_int(data["exporter_pid"], "exporter_pid"),
                exporter_start_time=_int(data["exporter_start_time"], "exporter_start_time"),
                export_id=_int(data["export_id"], "export_id"),
                weight_version=_int(data["weight_version"], "weight_version"),
                transport=str(data["transport"]),
                segments=segments,
                tensors=tensors,
                tied=tied,
                lora=data.get("lora"),
                created_at=float(data.get("created_at", 0.0)),
                bucket=bucket,
            )
        except (KeyError, TypeError) as exc:
            raise ManifestError(f"manifest is missing or mistypes a field: {exc!r}") from None

    def write(self, path: Path) -> None:
        """Write atomically (temporary file, rename), mode 0600."""
        write_atomic(path, self.to_json())

    @classmethod
    def load(
        cls,
        path: Path,
        *,
        expected_nonce: str,
        weights_dir: Path,
        exporter_alive: Callable[[int, int], bool] = exporter_alive,
    ) -> Manifest:
        """Read and check a manifest's provenance: location, owner, mode, nonce, live exporter.

        ``path`` must be exactly ``weights_dir/manifest-<expected_nonce>.json`` (or the push's
        host-staging manifest, ``manifest-<expected_nonce>-staging.json``): an importer never
        searches for a manifest and never accepts one of another launch.
        """
        expected = manifest_path(weights_dir, expected_nonce)
        staged = staging_manifest_path(weights_dir, expected_nonce)
        if Path(os.path.abspath(path)) not in (Path(os.path.abspath(expected)), Path(os.path.abspath(staged))):
            raise ManifestError(f"manifest path {path} is not this launch's manifest ({expected})")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ManifestError(f"manifest {path} does not exist") from None
        except OSError as exc:
            raise ManifestError(f"cannot open manifest {path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ManifestError(f"manifest {path} is not a regular file")
            if st.st_uid != os.geteuid():
                raise ManifestError(f"manifest {path} is owned by uid {st.st_uid}, not by this user")
            if st.st_mode & 0o077:
                raise ManifestError(f"manifest {path} has mode {stat.S_IMODE(st.st_mode):o}; expected 0600")
            if st.st_size > MAX_MANIFEST_BYTES:
                raise ManifestError(f"manifest {path} is {st.st_size} bytes (limit {MAX_MANIFEST_BYTES})")
            with os.fdopen(fd, "rb", closefd=False) as fh:
                raw = fh.read()
        finally:
            os.close(fd)
        manifest = cls.from_json(raw)
        if manifest.nonce != expected_nonce:
            raise ManifestError(
                f"manifest nonce {manifest.nonce!r} is not this launch's ({expected_nonce!r}): stale manifest refused"
            )
        if not exporter_alive(manifest.exporter_pid, manifest.exporter_start_time):
            raise ManifestError(
                f"manifest exporter pid {manifest.exporter_pid} (started "
                f"{manifest.exporter_start_time}) is not alive: stale manifest refused"
            )
        manifest.check_layout()
        return manifest

    # ------------------------------------------------------------------ validation

    def check_layout(self) -> None:
        """Internal consistency: names unique, dtypes allowed, sizes and bounds right."""
        if self.transport not in ("shm", "cuda_ipc"):
            raise ManifestError(f"unknown transport {self.transport!r}")
        prefix = f"atroposd-{self.nonce}-"
        seg_by_index: dict[int, SegmentRef] = {}
        for seg in self.segments:
            if seg.index in seg_by_index:
                raise ManifestError(f"segment index {seg.index} appears twice")
            if self.transport == "shm" and (
                not seg.name.startswith(prefix) or not SEGMENT_TAIL_RE.match(seg.name[len(prefix) :])
            ):
                raise ManifestError(f"segment name {seg.name!r} is not of the form {prefix}<tag>-<n>")
            if self.transport == "cuda_ipc" and (seg.handle is None or not seg.device_uuid):
                raise ManifestError(f"segment {seg.index} has no CUDA IPC handle or no device_uuid")
            if self.transport == "cuda_ipc" and seg.handle is not None and seg.handle.numel < seg.size:
                raise ManifestError(
                    f"segment {seg.index}: its CUDA buffer holds {seg.handle.numel} bytes; the manifest says {seg.size}"
                )
            if seg.size <= 0:
                raise ManifestError(f"segment {seg.name!r} has size {seg.size}")
            seg_by_index[seg.index] = seg
        seen: set[str] = set()
        for t in self.tensors:
            if t.name in seen:
                raise ManifestError(f"tensor {t.name!r} appears twice")
            seen.add(t.name)
            if t.dtype not in ALLOWED_DTYPES:
                raise ManifestError(
                    f"tensor {t.name!r}: dtype {t.dtype!r} is not allowed (allowed: {', '.join(ALLOWED_DTYPES)})"
                )
            if any(d < 0 for d in t.shape):
                raise ManifestError(f"tensor {t.name!r}: negative dimension in shape {list(t.shape)}")
            if t.stride != contiguous_stride(t.shape):
                raise ManifestError(
                    f"tensor {t.name!r}: stride {list(t.stride)} is not the contiguous stride of shape {list(t.shape)}"
                )
            numel = math.prod(t.shape)
            if t.nbytes != numel * itemsize(t.dtype):
                raise ManifestError(
                    f"tensor {t.name!r}: nbytes {t.nbytes} != {numel} elements × {itemsize(t.dtype)} bytes"
                )
            found = seg_by_index.get(t.segment)
            if found is None:
                raise ManifestError(f"tensor {t.name!r}: segment {t.segment} is not in the manifest")
            seg = found
            if t.offset < 0 or t.offset % itemsize(t.dtype):
                raise ManifestError(f"tensor {t.name!r}: offset {t.offset} is not aligned")
            if t.offset + t.nbytes > seg.size:
                raise ManifestError(
                    f"tensor {t.name!r}: bytes [{t.offset}, {t.offset + t.nbytes}) lie outside "
                    f"segment {seg.name!r} of {seg.size} bytes"
                )
        if self.bucket is not None and not 0 <= self.bucket.index < self.bucket.count:
            raise ManifestError(f"bucket index {self.bucket.index} is not in [0, {self.bucket.count})")
        for alias, target in self.tied.items():
            if alias in seen:
                raise ManifestError(f"tied alias {alias!r} is also exported as a tensor")
            if self.bucket is None and target not in seen:  # a bucket's alias may point into another bucket
                raise ManifestError(f"tied alias {alias!r} points at {target!r}, which is not exported")

    def check_against(self, expected: Mapping[str, TensorSpec], tied: Mapping[str, str]) -> dict[str, str]:
        """Every expected tensor present with the same dtype and shape; nothing extra.

        ``expected`` is the importer's own canonical tensors, ``tied`` its aliases. Returns
        importer name → exported name (an importer that does not tie what the exporter ties
        re-ties by mapping both names onto the one exported tensor).
        """
        if self.bucket is not None:
            raise ManifestError(
                f"bucket {self.bucket.index} of {self.bucket.count} holds part of the model; "
                "it is copied bucket by bucket, never attached or taken as the whole model"
            )
        exported = {t.name: TensorSpec(t.dtype, tuple(t.shape)) for t in self.tensors}
        return match_tensors(exported, self.tied, expected, tied)

    def check_bucket(self, expected: Mapping[str, TensorSpec], tied: Mapping[str, str]) -> dict[str, str]:
        """A bucket's tensors against the importer's: each one known (not tied by the importer to
        another one), same dtype and shape. Returns importer name → exported name for the
        importer's tensors this bucket fills; the rest come in the other buckets."""
        if self.bucket is None:
            raise ManifestError("not a bucket manifest")
        exported = {t.name: TensorSpec(t.dtype, tuple(t.shape)) for t in self.tensors}
        return match_tensors(exported, self.tied, expected, tied, partial=True)

    def entry(self, name: str) -> TensorEntry:
        index: dict[str, TensorEntry] | None = self.__dict__.get("_entries")
        if index is None:
            index = {t.name: t for t in self.tensors}
            object.__setattr__(self, "_entries", index)  # a cache on a frozen dataclass
        try:
            return index[name]
        except KeyError:
            raise ManifestError(f"tensor {name!r} is not in the manifest") from None

    def segment(self, index: int) -> SegmentRef:
        for seg in self.segments:
            if seg.index == index:
                return seg
        raise ManifestError(f"segment {index} is not in the manifest")


def match_tensors(
    exported: Mapping[str, TensorSpec],
    exported_tied: Mapping[str, str],
    mine: Mapping[str, TensorSpec],
    my_tied: Mapping[str, str],
    *,
    partial: bool = False,
) -> dict[str, str]:
    """Check an export against the importer's own tensors; return importer name → exported name.

    Every canonical tensor of the importer must be exported (directly, or as an alias the
    exporter ties) with the same dtype and shape; the export must hold nothing the importer
    lacks, and nothing the importer ties but the exporter keeps separate.
    ``partial``: ``exported`` is one bucket of the model: an importer tensor it does not hold
    is not a problem (another bucket holds it), only what it holds is checked.
    Raises ManifestError listing every problem, each naming its tensor.
    """
    source: dict[str, str] = {}
    problems: list[str] = []
    for name, spec in mine.items():
        src = name if name in exported else exported_tied.get(name)
        if src is None or src not in exported:
            if not partial:
                problems.append(f"tensor {name!r} is missing from the export")
            continue
        got = exported[src]
        if got.dtype != spec.dtype:
            problems.append(f"tensor {name!r}: dtype {got.dtype} != the importer's {spec.dtype}")
        if tuple(got.shape) != tuple(spec.shape):
            problems.append(f"tensor {name!r}: shape {list(got.shape)} != the importer's {list(spec.shape)}")
        source[name] = src
    for name in exported:
        if name in my_tied:
            problems.append(f"tensor {name!r} is exported on its own but the importer ties it to {my_tied[name]!r}")
        elif name not in mine:
            problems.append(f"tensor {name!r} is in the export but not in the importer's model")
    if problems:
        raise ManifestError("weights do not match the model: " + "; ".join(problems))
    return source


def _opt_str(value: object, what: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ManifestError(f"{what} must be a string, got {value!r}")
    return value


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ManifestError(f"{what} must be an integer, got {value!r}")
    return value

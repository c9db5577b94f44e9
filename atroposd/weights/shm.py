"""POSIX shared-memory segments without Python's resource tracker.

Segments are named ``atroposd-<nonce>-<tag>-<n>`` (``/dev/shm/atroposd-...`` on Linux; ``tag``
is random, one per export, so the names cannot be guessed from the nonce), created
with ``O_CREAT | O_EXCL`` and mode 0600, sized up front with ``ftruncate`` and mapped with
``mmap`` directly. ``multiprocessing.shared_memory`` is not used: on Python 3.11 its resource
tracker unlinks a segment when *any* process that attached to it exits, which would let a
killed inference server take the trainer's weights with it.

The creator (the trainer) maps read-write and is the only one that unlinks. An importer either
maps read-only (``shared`` mode: the inference model computes on views of the mapping) or
reads through the file descriptor without mapping anything (``read_into``, ``push`` mode), so
a sync leaves no mapping behind.
"""

from __future__ import annotations

import mmap
import os
import secrets
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from atroposd.logs import get_logger
from atroposd.shmscan import SegmentCheckError, check_private_segment, mapped_shm
from atroposd.weights.manifest import NONCE_RE, SEGMENT_TAIL_RE

try:  # The POSIX shm_open/shm_unlink pair; CPython ships it on every POSIX platform.
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

__all__ = [
    "SEGMENT_PREFIX",
    "ShmError",
    "ShmSegment",
    "cleanup_stale",
    "list_segments",
    "mapped_segments",
    "read_into",
    "segment_name",
    "segment_nonce",
    "segment_tag",
]

log = get_logger(__name__)

SEGMENT_PREFIX = "atroposd-"
SHM_DIR = Path("/dev/shm")
# read_into splits large reads across threads (the kernel copy runs without the GIL).
_READ_THREADS = 2
_PARALLEL_MIN_BYTES = 8 * 1024 * 1024


class ShmError(OSError):
    """A segment that cannot be created, opened or trusted."""


def segment_tag() -> str:
    """The unpredictable part of an export's segment names (64 random bits)."""
    return secrets.token_hex(8)


def segment_name(nonce: str, index: int, tag: str | None = None) -> str:
    """``atroposd-<nonce>-<tag>-<index>``. The nonce is in every child's environment and argv
    (``ps`` shows it), so the name also carries ``tag`` (default: a fresh :func:`segment_tag`;
    one per export): another user cannot create the names first and block the export."""
    return f"{SEGMENT_PREFIX}{nonce}-{tag if tag is not None else segment_tag()}-{index}"


def segment_nonce(name: str) -> str | None:
    """The launch nonce of a segment name, or None when the name is not of our form."""
    if not name.startswith(SEGMENT_PREFIX):
        return None
    parts = name[len(SEGMENT_PREFIX) :].rsplit("-", 2)
    if len(parts) != 3 or not SEGMENT_TAIL_RE.match(f"{parts[1]}-{parts[2]}"):
        return None
    return parts[0]


def _shm_open(name: str, flags: int, mode: int = 0o600) -> int:
    if _posixshmem is not None:
        return int(_posixshmem.shm_open("/" + name, flags | os.O_CLOEXEC, mode))
    return os.open(SHM_DIR / name, flags | os.O_CLOEXEC | os.O_NOFOLLOW, mode)  # pragma: no cover


def _shm_unlink(name: str) -> None:
    if _posixshmem is not None:
        _posixshmem.shm_unlink("/" + name)
    else:  # pragma: no cover
        os.unlink(SHM_DIR / name)


def _check_fd(fd: int, name: str, min_size: int) -> int:
    try:
        return check_private_segment(fd, name, min_size)
    except SegmentCheckError as exc:
        raise ShmError(str(exc)) from None


class ShmSegment:
    """One mapped segment. ``view`` hands out tensors over the mapping.

    While any tensor from ``view`` is alive the mapping cannot be closed (``close`` raises
    ``ShmError`` naming the segment), so a mapping is never pulled from under a live tensor.
    """

    def __init__(self, name: str, size: int, mapping: mmap.mmap, *, owner: bool, writable: bool) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self.writable = writable
        self._mmap: mmap.mmap | None = mapping
        self._unlinked = False
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")
            probe = torch.frombuffer(mapping, dtype=torch.uint8, count=1)
        self._base = int(probe.data_ptr())
        del probe

    @classmethod
    def create(cls, name: str, size: int) -> ShmSegment:
        """Create ``name`` exclusively (mode 0600), size it and map it read-write."""
        if size <= 0:
            raise ShmError(f"segment {name!r}: size must be positive, got {size}")
        try:
            fd = _shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            raise ShmError(f"shared-memory segment {name!r} already exists") from None
        try:
            os.fchmod(fd, 0o600)  # the umask may have narrowed it further; never wider
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _shm_unlink(name)
            raise
        os.close(fd)
        return cls(name, size, mapping, owner=True, writable=True)

    @classmethod
    def attach(cls, name: str, size: int, *, writable: bool = False) -> ShmSegment:
        """Map an existing segment (read-only unless ``writable``); never unlinks it."""
        flags = os.O_RDWR if writable else os.O_RDONLY
        try:
            fd = _shm_open(name, flags)
        except FileNotFoundError:
            raise ShmError(f"shared-memory segment {name!r} does not exist") from None
        try:
            _check_fd(fd, name, size)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=prot)
        finally:
            os.close(fd)
        return cls(name, size, mapping, owner=False, writable=writable)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    @property
    def address(self) -> int:
        """The mapping's first byte (for ``cudaHostRegister``)."""
        return self._base

    def view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: Iterable[int]) -> torch.Tensor:
        """A tensor of ``shape`` over bytes ``[offset, offset + nbytes)`` of the mapping.

        Returns: a contiguous tensor of ``dtype`` and ``shape`` sharing the segment's memory.
        """
        if self._mmap is None:
            raise ShmError(f"segment {self.name!r} is closed")
        if offset < 0 or offset + nbytes > self.size:
            raise ShmError(f"segment {self.name!r}: bytes [{offset}, {offset + nbytes}) out of bounds ({self.size})")
        shape = tuple(shape)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():
            # A read-only mapping gives a tensor torch calls "not writable"; that is the point.
            warnings.filterwarnings("ignore", message=".*not writable.*")
            # Through a memoryview: the tensor keeps it, and it keeps the mapping exported,
            # so the mapping cannot be closed under a live tensor (BufferError).
            flat = torch.frombuffer(memoryview(self._mmap), dtype=torch.uint8, count=nbytes, offset=offset)
        return flat.view(dtype).view(shape)

    def owns(self, t: torch.Tensor) -> bool:
        """True when ``t``'s memory lies inside this mapping."""
        return self._mmap is not None and t.device.type == "cpu" and self._base <= t.data_ptr() < self._base + self.size

    def close(self) -> None:
        """Unmap. Raises ShmError if a tensor over the mapping is still alive."""
        if self._mmap is None:
            return
        try:
            self._mmap.close()
        except BufferError:
            raise ShmError(
                f"segment {self.name!r} is still referenced by live tensors; drop them before closing"
            ) from None
        self._mmap = None

    def unlink(self) -> None:
        """Remove the name (the creator only); existing mappings stay valid until unmapped."""
        if self._unlinked:
            return
        try:
            _shm_unlink(self.name)
        except FileNotFoundError:
            log.warning("shm segment already gone", segment=self.name)
        self._unlinked = True

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("rw" if self.writable else "ro")
        return f"ShmSegment({self.name!r}, {self.size}, {state})"


_MAP_POPULATE: int = getattr(mmap, "MAP_POPULATE", 0)


def read_into(name: str, size: int, targets: Iterable[tuple[int, torch.Tensor]]) -> int:
    """Copy bytes of segment ``name`` into CPU tensors without mapping it.

    targets: ``(offset, tensor)`` pairs; each contiguous tensor receives ``tensor.nbytes``
    bytes read from ``offset``. The kernel copies from the segment straight into the tensor
    (``preadv``), so nothing stays mapped and the descriptor is closed on return.
    Returns the number of bytes copied.
    """
    try:
        fd = _shm_open(name, os.O_RDONLY)
    except FileNotFoundError:
        raise ShmError(f"shared-memory segment {name!r} does not exist") from None
    try:
        _check_fd(fd, name, size)
        jobs: list[tuple[int, memoryview]] = []
        for offset, tensor in targets:
            if not tensor.is_contiguous() or tensor.device.type != "cpu":
                raise ShmError(f"read_into needs contiguous CPU tensors (segment {name!r})")
            nbytes = tensor.numel() * tensor.element_size()
            if offset < 0 or offset + nbytes > size:
                raise ShmError(f"segment {name!r}: bytes [{offset}, {offset + nbytes}) out of bounds ({size})")
            if nbytes:
                jobs.append((offset, _byte_view(tensor)))
        total = sum(len(mv) for _, mv in jobs)
        chunks = _split(jobs, _READ_THREADS if total >= _PARALLEL_MIN_BYTES else 1)
        if len(chunks) == 1:
            _pread_all(fd, name, chunks[0])
        else:
            with ThreadPoolExecutor(len(chunks)) as pool:
                list(pool.map(lambda c: _pread_all(fd, name, c), chunks))
        return total
    finally:
        os.close(fd)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


def _split(jobs: list[tuple[int, memoryview]], parts: int) -> list[list[tuple[int, memoryview]]]:
    """Cut the byte ranges into ``parts`` lists of about equal size."""
    total = sum(len(mv) for _, mv in jobs)
    if parts <= 1 or total == 0:
        return [jobs]
    target = -(-total // parts)
    out: list[list[tuple[int, memoryview]]] = [[]]
    room = target
    for offset, mv in jobs:
        pos = 0
        while pos < len(mv):
            take = min(room, len(mv) - pos)
            out[-1].append((offset + pos, mv[pos : pos + take]))
            pos += take
            room -= take
            if room == 0 and len(out) < parts:
                out.append([])
                room = target
    return [c for c in out if c]


def _pread_all(fd: int, name: str, jobs: list[tuple[int, memoryview]]) -> None:
    for offset, mv in jobs:
        done = 0
        while done < len(mv):
            got = os.preadv(fd, [mv[done:]], offset + done)
            if got <= 0:
                raise ShmError(f"segment {name!r}: short read at byte {offset + done}")
            done += got


def list_segments(prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Names of this user's shared-memory segments that start with ``prefix``."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:  # pragma: no cover - no /dev/shm
        return []
    mine = []
    for n in names:
        if not n.startswith(prefix):
            continue
        try:
            if os.stat(SHM_DIR / n, follow_symlinks=False).st_uid == os.geteuid():
                mine.append(n)
        except FileNotFoundError:
            continue
    return sorted(mine)


def mapped_segments(prefix: str = SEGMENT_PREFIX) -> dict[str, set[int]]:
    """Segment name → pids of this user's processes that map it (from ``/proc/*/maps``)."""
    return mapped_shm(prefix)


def cleanup_stale(runtime_dir: Path, is_alive: Callable[[str], bool]) -> list[str]:
    """Remove segments and manifests of launches that are no longer alive.

    ``is_alive(nonce)`` says whether the launch with that nonce still runs (the daemon knows
    its own nonce and the recorded pid + start time of earlier ones). Segments are found by
    their ``atroposd-<nonce>-<tag>-<n>`` names, manifests as ``{runtime_dir}/weights/manifest-<nonce>.json``
    (plus their temporary files). A segment that a live process still maps is kept whatever
    ``is_alive`` says (a second instance on this machine has its own records). Returns what was
    removed.
    """
    removed: list[str] = []
    verdict: dict[str, bool] = {}

    def alive(nonce: str) -> bool:
        if nonce not in verdict:
            verdict[nonce] = is_alive(nonce)
        return verdict[nonce]

    in_use = mapped_segments()
    for name in list_segments():
        nonce = segment_nonce(name)
        if nonce is None or not NONCE_RE.match(nonce) or alive(nonce):
            continue
        if name in in_use:
            # A live process still maps it (another instance, or a child not yet reaped):
            # its owner is not dead, whatever the records say.
            log.warning(
                "shm segment of an unknown launch is still mapped; kept", segment=name, pids=sorted(in_use[name])
            )
            continue
        try:
            _shm_unlink(name)
            removed.append(f"/dev/shm/{name}")
        except FileNotFoundError:
            continue
    weights_dir = runtime_dir / "weights"
    if weights_dir.is_dir():
        for path in sorted(weights_dir.iterdir()):
            fname = path.name
            if fname.startswith(".manifest-"):
                fname = fname[1:]
            if not fname.startswith("manifest-"):
                continue
            nonce = fname[len("manifest-") :].split(".", 1)[0]
            if alive(nonce):
                continue
            try:
                path.unlink()
                removed.append(str(path))
            except FileNotFoundError:
                continue
    if removed:
        log.info("removed weight-exchange leftovers of dead launches", removed=removed)
    return removed

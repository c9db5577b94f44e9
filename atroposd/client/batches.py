"""``BatchClient``: an external trainer's side of the trajectory API, in a few lines.

It registers as the trainer, fetches batches — through shared memory when the API runs on this
host, else as safetensors over HTTP, else as JSON (any run-api compatible server) — retries with
backoff across API restarts, and hands back a :class:`Batch` of numpy arrays whose names, shapes
and dtypes are those of SPEC §5 "Binary batches" (see :mod:`atroposd.api.binary`), whatever the
transport. No torch needed; ``Batch.torch()`` gives torch tensors when torch is installed.

What the server announces is not trusted with memory: no answer, inflated gzip stream,
shared-memory segment or JSON batch's layout larger than ``max_batch_bytes`` is taken (an
:class:`ApiError` instead, before anything is allocated for it). A token sent over plain HTTP to
a host other than this one is sent in clear text: the client warns once
(:class:`InsecureTokenWarning`).
"""

from __future__ import annotations

import mmap
import os
import time
import warnings
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar, overload
from urllib.parse import urlsplit

import numpy as np
import orjson

from atroposd.api.binary import CONTENT_TYPE, FORMAT, LayoutError, batch_arrays, decode
from atroposd.api.schema import MAX_DISTILL_K
from atroposd.client._http import BodyTooLarge, HttpConnection
from atroposd.net import is_loopback
from atroposd.shmscan import SegmentCheckError, check_private_segment

if TYPE_CHECKING:
    import torch

_D = TypeVar("_D")

try:
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

__all__ = ["TRANSPORTS", "ApiError", "Batch", "BatchClient", "InsecureTokenWarning", "default_max_batch_bytes"]

TRANSPORTS = ("auto", "shm", "safetensors", "json")
# Bytes per position of a batch at most: tokens, masks (int64), inference_logprobs, advantages,
# ref_logprobs (float32) and the distillation top-k (int64 + float32 each), plus the per-sequence
# arrays spread over a position.
_BYTES_PER_POSITION = 8 + 8 + 4 + 4 + 4 + 2 + 12 * MAX_DISTILL_K
_REST_BYTES = 1 << 30  # groups_json (messages, overrides, ...) and the header


def default_max_batch_bytes(batch_size: int, max_token_len: int) -> int:
    """The largest batch a registration can be served: every field laid out at ``max_token_len``
    with the largest teacher top-k, and 1 GiB for the rest (``groups_json``)."""
    return max(1, batch_size) * max(1, max_token_len) * _BYTES_PER_POSITION + _REST_BYTES


class InsecureTokenWarning(UserWarning):
    """The API's bearer token goes in clear text (plain HTTP) to another host."""


class ApiError(RuntimeError):
    """The API refused a request (a 4xx other than a missing registration), or stayed unreachable
    past the caller's deadline."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _Unreachable(OSError):
    """The API did not answer (refused, reset, timed out): try again after a pause."""


@dataclass
class Batch:
    """One batch of ``S`` sequences padded to ``L`` positions.

    Always: ``tokens`` int64 [S, L] (0 padding), ``masks`` int64 [S, L] (-100 padding and over
    prompts), ``inference_logprobs`` float32 [S, L] (1.0 padding and where a group sent none),
    ``lengths`` int64 [S], ``scores`` float32 [S], ``group_index`` int64 [S], ``env_id`` int64
    [S] (-1: none). When a group of the batch carries them: ``advantages`` / ``ref_logprobs``
    float32 [S, L] with ``has_advantages`` / ``has_ref_logprobs`` uint8 [S];
    ``distill_token_ids`` int64 [S, L, K] (-1 padding) and ``distill_logprobs`` float32
    [S, L, K]. ``groups``: per group, its other fields (``overrides``, ``group_overrides``,
    ``messages``, ...). The arrays are writable and the batch's own (a shared-memory batch is
    mapped copy-on-write: writing to it changes nothing elsewhere).
    """

    arrays: dict[str, np.ndarray]
    transport: str  # shm | safetensors | json: how it came
    batch_id: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def __contains__(self, name: object) -> bool:
        return name in self.arrays

    @overload
    def get(self, name: str) -> np.ndarray | None: ...
    @overload
    def get(self, name: str, default: _D) -> np.ndarray | _D: ...
    def get(self, name: str, default: object = None) -> object:
        return self.arrays.get(name, default)

    @property
    def tokens(self) -> np.ndarray:
        return self.arrays["tokens"]

    @property
    def masks(self) -> np.ndarray:
        return self.arrays["masks"]

    @property
    def inference_logprobs(self) -> np.ndarray:
        return self.arrays["inference_logprobs"]

    @property
    def lengths(self) -> np.ndarray:
        return self.arrays["lengths"]

    @property
    def scores(self) -> np.ndarray:
        return self.arrays["scores"]

    @property
    def group_index(self) -> np.ndarray:
        return self.arrays["group_index"]

    @property
    def env_id(self) -> np.ndarray:
        return self.arrays["env_id"]

    @property
    def sequences(self) -> int:
        return int(self.arrays["tokens"].shape[0])

    @cached_property
    def groups(self) -> list[dict[str, Any]]:
        """Per group, the fields not laid out as arrays (empty dicts when none)."""
        raw = self.arrays["groups_json"]
        return list(orjson.loads(raw.tobytes())) if raw.size else []

    def prompt_response(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Per sequence ``(prompt_ids, response_ids, response_logprobs, loss_mask)``, unpadded:
        the prompt is the tokens before the first position the mask trains on (the environment
        masks the prompt with -100); ``loss_mask`` is 1 where the mask is not -100 (a multi-turn
        response may hold tool output the environment masked too). The shape SkyRL's
        ``GeneratorOutput`` and verl's prompt / response split use."""
        out = []
        tokens, masks, lps, lengths = self.tokens, self.masks, self.inference_logprobs, self.lengths
        for i in range(tokens.shape[0]):
            n = int(lengths[i])
            trained = np.flatnonzero(masks[i, :n] != -100)
            start = int(trained[0]) if trained.size else n
            out.append(
                (tokens[i, :start], tokens[i, start:n], lps[i, start:n], (masks[i, start:n] != -100).astype(np.int64))
            )
        return out

    def torch(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """The arrays as torch tensors (sharing memory with the arrays on the CPU; copied to
        ``device`` when given). Needs torch."""
        import torch

        out = {}
        for name, a in self.arrays.items():
            if name == "groups_json":
                continue
            t = torch.from_numpy(a)
            out[name] = t.to(device) if device is not None else t
        return out


class BatchClient:
    """Register as the trainer and pull batches.

    ``url``: the API (``http://127.0.0.1:8000``). ``token``: its bearer token (default:
    ``$ATROPOSD_API_TOKEN``). ``batch_size`` (sequences per batch) and ``max_token_len`` go into
    the registration like the rest of run-api's ``/register`` fields. ``transport``: ``auto``
    (shared memory when the API's host is this one, else safetensors; JSON from a server that
    speaks only JSON), or one of ``shm``, ``safetensors``, ``json``. ``max_batch_bytes``: the
    largest answer or batch taken (default: :func:`default_max_batch_bytes` of the registration).
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        batch_size: int,
        max_token_len: int,
        num_steps: int = 0,
        starting_step: int = 0,
        transport: str = "auto",
        poll_interval: float = 0.05,
        max_backoff: float = 2.0,
        request_timeout: float = 120.0,
        wandb_group: str = "",
        wandb_project: str = "",
        checkpoint_dir: str = "",
        save_checkpoint_interval: int = 0,
        max_batch_bytes: int | None = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}")
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.url = url
        self._scheme, self._host, self._port = parts.scheme, parts.hostname, parts.port
        self._base = parts.path.rstrip("/")
        self.token = token if token is not None else os.environ.get("ATROPOSD_API_TOKEN", "")
        self.registration = {
            "wandb_group": wandb_group,
            "wandb_project": wandb_project,
            "batch_size": batch_size,
            "max_token_len": max_token_len,
            "checkpoint_dir": checkpoint_dir,
            "save_checkpoint_interval": save_checkpoint_interval,
            "starting_step": starting_step,
            "num_steps": num_steps,
        }
        local = is_loopback(self._host)
        self.transport = ("shm" if local else "safetensors") if transport == "auto" else transport
        self._gzip = not local
        self.poll_interval = poll_interval
        self.max_backoff = max_backoff
        self.request_timeout = request_timeout
        self.max_batch_bytes = (
            max_batch_bytes if max_batch_bytes is not None else default_max_batch_bytes(batch_size, max_token_len)
        )
        self._conn: HttpConnection | None = None
        self._registered = False
        self._clear_text = bool(self.token) and self._scheme == "http" and not local
        self._warned = False
        self.fallbacks: list[str] = []  # why the transport changed, if it did

    # ------------------------------------------------------------------ HTTP

    def _connection(self) -> HttpConnection:
        if self._conn is None:
            port = self._port or (443 if self._scheme == "https" else 80)
            self._conn = HttpConnection(
                self._host,
                port,
                tls=self._scheme == "https",
                timeout=self.request_timeout,
                max_body=self.max_batch_bytes,
            )
        return self._conn

    def _request(self, method: str, path: str, body: object = None) -> tuple[int, str, bytearray]:
        """(status, content type, body) of one request on the kept-alive connection."""
        headers = {"Accept-Encoding": "gzip" if self._gzip else "identity"}
        if self.token:
            if self._clear_text and not self._warned:
                self._warned = True
                warnings.warn(
                    f"sending the API's bearer token over plain HTTP to {self._host}, another host: "
                    "anyone on the network path can read it; use https:// or a trusted network",
                    InsecureTokenWarning,
                    stacklevel=4,
                )
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data = orjson.dumps(body)
            headers["Content-Type"] = "application/json"
        try:
            resp = self._connection().request(method, self._base + path, headers, data)
        except BodyTooLarge as exc:
            self.close()
            raise ApiError(f"{method} {self.url}{path}: {exc} (max_batch_bytes)") from exc
        except (OSError, ValueError) as exc:
            self.close()
            raise _Unreachable(f"{method} {self.url}{path}: {exc!r}") from exc
        buf = resp.body
        if resp.headers.get("content-encoding", "").lower() == "gzip":
            buf = _gunzip(buf, self.max_batch_bytes, f"{method} {self.url}{path}")
        return resp.status, resp.headers.get("content-type", "").split(";")[0].strip(), buf

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> BatchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ protocol

    def register(self) -> int:
        """``POST /register`` (safe to repeat); returns the uuid."""
        status, _, body = self._request("POST", "/register", self.registration)
        if status != 200:
            raise ApiError(f"/register answered {status}: {bytes(body[:300])!r}", status)
        self._registered = True
        return int(orjson.loads(body)["uuid"])

    def get_batch(self) -> Batch | None:
        """One attempt: the next batch, or None when none is ready (or a shared-memory batch was
        not acknowledged in time: it is served again). Raises OSError when the API is unreachable."""
        if not self._registered:
            self.register()
        query = {"shm": "?format=shm", "safetensors": "?format=safetensors", "json": ""}[self.transport]
        status, ctype, body = self._request("GET", "/batch" + query)
        if status == 200 and ctype == CONTENT_TYPE:
            arrays, meta = decode(body)  # views of the body: nothing allocated
            return Batch(arrays, "safetensors", metadata=meta)
        obj = orjson.loads(body) if body else None
        if status != 200:
            no_segment = status == 503 and isinstance(obj, dict) and obj.get("shm") is False  # /dev/shm full
            if self.transport in ("shm", "safetensors") and (status in (400, 406, 415, 422, 500) or no_segment):
                return self._fall_back(f"format={self.transport} answered {status}: {bytes(body[:200])!r}")
            if status in (502, 503, 504):
                raise _Unreachable(f"/batch answered {status}")
            raise ApiError(f"/batch answered {status}: {bytes(body[:300])!r}", status)
        if not isinstance(obj, dict):
            raise ApiError(f"/batch answered something else than a JSON object: {bytes(body[:200])!r}")
        if obj.get("status") == "error":  # the API does not know a trainer (it restarted without its spool)
            self._registered = False
            return None
        if "shm" in obj:
            return self._take_shm(obj["shm"])
        batch = obj.get("batch")
        if batch is None:
            return None
        try:
            arrays = batch_arrays(batch, self.max_batch_bytes)
        except LayoutError as exc:
            raise ApiError(f"/batch: {exc} (max_batch_bytes)") from None
        return Batch(arrays, "json", metadata={"format": FORMAT})

    def next_batch(self, timeout: float | None = None) -> Batch:
        """Wait for the next batch: polls while the queue is empty, and across API restarts
        (connection refused, 503) with backoff up to ``max_backoff`` seconds. Raises
        TimeoutError after ``timeout`` seconds without a batch."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = self.poll_interval
        while True:
            try:
                batch = self.get_batch()
                if batch is not None:
                    return batch
                pause = self.poll_interval
            except _Unreachable:
                self._registered = False  # re-registering after a restart is harmless
                pause = min(max(pause * 2, self.poll_interval), self.max_backoff)
            if deadline is not None and time.monotonic() + pause > deadline:
                raise TimeoutError(f"no batch from {self.url} within {timeout} s")
            time.sleep(pause)

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    def _fall_back(self, why: str) -> Batch | None:
        new = "safetensors" if self.transport == "shm" else "json"
        self.fallbacks.append(f"{self.transport} -> {new}: {why}")
        self.transport = new
        return None

    # ------------------------------------------------------------------ shared memory

    def _take_shm(self, info: Mapping[str, Any]) -> Batch | None:
        batch_id = str(info["batch_id"])
        size = int(info["size"])
        if not 0 < size <= self.max_batch_bytes:
            self._ack(batch_id, release=True)
            raise ApiError(
                f"/batch: a shared-memory batch of {size} bytes; this client takes at most "
                f"{self.max_batch_bytes} (max_batch_bytes)"
            )
        try:
            arrays, meta = decode(_map_segment(str(info["name"]), size))
        except (OSError, LayoutError, ValueError) as exc:
            # Not mappable from here (another host or mount namespace, another user): give the
            # batch back at once, and use HTTP from now on.
            self._ack(batch_id, release=True)
            return self._fall_back(f"cannot map segment {info.get('name')!r}: {exc}")
        if not self._ack(batch_id):
            return None  # acknowledged too late: it is served again, this copy is dropped
        return Batch(arrays, "shm", batch_id=batch_id, metadata=meta)

    def _ack(self, batch_id: str, *, release: bool = False) -> bool:
        """Acknowledge (or release) a shared-memory batch; True when the API counts it delivered.
        Retried while the API is unreachable (for up to ``request_timeout`` seconds): once it
        answers, a restarted API does not know the id (the batch is replayed from its spool) and
        the answer is False; so is giving up."""
        pause = self.poll_interval
        deadline = time.monotonic() + self.request_timeout
        while True:
            try:
                status, _, body = self._request("POST", "/batch/ack", {"batch_id": batch_id, "release": release})
            except _Unreachable:
                status, body = 503, bytearray()
            if status in (502, 503, 504):
                if time.monotonic() + pause > deadline:
                    return False
                time.sleep(pause)
                pause = min(pause * 2, self.max_backoff)
                continue
            if status != 200:
                raise ApiError(f"/batch/ack answered {status}: {bytes(body[:300])!r}", status)
            return bool(orjson.loads(body).get("acknowledged"))


def _gunzip(data: bytes | bytearray, limit: int, what: str) -> bytearray:
    """A gzip answer inflated into at most ``limit`` bytes (ApiError past it or when damaged)."""
    out = bytearray()
    rest = bytes(data)
    while rest:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            out += d.decompress(rest, limit - len(out) + 1)
        except zlib.error as exc:
            raise ApiError(f"{what}: the gzip answer does not inflate: {exc}") from None
        if len(out) > limit:
            raise ApiError(f"{what}: the answer inflates past the {limit} bytes this client takes (max_batch_bytes)")
        if not d.eof:
            raise ApiError(f"{what}: the gzip answer is cut short")
        rest = d.unused_data
    return out


def _map_segment(name: str, size: int) -> mmap.mmap:
    """Map a batch segment privately (copy-on-write: the arrays are writable and the API's
    segment never changes), after checking it is this user's, mode 0600 and large enough.
    Not through multiprocessing.shared_memory: its resource tracker would unlink the segment."""
    if not name.startswith("atroposd-") or "/" in name:
        raise ValueError(f"not an atroposd segment name: {name!r}")
    if _posixshmem is not None:
        fd = int(_posixshmem.shm_open("/" + name, os.O_RDONLY | os.O_CLOEXEC, 0))
    else:  # pragma: no cover
        fd = os.open(f"/dev/shm/{name}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        try:
            check_private_segment(fd, name, size)
        except SegmentCheckError as exc:
            raise (PermissionError if exc.permission else ValueError)(str(exc)) from None
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)

"""``InferenceControl``: give atroposd's inference server new weights from an external trainer.

The ``reload`` way of docs/EXTERNAL-TRAINER.md: the trainer writes the weights as
``{state_dir}/sync/v<N>/model.safetensors`` (metadata ``format``, ``weight_version``,
``tied``), then on the server's control socket (``{runtime_dir}/inference-<port>.sock``, HTTP
over a Unix socket, 0600) pauses generation, loads the directory and resumes. Every later
``/generate`` answer carries ``weight_version`` N, and so do the groups the environments post.

:meth:`InferenceControl.publish` does all of it for a torch module (the canonical tensors, tied
aliases recorded); :meth:`write` takes a plain ``{name: array}`` mapping (numpy or torch) whose
names are the model's parameter names.
"""

from __future__ import annotations

import http.client
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from atroposd.weights.control import LoadWeights, ResumeBody
from atroposd.weights.syncdir import prune_sync_dirs, write_tensors

if TYPE_CHECKING:
    import torch

__all__ = ["InferenceControl", "WeightsError"]


MAX_ANSWER_BYTES = 16 << 20  # the inference server's control answers are small JSON documents


class WeightsError(RuntimeError):
    """The inference server refused or failed a weight-control request."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("inference", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(self.timeout)
            s.connect(self._path)
        except BaseException:
            s.close()
            raise
        self.sock = s


class InferenceControl:
    """The inference server's control socket, and where its weights are written.

    ``socket_path``: ``{runtime_dir}/inference-<port>.sock``; ``sync_dir``: ``{state_dir}/sync``.
    :meth:`from_config` finds both from the job's config file.
    """

    def __init__(
        self, socket_path: str | os.PathLike[str], sync_dir: str | os.PathLike[str], *, timeout: float = 600.0
    ) -> None:
        self.socket_path = Path(socket_path)
        self.sync_dir = Path(sync_dir)
        self.timeout = timeout

    @classmethod
    def from_config(cls, config: str | os.PathLike[str] | None = None) -> InferenceControl:
        """From the job's TOML file (``-c``'s rules: ``$ATROPOSD_CONFIG``, ``./atroposd.toml``, ...)."""
        from atroposd.config import load_config
        from atroposd.paths import Paths

        cfg = load_config(config)
        paths = Paths.of(cfg)
        return cls(paths.inference_socket(cfg.inference.port), paths.sync_dir)

    def request(self, method: str, route: str, body: Mapping[str, object] | None = None) -> dict[str, Any]:
        conn = _UnixConnection(str(self.socket_path), self.timeout)
        try:
            conn.request(
                method,
                route,
                body=orjson.dumps(body) if body is not None else None,
                headers={"Content-Type": "application/json"},
            )
            resp = conn.getresponse()
            raw = resp.read(MAX_ANSWER_BYTES + 1)  # whatever its Content-Length says
        except OSError as exc:
            raise WeightsError(f"{method} {route}: control socket {self.socket_path} is not reachable ({exc})") from exc
        finally:
            conn.close()
        if len(raw) > MAX_ANSWER_BYTES:
            raise WeightsError(f"{method} {route}: an answer of more than {MAX_ANSWER_BYTES} bytes")
        try:
            data = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            data = {"error": raw.decode(errors="replace")[:500]}
        if resp.status >= 300:
            raise WeightsError(f"{method} {route} answered {resp.status}: {data}")
        return data if isinstance(data, dict) else {"result": data}

    def weight_version(self) -> int | None:
        """The version the server generates with now."""
        v = self.request("GET", "/weight_info").get("weight_version")
        return int(v) if v is not None else None

    def load(self, path: str | os.PathLike[str], weight_version: int) -> dict[str, Any]:
        """Pause generation, load the sync directory ``path``, resume with ``weight_version``
        (resumed even when the load fails: the server keeps generating with the old weights)."""
        self.request("POST", "/pause")
        try:
            answer = self.request("POST", "/load", LoadWeights(str(path), weight_version).fields())
        except BaseException:
            self.request("POST", "/resume", ResumeBody().fields())  # the old weights, under their own version
            raise
        self.request("POST", "/resume", ResumeBody(weight_version).fields())
        return answer

    def write(self, tensors: Mapping[str, Any], weight_version: int, *, tied: Mapping[str, str] | None = None) -> Path:
        """Write ``{sync_dir}/v<weight_version>/model.safetensors`` from ``{name: array}`` (numpy
        or torch, the model's parameter names; ``tied``: alias name → the name it shares memory
        with). Atomic (a temporary directory renamed); files 0600. The writer is the trainer's own
        (:mod:`atroposd.weights.syncdir`)."""
        return write_tensors(self.sync_dir, weight_version, tensors, tied=tied)

    def publish(self, model: torch.nn.Module, weight_version: int) -> dict[str, Any]:
        """Write a torch module's weights (``atroposd.weights.reload``: canonical tensors, tied
        aliases, LoRA adapters) and load them; older version directories are removed."""
        from atroposd.weights.reload import write_sync_dir

        path = write_sync_dir(model, self.sync_dir, weight_version)
        answer = self.load(path, weight_version)
        prune_sync_dirs(self.sync_dir, keep=path)
        return answer

    def reload(
        self, tensors: Mapping[str, Any], weight_version: int, *, tied: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """:meth:`write` then :meth:`load`."""
        return self.load(self.write(tensors, weight_version, tied=tied), weight_version)

"""The engine seam: what the inference server's front needs of an engine, and the table that
makes one by name.

:class:`Engine` is the whole of it: the front (:mod:`atroposd.inference.server`), its metrics
(:mod:`atroposd.inference.metrics`) and the weight-control routes call these members and
nothing else; there are no optional capabilities to probe for. An engine answers a bad request
with :class:`~atroposd.inference.schema.BadRequest`, a refused weight update with
:class:`~atroposd.weights.protocol.WeightUpdateError` and an update outside a pause with
:class:`~atroposd.inference.gate.NotPaused`: the routes catch exactly these. The admission gate
(pause, resume, versions) is :class:`~atroposd.inference.gate.WeightGate`, which every engine
subclasses; every weight update is checked by :func:`atroposd.weights.receiver.check_update`
(and a reload by :func:`~atroposd.weights.receiver.check_load`) before the engine applies it.

:data:`ENGINES` maps each ``[inference] engine`` name to its factory. A factory imports its
engine's module (and so its heavy dependencies) only when called. Adding an engine: a module
with a class that implements :class:`Engine`, one factory and one row here, and its name among
``[inference] engine``'s choices in :mod:`atroposd.config.schema` (docs/ARCHITECTURE.md,
"Adding an inference engine").

Imports nothing heavy: :mod:`atroposd.inference.cli` reads :data:`ENGINE_NAMES` for its flags.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from atroposd.config import Config
    from atroposd.inference.schema import GenerateParams
    from atroposd.weights.control import BroadcastOp, LoadWeights, UpdateWeights
    from atroposd.weights.receiver import ReceiverState

__all__ = ["ENGINES", "ENGINE_NAMES", "Engine", "EngineOptions", "UnknownEngine", "make_engine"]


class Engine(Protocol):
    """What the front needs of an engine (:class:`~atroposd.inference.torch_engine.TorchEngine`,
    :class:`~atroposd.inference.vllm_engine.VllmEngine`)."""

    @property
    def name(self) -> str:
        """The ``[inference] engine`` name it is made under (in error messages and ``/weight_info``)."""

    @property
    def pause_modes(self) -> tuple[str, ...]:
        """The modes ``POST /pause`` takes: ``("wait",)`` at least (drain); ``"keep"`` freezes
        the generations in flight (in-flight updates, SPEC §7)."""

    @property
    def max_model_len(self) -> int: ...
    @property
    def vocab_size(self) -> int:
        """The embedding's rows (token ids are checked against it); known once started."""

    # The admission gate's state (atroposd.inference.gate.WeightGate), read by /health, the
    # probe route and the metrics.
    @property
    def weight_version(self) -> int: ...
    @property
    def paused(self) -> bool: ...
    @property
    def held_for_update(self) -> bool:
        """Paused by the trainer for a weight update: the daemon's probe does not generate then."""

    @property
    def waiting(self) -> int: ...
    @property
    def pauses(self) -> int: ...
    @property
    def paused_seconds(self) -> float: ...
    @property
    def updates(self) -> int: ...

    async def start(self) -> None:
        """Load the model (the front answers ``/health`` 503 meanwhile)."""

    async def close(self) -> None:
        """Answer every admitted or waiting generation (refused: shutting down), release the
        weights' mappings, stop whatever processes the engine started."""

    async def check_health(self) -> None:
        """Raise (any exception, its message reported by ``/health``) when the engine cannot serve."""

    async def generate(self, request: GenerateParams, *, bypass_pause: bool = False) -> dict[str, Any]:
        """One parsed ``/generate`` request → its response (SPEC §7). ``bypass_pause``: the
        daemon's own probe, answered while the gate is closed."""

    async def pause(self, mode: str = "wait", clear_cache: bool | None = None) -> dict[str, Any]: ...
    async def resume(self, weight_version: int | None = None) -> dict[str, Any]: ...
    async def update_weights(self, request: UpdateWeights) -> dict[str, Any]:
        """``shared`` / ``push`` mode, through :func:`atroposd.weights.receiver.check_update`."""

    async def load_weights(self, request: LoadWeights) -> dict[str, Any]:
        """``reload`` mode, through :func:`atroposd.weights.receiver.check_load`."""

    async def broadcast_weights(self, request: BroadcastOp) -> dict[str, Any]:
        """``broadcast`` mode: one op (join, receive, finish, leave) of :mod:`atroposd.weights.broadcast`."""

    async def weight_info(self) -> dict[str, Any]:
        """``GET /weight_info``: at least ``weight_version``, ``paused``, ``awaiting_weights``, ``engine``."""


@dataclass(frozen=True)
class EngineOptions:
    """What every factory is given beside the config."""

    receiver: ReceiverState
    await_weights: bool = False
    threads: int | None = None  # torch threads (the torch engine; others may ignore it)


EngineFactory = Callable[["Config", EngineOptions], Engine]


class UnknownEngine(ValueError):
    """An engine name that is not in :data:`ENGINES`."""


def _torch(cfg: Config, opts: EngineOptions) -> Engine:
    from atroposd import gpuenv
    from atroposd.inference.torch_engine import TorchEngine

    gpuenv.apply(os.environ)
    return TorchEngine.from_config(cfg, receiver=opts.receiver, await_weights=opts.await_weights, threads=opts.threads)


def _vllm(cfg: Config, opts: EngineOptions) -> Engine:
    from atroposd import gpuenv
    from atroposd.inference.vllm_engine import VllmEngine

    gpuenv.apply(os.environ, vllm=True)
    return VllmEngine.from_config(cfg, receiver=opts.receiver, await_weights=opts.await_weights)


#: ``[inference] engine`` → its factory. A factory sets its GPU environment (SPEC §12.1) before
#: the device is resolved, a broadcast group is built or the engine starts its workers.
ENGINES: Mapping[str, EngineFactory] = {"torch": _torch, "vllm": _vllm}
ENGINE_NAMES: tuple[str, ...] = tuple(ENGINES)


def make_engine(
    cfg: Config,
    name: str,
    *,
    await_weights: bool,
    threads: int | None = None,
    engines: Mapping[str, EngineFactory] | None = None,
) -> Engine:
    """The engine named ``name`` (a key of ``engines``, default :data:`ENGINES`) for ``cfg``,
    with the weight receiver of this launch; an unknown name is refused naming the known ones."""
    from atroposd.weights.receiver import ReceiverState

    table = ENGINES if engines is None else engines
    factory = table.get(name)
    if factory is None:
        raise UnknownEngine(f"unknown engine {name!r} (known: {', '.join(table)})")
    opts = EngineOptions(ReceiverState.from_config(cfg), await_weights=await_weights, threads=threads)
    return factory(cfg, opts)

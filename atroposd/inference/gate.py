"""Admission of generations around weight updates, the same for every engine (SPEC §7).

``pause`` admits no new generation and returns once every admitted one has been answered;
``resume(version)`` opens the gate with the new ``weight_version``, unless the engine's weight
receiver holds an incomplete bucketed push (the model holds a mix of versions, or none: a
:class:`~atroposd.weights.protocol.WeightUpdateError`, HTTP 400). A generation is admitted
under the version current at admission and keeps it in its response, so every response
carries exactly one version. Weight updates are refused (:class:`NotPaused`) unless the gate
is closed and nothing is in flight.

An engine subclasses :class:`WeightGate` and wraps each generation in
``async with self._admitted(bypass_pause) as version``. A server started with
``--await-weights`` starts paused: it serves once the trainer's weights arrived and the
trainer resumed it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from atroposd.logs import get_logger
from atroposd.weights.protocol import WeightUpdateError

if TYPE_CHECKING:
    from atroposd.weights.receiver import ReceiverState

__all__ = ["NotPaused", "ShuttingDown", "WeightGate"]

log = get_logger(__name__)


class NotPaused(RuntimeError):
    """A weight update while generation is not paused (HTTP 409)."""


class ShuttingDown(RuntimeError):
    """The server is stopping: a generation is refused instead of admitted (HTTP 503)."""


class WeightGate:
    #: the engine's :class:`atroposd.weights.receiver.ReceiverState` (None: takes no weights)
    receiver: ReceiverState | None = None

    def __init__(self, *, await_weights: bool) -> None:
        self.weight_version = 0
        self.updates = 0  # weight updates applied since start
        self.awaiting_weights = await_weights
        self._paused = await_weights
        # Paused by the trainer for a weight update (``pause`` until ``resume``): the daemon's
        # generation probes do not generate then (an update refuses any generation in flight).
        self.held_for_update = False
        self._resumed = asyncio.Event()
        if not await_weights:
            self._resumed.set()
        self._inflight = 0
        self.waiting = 0  # generations held at the closed gate (reported by /weight_info)
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False
        self.pauses = 0  # pauses for weight updates since start
        self.paused_seconds = 0.0  # time generation spent paused by them (the pause at start excluded)
        self._paused_at: float | None = None

    @property
    def paused(self) -> bool:
        return self._paused

    @contextlib.asynccontextmanager
    async def _admitted(self, bypass: bool) -> AsyncIterator[int]:
        """Wait for the gate (unless ``bypass``: the readiness probe's own generation), then
        count the generation as in flight; yields the version it is admitted under."""
        if not bypass and self._paused and not self._closing:
            self.waiting += 1
            try:
                while self._paused and not self._closing:
                    await self._resumed.wait()
            finally:
                self.waiting -= 1
        if self._closing:
            raise ShuttingDown("the inference server is shutting down")
        self._inflight += 1
        self._idle.clear()
        try:
            yield self.weight_version
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    def hold_admissions(self) -> None:
        """Admit nothing new until :meth:`resume` (a pause's first half, whatever its mode):
        counted once per pause, however often it is asked again before the resume."""
        if not self._paused:
            self.pauses += 1
            self._paused_at = time.monotonic()
        self._paused = True
        self.held_for_update = True
        self._resumed.clear()

    async def pause(self) -> dict[str, Any]:
        """Admit nothing new; return once every admitted generation has been answered."""
        self.hold_admissions()
        await self._idle.wait()
        return {"paused": True, "weight_version": self.weight_version}

    async def resume(self, weight_version: int | None = None) -> dict[str, Any]:
        """Open the gate, unless a bucketed push stopped halfway (the model holds a mix of versions)."""
        problem = self.receiver.incomplete() if self.receiver is not None else None
        if problem is not None:
            raise WeightUpdateError(problem)
        if weight_version is not None:
            self.weight_version = int(weight_version)
        if self.awaiting_weights and not self.updates:
            log.warning("resumed before any weights arrived; serving the weights loaded at start")
        self.awaiting_weights = False
        if self._paused_at is not None:
            self.paused_seconds += time.monotonic() - self._paused_at
            self._paused_at = None
        self._paused = False
        self.held_for_update = False
        self._resumed.set()
        return {"paused": False, "weight_version": self.weight_version}

    def _close_gate(self) -> None:
        """Stopping: admit nothing more, and release every generation waiting at a closed gate
        (each gets ShuttingDown) so that the server's shutdown does not wait for a resume."""
        self._closing = True
        self._resumed.set()

    def _require_paused(self) -> None:
        if not self._paused or self._inflight:
            raise NotPaused("pause generation before updating weights (POST /pause)")

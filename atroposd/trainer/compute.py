"""Rank 0's one compute thread (SPEC §12.1): every step's work, in order, on one thread; a group
restart fences it (:class:`Fenced`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch

__all__ = ["ComputeThread", "Fenced"]

_T = TypeVar("_T")
_P = ParamSpec("_P")


class Fenced(RuntimeError):
    """Work of an earlier trainer group generation: its result is discarded."""


class ComputeThread:
    """Rank 0's one compute thread (SPEC §12.1): every step's work runs here, in order, with the
    device set on it. A group restart ``fence``s it: a thread stuck in a collective is left
    behind (its late result is discarded, :class:`Fenced`) and a new one serves the next group.
    A daemon thread: one that never returns must not hold up the process's exit."""

    _ids = itertools.count(1)

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.generation = 0
        self._queue = self._start()

    def _start(self) -> queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None]:
        q: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None] = queue.SimpleQueue()
        threading.Thread(target=self._serve, args=(q,), name=f"atroposd-compute-{next(self._ids)}", daemon=True).start()
        return q

    def _serve(self, q: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None]) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            item = q.get()
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the awaiting task
                future.set_exception(exc)

    async def run(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """``fn(*args)`` on the compute thread; its result, unless the thread was fenced meanwhile."""
        generation = self.generation
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        self._queue.put((functools.partial(fn, *args, **kwargs), future))
        result = await asyncio.wrap_future(future)
        if generation != self.generation:
            raise Fenced("the trainer group was restarted while this work ran")
        return result

    def fence(self) -> None:
        """Abandon the current thread (it may be stuck): later work goes to a fresh one."""
        self.generation += 1
        old, self._queue = self._queue, self._start()
        _drain(old)

    def close(self) -> None:
        _drain(self._queue)


def _drain(q: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None]) -> None:
    """Cancel the work still queued and tell the thread to end once its current work returns."""
    while True:
        try:
            item = q.get_nowait()
        except queue.Empty:
            break
        if item is not None:
            item[1].cancel()
    q.put(None)

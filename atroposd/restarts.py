"""The restart budget, written once (SPEC §4): how many restarts a window of time allows, and
the backoff before the next one. A child's unit (:mod:`atroposd.process.unit`) and the trainer
group (:mod:`atroposd.trainer.service`) each keep one.

``max_restarts`` failures within ``window`` seconds are restarted; one more ends it. The
backoff doubles from ``first`` with every failure in the window, up to ``cap``, stretched by up
to ``jitter`` (a fraction) so that children that failed together do not restart in step.
"""

from __future__ import annotations

import collections
import random
import time
from dataclasses import dataclass, field

__all__ = ["RestartBudget"]


@dataclass
class RestartBudget:
    max_restarts: int
    window: float
    first: float = 1.0
    cap: float = 30.0
    jitter: float = 0.0
    _times: collections.deque[float] = field(default_factory=collections.deque, repr=False)

    def record(self, now: float | None = None, *, counted: bool = True) -> int:
        """A failure at ``now`` (monotonic seconds): forget those older than the window, count this
        one unless ``counted`` is False; returns the failures in the window."""
        now = time.monotonic() if now is None else now
        if counted:
            self._times.append(now)
        while self._times and now - self._times[0] > self.window:
            self._times.popleft()
        return len(self._times)

    @property
    def count(self) -> int:
        return len(self._times)

    @property
    def exhausted(self) -> bool:
        """More failures in the window than ``max_restarts``: no more restarts."""
        return len(self._times) > self.max_restarts

    def backoff(self, draw: float | None = None) -> float:
        """Seconds before the next restart; ``draw`` in [0, 1) stands for the random jitter."""
        delay = min(self.cap, self.first * 2.0 ** max(0, len(self._times) - 1))
        if self.jitter:
            delay = min(self.cap, delay * (1 + self.jitter * (random.random() if draw is None else draw)))
        return delay

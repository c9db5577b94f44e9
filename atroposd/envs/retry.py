"""Retry pacing shared by the environment's API and inference clients."""

from __future__ import annotations

import random

import aiohttp
import anyio
from structlog.typing import FilteringBoundLogger

# Retry pacing: exponential from BACKOFF_START to BACKOFF_CAP, with jitter; a Retry-After is
# honoured up to RETRY_AFTER_CAP.
BACKOFF_START = 0.2
BACKOFF_CAP = 5.0
RETRY_AFTER_CAP = 60.0
# While a wait goes on, say so again this often.
NOTICE_EVERY = 10.0
CONNECTION_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)


class Retry(Exception):
    """A transient answer: wait ``delay`` seconds (None: backoff) and try again."""

    def __init__(self, reason: str, delay: float | None = None, connection: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.delay = delay
        self.connection = connection


class Backoff:
    """Exponential backoff with jitter, and a notice at the first failure and then every
    NOTICE_EVERY seconds, so a long wait is visible without flooding the log."""

    def __init__(self, log: FilteringBoundLogger, what: str) -> None:
        self._log, self._what = log, what
        self._delay = BACKOFF_START
        self._attempts = 0
        self._started = anyio.current_time()
        self._last_notice: float | None = None

    async def wait(self, retry: Retry) -> None:
        self._attempts += 1
        now = anyio.current_time()
        if self._last_notice is None or now - self._last_notice >= NOTICE_EVERY:
            self._last_notice = now
            self._log.warning(
                f"{self._what}: retrying",
                reason=retry.reason,
                attempts=self._attempts,
                waited_s=round(now - self._started, 1),
            )
        if retry.delay is not None:
            delay = min(retry.delay, RETRY_AFTER_CAP)
        else:
            delay = self._delay * random.uniform(0.5, 1.0)
            self._delay = min(self._delay * 2, BACKOFF_CAP)
        await anyio.sleep(delay)

    def done(self) -> None:
        if self._attempts:
            self._log.info(
                f"{self._what}: succeeded after retries",
                attempts=self._attempts,
                waited_s=round(anyio.current_time() - self._started, 1),
            )


def retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: fall back to backoff

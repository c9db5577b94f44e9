"""Every inference replica's ``/health``, polled in the background (SPEC §12.2).

:class:`ReplicaHealth` asks each replica for its ``/health`` every :data:`POLL_INTERVAL`
seconds, all at once, each within :data:`POLL_TIMEOUT`, and keeps the latest answer: the
``generations`` it answered and the ``weight_version`` it serves. A replica that does not
answer keeps its last known values (None before its first answer). Readers — the trainer
writing a ``metrics.jsonl`` row, a ``/metrics`` scrape — take the latest values and never
wait on a replica.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from atroposd.config import Config
from atroposd.daemon.specs import inference_name

if TYPE_CHECKING:
    import aiohttp

__all__ = ["POLL_INTERVAL", "POLL_TIMEOUT", "ReplicaHealth", "ReplicaSeen", "fetch_health"]

POLL_INTERVAL = 2.0
POLL_TIMEOUT = 1.5


async def fetch_health(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None
) -> dict[str, Any] | None:
    """A replica's ``/health`` body (``url`` without the path); None when it does not answer 200
    with a JSON object in the session's timeout. ``headers``: the inference token, if any."""
    import aiohttp

    try:
        async with session.get(f"{url}/health", headers=headers or {}) as resp:
            data = await resp.json(content_type=None) if resp.status == 200 else None
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _count(x: object) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) and x >= 0 else None


@dataclass
class ReplicaSeen:
    """What one replica said last: None before its first answer."""

    name: str
    url: str
    generations: int | None = None
    weight_version: int | None = None
    answered_at: float | None = None  # monotonic: its last answer
    up: bool = False  # it answered the last poll


class ReplicaHealth:
    """The latest ``/health`` of each inference replica, replica 0 first."""

    def __init__(
        self,
        names: Sequence[str],
        urls: Sequence[str],
        *,
        interval: float = POLL_INTERVAL,
        timeout: float = POLL_TIMEOUT,
        headers: dict[str, str] | None = None,
    ) -> None:
        if len(names) != len(urls):
            raise ValueError(f"{len(names)} replica names for {len(urls)} URLs")
        if interval <= 0 or timeout <= 0:
            raise ValueError(f"interval and timeout must be positive, got {interval} and {timeout}")
        self.replicas = [ReplicaSeen(n, u.rstrip("/")) for n, u in zip(names, urls, strict=True)]
        self.interval = interval
        self.timeout = timeout
        self.headers = dict(headers or {})
        self.polls = 0  # rounds finished

    @classmethod
    def of(cls, cfg: Config, *, interval: float = POLL_INTERVAL, timeout: float = POLL_TIMEOUT) -> ReplicaHealth:
        """Every replica of ``cfg`` (supervised or the one external server), by component name."""
        from atroposd.daemon.specs import inference_headers

        urls = cfg.inference_urls
        names = [inference_name(cfg, i) for i in range(len(urls))]
        return cls(names, urls, interval=interval, timeout=timeout, headers=inference_headers(cfg))

    def generations(self) -> list[int | None]:
        """Generations each replica answered, last known; replica 0 first."""
        return [r.generations for r in self.replicas]

    async def poll(self, session: aiohttp.ClientSession) -> None:
        """One round: every replica at once."""

        async def one(r: ReplicaSeen) -> None:
            data = None
            with anyio.move_on_after(self.timeout):
                data = await fetch_health(session, r.url, self.headers)
            r.up = data is not None
            if data is None:
                return
            r.answered_at = time.monotonic()
            generations, version = _count(data.get("generations")), _count(data.get("weight_version"))
            if generations is not None:
                r.generations = generations
            r.weight_version = version

        async with anyio.create_task_group() as tg:
            for r in self.replicas:
                tg.start_soon(one, r)
        self.polls += 1

    async def run(self) -> None:
        """Poll every ``interval`` seconds until cancelled."""
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)) as session:
            while True:
                await self.poll(session)
                await anyio.sleep(self.interval)

"""What the API process runs with (:class:`ApiSettings`): the ``[api]`` section after flags."""

from __future__ import annotations

from dataclasses import dataclass

from atroposd.api.queue import BYTES_PER_SEQUENCE
from atroposd.config import ApiConfig
from atroposd.httpbounds import connection_cap as _connection_cap

__all__ = ["BODY_TIMEOUT_S", "MAX_CONNECTIONS", "ApiSettings"]

BODY_TIMEOUT_S = 30.0  # a request body must arrive within this (a slow client holds a reservation)
MAX_CONNECTIONS = 1024  # connections open at once (each held by a client, idle or not)


@dataclass
class ApiSettings:
    """What the API process runs with: the ``[api]`` section (defaults: ``ApiConfig``) after flags."""

    host: str
    port: int
    token: str
    max_queued_sequences: int
    max_request_bytes: int
    full_wait: float
    spool_dir: str | None  # None: nothing survives a restart
    shm_ack_timeout: float = 30.0
    spool_fsync: bool = False
    body_timeout: float = BODY_TIMEOUT_S
    max_queued_bytes: int | None = None  # None: the default of queue_bytes()
    max_connections: int = MAX_CONNECTIONS

    def connection_cap(self) -> int:
        """``max_connections``, kept below the process's file descriptor limit."""
        return _connection_cap(self.max_connections)

    def queue_bytes(self) -> int:
        """The byte budget of groups held: ``max_queued_bytes``, else 64 KiB per sequence of the
        cap, and never less than two bodies of ``max_request_bytes`` (any acceptable body fits)."""
        if self.max_queued_bytes is not None:
            return self.max_queued_bytes
        return max(self.max_queued_sequences * BYTES_PER_SEQUENCE, 2 * self.max_request_bytes)

    @classmethod
    def from_config(cls, api: ApiConfig, spool_dir: str | None) -> ApiSettings:
        return cls(
            host=api.host,
            port=api.port,
            token=api.token,
            max_queued_sequences=api.max_queued_sequences,
            max_request_bytes=api.max_request_bytes,
            full_wait=api.full_wait,
            spool_dir=spool_dir,
            spool_fsync=api.spool_fsync,
            shm_ack_timeout=api.shm_ack_timeout,
            max_connections=api.max_connections,
        )

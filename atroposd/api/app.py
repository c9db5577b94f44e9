"""Running the API process: replay the spool, bind, serve until SIGTERM/SIGINT, close cleanly."""

from __future__ import annotations

import asyncio
import errno
import signal

from aiohttp import web

from atroposd.api.ingest import ParseHelper, helper_wanted
from atroposd.api.queue import TrajectoryStore
from atroposd.api.server import ApiServer, ApiSettings
from atroposd.api.spool import Spool, SpoolError
from atroposd.logs import get_logger
from atroposd.net import is_loopback

__all__ = ["run", "serve"]

log = get_logger("api")
SHUTDOWN_GRACE_S = 2.0  # waiting submissions are cancelled (they were never accepted)


def run(settings: ApiSettings) -> int:
    """The process entry point: exit 0 on a requested stop, 1 on a failure to start."""
    return asyncio.run(serve(settings))


async def serve(settings: ApiSettings, *, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> int:
    spool = Spool(settings.spool_dir, fsync=settings.spool_fsync) if settings.spool_dir else None
    store = TrajectoryStore(settings.max_queued_sequences, spool=spool, capacity_bytes=settings.queue_bytes())
    if spool is not None:
        try:
            store.restore(spool.open())
        except (SpoolError, OSError) as exc:
            log.error("cannot open the spool", dir=settings.spool_dir, error=str(exc))
            spool.close()
            return 1
    helper = ParseHelper(settings.max_request_bytes) if helper_wanted() else None
    if helper is not None and not await helper.try_start():
        helper = None
    server = ApiServer(store, settings, helper)
    # handler_cancellation: a client that goes away ends its handler, so a submission waiting for
    # room gives its place back at once.
    runner = web.AppRunner(
        server.app(),
        auto_decompress=False,
        access_log=None,
        handle_signals=False,
        shutdown_timeout=SHUTDOWN_GRACE_S,
        handler_cancellation=True,
    )
    await runner.setup()
    try:
        site = server.site(runner)
        try:
            await site.start()
        except OSError as exc:
            reason = "port already in use" if exc.errno == errno.EADDRINUSE else str(exc)
            log.error("cannot bind the API", host=settings.host, port=settings.port, error=reason)
            return 1
        if not is_loopback(settings.host) and not settings.token:
            log.warning(
                "binding a non-loopback address without a token: anyone who can reach it can post and drain data",
                host=settings.host,
            )
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (RuntimeError, ValueError):  # not the main thread (embedded use)
                pass
        log.info(
            "API ready",
            url=f"http://{settings.host}:{settings.port}",
            capacity=settings.max_queued_sequences,
            spool=settings.spool_dir,
            queued_sequences=store.held,
        )
        if ready is not None:
            ready.set()
        await stop.wait()
        log.info("API stopping", queued_sequences=store.held)
        return 0
    finally:
        await runner.cleanup()
        if helper is not None:
            await helper.close()
        if spool is not None:
            spool.close()

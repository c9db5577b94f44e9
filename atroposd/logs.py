"""Structured logging for the daemon and every child (structlog over the standard library).

``configure_logging`` is called once by each entry point.  ``auto`` renders for humans on a
TTY and as one JSON object per line otherwise (journald and the daemon's log files).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, MutableMapping
from typing import Any, TextIO

import orjson
import structlog
from structlog.typing import FilteringBoundLogger, Processor

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _orjson_dumps(obj: object, default: Callable[[Any], object] | None = None) -> str:
    return orjson.dumps(obj, default=default or str).decode()


def configure_logging(
    level: str = "info", fmt: str = "auto", *, stream: TextIO | None = None, component: str | None = None
) -> None:
    """Route structlog and stdlib logging to ``stream`` (stderr) at ``level``.

    fmt: ``auto`` (console on a TTY, else JSON), ``console`` or ``json``.
    """
    stream = stream or sys.stderr
    use_json = fmt == "json" or (fmt == "auto" and not stream.isatty())
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if component:
        shared.insert(0, _bind_component(component))
    renderer: Processor = (
        structlog.processors.JSONRenderer(serializer=_orjson_dumps)
        if use_json
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(), structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    # Libraries that use the standard logging module (aiohttp, transformers) go to the same stream.
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer], foreign_pre_chain=shared
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(_LEVELS.get(level, logging.INFO), logging.INFO))
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _bind_component(component: str) -> Processor:
    def processor(_logger: object, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        event.setdefault("component", component)
        return event

    return processor


def get_logger(name: str | None = None, **bound: object) -> FilteringBoundLogger:
    """A lazy logger: safe at import time, it takes the configuration of ``configure_logging``
    whenever that runs (binding eagerly would freeze the default configuration)."""
    logger: FilteringBoundLogger = structlog.get_logger(name, **bound)
    return logger

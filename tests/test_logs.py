"""Logging set-up: loggers made at import time follow the configuration made later."""

from __future__ import annotations

import io

import orjson

from atroposd.logs import configure_logging, get_logger


def test_logger_bound_before_configuration_renders_as_configured() -> None:
    log = get_logger("early", component="trainer")  # as a module does at import time
    buf = io.StringIO()
    configure_logging("info", "json", stream=buf)
    log.info("step", step=3)
    log.debug("hidden")
    line = orjson.loads(buf.getvalue().strip())
    assert line["event"] == "step" and line["component"] == "trainer" and line["step"] == 3
    assert line["level"] == "info" and "timestamp" in line
    assert "hidden" not in buf.getvalue()

"""Helpers for tests: free ports, config files, running the CLI as a real subprocess."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_pair() -> int:
    """A port p with p and p + 1 free a moment ago (inference replica i listens on port + i)."""
    for _ in range(50):
        port = free_port()
        if port >= 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two consecutive free ports")


def config_problems(text: str) -> list[str]:
    """Every problem ``config check`` reports for a TOML text (it must be invalid)."""
    import pytest

    from atroposd.config import ConfigError, parse_toml

    with pytest.raises(ConfigError) as info:
        parse_toml(text)
    return [str(p) for p in info.value.problems]


def toml_value(v: Any) -> str:
    import json

    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


def write_config(path: Path, sections: Mapping[str, Any]) -> Path:
    """Write a TOML config: ``{"daemon": {...}, "env": [{...}, ...]}``."""
    lines: list[str] = []
    for name, body in sections.items():
        if name == "env":
            for env in body:
                lines.append("[[env]]")
                lines += [f"{k} = {toml_value(v)}" for k, v in env.items()]
                lines.append("")
            continue
        nested = {k: v for k, v in body.items() if isinstance(v, dict) and k == "vllm"}
        lines.append(f"[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in body.items() if k not in nested]
        lines.append("")
        for k, v in nested.items():
            lines.append(f"[{name}.{k}]")
            lines += [f"{kk} = {toml_value(vv)}" for kk, vv in v.items()]
            lines.append("")
    path.write_text("\n".join(lines))
    return path


def atroposd(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 60, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``atroposd ARGS`` to completion; returns the CompletedProcess (text)."""
    full_env = dict(os.environ)
    full_env.pop("ATROPOSD_CONFIG", None)
    if env:
        full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "atroposd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd,
    )


def spawn(
    cmd: Sequence[str], *, env: Mapping[str, str] | None = None, log: Path | None = None, **kw: Any
) -> subprocess.Popen[bytes]:
    """Start a process in its own session (so the test can kill its whole group)."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    out = open(log, "ab") if log else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            list(cmd), env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kw
        )
    finally:
        if log:
            out.close()  # type: ignore[union-attr]


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10.0) -> int:
    """SIGTERM the process group, wait, then SIGKILL; always reaps. Returns the exit code."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.wait(timeout)


def wait_for(predicate: Any, timeout: float = 30.0, interval: float = 0.05, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns a truthy value; raise AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # the predicate may probe something not up yet
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_exc!r})" if last_exc else "")
    )


def wait_http(url: str, timeout: float = 30.0, proc: subprocess.Popen[Any] | None = None) -> None:
    """Wait until GET url answers (any status); fail at once if ``proc`` exits."""
    import urllib.error
    import urllib.request

    def ok() -> bool:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} before {url} answered")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(0.05)
    raise AssertionError(f"{url} did not answer within {timeout}s")

"""Weights & Biases: every ``metrics.jsonl`` row logged to a run (optional extra ``atroposd[wandb]``).

``wandb`` is imported only here, only in the sink's own thread, and only when ``[wandb]
project`` is set (and ``mode`` is not ``disabled``). The run id is kept in
``{state_dir}/wandb/run.json`` so that a resumed job continues the same run; rows are logged
against atroposd's ``step`` (a custom x-axis, ``define_metric``), so rows after a resume from an
earlier checkpoint are kept, not dropped as W&B's own step would. The resolved config is the
run's config.

Every W&B call happens in one worker thread fed by a queue: the event loop never waits for
W&B (an unreachable server, a slow upload). Any W&B failure — not installed, no network, a
bad key — is a logged warning and the end of W&B logging, never a failed job.

The helpers above :class:`WandbSink` (run id, group) import nothing heavy: the daemon uses
them to give environments the group (``{wandb_group}``, ``WANDB_RUN_GROUP``).
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import string
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import structlog

from atroposd.fsutil import write_atomic

if TYPE_CHECKING:
    from types import ModuleType

    from wandb import Run

    from atroposd.config import Config

__all__ = ["WandbSink", "flatten", "run_file", "run_identity", "wandb_group"]

log = structlog.get_logger("trainer", component="trainer")  # lazy: bound at first use

MAX_PENDING = 10_000  # rows queued for W&B at most (beyond: dropped and counted)
FINISH_TIMEOUT_S = 30.0
_ID_ALPHABET = string.ascii_lowercase + string.digits


def run_file(state_dir: Path) -> Path:
    return state_dir / "wandb" / "run.json"


def run_identity(state_dir: Path, *, create: bool = True) -> dict[str, str] | None:
    """``{"id": ..., "group": ...}`` of this state dir's W&B run, made (and kept) on first use."""
    path = run_file(state_dir)
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict) and isinstance(data.get("id"), str) and data["id"]:
            return {"id": data["id"], "group": str(data.get("group") or f"atroposd-{data['id']}")}
    except (OSError, ValueError):
        pass
    if not create:
        return None
    run_id = "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))
    ident = {"id": run_id, "group": f"atroposd-{run_id}"}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(ident).encode() + b"\n", mode=0o644)
    except OSError as exc:
        log.warning("wandb run id not saved; a resume starts a new run", path=str(path), error=str(exc))
    return ident


def wandb_group(cfg: Config) -> str:
    """The group environments get: ``[wandb] group``, else (W&B on) this state dir's run's group."""
    if cfg.wandb.group:
        return str(cfg.wandb.group)
    if not cfg.wandb.enabled:
        return ""
    ident = run_identity(cfg.state_dir)
    return ident["group"] if ident else ""


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A metrics row as W&B keys: nested objects become ``key/sub`` (``rejected_groups/too_long``),
    lists ``key/<index>`` (``replica_generations/0``)."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "/"))
        elif isinstance(value, (list, tuple)):
            out.update(flatten({str(i): v for i, v in enumerate(value)}, name + "/"))
        elif value is not None:
            out[name] = value
    return out


class WandbSink:
    """Logs rows to one W&B run from a worker thread; :meth:`log` never blocks or raises."""

    def __init__(self, cfg: Config, config_dict: Mapping[str, Any]) -> None:
        self.cfg = cfg
        self.config_dict = dict(config_dict)
        self.state_dir = Path(cfg.state_dir)
        self.ident = run_identity(self.state_dir) or {"id": "", "group": ""}
        self.group = cfg.wandb.group or self.ident["group"]
        self.dropped = 0
        self.failed: str | None = None
        self.run_dir: str | None = None
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="wandb", daemon=True)

    @classmethod
    def start(cls, cfg: Config, config_dict: Mapping[str, Any]) -> WandbSink:
        sink = cls(cfg, config_dict)
        sink._thread.start()
        return sink

    @property
    def run_id(self) -> str:
        return self.ident["id"]

    def log(self, record: Mapping[str, Any]) -> None:
        if self.failed is not None:
            return
        if self._queue.qsize() >= MAX_PENDING:
            self.dropped += 1
            return
        self._queue.put(dict(record))

    def close(self, timeout: float = FINISH_TIMEOUT_S) -> None:
        """Finish the run (rows queued so far are logged first); waits at most ``timeout``."""
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("wandb did not finish in time; its last rows may be missing", timeout_s=timeout)

    # ------------------------------------------------------------------ worker thread

    def _fail(self, what: str, exc: BaseException) -> None:
        self.failed = f"{type(exc).__name__}: {exc}"
        log.warning(f"wandb {what} failed; training goes on without it", error=self.failed)
        while True:  # unblock close(): drop what is queued
            try:
                if self._queue.get_nowait() is None:
                    break
            except queue.Empty:
                break

    def _init(self) -> Run:
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError("the wandb package is not installed (pip install 'atroposd[wandb]')") from exc
        w = self.cfg.wandb
        (self.state_dir / "wandb").mkdir(parents=True, exist_ok=True)
        if w.mode == "online":
            _require_credentials(wandb)
        wanted: dict[str, Any] = {"console": "off", "silent": True, "x_disable_stats": True, "init_timeout": 60.0}
        known = getattr(wandb.Settings, "model_fields", wanted)
        settings = wandb.Settings(**{k: v for k, v in wanted.items() if k in known})
        run = wandb.init(
            project=w.project,
            entity=w.entity or None,
            group=self.group or None,
            name=w.name or None,
            tags=list(w.tags) or None,
            mode=cast(Literal["online", "offline", "disabled"], w.mode),  # the config's choices
            id=self.run_id or None,
            resume="allow",
            dir=str(self.state_dir),
            config=self.config_dict,
            settings=settings,
            reinit="create_new",
        )
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        self.run_dir = str(getattr(run, "dir", "") or "")
        log.info("wandb run", project=w.project, id=run.id, group=self.group, mode=w.mode, dir=self.run_dir)
        return run

    def _work(self) -> None:
        try:
            run = self._init()
        except BaseException as exc:  # anything at all: W&B is never the job's end
            self._fail("start", exc)
            if "wandb" in sys.modules:
                _teardown()
            return
        try:
            while True:
                record = self._queue.get()
                if record is None:
                    break
                run.log(flatten(record))
        except BaseException as exc:
            self._fail("logging", exc)
        try:
            run.finish()
        except BaseException as exc:
            log.warning("wandb finish failed", error=f"{type(exc).__name__}: {exc}")
        _teardown()


def _require_credentials(wandb: ModuleType) -> None:
    """Online: credentials must already exist — W&B never prompts on the daemon's terminal."""
    import inspect

    if "prompt" in inspect.signature(wandb.login).parameters:
        if not wandb.login(prompt=False, verify=False):
            raise RuntimeError("no W&B credentials (set WANDB_API_KEY or run `wandb login`)")
    elif not os.environ.get("WANDB_API_KEY") and sys.stdin is not None and sys.stdin.isatty():
        raise RuntimeError("no WANDB_API_KEY, and this wandb version would ask for it on the terminal")


def _teardown() -> None:
    """End W&B's service process now (the trainer is W&B's only user in this process)."""
    import wandb

    try:
        wandb.teardown()
    except BaseException as exc:
        log.warning("wandb teardown failed", error=f"{type(exc).__name__}: {exc}")

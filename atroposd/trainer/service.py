"""The daemon-facing handle of the in-process trainer (docs/ARCHITECTURE.md, "Trainer").

``run`` sets up in this order (SPEC §4, start order): load the model and tokenizer (and
resume from the newest complete checkpoint) → compare the tokenizer with the inference
server's → attach the weights (the server now computes with the trainer's weights and
version) → build the optimizer (after attach: in shared mode the parameters have moved into
shared memory) and restore its state → ``POST /register`` → the first ``GET /batch`` →
``task_status.started()`` → the training loop. Compute runs in worker threads.

The daemon owns ``weights`` and calls ``weights.close()`` once the inference server is gone.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import structlog
from anyio.abc import TaskStatus

from atroposd.config import Config
from atroposd.paths import Paths

if TYPE_CHECKING:
    from atroposd.weights.sync import WeightSync

if sys.version_info < (3, 11):  # pragma: no cover - exercised only on 3.10
    from exceptiongroup import BaseExceptionGroup

__all__ = ["TrainerOutcome", "TrainerService"]

log = structlog.get_logger("trainer", component="trainer")  # lazy: bound at first use

INFO_TIMEOUT_S = 10.0
PROGRESS_EVERY = 10


@dataclass(frozen=True)
class TrainerOutcome:
    """How ``run`` ended: ``finished`` (all steps), ``stopped`` (requested) or ``failed``."""

    state: str
    step: int
    weight_version: int
    error: str | None = None

    @property
    def exit_code(self) -> int:
        return 1 if self.state == "failed" else 0


class TrainerService:
    def __init__(self, cfg: Config, *, instance: str, weights: WeightSync, envs_alive: Callable[[], bool]) -> None:
        from atroposd.trainer.loop import Progress

        self.cfg = cfg
        self.instance = instance
        self.weights = weights
        self.envs_alive = envs_alive
        self.paths = Paths.of(cfg)
        self.progress = Progress(total_steps=cfg.trainer.steps)
        self._lock = anyio.Lock()
        self._loop: Any = None
        self._policy: Any = None
        self._metrics: Any = None
        self._stop = False
        # Cancelled by a stop request that comes before training starts (waits for the
        # inference server or the API must not hold up the daemon's stop).
        self._setup_scope = anyio.CancelScope()
        self.outcome: TrainerOutcome | None = None  # set when run() returns

    # ------------------------------------------------------------------ daemon interface

    def request_stop(self) -> None:
        """Finish (or abandon) the current step, checkpoint within checkpoint_timeout, return."""
        self._stop = True
        if self._loop is not None:
            self._loop.request_stop()
        else:
            self._setup_scope.cancel()

    def status(self) -> dict[str, Any]:
        """SPEC §2's ``trainer`` object."""
        p, last = self.progress, self.progress.last
        return {
            "state": p.state, "waiting_for": p.waiting_for if p.state == "waiting" else None,
            "step": p.step, "total_steps": p.total_steps, "weight_version": p.weight_version,
            "reward_mean": last.get("reward_mean"), "accuracy": last.get("accuracy"), "loss": last.get("loss"),
            "mean_kl": last.get("mean_kl"), "clipped_fraction": last.get("clipped_fraction"),
            "staleness": last.get("staleness"), "grad_norm": last.get("grad_norm"),
            "steps_per_s": p.steps_per_s, "skipped_steps": p.skipped_steps,
            "last_checkpoint": p.last_checkpoint, "checkpoint_error": p.checkpoint_error, "error": p.error,
            "metrics_dropped": self._metrics.dropped if self._metrics is not None else 0,
            "checkpoint_failures": p.checkpoint_failures,
            # groups the trainer refused since this process started, by reason (SPEC §13)
            "rejected_groups": dict(p.rejected_groups),
        }

    def metrics_view(self) -> dict[str, Any]:
        """What /metrics reads beyond the status: the last metrics row and the running totals."""
        from atroposd.trainer.batch import REASONS

        p = self.progress
        return {"last": dict(p.last), "seconds": dict(p.seconds), "tokens_total": p.tokens_total,
                "rejected_reasons": list(REASONS)}

    async def on_inference_restarted(self, replica: int | None = None) -> None:
        """A restarted inference replica (None: every one) gets the current weights before it
        serves rollouts."""
        if self._policy is None:
            return
        async with self._lock:
            await self.weights.reattach(self._policy.model, self.progress.weight_version, replica)
        log.info("weights re-attached to the restarted inference server", replica=replica,
                 weight_version=self.progress.weight_version)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> TrainerOutcome:
        p = self.progress
        started = False
        feed = None
        metrics = None
        wandb_sink = None
        try:
            from atroposd.trainer.feed import BatchFeed
            from atroposd.trainer.loop import TrainingLoop
            from atroposd.trainer.metrics import MetricsWriter
            from atroposd.trainer.setup import build_learner, load_for_training

            p.state, p.waiting_for = "waiting", "model"
            with self._setup_scope:
                setup = await anyio.to_thread.run_sync(load_for_training, self.cfg)
                self._policy = setup.policy
                p.step, p.weight_version, p.skipped_steps = setup.step, setup.weight_version, setup.skipped_steps
                p.last_checkpoint = str(setup.restored_from) if setup.restored_from else None
                p.waiting_for = "inference"
                await self._check_inference_tokenizer(setup.tokenizer_fingerprint)
                # The server computes with (shared) or loads (push/reload) the trainer's weights
                # and version before any rollout — also the restored ones after a resume.
                await self.weights.attach(setup.policy.model, p.weight_version)
                learner = await anyio.to_thread.run_sync(build_learner, self.cfg, setup)
                metrics = self._metrics = MetricsWriter(self.paths.metrics_file)
                if setup.restored_from is not None:
                    metrics.truncate_after(p.step)
                if self.cfg.wandb.enabled:
                    wandb_sink = self._start_wandb(metrics)
                p.waiting_for = "api"
                feed = BatchFeed(self.cfg.api_url, self._registration, max_ahead=self.cfg.trainer.max_staleness,
                                 token=self.cfg.api.token, on_wait=self._on_wait)
                await feed.register()
                await feed.prime()  # the first GET /batch lets environments register
                loop = TrainingLoop(tcfg=self.cfg.trainer, feed=feed, learner=learner, weights=self.weights,
                                    metrics=metrics, checkpointer=setup.checkpointer(learner), progress=p,
                                    envs_alive=self.envs_alive, lock=self._lock,
                                    # every 10 steps (on a terminal, `atroposd run` keeps a live
                                    # progress line below the log)
                                    progress_every=PROGRESS_EVERY)
                self._loop = loop
            if self._setup_scope.cancelled_caught or feed is None or self._loop is None:
                # stopped before training began: nothing new to checkpoint
                p.state, p.waiting_for = "stopped", None
                log.info("trainer stopped before training began", step=p.step)
                if not started:
                    task_status.started()
                self.outcome = TrainerOutcome("stopped", p.step, p.weight_version)
                return self.outcome
            if self._stop:
                loop.request_stop()
            p.state, p.waiting_for = "waiting", "data"
            started = True
            task_status.started()
            async with anyio.create_task_group() as tg:
                tg.start_soon(feed.run)
                result = await loop.run()
                tg.cancel_scope.cancel()
            if result == "stopped" and p.last_checkpoint != str(self.paths.checkpoints_dir / f"step-{p.step}"):
                await loop.checkpoint(deadline_s=self.cfg.daemon.checkpoint_timeout)
            p.state = result
            log.info("trainer " + result, step=p.step, weight_version=p.weight_version)
            self.outcome = TrainerOutcome(result, p.step, p.weight_version)
            return self.outcome
        except Exception as group:  # any failure ends the job: state failed, exit 1 (SPEC §4)
            exc = _root_cause(group)
            p.state, p.error = "failed", f"{type(exc).__name__}: {exc}"
            log.error("trainer failed", step=p.step, error=p.error, exc_info=not _expected(exc))
            if not started:
                task_status.started()
            self.outcome = TrainerOutcome("failed", p.step, p.weight_version, p.error)
            return self.outcome
        finally:
            with anyio.CancelScope(shield=True):
                if feed is not None:
                    await feed.aclose()
            if metrics is not None:
                metrics.close()
            if wandb_sink is not None:
                await anyio.to_thread.run_sync(wandb_sink.close, abandon_on_cancel=True)

    # ------------------------------------------------------------------ helpers

    def _on_wait(self, reason: str | None) -> None:
        p = self.progress
        if p.state in ("waiting", "training"):
            p.state, p.waiting_for = ("waiting", reason) if reason else ("training", None)

    def _start_wandb(self, metrics: Any) -> Any:
        """W&B logging of every metrics row (its own thread; a failure is a warning)."""
        from atroposd.config import to_dict
        from atroposd.trainer.wandb_sink import WandbSink

        config = to_dict(self.cfg)
        if config["api"].get("token"):
            config["api"]["token"] = "<set>"  # never a secret in the run's config
        sink = WandbSink.start(self.cfg, config)
        metrics.sinks.append(sink.log)
        return sink

    def _registration(self) -> dict[str, Any]:
        t = self.cfg.trainer
        # Atropos environments read the group and project from the API (/wandb_info) to group
        # their own W&B runs with the trainer's.
        from atroposd.trainer.wandb_sink import wandb_group

        w = self.cfg.wandb
        return {"wandb_group": wandb_group(self.cfg), "wandb_project": w.project if w.enabled else "",
                "batch_size": t.batch_size,
                "max_token_len": t.max_token_len, "checkpoint_dir": str(self.paths.checkpoints_dir),
                "save_checkpoint_interval": t.checkpoint_every, "starting_step": self.progress.step,
                "num_steps": t.steps}

    async def _check_inference_tokenizer(self, local: dict[str, Any]) -> None:
        """Compare the inference server's tokenizer (``GET /info``) with the trainer's."""
        import aiohttp
        import orjson

        from atroposd.trainer.model import check_tokenizers

        url = f"{self.cfg.inference_url}/info"
        deadline = time.monotonic() + max(INFO_TIMEOUT_S, self.cfg.inference.ready_timeout)
        delay = 0.05
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=INFO_TIMEOUT_S)) as session:
            while True:
                try:
                    async with session.get(url) as resp:
                        body = await resp.read()
                        status = resp.status
                    break
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"inference server at {self.cfg.inference_url} not reachable: "
                                           f"{exc}") from exc
                await anyio.sleep(delay)
                delay = min(delay * 2, 1.0)
        if status == 404:
            log.warning("the inference server has no /info; its tokenizer cannot be compared", url=url)
            return
        info = orjson.loads(body) if status == 200 else None
        remote = info.get("tokenizer") if isinstance(info, dict) else None
        if not isinstance(info, dict) or not isinstance(remote, dict):
            log.warning("the inference server's /info has no tokenizer fingerprint", url=url, status=status)
            return
        check_tokenizers(local, remote, local_name=str(self._policy.source),
                         remote_name=f"{info.get('model')} at {self.cfg.inference_url}")


def _root_cause(exc: BaseException) -> BaseException:
    """The one error inside (nested) single-member exception groups of the loop's task group."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _expected(exc: BaseException) -> bool:
    from atroposd.devices import DeviceError
    from atroposd.trainer.checkpoint import CheckpointError
    from atroposd.trainer.feed import DataTimeout
    from atroposd.trainer.model import ModelLoadError
    from atroposd.trainer.optim import OptimizerError
    from atroposd.trainer.setup import ResumeError

    return isinstance(exc, (DataTimeout, DeviceError, ModelLoadError, OptimizerError, CheckpointError, ResumeError))

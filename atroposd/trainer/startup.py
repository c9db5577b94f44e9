"""What the trainer does once, on its way to training (SPEC §4, start order): compare the
inference server's tokenizer with its own, register with the API, start W&B logging."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import structlog

if TYPE_CHECKING:
    from atroposd.config import Config
    from atroposd.trainer.loop import Progress
    from atroposd.trainer.metrics import MetricsWriter
    from atroposd.trainer.wandb_sink import WandbSink

__all__ = ["check_inference_tokenizer", "expected_failure", "registration", "start_wandb"]

log = structlog.get_logger("trainer", component="trainer")

INFO_TIMEOUT_S = 10.0


def start_wandb(cfg: Config, metrics: MetricsWriter) -> WandbSink:
    """W&B logging of every metrics row (its own thread; a failure is a warning)."""
    from atroposd.config import to_dict
    from atroposd.trainer.wandb_sink import WandbSink

    config = to_dict(cfg)
    if config["api"].get("token"):
        config["api"]["token"] = "<set>"  # never a secret in the run's config
    sink = WandbSink.start(cfg, config)
    metrics.sinks.append(sink.log)
    return sink


def registration(cfg: Config, checkpoints_dir: Path, progress: Progress) -> dict[str, Any]:
    """The trainer's ``POST /register`` body (read again at each registration: the step moves)."""
    t = cfg.trainer
    # Atropos environments read the group and project from the API (/wandb_info) to group
    # their own W&B runs with the trainer's.
    from atroposd.trainer.wandb_sink import wandb_group

    w = cfg.wandb
    return {
        "wandb_group": wandb_group(cfg),
        "wandb_project": w.project if w.enabled else "",
        "batch_size": t.batch_size,
        "max_token_len": t.max_token_len,
        "checkpoint_dir": str(checkpoints_dir),
        "save_checkpoint_interval": t.checkpoint_every,
        "starting_step": progress.step,
        "num_steps": t.steps,
    }


async def check_inference_tokenizer(cfg: Config, local: dict[str, Any], local_name: str) -> None:
    """Compare the inference server's tokenizer (``GET /info``) with the trainer's (``local``,
    loaded from ``local_name``)."""
    import aiohttp
    import orjson

    from atroposd.trainer.model import check_tokenizers

    url = f"{cfg.inference_url}/info"
    token = cfg.inference.token  # the inference servers' bearer token, if any (SPEC §12.3)
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + max(INFO_TIMEOUT_S, cfg.inference.ready_timeout)
    delay = 0.05
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=INFO_TIMEOUT_S)) as session:
        while True:
            try:
                async with session.get(url, headers=auth) as resp:
                    body = await resp.read()
                    status = resp.status
                break
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"inference server at {cfg.inference_url} not reachable: {exc}") from exc
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
    check_tokenizers(
        local,
        remote,
        local_name=local_name,
        remote_name=f"{info.get('model')} at {cfg.inference_url}",
    )


def expected_failure(exc: BaseException) -> bool:
    """A failure the trainer names in one line (its log entry carries no traceback)."""
    from atroposd.devices import DeviceError
    from atroposd.trainer.checkpoint import CheckpointError
    from atroposd.trainer.feed import DataTimeout
    from atroposd.trainer.model import ModelLoadError
    from atroposd.trainer.optim import OptimizerError
    from atroposd.trainer.setup import ResumeError

    return isinstance(exc, (DataTimeout, DeviceError, ModelLoadError, OptimizerError, CheckpointError, ResumeError))

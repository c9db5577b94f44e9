"""Per-step metrics: one JSON object per optimizer step in ``state_dir/metrics.jsonl`` (SPEC §9).

Fields: step, time, loss, reward_mean, reward_std, accuracy, weight_version, staleness,
mean_ratio, clipped_fraction, mean_kl, grad_norm, lr, tokens, batch_wait_s, step_s,
skipped_steps, sequences, rejected_groups, missing_logprobs, logprob_diff_abs_mean (trainer vs
rollout logprob of the same tokens), entropy (the policy's mean entropy per completion token, at
the rollout temperature, computed chunk by chunk with the logprobs) (+ distill_loss, distill_token_count when
distillation is on),
and the step's timeline: compute_s, sync_s, prepare_s, optimizer_s, pause_s, fetch_s,
rollout_gate_s, rollout_generate_s, rollout_delivery_s (:mod:`atroposd.timeline`, docs/WATCHING.md
"Where a step's time goes").
``staleness`` = the weight version trained *from* minus the oldest weight version the batch's
rollouts were generated with (null when the environments do not report it).
``rejected_groups`` = the groups batch preparation refused since the trainer started, by
reason (``{"token_out_of_range": 2, ...}``; SPEC §13), skipped batches' groups included.
The objective menu (SPEC §14): ``reward_mean_trained`` (the mean score of the trained groups;
``reward_mean`` and ``accuracy`` cover every group received for the step, the ones
``filter_groups`` dropped included), ``filtered_groups`` (groups dropped for this step) and
``rollout_corrected`` (the share of the batch's tokens a rollout correction truncated or masked;
null without one). ``swapped_token_share`` (SPEC §7): the share of the batch's trained completion
tokens sampled after a weight swap (by the groups' ``weight_versions``; 0 when none carries one).

A write that fails (disk full, unwritable) is dropped and counted, never fatal (SPEC §4).
Each row also goes to the writer's ``sinks`` (W&B: :mod:`atroposd.trainer.wandb_sink`).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import structlog

from atroposd.fsutil import write_atomic

__all__ = ["MetricsWriter", "read_metrics"]

log = structlog.get_logger("trainer", component="trainer")  # lazy: bound at first use


class MetricsWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.dropped = 0
        self._file: io.BufferedWriter | None = None
        self.sinks: list[Callable[[dict[str, Any]], None]] = []  # each row goes to these too (never raise)

    def _open(self) -> io.BufferedWriter:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab")  # kept open across steps
        return self._file

    def truncate_after(self, step: int) -> None:
        """On resume: drop lines of steps after ``step`` (trained but not checkpointed)."""
        if not self.path.is_file():
            return
        try:
            kept = [
                line
                for line in self.path.read_bytes().splitlines()
                if line.strip() and _step_of(line) is not None and (_step_of(line) or 0) <= step
            ]
            write_atomic(self.path, b"".join(line + b"\n" for line in kept), mode=0o644)
        except OSError as exc:
            log.warning("metrics file not trimmed at resume", path=str(self.path), error=str(exc))

    def write(self, record: dict[str, Any]) -> None:
        try:
            f = self._open()
            f.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
            f.flush()
        except (OSError, TypeError) as exc:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 100 == 0:
                log.warning("metrics line dropped", path=str(self.path), error=str(exc), dropped=self.dropped)
        for sink in self.sinks:
            sink(record)

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None


def _step_of(line: bytes) -> int | None:
    try:
        value = orjson.loads(line).get("step")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return value if isinstance(value, int) else None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every well-formed line of a metrics file (a torn last line is skipped)."""
    out = []
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out

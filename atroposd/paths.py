"""Where a job's files live, derived from the config (see docs/ARCHITECTURE.md, "Files")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from atroposd.config import Config


@dataclass(frozen=True)
class Paths:
    runtime_dir: Path
    state_dir: Path

    @classmethod
    def of(cls, cfg: Config) -> Paths:
        return cls(cfg.runtime_dir, cfg.state_dir)

    # runtime_dir ---------------------------------------------------------------
    @property
    def control_socket(self) -> Path:
        return self.runtime_dir / "control.sock"

    @property
    def pidfile(self) -> Path:
        return self.runtime_dir / "atroposd.pid"

    def inference_socket(self, port: int) -> Path:
        return self.runtime_dir / f"inference-{port}.sock"

    @property
    def weights_dir(self) -> Path:
        return self.runtime_dir / "weights"

    def child_config(self, nonce: str) -> Path:
        return self.runtime_dir / f"config-{nonce}.toml"

    # state_dir -----------------------------------------------------------------
    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    def log_file(self, component: str) -> Path:
        return self.logs_dir / f"{component}.log"

    @property
    def checkpoints_dir(self) -> Path:
        return self.state_dir / "checkpoints"

    @property
    def metrics_file(self) -> Path:
        return self.state_dir / "metrics.jsonl"

    @property
    def recovery_dir(self) -> Path:
        return self.state_dir / "recovery"

    @property
    def models_dir(self) -> Path:
        return self.state_dir / "models"

    @property
    def sync_dir(self) -> Path:
        return self.state_dir / "sync"

"""The facts about a checkpoint directory that both writers share — the one-file writer
(:mod:`atroposd.trainer.checkpoint`) and the sharded one (:mod:`atroposd.trainer.sharded`) —
and the error either raises. A leaf: it imports neither."""

from __future__ import annotations

__all__ = ["CHECKSUM_FILE", "CheckpointError"]

CHECKSUM_FILE = "checksums.json"


class CheckpointError(RuntimeError):
    pass

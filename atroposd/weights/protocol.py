"""What both sides of a weight exchange share, torch-free: the layout of a ``reload`` sync
directory (written by :mod:`atroposd.weights.reload` on the trainer's side, read by
:mod:`atroposd.weights.receiver` on the server's) and the error a refused update raises, so
that the inference front can name it in its ``except`` clauses without importing torch."""

from __future__ import annotations

__all__ = ["ADAPTER_DIR", "SYNC_FORMAT", "SYNC_WEIGHTS_FILE", "WeightUpdateError"]

SYNC_WEIGHTS_FILE = "model.safetensors"
ADAPTER_DIR = "adapter"
SYNC_FORMAT = "atroposd-sync-1"


class WeightUpdateError(ValueError):
    """A weight update that was refused; the model is unchanged."""

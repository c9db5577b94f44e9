"""What both sides of a weight exchange share, torch-free: the names of a ``reload`` sync
directory's files (written and read by :mod:`atroposd.weights.syncdir` only, for every writer
and reader) and the error a refused update raises, so that the inference front can name it in
its ``except`` clauses without importing torch."""

from __future__ import annotations

__all__ = ["ADAPTER_DIR", "SYNC_FORMAT", "SYNC_INDEX_FILE", "SYNC_WEIGHTS_FILE", "WeightUpdateError", "shard_name"]

# One file (one trainer rank) ...
SYNC_WEIGHTS_FILE = "model.safetensors"
# ... or, written a bucket at a time (several ranks), shards named by ``shard_name`` and an index
# in Hugging Face's layout: {"metadata": {"format", "weight_version", "tied", "lora", "total_size"},
# "weight_map": {tensor name: shard file name}}.
SYNC_INDEX_FILE = "model.safetensors.index.json"
ADAPTER_DIR = "adapter"
SYNC_FORMAT = "atroposd-sync-1"


def shard_name(index: int, count: int) -> str:
    """The file name of shard ``index`` (from 0) of ``count``: ``model-00001-of-00004.safetensors``."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


class WeightUpdateError(ValueError):
    """A weight update that was refused; the model is unchanged."""

"""A client for trainers that run outside atroposd (``[trainer] enabled = false``).

    from atroposd.client import BatchClient, InferenceControl

    client = BatchClient("http://127.0.0.1:8000", batch_size=64, max_token_len=512)
    batch = client.next_batch()      # numpy arrays: batch.tokens [S, L], batch.masks, batch.scores, ...

Batches come through shared memory when the API runs on this host, else as safetensors over
HTTP, else as JSON; the arrays are the same (SPEC §5 "Binary batches"). Needs numpy (and
orjson), not torch; ``Batch.torch()`` converts when torch is installed. See
docs/EXTERNAL-TRAINER.md.
"""

from atroposd.client.batches import TRANSPORTS, ApiError, Batch, BatchClient, InsecureTokenWarning
from atroposd.client.weights import InferenceControl, WeightsError

__all__ = ["TRANSPORTS", "ApiError", "Batch", "BatchClient", "InferenceControl", "InsecureTokenWarning", "WeightsError"]

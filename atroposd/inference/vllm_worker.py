"""The vLLM worker extension (``worker_extension_cls``): runs inside each vLLM worker process.

vLLM imports it by its qualified name (``WORKER_EXTENSION`` in
:mod:`atroposd.inference.vllm_engine`) in every worker before the worker loads its model, which
is what makes it the place to register atroposd's weight-transfer engine in vLLM's per-process
factory (:func:`atroposd.inference.vllm_transfer.register`): every weight update (push, reload,
broadcast) then goes through vLLM's own lifecycle (``start_weight_update`` / ``update_weights`` /
``finish_weight_update``) into :class:`~atroposd.inference.vllm_transfer.AtroposdTransferEngine`.

What is left here is reached with ``collective_rpc`` (only strings cross it): the workers'
count (``atroposd_ping``) and leaving a broadcast group while a receive may be blocked on it
(``atroposd_broadcast_leave``).

The module imports no vLLM at import time unless vLLM is loaded already (a worker).
"""

from __future__ import annotations

import os
import sys

__all__ = ["AtroposdWorkerExtension"]


class AtroposdWorkerExtension:
    """Mixed into vLLM's worker class; runs inside the worker process.

    Method names are prefixed so that they never collide with a worker attribute (vLLM
    asserts that).
    """

    def atroposd_ping(self) -> str:
        return str(os.getpid())

    def atroposd_broadcast_leave(self) -> str:
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is not None and hasattr(engine, "leave"):
            engine.leave()
        return "{}"


if "vllm" in sys.modules:  # a vLLM worker: register the transfer engine before the model is loaded
    from atroposd.inference.vllm_transfer import register

    register()

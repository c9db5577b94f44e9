"""The environment variables a GPU process of the job needs before torch or vLLM reads them
(SPEC §12.1), set over whatever the environment says.

* :data:`NCCL_ENV` — every process that may build an NCCL group: the daemon (rank 0 and the
  broadcast groups live there, whatever the rank count), its trainer ranks and every inference
  replica. torch's defaults tear the process down when a collective fails (a replica dying
  mid-broadcast would end the daemon); with these a failed collective raises in the caller
  and the group is aborted and formed again. torch reads them when a group is built, so they
  are set before the first one.
* :data:`VLLM_ENV` — a vLLM replica: its engine's workers start by ``spawn`` (vLLM's default
  is ``fork``, and it switches to ``spawn`` only when CUDA is already initialised, not when a
  call such as ``torch.cuda.is_available()`` has already made a forked child's CUDA unusable),
  and torch answers ``is_available()`` through NVML, without touching the CUDA driver, so that
  asking which device to use never poisons a later fork.
"""

from __future__ import annotations

from collections.abc import MutableMapping

__all__ = ["NCCL_ENV", "VLLM_ENV", "apply"]

NCCL_ENV: dict[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # CleanUpOnly: abort the communicator, raise, keep the process
    "TORCH_NCCL_ENABLE_MONITORING": "0",  # no heartbeat monitor that kills a process whose collective hangs
}

VLLM_ENV: dict[str, str] = {
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
}


def apply(env: MutableMapping[str, str], *, vllm: bool = False) -> MutableMapping[str, str]:
    """Set :data:`NCCL_ENV` (and with ``vllm`` :data:`VLLM_ENV`) in ``env``, overriding it;
    returns ``env``."""
    env.update(NCCL_ENV)
    if vllm:
        env.update(VLLM_ENV)
    return env

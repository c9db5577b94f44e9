"""Built-in environments and the Atropos environment protocol they speak.

- ``client``: the environment's side of the trajectory API — ``AtroposEnvClient`` (register
  through the "wait for trainer to start" gate, ``/status-env``, ``/scored_data`` retried until
  accepted, re-registration after an API restart, ``/disconnect-env``) and ``QueueGate`` (the
  cooperative throttle).
- ``generate``: ``InferenceClient`` for the inference server's ``POST /generate``.
- ``runner``: ``EnvRunner``, the loop every built-in task shares (groups in flight, throttle,
  signals, progress lines) and the ``EnvTask`` protocol a task implements.
- ``arithmetic``: the built-in task ``arithmetic`` (reward, exact-match accuracy, the
  prompt-ignoring bound, ``evaluate_exact_match`` for greedy evaluation).
- ``vocab``: the job's tokenizer through the ``tokenizers`` library (no torch, no transformers).
- ``cli``: ``atroposd env NAME``.

Nothing here imports torch: an environment child stays small and starts quickly.
"""

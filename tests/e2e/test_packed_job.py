"""The embedded job with packed micro-batches and the LM head in small chunks (SPEC §14
``micro_batch_tokens``, ``logprob_chunk``): it learns, and reports the policy's entropy."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.e2e.jobs import SHORT_TASK, job_config, run_short_learning_job


@pytest.mark.slow
def test_a_packed_job_in_chunks_learns_and_reports_entropy(short_tmp: Path) -> None:
    """Packed into micro-batches of at most 512 tokens (a few dozen sequences each), the head
    over 16 completion positions at a time (a pass holds many more): reward and accuracy rise as
    in the padded job, and every step's ``entropy`` is a mean entropy per token (between 0 and
    log of the vocabulary), falling as the policy learns the answers."""
    cfg = job_config(
        short_tmp,
        steps=400,
        envs=SHORT_TASK,
        trainer={"checkpoint_every": 400, "micro_batch_tokens": 512, "logprob_chunk": 16},
    )
    rows = run_short_learning_job(cfg, short_tmp / "state")
    entropies = [r["entropy"] for r in rows]
    assert all(isinstance(e, float) and 0 < e < math.log(22) for e in entropies), entropies[:5]
    first, last = sum(entropies[:10]) / 10, sum(entropies[-10:]) / 10
    assert last < first, (first, last)
    log = (short_tmp / "state" / "logs" / "daemon.log").read_text()
    assert "Traceback" not in log

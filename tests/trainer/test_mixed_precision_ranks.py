"""FSDP2's mixed-precision policy (SPEC §12.1) switched on on the CPU, in a real two-rank gloo
group: it casts the parameters, never the model's inputs — the sampling temperature and the
teacher's probabilities reach the root's forward in float32 — and two ranks score a batch as one
rank with a bf16 working copy does, within bf16's tolerance."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

PEER = (sys.executable, "-m", "tests.trainer.mixed_peer")
# bf16 keeps 8 significant bits: two ways of rounding the same computation to it agree within one ulp.
BF16_TOL = 2.0**-7


def _run_ranks(model_dir: Path, tmp_path: Path, world: int) -> list[dict[str, Any]]:
    store = tmp_path / "store"
    outs = [tmp_path / f"rank{r}.pt" for r in range(world)]
    logs = [tmp_path / f"rank{r}.log" for r in range(world)]
    procs = []
    try:
        for r in range(world):
            with open(logs[r], "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [*PEER, str(model_dir), str(r), str(world), str(store), str(outs[r])],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        # a rank that fails leaves the other waiting in the group: stop at the first failure
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{logs[r].read_text(errors='replace')[-3000:]}"
    return [torch.load(o, weights_only=False) for o in outs]


@pytest.mark.slow  # two interpreters and a group: about 10 s here
def test_two_ranks_with_mixed_precision_keep_float32_inputs_and_equal_one_rank(tiny_dir: Path, tmp_path: Path) -> None:
    ranks = _run_ranks(tiny_dir, tmp_path, 2)
    for r in ranks:
        # the policy is on: the root's parameters are bf16 inside its forward ...
        assert r["dtypes"]["embedding"] == "bfloat16", r["dtypes"]
        # ... and its inputs are as the trainer gave them (0.7 in bf16 would be 0.69921875)
        assert r["dtypes"]["temperature"] == "float32", r["dtypes"]
        assert r["dtypes"]["teacher_probs"] == "float32", r["dtypes"]
        assert r["dtypes"]["input_ids"] == "int64"
    one = ranks[0]
    for r in ranks:
        torch.testing.assert_close(r["logp"], one["one_rank_logp"], rtol=BF16_TOL, atol=BF16_TOL)
        torch.testing.assert_close(r["distill"], one["one_rank_distill"], rtol=BF16_TOL, atol=BF16_TOL)
    # both ranks computed the same thing (one gathered model)
    torch.testing.assert_close(ranks[0]["logp"], ranks[1]["logp"], rtol=0, atol=0)

"""Two trainer ranks equal one (SPEC §12.1) with the objective menu on: GSPO's sequence ratio,
clip-higher, a sequence-level rollout correction, per-sequence aggregation and RLOO, on real
processes and a real gloo group (the harness of test_ranks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.test_ranks import LOSS_TOL, PARAM_TOL, _config, _run, _worst

MENU = {
    "loss": "gspo",
    "clip_eps_high": 0.28,
    "rollout_correction": "seq-tis",
    "rollout_correction_threshold": 1.5,
    "loss_agg": "seq-mean-token-mean",
    "advantage": "rloo",
    "lr_schedule": "cosine",
    "steps": 3,
}


@pytest.mark.slow  # two rank-0 runs with a real gloo group: ~55 s on 2 cores
def test_two_ranks_equal_one_rank_with_gspo_and_a_rollout_correction(tiny_dir: Path, tmp_path: Path) -> None:
    one = _run(_config(tmp_path, "one", tiny_dir, "cpu", **MENU), tmp_path / "one.pt", "--steps", "2")
    two = _run(_config(tmp_path, "two", tiny_dir, ["cpu", "cpu"], **MENU), tmp_path / "two.pt", "--steps", "2")
    for a, b in zip(one["losses"], two["losses"], strict=True):
        assert abs(a - b) <= LOSS_TOL, (one["losses"], two["losses"])
    assert _worst(one["params"], two["params"]) <= PARAM_TOL
    assert one["losses"][0] != one["losses"][1]  # the first step moved the weights

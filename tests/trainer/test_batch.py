"""Batch preparation: shift by one, masks, sentinels, advantages, rejected groups."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from atroposd.trainer.batch import BatchError, group_advantages, prepare_batch
from tests.trainer.conftest import make_groups


def test_equal_scores_give_exactly_zero_advantages() -> None:
    assert group_advantages([0.1, 0.1, 0.1], 0.1) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0] * 8, 0.1) == [0.0] * 8


def test_near_zero_variance_is_not_scaled_up_to_unit_size() -> None:
    adv = group_advantages([0.5, 0.5 + 1e-9, 0.5, 0.5 - 1e-9], 0.1)
    assert max(abs(a) for a in adv) < 1e-7


def test_group_advantage_values_and_size_one_rule() -> None:
    assert group_advantages([0.0, 1.0], 0.1) == pytest.approx([-1.0, 1.0])
    assert group_advantages([0.0, 0.1], 0.1) == pytest.approx([-0.5, 0.5])  # std 0.05 < floor 0.1
    assert group_advantages([0.7], 0.1) == [0.0]
    n = 8
    adv = group_advantages([1.0] + [0.0] * (n - 1), 0.1)
    assert max(abs(a) for a in adv) <= math.sqrt(n)


def test_rows_are_shifted_and_sentinels_become_missing() -> None:
    group = {"tokens": [[1, 5, 6, 7, 2]], "masks": [[-100, -100, 6, 7, 2]], "scores": [1.0],
             "inference_logprobs": [[1.0, 1.0, -0.5, 1.0, -0.7]]}
    batch = prepare_batch([group], micro_batch_size=4, max_token_len=16, adv_std_floor=0.1)
    mb = batch.micro[0]
    assert mb.input_ids.tolist() == [[1, 5, 6, 7]]
    assert mb.labels.tolist() == [[5, 6, 7, 2]]
    assert mb.mask.tolist() == [[False, True, True, True]]
    old = mb.old_logp[0].tolist()
    assert math.isnan(old[0]) and old[1] == pytest.approx(-0.5) and math.isnan(old[2])
    assert old[3] == pytest.approx(-0.7)
    assert batch.completion_tokens == 3 and batch.missing_logprobs == 1


def test_padding_micro_batches_and_metrics() -> None:
    groups = make_groups(0, n=3, size=4, accuracy=0.5, version=3)
    groups[1]["tokens"][0] = groups[1]["tokens"][0] + [4, 5]
    groups[1]["masks"][0] = groups[1]["masks"][0] + [4, 5]
    groups[1]["inference_logprobs"][0] = groups[1]["inference_logprobs"][0] + [-1.0, -1.0]
    batch = prepare_batch(groups, micro_batch_size=5, max_token_len=64, adv_std_floor=0.1)
    assert [m.input_ids.shape[0] for m in batch.micro] == [5, 5, 2]
    assert batch.micro[0].input_ids.shape[1] == 8 and batch.micro[1].input_ids.shape[1] == 6
    assert batch.sequences == 12 and batch.accuracy == 0.5 and batch.weight_versions == [3, 3, 3]
    assert batch.completion_tokens == 12 * 3 + 2
    scores = [s for g in groups for s in g["scores"]]
    assert batch.reward_mean == pytest.approx(sum(scores) / len(scores))


def test_bad_groups_are_rejected_and_the_rest_kept() -> None:
    groups = make_groups(1, n=4, size=2)
    groups[0]["scores"][1] = float("nan")
    groups[1]["masks"][0] = groups[1]["masks"][0][:-1]
    groups[2]["tokens"][0] = [1] * 100  # longer than max_token_len
    batch = prepare_batch(groups, micro_batch_size=8, max_token_len=32, adv_std_floor=0.1)
    assert batch.rejected == 3 and batch.sequences == 2
    with pytest.raises(BatchError, match="no usable sequence"):
        prepare_batch(groups[:3], micro_batch_size=8, max_token_len=32, adv_std_floor=0.1)


def test_environment_advantages_and_overrides_win() -> None:
    group = make_groups(2, n=1, size=2)[0]
    group["advantages"] = [[0.0] * 7, [0.25] * 7]
    group["overrides"] = [{"set_advantage_to_zero": True, "temperature": 0.5}, {}]
    group["generation_params"] = {"temperature": 0.8}
    mb = prepare_batch([group], micro_batch_size=8, max_token_len=32, adv_std_floor=0.1).micro[0]
    assert not mb.advantages[0].any()
    assert mb.advantages[1, :6].tolist() == pytest.approx([0.25] * 6)
    assert mb.temperature.tolist() == pytest.approx([0.5, 0.8])


def test_distill_payload_is_shifted_to_the_predicting_position() -> None:
    group = {"tokens": [[1, 5, 6, 2]], "masks": [[-100, 5, 6, 2]], "scores": [1.0],
             "inference_logprobs": [[1.0, -1.0, -1.0, -1.0]],
             "distill_token_ids": [[None, [5, 7], [6], [2, 3]]],
             "distill_logprobs": [[None, [-0.1, -2.0], [-0.2], [-0.3, -1.5]]]}
    batch = prepare_batch([group], micro_batch_size=4, max_token_len=16, adv_std_floor=0.1, use_distill=True)
    mb = batch.micro[0]
    assert mb.distill_ids is not None and mb.distill_lp is not None
    # input position 0 predicts token 1 (5): the teacher's top-k for token 1
    assert mb.distill_ids[0].tolist() == [[5, 7], [6, -1], [2, 3]]
    assert batch.distill_positions == 3


def test_metrics_writer_counts_what_it_cannot_write(tmp_path: Path) -> None:
    from atroposd.trainer.metrics import MetricsWriter, read_metrics

    blocked = tmp_path / "file"
    blocked.write_text("")
    writer = MetricsWriter(blocked / "metrics.jsonl")  # its directory is a file: every write fails
    writer.write({"step": 1})
    writer.write({"step": 2})
    assert writer.dropped == 2
    good = MetricsWriter(tmp_path / "m.jsonl")
    for step in (1, 2, 3):
        good.write({"step": step, "loss": 0.5})
    good.close()
    good.truncate_after(2)
    assert [r["step"] for r in read_metrics(tmp_path / "m.jsonl")] == [1, 2]

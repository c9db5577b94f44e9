"""Batch preparation: shift by one, masks, sentinels, advantages, rejected groups."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

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
    group = {
        "tokens": [[1, 5, 6, 7, 2]],
        "masks": [[-100, -100, 6, 7, 2]],
        "scores": [1.0],
        "inference_logprobs": [[1.0, 1.0, -0.5, 1.0, -0.7]],
    }
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
    assert batch.rejected_by_reason == {"score_invalid": 1, "malformed": 1, "too_long": 1}
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
    group = {
        "tokens": [[1, 5, 6, 2]],
        "masks": [[-100, 5, 6, 2]],
        "scores": [1.0],
        "inference_logprobs": [[1.0, -1.0, -1.0, -1.0]],
        "distill_token_ids": [[None, [5, 7], [6], [2, 3]]],
        "distill_logprobs": [[None, [-0.1, -2.0], [-0.2], [-0.3, -1.5]]],
    }
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


def _reasons(groups: list[Any], **kw: Any) -> dict[str, int]:
    try:
        return prepare_batch(
            groups, micro_batch_size=8, max_token_len=32, adv_std_floor=0.1, vocab_size=22, **kw
        ).rejected_by_reason
    except BatchError as exc:
        return exc.rejected


def test_each_defect_is_rejected_under_its_reason() -> None:
    """SPEC §13: out-of-vocabulary and negative ids, bad distillation ids, non-finite or absurd
    advantages and scores — each group rejected and counted by reason, the others trained on."""

    def group(**change: Any) -> dict[str, Any]:
        g = make_groups(5, n=1, size=2)[0]
        g.update(change)
        return g

    good = group()
    vocab = group(tokens=[good["tokens"][0], [*good["tokens"][1][:-1], 22]])
    negative = group(tokens=[[-1, *good["tokens"][0][1:]], good["tokens"][1]])
    nan_scalar = group(advantages=[float("nan"), 0.5])
    huge_scalar = group(advantages=[1e4 + 1, 0.0])
    huge_list = group(advantages=[[0.0] * 7, [2e4] * 7])
    ok_list = group(advantages=[[0.0] * 7, [1e4] * 7])
    inf_score = group(scores=[float("inf"), 0.0])
    huge_score = group(scores=[1e300, -1e300])
    d_ids = [[None] + [[5, -1]] * 6] * 2
    d_lps = [[None] + [[-0.5, 0.0]] * 6] * 2
    distill_ok = group(distill_token_ids=d_ids, distill_logprobs=d_lps)
    distill_high = group(distill_token_ids=[d_ids[0], [None] + [[22]] * 6], distill_logprobs=[d_lps[0], d_lps[0]])
    distill_low = group(distill_token_ids=[[None] + [[-2, 5]] * 6] * 2, distill_logprobs=d_lps)
    distill_nan = group(distill_token_ids=d_ids, distill_logprobs=[[None] + [[float("nan"), 0.0]] * 6] * 2)
    distill_wide = group(
        distill_token_ids=[[None] + [[5] * 257] * 6] * 2, distill_logprobs=[[None] + [[-1.0] * 257] * 6] * 2
    )
    groups = [
        good,
        vocab,
        negative,
        nan_scalar,
        huge_scalar,
        huge_list,
        ok_list,
        inf_score,
        huge_score,
        distill_ok,
        distill_high,
        distill_low,
        distill_nan,
        distill_wide,
    ]
    batch = prepare_batch(
        groups, micro_batch_size=8, max_token_len=32, adv_std_floor=0.1, vocab_size=22, use_distill=True
    )
    assert batch.rejected_by_reason == {
        "token_out_of_range": 2,
        "advantage_invalid": 3,
        "score_invalid": 2,
        "distill_invalid": 4,
    }
    assert batch.sequences == 3 * 2 and batch.rejected == 11
    # without distillation the teacher fields are not read, so they cannot reject a group
    assert _reasons([distill_high, distill_low]) == {}
    # without a vocabulary size, ids still must be ≥ 0
    assert prepare_batch(
        [vocab, negative], micro_batch_size=8, max_token_len=32, adv_std_floor=0.1
    ).rejected_by_reason == {"token_out_of_range": 1}


def test_a_positive_or_out_of_float32_teacher_logprob_is_rejected() -> None:
    """Found by the batch fuzz: 3.4028235677973366e+38 is finite as a Python float but infinite
    in the float32 tensor; a log-probability is never positive anyway."""

    def group(lps: list[float]) -> dict[str, Any]:
        g = make_groups(5, n=1, size=2)[0]
        g.update(distill_token_ids=[[None] + [[5, 6]] * 6] * 2, distill_logprobs=[[None] + [lps] * 6] * 2)
        return g

    for bad in ([0.0, 3.4028235677973366e38], [-0.5, 0.7], [-1e300, -0.1]):
        assert _reasons([group(bad)], use_distill=True) == {"distill_invalid": 1}, bad
    batch = prepare_batch(
        [group([-0.5, 0.0]), group([-2.0, -1e20])],
        micro_batch_size=8,
        max_token_len=32,
        adv_std_floor=0.1,
        vocab_size=22,
        use_distill=True,
    )
    assert batch.rejected == 0 and batch.micro[0].distill_lp is not None
    assert bool(torch.isfinite(batch.micro[0].distill_lp).all())


def test_any_other_exception_of_one_group_is_a_rejection() -> None:
    class Hostile(dict[str, Any]):
        def get(self, key: Any, default: Any = None) -> Any:
            if key == "overrides":
                raise RuntimeError("boom")
            return super().get(key, default)

    good = make_groups(6, n=2, size=2)
    batch = prepare_batch(
        [Hostile(good[0]), good[1], "not a group"], micro_batch_size=8, max_token_len=32, adv_std_floor=0.1
    )
    assert batch.rejected_by_reason == {"error": 1, "malformed": 1} and batch.sequences == 2

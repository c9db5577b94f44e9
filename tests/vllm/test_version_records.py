"""The vLLM engine's ``weight_version`` and ``weight_versions`` (SPEC §7) from vLLM's own output
objects (``CompletionOutput`` with its ``WeightVersionSpan`` labels): the n copies of one request
may begin on both sides of a keep-swap, and the answer must still be one the trainer accepts —
every record starting at ``[0, weight_version]`` and naming the weights that sampled each token."""

from __future__ import annotations

import random
from typing import Any

import pytest

from atroposd.groupext import sampled_versions, version_records
from atroposd.trainer.batch import prepare_batch
from tests.trainer.conftest import make_group

pytestmark = pytest.mark.vllm


def _completion(index: int, length: int, spans: list[tuple[int, int, int]] | None) -> Any:
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, WeightVersionSpan

    ids = [5 + (index + k) % 7 for k in range(length)]
    return CompletionOutput(
        index=index,
        text="x" * length,
        token_ids=ids,
        cumulative_logprob=None,
        logprobs=[{t: Logprob(logprob=-0.5)} for t in ids],
        finish_reason="length",
        weight_versions=None if spans is None else [WeightVersionSpan(str(v), a, b) for v, a, b in spans],
    )


def _answer(admitted: int, spans: list[list[tuple[int, int, int]] | None], length: int = 4) -> dict[str, Any]:
    from vllm.outputs import RequestOutput

    from atroposd.inference.vllm_engine import _response

    out = RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1, 2, 3],
        prompt_logprobs=None,
        outputs=[_completion(i, length, s) for i, s in enumerate(spans)],
        finished=True,
    )
    return _response(out, admitted, want_prompt_logprobs=False)


def _group_of(answer: dict[str, Any]) -> dict[str, Any]:
    """The group an environment posts from the answer (the built-in environments' fields)."""
    n = len(answer["token_ids"])
    g = make_group(
        random.Random(1), size=n, completion_len=len(answer["token_ids"][0]), version=answer["weight_version"]
    )
    g["scores"] = [float(i % 2) for i in range(n)]
    if "weight_versions" in answer:
        g["group_overrides"]["atroposd"]["weight_versions"] = answer["weight_versions"]
    return g


def test_copies_begun_on_both_sides_of_a_swap_give_records_the_trainer_accepts() -> None:
    # admitted at 1; copy 0 sampled its first two tokens under 1, then 2; copy 1 was first
    # scheduled after the swap: all four of its tokens under 2; copy 2 never saw the swap
    answer = _answer(1, [[(1, 0, 2), (2, 2, 4)], [(2, 0, 4)], [(1, 0, 4)]])
    assert answer["weight_version"] == 1
    assert answer["weight_versions"] == [[[0, 1], [2, 2]], [[0, 1], [0, 2]], [[0, 1]]]
    group = _group_of(answer)
    assert version_records(group, 3) == [[(0, 1), (2, 2)], [(0, 1), (0, 2)], [(0, 1)]]
    assert sampled_versions(group) == [1, 2]
    batch = prepare_batch([group], micro_batch_size=8, max_token_len=64, adv_std_floor=1e-6)
    assert batch.rejected_by_reason == {} and batch.sequences == 3
    assert batch.swapped_tokens == 2 + 4  # copy 0's last two, every token of copy 1


def test_every_copy_begun_after_the_swap_names_the_new_weights_alone() -> None:
    answer = _answer(1, [[(2, 0, 4)], [(2, 0, 4)]])
    assert answer["weight_version"] == 2 and "weight_versions" not in answer
    group = _group_of(answer)
    assert sampled_versions(group) == [2]
    batch = prepare_batch([group], micro_batch_size=8, max_token_len=64, adv_std_floor=1e-6)
    assert batch.rejected_by_reason == {} and batch.swapped_tokens == 0


def test_copies_begun_after_two_swaps_open_at_the_oldest_they_began_under() -> None:
    # admitted at 3, nothing sampled under it; the copies began under 4 and 5
    answer = _answer(3, [[(4, 0, 1), (5, 1, 4)], [(5, 0, 4)], None])
    # copy 2 carries no labels at all: vLLM sampled it under the admission version
    assert answer["weight_version"] == 3
    assert answer["weight_versions"] == [[[0, 3], [0, 4], [1, 5]], [[0, 3], [0, 5]], [[0, 3]]]
    group = _group_of(answer)
    assert sampled_versions(group) == [3, 4, 5]
    batch = prepare_batch([group], micro_batch_size=8, max_token_len=64, adv_std_floor=1e-6)
    assert batch.rejected_by_reason == {} and batch.swapped_tokens == 4 + 4

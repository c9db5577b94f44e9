"""One group schema for the API and the trainer (atroposd/groups.py): a malformed group is refused
by both, with the same message naming the same field.

The API refuses it over real loopback HTTP (``POST /scored_data`` to an atroposd API child); the
trainer refuses it where a batch's groups are prepared (``rows_of_group``), as it would a group
that reached it over the network.
"""

from __future__ import annotations

from typing import Any

import pytest

from atroposd.groups import SchemaError, group_from_json
from atroposd.trainer.batch import REASONS, GroupRejected, rows_of_group
from tests.api.conftest import Api, group


def _malformed() -> list[tuple[str, dict[str, Any], str, str]]:
    """(case, group, the field named, the trainer's reason)."""
    cases: list[tuple[str, dict[str, Any], str, str]] = []

    def case(name: str, field: str, reason: str = "malformed", **change: Any) -> None:
        g = group(2, length=6)
        g.update(change)
        cases.append((name, {k: v for k, v in g.items() if v is not None}, field, reason))

    base = group(2, length=6)
    case("a mask row too short", "masks", masks=[base["masks"][0], base["masks"][1][:-1]])
    case("masks missing", "masks", masks=None)
    case(
        "a logprob row too long", "inference_logprobs", inference_logprobs=[base["inference_logprobs"][0] + [-1.0]] * 2
    )
    case("one score too many", "scores", scores=[0.0, 1.0, 0.5])
    case("a score that is text", "scores", scores=[0.0, "high"])
    case("a token row that is a number", "tokens", tokens=[7, base["tokens"][1]])
    case("a token that is text", "tokens", tokens=[base["tokens"][0], [*base["tokens"][1][:-1], "x"]])
    case("no sequence", "tokens", tokens=[], masks=[], scores=[], inference_logprobs=[])
    case(
        "teacher ids for one sequence of two",
        "distill_token_ids",
        "distill_invalid",
        distill_token_ids=[[None] * 6],
        distill_logprobs=[[None] * 6, [None] * 6],
    )
    return cases


CASES = _malformed()


@pytest.mark.parametrize(("body", "field", "reason"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_api_and_the_trainer_refuse_a_malformed_group_naming_the_same_field(
    api: Api, body: dict[str, Any], field: str, reason: str
) -> None:
    reply = api.post("/scored_data", body)
    assert reply.status in (400, 422), (reply.status, reply.body[:300])
    detail = reply.json()["detail"]
    assert field in detail, detail

    with pytest.raises(SchemaError) as schema:
        group_from_json(body)
    assert schema.value.field == field and str(schema.value) == detail

    with pytest.raises(GroupRejected) as trainer:
        rows_of_group(body, std_floor=0.1, max_token_len=64, use_distill=True, vocab_size=1000)
    assert trainer.value.field == field, (trainer.value.field, str(trainer.value))
    assert str(trainer.value) == detail  # the same words as the API's 4xx
    assert trainer.value.reason == reason and reason in REASONS

"""The built-in environments pass a response's ``weight_versions`` (SPEC §7) on in
``group_overrides.atroposd.weight_versions``, one record per completion, and check its shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from atroposd.envs.arithmetic import Problem, build_group
from atroposd.envs.generate import GenerateError, parse_generation
from atroposd.envs.vocab import Vocab
from atroposd.groupext import version_records


def test_weight_versions_reach_the_group(tokenizer_dir: Path) -> None:
    answer = {
        "logprobs": [[[{"5": -0.1}], [{"6": -0.2}], [{"2": -0.3}]], [[{"9": -1.0}], [{"2": -0.5}]]],
        "finish_reasons": ["stop", "stop"],
        "weight_version": 4,
        "weight_versions": [[[0, 4], [2, 5]], [[0, 4]]],
    }
    gen = parse_generation(answer, 2)
    assert gen.weight_versions == [[[0, 4], [2, 5]], [[0, 4]]]
    vocab = Vocab.load(tokenizer_dir)
    problem = Problem(7, "+", 5)
    group = build_group(
        problem, vocab.encode_prompt(problem.prompt), gen, vocab, env_name="a", temperature=1.0, max_tokens=3
    )
    ext = group.payload["group_overrides"]["atroposd"]
    assert ext["weight_version"] == 4 and ext["weight_versions"] == [[[0, 4], [2, 5]], [[0, 4]]]
    assert version_records(group.payload, 2) == [[(0, 4), (2, 5)], [(0, 4)]]  # what the trainer accepts
    plain = parse_generation({k: v for k, v in answer.items() if k != "weight_versions"}, 2)
    assert plain.weight_versions is None
    unchanged = build_group(
        problem, vocab.encode_prompt(problem.prompt), plain, vocab, env_name="a", temperature=1.0, max_tokens=3
    )
    assert "weight_versions" not in unchanged.payload["group_overrides"]["atroposd"]
    for bad in ([[[0, 4]]], [[[0, "4"]], [[0, 4]]], "x", [[], [[0, 4]]]):
        with pytest.raises(GenerateError, match="weight_versions"):
            parse_generation({**answer, "weight_versions": bad}, 2)

"""The arithmetic task without I/O: reward table, the prompt-ignoring bound, options, tokenizer,
group layout and the greedy evaluation helper."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from atroposd.envoptions import ArithmeticOptions, parse_options, validate_options
from atroposd.envs.arithmetic import (
    ArithmeticTask,
    Problem,
    all_problems,
    build_group,
    evaluate_exact_match,
    prompt_ignoring_bound,
    score,
)
from atroposd.envs.generate import Completion, GenerateError, Generation, parse_generation
from atroposd.envs.vocab import Vocab, VocabError


@pytest.mark.parametrize(
    ("answer", "text", "ended", "reward"),
    [
        ("12", "12", True, 1.0),  # exact, then EOS
        ("7", "7", True, 1.0),
        ("12", "12", False, 0.4),  # right digits but no EOS: lead credit only
        ("12", "13", True, 0.5),  # right lead, well formed
        ("12", "1", True, 0.5),
        ("12", "1+", True, 0.4),  # right lead, malformed
        ("12", "21", True, 0.1),  # wrong lead, well formed
        ("12", "", True, 0.0),  # EOS at once
        ("12", "+", True, 0.0),
        ("7", "70", True, 0.5),
        ("-3", "-3", True, 1.0),
        ("-3", "-4", True, 0.1),  # the lead of a negative answer is the sign and first digit
        ("-3", "-", True, 0.0),
        ("-3", "3", True, 0.1),
        ("12", "12[BOS]", True, 0.4),  # a special token inside is never well formed
    ],
)
def test_reward_table(answer: str, text: str, ended: bool, reward: float) -> None:
    assert score(answer, text, ended) == pytest.approx(reward)


def test_all_rewards_in_unit_interval() -> None:
    alphabet = [*"0123456789-+"]
    for n in range(4):
        for chars in itertools.product(alphabet, repeat=n):
            for ended in (True, False):
                assert 0.0 <= score("12", "".join(chars), ended) <= 1.0


def test_default_task_is_the_100_single_digit_sums() -> None:
    problems = all_problems(ArithmeticOptions())
    assert len(problems) == 100 and len(set(problems)) == 100
    assert Problem(3, "+", 4).prompt == "3+4=" and Problem(3, "+", 4).answer == "7"
    assert Problem(3, "-", 5).answer == "-2" and Problem(9, "*", 9).answer == "81"


def test_prompt_ignoring_bound_default_is_one_third() -> None:
    """The best answer that ignores the prompt is "10" then EOS: 9 sums are exactly 10, 38 more
    start with 1 (1, 11..18), the other 53 are only well formed:
    (9 × 1.0 + 38 × 0.5 + 53 × 0.1) / 100 = 0.333, a third of the maximum and under SPEC §8's 0.35."""
    value, best = prompt_ignoring_bound(all_problems(ArithmeticOptions()))
    assert best == "10"
    assert value == pytest.approx((9 * 1.0 + 38 * 0.5 + 53 * 0.1) / 100)
    assert value == pytest.approx(0.333)
    assert value <= 0.35


def _brute_force_bound(problems: list[Problem], max_tokens: int) -> float:
    """Every completion a prompt-ignoring policy could emit, scored on every problem."""
    symbols = [*"0123456789", "-", "+", None]  # None: EOS
    best = 0.0
    for n in range(1, max_tokens + 1):
        for seq in itertools.product(symbols, repeat=n):
            ended = None in seq
            text = "".join(s for s in seq[: seq.index(None)] if s) if ended else "".join(s for s in seq if s)
            value = sum(score(p.answer, text, ended) for p in problems) / len(problems)
            best = max(best, value)
    return best


@pytest.mark.parametrize(
    "options",
    [
        ArithmeticOptions(),
        ArithmeticOptions(operators=("-",)),
        ArithmeticOptions(operators=("+", "-", "*")),
        ArithmeticOptions(max_operand=4),
    ],
)
def test_prompt_ignoring_bound_matches_enumeration(options: ArithmeticOptions) -> None:
    problems = all_problems(options)
    value, _ = prompt_ignoring_bound(problems)
    assert value == pytest.approx(_brute_force_bound(problems, options.max_tokens))


def test_options_validation() -> None:
    assert validate_options("arithmetic", {}) == []
    assert validate_options("arithmetic", {"operators": ["+", "*"], "max_tokens": 3}) == []
    problems = dict(validate_options("arithmetic", {"operators": ["/"], "temperature": 0, "bogus": 1}))
    assert set(problems) == {"temperature", "bogus", "operators"}  # every problem at once
    assert "unknown operator" in problems["operators"]
    msg = dict(validate_options("arithmetic", {"max_operand": 99}))["max_tokens"]
    assert "≥ 4" in msg
    assert validate_options("arithmetic", {"max_operand": 99, "max_tokens": 4}) == []
    assert "≥ 3" in dict(validate_options("arithmetic", {"operators": ["-"], "max_tokens": 2}))["max_tokens"]
    with pytest.raises(ValueError, match=r"options\.concurrency"):
        parse_options("arithmetic", {"concurrency": "8"})
    assert parse_options("arithmetic", {"operators": ["+", "-"]}).operators == ("+", "-")


def test_vocab_round_trip(tokenizer_dir: Path) -> None:
    vocab = Vocab.load(tokenizer_dir)
    assert (vocab.bos_id, vocab.eos_id) == (1, 2)
    ids = vocab.encode_prompt("3+4=")
    assert ids == [1, 7, 14, 8, 17]
    assert vocab.decode_completion([5, 6, 2]) == ("12", True)
    assert vocab.decode_completion([5, 6, 7]) == ("123", False)
    assert vocab.decode_completion([2, 5]) == ("", True)
    text, ended = vocab.decode_completion([5, 1])
    assert not ended and text != "1" and score("1", text, True) < 1
    with pytest.raises(VocabError, match="outside the vocabulary"):
        vocab.encode_prompt("3/4=")
    with pytest.raises(VocabError, match=r"no tokenizer\.json"):
        Vocab.load(tokenizer_dir.parent)


def test_group_layout(tokenizer_dir: Path) -> None:
    """tokens = prompt + completion; masks -100 over the prompt; logprobs aligned with tokens,
    1.0 over the prompt; scores and accuracy per completion."""
    vocab = Vocab.load(tokenizer_dir)
    problem = Problem(7, "+", 5)
    prompt = vocab.encode_prompt(problem.prompt)
    gen = Generation(
        completions=[
            Completion([5, 6, 2], [-0.1, -0.2, -0.3], "stop"),  # "12" EOS: exact
            Completion([5, 7, 2], [-0.4, -0.5, -0.6], "stop"),  # "13" EOS: 0.5
            Completion([9, 9, 9], [-1.0, -1.1, -1.2], "length"),  # "555": 0.0
            Completion([2], [-0.7], "stop"),  # EOS at once
        ],
        weight_version=4,
    )
    group = build_group(problem, prompt, gen, vocab, env_name="arithmetic-0", temperature=1.0, max_tokens=3)
    p = group.payload
    assert p["scores"] == [1.0, 0.5, 0.0, 0.0]
    assert group.correct == [True, False, False, False] and group.accuracy == 0.25
    for tokens, masks, lps, c in zip(p["tokens"], p["masks"], p["inference_logprobs"], gen.completions, strict=True):
        assert tokens == prompt + c.token_ids
        assert len(tokens) == len(masks) == len(lps)
        assert masks == [-100] * len(prompt) + c.token_ids
        assert lps == [1.0] * len(prompt) + c.logprobs
    assert p["group_overrides"]["atroposd"] == {
        "weight_version": 4,
        "accuracy": 0.25,
        "reward_mean": 0.375,
        "env": "arithmetic-0",
    }
    assert p["generation_params"]["temperature"] == 1.0
    assert "env_id" not in p
    # each completion's finish reason, for trainer.overlong = "mask"
    assert p["overrides"] == [{"finish_reason": c.finish_reason} for c in gen.completions]


def test_parse_generation_checks_the_protocol() -> None:
    ok = {
        "logprobs": [[[{"5": -0.1}], [{"2": -0.2}]]],
        "finish_reasons": ["stop"],
        "token_ids": [[5, 2]],
        "weight_version": 3,
    }
    gen = parse_generation(ok, 1)
    assert gen.completions[0].token_ids == [5, 2] and gen.completions[0].logprobs == [-0.1, -0.2]
    assert gen.weight_version == 3
    with pytest.raises(GenerateError, match="disagree"):
        parse_generation({**ok, "token_ids": [[5, 3]]}, 1)
    with pytest.raises(GenerateError, match="for 2 completions"):
        parse_generation(ok, 2)
    with pytest.raises(GenerateError, match="logprobs\\[0\\]\\[0\\]"):
        parse_generation({**ok, "logprobs": [[[{"5": -0.1, "6": -2.0}], [{"2": -0.2}]]]}, 1)


def test_task_is_seeded(tokenizer_dir: Path) -> None:
    vocab = Vocab.load(tokenizer_dir)
    draw = [ArithmeticTask(ArithmeticOptions(), vocab, seed=s, env_name="a").next_item() for s in (1, 1, 2)]
    assert draw[0] == draw[1] != draw[2]
    assert ArithmeticTask(ArithmeticOptions(), vocab, seed=0, env_name="a").max_sequence_len == 5 + 3


def test_evaluate_exact_match(tokenizer_dir: Path) -> None:
    vocab = Vocab.load(tokenizer_dir)
    problems = all_problems(ArithmeticOptions())

    def oracle_except_sums_over_15(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        out = []
        for ids in prompts:
            a, b = ids[1] - 4, ids[3] - 4
            answer = str(a + b) if a + b <= 15 else "0"
            out.append([*vocab.encode_prompt(answer)[1:], vocab.eos_id])
        return out

    result = evaluate_exact_match(oracle_except_sums_over_15, vocab, problems)
    wrong = sum(1 for p in problems if int(p.answer) > 15)  # 16, 17, 18: 3 + 2 + 1
    assert (result.correct, result.total) == (100 - wrong, 100)
    assert result.accuracy == pytest.approx(0.94)
    assert result.misses[0][1] == "0<eos>"
    with pytest.raises(ValueError, match="returned 0 completions"):
        evaluate_exact_match(lambda prompts, k: [], vocab, problems)
    # the tokenizer directory will do as well; the default set is the 100 problems
    assert evaluate_exact_match(oracle_except_sums_over_15, tokenizer_dir).correct == 94


def test_environment_modules_import_no_torch() -> None:
    """An environment child stays small: none of its modules pulls in torch or transformers."""
    import subprocess
    import sys

    code = (
        "import sys, atroposd.cli, atroposd.envoptions\n"
        "from atroposd.envs import arithmetic, cli, client, generate, runner, vocab\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr

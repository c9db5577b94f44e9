"""The built-in environment ``arithmetic``: ``[BOS]a+b=`` → the answer digits, then EOS.

Task. Operands 0..``max_operand`` (default 9, so 100 problems for ``+``), drawn uniformly;
operators from the options. A group is ``group_size`` completions of one prompt.

Reward (in [0, 1]; EMBEDDED-TASK.md measured this shape learning on 2 cores, with the
partial credit lowered from 0.5 to 0.4 so that a prompt-ignoring policy stays under a third):

- 1.0 for the exact answer followed by EOS;
- otherwise 0.4 if the completion starts with the answer's lead (its sign, if negative, and
  first digit), plus 0.1 if it is well formed (an optional ``-``, digits, then EOS within
  ``max_tokens``).

The partial credit gives a random-init policy something to climb (a uniform first token hits
the lead about 1 time in 20); it is small enough that an answer chosen without looking at the
prompt cannot get far. For the default task the best such answer is ``10`` then EOS, worth
exactly 0.333 in expectation (9 exact, 38 more with the right lead — the sums 1 and 11..18 —,
53 only well formed, out of 100) — ``prompt_ignoring_bound`` computes this for any options, and the tests check it by
enumerating every completion. A policy that ignores the prompt is a mixture of fixed answers,
so no such policy, stochastic or not, does better.

Accuracy. Every group carries ``group_overrides.atroposd = {"weight_version", "accuracy",
"reward_mean", "env"}`` (SPEC §5 extensions; clients that do not know it ignore it), and
``weight_versions`` when a completion spans a weight swap (SPEC §7):
``accuracy`` is the fraction of the group's completions that are exactly right.

What is sent. ``tokens`` = prompt + completion (a sampled EOS included); ``masks`` = -100 over
the prompt, the token ids over the completion; ``inference_logprobs`` aligned with ``tokens``,
1.0 over the prompt; ``generation_params`` with the sampling temperature (the trainer divides
logits by it). Every group is sent, zero-variance ones included (SPEC §8: the trainer gives
them zero advantage).
"""

from __future__ import annotations

import operator
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atroposd.envoptions import ArithmeticOptions
from atroposd.envs.generate import Generation, InferenceClient
from atroposd.envs.runner import ScoredGroup
from atroposd.envs.vocab import Vocab
from atroposd.groupext import EXT_KEY

OPERATIONS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}

EXACT_REWARD = 1.0
LEAD_REWARD = 0.4
FORMAT_REWARD = 0.1

_NUMBER = re.compile(r"-?[0-9]+")


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}{self.op}{self.b}="

    @property
    def answer(self) -> str:
        return str(OPERATIONS[self.op](self.a, self.b))


def all_problems(options: ArithmeticOptions) -> list[Problem]:
    """Every problem of the task, in a fixed order (the greedy evaluation set)."""
    top = options.max_operand
    return [Problem(a, op, b) for op in options.operators for a in range(top + 1) for b in range(top + 1)]


def lead(answer: str) -> str:
    """The sign (if negative) and first digit: what earns the partial credit."""
    return answer[:2] if answer.startswith("-") else answer[:1]


def is_exact(answer: str, text: str, ended: bool) -> bool:
    return ended and text == answer


def score(answer: str, text: str, ended: bool) -> float:
    """The reward of a completion decoded to ``text`` (``ended``: it generated EOS)."""
    if is_exact(answer, text, ended):
        return EXACT_REWARD
    reward = 0.0
    if text.startswith(lead(answer)):
        reward += LEAD_REWARD
    if ended and _NUMBER.fullmatch(text):
        reward += FORMAT_REWARD
    return reward


def prompt_ignoring_bound(problems: Sequence[Problem]) -> tuple[float, str]:
    """The best expected reward of a policy that ignores the prompt, and the answer that earns it.

    Such a policy's expected reward is an average over fixed completions, so the best one is a
    fixed completion. A well-formed one dominates any malformed one with the same lead; among
    the well-formed ones with a given lead, the most frequent answer with that lead is best.
    """
    answers = Counter(p.answer for p in problems)
    leads = Counter(lead(p.answer) for p in problems)
    n = len(problems)
    best_value, best_text = FORMAT_REWARD, "<a number no answer starts like>"
    for head, with_head in leads.items():
        text, exact = max(((a, c) for a, c in answers.items() if lead(a) == head), key=lambda ac: ac[1])
        value = (
            exact * EXACT_REWARD + (with_head - exact) * (LEAD_REWARD + FORMAT_REWARD) + (n - with_head) * FORMAT_REWARD
        ) / n
        if value > best_value:
            best_value, best_text = value, text
    return best_value, best_text


# ---------------------------------------------------------------------------- groups


def build_group(
    problem: Problem,
    prompt_ids: Sequence[int],
    generation: Generation,
    vocab: Vocab,
    *,
    env_name: str,
    temperature: float,
    max_tokens: int,
) -> ScoredGroup:
    """Tokens, masks, logprobs and scores of one generated group."""
    prompt = list(prompt_ids)
    tokens, masks, logprobs, scores, correct = [], [], [], [], []
    for c in generation.completions:
        text, ended = vocab.decode_completion(c.token_ids)
        tokens.append(prompt + c.token_ids)
        masks.append([-100] * len(prompt) + c.token_ids)
        logprobs.append([1.0] * len(prompt) + c.logprobs)
        scores.append(score(problem.answer, text, ended))
        correct.append(is_exact(problem.answer, text, ended))
    accuracy = sum(correct) / len(correct)
    ext: dict[str, Any] = {
        "weight_version": generation.weight_version,
        "accuracy": accuracy,
        "reward_mean": sum(scores) / len(scores),
        "env": env_name,
    }
    if generation.weight_versions is not None:  # a completion spans a weight swap (SPEC §7)
        ext["weight_versions"] = generation.weight_versions
    payload = {
        "tokens": tokens,
        "masks": masks,
        "scores": scores,
        "inference_logprobs": logprobs,
        # per completion: "length" = truncated at max_tokens (trainer.overlong = "mask" trains none of it)
        "overrides": [{"finish_reason": c.finish_reason} for c in generation.completions],
        "generation_params": {"temperature": temperature, "top_p": 1.0, "max_tokens": max_tokens},
        "group_overrides": {EXT_KEY: ext},
    }
    return ScoredGroup(payload=payload, scores=scores, correct=correct, weight_version=generation.weight_version)


@dataclass
class ArithmeticTask:
    """The environment's task: draws problems (seeded) and turns one into a scored group."""

    options: ArithmeticOptions
    vocab: Vocab
    seed: int
    env_name: str
    problems: list[Problem] = field(init=False)
    _rng: random.Random = field(init=False)
    _prompts: dict[Problem, list[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.problems = all_problems(self.options)
        self._rng = random.Random(self.seed)
        # Encoding up front also proves every prompt fits the vocabulary before anything starts.
        self._prompts = {p: self.vocab.encode_prompt(p.prompt) for p in self.problems}

    @property
    def max_sequence_len(self) -> int:
        return max(len(ids) for ids in self._prompts.values()) + self.options.max_tokens

    def describe(self) -> dict[str, Any]:
        bound, text = prompt_ignoring_bound(self.problems)
        return {
            "problems": len(self.problems),
            "operators": "".join(self.options.operators),
            "max_operand": self.options.max_operand,
            "max_tokens": self.options.max_tokens,
            "temperature": self.options.temperature,
            "prompt_ignoring_bound": round(bound, 4),
            "prompt_ignoring_best": text,
        }

    def next_item(self) -> tuple[Problem, int]:
        """The next problem and the sampling seed of its group."""
        return self._rng.choice(self.problems), self._rng.randrange(2**31)

    async def rollout(self, item: tuple[Problem, int], infer: InferenceClient, group_size: int) -> ScoredGroup:
        problem, seed = item
        prompt_ids = self._prompts[problem]
        generation = await infer.generate(
            prompt_ids,
            n=group_size,
            max_tokens=self.options.max_tokens,
            temperature=self.options.temperature,
            seed=seed,
        )
        return build_group(
            problem,
            prompt_ids,
            generation,
            self.vocab,
            env_name=self.env_name,
            temperature=self.options.temperature,
            max_tokens=self.options.max_tokens,
        )


# ---------------------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class EvalResult:
    """Greedy exact match over a problem set."""

    accuracy: float
    correct: int
    total: int
    reward_mean: float
    #: up to 10 misses, (prompt, decoded completion)
    misses: list[tuple[str, str]]

    def as_dict(self) -> dict[str, Any]:
        return {
            "accuracy": self.accuracy,
            "correct": self.correct,
            "total": self.total,
            "reward_mean": self.reward_mean,
            "misses": [list(m) for m in self.misses],
        }


GreedyFn = Callable[[list[list[int]], int], Sequence[Sequence[int]]]


def evaluate_exact_match(
    generate_fn: GreedyFn, vocab: Vocab | str | Path, problems: Sequence[Problem] | None = None, *, max_tokens: int = 3
) -> EvalResult:
    """Greedy exact match: ``generate_fn(prompt_id_lists, max_tokens)`` returns one greedy
    completion (token ids, EOS included if generated) per prompt; every problem is scored.

    ``vocab``: a loaded Vocab or the tokenizer directory. The default problem set is all 100
    problems of the default task. Needs no torch itself: the caller's ``generate_fn`` decodes."""
    if not isinstance(vocab, Vocab):
        vocab = Vocab.load(vocab)
    problems = list(problems) if problems is not None else all_problems(ArithmeticOptions())
    prompts = [vocab.encode_prompt(p.prompt) for p in problems]
    completions = generate_fn(prompts, max_tokens)
    if len(completions) != len(problems):
        raise ValueError(f"generate_fn returned {len(completions)} completions for {len(problems)} prompts")
    return _tally(problems, [vocab.decode_completion(list(c)) for c in completions])


async def evaluate_via_server(
    infer: InferenceClient, vocab: Vocab, problems: Sequence[Problem] | None = None, *, max_tokens: int = 3
) -> EvalResult:
    """The same through ``/generate`` at temperature 0 (one request per problem, all at once)."""
    import anyio

    problems = list(problems) if problems is not None else all_problems(ArithmeticOptions())
    decoded: list[tuple[str, bool]] = [("", False)] * len(problems)

    async def one(i: int, problem: Problem) -> None:
        gen = await infer.generate(vocab.encode_prompt(problem.prompt), n=1, max_tokens=max_tokens, temperature=0.0)
        decoded[i] = vocab.decode_completion(gen.completions[0].token_ids)

    async with anyio.create_task_group() as tg:
        for i, problem in enumerate(problems):
            tg.start_soon(one, i, problem)
    return _tally(problems, decoded)


def _tally(problems: Sequence[Problem], decoded: Sequence[tuple[str, bool]]) -> EvalResult:
    correct = 0
    reward = 0.0
    misses: list[tuple[str, str]] = []
    for problem, (text, ended) in zip(problems, decoded, strict=True):
        reward += score(problem.answer, text, ended)
        if is_exact(problem.answer, text, ended):
            correct += 1
        elif len(misses) < 10:
            misses.append((problem.prompt, text + ("<eos>" if ended else "")))
    total = len(problems)
    return EvalResult(
        accuracy=correct / total if total else 0.0,
        correct=correct,
        total=total,
        reward_mean=reward / total if total else 0.0,
        misses=misses,
    )

"""``atroposd env arithmetic`` as a real process against a real API (atroposlib's run-api and
``atroposd api``) and a stand-in /generate server with scripted policies."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.envs.conftest import (
    Api,
    EnvProc,
    FakeInference,
    env_config,
    held_back_env,
    http_json,
    start_fake_inference,
)
from tests.support import atroposd, free_port, stop_process, wait_for


def check_group(group: dict[str, Any], group_size: int) -> None:
    """The wire layout every group must have."""
    assert len(group["tokens"]) == len(group["masks"]) == len(group["scores"]) == group_size
    assert len(group["inference_logprobs"]) == group_size
    for tokens, masks, lps in zip(group["tokens"], group["masks"], group["inference_logprobs"], strict=True):
        assert len(tokens) == len(masks) == len(lps)
        prompt_len = 5  # [BOS] a + b =
        assert tokens[0] == 1 and tokens[4] == 17  # BOS ... '='
        assert masks[:prompt_len] == [-100] * prompt_len
        assert masks[prompt_len:] == tokens[prompt_len:] and len(tokens) > prompt_len
        assert lps[:prompt_len] == [1.0] * prompt_len
        # the stand-in's logprob of completion token j is -(0.1 + 0.01 j)
        assert lps[prompt_len:] == pytest.approx([-(0.1 + 0.01 * j) for j in range(len(tokens) - prompt_len)])
    assert all(0.0 <= s <= 1.0 for s in group["scores"])
    ext = group["group_overrides"]["atroposd"]
    assert set(ext) >= {"weight_version", "accuracy", "reward_mean", "env"}
    assert group["generation_params"]["temperature"] == 1.0


def test_env_registers_after_the_gate_and_posts_well_formed_groups(
    api: Api, fake_inference: Callable[..., FakeInference], start_env: Callable[..., EnvProc]
) -> None:
    infer = fake_inference("oracle")
    api.register_trainer(batch_size=16, max_token_len=64)
    # Groups of 8 make bodies over 1 KiB: the client gzips them, as atroposlib's environments do.
    env = start_env(api.url, infer.url, group_size=8, concurrency=2)
    # Until the trainer's first GET /batch the API says "wait for trainer to start": no rollouts.
    env.wait_event("register-env: retrying")
    assert infer.stats()["requests"] == 0
    api.get_batch()
    env.wait_event("registered")
    batch = wait_for(api.get_batch, timeout=30, what="a batch")
    assert sum(len(g["tokens"]) for g in batch) == 16
    for group in batch:
        check_group(group, 8)
        assert group["env_id"] == 0
        assert group["scores"] == [1.0] * 8  # the oracle is always exactly right
        ext = dict(group["group_overrides"]["atroposd"])
        assert set(ext.pop("timing")) == {"gate_s", "generate_s", "posted_at"}  # one key holds all of ours
        assert ext == {"weight_version": 0, "accuracy": 1.0, "reward_mean": 1.0, "env": "arithmetic-0"}
        assert list(group["group_overrides"]) == ["atroposd"]
    body = infer.stats()["bodies"][0]
    assert body["n"] == 8 and body["max_tokens"] == 3 and body["temperature"] == 1.0
    assert body["logprobs"] == 0 and isinstance(body["seed"], int)
    assert body["prompt"]["prompt_token_ids"][0] == 1


def test_prompt_ignoring_policy_scores_a_third(
    our_api: Api, fake_inference: Callable[..., FakeInference], start_env: Callable[..., EnvProc]
) -> None:
    """The exploit of EMBEDDED-TASK.md ("10" then EOS whatever the prompt) earns 0.5 or 0.1 per
    completion unless the sum is 10; accuracy shows it for what it is."""
    infer = fake_inference("fixed:10")
    our_api.start_trainer(batch_size=8, max_token_len=64)
    start_env(our_api.url, infer.url, group_size=4, concurrency=2)
    groups = [g for _ in range(6) for g in wait_for(our_api.get_batch, timeout=30, what="a batch")]
    for g in groups:
        check_group(g, 4)
        prompt = g["tokens"][0][1:4]
        total = (prompt[0] - 4) + (prompt[2] - 4)
        expected = 1.0 if total == 10 else 0.5 if str(total).startswith("1") else 0.1
        assert g["scores"] == [expected] * 4
        assert g["group_overrides"]["atroposd"]["accuracy"] == (1.0 if total == 10 else 0.0)


def test_throttles_when_the_queue_is_full_and_resumes_when_it_drains(
    api: Api, fake_inference: Callable[..., FakeInference], start_env: Callable[..., EnvProc]
) -> None:
    infer, env = held_back_env(api, fake_inference, start_env)
    assert infer.stats()["requests"] == 2  # nothing generated beyond the limit
    for drained in (1, 2):
        assert len(api.get_batch() or []) == 2
        env.wait_event("resumed", n=drained)
        wait_for(lambda: api.status()["queue_size"] == 2, timeout=20, what="2 groups queued again")
        env.wait_event("throttled", n=drained + 1)
        assert infer.stats()["requests"] == 2 * (drained + 1)
        assert api.status()["queue_size"] == 2


@pytest.mark.parametrize(("weight", "other", "limit"), [(1.0, 3.0, 1), (3.0, 1.0, 3)])
def test_weight_is_registered_and_sets_the_share_of_the_throttle(
    api: Api,
    fake_inference: Callable[..., FakeInference],
    start_env: Callable[..., EnvProc],
    weight: float,
    other: float,
    limit: int,
) -> None:
    """Beside another environment of weight ``other``, this one's share of the off-policy
    budget (batch 16 / group 4 = 4 groups) is weight / (weight + other): it keeps that many
    groups queued or in flight, no more."""
    infer = fake_inference("uniform")
    api.start_trainer(batch_size=16, max_token_len=64)
    http_json(
        "POST",
        api.url + "/register-env",
        {"max_token_length": 64, "desired_name": "other", "weight": other, "group_size": 4},
    )
    env = start_env(api.url, infer.url, group_size=4, concurrency=8, max_batches_offpolicy=1, weight=weight)
    env.wait_event("throttled")
    status = api.status_env(1)
    assert status["env_weight"] == pytest.approx(weight / (weight + other))
    wait_for(lambda: api.status_env(1)["self_queue_size"] == limit, timeout=20, what=f"{limit} groups queued")
    env.wait_event("throttled")
    assert infer.stats()["requests"] == limit  # nothing generated beyond its share


def test_sigterm_abandons_generation_disconnects_and_exits_zero(
    api: Api, fake_inference: Callable[..., FakeInference], start_env: Callable[..., EnvProc]
) -> None:
    infer = fake_inference("oracle")
    infer.post("/hold")  # every generation stays in flight
    api.start_trainer(batch_size=8, max_token_len=64)
    env = start_env(api.url, infer.url, group_size=4, concurrency=2)
    env.wait_event("registered")
    wait_for(lambda: infer.stats()["in_flight"] == 2, timeout=20, what="2 generations in flight")
    os.kill(env.proc.pid, signal.SIGTERM)
    assert env.proc.wait(timeout=15) == 0
    assert env.count("disconnected") == 1
    assert env.count("environment stopped") == 1
    assert api.status()["queue_size"] == 0


def test_sigterm_while_waiting_for_the_trainer_exits_zero(
    our_api: Api, fake_inference: Callable[..., FakeInference], start_env: Callable[..., EnvProc]
) -> None:
    infer = fake_inference("oracle")
    env = start_env(our_api.url, infer.url, group_size=4)
    env.wait_event("register-env: retrying")
    os.kill(env.proc.pid, signal.SIGTERM)
    assert env.proc.wait(timeout=15) == 0
    assert env.count("environment stopped") == 1 and env.count("disconnected") == 0


def test_exploitable_options_are_warned_about_and_an_unreachable_api_is_waited_for(
    start_env: Callable[..., EnvProc],
) -> None:
    """With operands 0..2 the answer "2" alone earns 0.4; the log says so. The API is not up:
    the environment keeps trying, visibly, and still stops cleanly."""
    port = free_port()
    env = start_env(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}", max_operand=2)
    env.wait_event("with these options a policy that ignores the prompt")
    env.wait_event("register-env: retrying")
    warning = next(e for e in env.events() if e.get("event", "").startswith("with these options"))
    assert warning["prompt_ignoring_bound"] == 0.4 and warning["answer"] == "2"
    os.kill(env.proc.pid, signal.SIGTERM)
    assert env.proc.wait(timeout=15) == 0


def test_bad_options_exit_2(tmp_path: Path, tokenizer_dir: Path) -> None:
    tok = [
        "--tokenizer",
        str(tokenizer_dir),
        "--api-url",
        "http://127.0.0.1:1",
        "--inference-url",
        "http://127.0.0.1:1",
    ]
    cfg = env_config(tmp_path, operators=["/"])
    r = atroposd("env", "arithmetic", "-c", str(cfg), *tok)
    assert r.returncode == 2 and "env[0].options.operators" in r.stderr and "unknown operator" in r.stderr
    cfg = env_config(tmp_path)
    r = atroposd("env", "arithmetic", "-c", str(cfg), "--option", "max_tokens=1", *tok)
    assert r.returncode == 2 and "options.max_tokens: must be ≥ 3" in r.stderr
    r = atroposd("env", "arithmetic", "-c", str(cfg), "--option", "max_tokens", *tok)
    assert r.returncode == 2 and "KEY=VALUE" in r.stderr
    r = atroposd("env", "geometry", "-c", str(cfg), *tok)
    assert r.returncode == 2 and "unknown built-in environment 'geometry'" in r.stderr
    r = atroposd("env", "arithmetic", "-c", str(cfg), *tok[2:], "--tokenizer", str(tmp_path))
    assert r.returncode == 2 and "no tokenizer.json" in r.stderr
    # the daemon's variables are checked by the config's rules for the key they stand for
    r = atroposd("env", "arithmetic", "-c", str(cfg), *tok, env={"ATROPOSD_WEIGHT": "-1"})
    assert r.returncode == 2 and "weight must be ≥ 0, got -1" in r.stderr
    r = atroposd("env", "arithmetic", "-c", str(cfg), *tok, env={"ATROPOSD_GROUP_SIZE": "0"})
    assert r.returncode == 2 and "group size must be ≥ 1, got 0" in r.stderr


def test_sequences_longer_than_max_token_len_exit_2(
    our_api: Api, fake_inference: Callable[..., FakeInference], start_env: Callable[..., EnvProc]
) -> None:
    infer = fake_inference("oracle")
    our_api.start_trainer(batch_size=8, max_token_len=7)  # prompt 5 + max_tokens 3 = 8
    env = start_env(our_api.url, infer.url, group_size=4)
    assert env.proc.wait(timeout=30) == 2
    assert "do not fit the trainer's max_token_len 7" in env.log.read_text()
    assert infer.stats()["requests"] == 0


def test_generate_4xx_exits_1(
    our_api: Api, fake_inference: Callable[..., FakeInference], start_env: Callable[..., EnvProc]
) -> None:
    infer = fake_inference("oracle", status=400)
    our_api.start_trainer(batch_size=8, max_token_len=64)
    env = start_env(our_api.url, infer.url, group_size=4)
    assert env.proc.wait(timeout=30) == 1
    assert "/generate answered 400: scripted failure" in env.log.read_text()


def test_waits_for_inference_then_serves(our_api: Api, tmp_path: Path, start_env: Callable[..., EnvProc]) -> None:
    """An inference server that is not up yet (or restarting) is waited for, visibly."""
    our_api.start_trainer(batch_size=8, max_token_len=64)
    port = free_port()
    env = start_env(our_api.url, f"http://127.0.0.1:{port}", group_size=4, concurrency=2)
    env.wait_event("generate: retrying")
    infer = start_fake_inference(tmp_path, "oracle", port=port)
    try:
        batch = wait_for(our_api.get_batch, timeout=30, what="a batch")
        assert all(g["scores"] == [1.0] * 4 for g in batch)
    finally:
        stop_process(infer.proc)

"""The environment against an API that refuses (503 when full) or restarts: every scored group
reaches the trainer exactly once, and the environment registers again when the API forgot it."""

from __future__ import annotations

import json
import os
import signal
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.envs.conftest import Api, EnvProc, FakeInference, start_api
from tests.support import spawn, stop_process, wait_for, write_config


def _key(group: dict[str, Any]) -> str:
    return repr(group["tokens"])


def _final_totals(env: EnvProc) -> dict[str, Any]:
    return next(e for e in env.events() if e.get("event") == "rollouts (total)")


def test_503_is_retried_until_accepted_and_nothing_is_lost(
    tmp_path: Path, fake_inference: Callable[..., FakeInference], start_env: Callable[..., EnvProc]
) -> None:
    # Room for 2 groups of 4; the environment may have 16 queued or in flight, so it hits 503s.
    api = start_api("atroposd", tmp_path, extra=("--max-queued-sequences", "8", "--full-wait", "0"))
    try:
        infer = fake_inference("uniform")
        api.start_trainer(batch_size=8, max_token_len=64)
        env = start_env(api.url, infer.url, group_size=4, concurrency=4, max_batches_offpolicy=8)
        env.wait_event("scored_data: retrying")
        received: list[dict[str, Any]] = []
        while len(received) < 12:
            received += wait_for(api.get_batch, timeout=30, what="a batch")
        os.kill(env.proc.pid, signal.SIGTERM)
        # Groups waiting to be retried get the stop grace; keep draining meanwhile.
        while env.proc.poll() is None:
            received += api.get_batch() or []
        assert env.proc.wait(timeout=10) == 0
        left = api.status()["queue_size"]
        totals = _final_totals(env)
        assert totals["refused_503"] > 0 and totals["submit_retries"] > 0
        assert totals["dropped_at_stop"] == 0
        assert totals["rejected"] == 0
        assert len(received) + left == totals["groups"]  # every accepted group, once
        assert len({_key(g) for g in received}) == len(received)
    finally:
        stop_process(api.proc)


@pytest.mark.slow
def test_api_restart_registers_again_and_resends(
    tmp_path: Path, fake_inference: Callable[..., FakeInference], start_env: Callable[..., EnvProc]
) -> None:
    """run-api keeps nothing across a restart: the environment notices the lost connection, finds
    its env_id unknown, waits at the gate again and registers anew — once, although the status
    poll and two submissions all found the registration stale — and the groups scored while the
    API was down reach the new API."""
    api = start_api("run-api", tmp_path)
    port = int(api.url.rsplit(":", 1)[1])
    infer = fake_inference("oracle")
    api.start_trainer(batch_size=8, max_token_len=64)
    # limit: 2 batches × 8 / 4 = 4 groups queued or in flight
    env = start_env(api.url, infer.url, group_size=4, concurrency=4, max_batches_offpolicy=2)
    api2: Api | None = None
    try:
        env.wait_event("throttled")
        infer.post("/hold")
        assert len(api.get_batch() or []) == 2  # room for more groups, whose generation is held
        wait_for(lambda: infer.stats()["in_flight"] >= 2, timeout=20, what="generations in flight")
        stop_process(api.proc)
        infer.post("/release")  # those groups are scored while the API is down
        env.wait_event("scored_data: retrying", n=2)
        api2 = start_api("run-api", tmp_path, port=port)
        api2.start_trainer(batch_size=8, max_token_len=64)
        env.wait_event("registered", n=2)
        received = []
        while len(received) < 4:
            received += wait_for(api2.get_batch, timeout=30, what="a batch from the restarted API")
        assert all(g["env_id"] == 0 and g["scores"] == [1.0] * 4 for g in received)
        assert env.count("registered") == 2 and env.count("registration lost") == 1
        stop_process(env.proc)  # before the API, so that it is not kept waiting on the connection
    finally:
        stop_process(api.proc)
        if api2 is not None:
            stop_process(api2.proc)


@pytest.mark.slow
def test_api_restart_with_spool_keeps_the_registration(
    tmp_path: Path, fake_inference: Callable[..., FakeInference], start_env: Callable[..., EnvProc]
) -> None:
    """atroposd's API brings its registrations and queue back from the spool: the environment
    keeps its env_id and carries on."""
    spool = ("--spool-dir", str(tmp_path / "spool"))
    api = start_api("atroposd", tmp_path, extra=spool)
    port = int(api.url.rsplit(":", 1)[1])
    infer = fake_inference("oracle")
    api.start_trainer(batch_size=8, max_token_len=64)
    env = start_env(api.url, infer.url, group_size=4, concurrency=2, max_batches_offpolicy=1)
    api2: Api | None = None
    try:
        env.wait_event("throttled")
        stop_process(api.proc)
        env.wait_event("status-env: retrying")
        api2 = start_api("atroposd", tmp_path, port=port, extra=spool)
        received = []
        while len(received) < 6:
            received += wait_for(api2.get_batch, timeout=30, what="a batch from the restarted API")
        assert all(g["env_id"] == 0 for g in received)
        assert env.count("registered") == 1 and env.count("registration lost") == 0
        stop_process(env.proc)
    finally:
        stop_process(api.proc)
        if api2 is not None:
            stop_process(api2.proc)


def test_bearer_token_from_the_config(
    tmp_path: Path, tokenizer_dir: Path, fake_inference: Callable[..., FakeInference]
) -> None:
    """The environment sends ``[api] token``; an API that refuses it is a failure (exit 1)."""
    api = start_api("atroposd", tmp_path, extra=("--token", "s3cret"))
    infer = fake_inference("oracle")
    procs = []
    try:
        urllib.request.urlopen(
            urllib.request.Request(
                api.url + "/register",
                method="POST",
                data=json.dumps(
                    {
                        "wandb_group": "",
                        "wandb_project": "",
                        "batch_size": 8,
                        "max_token_len": 64,
                        "checkpoint_dir": "",
                        "save_checkpoint_interval": 0,
                        "starting_step": 0,
                        "num_steps": 10,
                    }
                ).encode(),
                headers={"Authorization": "Bearer s3cret", "Content-Type": "application/json"},
            ),
            timeout=10,
        ).close()
        for token in ("s3cret", "wrong"):
            cfg = write_config(
                tmp_path / f"{token}.toml",
                {
                    "daemon": {"state_dir": str(tmp_path / "state"), "log_format": "json"},
                    "api": {"token": token},
                    "env": [{"name": "arithmetic", "builtin": "arithmetic", "group_size": 4}],
                },
            )
            log = tmp_path / f"env-{token}.log"
            procs.append(
                spawn(
                    [
                        sys.executable,
                        "-m",
                        "atroposd",
                        "env",
                        "arithmetic",
                        "-c",
                        str(cfg),
                        "--api-url",
                        api.url,
                        "--inference-url",
                        infer.url,
                        "--tokenizer",
                        str(tokenizer_dir),
                    ],
                    log=log,
                )
            )
        good, bad = (EnvProc(p, tmp_path / f"env-{t}.log") for p, t in zip(procs, ("s3cret", "wrong"), strict=True))
        assert bad.proc.wait(timeout=30) == 1
        assert "401" in bad.log.read_text() and "bearer token" in bad.log.read_text()
        good.wait_event("register-env: retrying")  # the token passed; the gate is still closed
    finally:
        for proc in procs:
            stop_process(proc)
        stop_process(api.proc)

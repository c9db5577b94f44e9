"""The trainer in shared-weight mode with the real inference server (``atroposd inference``)
as a child process and real rollouts: the server computes on the trainer's memory, so a
rollout sampled at version v is scored identically by the trainer at version v."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson
import pytest

from atroposd.trainer.service import TrainerService
from atroposd.weights.shm import list_segments
from atroposd.weights.sync import make_weight_sync
from tests.support import REPO, free_port, spawn, stop_process, write_config
from tests.trainer.helpers import produce_rollouts, run_api, wait_ok

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


async def test_shared_mode_rollouts_match_the_trainer(
    short_tmp: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nonce = "tr" + short_tmp.name[-6:].replace("_", "x")
    monkeypatch.setenv("ATROPOSD_INSTANCE", nonce)
    inf_port = free_port()
    state, run = short_tmp / "state", short_tmp / "run"
    run.mkdir(mode=0o700)
    with run_api(short_tmp / "api.log") as (api_url, _api):
        cfg_path = write_config(
            short_tmp / "a.toml",
            {
                "daemon": {"state_dir": str(state), "runtime_dir": str(run)},
                "api": {"enabled": False, "url": api_url},
                "inference": {"model": str(tiny_dir), "port": inf_port, "max_model_len": 512},
                "trainer": {
                    "steps": 6,
                    "batch_size": 16,
                    "micro_batch_size": 8,
                    "max_token_len": 64,
                    "checkpoint_every": 100,
                    "weight_sync": "shared",
                    "max_staleness": 0,
                    "lr": 3e-3,
                },
            },
        )
        from atroposd.config import load_config

        cfg = load_config(cfg_path)
        sock = run / f"inference-{inf_port}.sock"
        inference = spawn(
            [
                sys.executable,
                "-m",
                "atroposd",
                "inference",
                "-c",
                str(cfg_path),
                "--control-socket",
                str(sock),
                "--await-weights",
            ],
            env={"PYTHONPATH": str(REPO)},
            log=short_tmp / "inference.log",
        )
        weights = make_weight_sync(cfg, nonce=nonce, control_socket=sock)
        try:
            wait_ok(f"{cfg.inference_url}/health", inference)
            service = TrainerService(cfg, instance=nonce, weights=weights, envs_alive=lambda: True)
            done = anyio.Event()

            async def trainer(*, task_status: Any) -> None:
                await service.run(task_status=task_status)
                done.set()

            with anyio.fail_after(180):
                async with anyio.create_task_group() as tg:
                    await tg.start(trainer)
                    tg.start_soon(produce_rollouts, api_url, cfg.inference_url)
                    await done.wait()
                    tg.cancel_scope.cancel()
            assert service.outcome is not None and service.outcome.state == "finished", service.outcome
            rows = [orjson.loads(x) for x in (state / "metrics.jsonl").read_bytes().splitlines()]
            assert len(rows) == 6
            # max_staleness 0: every batch was sampled with the weights it is trained from, in the
            # server's own memory, so the importance ratio is 1 up to float rounding.
            for r in rows:
                if r["staleness"] == 0:
                    assert abs(r["mean_ratio"] - 1.0) < 1e-3, r
                    assert r["clipped_fraction"] == 0.0, r
            assert sum(r["staleness"] == 0 for r in rows) >= 1  # how many is up to the rollout timing
            async with aiohttp.ClientSession() as http, http.get(f"{cfg.inference_url}/info") as resp:
                info = await resp.json()
            assert info["weight_version"] == 6
        finally:
            stop_process(inference)
            weights.close()
    assert not list_segments(f"atroposd-{nonce}-")

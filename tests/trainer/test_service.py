"""TrainerService against a real run-api, an inference /info stand-in and a rollout producer."""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson
import pytest

from atroposd.config import Config
from atroposd.models.resolve import tokenizer_fingerprint
from atroposd.trainer.service import TrainerOutcome, TrainerService
from atroposd.weights.sync import make_weight_sync
from tests.support import free_port
from tests.trainer.conftest import make_cfg, make_groups
from tests.trainer.helpers import info_server, produce, run_api

pytestmark = pytest.mark.anyio

REQUIRED = (
    "step",
    "time",
    "loss",
    "reward_mean",
    "reward_std",
    "accuracy",
    "weight_version",
    "staleness",
    "mean_ratio",
    "clipped_fraction",
    "mean_kl",
    "grad_norm",
    "tokens",
    "skipped_steps",
    "lr",
    "batch_wait_s",
    "step_s",
)


@pytest.fixture(scope="module")
def shared_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One run-api for the module's tests (each starts from /reset_data)."""
    with run_api(tmp_path_factory.mktemp("api") / "api.log") as (url, _proc):
        yield url


@pytest.fixture
def api_url(shared_api: str) -> str:
    import urllib.request

    urllib.request.urlopen(f"{shared_api}/reset_data", timeout=10).close()
    return shared_api


def _cfg(state_dir: Path, tiny_dir: Path, api_url: str, inf_port: int, **trainer: Any) -> Config:
    cfg = make_cfg(state_dir, tiny_dir, **trainer)
    cfg.api.enabled, cfg.api.url = False, api_url
    cfg.inference.port = inf_port
    return cfg


def _service(cfg: Config, *, envs_alive: bool = True) -> TrainerService:
    weights = make_weight_sync(cfg, nonce="t", control_socket=None)
    return TrainerService(cfg, instance="t", weights=weights, envs_alive=lambda: envs_alive)


async def _train(
    cfg: Config, api_url: str, *, seed: int = 0, first: list[dict[str, Any]] | None = None
) -> tuple[TrainerOutcome, TrainerService]:
    service = _service(cfg)
    done = anyio.Event()

    async def trainer(*, task_status: Any) -> None:
        await service.run(task_status=task_status)
        done.set()

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            await tg.start(trainer)  # returns after /register and the first /batch
            tg.start_soon(partial(produce, api_url, 8, 4, seed, first=first))
            await done.wait()
            tg.cancel_scope.cancel()
    assert service.outcome is not None
    return service.outcome, service


def _metrics(state_dir: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in (state_dir / "metrics.jsonl").read_bytes().splitlines()]


async def test_trains_checkpoints_and_resumes(tiny_dir: Path, state_dir: Path, api_url: str) -> None:
    fp = tokenizer_fingerprint(tiny_dir)
    inf_port = free_port()
    async with info_server(fp, inf_port):
        cfg = _cfg(state_dir, tiny_dir, api_url, inf_port, steps=4, checkpoint_every=2, keep_checkpoints=2)
        outcome, service = await _train(cfg, api_url)
        assert outcome == TrainerOutcome("finished", 4, 4), outcome
        status = service.status()
        assert status["state"] == "finished" and status["step"] == 4 and status["total_steps"] == 4
        assert status["reward_mean"] is not None and status["accuracy"] == 0.25
        rows = _metrics(state_dir)
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        for r in rows:
            assert all(k in r for k in REQUIRED), set(REQUIRED) - set(r)
            assert r["tokens"] == 16 * 3 and r["skipped_steps"] == 0
        assert rows[-1]["weight_version"] == 4 and rows[0]["staleness"] == 0
        ckpts = sorted(p.name for p in (state_dir / "checkpoints").iterdir())
        assert ckpts == ["step-2", "step-4"]
        step4 = state_dir / "checkpoints" / "step-4"
        assert {"config.json", "model.safetensors", "trainer_state.pt", "tokenizer.json"} <= {
            p.name for p in step4.iterdir()
        }
        # the same job with more steps continues from step 4 with the same weight version
        cfg2 = _cfg(state_dir, tiny_dir, api_url, inf_port, steps=6, checkpoint_every=2, keep_checkpoints=2)
        outcome2, _ = await _train(cfg2, api_url, seed=1)
        assert outcome2 == TrainerOutcome("finished", 6, 6)
        assert [r["step"] for r in _metrics(state_dir)] == [1, 2, 3, 4, 5, 6]


async def test_hostile_groups_are_rejected_by_reason_and_training_goes_on(
    tiny_dir: Path, state_dir: Path, api_url: str
) -> None:
    """Groups that would crash the model (ids outside the vocabulary, negative ids) or poison the
    step (absurd advantages), posted through the real API: counted, never the job's end."""
    hostile = make_groups(7, n=4, size=8)
    hostile[0]["tokens"][3][-1] = 999  # the tiny model has 22 tokens
    hostile[1]["tokens"][0][2] = -5
    hostile[2]["advantages"] = [[1e6] * len(t) for t in hostile[2]["tokens"]]
    hostile[3]["tokens"][1][0] = 22
    inf_port = free_port()
    async with info_server(tokenizer_fingerprint(tiny_dir), inf_port):
        cfg = _cfg(state_dir, tiny_dir, api_url, inf_port, steps=3, checkpoint_every=10)
        outcome, service = await _train(cfg, api_url, first=hostile)
    assert outcome == TrainerOutcome("finished", 3, 3), outcome
    expected = {"token_out_of_range": 3, "advantage_invalid": 1}
    assert service.status()["rejected_groups"] == expected
    rows = _metrics(state_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["rejected_groups"] == expected  # (the first two batches were all hostile: skipped)


async def test_stop_while_waiting_for_data_checkpoints(tiny_dir: Path, state_dir: Path, api_url: str) -> None:
    inf_port = free_port()
    async with info_server(tokenizer_fingerprint(tiny_dir), inf_port):
        service = _service(_cfg(state_dir, tiny_dir, api_url, inf_port))
        outcome: TrainerOutcome | None = None

        async def trainer(*, task_status: Any) -> None:
            nonlocal outcome
            outcome = await service.run(task_status=task_status)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                await tg.start(trainer)
                while service.status()["waiting_for"] != "data":  # noqa: ASYNC110 - a probe, with a deadline
                    await anyio.sleep(0.01)
                assert service.status()["state"] == "waiting"
                t0 = time.monotonic()
                service.request_stop()
        assert time.monotonic() - t0 < 10
        assert outcome == TrainerOutcome("stopped", 0, 0)
        assert (state_dir / "checkpoints" / "step-0" / "trainer_state.pt").is_file()
        assert service.status()["state"] == "stopped"


async def test_no_data_and_no_environment_fails_after_data_timeout(
    tiny_dir: Path, state_dir: Path, api_url: str
) -> None:
    inf_port = free_port()
    async with info_server(tokenizer_fingerprint(tiny_dir), inf_port):
        service = _service(_cfg(state_dir, tiny_dir, api_url, inf_port, data_timeout=0.5), envs_alive=False)
        with anyio.fail_after(60):
            outcome = await service.run()
    assert outcome.state == "failed" and outcome.exit_code == 1
    assert outcome.error is not None and "data_timeout" in outcome.error
    assert service.status()["state"] == "failed"


async def test_tokenizer_mismatch_is_refused_before_any_rollout(tiny_dir: Path, state_dir: Path, api_url: str) -> None:
    inf_port = free_port()
    other = dict(tokenizer_fingerprint(tiny_dir), fingerprint="0" * 32)
    other["special_ids"] = dict(other["special_ids"], eos=7)
    async with info_server(other, inf_port):
        service = _service(_cfg(state_dir, tiny_dir, api_url, inf_port))
        with anyio.fail_after(60):
            outcome = await service.run()
        async with aiohttp.ClientSession() as http, http.get(f"{api_url}/info") as resp:
            info = await resp.json()
    assert outcome.state == "failed"
    assert outcome.error is not None and "tokenizer mismatch" in outcome.error
    assert str(tiny_dir) in outcome.error and "stand-in" in outcome.error and "special_ids" in outcome.error
    assert info["batch_size"] == -1  # never registered: no rollout could start


async def test_survives_an_api_restart_and_registers_again(tiny_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    from tests.support import free_port as _port

    api_port = _port()
    inf_port = free_port()
    async with info_server(tokenizer_fingerprint(tiny_dir), inf_port):
        with run_api(tmp_path / "api1.log", port=api_port) as (api_url, _proc):
            cfg = _cfg(state_dir, tiny_dir, api_url, inf_port, steps=4, checkpoint_every=100)
            service = _service(cfg)
            done = anyio.Event()

            async def trainer(*, task_status: Any) -> None:
                await service.run(task_status=task_status)
                done.set()

            async with anyio.create_task_group() as tg:
                with anyio.fail_after(120):
                    await tg.start(trainer)
                    producer = anyio.CancelScope()

                    async def first_producer() -> None:
                        with producer:
                            await produce(api_url, 8, 4, 0)

                    tg.start_soon(first_producer)
                    while service.status()["step"] < 2:  # noqa: ASYNC110 - a probe, with a deadline
                        await anyio.sleep(0.01)
                    producer.cancel()
                    _proc.kill()  # the API dies with everything it held
                    _proc.wait(10)
                    while service.status()["waiting_for"] != "api":  # noqa: ASYNC110
                        await anyio.sleep(0.01)
                    with run_api(tmp_path / "api2.log", port=api_port):  # a fresh API: no registration
                        tg.start_soon(produce, api_url, 8, 4, 1)
                        await done.wait()
                        tg.cancel_scope.cancel()
    assert service.outcome == TrainerOutcome("finished", 4, 4)


async def test_stop_while_waiting_for_the_api(tiny_dir: Path, state_dir: Path) -> None:
    inf_port = free_port()
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens: the API is "restarting"
    async with info_server(tokenizer_fingerprint(tiny_dir), inf_port):
        service = _service(_cfg(state_dir, tiny_dir, nowhere, inf_port))
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(service.run)
                while service.status()["waiting_for"] != "api":  # noqa: ASYNC110 - a probe, with a deadline
                    await anyio.sleep(0.01)
                assert service.status()["state"] == "waiting"
                service.request_stop()
    assert service.outcome == TrainerOutcome("stopped", 0, 0)
    assert service.status()["state"] == "stopped"

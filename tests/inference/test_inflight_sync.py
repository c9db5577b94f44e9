"""In-flight weight updates through a real `atroposd inference` process and the trainer's real
sync strategies (shared, push, reload, broadcast; SPEC §7): a generation running when the sync
comes is frozen, the weights swap, it goes on; its tokens before the swap carry the old weights'
logprobs and those after it the new weights', as the trainer scores them."""

from __future__ import annotations

import asyncio
import copy
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from atroposd.models.tiny import BOS_ID
from atroposd.trainer.sentinel import score_completion
from atroposd.weights.replicas import pause_request
from atroposd.weights.sync import BroadcastSync, PushSync, ReloadSync, SharedSync
from tests.inference.conftest import Server, env_with_nonce, start_server
from tests.inference.test_weights import train_step, trainer_model
from tests.support import stop_process

pytestmark = pytest.mark.slow

PROMPT = [BOS_ID, 7, 14, 9, 17]
TOKENS = 200


@pytest.fixture
def nonce() -> str:
    return "t" + secrets.token_hex(6)


@pytest.fixture
def awaiting(tiny_dir: Path, nonce: str) -> Iterator[Server]:
    root = Path(tempfile.mkdtemp(prefix="atpd-if-", dir="/tmp"))
    srv = start_server(root, tiny_dir, extra=["--await-weights"], env=env_with_nonce(nonce))
    try:
        yield srv
    finally:
        code = stop_process(srv.proc)
        shutil.rmtree(root, ignore_errors=True)
        assert code == 0, srv.tail()


def _sync(mode: str, srv: Server, nonce: str) -> Any:
    weights_dir = srv.root / "run" / "weights"
    weights_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    if mode == "shared":
        return SharedSync(nonce=nonce, weights_dir=weights_dir, control_socket=srv.socket)
    if mode == "push":
        return PushSync(nonce=nonce, weights_dir=weights_dir, control_socket=srv.socket)
    if mode == "reload":
        return ReloadSync(sync_dir=srv.root / "state" / "sync", control_socket=srv.socket)
    return BroadcastSync(nonce=nonce, control_socket=srv.socket, store_dir=srv.root / "run", form_timeout=60)


async def _running(srv: Server) -> None:
    deadline = time.monotonic() + 30
    while (await asyncio.to_thread(srv.control, "GET", "/weight_info"))[1].get("inflight", 0) < 1:
        assert time.monotonic() < deadline, "the generation never reached the server"
        await asyncio.sleep(0.005)


def _logprobs(answer: dict[str, Any], i: int) -> list[float]:
    return [float(next(iter(item[0].values()))) for item in answer["logprobs"][i]]


def test_a_sync_swaps_the_weights_under_a_running_generation_in_every_mode(
    awaiting: Server, tiny_dir: Path, nonce: str
) -> None:
    """One server; each mode in turn takes over its weights (as after a restart of the trainer)."""
    srv = awaiting
    torch.set_num_threads(1)

    async def one(mode: str, seed: int, version: int) -> None:
        import aiohttp

        model = trainer_model(tiny_dir, seed=seed)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
        sync = _sync(mode, srv, nonce)
        sync.replicas.pause_body = pause_request("keep", "recompute")
        try:
            await sync.attach(model, version)
            old = copy.deepcopy(model)
            body = {
                "prompt": {"prompt_token_ids": PROMPT},
                "n": 2,
                "max_tokens": TOKENS,
                "temperature": 1.0,
                "ignore_eos": True,
                "logprobs": 0,
            }
            async with aiohttp.ClientSession() as session:
                pending = asyncio.ensure_future(session.post(srv.url + "/generate", json=body))
                await _running(srv)
                if mode == "shared":
                    async with sync.paused(version + 1):  # the optimizer writes the memory the server computes with
                        train_step(model, opt)
                else:
                    train_step(model, opt)
                    assert await sync.after_step(model, version + 1) is not None
                resp = await asyncio.wait_for(pending, 120)
                answer = await resp.json()
            assert resp.status == 200, answer
        finally:
            sync.close()
        assert answer["weight_version"] == version, mode
        assert "weight_versions" in answer, f"{mode}: the generation ended before the sync"
        for i, record in enumerate(answer["weight_versions"]):
            ids, lps = answer["token_ids"][i], _logprobs(answer, i)
            assert len(ids) == TOKENS and record[0] == [0, version] and len(record) == 2, (mode, record)
            at = record[1][0]
            assert record[1][1] == version + 1 and 0 < at < TOKENS, (mode, record)
            before, after = score_completion(old, PROMPT, ids), score_completion(model, PROMPT, ids)
            assert max(abs(a - b) for a, b in zip(lps[:at], before[:at], strict=True)) < 1e-5, mode
            assert max(abs(a - b) for a, b in zip(lps[at:], after[at:], strict=True)) < 1e-5, mode
            assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 1e-3, mode

    async def refused() -> None:
        """A sync refused half-way (the load fails after the pause froze the generation): the
        replica resumes with the version it had, and the frozen generation goes on with the old
        weights, saying so (one version, the old weights' logprobs)."""
        import aiohttp

        from atroposd.weights.client import WeightControlError
        from atroposd.weights.replicas import Replicas

        model = trainer_model(tiny_dir, seed=3)
        push = _sync("push", srv, nonce)
        push.replicas.pause_body = pause_request()
        try:
            await push.attach(model, 50)
        finally:
            push.close()
        reps = Replicas([srv.socket], deadline=60)
        reps.pause_body = pause_request()
        reps[0].version = 50
        body = {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": TOKENS, "ignore_eos": True, "logprobs": 0}
        async with aiohttp.ClientSession() as session:
            pending = asyncio.ensure_future(session.post(srv.url + "/generate", json=body))
            await _running(srv)
            with pytest.raises(WeightControlError, match="does not exist"):
                await reps.update(reps[0], 51, 50, "load", srv.root / "state" / "sync" / "v51", 51)
            answer = await (await asyncio.wait_for(pending, 120)).json()
        assert answer["weight_version"] == 50 and "weight_versions" not in answer
        info = await asyncio.to_thread(srv.control, "GET", "/weight_info")
        assert info[1]["weight_version"] == 50 and not info[1]["paused"]
        ids, lps = answer["token_ids"][0], _logprobs(answer, 0)
        ref = score_completion(model, PROMPT, ids)
        assert max(abs(a - b) for a, b in zip(lps, ref, strict=True)) < 1e-5

    async def run() -> None:
        for k, mode in enumerate(("shared", "push", "reload", "broadcast")):
            await one(mode, seed=7 + k, version=10 * k)
        await refused()

    asyncio.run(run())


def test_stop_while_frozen_answers_the_frozen_generation_and_exits_cleanly(tiny_dir: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="atpd-ifs-", dir="/tmp"))
    srv = start_server(root, tiny_dir)
    try:

        async def run() -> tuple[int, float]:
            import aiohttp

            body = {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": TOKENS, "ignore_eos": True}
            async with aiohttp.ClientSession() as session:
                pending = asyncio.ensure_future(session.post(srv.url + "/generate", json=body))
                await _running(srv)
                status, paused = await asyncio.to_thread(srv.control, "POST", "/pause", {"mode": "keep"})
                assert status == 200 and paused["mode"] == "keep", paused
                t0 = time.monotonic()
                srv.proc.terminate()
                resp = await asyncio.wait_for(pending, 60)
                return resp.status, time.monotonic() - t0

        status, seconds = asyncio.run(run())
        assert status == 503 and seconds < 30
        assert srv.proc.wait(60) == 0, srv.tail()
        assert not srv.socket.exists()
    finally:
        stop_process(srv.proc)
        shutil.rmtree(root, ignore_errors=True)

"""Weights into a running `atroposd inference` through its control socket, with the trainer's
real sync strategies: shared (POSIX shm attach), push (copy), reload (a sync directory), and
--await-weights."""

from __future__ import annotations

import asyncio
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from atroposd.models.tiny import BOS_ID
from atroposd.weights.shm import list_segments
from atroposd.weights.sync import PushSync, ReloadSync, SharedSync
from tests.inference.conftest import Server, env_with_nonce, start_server
from tests.support import stop_process

SEQ = [BOS_ID, 7, 14, 9, 17, 1 + 15, 6]  # a prompt whose every token is scored


@pytest.fixture
def nonce() -> str:
    return "t" + secrets.token_hex(6)


@pytest.fixture
def awaiting(tiny_dir: Path, nonce: str) -> Iterator[Server]:
    root = Path(tempfile.mkdtemp(prefix="atpd-w-", dir="/tmp"))
    srv = start_server(root, tiny_dir, extra=["--await-weights"], env=env_with_nonce(nonce))
    try:
        yield srv
    finally:
        code = stop_process(srv.proc)
        shutil.rmtree(root, ignore_errors=True)
        assert code == 0, srv.tail()


def trainer_model(tiny_dir: Path, seed: int) -> torch.nn.Module:
    """The tiny model's architecture with other weights than the server loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tiny_dir)))
    return model.eval()


def local_logprobs(model: torch.nn.Module, tokens: list[int] = SEQ) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[i - 1, tokens[i]]) for i in range(1, len(tokens))]


def served(server: Server, tokens: list[int] = SEQ) -> tuple[list[float], int]:
    status, body = server.http(
        "POST",
        "/generate",
        {"prompt": {"prompt_token_ids": tokens}, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0},
    )
    assert status == 200, body
    pl = body["prompt_logprobs"]
    return [pl[i][str(tokens[i])] for i in range(1, len(tokens))], body["weight_version"]


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model.train()
    ids = torch.tensor([SEQ])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()


def close(a: list[float], b: list[float], tol: float = 1e-4) -> bool:
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) < tol


def test_await_weights_then_shared_push_and_reload(awaiting: Server, tiny_dir: Path, nonce: str) -> None:
    srv = awaiting
    weights_dir = srv.root / "run" / "weights"
    weights_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    model = trainer_model(tiny_dir, seed=7)

    async def run() -> None:
        import aiohttp

        status, info = srv.http("GET", "/info")
        assert status == 200 and info["awaiting_weights"] is True
        assert srv.http("GET", "/health")[0] == 200
        # A rollout waits while the server awaits weights; the daemon's probe does not.
        async with aiohttp.ClientSession() as session:
            body = {"prompt": {"prompt_token_ids": SEQ}, "max_tokens": 1, "prompt_logprobs": 0}
            held = asyncio.ensure_future(session.post(srv.url + "/generate", json=body))
            status, probe = await asyncio.to_thread(srv.control, "POST", "/probe_generate")
            assert status == 200 and probe["weight_version"] == 0
            assert not held.done()

            shared = SharedSync(nonce=nonce, weights_dir=weights_dir, control_socket=srv.socket)
            try:
                await shared.attach(model, 0)
                resp = await asyncio.wait_for(held, 60)
                answer = await resp.json()
                assert resp.status == 200 and answer["weight_version"] == 0
                pl = answer["prompt_logprobs"]
                assert close([pl[i][str(SEQ[i])] for i in range(1, len(SEQ))], local_logprobs(model))
                info = await asyncio.to_thread(srv.control, "GET", "/weight_info")
                assert info[1]["attached"] is True and info[1]["updates"] == 1
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                before = local_logprobs(model)
                for version in (1, 2):
                    async with shared.paused(version):
                        train_step(model, opt)
                    lps, v = await asyncio.to_thread(served, srv)
                    assert v == version and close(lps, local_logprobs(model))
                assert not close(before, local_logprobs(model), 1e-3)  # the steps changed what is served
                assert (await asyncio.to_thread(srv.control, "GET", "/weight_info"))[1]["updates"] == 1
            finally:
                shared.close()
            assert not list_segments(f"atroposd-{nonce}-")

            # push: the server copies the trainer's export into its own memory
            pushed = trainer_model(tiny_dir, seed=8)
            push = PushSync(nonce=nonce, weights_dir=weights_dir, control_socket=srv.socket)
            try:
                await push.attach(pushed, 5)
                lps, v = await asyncio.to_thread(served, srv)
                assert v == 5 and close(lps, local_logprobs(pushed))
                assert (await asyncio.to_thread(srv.control, "GET", "/weight_info"))[1]["attached"] is False
            finally:
                push.close()
            lps, _ = await asyncio.to_thread(served, srv)  # its own copy outlives the export
            assert close(lps, local_logprobs(pushed))

            # reload: a directory in state_dir/sync
            reloaded = trainer_model(tiny_dir, seed=9)
            reload = ReloadSync(sync_dir=srv.root / "state" / "sync", control_socket=srv.socket)
            try:
                await reload.attach(reloaded, 9)
                lps, v = await asyncio.to_thread(served, srv)
                assert v == 9 and close(lps, local_logprobs(reloaded))
            finally:
                reload.close()

    asyncio.run(run())
    refused_updates_leave_the_weights(srv, nonce)


def refused_updates_leave_the_weights(srv: Server, nonce: str) -> None:
    before, version = served(srv)
    assert srv.control("POST", "/pause")[0] == 200
    status, answer = srv.control("POST", "/update_weights", {"mode": "copy"})
    assert status == 400 and "manifest" in answer["error"]
    bogus = srv.root / "run" / "weights" / f"manifest-{nonce}.json"
    bogus.write_text("{}")
    status, answer = srv.control("POST", "/update_weights", {"manifest": str(bogus), "mode": "attach"})
    assert status == 400 and answer["error"]
    status, answer = srv.control("POST", "/load", {"path": str(srv.root / "state" / "sync" / "v1")})
    assert status == 400 and "does not exist" in answer["error"]
    assert srv.control("POST", "/resume", {})[0] == 200
    after, after_version = served(srv)
    assert after == before and after_version == version

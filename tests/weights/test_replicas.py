"""Weight sync to several inference replicas (SPEC §12.2), each a real server process
(tests/weights/child_server.py): every sync reaches every replica; a replica killed -9 is
skipped while training goes on and gets the current weights when it is back."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from atroposd.weights.shm import list_segments
from atroposd.weights.sync import PushSync, ReloadSync, SharedSync, WeightSync
from tests.weights.conftest import ChildFactory, make_model, score, train_step

pytestmark = pytest.mark.anyio

ATOL = 1e-5


def _sync(mode: str, dirs: dict[str, Path], nonce: str, sockets: list[Path]) -> WeightSync:
    if mode == "shared":
        return SharedSync(nonce=nonce, weights_dir=dirs["weights"], control_sockets=sockets)
    if mode == "push":
        return PushSync(nonce=nonce, weights_dir=dirs["weights"], control_sockets=sockets)
    return ReloadSync(sync_dir=dirs["sync"], control_sockets=sockets)


async def _step(sync: WeightSync, model: torch.nn.Module, opt: torch.optim.Optimizer, version: int) -> None:
    async with sync.paused(version):
        train_step(model, opt)
    await sync.after_step(model, version)


@pytest.mark.slow  # a whole job or a long search: run by .ci/run, not in the default run
@pytest.mark.parametrize("mode", ["shared", "push", pytest.param("reload")])
async def test_every_replica_follows_and_a_killed_one_catches_up(
    mode: str, dirs: dict[str, Path], nonce: str, child_factory: ChildFactory
) -> None:
    first, second = child_factory.reuse(), child_factory.start()
    model = make_model(0)
    sync = _sync(mode, dirs, nonce, [first.socket, second.socket])
    try:
        await sync.attach(model, 0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        await _step(sync, model, opt, 1)
        for child in (first, second):
            lp, version = await child.logprobs()
            assert version == 1
            torch.testing.assert_close(lp, score(model), atol=ATOL, rtol=0)
        assert sync.replica_versions() == [1, 1]
        if mode == "shared":  # one copy for all: both replicas map the trainer's buffers, nothing copied
            for child in (first, second):
                assert (await child.call("GET", "/weight_info"))["updates"] == 1

        os.kill(second.proc.pid, signal.SIGKILL)
        second.proc.wait(10)
        for v in (2, 3):  # the dead replica is skipped; the live one follows every step
            await _step(sync, model, opt, v)
            lp, version = await first.logprobs()
            assert version == v
            torch.testing.assert_close(lp, score(model), atol=ATOL, rtol=0)
        assert sync.replica_versions() == [3, 1] and not sync.server_current

        back = child_factory.start()
        sync.replicas[1].socket = back.socket  # the restarted replica (the daemon keeps the socket path)
        await sync.reattach(model, 3, 1)  # the restarted replica alone
        lp, version = await back.logprobs()
        assert version == 3 and sync.server_current
        torch.testing.assert_close(lp, score(model), atol=ATOL, rtol=0)
        await _step(sync, model, opt, 4)
        for child in (first, back):
            assert (await child.logprobs())[1] == 4
    finally:
        sync.close()
    assert not list_segments(f"atroposd-{nonce}-")

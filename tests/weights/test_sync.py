"""The three sync modes between this process (the trainer) and a real inference-server process
(tests/weights/child_server.py, which calls atroposd.weights.receiver as an engine does)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import pytest
import torch

from atroposd.weights.shm import list_segments
from atroposd.weights.sync import PushSync, ReloadSync, SharedSync
from tests.weights.conftest import Child, ChildFactory, make_model, own_resources, score, train_step

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parent.parent.parent

ATOL = 1e-5


def _shared(dirs: dict[str, Path], nonce: str, child: Child) -> SharedSync:
    return SharedSync(nonce=nonce, weights_dir=dirs["weights"], control_socket=child.socket)


async def test_shared_step_is_seen_by_the_server(
    dirs: dict[str, Path], nonce: str, child_factory: ChildFactory
) -> None:
    child = child_factory.reuse()
    model = make_model(0)
    sync = _shared(dirs, nonce, child)
    try:
        await sync.attach(model, 0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        lp, version = await child.logprobs()
        assert version == 0
        old = score(model)
        torch.testing.assert_close(lp, old, atol=ATOL, rtol=0)
        info = await child.call("GET", "/weight_info")
        assert info["attached"] and info["updates"] == 1
        for v in (1, 2):
            async with sync.paused(v):
                train_step(model, opt)
            lp, version = await child.logprobs()
            new = score(model)
            assert version == v
            torch.testing.assert_close(lp, new, atol=ATOL, rtol=0)
            assert (new - old).abs().max() > 1e-3  # the step changed the weights
            old = new
        assert (await child.call("GET", "/weight_info"))["updates"] == 1  # no copy: one shared memory
    finally:
        sync.close()
    assert not list_segments(f"atroposd-{nonce}-")
    assert not (dirs["weights"] / f"manifest-{nonce}.json").exists()


async def test_generation_during_a_step_carries_one_version(
    dirs: dict[str, Path], nonce: str, child_factory: ChildFactory
) -> None:
    child = child_factory.reuse()
    model = make_model(0)
    sync = _shared(dirs, nonce, child)
    results: list[tuple[torch.Tensor, int | None]] = []
    try:
        await sync.attach(model, 0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        old = score(model)
        async with anyio.create_task_group() as tg:
            async with sync.paused(1):

                async def ask() -> None:
                    results.append(await child.logprobs())

                tg.start_soon(ask)
                # The request reached the server and waits for the resume.
                with anyio.fail_after(30):  # a probe of the server's state, with a deadline
                    while (await child.call("GET", "/weight_info"))["waiting"] != 1:  # noqa: ASYNC110
                        await anyio.sleep(0.01)
                await anyio.wait_all_tasks_blocked()
                await anyio.to_thread.run_sync(train_step, model, opt)
                assert not results  # still held back while the weights change
        lp, version = results[0]
        assert version == 1
        torch.testing.assert_close(lp, score(model), atol=ATOL, rtol=0)
        assert (lp - old).abs().max() > 1e-3
    finally:
        sync.close()


@pytest.mark.slow  # a whole job or a long search: run by .ci/run, not in the default run
@pytest.mark.parametrize("mode", ["shared", "push", pytest.param("reload")])
async def test_killed_server_keeps_trainer_segments_and_restart_reattaches(
    dirs: dict[str, Path], nonce: str, child_factory: ChildFactory, mode: str
) -> None:
    """kill -9 of the inference server with a generation in flight, mid-training."""
    child = child_factory.start()
    model = make_model(0)
    sync = _make(mode, dirs, nonce, child)
    try:
        await sync.attach(model, 0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        segments = list_segments(f"atroposd-{nonce}-")
        assert bool(segments) == (mode != "reload")
        # A generation is held in the server (paused), then the server is killed under it.
        await child.call("POST", "/pause")
        async with anyio.create_task_group() as tg:
            failed = anyio.Event()

            async def ask() -> None:
                from atroposd.weights.client import WeightControlError

                with pytest.raises(WeightControlError):
                    await child.logprobs()
                failed.set()

            tg.start_soon(ask)
            with anyio.fail_after(30):
                while (await child.call("GET", "/weight_info"))["waiting"] != 1:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            os.kill(child.proc.pid, signal.SIGKILL)
            child.proc.wait(10)
            with anyio.fail_after(30):
                await failed.wait()
        assert list_segments(f"atroposd-{nonce}-") == segments  # nothing unlinked by the dead server
        # Training goes on while the server is away (pause, resume and syncs are skipped).
        for v in (1, 2):
            async with sync.paused(v):
                train_step(model, opt)
            await sync.after_step(model, v)
        assert not sync.server_current
        restarted = child_factory.start()
        sync.control_socket = restarted.socket
        await sync.reattach(model, 2)
        lp, version = await restarted.logprobs()
        assert version == 2 and sync.server_current
        torch.testing.assert_close(lp, score(model), atol=ATOL, rtol=0)
        assert list_segments(f"atroposd-{nonce}-") == segments  # re-exported, not re-created
    finally:
        sync.close()
    assert not list_segments(f"atroposd-{nonce}-")


@pytest.mark.slow  # a whole job or a long search: run by .ci/run, not in the default run
async def test_segments_removed_behind_the_trainer_are_exported_anew(
    dirs: dict[str, Path], nonce: str, child_factory: ChildFactory
) -> None:
    """Someone removes the trainer's segments from /dev/shm (its mapping still works); after an
    inference restart the trainer exports into new segments and the server attaches to them."""
    child = child_factory.start()
    model = make_model(0)
    sync = _shared(dirs, nonce, child)
    try:
        await sync.attach(model, 0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        old = list_segments(f"atroposd-{nonce}-")
        for name in old:
            os.unlink(f"/dev/shm/{name}")
        async with sync.paused(1):
            train_step(model, opt)  # the trainer goes on in its mapping
        os.kill(child.proc.pid, signal.SIGKILL)
        child.proc.wait(10)
        restarted = child_factory.start()
        sync.control_socket = restarted.socket
        await sync.reattach(model, 1)
        lp, version = await restarted.logprobs()
        assert version == 1 and sync.server_current
        torch.testing.assert_close(lp, score(model), atol=ATOL, rtol=0)
        new = list_segments(f"atroposd-{nonce}-")
        assert new and not set(new) & set(old)
        async with sync.paused(2):  # the server computes on the new segments: it sees the next step
            train_step(model, opt)
        lp, version = await restarted.logprobs()
        assert version == 2
        torch.testing.assert_close(lp, score(model), atol=ATOL, rtol=0)
    finally:
        sync.close()
    assert not list_segments(f"atroposd-{nonce}-")


def _make(mode: str, dirs: dict[str, Path], nonce: str, child: Child) -> PushSync | ReloadSync | SharedSync:
    if mode == "push":
        return PushSync(nonce=nonce, weights_dir=dirs["weights"], control_socket=child.socket)
    if mode == "reload":
        return ReloadSync(sync_dir=dirs["sync"], control_socket=child.socket)
    return _shared(dirs, nonce, child)


@pytest.mark.parametrize("mode", ["push", "reload"])
async def test_push_and_reload_sync_every(
    dirs: dict[str, Path], nonce: str, child_factory: ChildFactory, mode: str
) -> None:
    child = child_factory.reuse()
    model = make_model(0)
    sync: PushSync | ReloadSync
    if mode == "push":
        sync = PushSync(nonce=nonce, weights_dir=dirs["weights"], control_socket=child.socket, sync_every=2)
    else:
        sync = ReloadSync(sync_dir=dirs["sync"], control_socket=child.socket, sync_every=2)
    try:
        await sync.attach(model, 0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        v0 = score(model)
        lp, version = await child.logprobs()
        assert version == 0
        torch.testing.assert_close(lp, v0, atol=ATOL, rtol=0)
        for v in (1, 2):
            async with sync.paused(v):
                train_step(model, opt)
            report = await sync.after_step(model, v)
            lp, version = await child.logprobs()
            if v == 1:  # sync_every = 2: the server still has version 0
                assert report is None  # no sync, no report
                assert version == 0
                torch.testing.assert_close(lp, v0, atol=ATOL, rtol=0)
                assert (score(model) - v0).abs().max() > 1e-3
        assert version == 2
        torch.testing.assert_close(lp, score(model), atol=ATOL, rtol=0)
        # the step that synced got the sync's report back: push times the pause and the copy apart
        assert report is not None and 0 < report["seconds"] < 30
        if mode == "push":
            assert report is sync.last_sync
            assert 0 <= report["sync_pause_s"] and 0 < report["sync_transfer_s"] <= report["seconds"]
        info = await child.call("GET", "/weight_info")
        assert info["updates"] == 2 and not info["attached"]
        res = await child.call("GET", "/resources")
        # push: the export's one segment stays mapped read-only across syncs; reload maps nothing
        assert res["shm_maps"] == (1 if mode == "push" else 0)
        if mode == "reload":
            assert sorted(p.name for p in dirs["sync"].iterdir()) == ["v2"]
    finally:
        sync.close()
    assert not list_segments(f"atroposd-{nonce}-")
    assert not list(dirs["sync"].iterdir())


async def test_refused_update_leaves_the_server_serving(
    dirs: dict[str, Path], nonce: str, child_factory: ChildFactory
) -> None:
    child = child_factory.reuse()
    model = make_model(0)
    sync = PushSync(nonce=nonce, weights_dir=dirs["weights"], control_socket=child.socket)
    try:
        await sync.attach(model, 0)
        before = (await child.logprobs())[0]
        # A model the server cannot take (different shape): refused, server resumed on version 0.
        other = make_model(0, intermediate_size=384)
        from atroposd.weights.client import WeightControlError

        with pytest.raises(WeightControlError, match="shape"):
            await sync.after_step(other, 1)
        lp, version = await child.logprobs()
        assert version == 0
        torch.testing.assert_close(lp, before, atol=0, rtol=0)
    finally:
        sync.close()


async def _leak_run(dirs: dict[str, Path], nonce: str, child_factory: ChildFactory, mode: str, syncs: int) -> None:
    child = child_factory.reuse()
    model = make_model(0)
    sync: PushSync | ReloadSync | SharedSync
    if mode == "push":
        sync = PushSync(nonce=nonce, weights_dir=dirs["weights"], control_socket=child.socket)
    elif mode == "reload":
        sync = ReloadSync(sync_dir=dirs["sync"], control_socket=child.socket)
    else:
        sync = _shared(dirs, nonce, child)
    try:
        await sync.attach(model, 0)
        params = list(model.parameters())
        warm = 20
        for v in range(1, warm + 1):
            async with sync.paused(v):
                with torch.no_grad():
                    params[v % len(params)].add_(1e-4)
            await sync.after_step(model, v)
        mine0, theirs0 = own_resources(), await child.call("GET", "/resources")
        segs0 = list_segments(f"atroposd-{nonce}-")
        for v in range(warm + 1, warm + syncs + 1):
            async with sync.paused(v):
                with torch.no_grad():
                    params[v % len(params)].add_(1e-4)
            await sync.after_step(model, v)
        mine1, theirs1 = own_resources(), await child.call("GET", "/resources")
        assert list_segments(f"atroposd-{nonce}-") == segs0
        assert mine1["fds"] == mine0["fds"] and mine1["shm_maps"] == mine0["shm_maps"]
        assert theirs1["fds"] == theirs0["fds"] and theirs1["shm_maps"] == theirs0["shm_maps"]
        # steady memory: well under one model copy (1.3 MB) per 100 syncs
        assert theirs1["rss"] - theirs0["rss"] < 8 * 1024 * 1024, (theirs0, theirs1)
        assert mine1["rss"] - mine0["rss"] < 16 * 1024 * 1024, (mine0, mine1)
        lp, version = await child.logprobs()
        assert version == warm + syncs
        torch.testing.assert_close(lp, score(model), atol=ATOL, rtol=0)
    finally:
        sync.close()
    assert not list_segments(f"atroposd-{nonce}-")
    assert not list(dirs["weights"].iterdir())
    assert not list(dirs["sync"].iterdir())
    mine2 = own_resources()
    assert mine2["shm_maps"] == 0


@pytest.mark.parametrize("mode", ["push", "shared", "reload"])
async def test_no_leak_over_syncs_quick(
    dirs: dict[str, Path], nonce: str, child_factory: ChildFactory, mode: str
) -> None:
    await _leak_run(dirs, nonce, child_factory, mode, 100)


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.parametrize("mode", ["push", "shared", "reload"])
async def test_no_leak_over_1000_syncs(
    dirs: dict[str, Path], nonce: str, child_factory: ChildFactory, mode: str
) -> None:
    await _leak_run(dirs, nonce, child_factory, mode, 1000)


async def test_dead_trainer_leftovers_are_removed_by_the_next_start(dirs: dict[str, Path], nonce: str) -> None:
    """A trainer process killed with SIGKILL leaves segments + manifest; cleanup_stale removes them."""
    import subprocess
    import sys

    from atroposd.pids import start_ticks
    from atroposd.weights.manifest import exporter_alive
    from atroposd.weights.shm import cleanup_stale

    code = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from pathlib import Path
from atroposd.weights.arena import ParameterArena
from atroposd.weights.manifest import manifest_path
from tests.weights.conftest import make_model
m = make_model(0)
a = ParameterArena.create(m, nonce={nonce!r})
a.manifest(0).write(manifest_path(Path({str(dirs["weights"])!r}), {nonce!r}))
print("EXPORT-DONE", flush=True)
sys.stdin.read()
"""
    async with await anyio.open_process(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as proc:
        assert proc.stdout is not None
        seen = b""
        with anyio.fail_after(60):
            while b"EXPORT-DONE" not in seen:
                seen += await proc.stdout.receive()
        start_time = start_ticks(proc.pid)
        assert start_time is not None
        os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()
    assert list_segments(f"atroposd-{nonce}-")
    assert (dirs["weights"] / f"manifest-{nonce}.json").exists()
    removed = cleanup_stale(dirs["runtime"], lambda n: n == nonce and exporter_alive(proc.pid, start_time))
    assert removed
    assert not list_segments(f"atroposd-{nonce}-")
    assert not list(dirs["weights"].iterdir())

"""The replica sentinel (SPEC §15) against a real `atroposd inference` server: the canary's drift
between the server's logprobs and the trainer's own, a replica whose weights were corrupted through
the weight-control socket quarantined (503), synced again and let back, and the log's cause."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from structlog.testing import capture_logs
from transformers import AutoModelForCausalLM

from atroposd.trainer.sentinel import Sentinel, builtin_prompts, score_completion
from atroposd.weights.client import WeightControlClient
from atroposd.weights.reload import write_sync_dir
from atroposd.weights.sync import ReloadSync
from tests.inference.conftest import start_server
from tests.support import stop_process

pytestmark = pytest.mark.anyio


@pytest.fixture
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from atroposd.models.tiny import ensure_builtin_model

    return ensure_builtin_model(tmp_path_factory.mktemp("tiny-state"), seed=0, max_model_len=256)


async def _on_thread(fn: Any, *args: Any) -> Any:
    return await anyio.to_thread.run_sync(lambda: fn(*args))


def _generate(url: str) -> int:
    body = json.dumps({"prompt": {"prompt_token_ids": [3, 4, 5]}, "max_tokens": 2}).encode()
    req = urllib.request.Request(
        url + "/generate", data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _info(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/info", timeout=30) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def test_builtin_prompts_are_fixed_and_inside_the_vocabulary() -> None:
    a, b = builtin_prompts(8, 300), builtin_prompts(8, 300)
    assert a == b and len(a) == 8 and len({tuple(p) for p in a}) == 8
    assert all(3 <= t < 300 for p in a for t in p)


@pytest.mark.slow  # a real inference server: about 25 s on 2 cores
async def test_corrupted_replica_is_quarantined_resynced_and_let_back(short_tmp: Path, tiny_dir: Path) -> None:
    server = start_server(short_tmp, tiny_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
        model.eval()
        sync = ReloadSync(sync_dir=short_tmp / "state" / "sync", control_socket=server.socket)
        await sync.attach(model, 1)
        sentinel = Sentinel(
            every=2,
            limit=0.05,
            prompts=builtin_prompts(4, model.config.vocab_size),
            sockets=lambda: [server.socket],
            run=_on_thread,
            max_tokens=8,
        )

        # a healthy replica: only every second sync is checked, and its drift is near 0 (float32)
        await sentinel.after_sync(sync, model, 1)
        assert sentinel.checks == 0
        await sentinel.after_sync(sync, model, 1)
        assert sentinel.checks == 1
        healthy = sentinel.replica_drift()[0]
        assert healthy is not None and healthy < 1e-3, healthy

        # the same tokens scored by the trainer agree with what the replica reported
        client = WeightControlClient(server.socket)
        try:
            prompt = builtin_prompts(1, model.config.vocab_size)[0]
            ans = await client.request("POST", "/canary", {"prompt": {"prompt_token_ids": prompt}, "max_tokens": 4})
            ids = ans["token_ids"][0]
            theirs = [float(next(iter(e[0].values()))) for e in ans["logprobs"][0]]
            assert ans["weight_version"] == 1
            assert max(abs(a - b) for a, b in zip(theirs, score_completion(model, prompt, ids), strict=True)) < 1e-3

            # corrupt the replica's weights after the sync, through the weight-control socket
            bad = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
            with torch.no_grad():
                for p in bad.parameters():
                    p.add_(torch.randn_like(p) * 0.5)
            path = await anyio.to_thread.run_sync(write_sync_dir, bad, short_tmp / "state" / "sync", 999)
            await client.pause()
            await client.load(path, 999)
            await client.resume(1)

            # quarantined: generation routes answer 503, the canary still generates
            await sentinel._quarantine(server.socket, True, "test")
            assert await anyio.to_thread.run_sync(_generate, server.url) == 503
            assert (await anyio.to_thread.run_sync(_info, server.url))["quarantined"] is True
            await sentinel._quarantine(server.socket, False)
            assert await anyio.to_thread.run_sync(_generate, server.url) == 200
        finally:
            await client.close()

        with capture_logs() as logs:
            await sentinel.check_all(sync, model, 1)
        events = [e["event"] for e in logs]
        over = [e for e in logs if e["event"].startswith("replica drift over the limit")]
        assert over and over[0]["drift"] > 0.05, events
        assert sentinel.resyncs == 1
        fell = [e for e in logs if "had not arrived" in e["event"]]
        assert fell and fell[0]["drift_after"] < 1e-3, events
        assert sentinel.replica_drift()[0] is not None and sentinel.replica_drift()[0] < 1e-3  # type: ignore[operator]
        assert not sentinel.quarantined
        assert await anyio.to_thread.run_sync(_generate, server.url) == 200  # back in rotation

        # drift that stays with the same weights (here the scoring side computes differently):
        # resynced, still over; with no other replica passing, it keeps serving and the log says so
        async def differs(fn: Any, _model: Any, *args: Any) -> Any:
            return await anyio.to_thread.run_sync(lambda: fn(bad, *args))

        stubborn = Sentinel(
            every=1,
            limit=0.05,
            prompts=builtin_prompts(4, model.config.vocab_size),
            sockets=lambda: [server.socket],
            run=differs,
            max_tokens=8,
        )
        with capture_logs() as logs:
            await stubborn.check_all(sync, model, 1)
        still = [e for e in logs if e["event"].startswith("replica still drifts")]
        assert still and still[0]["cause"] == "drift with the same weights" and still[0]["drift_after"] > 0.05, logs
        assert stubborn.resyncs == 1 and not stubborn.quarantined
        assert await anyio.to_thread.run_sync(_generate, server.url) == 200
        sync.close()
    finally:
        assert stop_process(server.proc) == 0, server.tail()


def test_batched_scoring_equals_one_sequence_at_a_time(tiny_dir: Path) -> None:
    from atroposd.trainer.sentinel import _score_all

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    items = [([3, 4, 5, 6], [7, 8]), ([9, 10], [11, 12, 13, 14, 15]), ([16, 17, 18], [19])]
    batched = _score_all(model, items)
    for (prompt, completion), got in zip(items, batched, strict=True):
        want = score_completion(model, prompt, completion)
        assert len(got) == len(completion)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


def test_drift_in_metrics_and_status_rows() -> None:
    from atroposd.daemon.metrics import sentinel_families
    from atroposd.daemon.status import _replica_drift

    st = {
        "replica_drift": [0.0, 0.31],
        "quarantined": {"1": "drift"},
        "resyncs": 1,
        "restarts": 0,
        "checks": 5,
        "check_s": 0.05,
    }
    fams = {f.name: f for f in sentinel_families(st)}
    drift = {s.labels["replica"]: s.value for s in fams["atroposd_replica_drift"].samples}
    held = {s.labels["replica"]: s.value for s in fams["atroposd_replica_quarantined"].samples}
    assert drift == {"0": 0.0, "1": 0.31} and held == {"0": 0.0, "1": 1.0}
    assert fams["atroposd_sentinel_resyncs"].samples[0].value == 1.0
    assert list(sentinel_families(None)) == []  # the sentinel off: no family
    rows = [
        {"name": "inference-0", "kind": "inference"},
        {"name": "inference-1", "kind": "inference"},
        {"name": "api", "kind": "api"},
    ]
    _replica_drift({"sentinel": st}, rows)
    assert [r.get("drift") for r in rows] == [0.0, 0.31, None]


def _group(prompt: list[int], completion: list[int]) -> dict[str, Any]:
    return {"tokens": [prompt + completion], "masks": [[-100] * len(prompt) + completion], "scores": [1.0]}


def test_canary_prompts_are_the_environments_first_distinct_prompts() -> None:
    built = builtin_prompts(3, 100)
    sentinel = Sentinel(
        every=1,
        limit=0.05,
        prompts=built,
        sockets=lambda: [],
        run=_on_thread,
        wanted=3,
        vocab_size=100,
        max_prompt_len=4,
    )
    assert sentinel.status()["canary_source"] == "built-in"
    # malformed groups, an id outside the vocabulary, a group without a prompt: not taken
    assert not sentinel.offer(
        [
            {"tokens": "x"},
            _group([5, 500], [6]),
            {"tokens": [[5, 6]], "masks": [[5, 6]]},
            _group([5, 6], [7]),
            _group([5, 6], [8]),
        ]
    )  # the same prompt twice
    assert sentinel.prompts == built
    assert sentinel.offer([_group([9, 10, 11, 12, 13, 14], [15]), _group([20], [21]), _group([30], [31])])
    assert sentinel.prompts == [[5, 6], [9, 10, 11, 12], [20]]  # at most max_prompt_len tokens each
    assert sentinel.status()["canary_source"] == "environments"
    assert not sentinel.offer([_group([40], [41])])  # fixed for the rest of the job
    assert sentinel.prompts == [[5, 6], [9, 10, 11, 12], [20]]


def test_canary_pairs_from_rank_zero_are_checked() -> None:
    from atroposd.trainer.sentinel import canary_items

    assert canary_items([[[1, 2], [3]], [[4], [5, 6]]], 10) == [([1, 2], [3]), ([4], [5, 6])]
    assert canary_items([], 10) == []
    for bad in (None, [[1, 2]], [[[1], [10]]], [[[1], []]], [[[True], [2]]], [[[1], "2"]], {"a": 1}):
        assert canary_items(bad, 10) is None, bad


async def test_a_stop_does_not_wait_for_the_sentinels_restart_of_a_replica() -> None:
    """The sentinel's restart (the step waits for it) gives way to a stop request; a restarted
    replica's reattach skips the step's lock only while the sentinel waits for it."""
    from atroposd.config import Config
    from atroposd.trainer.service import TrainerService

    started = anyio.Event()

    async def never_ready(replica: int, reason: str) -> bool:
        assert replica == 1 and "sentinel" in reason
        started.set()
        await anyio.sleep_forever()
        return True

    service = TrainerService(
        Config(),
        instance="t",
        weights=None,
        envs_alive=lambda: True,  # type: ignore[arg-type]
        restart_replica=never_ready,
    )
    result: list[bool] = []

    async def restart() -> None:
        result.append(await service._sentinel_restart(1))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(restart)
            await started.wait()
            assert service._sentinel_restarting == {1}
            service.request_stop()
    assert result == [False] and not service._sentinel_restarting

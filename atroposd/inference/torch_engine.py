"""The torch engine (``[inference] engine = "torch"``): any local Hugging Face causal LM, and
``builtin:tiny``, on CPU or CUDA.

* **Batching.** Requests wait in a queue; one scheduler task takes everything queued when the
  model is free and decodes it as one batch (a request with ``n = 8`` is 8 rows), prompts
  left-padded, with the model's KV cache. Requests arriving while a batch runs form the next
  one, so concurrent environments share forward passes. A probe (``max_tokens ≤ 1``, ``n = 1``, a
  short prompt: the health checks of atroposlib's server classes, SPEC §7) is answered ahead of
  queued rollouts — the daemon's own generations first, then at most ``PROBE_ROWS_PER_BATCH``
  probe rows a batch: queued probes go first into the next batch, ride on its prefill (one more
  prompt row, no forward pass of their own) and are answered right after its first step, before the rollouts decode on;
  probes with no rollout queued form a batch by themselves.
* **Sampling.** Temperature, top-p, top-k, per-request seeds. The reported logprob of a sampled
  token is ``log_softmax(logits / temperature)`` over the full vocabulary, untruncated by
  top-p/top-k (SPEC §7) — exactly what the trainer recomputes. Greedy (temperature 0) reports
  ``log_softmax(logits)``. ``prompt_logprobs`` are teacher-forced with the same scaling. The
  decode kernel (batch, KV cache, sampling) is :mod:`atroposd.inference.decode`.
* **Pause gate** (:mod:`atroposd.inference.gate`). ``pause()`` (mode ``wait``) admits nothing
  new and returns once every admitted request has been answered; weight updates run only then
  (and never during a forward pass: a lock orders compute). ``pause(mode="keep")`` admits
  nothing new and freezes the running batch between two decode steps (SPEC §7, in-flight
  updates): the compute lock is let go while it is frozen, the weights change, and ``resume``
  lets it go on with the new version (its KV recomputed with the new weights unless
  ``clear_cache = false``); requests queued but not begun start after the resume. Every
  response carries the ``weight_version`` its batch began under, and ``weight_versions`` when
  a completion spans a swap.
* **Weights** arrive through :mod:`atroposd.weights.receiver` (attach/copy an export, load a
  reload directory).

Compute runs in a worker thread; on CPU torch uses one thread by default (the trainer shares
the cores).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atroposd.devices import resolve_torch
from atroposd.inference.decode import Freezer, FrozenAbort, Thaw, decode_batch
from atroposd.inference.gate import NotPaused, ShuttingDown, WeightGate
from atroposd.inference.schema import (
    PROBE_ROWS_PER_BATCH,
    BadRequest,
    Completion,
    GenerateParams,
    generate_response,
    parse_generate,
)
from atroposd.logs import get_logger
from atroposd.weights.control import BroadcastOp, LoadWeights, UpdateWeights
from atroposd.weights.protocol import WeightUpdateError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from atroposd.config import Config
    from atroposd.weights.broadcast import BroadcastEndpoint
    from atroposd.weights.receiver import ReceiverState

__all__ = ["BadRequest", "NotPaused", "TorchEngine", "decode_batch"]

log = get_logger("inference.torch")

MAX_BATCH_ROWS = 256
#: what the weight-control pause accepts (inference/server.py): "wait" drains, "keep" freezes
PAUSE_MODES = ("wait", "keep")
BATCH_WINDOW = 0.003  # seconds a partial batch may wait for the rest of its group


@dataclass
class _Job:
    params: GenerateParams
    future: asyncio.Future[dict[str, Any]]
    version: int
    rows: int = field(init=False)
    probe: bool = field(init=False)

    def __post_init__(self) -> None:
        self.rows = self.params.n
        self.probe = self.params.lane != "rollout"  # a probe or the daemon's own (schema.with_lane)


class TorchEngine(WeightGate):
    """A Hugging Face causal LM behind the inference-engine methods (see vllm_engine.VllmEngine)."""

    name = "torch"
    pause_modes: tuple[str, ...] = PAUSE_MODES

    def __init__(
        self,
        *,
        model_dir: Path,
        tokenizer_dir: Path | None = None,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int = 4096,
        seed: int = 0,
        receiver: ReceiverState | None = None,
        await_weights: bool = False,
        threads: int | None = None,
        max_batch_rows: int = MAX_BATCH_ROWS,
        batch_window: float = BATCH_WINDOW,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.tokenizer_dir = Path(tokenizer_dir or model_dir)
        self.dtype_name = dtype
        self.device_name = device
        self.max_model_len = max_model_len
        self.seed = seed
        self.receiver = receiver  # atroposd.weights.receiver.ReceiverState
        self.threads = threads
        self.max_batch_rows = max_batch_rows
        self.batch_window = batch_window
        self.fast = True  # the flat Llama forward where it applies (atroposd.inference.steppers)
        self._last_rows = 0
        self.model: PreTrainedModel | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.vocab_size = 0
        self.eos_ids: frozenset[int] = frozenset()
        super().__init__(await_weights=await_weights)
        self._queue: list[_Job] = []
        self._wake = asyncio.Event()
        self._compute = asyncio.Lock()  # one forward pass or weight update at a time
        self._owns_compute = False  # the scheduler holds it (let go while a batch is frozen)
        self._scheduler: asyncio.Task[None] | None = None
        self._running: asyncio.Future[list[dict[str, Any]]] | None = None  # the batch being computed
        self._running_jobs: list[_Job] = []
        self._generator: torch.Generator | None = None
        self._broadcast: BroadcastEndpoint | None = None  # weight_sync = "broadcast": made at its first op
        self.batches = 0
        self.batched_rows = 0
        # In-flight updates (pause mode "keep"): while held, no forward pass runs (a running batch
        # is frozen between two steps, with the compute lock let go) until resume thaws it.
        self._hold = False
        self._thawed = asyncio.Event()
        self._thawed.set()
        self._recompute = True  # the frozen rows' KV computed again with the new weights at resume
        self._freezer: Freezer | None = None  # the running batch's
        self._parked = asyncio.Event()  # the running batch is frozen (set from the compute thread)
        self.frozen_syncs = 0  # keep-pauses that froze a running batch
        # A refused weight update that had already changed the model (a copy found damaged once
        # made): the model holds weights of no version; resume is refused until a whole one arrives.
        self._torn: str | None = None

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        *,
        receiver: ReceiverState | None = None,
        await_weights: bool = False,
        threads: int | None = None,
    ) -> TorchEngine:
        """An engine for ``cfg.inference`` (builtin:tiny is built on demand)."""
        from atroposd.models.resolve import resolve_model, resolve_tokenizer
        from atroposd.weights.receiver import ReceiverState

        inf = cfg.inference
        # A device list names one device per replica; a server is told its own (inference/cli.py).
        device = inf.device if isinstance(inf.device, str) else cfg.inference_devices()[0]
        return cls(
            model_dir=resolve_model(cfg),
            tokenizer_dir=resolve_tokenizer(cfg),
            dtype=inf.dtype,
            device=device,
            max_model_len=inf.max_model_len,
            seed=cfg.trainer.seed,
            receiver=receiver if receiver is not None else ReceiverState.from_config(cfg),
            await_weights=await_weights,
            threads=threads,
        )

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        self._scheduler = asyncio.create_task(self._schedule(), name="torch-engine-scheduler")

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a progress bar is noise in a daemon's log files
        device, dtype = resolve_torch(self.device_name, self.dtype_name, key="inference.device")
        if device.type == "cpu":
            torch.set_num_threads(self.threads or 1)
        elif self.threads:
            torch.set_num_threads(self.threads)
        t0 = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer_dir))
        model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=dtype)
        self.model = model.to(device).eval()
        self.model.requires_grad_(False)
        weight = model.get_input_embeddings().weight
        assert isinstance(weight, torch.Tensor)
        self.vocab_size = int(weight.shape[0])
        self.eos_ids = frozenset(_eos_ids(self.tokenizer, self.model))
        self._generator = torch.Generator(device="cpu").manual_seed(self.seed)
        log.info(
            "model loaded",
            model=str(self.model_dir),
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            parameters=sum(p.numel() for p in self.model.parameters()),
            seconds=round(time.perf_counter() - t0, 3),
            threads=torch.get_num_threads(),
        )

    async def close(self) -> None:
        self._close_gate()
        if self._freezer is not None:  # a frozen batch ends now: its requests get 503 (ShuttingDown)
            self._freezer.thaw(Thaw(abort=True))
        self._thawed.set()
        task, self._scheduler = self._scheduler, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        running = self._running
        if running is not None:
            if not running.done():
                await asyncio.wait({running})
            self._answer(self._running_jobs, running)  # answered already unless the scheduler was cancelled
        for job in self._queue:
            if not job.future.done():
                job.future.set_exception(ShuttingDown("the inference server is shutting down"))
        self._queue.clear()
        endpoint = self._broadcast
        if endpoint is not None:  # a receive under way fails at once instead of holding the compute lock
            endpoint.close()
        async with self._compute:
            if self.receiver is not None and self.model is not None:
                await asyncio.to_thread(self.receiver.release, self.model)

    async def check_health(self) -> None:
        if self.model is None:
            raise RuntimeError("model not loaded")
        task = self._scheduler
        if task is None or task.done():
            raise RuntimeError("the batch scheduler is not running")

    # ------------------------------------------------------------------ generation

    async def generate(
        self, request: Mapping[str, object] | GenerateParams, *, bypass_pause: bool = False
    ) -> dict[str, Any]:
        """One Atropos ``/generate`` request (or one the front parsed already) → its response (SPEC §7)."""
        params = request if isinstance(request, GenerateParams) else self.validate(request)
        async with self._admitted(bypass_pause) as version:
            job = _Job(params, asyncio.get_running_loop().create_future(), version)
            self._queue.append(job)
            self._wake.set()
            return await job.future

    def validate(self, request: object) -> GenerateParams:
        """The request parsed as every engine parses it; this engine honours all of it
        (top-p and top-k included: its logprobs are untruncated, SPEC §7)."""
        return parse_generate(request, max_model_len=self.max_model_len, vocab_size=self.vocab_size)

    async def _schedule(self) -> None:
        """Take everything queued, decode it as one batch, answer; repeat."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._gather()
            jobs = self._take_batch()
            if not jobs:
                continue
            if self._queue:
                self._wake.set()
            await self._compute.acquire()
            self._owns_compute = True
            try:
                while self._hold and not self._closing:  # a keep-pause: nothing begins before resume
                    await self._held()
                jobs = [j for j in jobs if not j.future.done()]  # a client gone while it waited: dropped
                if not jobs:
                    continue
                if self._closing:
                    for job in jobs:
                        job.future.set_exception(ShuttingDown("the inference server is shutting down"))
                    continue
                for job in jobs:  # the version the batch begins under (unchanged since admission unless held)
                    job.version = self.weight_version
                loop = asyncio.get_running_loop()
                self._parked.clear()
                freezer = self._freezer = Freezer(functools.partial(loop.call_soon_threadsafe, self._parked.set))
                # A cancelled scheduler (shutdown) must not abandon a forward pass that still
                # reads the weights: the batch runs on, and close() waits for it.
                self._running = asyncio.ensure_future(asyncio.to_thread(self._run_batch, jobs, loop, freezer))
                self._running_jobs = jobs
                try:
                    await self._run_frozen(self._running, freezer)
                finally:
                    self._freezer = None
                self._answer(jobs, self._running)
            finally:
                if self._owns_compute:
                    self._owns_compute = False
                    self._compute.release()

    async def _run_frozen(self, running: asyncio.Future[Any], freezer: Freezer) -> None:
        """Wait for the batch (holding the compute lock); each time it is frozen for a keep-pause,
        let the lock go until resume, then thaw it with the version resumed with."""
        while True:
            parked = asyncio.ensure_future(self._parked.wait())
            try:
                await asyncio.wait({running, parked}, return_when=asyncio.FIRST_COMPLETED)  # never raises
            finally:
                parked.cancel()
            if running.done():
                return
            self._parked.clear()
            self.frozen_syncs += 1
            thaw = await self._held()
            while self._hold and not self._closing:  # paused again before the lock came back
                thaw = await self._held()
            freezer.thaw(thaw)

    async def _held(self) -> Thaw:
        """Let the compute lock go until resume (or close); how the frozen batch goes on."""
        self._owns_compute = False
        self._compute.release()
        await self._thawed.wait()
        await self._compute.acquire()
        self._owns_compute = True
        if self._closing:
            return Thaw(abort=True)
        return Thaw(version=self.weight_version, recompute=self._recompute)

    @staticmethod
    def _answer(jobs: list[_Job], done: asyncio.Future[list[dict[str, Any]]]) -> None:
        """Deliver a finished batch: each request its result, or the batch's error to all."""
        exc = done.exception() if not done.cancelled() else RuntimeError("the batch was cancelled")
        if isinstance(exc, FrozenAbort):
            exc = ShuttingDown(str(exc))
            log.warning("frozen generations ended by the shutdown", requests=len(jobs))
        elif exc is not None:
            log.error("batch failed", requests=len(jobs), error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        for i, job in enumerate(jobs):
            if job.future.done():  # a client that went away cancelled its future
                continue
            if exc is not None:
                job.future.set_exception(exc)
            else:
                job.future.set_result(done.result()[i])

    async def _gather(self) -> None:
        """Give requests sent together a moment to arrive together.

        Clients such as an environment send a group's requests at once, but over separate
        connections they reach the queue a little apart. While fewer rows are queued than the
        last batch had, wait up to ``batch_window`` seconds for more, so the group is decoded
        as one batch instead of two.
        """
        await asyncio.sleep(0)  # handlers that are already runnable enqueue first
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.batch_window
        while self._queued_rows() < self._last_rows:
            left = deadline - loop.time()
            if left <= 0:
                return
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), left)

    def _queued_rows(self) -> int:
        return sum(j.rows for j in self._queue if not j.future.done() and not j.probe)

    def _take_batch(self) -> list[_Job]:
        """The next batch: the queued probes first (answered after its first step, ahead of every
        rollout), then the rollouts in arrival order."""
        queue = [j for j in self._queue if not j.future.done()]
        jobs: list[_Job] = []
        rows = probe_rows = lane_rows = 0
        lanes = {"own": 0, "probe": 1, "rollout": 2}
        for job in sorted(queue, key=lambda j: lanes.get(j.params.lane, 2)):  # stable: arrival order in a lane
            if job.params.lane == "probe":
                if lane_rows >= PROBE_ROWS_PER_BATCH:
                    continue  # a few probes a batch: the others wait for the next one
                lane_rows += job.rows
            if jobs and rows + job.rows > self.max_batch_rows:
                break
            jobs.append(job)
            rows += job.rows
            probe_rows += job.rows if job.probe else 0
        taken = {id(j) for j in jobs}
        self._queue = [j for j in queue if id(j) not in taken]
        if rows > probe_rows:  # the size a rollout batch waits for (_gather)
            self._last_rows = rows - probe_rows
        return jobs

    def _run_batch(
        self, jobs: list[_Job], loop: asyncio.AbstractEventLoop | None = None, freezer: Freezer | None = None
    ) -> list[dict[str, Any]]:
        import torch

        tokenizer, model = self.tokenizer, self._loaded()
        assert tokenizer is not None

        def response(j: int, comps: list[Completion], plp: list[dict[str, float] | None] | None) -> dict[str, Any]:
            job = jobs[j]
            return generate_response(
                job.params,
                comps,
                weight_version=job.version,
                prompt_text=str(tokenizer.decode(job.params.prompt_ids)),
                prompt_logprobs=plp,
            )

        def early(j: int, comps: list[Completion], plp: list[dict[str, float] | None] | None) -> None:
            # A probe is done after the first step: answer it now, not after the rollouts.
            if loop is not None and jobs[j].probe:
                loop.call_soon_threadsafe(_deliver, jobs[j].future, response(j, comps, plp))

        with torch.inference_mode():
            completions, prompt_lps = decode_batch(
                model,
                [j.params for j in jobs],
                tokenizer=tokenizer,
                eos_ids=self.eos_ids,
                generator=self._generator,
                fast=self.fast,
                early=early,
                versions=[j.version for j in jobs],
                freezer=freezer,
            )
        self.batches += 1
        self.batched_rows += sum(j.rows for j in jobs)
        return [response(j, comps, plp) for j, (comps, plp) in enumerate(zip(completions, prompt_lps, strict=True))]

    # ------------------------------------------------------------------ weight control

    async def pause(self, mode: str = "wait", clear_cache: bool | None = None) -> dict[str, Any]:
        """``mode = "wait"``: admit nothing new; return once every admitted generation has been
        answered. ``"keep"``: admit nothing new; freeze the running batch between two decode steps
        and return once no forward pass runs (the weights may change until :meth:`resume`).
        ``clear_cache`` (keep; default true): the frozen rows' KV is computed again with the
        weights they resume on; false keeps the old KV."""
        if mode not in PAUSE_MODES:
            raise BadRequest(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        if clear_cache is not None and not isinstance(clear_cache, bool):
            raise BadRequest(f"clear_cache must be true or false, got {clear_cache!r}")
        if mode == "keep":
            self.hold_admissions()
            self._recompute = clear_cache is not False
            self._hold = True
            self._thawed.clear()
            if self._freezer is not None:
                self._freezer.request()
            # The running batch lets the lock go once frozen (or finished); none begins while held.
            async with self._compute:
                pass
            return {"paused": True, "weight_version": self.weight_version, "mode": mode, "frozen": self._inflight}
        if self._hold:  # a drain after a keep-pause: the frozen batch goes on (same weights) and drains
            self._release_hold()
        result = await super().pause()
        # A batch whose every client went away still computes: let it finish before the
        # caller touches the weights (in shared mode the trainer writes them in place).
        async with self._compute:
            pass
        return result if clear_cache is None else {**result, "mode": mode}

    async def resume(self, weight_version: int | None = None) -> dict[str, Any]:
        """Open the gate with ``weight_version`` (SPEC §7); a frozen batch goes on, its next
        tokens sampled from the weights loaded meanwhile and recorded under that version."""
        if self._torn is not None:
            raise WeightUpdateError(self._torn)
        result = await super().resume(weight_version)
        self._release_hold()
        return result

    @contextlib.asynccontextmanager
    async def _whole_or_held(self) -> AsyncIterator[None]:
        """Around a weight update: one refused after it had changed the model's tensors (a push
        whose copy fails its checksum once made) leaves the model holding weights of no
        version, so the replica may not resume with the version it had (its frozen generations
        would go on, and new ones begin, labelled with weights they are not sampled from):
        :meth:`resume` is refused until a whole version arrived. A refusal that changed
        nothing leaves the replica as it was."""
        before = await asyncio.to_thread(_fingerprint, self.model)
        try:
            yield
        except WeightUpdateError as exc:
            if await asyncio.to_thread(_fingerprint, self.model) != before:
                self._torn = (
                    f"a refused weight update had changed the model already ({exc}): it holds no "
                    f"whole weight_version; resume waits for a complete update"
                )
                log.error("weight update refused after it changed the model", error=str(exc))
            raise
        self._torn = None

    def _release_hold(self) -> None:
        self._hold = False
        self._thawed.set()

    def _require_paused(self) -> None:
        # A keep-pause: the generations in flight are frozen or not begun, no forward pass runs.
        if not self._paused or (self._inflight and not self._hold):
            raise NotPaused("pause generation before updating weights (POST /pause)")

    def _loaded(self) -> PreTrainedModel:
        if self.model is None:
            raise RuntimeError("model not loaded")
        return self.model

    async def update_weights(self, request: UpdateWeights | Mapping[str, object]) -> dict[str, Any]:
        """``{"manifest", "mode": "attach"|"copy", "weight_version"?}`` (shared / push mode; a
        bucket manifest: one bucket of a bucketed push, mode ``copy``), checked by
        :func:`atroposd.weights.receiver.check_update` against the model's own tensors."""
        from atroposd.weights.receiver import apply_update

        if self.receiver is None:
            raise WeightUpdateError("this server has no weight receiver")
        self._require_paused()
        async with self._compute, self._whole_or_held():
            t0 = time.perf_counter()
            result = await asyncio.to_thread(apply_update, self._loaded(), request, state=self.receiver)
        self.updates += 1
        return {**result, "seconds": round(time.perf_counter() - t0, 6)}

    async def load_weights(self, request: LoadWeights | Mapping[str, object]) -> dict[str, Any]:
        """``{"path", "weight_version"}``: load a directory the trainer wrote (reload mode)."""
        from atroposd.weights.receiver import load_dir

        body = LoadWeights.parse(request)
        self._require_paused()
        async with self._compute, self._whole_or_held():
            result = await asyncio.to_thread(
                load_dir, self._loaded(), body.path, weight_version=body.weight_version, state=self.receiver
            )
        self.updates += 1
        return result

    async def broadcast_weights(self, request: BroadcastOp | Mapping[str, object]) -> dict[str, Any]:
        """``POST /broadcast`` (``weight_sync = "broadcast"``): join the trainer's group, receive
        a sync's buckets into the model, finish (``atroposd.weights.broadcast``)."""
        from atroposd.weights.broadcast import BroadcastEndpoint

        if self.receiver is None or not self.receiver.nonce:
            raise WeightUpdateError("this server has no weight receiver (no launch nonce)")
        body = BroadcastOp.parse(request)
        endpoint = self._broadcast
        if endpoint is None:
            endpoint = self._broadcast = BroadcastEndpoint(self.receiver.nonce)
        result = await endpoint.handle(
            body.body,
            model=self._loaded(),
            state=self.receiver,
            require_paused=self._require_paused,
            compute=self._compute,
        )
        if body.op == "finish":
            self.updates += 1
        return result

    async def weight_info(self) -> dict[str, Any]:
        return {
            "weight_version": self.weight_version,
            "paused": self._paused,
            "attached": bool(self.receiver is not None and self.receiver.attached),
            "updates": self.updates,
            "awaiting_weights": self.awaiting_weights,
            "waiting": self.waiting,
            "held": self._hold,  # a keep-pause: generations in flight frozen or not begun
            "inflight": self._inflight,
            "engine": self.name,
            "pid": os.getpid(),
        }

    def stats(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "rows": self.batched_rows,
            "queued": len(self._queue),
            "inflight": self._inflight,
            "frozen_syncs": self.frozen_syncs,
        }


# ---------------------------------------------------------------------------- helpers


def _deliver(future: asyncio.Future[dict[str, Any]], result: dict[str, Any]) -> None:
    """Answer a request on the event loop (a probe answered before its batch ends)."""
    if not future.done():  # a client that went away cancelled it
        future.set_result(result)


def _fingerprint(model: object) -> list[float]:
    """The sum of the first elements of each of the model's tensors (what the exporter's
    checksum covers): whether a weight update changed the model's values."""
    import torch

    from atroposd.weights.tensors import CHECKSUM_ELEMENTS, model_tensors

    if not isinstance(model, torch.nn.Module):
        return []
    tensors = list(model_tensors(model).tensors.values())
    if not tensors:
        return []
    with torch.no_grad():
        sums = torch.stack([t.detach().reshape(-1)[:CHECKSUM_ELEMENTS].to(torch.float64).sum() for t in tensors])
        sums = torch.nan_to_num(sums, nan=-1.0e300)  # NaN as a value, equal to itself
    return [float(x) for x in sums.tolist()]


def _eos_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> set[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, (list, tuple)):
        ids.update(int(i) for i in gen_eos)
    return ids

"""The vLLM engine (``[inference] engine = "vllm"``, extra ``atroposd[vllm]``).

It serves the same ``/generate`` (SPEC §7, with ``logprobs`` and ``prompt_logprobs``) on
vLLM's ``AsyncLLM`` and takes weights through vLLM's supported mechanisms: a worker extension
(``worker_extension_cls``, :mod:`atroposd.inference.vllm_worker`) reached with
``collective_rpc``, which reads the trainer's export and calls
``model_runner.reload_weights(..., is_checkpoint_format=True)`` — the checkpoint-format
reload reruns vLLM's fusing and repacking, so it works on the CPU backend where a plain
``load_weights`` after start-up does not. Nothing of vLLM is patched, no ``VLLM_USE_V1`` is
set, and only strings cross the RPC (so no insecure serialisation is needed); CUDA IPC handles
only travel through the 0600 manifest and Unix socket.

* Several trainer ranks: the bucketed push (one manifest per bucket) streams into the same
  checkpoint-format reload, started at bucket 0 and finished at the last one
  (:meth:`~atroposd.inference.vllm_worker.AtroposdWorkerExtension.atroposd_load_bucket`), with
  the receiver's order and completeness checks; the sharded reload directory loads like the single file.
* ``logprobs_mode = "processed_logprobs"``: rollout logprobs are ``log_softmax(logits / T)``
  of the sampled token, what the trainer recomputes. ``top_p < 1`` or ``top_k > 0`` are refused
  (processed logprobs would be renormalised over the truncated support).
* Pause (``pause``): no new generation is admitted, in-flight ones finish; ``resume(version)``
  opens the gate with the new ``weight_version``. Each response carries the version it was
  admitted under, which cannot change while it runs. After every update the prefix cache is
  reset (its KV was computed with the old weights).
* Shutdown: ``close()`` calls ``AsyncLLM.shutdown`` and then kills whatever is left of the
  engine's processes (vLLM's EngineCore has no parent-death detection): every other member
  of this process's group when it leads one, else its descendants.

The module imports no vLLM at import time. The inference server's front
(``atroposd inference --engine vllm``, :mod:`atroposd.inference.server`) hosts
:class:`VllmEngine` through the same methods as the torch engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from atroposd.devices import resolve
from atroposd.inference import schema
from atroposd.inference.gate import NotPaused, ShuttingDown, WeightGate
from atroposd.inference.schema import BadRequest
from atroposd.logs import get_logger
from atroposd.weights.control import BroadcastOp, LoadWeights, UpdateWeights
from atroposd.weights.protocol import WeightUpdateError

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from atroposd.config import Config
    from atroposd.weights.manifest import Manifest, TensorSpec
    from atroposd.weights.receiver import CheckedUpdate, ReceiverState

__all__ = ["REFUSED", "BadRequest", "VllmEngine", "sampling_kwargs"]

log = get_logger(__name__)


def check_installed_vllm(*, allow_untested: bool) -> None:
    """Refuse a vLLM outside the tested range (SPEC §1: :class:`UntestedVllm`, naming the range),
    or log a warning when ``allow_untested`` lets it start."""
    from atroposd.inference.vllm_range import check_vllm_version, installed_vllm_version

    version = installed_vllm_version()
    warning = check_vllm_version(version, allow_untested=allow_untested)
    if warning is not None:
        log.warning("untested vLLM", version=version, detail=warning)


# vLLM imports the worker extension by this name in each worker (atroposd.inference.vllm_worker);
# importing it registers atroposd's weight-transfer engine under this backend name.
WORKER_EXTENSION = "atroposd.inference.vllm_worker.AtroposdWorkerExtension"
TRANSFER_BACKEND = "atroposd"
# How the weight-control pause treats generations in flight (vLLM's pause_generation modes):
# "wait" drains them (no new admission until resume), "keep" freezes them between two decode
# steps; they go on after resume, on whatever weights were loaded meanwhile.
PAUSE_MODES = ("wait", "keep")
CPU_DEFAULT_MEMORY_FRACTION = 0.2
# How long a probe generation waits for a bucketed push under way before it fails.
PROBE_WAIT_S = 60.0
# vLLM's priority of a probe (max_tokens ≤ 1) under scheduling_policy = "priority"; rollouts have 0.
PROBE_PRIORITY = -1


# ---------------------------------------------------------------------------- engine


def tensor_parallel_args(extra_args: list[str], gpus: int) -> list[str]:
    """``extra_args`` with ``--tensor-parallel-size GPUS`` for a replica on several GPUs, unless
    they set it already (SPEC §12.2)."""
    if gpus <= 1 or any(
        a in ("-tp", "--tensor-parallel-size") or a.startswith(("-tp=", "--tensor-parallel-size=")) for a in extra_args
    ):
        return list(extra_args)
    return [*extra_args, "--tensor-parallel-size", str(gpus)]


class VllmEngine(WeightGate):
    """AsyncLLM behind the inference-engine methods: generate, pause/resume, weights, close."""

    name = "vllm"
    pause_modes: tuple[str, ...] = PAUSE_MODES  # what the weight-control pause route accepts (inference/server.py)

    def __init__(
        self,
        *,
        model: str,
        tokenizer: str | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        max_model_len: int = 4096,
        gpu_memory_utilization: float = 0.0,
        enforce_eager: bool = False,
        extra_args: list[str] | None = None,
        receiver: ReceiverState | None = None,
        seed: int = 0,
        await_weights: bool = False,
        lora_rank: int | None = None,
        gpus: int = 1,
    ) -> None:
        self.model = model
        self.gpus = gpus  # the GPUs this replica was given: its tensor-parallel size (SPEC §12.2)
        # A path, not a tokenizer object: the front loads its own tokenizer from the config.
        self.tokenizer_path = tokenizer or model
        self.dtype = dtype
        self.device = device
        self.max_model_len = max_model_len
        self.gpu_memory_utilization = gpu_memory_utilization
        self.enforce_eager = enforce_eager
        self.extra_args = list(extra_args or [])
        self.receiver = receiver  # atroposd.weights.receiver.ReceiverState
        self.seed = seed
        self.vocab_size = 0  # the embedding's rows, read from the model's config at start
        super().__init__(await_weights=await_weights)
        self.engine: AsyncLLM | None = None
        self._starting: asyncio.Future[AsyncLLM] | None = None
        self._expected: tuple[dict[str, TensorSpec], dict[str, str]] | None = None
        self._update_lock = asyncio.Lock()
        self._whole = asyncio.Event()  # set: no bucketed push under way (_settle)
        self._whole.set()
        # vLLM's scheduler paused (pause_generation) until resume; with "keep", generations in
        # flight are frozen and weights may change under them.
        self._engine_paused = False
        self._frozen = False
        self._session = False  # a weight-transfer session (start_weight_update) not yet finished
        # LoRA (trainer.mode = "lora"): adapters arrive through reload; generations use the newest.
        self.lora_rank = lora_rank
        self._lora: LoRARequest | None = None  # the adapter generations use
        self._lora_ids = 0
        self._probing = 0  # clients' probes scheduled ahead of the rollouts now
        # weight_sync = "broadcast": the receive under way, its (formation, version), the group joined
        self._bcast_task: asyncio.Task[dict[str, Any]] | None = None
        self._bcast_key: tuple[object, object] | None = None
        self._bcast_formation: object = None

    @classmethod
    def from_config(
        cls, cfg: Config, *, receiver: ReceiverState | None = None, await_weights: bool = False
    ) -> VllmEngine:
        """An engine for ``cfg.inference`` (the model resolved to a local directory first).

        ``receiver`` defaults to ``ReceiverState.from_config(cfg)`` (nonce from
        ``ATROPOSD_INSTANCE``).
        """
        from atroposd.models.resolve import resolve_model, resolve_tokenizer
        from atroposd.weights.receiver import ReceiverState

        inf = cfg.inference
        check_installed_vllm(allow_untested=inf.vllm.allow_untested)
        model = str(resolve_model(cfg))
        tokenizer = str(resolve_tokenizer(cfg))
        # A device list names one device per replica; a server is told its own (inference/cli.py).
        one = inf.device if isinstance(inf.device, str) else cfg.inference_devices()[0]
        device, dtype = resolve(one, inf.dtype, key="inference.device")
        return cls(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            device=device,
            max_model_len=inf.max_model_len,
            gpu_memory_utilization=inf.vllm.gpu_memory_utilization,
            enforce_eager=inf.vllm.enforce_eager,
            extra_args=list(inf.vllm.extra_args),
            receiver=receiver if receiver is not None else ReceiverState.from_config(cfg),
            seed=cfg.trainer.seed,
            await_weights=await_weights,
            lora_rank=cfg.trainer.lora_r if cfg.trainer.enabled and cfg.trainer.mode == "lora" else None,
            gpus=int(os.environ.get("ATROPOSD_GPUS") or 1),
        )

    # ------------------------------------------------------------------ lifecycle

    def engine_args(self) -> AsyncEngineArgs:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
        ns = parser.parse_args(["--model", self.model, *tensor_parallel_args(self.extra_args, self.gpus)])
        args = AsyncEngineArgs.from_cli_args(ns)
        args.tokenizer = self.tokenizer_path
        args.dtype = resolve(self.device, self.dtype, key="inference.device")[1]
        args.max_model_len = self.max_model_len
        on_cpu = self.device == "cpu"
        fraction = self.gpu_memory_utilization or (CPU_DEFAULT_MEMORY_FRACTION if on_cpu else 0.9)
        args.gpu_memory_utilization = fraction
        args.enforce_eager = self.enforce_eager or on_cpu
        args.logprobs_mode = "processed_logprobs"
        # Probes (max_tokens ≤ 1: health checks) go ahead of queued rollouts (lower = sooner).
        args.scheduling_policy = "priority"
        args.worker_extension_cls = WORKER_EXTENSION
        # Every weight update goes through vLLM's weight-transfer lifecycle into atroposd's own
        # engine, which the worker extension registers in each worker (vllm_transfer.py).
        from vllm.config import WeightTransferConfig

        args.weight_transfer_config = WeightTransferConfig(backend=TRANSFER_BACKEND)
        args.seed = self.seed
        # vLLM's own statistics on: its Prometheus metrics (vllm:*) join the server's /metrics
        # (atroposd.inference.metrics); its periodic throughput line goes to this server's log.
        args.disable_log_stats = False
        if self.lora_rank is not None:
            ranks = (1, 8, 16, 32, 64, 128, 256, 320, 512)
            args.enable_lora = True
            args.max_lora_rank = next((r for r in ranks if r >= self.lora_rank), ranks[-1])
            args.max_loras = 1
            args.max_cpu_loras = 2
        return args

    async def start(self) -> None:
        # Importing vLLM and building its arguments takes seconds (minutes on a loaded machine):
        # off the event loop, like the engine itself.
        args = await asyncio.to_thread(self.engine_args)
        log.info(
            "starting vLLM",
            model=self.model,
            dtype=args.dtype,
            device=self.device,
            memory_fraction=args.gpu_memory_utilization,
        )
        specs, tied, self.vocab_size = await asyncio.to_thread(
            _expected_tensors, self.model, args.dtype if args.dtype != "auto" else "float32"
        )
        self._expected = specs, tied
        # Built in a thread: the start takes a minute on a CPU, and meanwhile the front must keep
        # answering /health (503) and its signals. A stop during the start cancels this
        # coroutine but not the thread; close() waits for the engine and shuts it down.
        self._starting = asyncio.get_running_loop().run_in_executor(None, _build_engine, args)
        self.engine = await asyncio.shield(self._starting)
        self._starting = None
        # vLLM labels every output token with its engine's weight version: from here on the
        # label is the version generation was resumed with (resume), so that a completion that
        # spans a swap reports where it happened (_version_record).
        await self._started().update_weight_version(str(self.weight_version))

    async def close(self, timeout: float = 1.5) -> None:
        """Shut the engine down (waiting for one still starting); then kill what is left of its
        processes and remove the shared memory they leave (vLLM's message queues are ``psm_*``
        segments of a few hundred MB that only their creator unlinks, which a killed EngineCore
        never does). Called as the server stops: segments this process still maps go too."""
        self._close_gate()
        engine, self.engine = self.engine, None
        starting, self._starting = self._starting, None
        mapped = await asyncio.to_thread(_engine_segments)
        try:
            if engine is None and starting is not None:
                with contextlib.suppress(Exception):
                    engine = await starting
            if engine is not None:
                if self._bcast_formation:
                    # a worker still in a broadcast group leaves it first (else it lingers at shutdown)
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(engine.collective_rpc("atroposd_broadcast_leave"), 5.0)
                await asyncio.to_thread(engine.shutdown, timeout)
        finally:
            _kill_leftovers()
            mapped |= _engine_segments()  # an engine still starting maps its queues late
            _remove_segments(mapped)

    async def check_health(self) -> None:
        if self.engine is None:
            raise RuntimeError("engine not started")
        await self.engine.check_health()

    # ------------------------------------------------------------------ generation

    async def generate(
        self, request: Mapping[str, object] | schema.GenerateParams, *, bypass_pause: bool = False
    ) -> dict[str, Any]:
        """One Atropos ``/generate`` request (or one the front parsed already) → its response
        (SPEC §7). The daemon's own generations and a few probes (``schema.with_lane``) are
        scheduled ahead of queued rollouts (vLLM's priority scheduling, :data:`PROBE_PRIORITY`)."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        if isinstance(request, schema.GenerateParams):
            parsed, kw = request, sampling_kwargs(request)
        else:
            parsed, kw = self.validate(request)
        params = SamplingParams(**kw, output_kind=RequestOutputKind.FINAL_ONLY)
        # The daemon's own generations always go ahead; a client's probe (schema.with_lane) only
        # while fewer than PROBE_ROWS_PER_BATCH are ahead already, else it waits as a rollout.
        ahead = parsed.lane == "own" or (parsed.lane == "probe" and self._probing < schema.PROBE_ROWS_PER_BATCH)
        priority = PROBE_PRIORITY if ahead else 0
        if parsed.lane == "probe" and ahead:
            self._probing += 1
        try:
            return await self._generate(parsed, params, priority, bypass_pause)
        finally:
            if parsed.lane == "probe" and ahead:
                self._probing -= 1

    async def _generate(
        self, parsed: schema.GenerateParams, params: SamplingParams, priority: int, bypass_pause: bool
    ) -> dict[str, Any]:
        if bypass_pause:
            await self._weights_whole()
        async with self._admitted(bypass_pause) as version:
            final = None
            async for out in self._started().generate(
                # The prefix cache is keyed by the admission version: a request admitted after
                # a swap never reuses KV that older weights computed (SPEC §7).
                {"prompt_token_ids": parsed.prompt_ids, "cache_salt": f"atroposd-v{version}"},
                params,
                request_id=f"gen-{uuid.uuid4().hex}",
                lora_request=self._lora,
                priority=priority,
            ):
                final = out
        assert final is not None
        if any(c.finish_reason == "abort" for c in final.outputs):
            # vLLM aborts what it is generating as it shuts down (also a generation a keep-pause
            # holds frozen): a 503 as from every engine, never a 200 with a completion cut short
            # that an environment would score as a rollout
            raise ShuttingDown("the inference server is shutting down (vLLM aborted the generation)")
        return _response(final, version, want_prompt_logprobs=parsed.prompt_logprobs is not None)

    def validate(self, request: object) -> tuple[schema.GenerateParams, dict[str, Any]]:
        """The request parsed as every engine parses it, and its ``SamplingParams`` arguments
        (a :class:`BadRequest` for a malformed request or one this engine cannot honour)."""
        params = schema.parse_generate(request, max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        return params, sampling_kwargs(params)

    # ------------------------------------------------------------------ weight control

    async def pause(self, mode: str = "wait", clear_cache: bool | None = None) -> dict[str, Any]:
        """Stop generation for a weight update, through vLLM's own ``pause_generation``.

        ``mode = "wait"`` (the default): admit nothing new and return once every admitted
        generation has been answered. ``"keep"``: admit nothing new and freeze the generations in
        flight between two decode steps; weights may then change under them, and they go on at
        :meth:`resume`, each token sampled after the swap from the new weights (its logprob
        theirs), the response's ``weight_versions`` naming where. ``clear_cache`` (default: true
        for "keep", false for "wait", whose update drops the prefix cache anyway) drops the KV
        and prefix caches as it pauses, so that frozen sequences recompute their KV with the
        weights they resume on; false keeps the frozen KV of the old weights.
        """
        if mode not in PAUSE_MODES:
            raise BadRequest(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        if clear_cache is not None and not isinstance(clear_cache, bool):
            raise BadRequest(f"clear_cache must be true or false, got {clear_cache!r}")
        clear = clear_cache if clear_cache is not None else mode == "keep"
        if mode == "wait":
            out = await super().pause()
            if self.engine is not None:
                await self.engine.pause_generation(mode="wait", clear_cache=clear)
                self._engine_paused = True
            return {**out, "mode": mode}
        self.hold_admissions()
        if self.engine is not None:
            await self.engine.pause_generation(mode="keep", clear_cache=clear)
            self._engine_paused = True
        self._frozen = True
        return {"paused": True, "weight_version": self.weight_version, "mode": mode, "frozen": self._inflight}

    async def resume(self, weight_version: int | None = None) -> dict[str, Any]:
        """Open the gate with ``weight_version`` (unless a bucketed push stopped halfway) and let
        vLLM's scheduler go on: frozen generations continue, their next tokens labelled with the
        new version."""
        problem = self.receiver.incomplete() if self.receiver is not None else None
        if problem is not None:
            raise WeightUpdateError(problem)
        if self.engine is not None:
            if weight_version is not None:
                await self.engine.update_weight_version(str(int(weight_version)))
            if self._engine_paused:
                await self.engine.resume_generation()
                self._engine_paused = False
        self._frozen = False
        return await super().resume(weight_version)

    def _require_paused(self) -> None:
        # With "keep", the generations in flight are frozen in vLLM's scheduler: weights may change.
        if not self._paused or (self._inflight and not self._frozen):
            raise NotPaused("pause generation before updating weights (POST /pause)")

    def _started(self) -> AsyncLLM:
        if self.engine is None:
            raise RuntimeError("engine not started")
        return self.engine

    def _update_targets(self, manifest: Manifest) -> tuple[dict[str, TensorSpec], dict[str, str]]:
        """What an update is checked against: the checkpoint-format tensors vLLM loads."""
        from atroposd.weights.manifest import ManifestError

        if manifest.lora is not None:
            raise ManifestError("LoRA exports go through reload mode with the vLLM engine")
        return self._expected or ({}, {})

    async def update_weights(self, request: UpdateWeights | Mapping[str, object]) -> dict[str, Any]:
        """``{"manifest", "mode": "copy", "weight_version"?}``: copy an export in (push), or one
        bucket of a bucketed push (a manifest with ``bucket``; :meth:`_update_bucket`), checked by
        :func:`atroposd.weights.receiver.check_update` against the checkpoint-format tensors."""
        from atroposd.weights.receiver import ReceiverState, check_update

        receiver = self.receiver or ReceiverState(nonce="", weights_dir=Path())  # no nonce: refused
        checked = check_update(
            request,
            receiver,
            self._update_targets,
            engine="vLLM",
            modes=("copy",),
            note=" (vLLM fuses and repacks weights: no shared mode)",
            ready=self._require_paused,
        )
        manifest = checked.manifest
        if checked.progress is not None:
            return await self._update_bucket(checked, receiver)
        async with self._update_lock:
            t0 = time.perf_counter()
            try:
                await self._transfer({"manifest": manifest.to_json().decode()}, start=True, finish=True)
                receiver.buckets = None  # a whole model replaces any push that stopped halfway
                receiver.weight_version = manifest.weight_version
            finally:
                self._settle()
        self.updates += 1
        stats = _manifest_stats(manifest)
        log.info("weights updated", weight_version=manifest.weight_version, seconds=time.perf_counter() - t0, **stats)
        return {"weight_version": manifest.weight_version, "mode": "copy", "export_id": manifest.export_id, **stats}

    async def _update_bucket(self, checked: CheckedUpdate, receiver: ReceiverState) -> dict[str, Any]:
        """One bucket of a bucketed push (several trainer ranks), in order and (the last one)
        completing the model, as :func:`~atroposd.weights.receiver.check_update` checked before
        the worker loads it. The workers stream the buckets into vLLM's checkpoint-format reload
        (:meth:`~atroposd.inference.vllm_worker.AtroposdWorkerExtension.atroposd_load_bucket`); the
        served version changes only at ``/resume``, which is refused until the last bucket is in
        (``ReceiverState.incomplete``)."""
        manifest, progress = checked.manifest, checked.progress
        assert manifest.bucket is not None and progress is not None
        index, count = manifest.bucket.index, manifest.bucket.count
        receiver.buckets = progress  # from here until the last bucket the model is mid-reload
        self._settle()
        async with self._update_lock:
            t0 = time.perf_counter()
            try:
                await self._transfer(
                    {"manifest": manifest.to_json().decode()}, start=index == 0, finish=index + 1 == count
                )
                complete = receiver.bucket_applied(manifest, progress)
            finally:
                self._settle()
        self.updates += 1
        stats = _manifest_stats(manifest)
        seconds = time.perf_counter() - t0
        log.debug(
            "bucket loaded",
            bucket=index,
            buckets=count,
            weight_version=manifest.weight_version,
            seconds=seconds,
            **stats,
        )
        if complete:
            log.info("weights updated", weight_version=manifest.weight_version, buckets=count)
        return {
            "weight_version": manifest.weight_version,
            "mode": "copy",
            "export_id": manifest.export_id,
            "tensors": stats["tensors"],
            "bytes": stats["bytes"],
            "bucket": index,
            "buckets": count,
            "complete": complete,
            "seconds": round(seconds, 6),
        }

    def _settle(self) -> None:
        """Let generations that bypass the pause (the daemon's probes) run only while no
        bucketed push is under way (:meth:`_weights_whole`)."""
        if self.receiver is None or self.receiver.buckets is None:
            self._whole.set()
        else:
            self._whole.clear()

    async def _weights_whole(self) -> None:
        """Wait while a bucketed push is under way: the model is then mid-reload (vLLM's layers not
        yet loaded hold no weights), so a probe must not run it. A push that does not complete
        within :data:`PROBE_WAIT_S` fails the probe, naming why."""
        try:
            while self.receiver is not None and self.receiver.buckets is not None:
                await asyncio.wait_for(self._whole.wait(), PROBE_WAIT_S)
        except asyncio.TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
            problem = self.receiver.incomplete() if self.receiver is not None else None
            raise WeightUpdateError(problem or "a bucketed push is under way") from None

    async def load_weights(self, request: LoadWeights | Mapping[str, object]) -> dict[str, Any]:
        """``{"path", "weight_version"}``: load a directory the trainer wrote (reload mode),
        checked by :func:`atroposd.weights.receiver.check_load`; a LoRA directory's adapter is
        served as an adapter."""
        from atroposd.weights.manifest import itemsize
        from atroposd.weights.receiver import check_load

        def targets(lora: Mapping[str, Any] | None) -> tuple[dict[str, TensorSpec], dict[str, str]] | None:
            if lora is not None:
                return None
            if self.lora_rank is not None:
                raise WeightUpdateError(
                    'this engine serves LoRA adapters (trainer.mode = "lora"); the sync directory holds a full model'
                )
            return self._expected or ({}, {})

        checked = check_load(request, self.receiver, targets, ready=self._require_paused)
        file, version, exported = checked.file, checked.weight_version, checked.exported
        if checked.lora is not None:
            return await self._load_adapter(file.parent, version, checked.lora)
        async with self._update_lock:
            try:
                await self._transfer({"path": str(file)}, start=True, finish=True)
                if self.receiver is not None:
                    self.receiver.buckets = None  # a whole model replaces any push that stopped halfway
                    self.receiver.weight_version = version
            finally:
                self._settle()
        self.updates += 1
        total = sum(itemsize(sp.dtype) * math.prod(sp.shape) for sp in exported.values())
        return {"weight_version": version, "mode": "load", "export_id": None, "tensors": len(exported), "bytes": total}

    async def _load_adapter(self, directory: Path, version: int, spec: Mapping[str, Any]) -> dict[str, Any]:
        """Serve the adapter of a LoRA sync directory; the previous adapter is dropped."""
        from vllm.lora.request import LoRARequest

        from atroposd.weights.syncdir import adapter_dir

        if self.lora_rank is None:
            raise WeightUpdateError(
                'a LoRA adapter arrived but this engine was started without LoRA (trainer.mode is not "lora")'
            )
        if int(spec["r"]) > self.lora_rank:
            raise WeightUpdateError(f"adapter rank {spec['r']} exceeds the engine's lora rank {self.lora_rank}")
        adapter = adapter_dir(directory)
        if not (adapter / "adapter_config.json").is_file():
            raise WeightUpdateError(f"{adapter} holds no PEFT adapter (adapter_config.json missing)")
        self._lora_ids += 1
        request = LoRARequest(
            lora_name=f"atroposd-v{version}-{self._lora_ids}", lora_int_id=self._lora_ids, lora_path=str(adapter)
        )
        async with self._update_lock:
            try:
                await self._started().add_lora(request)
            except Exception as exc:  # vLLM reports a bad adapter with its own exception types
                raise WeightUpdateError(f"vLLM refused the adapter {adapter}: {exc}") from exc
            previous, self._lora = self._lora, request
            if previous is not None:
                await self._started().remove_lora(previous.lora_int_id)
            await self._started().reset_prefix_cache()
        self.updates += 1
        return {"weight_version": version, "mode": "load", "export_id": None, "adapter": str(adapter)}

    async def _transfer(self, update_info: dict[str, str] | None, *, start: bool, finish: bool) -> None:
        """One step of vLLM's weight-transfer lifecycle on every worker (atroposd's transfer
        engine, :mod:`atroposd.inference.vllm_transfer`): ``start`` opens a session (finishing
        one left open by a push that stopped halfway), ``update_info`` is one chunk, ``finish``
        closes it and drops the prefix cache.

        A worker reads and checks a chunk before it loads any of it, and vLLM's reload starts
        with the first chunk loaded, so a whole model refused (a segment gone, a checksum off)
        leaves the served weights as they were; it is answered as a refused update, naming the
        cause.
        """
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        try:
            if start:
                if self._session:  # vLLM has no abort: the transfer engine drops what arrived
                    self._session = False
                    await self._started().finish_weight_update()
                await self._started().start_weight_update()
                self._session = True
            if update_info is not None:
                try:
                    await self._started().update_weights(WeightTransferUpdateRequest(update_info=update_info))
                except BaseException:
                    self._session = False  # vLLM's worker ends the session on an error
                    raise
            if finish:
                self._session = False
                await self._started().finish_weight_update()
        except Exception as exc:  # vLLM wraps the worker's exception in its own types
            raise WeightUpdateError(f"the vLLM worker refused the update: {exc}") from exc
        if finish:
            await self._started().reset_prefix_cache()

    async def broadcast_weights(self, request: BroadcastOp | Mapping[str, object]) -> dict[str, Any]:
        """``POST /broadcast`` (``weight_sync = "broadcast"``, atroposd.weights.broadcast): every
        worker joins the trainer's group; a receive is checked whole against the model's
        checkpoint-format tensors, then streamed by the workers in the background; finish waits."""
        from atroposd.weights.broadcast import JoinRequest, check_plan, layout, parse_plan
        from atroposd.weights.receiver import BucketProgress

        if self.receiver is None or not self.receiver.nonce:
            raise WeightUpdateError("this server has no launch nonce (ATROPOSD_INSTANCE); it cannot accept weights")
        receiver = self.receiver
        parsed = BroadcastOp.parse(request)
        op, fields = parsed.op, parsed.body
        engine = self._started()
        if op in ("join", "leave"):
            task, self._bcast_task, self._bcast_key = self._bcast_task, None, None
            if task is not None and not task.done():
                await engine.collective_rpc("atroposd_broadcast_leave")
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(task), 30.0)
            self._bcast_formation = None
            if op == "leave":
                await engine.collective_rpc("atroposd_broadcast_leave")
                return {"left": True}
            JoinRequest.parse(fields, secret=self.receiver.nonce)
            workers = len(await engine.collective_rpc("atroposd_ping"))
            body = orjson.dumps({"join": dict(fields), "secret": self.receiver.nonce, "world": 1 + workers}).decode()
            try:
                from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

                await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info={"broadcast": body}))
            except Exception as exc:  # vLLM wraps the worker's exception in its own types
                raise WeightUpdateError(f"the vLLM workers did not join the broadcast group: {exc}") from exc
            self._bcast_formation = fields["prefix"]
            return {"formation": fields["prefix"], "world": 1 + workers}
        if op == "receive":
            self._require_paused()
            if self._bcast_task is not None and not self._bcast_task.done():
                raise WeightUpdateError("a broadcast is already being received")
            formation, version = fields.get("formation"), fields.get("weight_version")
            if formation is None or formation != self._bcast_formation:
                raise WeightUpdateError(
                    f"broadcast formation {formation!r} is not the group this replica joined "
                    f"({self._bcast_formation}); join again"
                )
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise WeightUpdateError("'weight_version' must be a non-negative integer")
            plan = parse_plan(fields)
            expected, tied = self._expected or ({}, {})
            check_plan(plan, expected, tied)
            progress = BucketProgress(version, len(plan))
            receiver.buckets = progress  # the model is mid-reload until the last bucket
            self._settle()
            chunks = [
                orjson.dumps(
                    {
                        "formation": formation,
                        "weight_version": version,
                        "index": i,
                        "buckets": len(plan),
                        "tensors": [[n, sp.dtype, list(sp.shape)] for n, sp in b],
                    }
                ).decode()
                for i, b in enumerate(plan)
            ]

            async def run() -> dict[str, Any]:
                t0 = time.perf_counter()
                async with self._update_lock:
                    try:
                        # one lifecycle session; each bucket is one update_weights chunk
                        for i, chunk in enumerate(chunks):
                            await self._transfer({"broadcast": chunk}, start=i == 0, finish=i + 1 == len(chunks))
                        receiver.buckets = None
                        receiver.weight_version = version
                    finally:
                        self._settle()
                self.updates += 1
                stats = {
                    "tensors": sum(len(b) for b in plan),
                    "bytes": sum(layout(b).size for b in plan),
                    "buckets": len(plan),
                }
                return {"weight_version": version, **stats, "seconds": round(time.perf_counter() - t0, 6)}

            self._bcast_task = asyncio.get_running_loop().create_task(run())
            self._bcast_key = (formation, version)
            return {"accepted": True, "formation": formation, "weight_version": version, "buckets": len(plan)}
        if op == "finish":
            key = (fields.get("formation"), fields.get("weight_version"))
            task = self._bcast_task
            if task is None or self._bcast_key != key:
                raise WeightUpdateError(f"no broadcast of weight_version {key[1]} under way in {key[0]!r}")
            self._bcast_task, self._bcast_key = None, None
            result: dict[str, Any] = await asyncio.shield(task)
            log.info(
                "weights received by broadcast",
                **{k: result[k] for k in ("weight_version", "buckets", "bytes", "seconds")},
            )
            return result
        raise WeightUpdateError(f"unknown broadcast op {op!r} (join, receive, finish, leave)")

    async def weight_info(self) -> dict[str, Any]:
        return {
            "weight_version": self.weight_version,
            "paused": self._paused,
            "attached": False,
            "updates": self.updates,
            "awaiting_weights": self.awaiting_weights,
            "waiting": self.waiting,
            "engine": self.name,
            "pid": os.getpid(),
        }


def _manifest_stats(manifest: Manifest) -> dict[str, int]:
    return {"tensors": len(manifest.tensors), "bytes": sum(t.nbytes for t in manifest.tensors)}


def _build_engine(args: AsyncEngineArgs) -> AsyncLLM:
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(args)


def _expected_tensors(model_dir: str, dtype: str) -> tuple[dict[str, Any], dict[str, str], int]:
    """The checkpoint-format tensors vLLM loads (an HF model of the config on the meta device),
    their aliases, and the vocabulary (the input embedding's rows)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from atroposd.weights.tensors import model_tensors

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    mt = model_tensors(meta)
    return mt.specs(), mt.tied, int(meta.get_input_embeddings().weight.shape[0])


def _engine_segments() -> set[str]:
    """/dev/shm segments this process and its descendants map now."""
    import psutil

    from atroposd.shmscan import mapped_shm

    pids = [os.getpid()]
    with contextlib.suppress(psutil.Error):
        pids += [p.pid for p in psutil.Process().children(recursive=True)]
    return set(mapped_shm(pids=pids))


def _remove_segments(names: set[str]) -> None:
    import psutil

    from atroposd.shmscan import unlink_orphaned_segments

    try:
        since = psutil.Process().create_time()
    except psutil.Error:
        return
    removed = unlink_orphaned_segments(names, since=since, ignore_pids=[os.getpid()])
    if removed:
        log.info("removed the engine's shared-memory segments", segments=removed)


def _kill_leftovers() -> None:
    """SIGKILL the engine's processes that survived shutdown (own group, or descendants)."""
    import psutil

    me = os.getpid()
    victims: list[psutil.Process] = []
    try:
        victims = psutil.Process(me).children(recursive=True)
    except psutil.Error:
        victims = []
    if os.getpgrp() == me:
        for proc in psutil.process_iter(["pid"]):
            try:
                if proc.pid != me and os.getpgid(proc.pid) == me and proc not in victims:
                    victims.append(proc)
            except (ProcessLookupError, psutil.Error):
                continue
    for proc in victims:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(victims, timeout=2)


# ---------------------------------------------------------------------------- /generate mapping

# What this engine cannot honour of a valid /generate request (SPEC §7): with
# processed_logprobs, vLLM renormalises the logprobs over the truncated support.
REFUSED = ("top_p < 1", "top_k > 0")


def sampling_kwargs(params: schema.GenerateParams) -> dict[str, Any]:
    """A request parsed by :func:`atroposd.inference.schema.parse_generate` → the keyword
    arguments of vLLM's ``SamplingParams``; :data:`REFUSED` is answered with a ``BadRequest``."""
    if params.top_p < 1.0 or params.top_k > 0:
        raise BadRequest(
            f"top_p < 1 and top_k > 0 are not supported by the vLLM engine (got top_p = {params.top_p}, "
            f"top_k = {params.top_k}): the rollout logprobs would be renormalised over the truncated "
            "support and no longer match the trainer's"
        )
    kw: dict[str, Any] = {
        "n": params.n,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "logprobs": params.logprobs,
        "ignore_eos": params.ignore_eos,
        "skip_special_tokens": params.skip_special_tokens,
        "include_stop_str_in_output": params.include_stop_str_in_output,
    }
    if params.stop:
        kw["stop"] = list(params.stop)
    if params.stop_token_ids:
        kw["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        kw["seed"] = params.seed
    if params.prompt_logprobs is not None:
        kw["prompt_logprobs"] = params.prompt_logprobs
    return kw


def _version_record(completion: CompletionOutput, admitted: int) -> list[list[int]]:
    """``[[token_index, version], ...]``: from which output token on each weight version sampled
    this completion, starting at ``[0, admitted]`` (vLLM's spans of its weight-version labels,
    which :meth:`VllmEngine.resume` sets). A version no token was sampled under is left out: a
    generation admitted before a keep-pause but first scheduled after it starts at the version
    it was resumed with (:func:`_response` reports the oldest first version of a request's
    copies as its ``weight_version``)."""
    record = [[0, admitted]]
    for span in getattr(completion, "weight_versions", None) or ():
        try:
            version, start = int(span.version), int(span.start)
        except (TypeError, ValueError):  # a label atroposd did not set
            continue
        if version == record[-1][1]:
            continue
        if start <= record[-1][0]:  # nothing sampled under the version before
            record[-1][1] = version
        else:
            record.append([start, version])
    return record


def _response(out: RequestOutput, version: int, *, want_prompt_logprobs: bool) -> dict[str, Any]:
    """RequestOutput → the Atropos response: logprobs[completion][token] = [{"<id>": lp}]."""
    completions = sorted(out.outputs, key=lambda c: c.index)
    logprobs = []
    for c in completions:
        per_token = []
        for pos, tid in enumerate(c.token_ids):
            entry = c.logprobs[pos] if c.logprobs is not None and pos < len(c.logprobs) else None
            lp = entry[tid].logprob if entry is not None and tid in entry else None
            if lp is None:
                raise RuntimeError(f"vLLM returned no logprob for sampled token {tid} at position {pos}")
            per_token.append([{str(tid): float(lp)}])
        logprobs.append(per_token)
    body: dict[str, Any] = {
        "text": [c.text for c in completions],
        "token_ids": [list(c.token_ids) for c in completions],
        "logprobs": logprobs,
        "finish_reasons": [c.finish_reason for c in completions],
        "weight_version": version,
    }
    records = [_version_record(c, version) for c in completions]
    # The version its first tokens were sampled under (a later one than the admission's when it
    # began after a swap). The n copies of one request may begin on both sides of a keep-swap (vLLM
    # schedules them as room frees up): the response then names the oldest, and a copy that began
    # on newer weights opens its record with an empty span, [[0, oldest], [0, its own], ...], so
    # every record starts at [0, weight_version] (SPEC §7) and says which weights sampled what.
    began = min(r[0][1] for r in records) if records else version
    body["weight_version"] = began
    records = [r if r[0][1] == began else [[0, began], *r] for r in records]
    if any(len(r) > 1 for r in records):  # only a completion that spans a swap carries it
        body["weight_versions"] = records
    if want_prompt_logprobs:
        pl: list[Any] = []
        for pos, entry in enumerate(out.prompt_logprobs or []):
            if entry is None or pos == 0:
                pl.append(None)
            else:
                pl.append({str(k): float(v.logprob) for k, v in entry.items()})
        body["prompt_logprobs"] = pl
    return body

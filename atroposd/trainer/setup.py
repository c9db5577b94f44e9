"""Building the trainer's objects from the config: model (resumed if asked), then learner.

Split in two because the weights must be attached to the inference server between them: in
shared mode ``attach`` moves the parameters into shared memory, and the optimizer is built
on the parameters after that (ARCHITECTURE.md, "Weight sync").
"""

from __future__ import annotations

import concurrent.futures
import copy
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from atroposd.config import Config, to_dict
from atroposd.devices import resolve_torch
from atroposd.paths import Paths
from atroposd.trainer.checkpoint import (
    WEIGHTS_FILE,
    CheckpointError,
    Restored,
    clean_partial,
    load_checkpoint,
    load_latest,
    lower_priority,
    model_weights,
    prepare_checkpoint,
    restore_weights,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from atroposd.trainer.fsdp import checkpoint_activations, decoder_layers
from atroposd.trainer.group import Checkpoint
from atroposd.trainer.learner import Learner, make_strategies
from atroposd.trainer.model import ModelLoadError, Policy, load_policy
from atroposd.trainer.optim import build_optimizer, build_scheduler
from atroposd.trainer.precision import Precision, resolve_precision
from atroposd.trainer.ranks import OneRank, Ranks

__all__ = ["Checkpointer", "ResumeError", "Setup", "build_learner", "load_for_training"]

log = structlog.get_logger("trainer", component="trainer")  # lazy: bound at first use

# Resume refuses a checkpoint whose identity differs in one of these (SPEC §9).
IDENTITY_KEYS = ("model", "mode", "tokenizer")


class ResumeError(RuntimeError):
    pass


@dataclass
class Setup:
    policy: Policy
    tokenizer_fingerprint: dict[str, Any]
    identity: dict[str, Any]
    checkpoints_dir: Path
    keep_checkpoints: int
    step: int = 0
    weight_version: int = 0
    skipped_steps: int = 0
    restored: Restored | None = field(default=None, repr=False)
    set_aside: list[Path] = field(default_factory=list)  # damaged checkpoints renamed at this start
    ranks: Ranks = field(default_factory=OneRank)
    aliases: set[str] = field(default_factory=set)  # tied names, dropped from gathered weights
    # several ranks: the full tensors' specs and tied aliases, taken before sharding (weight sync)
    tensor_specs: dict[str, Any] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)
    # SPEC §15: the checkpoint's health record (rollbacks, learning-rate scale), and the scale the
    # learner applies to trainer.lr (halved at each rollback; rank 0's reaches every rank)
    health: dict[str, Any] = field(default_factory=dict)
    lr_scale: float = 1.0
    # SPEC §12.1: the working copy's dtype, the master weights' and the optimizer's compensation
    precision: Precision | None = None

    @property
    def restored_from(self) -> Path | None:
        return self.restored.path if self.restored is not None else None

    def checkpointer(self, learner: Learner) -> Checkpointer:
        return Checkpointer(
            self.checkpoints_dir,
            keep=self.keep_checkpoints,
            learner=learner,
            identity=self.identity,
            aliases=self.aliases,
        )


class Checkpointer:
    """Writes ``checkpoints/step-N`` with everything a resume needs.

    ``start`` (compute thread, between two steps) takes what a checkpoint holds and writes it —
    at once (``save``), or on a background thread while training goes on (``start(background=
    True)``: its future says when the checkpoint is complete). Nothing is copied: the writer reads
    the live weights and optimizer state, which only an optimizer step changes, and the next
    optimizer step waits until the writer has read them (``fence``, called by the learner before
    every optimizer step; it waits only when a step's forward and backward were shorter than the
    writer's reading). The scheduler, the RNG and the health record are copied at ``start``. One
    write at a time: a checkpoint started while the previous one is still being written waits
    for it.

    With several ranks rank 0 calls ``start`` and tells the others (``Checkpoint``), who call
    ``write_shards`` with the same directory: every rank writes its own shards of the model and
    the optimizer through the group's checkpoint process group (:mod:`.sharded`); rank 0 writes
    the rest, hashes every file and renames the directory complete."""

    def __init__(
        self, root: Path, *, keep: int, learner: Learner, identity: dict[str, Any], aliases: set[str] | None = None
    ) -> None:
        self.root = root
        self.keep = keep
        self.learner = learner
        self.identity = identity  # config, model, mode, tokenizer: what resume checks
        self.aliases = aliases or set()
        self.health: Callable[[], dict[str, Any]] | None = None  # the run's health record (SPEC §15)
        self._writing: concurrent.futures.Future[Any] | None = None  # this process's write in flight
        self._abandoned = threading.Event()
        self._read = threading.Event()  # set: no writer is reading the live tensors
        self._read.set()
        self.fence_waited_s = 0.0  # optimizer steps' waits for a writer, in total
        # told True / False around such a wait (the loop shows the trainer checkpointing meanwhile)
        self.on_fence: Callable[[bool], None] | None = None
        learner.fence = self.fence
        # The rank's device, set on every writer thread before it reads a tensor (torch's current
        # CUDA device is per thread: a new thread's is cuda:0, whatever the rank computes on).
        self.device: torch.device = learner.policy.device
        self.set_device: Callable[[torch.device], None] = set_thread_device

    def save(self, step: int, weight_version: int, skipped_steps: int, *, consolidate: bool = False) -> Path:
        """Write the checkpoint of ``step`` now (compute thread); raises CheckpointError."""
        path: Path = self.start(step, weight_version, skipped_steps, consolidate=consolidate).result()
        return path

    def start(
        self, step: int, weight_version: int, skipped_steps: int, *, background: bool = False, consolidate: bool = False
    ) -> concurrent.futures.Future[Path]:
        """Take the checkpoint of ``step`` (compute thread) and write it, at once or (``background``)
        on a thread of its own; the future holds the complete directory or the error.
        ``consolidate`` (several ranks): also ``model.safetensors`` from the shards (the
        Hugging Face layout; the one-rank layout always has it)."""
        self.wait_previous()
        policy, ranks = self.learner.policy, self.learner.ranks
        state: dict[str, Any] = {
            "weight_version": weight_version,
            "skipped_steps": skipped_steps,
            "scheduler": copy.deepcopy(self.learner.scheduler.state_dict()),
            "rng": rng_state(),
            "ranks": ranks.world,
            **self.identity,
        }
        if self.health is not None:
            state["health"] = copy.deepcopy(self.health())
        root, keep = self.root, self.keep
        abandoned, read = self._abandoned, self._read
        if ranks.world == 1:
            # the live tensors: written before the next optimizer step changes them (fence)
            state["optimizer"] = self.learner.optimizer.state_dict()
            weights = None if policy.lora else model_weights(policy.model, copy=False)
            if policy.lora:
                background = False  # PEFT writes the live adapters: small, written at once

            def write() -> Path:
                try:
                    return save_checkpoint(
                        root,
                        step,
                        model=policy.model,
                        tokenizer=policy.tokenizer,
                        lora=policy.lora,
                        state=state,
                        keep=keep,
                        weights=weights,
                        abandoned=abandoned,
                        read_done=read.set,
                        low_priority=background,
                    )
                finally:
                    read.set()
        else:
            from atroposd.trainer.sharded import MODEL_DIR, OPTIMIZER_DIR, model_shapes, stage

            state["optimizer"] = None
            state["optimizer_dcp"] = OPTIMIZER_DIR
            state["model_dcp"] = MODEL_DIR
            tmp = prepare_checkpoint(root, step, keep)
            staged = stage(policy.model, self.learner.optimizer, self.aliases)
            shapes = state["model_shapes"] = model_shapes(staged)
            ranks.command(Checkpoint(str(tmp), background=background))
            group = ranks.checkpoint_group

            def shards(tmp: Path) -> None:
                from atroposd.trainer.sharded import check_model_shards, check_shards, write_shards

                try:
                    write_shards(staged, tmp, group)
                finally:
                    read.set()
                # Across machines every rank writes into the shared checkpoint_dir: complete only
                # when every rank's shards are there (SPEC §12.3).
                check_shards(tmp / OPTIMIZER_DIR, ranks.world)
                check_model_shards(tmp / MODEL_DIR, ranks.world, shapes)
                if consolidate:
                    from atroposd.trainer.hfshards import consolidate as merge

                    merge(tmp / MODEL_DIR, tmp / WEIGHTS_FILE, world=ranks.world, shapes=shapes)

            def write() -> Path:
                try:
                    return save_checkpoint(
                        root,
                        step,
                        model=policy.model,
                        tokenizer=policy.tokenizer,
                        lora=False,
                        state=state,
                        keep=keep,
                        shards=shards,
                        prepared=tmp,
                        abandoned=abandoned,
                        low_priority=background,
                    )
                finally:
                    read.set()

        read.clear()
        future = _run(write, background, name=f"atroposd-checkpoint-{step}", on_thread=self._on_writer_thread)
        self._writing = future
        return future

    def write_shards(self, tmp: Path, *, background: bool = True) -> None:
        """A follower rank (rank 0's ``Checkpoint``): its shards under ``tmp`` (their collectives
        meet rank 0's), on its background thread or at once."""
        from atroposd.trainer.sharded import stage, write_shards

        self.wait_previous()
        staged = stage(self.learner.policy.model, self.learner.optimizer, self.aliases)
        group = self.learner.ranks.checkpoint_group
        read = self._read

        def write() -> None:
            try:
                write_shards(staged, tmp, group)
            except Exception as exc:  # rank 0 says so too (DCP's collectives carry the failure)
                log.error(
                    "this rank's checkpoint shards were not written",
                    path=str(tmp),
                    error=f"{type(exc).__name__}: {exc}",
                )
                raise
            finally:
                read.set()

        read.clear()
        self._writing = _run(write, background, name="atroposd-checkpoint-shards", on_thread=self._on_writer_thread)

    def _on_writer_thread(self) -> None:
        """First thing on a writer thread: the rank's device (:attr:`set_device`)."""
        self.set_device(self.device)

    def fence(self) -> None:
        """Before an optimizer step: wait until the writer in flight has read the live weights
        and optimizer state (logged when it has to wait)."""
        if self._read.is_set():
            return
        t0 = time.monotonic()
        log.info("the optimizer step waits for the checkpoint being written to read the weights")
        if self.on_fence is not None:
            self.on_fence(True)
        try:
            self._read.wait()
        finally:
            if self.on_fence is not None:
                self.on_fence(False)
        self.fence_waited_s += time.monotonic() - t0

    @property
    def writing(self) -> bool:
        """A background write is in flight."""
        return self._writing is not None and not self._writing.done()

    def wait_previous(self, timeout: float | None = None) -> None:
        """Wait for the write in flight, if any (its outcome is its future's)."""
        future = self._writing
        if future is None:
            return
        if not future.done():
            log.info("a checkpoint is still being written: the next one waits for it")
        concurrent.futures.wait([future], timeout=timeout)
        if future.done():
            self._writing = None

    def abandon(self) -> None:
        """The trainer group restarts: a write still in flight is never installed as complete."""
        self._abandoned.set()


def set_thread_device(device: torch.device) -> None:
    """Make ``device`` this thread's current CUDA device (nothing for the CPU). DCP's copies
    and the stream it waits on are the current device's: on a rank not on ``cuda:0`` a thread
    that never set it would wait on device 0 while the copies run on the rank's."""
    if device.type == "cuda":  # GPU only
        torch.cuda.set_device(device)


def _run(
    fn: Callable[[], Any], background: bool, *, name: str, on_thread: Callable[[], None] | None = None
) -> concurrent.futures.Future[Any]:
    """``fn()`` now, or on a daemon thread of its own (one stuck in a collective of a broken
    group must not hold up the process's exit); its outcome in a future. ``fn`` — and what it
    holds: the live weights — is let go before the future is done (a rollback's re-attach
    releases the weights' memory once the write is done). ``on_thread``: called first on the
    thread of its own (the rank's device), its failure the future's."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    box = [fn]

    def target() -> None:
        if background:
            lower_priority()  # the writer yields the CPU to training
        work = box.pop()
        try:
            if background and on_thread is not None:
                on_thread()
            result = work()
        except BaseException as exc:  # handed to whoever waits on the future
            del work
            traceback.clear_frames(exc.__traceback__)
            future.set_exception(exc)
            return
        del work
        future.set_result(result)

    if background:
        threading.Thread(target=target, name=name, daemon=True).start()
    else:
        target()
    return future


# ``pick`` of load_for_training: the starting weights, no checkpoint (a rollback to the start)
START = "start"


def load_for_training(cfg: Config, ranks: Ranks | None = None, *, pick: Path | str | None = None) -> Setup:
    """Load the policy and, with ``resume``, the newest complete checkpoint's weights (compute
    thread); with several ranks the model is then sharded (FSDP2). ``pick`` (rank 0, a rollback):
    that checkpoint instead, or ``START`` for none."""
    from atroposd.models.resolve import fingerprint_of, resolve_model, resolve_tokenizer

    t = cfg.trainer
    ranks = ranks if ranks is not None else OneRank()
    device, inference_dtype = resolve_torch(t.device_of(ranks.rank), cfg.inference.dtype, key="trainer.device")
    precision = resolve_precision(
        device_type=device.type,
        dtype=t.dtype,
        compute_dtype=t.compute_dtype,
        inference_dtype=str(inference_dtype).removeprefix("torch."),
        weight_sync=cfg.weight_sync,
    )
    dtype = getattr(torch, precision.compute)
    if dtype != inference_dtype and cfg.weight_sync in ("shared", "push", "broadcast"):
        raise ModelLoadError(
            f"trainer.compute_dtype = {t.compute_dtype!r} ({precision.compute}) differs from the "
            f"inference dtype ({inference_dtype}); replicas receive the trainer's working copy with "
            f'weight_sync = {cfg.weight_sync!r}: use the inference dtype or "reload"'
        )
    if device.type == "cpu":
        torch.set_num_threads(1)  # small batches gain nothing from more threads; cores are shared
    root = Paths.of(cfg).checkpoints_dir
    _check_writable(root)
    if ranks.rank == 0:
        for partial in clean_partial(root):
            log.warning("removed an incomplete checkpoint", path=str(partial))
    model_dir, tokenizer_dir = resolve_model(cfg), resolve_tokenizer(cfg)
    lora = {"r": t.lora_r, "alpha": t.lora_alpha, "targets": t.lora_targets} if t.mode == "lora" else None
    policy = load_policy(
        model_dir,
        tokenizer_dir,
        device=device,
        dtype=dtype,
        lora=lora,
        need_reference=t.kl_coef > 0 and t.kl_reference == "initial",
        seed=t.seed,
        precision={"inference_dtype": str(inference_dtype).removeprefix("torch."), **precision.describe()},
    )
    fingerprint = fingerprint_of(policy.tokenizer)
    identity = {
        "config": to_dict(cfg),
        "model": cfg.inference.model,
        "model_dir": str(model_dir),
        "mode": t.mode,
        "tokenizer": fingerprint,
    }
    setup = Setup(
        policy=policy,
        tokenizer_fingerprint=fingerprint,
        identity=identity,
        checkpoints_dir=root,
        keep_checkpoints=t.keep_checkpoints,
        ranks=ranks,
        precision=precision,
    )
    restored = (
        _latest(root, ranks, setup, pick if pick is not None else (None if t.resume else START))
        if t.resume or pick is not None or ranks.world > 1
        else None
    )
    if restored is not None:
        _check_identity(restored, identity)
        restore_weights(policy.model, restored, lora=policy.lora)
        setup.restored = restored
        setup.step = int(restored.state["step"])
        setup.weight_version = int(restored.state["weight_version"])
        setup.skipped_steps = int(restored.state.get("skipped_steps", 0))
        health = restored.state.get("health")
        setup.health = dict(health) if isinstance(health, dict) else {}
        setup.lr_scale = float(setup.health.get("lr_scale", 1.0))
        saved_ranks = int(restored.state.get("ranks", 1))
        log.info(
            "resumed from checkpoint",
            path=str(restored.path),
            step=setup.step,
            weight_version=setup.weight_version,
            saved_ranks=saved_ranks,
            ranks=ranks.world,
            **({"resharded": f"{saved_ranks} → {ranks.world} ranks"} if saved_ranks != ranks.world else {}),
        )
    _distribute(policy, ranks, t.activation_checkpointing, setup)
    return setup


def _latest(root: Path, ranks: Ranks, setup: Setup, pick: Path | str | None = None) -> Restored | None:
    """The checkpoint to resume from: rank 0 verifies and picks it (setting damaged ones aside);
    the other ranks read the one it picked."""
    if ranks.rank == 0 and pick is not None:
        chosen = None if pick == START else load_checkpoint(Path(pick))
        ranks.broadcast(str(chosen.path) if chosen is not None else None)
        return chosen
    if ranks.rank == 0:
        latest = load_latest(root)
        setup.set_aside = latest.set_aside
        ranks.broadcast(str(latest.restored.path) if latest.restored is not None else None)
        return latest.restored
    picked = ranks.broadcast(None)
    return load_checkpoint(Path(picked)) if picked is not None else None


def _distribute(policy: Policy, ranks: Ranks, activation_checkpointing: bool, setup: Setup) -> None:
    """Activation checkpointing per decoder layer; with several ranks, FSDP2 sharding of the policy
    (and of the frozen reference) — after the full weights were loaded."""
    if activation_checkpointing:
        layers = decoder_layers(policy.model)
        if not layers:
            log.warning("activation_checkpointing: no decoder layers found; off")
        checkpoint_activations(layers)
    if ranks.world == 1:
        return
    from atroposd.trainer.sharded import tied_aliases
    from atroposd.weights.tensors import model_tensors

    setup.aliases = tied_aliases(policy.model)
    mt = model_tensors(policy.model)
    setup.tensor_specs, setup.tied = mt.specs(), dict(mt.tied)
    mixed = policy.device.type == "cuda"
    ranks.shard(policy.model, mixed_precision=mixed)
    if policy.reference is not None:
        ranks.shard(policy.reference, mixed_precision=mixed)


def build_learner(cfg: Config, setup: Setup) -> Learner:
    """Optimizer (on the attached parameters), scheduler, strategies; restores their state."""
    t = cfg.trainer
    optimizer = build_optimizer(setup.policy.trainable(), t, precision=setup.precision)
    # the schedule counts optimizer steps (SPEC §14: steps × ppo_epochs × mini_batches in all)
    scheduler = build_scheduler(optimizer, t.warmup_steps, t.lr_schedule, t.steps * t.optimizer_steps_per_batch)
    if setup.restored is not None:
        from atroposd.trainer.sharded import load_optimizer

        state = setup.restored.state
        load_optimizer(setup.policy.model, optimizer, state, setup.restored.path, world=setup.ranks.world)
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
    # The learning rate's scale (SPEC §15: halved at each rollback), rank 0's on every rank
    scale = float(setup.ranks.broadcast(setup.lr_scale)) if setup.ranks.world > 1 else setup.lr_scale
    setup.lr_scale = scale
    scale_lr(optimizer, scheduler, t.lr * scale)
    if scale != 1.0:
        log.info("learning rate scaled after rollbacks", rank=setup.ranks.rank, scale=scale, lr=t.lr * scale)
    objective, reference = make_strategies(t)
    if setup.ranks.rank == 0:
        eps, high = t.clip_range()
        log.info(
            "trainer objective",
            loss=t.loss,
            clip_range=None if t.loss == "awsft" else f"[{1 - eps:g}, {1 + (high if high > 0 else eps):g}]",
            clip_eps=eps,
            clip_eps_high=high,
            rollout_correction=t.rollout_correction,
            ppo_epochs=t.ppo_epochs,
            mini_batches=t.mini_batches,
            lr_schedule_steps=t.steps * t.optimizer_steps_per_batch,
        )
    learner = Learner(
        setup.policy,
        optimizer,
        scheduler,
        objective=objective,
        reference=reference,
        max_grad_norm=t.max_grad_norm,
        distill_coef=t.distill_coef,
        distill_temperature=t.distill_temperature,
        ranks=setup.ranks,
        logprob_chunk=t.logprob_chunk,
        ppo_epochs=t.ppo_epochs,
        mini_batches=t.mini_batches,
        seed=t.seed,
        micro_batch_size=t.micro_batch_size,
        micro_batch_tokens=t.micro_batch_tokens,
    )
    setup.ranks.settle()  # every rank is set up: collectives are bounded by collective_timeout from here
    return learner


def scale_lr(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, base_lr: float) -> None:
    """Set the schedule's base learning rate to ``base_lr`` at its current position (a restored
    scheduler carries the base it was saved with)."""
    scheduler.base_lrs = [base_lr for _ in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["initial_lr"] = base_lr
        group["lr"] = base_lr * scheduler.lr_lambdas[0](scheduler.last_epoch)


def _check_writable(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create the checkpoint directory {root}: {exc.strerror or exc}") from exc
    if not os.access(root, os.W_OK | os.X_OK):
        raise CheckpointError(f"the checkpoint directory {root} is not writable")


def _check_identity(restored: Restored, identity: dict[str, Any]) -> None:
    state = restored.state
    changed = [k for k in IDENTITY_KEYS if state.get(k) != identity[k]]
    if changed:
        detail = "; ".join(f"{k}: checkpoint {state.get(k)!r} vs now {identity[k]!r}" for k in changed)
        raise ResumeError(
            f"cannot resume from {restored.path}: changed {detail}. Move the checkpoints away or set "
            "trainer.resume = false"
        )
    old, new = state.get("config", {}), identity["config"]
    for section in ("trainer", "inference"):
        diffs = sorted(
            k
            for k in set(old.get(section, {})) | set(new.get(section, {}))
            if old.get(section, {}).get(k) != new.get(section, {}).get(k)
        )
        if diffs:
            log.warning("resuming with a changed configuration", section=section, keys=diffs)

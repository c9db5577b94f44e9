"""Periodic checkpoints are written in the background (SPEC §12.1): the training loop, with a real
learner on the tiny model, goes on stepping while one is written; what the checkpoint holds is
the state of its own step (copied between two steps), not of the steps that ran meanwhile; the
next checkpoint waits for it; the last step's is written at once."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from atroposd.trainer import checkpoint as ckpt
from atroposd.trainer.loop import Progress, TrainingLoop
from atroposd.trainer.metrics import MetricsWriter
from atroposd.trainer.setup import build_learner, load_for_training
from tests.trainer.conftest import make_cfg
from tests.trainer.test_loop import ListFeed, RecordingSync

pytestmark = pytest.mark.anyio


class WatchingFeed(ListFeed):
    """Records, at each fetch, the step and the checkpoint in flight; at fetch ``release_at``
    lets the blocked write go on. At the fetch after step 3 it copies the weights and the
    optimizer state (what step 3's checkpoint must hold)."""

    def __init__(self, loop_box: list[TrainingLoop], release: threading.Event, release_at: int) -> None:
        super().__init__([])
        self.loop_box = loop_box
        self.gate = release
        self.release_at = release_at
        self.seen: list[tuple[int, int | None]] = []
        self.at_three: dict[str, Any] = {}

    async def next(self, *, data_timeout: float, envs_alive: Any) -> list[Any] | None:
        loop = self.loop_box[0]
        p = loop.progress
        self.seen.append((p.step, p.checkpoint_writing))
        if p.step == 3:
            model, opt = loop.learner.policy.model, loop.learner.optimizer
            self.at_three = {
                "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "exp_avg": [s["exp_avg"].clone() for s in opt.state.values()],
            }
        if self.fetched + 1 == self.release_at:
            self.gate.set()
        return await super().next(data_timeout=data_timeout, envs_alive=envs_alive)


async def test_steps_go_on_while_a_periodic_checkpoint_is_written(
    tiny_dir: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    real = ckpt._write_checksums

    def slow_checksums(path: Path, **kw: Any) -> None:  # the background write of step 3 holds here
        if path.name.startswith(f"{ckpt.TMP_PREFIX}3-"):
            assert threading.current_thread().name.startswith("atroposd-checkpoint"), "not in the background"
            assert release.wait(60), "never released"
        real(path, **kw)

    monkeypatch.setattr(ckpt, "_write_checksums", slow_checksums)
    cfg = make_cfg(state_dir, tiny_dir, steps=7, checkpoint_every=3, keep_checkpoints=5, lr=3e-3)
    setup = load_for_training(cfg)
    learner = build_learner(cfg, setup)
    box: list[TrainingLoop] = []
    feed = WatchingFeed(box, release, release_at=6)  # released before step 6's batch
    loop = TrainingLoop(
        tcfg=cfg.trainer,
        feed=feed,
        learner=learner,
        weights=RecordingSync(),  # type: ignore[arg-type]
        metrics=MetricsWriter(state_dir / "metrics.jsonl"),
        checkpointer=setup.checkpointer(learner),
        progress=Progress(total_steps=7),
        envs_alive=lambda: True,
        lock=anyio.Lock(),
    )
    box.append(loop)
    try:
        assert await loop.run() == "finished"
    finally:
        loop.metrics.close()
    # steps 4 and 5 were taken while step 3's checkpoint was being written
    assert (4, 3) in feed.seen and (5, 3) in feed.seen, feed.seen
    root = state_dir / "checkpoints"
    assert [s for s, _ in ckpt.complete_checkpoints(root)] == [3, 6, 7]
    p = loop.progress
    assert p.last_checkpoint == str(root / "step-7") and p.checkpoint_failures == 0 and p.checkpoint_writing is None
    # step 3's checkpoint holds step 3's state, not that of the steps trained while it was written
    restored = ckpt.load_checkpoint(root / "step-3")
    assert restored.state["step"] == 3 and restored.state["weight_version"] == 3
    for name, t in restored.weights.items():
        assert torch.equal(t, feed.at_three["weights"][name]), name
    saved = [s["exp_avg"] for s in restored.state["optimizer"]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(saved, feed.at_three["exp_avg"], strict=True))
    assert not torch.equal(
        restored.weights["model.norm.weight"], learner.policy.model.state_dict()["model.norm.weight"]
    )


async def test_the_next_optimizer_step_waits_until_the_writer_has_read_the_weights(
    tiny_dir: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer reads the live weights and optimizer state (no copy): held while it reads them,
    step 4's optimizer step waits for it (the trainer shows checkpointing meanwhile) and the
    checkpoint holds step 3's optimizer state, not step 4's."""
    gate = threading.Event()
    real_save = ckpt.torch.save

    def slow_save(obj: Any, path: Any, *a: Any, **kw: Any) -> None:  # the writer reads the optimizer here
        if Path(path).name == ckpt.STATE_FILE and Path(path).parent.name.startswith(f"{ckpt.TMP_PREFIX}3-"):
            assert gate.wait(60), "the optimizer step never waited"
        real_save(obj, path, *a, **kw)

    monkeypatch.setattr(ckpt.torch, "save", slow_save)
    cfg = make_cfg(state_dir, tiny_dir, steps=5, checkpoint_every=3, keep_checkpoints=5, lr=3e-3)
    setup = load_for_training(cfg)
    learner = build_learner(cfg, setup)
    box: list[TrainingLoop] = []
    feed = WatchingFeed(box, threading.Event(), release_at=0)
    checkpointer = setup.checkpointer(learner)
    loop = TrainingLoop(
        tcfg=cfg.trainer,
        feed=feed,
        learner=learner,
        weights=RecordingSync(),  # type: ignore[arg-type]
        metrics=MetricsWriter(state_dir / "metrics.jsonl"),
        checkpointer=checkpointer,
        progress=Progress(total_steps=5),
        envs_alive=lambda: True,
        lock=anyio.Lock(),
    )
    box.append(loop)
    shown = loop._fencing
    waits: list[tuple[int, bool, str]] = []

    def spy(waiting: bool) -> None:
        shown(waiting)
        waits.append((loop.progress.step, waiting, loop.progress.state))
        if waiting:
            gate.set()  # the optimizer step of step 4 waits: let the writer go on

    checkpointer.on_fence = spy
    try:
        assert await loop.run() == "finished"
    finally:
        loop.metrics.close()
    assert waits[:2] == [(3, True, "checkpointing"), (3, False, "training")], waits
    assert checkpointer.fence_waited_s > 0
    restored = ckpt.load_checkpoint(state_dir / "checkpoints" / "step-3")
    saved = [s["exp_avg"] for s in restored.state["optimizer"]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(saved, feed.at_three["exp_avg"], strict=True))
    for name, t in restored.weights.items():
        assert torch.equal(t, feed.at_three["weights"][name]), name


async def test_a_background_writer_sets_the_ranks_device_on_its_thread_before_it_reads(
    tiny_dir: Path, state_dir: Path
) -> None:
    """torch's current CUDA device is per thread (a new thread's is cuda:0): each writer thread
    sets the rank's device first, before it reads a tensor or writes a file."""
    from atroposd.trainer.setup import set_thread_device

    cfg = make_cfg(state_dir, tiny_dir, steps=1, keep_checkpoints=2)
    setup = load_for_training(cfg)
    learner = build_learner(cfg, setup)
    checkpointer = setup.checkpointer(learner)
    assert checkpointer.set_device is set_thread_device and checkpointer.device == learner.policy.device
    calls: list[tuple[torch.device, str, list[str]]] = []

    def hook(device: torch.device) -> None:
        written = sorted(p.name for p in setup.checkpoints_dir.iterdir()) if setup.checkpoints_dir.exists() else []
        calls.append((device, threading.current_thread().name, written))

    checkpointer.set_device = hook
    path = checkpointer.start(1, 1, 0, background=True).result(timeout=120)
    assert path.name == "step-1"
    assert calls == [(learner.policy.device, "atroposd-checkpoint-1", [])], calls
    checkpointer.save(2, 2, 0)  # at once, on the compute thread (whose device is set already)
    assert len(calls) == 1
    set_thread_device(torch.device("cpu"))  # nothing to set for the CPU


@pytest.mark.gpu
def test_set_thread_device_makes_the_ranks_gpu_current_on_a_new_thread() -> None:
    from atroposd.trainer.setup import set_thread_device

    last = torch.device("cuda", torch.cuda.device_count() - 1)
    seen: list[int] = []

    def writer() -> None:
        set_thread_device(last)
        seen.append(torch.cuda.current_device())

    t = threading.Thread(target=writer)
    t.start()
    t.join()
    assert seen == [last.index]

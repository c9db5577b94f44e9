"""Checkpoints: bit-exact resume after a kill, an interrupted write is ignored, pruning,
identity checks, unwritable directories."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch

from atroposd.trainer.checkpoint import (
    CheckpointError,
    complete_checkpoints,
    latest_checkpoint,
    save_checkpoint,
)
from atroposd.trainer.setup import ResumeError, build_learner, load_for_training
from tests.support import REPO, wait_for
from tests.trainer.child_trainer import batch_for, weights_hash
from tests.trainer.conftest import make_cfg
from tests.unprivileged import shared_dir, unprivileged

CHILD = Path(__file__).with_name("child_trainer.py")


def _child(state_dir: Path, model_dir: Path, steps: int, mode: str, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with open(log, "wb") as err:
        return subprocess.Popen(
            [sys.executable, str(CHILD), str(state_dir), str(model_dir), str(steps), mode],
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
            start_new_session=True,
        )


def _kill(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert proc.stdout is not None
    proc.stdout.close()


def test_resume_after_kill_gives_a_bit_identical_next_step(tiny_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    proc = _child(state_dir, tiny_dir, 3, "uninterrupted", tmp_path / "child.log")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, (tmp_path / "child.log").read_text()[-2000:]
        uninterrupted = orjson.loads(line)
    finally:
        _kill(proc)
    assert [s for s, _ in complete_checkpoints(state_dir / "checkpoints")] == [3]
    cfg = make_cfg(state_dir, tiny_dir, lr=3e-3, kl_coef=0.04, kl_reference="initial")
    setup = load_for_training(cfg)
    assert (setup.step, setup.weight_version) == (3, 3)
    learner = build_learner(cfg, setup)
    result = learner.compute(batch_for(4, cfg))  # type: ignore[arg-type]
    learner.apply()
    assert result.loss == uninterrupted["loss"]  # bit-exact, not approximately
    assert weights_hash(learner.policy.model) == uninterrupted["hash"]


def test_a_checkpoint_killed_mid_write_is_ignored_at_resume(tiny_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    proc = _child(state_dir, tiny_dir, 2, "kill-mid-write", tmp_path / "child.log")
    try:
        wait_for(
            lambda: (state_dir / "mid-write").exists() or proc.poll() is not None,
            timeout=120,
            what="the child to be in the middle of writing step 3",
        )
        assert proc.poll() is None, (tmp_path / "child.log").read_text()[-2000:]
    finally:
        _kill(proc)
    root = state_dir / "checkpoints"
    partial = [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert partial and (partial[0] / "trainer_state.pt").exists()  # the write got far
    assert latest_checkpoint(root) == root / "step-2"
    cfg = make_cfg(state_dir, tiny_dir, lr=3e-3, kl_coef=0.04, kl_reference="initial")
    setup = load_for_training(cfg)
    assert setup.step == 2 and setup.restored_from == root / "step-2"
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]  # cleaned at start


def test_keep_checkpoints_prunes_the_oldest(tiny_dir: Path, state_dir: Path) -> None:
    cfg = make_cfg(state_dir, tiny_dir, keep_checkpoints=2)
    setup = load_for_training(cfg)
    learner = build_learner(cfg, setup)
    checkpointer = setup.checkpointer(learner)
    for step in (1, 2, 3):
        checkpointer.save(step, step, 0)
    assert [s for s, _ in complete_checkpoints(state_dir / "checkpoints")] == [2, 3]


def test_resume_refuses_a_changed_mode(tiny_dir: Path, state_dir: Path) -> None:
    cfg = make_cfg(state_dir, tiny_dir)
    setup = load_for_training(cfg)
    setup.checkpointer(build_learner(cfg, setup)).save(1, 1, 0)
    lora = make_cfg(state_dir, tiny_dir, mode="lora", lora_r=4)
    with pytest.raises(ResumeError, match="mode"):
        load_for_training(lora)
    fresh = make_cfg(state_dir, tiny_dir, mode="lora", lora_r=4, resume=False)
    assert load_for_training(fresh).step == 0


def test_lora_checkpoint_round_trip(tiny_dir: Path, state_dir: Path) -> None:
    cfg = make_cfg(state_dir, tiny_dir, mode="lora", lora_r=4, lr=1e-2)
    setup = load_for_training(cfg)
    learner = build_learner(cfg, setup)
    learner.compute(batch_for(1, cfg))  # type: ignore[arg-type]
    learner.apply()
    path = setup.checkpointer(learner).save(1, 1, 0)
    assert (path / "adapter_model.safetensors").is_file() and (path / "adapter_config.json").is_file()
    adapters = {k: v.clone() for k, v in learner.policy.model.state_dict().items() if "lora_" in k}
    again = load_for_training(cfg)
    restored = {k: v for k, v in again.policy.model.state_dict().items() if "lora_" in k}
    assert adapters.keys() == restored.keys()
    assert all(torch.equal(adapters[k], restored[k]) for k in adapters)


def test_unwritable_checkpoint_directory_is_a_clear_error() -> None:
    """As an unprivileged user (as root: with nobody's effective uid, root ignores permissions)."""
    with shared_dir() as d, unprivileged():
        root = d / "checkpoints"
        root.mkdir(mode=0o500)
        with pytest.raises(CheckpointError, match=r"not writable|cannot write"):
            save_checkpoint(root, 1, model=torch.nn.Linear(2, 2), tokenizer=None, lora=False, state={}, keep=2)
        assert list(root.iterdir()) == []


def test_a_failed_write_removes_its_temporary_directory(state_dir: Path) -> None:
    root = state_dir / "checkpoints"

    class Unsaveable(torch.nn.Linear):
        def state_dict(self, *a: object, **kw: object) -> dict[str, torch.Tensor]:  # type: ignore[override]
            raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointError, match="no space left"):
        save_checkpoint(root, 5, model=Unsaveable(2, 2), tokenizer=None, lora=False, state={}, keep=2)
    assert list(root.iterdir()) == []

"""Checkpoints under damage (SPEC §13): checksums verified at resume with a fallback to the next
older checkpoint, any write failure (a real full disk included) a counted failure that training
survives, and never a moment without a complete checkpoint."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from atroposd.trainer import checkpoint as ckpt
from atroposd.trainer.checkpoint import (
    CHECKSUM_FILE,
    STATE_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    clean_partial,
    complete_checkpoints,
    load_latest,
    save_checkpoint,
)
from atroposd.trainer.ranks import OneRank

pytestmark = pytest.mark.anyio


def _model(seed: int, size: int = 4) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(size, size)


def _save(root: Path, step: int, *, keep: int = 3, size: int = 4, state: dict[str, Any] | None = None) -> Path:
    return save_checkpoint(
        root,
        step,
        model=_model(step, size),
        tokenizer=None,
        lora=False,
        state=state or {"weight_version": step},
        keep=keep,
    )


def _steps(root: Path) -> list[int]:
    return [s for s, _ in complete_checkpoints(root)]


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A small real file system at ``path`` (a full disk on demand); skips where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


# ---------------------------------------------------------------------------- checksums and resume


def test_checksums_are_written_last_and_cover_every_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    real = ckpt._write_checksums

    def spy(path: Path, **kw: Any) -> None:
        order.append("checksums")
        assert {p.name for p in path.iterdir()} == {WEIGHTS_FILE, STATE_FILE}
        real(path, **kw)

    monkeypatch.setattr(ckpt, "_write_checksums", spy)
    path = _save(tmp_path, 1)
    assert order == ["checksums"]
    table = __import__("json").loads((path / CHECKSUM_FILE).read_text())["files"]
    assert set(table) == {WEIGHTS_FILE, STATE_FILE}
    assert ckpt.verify_checksums(path)


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "remove the weights", "garbage state"])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_older_one_used(tmp_path: Path, damage: str) -> None:
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    weights = newest / WEIGHTS_FILE
    if damage == "flip a byte":
        data = bytearray(weights.read_bytes())
        data[-3] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:20])
    elif damage == "remove the weights":
        weights.unlink()
    else:
        (newest / STATE_FILE).write_bytes(b"not a torch file")
    latest = load_latest(tmp_path)
    assert latest.restored is not None and latest.restored.path == tmp_path / "step-1"
    assert latest.restored.state["weight_version"] == 1
    assert len(latest.set_aside) == 1 and latest.set_aside[0].name.startswith("step-2.bad-")
    assert latest.set_aside[0].is_dir()  # kept for a look, never used again
    assert _steps(tmp_path) == [1]
    assert load_latest(tmp_path).set_aside == []


def test_every_checkpoint_damaged_means_a_fresh_start(tmp_path: Path) -> None:
    for step in (1, 2):
        path = _save(tmp_path, step)
        (path / WEIGHTS_FILE).write_bytes(b"x")
    latest = load_latest(tmp_path)
    assert latest.restored is None and len(latest.set_aside) == 2


def test_a_checkpoint_without_checksums_still_loads(tmp_path: Path) -> None:
    path = _save(tmp_path, 3)
    (path / CHECKSUM_FILE).unlink()  # as written before checksums existed
    latest = load_latest(tmp_path)
    assert latest.restored is not None and latest.restored.path == path and not latest.set_aside


def test_resume_falls_back_to_the_older_checkpoint(tiny_dir: Path, state_dir: Path) -> None:
    from atroposd.trainer.setup import build_learner, load_for_training
    from tests.trainer.conftest import make_cfg

    cfg = make_cfg(state_dir, tiny_dir, keep_checkpoints=3)
    setup = load_for_training(cfg)
    checkpointer = setup.checkpointer(build_learner(cfg, setup))
    checkpointer.save(1, 1, 0)
    newest = checkpointer.save(2, 2, 0)
    data = bytearray((newest / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x01
    (newest / "model.safetensors").write_bytes(bytes(data))
    again = load_for_training(cfg)
    assert (again.step, again.weight_version) == (1, 1)
    assert again.restored_from == state_dir / "checkpoints" / "step-1"
    assert [p.name.split(".bad-")[0] for p in again.set_aside] == ["step-2"]


# ---------------------------------------------------------------------------- write failures


@pytest.mark.parametrize("where", ["safetensors", "torch.save"])
def test_a_write_failure_of_any_kind_is_a_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """safetensors and torch.save report a full disk as SafetensorError / RuntimeError, not OSError."""
    _save(tmp_path, 1)
    if where == "safetensors":
        from safetensors import SafetensorError

        def fail(*_a: object, **_kw: object) -> None:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr("safetensors.torch.save_file", fail)
    else:

        def fail(*_a: object, **_kw: object) -> None:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

        monkeypatch.setattr(ckpt.torch, "save", fail)
    with pytest.raises(CheckpointError, match="cannot write checkpoint"):
        _save(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]  # no temporary directory left


def test_a_real_full_disk(tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "ckpt", "256k") as root:
        _save(root, 1)  # small: fits
        for big in ({"size": 400}, {"state": {"blob": torch.zeros(100_000)}}):  # safetensors, then torch.save
            with pytest.raises(CheckpointError, match=r"cannot write checkpoint .* bytes free on the device"):
                _save(root, 2, **big)
            assert sorted(p.name for p in root.iterdir()) == ["step-1"]
        assert load_latest(root).restored is not None


class _FailingCheckpointer:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
        self.on_fence: Any = None

    def save(self, step: int, weight_version: int, skipped_steps: int, *, consolidate: bool = False) -> Path:
        raise self.exc

    def start(
        self, step: int, weight_version: int, skipped_steps: int, *, background: bool = False, consolidate: bool = False
    ) -> Any:
        import concurrent.futures

        future: concurrent.futures.Future[Path] = concurrent.futures.Future()
        future.set_exception(self.exc)  # written in the background, and failed there
        return future


@pytest.mark.parametrize("exc", [RuntimeError("unexpected pos 576 vs 534"), CheckpointError("disk full")])
async def test_the_loop_counts_a_failed_checkpoint_and_goes_on(exc: BaseException) -> None:
    from atroposd.config import TrainerConfig
    from atroposd.trainer.loop import Progress, TrainingLoop

    progress = Progress(total_steps=10, step=4)
    learner = SimpleNamespace(policy=SimpleNamespace(vocab_size=22), ranks=OneRank())
    loop = TrainingLoop(
        tcfg=TrainerConfig(),
        feed=None,
        learner=learner,
        weights=None,
        metrics=None,  # type: ignore[arg-type]
        checkpointer=_FailingCheckpointer(exc),
        progress=progress,  # type: ignore[arg-type]
        envs_alive=lambda: True,
        lock=None,
    )  # type: ignore[arg-type]
    assert await loop.checkpoint() is None
    assert await loop.checkpoint() is None
    assert progress.checkpoint_failures == 2 and progress.checkpoint_error is not None
    assert str(exc) in progress.checkpoint_error and progress.state == "waiting"
    # a periodic one, written in the background: its failure is counted once it is known
    assert await loop.checkpoint(background=True) is None and progress.checkpoint_writing == 4
    assert loop._collect_checkpoint() is None
    assert progress.checkpoint_failures == 3 and progress.checkpoint_writing is None


@pytest.mark.slow
async def test_training_goes_on_when_the_disk_is_full(tiny_dir: Path, state_dir: Path, tmp_path: Path) -> None:
    """A whole trainer against the real run-api, its checkpoint directory a full tmpfs."""
    from atroposd.models.resolve import tokenizer_fingerprint
    from atroposd.trainer.service import TrainerOutcome
    from tests.support import free_port
    from tests.trainer.helpers import info_server, run_api
    from tests.trainer.test_service import _cfg, _train

    with _tmpfs(state_dir / "checkpoints", "128k"), run_api(tmp_path / "api.log") as (api_url, _proc):
        inf_port = free_port()
        async with info_server(tokenizer_fingerprint(tiny_dir), inf_port):
            cfg = _cfg(state_dir, tiny_dir, api_url, inf_port, steps=3, checkpoint_every=1)
            outcome, service = await _train(cfg, api_url)
        assert outcome == TrainerOutcome("finished", 3, 3), outcome
        status = service.status()
        assert status["checkpoint_failures"] == 3 and "no space left" in status["checkpoint_error"]
        assert os.listdir(state_dir / "checkpoints") == []


# ---------------------------------------------------------------------------- never without a checkpoint


def _always_complete(root: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """After every removal the checkpoint code makes, a complete checkpoint must exist."""
    removed: list[str] = []
    real = ckpt.shutil.rmtree

    def rmtree(path: Any, *a: Any, **kw: Any) -> None:
        real(path, *a, **kw)
        removed.append(Path(path).name)
        assert complete_checkpoints(root), f"no complete checkpoint after removing {path}"

    monkeypatch.setattr(ckpt.shutil, "rmtree", rmtree)
    return removed


def test_keep_one_deletes_the_old_checkpoint_only_after_the_new_one_is_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(tmp_path, 1, keep=1)
    removed = _always_complete(tmp_path, monkeypatch)
    real_save = ckpt.torch.save

    def failing_save(*_a: object, **_kw: object) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", failing_save)
    with pytest.raises(CheckpointError):
        _save(tmp_path, 2, keep=1)
    assert _steps(tmp_path) == [1]  # the failed write of step 2 cost nothing
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    _save(tmp_path, 2, keep=1)
    assert _steps(tmp_path) == [2] and "step-1" in removed


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_saving_a_step_again_replaces_it_without_a_gap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    _save(tmp_path, 5, keep=1)
    first = (tmp_path / "step-5" / WEIGHTS_FILE).read_bytes()
    if exchange:
        _always_complete(tmp_path, monkeypatch)
    else:
        monkeypatch.setattr(ckpt, "_exchange", lambda a, b: False)
    save_checkpoint(tmp_path, 5, model=_model(99), tokenizer=None, lora=False, state={}, keep=1)
    assert _steps(tmp_path) == [5] and sorted(os.listdir(tmp_path)) == ["step-5"]
    assert (tmp_path / "step-5" / WEIGHTS_FILE).read_bytes() != first
    assert ckpt.verify_checksums(tmp_path / "step-5")


def test_an_interrupted_replacement_puts_the_previous_copy_back(tmp_path: Path) -> None:
    """The rename-aside path killed between its two renames: the old copy returns at the next start."""
    _save(tmp_path, 5)
    os.rename(tmp_path / "step-5", tmp_path / f"{ckpt.OLD_PREFIX}5-4242")
    (tmp_path / f"{ckpt.TMP_PREFIX}5-4242").mkdir()
    clean_partial(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["step-5"] and ckpt.verify_checksums(tmp_path / "step-5")
    _save(tmp_path, 6)
    (tmp_path / f"{ckpt.OLD_PREFIX}6-4242").mkdir()  # the new copy did arrive: the old one goes
    assert clean_partial(tmp_path) == [tmp_path / f"{ckpt.OLD_PREFIX}6-4242"]
    assert _steps(tmp_path) == [5, 6]


def test_keep_more_than_one_prunes_first_to_make_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for step in (1, 2, 3):
        _save(tmp_path, step, keep=3)
    seen: list[list[int]] = []
    real_save = ckpt.torch.save

    def spy(obj: Any, path: Any, *a: Any, **kw: Any) -> None:
        seen.append(_steps(tmp_path))
        real_save(obj, path, *a, **kw)

    monkeypatch.setattr(ckpt.torch, "save", spy)
    _save(tmp_path, 4, keep=3)
    assert seen == [[2, 3]] and _steps(tmp_path) == [2, 3, 4]


def test_a_failed_rename_aside_puts_the_previous_copy_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path, 5, keep=1)
    monkeypatch.setattr(ckpt, "_exchange", lambda a, b: False)
    real_rename = os.rename

    def rename(src: Any, dst: Any) -> None:
        if Path(src).name.startswith(ckpt.TMP_PREFIX):
            raise OSError(5, "Input/output error")
        real_rename(src, dst)

    monkeypatch.setattr(ckpt.os, "rename", rename)
    with pytest.raises(CheckpointError, match="Input/output error"):
        _save(tmp_path, 5, keep=1)
    assert sorted(os.listdir(tmp_path)) == ["step-5"] and ckpt.verify_checksums(tmp_path / "step-5")


def test_a_checkpoint_missing_another_nodes_shard_names_the_missing_file(tmp_path: Path) -> None:
    """Several machines: a checkpoint_dir that is not shared leaves rank 1's optimizer shard on
    its own node's disk: the checkpoint is not complete, and the error names what is missing."""
    from atroposd.trainer.checkpoint import CheckpointError
    from atroposd.trainer.sharded import check_shards

    opt = tmp_path / "optimizer"
    opt.mkdir()
    (opt / ".metadata").write_bytes(b"m")
    (opt / "__0_0.distcp").write_bytes(b"0")
    with pytest.raises(CheckpointError) as err:
        check_shards(opt, 2)
    assert str(opt / "__1_0.distcp") in str(err.value) and "every node sees" in str(err.value)
    (opt / "__1_0.distcp").write_bytes(b"1")
    check_shards(opt, 2)  # complete: no error


# ---------------------------------------------------------------------------- sharded: nothing unverified


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _save_sharded(root: Path, step: int) -> tuple[Path, torch.optim.Optimizer]:
    """A checkpoint in the layout of several ranks (``optimizer/`` by DCP), written here by one
    process (DCP without a process group) through the same writer the ranks use."""
    import warnings

    from atroposd.trainer.sharded import OPTIMIZER_DIR, save_optimizer

    model, opt = _trained(step)

    def shards(tmp: Path) -> dict[str, torch.Tensor]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            save_optimizer(model, opt, tmp / OPTIMIZER_DIR)
        return ckpt.model_weights(model)

    state = {"weight_version": step, "ranks": 2, "optimizer": None, "optimizer_dcp": OPTIMIZER_DIR}
    path = save_checkpoint(root, step, model=model, tokenizer=None, lora=False, state=state, keep=3, shards=shards)
    return path, opt


def _rewrite_checksums(path: Path) -> None:
    """What someone who can write the directory does after changing a file."""
    (path / CHECKSUM_FILE).unlink()
    ckpt._write_checksums(path)


def _load_optimizer(path: Path, seed: int = 99) -> torch.optim.Optimizer:
    from atroposd.trainer.sharded import load_optimizer

    model, opt = _trained(seed)
    state = ckpt.load_checkpoint(path).state
    load_optimizer(model, opt, state, path, world=1)
    return opt


def test_a_verified_sharded_checkpoint_restores_its_optimizer(tmp_path: Path) -> None:
    path, saved = _save_sharded(tmp_path, 1)
    latest = load_latest(tmp_path)
    assert latest.restored is not None and latest.restored.path == path and not latest.set_aside
    opt = _load_optimizer(path)
    assert opt.param_groups[0]["betas"] == (0.8, 0.95)
    for a, b in zip(saved.state.values(), opt.state.values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"])


def test_a_sharded_checkpoint_without_checksums_is_refused(tmp_path: Path) -> None:
    old, _ = _save_sharded(tmp_path, 1)
    newest, _ = _save_sharded(tmp_path, 2)
    (newest / CHECKSUM_FILE).unlink()
    latest = load_latest(tmp_path)
    assert latest.restored is not None and latest.restored.path == old
    assert [p.name.split(".bad-")[0] for p in latest.set_aside] == ["step-2"]


def test_a_sharded_checkpoint_with_an_unlisted_optimizer_file_is_refused(tmp_path: Path) -> None:
    path, _ = _save_sharded(tmp_path, 1)
    (path / "optimizer" / "__1_0.distcp").write_bytes(b"planted")
    with pytest.raises(CheckpointError, match=r"does not cover: optimizer/__1_0\.distcp"):
        ckpt._check_sharded(path, ckpt.verify_checksums(path))
    assert load_latest(tmp_path).restored is None


@pytest.mark.parametrize("named", ["../elsewhere", "/tmp/optimizer", "optimizer/.."])
def test_a_sharded_checkpoint_naming_a_foreign_optimizer_path_is_refused(tmp_path: Path, named: str) -> None:
    """The optimizer's directory is fixed: a trainer state naming another (checksums rewritten
    to match, as whoever wrote it would) is refused at resume and by the loader itself."""
    from atroposd.trainer.sharded import load_optimizer

    path, _ = _save_sharded(tmp_path, 1)
    state = torch.load(path / STATE_FILE, weights_only=True)
    state["optimizer_dcp"] = named
    torch.save(state, path / STATE_FILE)
    _rewrite_checksums(path)
    with pytest.raises(CheckpointError, match="names the optimizer directory"):
        ckpt.load_checkpoint(path)
    model, opt = _trained(3)
    with pytest.raises(CheckpointError, match="refused, not followed"):
        load_optimizer(model, opt, state, path, world=1)
    latest = load_latest(tmp_path)
    assert latest.restored is None and len(latest.set_aside) == 1


def test_a_sharded_model_directory_is_verified_like_the_optimizers(tmp_path: Path) -> None:
    """``model/`` (the ranks' model shards) loads only when the checksums cover every file in it,
    only as a directory of the checkpoint, and only from its fixed name."""
    path, _ = _save_sharded(tmp_path, 1)
    (path / "model").mkdir()
    (path / "model" / "__0_0.distcp").write_bytes(b"shard")
    _rewrite_checksums(path)
    ckpt._check_sharded(path, ckpt.verify_checksums(path))  # listed: accepted
    (path / "model" / "__1_0.distcp").write_bytes(b"planted")
    with pytest.raises(CheckpointError, match=r"does not cover: model/__1_0\.distcp"):
        ckpt._check_sharded(path, ckpt.verify_checksums(path))
    (path / "model" / "__1_0.distcp").unlink()
    (path / CHECKSUM_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"without checksums\.json"):
        ckpt._check_sharded(path, ckpt.verify_checksums(path))
    ckpt._write_checksums(path)
    state = torch.load(path / STATE_FILE, weights_only=True)
    state["model_dcp"] = "../elsewhere"
    torch.save(state, path / STATE_FILE)
    _rewrite_checksums(path)
    with pytest.raises(CheckpointError, match="names the model directory"):
        ckpt.load_checkpoint(path)
    elsewhere = tmp_path / "elsewhere"
    (path / "model").rename(elsewhere)
    (path / "model").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="model is not a directory of the checkpoint"):
        ckpt._check_sharded(path, True)


class _Planted:
    """Unpickling this runs ``open(marker, "w")``: what a planted pickle would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def test_optimizer_metadata_and_values_load_without_running_code(tmp_path: Path) -> None:
    """DCP's ``.metadata`` and the shards' non-tensor values are pickles: a planted one (with the
    checksums rewritten) is refused and runs nothing; metadata naming a file outside its
    directory is refused."""
    import io
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from atroposd.trainer.sharded import read_metadata

    path, _ = _save_sharded(tmp_path, 1)
    meta_file = path / "optimizer" / ".metadata"
    good = meta_file.read_bytes()
    marker = tmp_path / "ran"

    meta_file.write_bytes(pickle.dumps(_Planted(marker)))
    _rewrite_checksums(path)
    with pytest.raises(CheckpointError, match="not allowed in checkpoint metadata"):
        _load_optimizer(path)
    assert not marker.exists()
    latest = load_latest(tmp_path)  # refused at resume already: set aside
    assert latest.restored is None and len(latest.set_aside) == 1 and not marker.exists()
    path = latest.set_aside[0].rename(path)

    metadata = read_metadata(good)
    key = next(iter(metadata.storage_data))
    metadata.storage_data[key] = _StorageInfo(relative_path="../../etc/passwd", offset=0, length=10)
    with pytest.raises(CheckpointError, match="not a shard of its directory"):
        read_metadata(pickle.dumps(metadata))

    # a byte value (the optimizer's hyper-parameters) planted in the shard, at the place the
    # metadata names for it
    meta_file.write_bytes(good)
    shard = path / "optimizer" / "__0_0.distcp"
    info = next(i for k, i in metadata.storage_data.items() if "param_groups" in k.fqn and "betas" in k.fqn)
    payload = io.BytesIO()
    torch.save(_Planted(marker), payload)
    data = bytearray(shard.read_bytes())
    data[info.offset : info.offset + info.length] = payload.getvalue()
    shard.write_bytes(bytes(data))
    good_meta = read_metadata(good)
    for k, i in good_meta.storage_data.items():  # the planted value is longer: move what follows
        if i.relative_path == info.relative_path and i.offset > info.offset:
            good_meta.storage_data[k] = _StorageInfo(
                i.relative_path, i.offset + len(payload.getvalue()) - info.length, i.length, i.transform_descriptors
            )
        elif k.fqn == next(kk for kk, ii in metadata.storage_data.items() if ii is info).fqn:
            good_meta.storage_data[k] = _StorageInfo(
                i.relative_path, i.offset, len(payload.getvalue()), i.transform_descriptors
            )
    meta_file.write_bytes(pickle.dumps(good_meta))
    _rewrite_checksums(path)
    with pytest.raises(CheckpointError, match=r"Weights only load failed|Unsupported global"):
        _load_optimizer(path)
    assert not marker.exists()

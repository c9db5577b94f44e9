"""Trainer ranks (SPEC §12.1) with real processes and a real gloo group: rank 0 is
``tests/trainer/rank_zero.py`` (the store host and driver, as in the daemon), rank 1 the real
``atroposd trainer-rank``. Two ranks equal one rank on the same batches; a sharded checkpoint
(written in the background while the next step trains) resumes bit-identically with two ranks
and, resharded, on one rank and back; the last step's checkpoint and ``atroposd export`` are
Hugging Face directories that transformers loads with exactly the trained weights; checkpoints
of format 1 (written before the ranks wrote their own model shards) still resume. A client
holding only the store's address cannot make a rank run code."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import write_config

# SPEC §12.1: CPU float32, loss within 1e-5, each parameter tensor within 1e-5 relative by norm.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-5


def _config(root: Path, name: str, model_dir: Path, devices: str | list[str], **trainer: Any) -> Path:
    state = root / name
    t = {
        "device": devices,
        "batch_size": 32,
        "micro_batch_size": 8,
        "max_token_len": 64,
        "weight_sync": "reload",
        "checkpoint_dir": str(root / f"{name}-checkpoints"),
        **trainer,
    }
    return write_config(
        root / f"{name}.toml",
        {
            "daemon": {"state_dir": str(state), "runtime_dir": str(state / "run")},
            "inference": {"model": str(model_dir), "max_model_len": 512},
            "trainer": t,
        },
    )


def _run(cfg: Path, out: Path, *args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.trainer.rank_zero", str(cfg), str(out), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    logs = "".join(p.read_text(errors="replace")[-2000:] for p in out.parent.glob(f"{out.stem}.rank*.log"))
    assert proc.returncode == 0, f"rank 0 exited {proc.returncode}\n{proc.stdout[-4000:]}\nrank logs:\n{logs}"
    result: dict[str, Any] = torch.load(out, weights_only=False)
    result["log"] = proc.stdout
    return result


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).norm() / max(float(a[n].norm()), 1e-12)) for n in a)


@pytest.fixture(scope="module")
def runs(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One rank and two ranks, three steps each on the same batches, a checkpoint after step 2."""
    root = tmp_path_factory.mktemp("ranks")
    one = _config(root, "one", tiny_dir, "cpu")
    two = _config(root, "two", tiny_dir, ["cpu", "cpu"])
    return {
        "root": root,
        "model": tiny_dir,
        "one_cfg": one,
        "two_cfg": two,
        "one": _run(one, root / "one.pt", "--steps", "3", "--checkpoint-at", "2"),
        "marker": root / "pwned",
        "two": _run(
            two,
            root / "two.pt",
            "--steps",
            "3",
            "--checkpoint-at",
            "2",
            "--background",
            "--final",
            "--attack",
            str(root / "pwned"),
        ),
    }


def test_two_ranks_equal_one_rank(runs: dict[str, Any]) -> None:
    one, two = runs["one"], runs["two"]
    for a, b in zip(one["losses"], two["losses"], strict=True):
        assert abs(a - b) <= LOSS_TOL, (one["losses"], two["losses"])
    # the gradient norm each step clipped by: over the whole batch on every rank, as with one
    assert len(one["grad_norms"]) == len(two["grad_norms"]) == len(one["losses"])
    for a, b in zip(one["grad_norms"], two["grad_norms"], strict=True):
        assert a > 0 and abs(a - b) <= 1e-5 * max(1.0, a), (one["grad_norms"], two["grad_norms"])
    assert _worst(one["params"], two["params"]) <= PARAM_TOL
    # the step moved the weights: the comparison is not between two untouched models
    assert one["losses"][0] != one["losses"][1]


@pytest.mark.slow
def test_two_ranks_packed_in_chunks_equal_one_rank_padded(runs: dict[str, Any]) -> None:
    """SPEC §12.1 and §14 together: two ranks on packed micro-batches, the head in chunks of 3
    positions, activations checkpointed, give the padded one-rank steps."""
    root = runs["root"]
    cfg = _config(
        root,
        "two-packed",
        runs["model"],
        ["cpu", "cpu"],
        micro_batch_tokens=64,
        logprob_chunk=3,
        activation_checkpointing=True,
    )
    packed = _run(cfg, root / "two-packed.pt", "--steps", "3")
    one = runs["one"]
    for a, b in zip(one["losses"], packed["losses"], strict=True):
        assert abs(a - b) <= LOSS_TOL, (one["losses"], packed["losses"])
    assert _worst(one["params"], packed["params"]) <= PARAM_TOL


def test_a_store_client_cannot_make_a_rank_run_code(runs: dict[str, Any]) -> None:
    """SPEC §12.1: a client with only the store's address wrote a pickle that creates a file
    when unpickled, a command without the key and a replayed command at the key rank 1 waited
    on: rank 1 ran none of them (no file), refused each, then took rank 0's own stop (exit 0)."""
    assert not runs["marker"].exists(), "a rank unpickled a value a store client wrote"
    assert runs["two"]["follower_codes"] == [0]
    log = (runs["root"] / "two.rank1.log").read_text(errors="replace")
    assert "refused a store value at a command key" in log, log[-3000:]
    assert "bad MAC" in log, log[-3000:]
    assert "trainer rank stops" in log


def test_sharded_checkpoint_layout(runs: dict[str, Any]) -> None:
    """SPEC §12.1: every rank wrote its own model shard (safetensors, DCP's Hugging Face writer)
    and optimizer shard; nothing gathered (no model.safetensors before the last step); every
    file under a checksum."""
    import json

    from atroposd.trainer.hfshards import shard_name

    step = runs["root"] / "two-checkpoints" / "step-2"
    assert (step / "checksums.json").is_file() and (step / "config.json").is_file()
    assert not (step / "model.safetensors").exists()
    assert sorted(p.name for p in (step / "model").iterdir()) == [shard_name(0), shard_name(1)]
    shards = sorted(p.name for p in (step / "optimizer").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"], shards
    state = torch.load(step / "trainer_state.pt", weights_only=True)
    assert state["format"] == 2 and state["ranks"] == 2 and state["optimizer"] is None
    assert state["optimizer_dcp"] == "optimizer" and state["model_dcp"] == "model"
    assert state["model_shapes"]["model.embed_tokens.weight"] == list(
        runs["two"]["params"]["model.embed_tokens.weight"].shape
    )
    table = json.loads((step / "checksums.json").read_text())["files"]
    assert {f"model/{shard_name(0)}", f"model/{shard_name(1)}", "optimizer/.metadata"} <= set(table)
    assert not list(step.parent.glob(".tmp-*"))


def test_resume_with_two_ranks_is_bit_identical(runs: dict[str, Any]) -> None:
    root = runs["root"]
    cfg = _config(root, "two-again", runs["model"], ["cpu", "cpu"])
    shutil.copytree(root / "two-checkpoints" / "step-2", root / "two-again-checkpoints" / "step-2")
    resumed = _run(cfg, root / "two-again.pt", "--steps", "1")
    assert resumed["resumed_from"] == 2
    assert resumed["losses"] == runs["two"]["losses"][2:]
    for name, t in runs["two"]["params"].items():
        assert torch.equal(t, resumed["params"][name]), name


@pytest.mark.parametrize(
    ("source", "target", "devices"), [("two", "one-from-two", "cpu"), ("one", "two-from-one", ["cpu", "cpu"])]
)
def test_resume_with_another_rank_count(
    runs: dict[str, Any], source: str, target: str, devices: str | list[str]
) -> None:
    root = runs["root"]
    cfg = _config(root, target, runs["model"], devices)
    shutil.copytree(root / f"{source}-checkpoints" / "step-2", root / f"{target}-checkpoints" / "step-2")
    resumed = _run(cfg, root / f"{target}.pt", "--steps", "1")
    assert resumed["resumed_from"] == 2
    saved, now = (2, 1) if source == "two" else (1, 2)
    assert f"resharded='{saved} → {now} ranks'" in resumed["log"], resumed["log"][-3000:]
    assert abs(resumed["losses"][0] - runs[source]["losses"][2]) <= LOSS_TOL
    assert _worst(runs[source]["params"], resumed["params"]) <= PARAM_TOL


def test_deal_gives_every_rank_the_same_passes() -> None:
    from atroposd.trainer.batch import prepare_batch
    from atroposd.trainer.share import deal
    from tests.trainer.conftest import make_groups

    batch = prepare_batch(make_groups(7, n=3), micro_batch_size=8, max_token_len=64, adv_std_floor=0.1)
    assert len(batch.micro) == 3
    shares = deal(batch.micro, 2, batch.completion_tokens, 0)
    assert [len(s.micro) for s in shares] == [2, 1] and {s.passes for s in shares} == {2}
    weights = [[w for _, w in s.passes_with_weight()] for s in shares]
    assert weights == [[1.0, 1.0], [1.0, 0.0]]
    assert all(s.denom == batch.completion_tokens for s in shares)
    # more ranks than micro-batches: the extra ranks run zero-weight passes only
    shares = deal(batch.micro[:1], 3, 10, 0)
    assert [[w for _, w in s.passes_with_weight()] for s in shares] == [[1.0], [0.0], [0.0]]


def test_group_errors_restart_the_group_but_a_poisoned_device_ends_the_job() -> None:
    from atroposd.trainer.compute import Fenced
    from atroposd.trainer.ranks import JoinTimeout, is_group_error

    assert is_group_error(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
    assert is_group_error(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 4000ms"))
    assert is_group_error(RuntimeError("Application timeout caused pair closure"))
    assert is_group_error(JoinTimeout("trainer-1 did not join")) and is_group_error(Fenced("old generation"))
    assert not is_group_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_group_error(ValueError("a bug in the loss"))


def _hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """What transformers loads from ``directory`` (the tied head included)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


def _assert_exact(loaded: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == trained.keys()
    for name, t in trained.items():
        assert torch.equal(loaded[name], t), name


def test_the_last_checkpoint_is_a_hugging_face_model(runs: dict[str, Any]) -> None:
    """SPEC §12.1: at the last step the shards are consolidated into model.safetensors beside
    them: transformers loads the checkpoint with exactly the trained weights."""
    step = runs["root"] / "two-checkpoints" / "step-3"
    assert (step / "model.safetensors").is_file() and (step / "model").is_dir()
    _assert_exact(_hf_weights(step), runs["two"]["params"])


def _export(cfg: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "atroposd", "export", "-c", str(cfg), *args, str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(("name", "files"), [("two", ["--step", "2"]), ("one", [])])
def test_export_writes_what_transformers_loads_bit_exact(runs: dict[str, Any], name: str, files: list[str]) -> None:
    """``atroposd export``: the sharded checkpoint of step 2 (consolidated from the two ranks'
    shards) and the newest one-rank checkpoint, each a directory transformers loads with exactly
    the weights trained to step 2; a second export into the same directory is refused (exit 2)."""
    out = runs["root"] / f"export-{name}"
    proc = _export(runs[f"{name}_cfg"], out, *files)
    assert proc.returncode == 0, proc.stderr
    assert "model.safetensors" in proc.stdout and "config.json" in proc.stdout
    assert not (out / "trainer_state.pt").exists() and not (out / "optimizer").exists()
    _assert_exact(_hf_weights(out), runs[name]["checkpoint_params"])
    again = _export(runs[f"{name}_cfg"], out, *files)
    assert again.returncode == 2 and "not an empty directory" in again.stderr


def test_a_tampered_model_shard_is_refused(runs: dict[str, Any]) -> None:
    """SPEC §12.1: one byte of rank 1's model shard changed: resume sets the checkpoint aside
    naming the file, and export refuses it (exit 1) before reading anything."""
    from atroposd.trainer.checkpoint import load_latest
    from atroposd.trainer.hfshards import shard_name

    root = runs["root"] / "tampered"
    shutil.copytree(runs["root"] / "two-checkpoints" / "step-2", root / "step-2")
    shard = root / "step-2" / "model" / shard_name(1)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    cfg = _config(runs["root"], "tampered-job", runs["model"], ["cpu", "cpu"], checkpoint_dir=str(root))
    proc = _export(cfg, runs["root"] / "tampered-export")
    assert proc.returncode == 1 and f"model/{shard_name(1)} does not match its checksum" in proc.stderr
    assert not (runs["root"] / "tampered-export").exists()
    latest = load_latest(root)
    assert latest.restored is None and [p.name.split(".bad-")[0] for p in latest.set_aside] == ["step-2"]


# ---------------------------------------------------------------------------- format 1 still resumes

LEGACY = Path(__file__).resolve().parent.parent / "data" / "checkpoints-format1"


@pytest.mark.parametrize(("name", "devices"), [("one", "cpu"), ("two", ["cpu", "cpu"])])
def test_a_format_1_checkpoint_still_resumes(tmp_path: Path, name: str, devices: str | list[str]) -> None:
    """Checkpoints written before the ranks wrote their own model shards (tests/data/
    checkpoints-format1, made by its make.py with that atroposd): the weights load exactly as
    saved, and the step after resuming is the step that atroposd took (its loss and weights,
    recorded then) — bit for bit while the trainer's arithmetic is that atroposd's, within 1e-6
    (loss) and 1e-5 (each tensor, relative by norm) after a change of it; without the restored
    optimizer state the step would differ by far more."""
    import json
    import os

    from safetensors.torch import load_file

    from tests.support import write_config

    shutil.copytree(LEGACY / "model", tmp_path / "model")
    shutil.copytree(LEGACY / name / "step-2", tmp_path / f"{name}-checkpoints" / "step-2")
    # the model is named as the checkpoint names it: relative to the job's working directory
    cfg = write_config(
        tmp_path / f"{name}.toml",
        {
            "daemon": {"state_dir": name, "runtime_dir": f"{name}/run"},
            "inference": {"model": "model", "max_model_len": 512},
            "trainer": {
                "device": devices,
                "batch_size": 32,
                "micro_batch_size": 8,
                "max_token_len": 64,
                "weight_sync": "reload",
                "checkpoint_dir": f"{name}-checkpoints",
            },
        },
    )
    repo = Path(__file__).resolve().parent.parent.parent
    proc = subprocess.run(
        [sys.executable, "-m", "tests.trainer.rank_zero", str(cfg), str(tmp_path / "out.pt"), "--steps", "1"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(repo)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert out["resumed_from"] == 2
    saved = load_file(str(LEGACY / name / "step-2" / "model.safetensors"))
    for k, t in saved.items():
        assert torch.equal(out["loaded_params"][k], t), k
    expected = json.loads((LEGACY / "expected.json").read_text())[name]
    step3 = load_file(str(LEGACY / f"{name}-step3.safetensors"))
    assert abs(out["losses"][0] - expected["losses"][2]) <= 1e-6, (out["losses"], expected["losses"])
    assert _worst(step3, {k: out["params"][k] for k in step3}) <= PARAM_TOL

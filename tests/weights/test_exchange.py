"""Manifest, shm segments, the parameter arena and the receiver, in one process and with real
shared memory (the cross-process protocol is in test_sync.py)."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atroposd.weights.arena import ParameterArena, plan_layout
from atroposd.weights.manifest import ALIGNMENT, Manifest, ManifestError, manifest_path
from atroposd.weights.receiver import ReceiverState, WeightUpdateError, apply_update, load_dir
from atroposd.weights.reload import prune_sync_dirs, write_sync_dir
from atroposd.weights.shm import (
    ShmError,
    ShmSegment,
    cleanup_stale,
    list_segments,
    read_into,
    segment_name,
)
from atroposd.weights.tensors import model_tensors
from tests.weights.conftest import make_model, score

# ---------------------------------------------------------------------------- layout / segments


def test_plan_layout_aligns_and_splits() -> None:
    slots, segs = plan_layout({"a": 10, "b": 100, "c": 300, "d": 5}, max_segment_bytes=256)
    by = {s.name: s for s in slots}
    assert all(s.offset % ALIGNMENT == 0 for s in slots)
    assert by["a"].segment == by["b"].segment == 0 and by["b"].offset == 64
    assert by["c"].segment == 1 and by["c"].offset == 0  # larger than a segment: its own
    assert by["d"].segment == 2
    for s in slots:
        assert s.offset + s.nbytes <= segs[s.segment]


def test_segment_names_carry_an_unpredictable_part(nonce: str) -> None:
    """The nonce is visible in ``ps``: a name squatted from it does not block an export."""
    from atroposd.weights.arena import ParameterArena
    from atroposd.weights.shm import segment_nonce

    first, second = segment_name(nonce, 0), segment_name(nonce, 0)
    assert first != second and first.startswith(f"atroposd-{nonce}-")
    assert segment_nonce(first) == nonce and segment_nonce(f"atroposd-{nonce}-0") is None
    squat = ShmSegment.create(f"atroposd-{nonce}-0", 4096)  # the old, predictable name
    try:
        arena = ParameterArena.create(make_model(0), nonce=nonce)
        try:
            names = [s.name for s in arena.manifest(0).segments]
            assert names and squat.name not in names
            assert all(segment_nonce(n) == nonce for n in names)
            assert len({n.rsplit("-", 2)[1] for n in names}) == 1  # one tag per export
        finally:
            arena.release()
    finally:
        squat.unlink()
        squat.close()


def test_segment_is_exclusive_private_and_not_tracked(nonce: str) -> None:
    name = segment_name(nonce, 0)
    seg = ShmSegment.create(name, 4096)
    try:
        st = os.stat(f"/dev/shm/{name}")
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 4096
        with pytest.raises(ShmError, match="already exists"):
            ShmSegment.create(name, 4096)
        v = seg.view(64, 16, torch.float32, (4,))
        v.copy_(torch.arange(4.0))
        # A child process attaches and exits: with multiprocessing.shared_memory on 3.11 its
        # resource tracker would unlink the segment here.
        code = (
            "import sys; from atroposd.weights.shm import ShmSegment; import torch;"
            f"s = ShmSegment.attach({name!r}, 4096); t = s.view(64, 16, torch.float32, (4,));"
            "sys.exit(0 if t.tolist() == [0.0, 1.0, 2.0, 3.0] else 1)"
        )
        assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
        assert os.path.exists(f"/dev/shm/{name}")
        with pytest.raises(ShmError, match="still referenced"):
            seg.close()
        out = torch.empty(4)
        assert read_into(name, 4096, [(64, out)]) == 16
        assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
        with pytest.raises(ShmError, match="out of bounds"):
            read_into(name, 4096, [(4090, out)])
        del v
    finally:
        seg.close()
        seg.unlink()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_read_into_parallel_split(nonce: str) -> None:
    name = segment_name(nonce, 0)
    n = 3 * 1024 * 1024  # 12 MiB of float32: split across threads
    seg = ShmSegment.create(name, n * 4 + 128)
    try:
        src = torch.randn(n)
        v = seg.view(64, n * 4, torch.float32, (n,))
        v.copy_(src)
        del v
        a, b = torch.empty(n // 3), torch.empty(n - n // 3)
        read_into(name, seg.size, [(64, a), (64 + a.numel() * 4, b)])
        assert torch.equal(torch.cat([a, b]), src)
    finally:
        seg.close()
        seg.unlink()


# ---------------------------------------------------------------------------- arena


def test_arena_moves_parameters_in_place_and_releases(nonce: str) -> None:
    model = make_model(0)
    params_before = {n: p for n, p in model.named_parameters()}
    ref = score(model)
    arena = ParameterArena.create(model, nonce=nonce, max_segment_bytes=256 * 1024)
    try:
        assert len(arena.segments) > 1  # several flat buffers, not one per tensor
        assert len(arena.segments) < len(arena.slots)
        for seg in arena.segments:
            assert os.path.exists(f"/dev/shm/{seg.name}")
        # Same Parameter objects (an optimizer built before or after stays valid), new memory.
        for n, p in model.named_parameters():
            assert p is params_before[n]
            assert any(s.owns(p) for s in arena.segments), n
        assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
        assert torch.equal(score(model), ref)
        m = arena.manifest(3)
        assert m.tied == {"lm_head.weight": "model.embed_tokens.weight"}
        assert m.weight_version == 3 and m.export_id == 1 and m.exporter_pid == os.getpid()
        assert "lm_head.weight" not in {t.name for t in m.tensors}  # exported once
        m.check_layout()
    finally:
        arena.release()
    assert not list_segments(f"atroposd-{nonce}-")
    assert torch.equal(score(model), ref)  # private memory again, same values
    torch.optim.SGD(model.parameters(), lr=0.1)  # still a normal model


# ---------------------------------------------------------------------------- receiver


@pytest.fixture
def exported(nonce: str, dirs: dict[str, Path]):
    trainer = make_model(0)
    arena = ParameterArena.create(trainer, nonce=nonce)
    path = manifest_path(dirs["weights"], nonce)
    arena.manifest(5).write(path)
    state = ReceiverState(nonce=nonce, weights_dir=dirs["weights"], sync_dir=dirs["sync"])
    yield trainer, arena, path, state
    arena.release()


def _rewrite(path: Path, **changes: object) -> None:
    m = Manifest.from_json(path.read_bytes())
    dataclasses.replace(m, **changes).write(path)  # type: ignore[arg-type]


def _tensor_change(path: Path, name: str, **changes: object) -> None:
    m = Manifest.from_json(path.read_bytes())
    tensors = tuple(dataclasses.replace(t, **changes) if t.name == name else t for t in m.tensors)  # type: ignore[arg-type]
    dataclasses.replace(m, tensors=tensors).write(path)


def test_copy_and_attach_give_the_trainer_weights(exported) -> None:
    trainer, _arena, path, state = exported
    server = make_model(1)
    assert not torch.allclose(score(server), score(trainer))
    r = apply_update(server, {"manifest": str(path), "mode": "copy", "weight_version": 5}, state=state)
    assert r["weight_version"] == 5 and r["tensors"] == len(model_tensors(server).tensors)
    assert torch.equal(score(server), score(trainer))
    assert not state.attached
    server2 = make_model(2)
    apply_update(server2, {"manifest": str(path), "mode": "attach"}, state=state)
    assert state.attached
    with torch.no_grad():
        trainer.model.norm.weight.mul_(1.5)  # the trainer writes its memory ...
    assert torch.equal(score(server2), score(trainer))  # ... and the server computes on it
    state.release(server2)
    assert not state.attached
    assert torch.equal(score(server2), score(trainer))  # private copy kept the values


@pytest.mark.parametrize(
    "case",
    [
        "dtype16",
        "dtypebf16",
        "dtype_bad",
        "shape",
        "missing",
        "extra",
        "bounds",
        "nonce",
        "dead_pid",
        "version",
        "segment_name",
    ],
)
def test_tampered_manifest_is_refused(exported, case: str, tmp_path: Path) -> None:
    _trainer, _arena, path, state = exported
    name = "model.layers.0.mlp.up_proj.weight"
    expect = name
    request: dict[str, object] = {"manifest": str(path), "mode": "copy"}
    m = Manifest.from_json(path.read_bytes())
    if case == "dtype16":
        _tensor_change(path, name, dtype="float16", nbytes=m.entry(name).nbytes // 2)
    elif case == "dtypebf16":
        _tensor_change(path, name, dtype="bfloat16", nbytes=m.entry(name).nbytes // 2)
    elif case == "dtype_bad":
        _tensor_change(path, name, dtype="int64")
        expect = "not allowed"
    elif case == "shape":
        _tensor_change(path, name, shape=(128, 256), stride=(256, 1))
    elif case == "missing":
        _rewrite(path, tensors=tuple(t for t in m.tensors if t.name != name))
        expect = f"{name}' is missing"
    elif case == "extra":
        e = m.entry(name)
        _rewrite(path, tensors=(*m.tensors, dataclasses.replace(e, name="model.extra.weight")))
        expect = "model.extra.weight"
    elif case == "bounds":
        _tensor_change(path, name, offset=m.segment(m.entry(name).segment).size - 64)
        expect = f"{name}': bytes"
    elif case == "nonce":
        _rewrite(path, nonce="other123")
        expect = "stale manifest refused"
    elif case == "dead_pid":
        proc = subprocess.Popen(["true"])
        proc.wait()
        _rewrite(path, exporter_pid=proc.pid)
        expect = "not alive"
    elif case == "version":
        request["weight_version"] = 4
        expect = "stale manifest refused"
    elif case == "segment_name":
        segs = tuple(dataclasses.replace(s, name="atroposd-other-0") for s in m.segments)
        _rewrite(path, segments=segs)
        expect = "is not of the form"
    server = make_model(1)
    before = score(server)
    with pytest.raises(WeightUpdateError, match=expect.replace("(", r"\(").replace(")", r"\)")):
        apply_update(server, request, state=state)
    assert torch.equal(score(server), before)  # nothing touched
    assert not state.attached


def test_manifest_provenance_checks(exported, tmp_path: Path) -> None:
    _trainer, _arena, path, state = exported
    server = make_model(1)
    elsewhere = tmp_path / path.name
    elsewhere.write_bytes(path.read_bytes())
    os.chmod(elsewhere, 0o600)
    with pytest.raises(WeightUpdateError, match="is not this launch's manifest"):
        apply_update(server, {"manifest": str(elsewhere), "mode": "copy"}, state=state)
    os.chmod(path, 0o644)
    with pytest.raises(WeightUpdateError, match="expected 0600"):
        apply_update(server, {"manifest": str(path), "mode": "copy"}, state=state)
    os.chmod(path, 0o600)
    path.write_bytes(b"{not json")
    with pytest.raises(WeightUpdateError, match="not valid JSON"):
        apply_update(server, {"manifest": str(path), "mode": "copy"}, state=state)
    path.unlink()
    with pytest.raises(WeightUpdateError, match="does not exist"):
        apply_update(server, {"manifest": str(path), "mode": "copy"}, state=state)
    with pytest.raises(WeightUpdateError, match="'mode'"):
        apply_update(server, {"manifest": str(path), "mode": "steal"}, state=state)


def test_shape_mismatch_against_a_different_model(exported) -> None:
    _trainer, _arena, path, state = exported
    other = make_model(1, intermediate_size=384)
    with pytest.raises(WeightUpdateError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight'.*shape"):
        apply_update(other, {"manifest": str(path), "mode": "attach"}, state=state)
    untied = make_model(1, tie_word_embeddings=False)
    # The exporter ties lm_head to embed_tokens; an importer that does not tie re-ties.
    apply_update(untied, {"manifest": str(path), "mode": "copy"}, state=state)
    assert torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)
    fp16 = make_model(1).half()
    with pytest.raises(WeightUpdateError, match="dtype float32 != the importer's float16"):
        apply_update(fp16, {"manifest": str(path), "mode": "copy"}, state=state)


def test_checksum_detects_changed_memory(exported) -> None:
    trainer, _arena, path, state = exported
    with torch.no_grad():
        trainer.model.norm.weight.add_(1.0)  # memory changed after the manifest was written
    with pytest.raises(WeightUpdateError, match=r"model\.norm\.weight.*checksum"):
        apply_update(make_model(1), {"manifest": str(path), "mode": "attach"}, state=state)


# ---------------------------------------------------------------------------- reload


def test_reload_dir_roundtrip_and_refusals(dirs: dict[str, Path], nonce: str) -> None:
    trainer = make_model(0)
    state = ReceiverState(nonce=nonce, weights_dir=dirs["weights"], sync_dir=dirs["sync"])
    d = write_sync_dir(trainer, dirs["sync"], 7)
    assert stat.S_IMODE(os.stat(d / "model.safetensors").st_mode) == 0o600
    server = make_model(1)
    with pytest.raises(WeightUpdateError, match="stale"):
        load_dir(server, d, weight_version=8, state=state)
    r = load_dir(server, d, weight_version=7, state=state)
    assert r["weight_version"] == 7
    assert torch.equal(score(server), score(trainer))
    with pytest.raises(WeightUpdateError, match="shape"):
        load_dir(make_model(1, intermediate_size=384), d, weight_version=7, state=state)
    outside = dirs["state"] / "elsewhere"
    outside.mkdir()
    with pytest.raises(WeightUpdateError, match="not inside the sync directory"):
        load_dir(server, outside, state=state)
    d2 = write_sync_dir(trainer, dirs["sync"], 8)
    prune_sync_dirs(dirs["sync"], d2)
    assert sorted(p.name for p in dirs["sync"].iterdir()) == ["v8"]


# ---------------------------------------------------------------------------- stale cleanup


def test_cleanup_stale_removes_only_dead_launches(dirs: dict[str, Path]) -> None:
    dead, live = "deadbeef01", "a1ive0001"
    segs = [ShmSegment.create(segment_name(n, i), 4096) for n in (dead, live) for i in range(2)]
    for s in segs:
        s.close()
    # Unknown to the records but mapped by a live process (this one): not dead, kept.
    mapped = ShmSegment.create(segment_name("deadbeef02", 0), 4096)
    segs.append(mapped)
    for n in (dead, live):
        manifest_path(dirs["weights"], n).write_text("{}")
    (dirs["weights"] / f".manifest-{dead}.json.1.2.tmp").write_text("")
    try:
        removed = cleanup_stale(dirs["runtime"], lambda n: n == live)
        assert sorted(Path(r).name for r in removed) == sorted(
            [segs[0].name, segs[1].name, f"manifest-{dead}.json", f".manifest-{dead}.json.1.2.tmp"]
        )
        assert list_segments(f"atroposd-{dead}-") == []
        assert len(list_segments(f"atroposd-{live}-")) == 2
        assert manifest_path(dirs["weights"], live).exists()
        assert list_segments("atroposd-deadbeef02-") == [mapped.name]
        mapped.close()
        assert cleanup_stale(dirs["runtime"], lambda n: n == live) == [f"/dev/shm/{mapped.name}"]
    finally:
        mapped.close()
        for s in segs:
            if os.path.exists(f"/dev/shm/{s.name}"):
                s.unlink()


def test_manifest_rejects_bad_nonce(dirs: dict[str, Path]) -> None:
    with pytest.raises(ManifestError, match="invalid nonce"):
        manifest_path(dirs["weights"], "../../etc")


# ---------------------------------------------------------------------------- LoRA


def _peft(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def _lora_step(model: torch.nn.Module) -> None:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ids = torch.tensor([[1, 5, 12, 7, 17, 9, 3]])
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()


def test_lora_shared_and_reload(nonce: str, dirs: dict[str, Path]) -> None:
    trainer = _peft(make_model(0))
    arena = ParameterArena.create(trainer, nonce=nonce)
    try:
        m = arena.manifest(0)
        assert m.lora == {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"], "dropout": 0.0}
        assert any(t.name == "model.layers.0.self_attn.q_proj.lora_A.default.weight" for t in m.tensors)
        path = manifest_path(dirs["weights"], nonce)
        m.write(path)
        state = ReceiverState(nonce=nonce, weights_dir=dirs["weights"], sync_dir=dirs["sync"])
        server = make_model(1)  # a plain model: the receiver injects the same adapters
        apply_update(server, {"manifest": str(path), "mode": "attach"}, state=state)
        _lora_step(trainer)  # trains the adapters in the shared memory
        torch.testing.assert_close(score(server), score(trainer), atol=1e-5, rtol=0)
        assert (score(server) - score(make_model(0))).abs().max() > 1e-3
        state.release(server)
        # reload mode: adapters (and base) through state_dir/sync
        other = make_model(2)
        d = write_sync_dir(trainer, dirs["sync"], 3)
        load_dir(other, d, weight_version=3, state=state)
        torch.testing.assert_close(score(other), score(trainer), atol=1e-5, rtol=0)
    finally:
        arena.release()

"""The GPU paths' CPU twins: what can be checked without a GPU of the CUDA IPC transport —
the handle's fields carried as plain JSON (nothing unpickled), one export per buffer, the
same-GPU check of shared mode, and the device synchronised before a shared-mode resume."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from atroposd.weights import cuda_ipc
from atroposd.weights.cuda_ipc import CudaSegment, handle_args, handle_from_args
from atroposd.weights.manifest import CudaIpcHandle, Manifest, ManifestError, SegmentRef
from atroposd.weights.receiver import other_gpu
from atroposd.weights.sync import SharedSync
from tests.weights.conftest import ChildFactory, make_model, train_step

UUID = "GPU-0d1f2c3a-aaaa-bbbb-cccc-000000000000"
OTHER = "GPU-99999999-aaaa-bbbb-cccc-000000000000"


def torch_args(device: int = 0, numel: int = 4096) -> tuple[Any, ...]:
    """What reduce_tensor gives for a flat uint8 CUDA tensor (the handles are opaque bytes)."""
    return (
        torch.Tensor,
        torch.Size([numel]),
        (1,),
        0,
        torch.storage.TypedStorage,
        torch.uint8,
        device,
        b"\x00storage\xff" * 4,
        numel,
        0,
        False,
        b"/torch_123_ref",
        7,
        b"\x01event" * 8,
        True,
    )


def cuda_manifest(uuid: str = UUID, handle: CudaIpcHandle | None = None) -> Manifest:
    handle = handle or handle_from_args(torch_args())
    return Manifest(
        nonce="abcd",
        exporter_pid=os.getpid(),
        exporter_start_time=1,
        export_id=1,
        weight_version=0,
        transport="cuda_ipc",
        segments=(SegmentRef(index=0, name="cuda-abcd-0", size=4096, handle=handle, device_uuid=uuid),),
        tensors=(),
    )


def test_handle_fields_round_trip_without_pickle() -> None:
    handle = handle_from_args(torch_args())
    assert handle_args(handle, 3) == torch_args(device=3)  # the importer's own device index
    m = cuda_manifest(handle=handle)
    raw = m.to_json()
    assert orjson.loads(raw)["segments"][0]["handle"]["ref_counter_offset"] == 7
    back = Manifest.from_json(raw)
    back.check_layout()
    assert back.segments[0].handle == handle


@pytest.mark.parametrize("change", ["pickled", "missing", "extra", "bad_b64", "negative", "not_bool", "small"])
def test_a_malformed_handle_is_refused(change: str) -> None:
    data = orjson.loads(cuda_manifest().to_json())
    h = data["segments"][0]["handle"]
    if change == "pickled":  # the former form: base64 of a pickle
        data["segments"][0]["handle"] = "gASVJAAAAAAAAAB9lC4="
    elif change == "missing":
        del h["event_handle"]
    elif change == "extra":
        h["tensor_cls"] = "os.system"
    elif change == "bad_b64":
        h["storage_handle"] = "not base64!"
    elif change == "negative":
        h["ref_counter_offset"] = -1
    elif change == "not_bool":
        h["event_sync_required"] = 1
    elif change == "small":
        h["numel"] = 1
    with pytest.raises(ManifestError):
        Manifest.from_json(orjson.dumps(data)).check_layout()


@pytest.mark.parametrize(
    "field, value", [(0, torch.nn.Parameter), (4, torch.UntypedStorage), (5, torch.float32), (3, 8), (10, True)]
)
def test_only_a_whole_flat_uint8_buffer_is_exported(field: int, value: Any) -> None:
    args = list(torch_args())
    args[field] = value
    with pytest.raises(RuntimeError, match="whole flat uint8"):
        handle_from_args(tuple(args))
    with pytest.raises(RuntimeError, match="fields"):
        handle_from_args(torch_args()[:-1])


def test_each_buffer_is_exported_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every torch export adds a ref-counted IPC entry for the buffer's life: export once, then
    reuse the handle (each export still waits for the device)."""
    import torch.multiprocessing.reductions as reductions

    exports: list[int] = []
    syncs: list[Any] = []
    monkeypatch.setattr(
        reductions, "reduce_tensor", lambda t: (exports.append(1), (None, torch_args(numel=t.numel()))[1])
    )
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda device: UUID)
    monkeypatch.setattr(cuda_ipc, "ipc_collect", lambda: None)
    seg = CudaSegment("cuda-abcd-0", torch.empty(4096, dtype=torch.uint8))  # the CPU stands in for the GPU
    first = seg.export_handle()
    for _ in range(20):
        assert seg.export_handle() == first
    assert len(exports) == 1 and len(syncs) == 21
    seg.close()


def _export(offset: int, name: str = "cuda-abcd-0", index: int = 0) -> SegmentRef:
    """A segment of one export: each torch export of a buffer has its own reference counter slot."""
    args = list(torch_args())
    args[12] = offset
    return SegmentRef(index=index, name=name, size=4096, handle=handle_from_args(tuple(args)), device_uuid=UUID)


def test_a_consumer_rebuilds_each_export_once_and_holds_it_for_the_exports_life() -> None:
    """SPEC §7: one rebuild/release cycle per export — 100 syncs of one export rebuild it once
    (each rebuild would release one reference of the export and open its IPC event again); a
    new export releases the old mapping, then rebuilds once; ``release`` lets every mapping go."""
    import weakref

    rebuilt: list[tuple[bytes, int]] = []

    def rebuild(handle: CudaIpcHandle, uuid: str) -> torch.Tensor:
        assert uuid == UUID
        rebuilt.append((handle.ref_counter_handle, handle.ref_counter_offset))
        return torch.zeros(handle.numel, dtype=torch.uint8)  # the CPU stands in for the mapped GPU block

    imports = cuda_ipc.CudaImports(rebuild)
    first = imports.map([_export(7)])
    mapping = weakref.ref(first[0])
    for _ in range(100):
        assert imports.map([_export(7)])[0] is first[0]
    assert (imports.rebuilds, imports.releases, len(imports)) == (1, 0, 1)
    del first
    assert mapping() is not None  # held while the export lives, by nobody but the imports
    second = imports.map([_export(8), _export(3, "cuda-abcd-1", 1)])  # the trainer exported anew
    assert mapping() is None
    assert rebuilt == [(b"/torch_123_ref", 7), (b"/torch_123_ref", 8), (b"/torch_123_ref", 3)]
    assert (imports.rebuilds, imports.releases) == (3, 1) and sorted(second) == [0, 1]
    held = [weakref.ref(t) for t in second.values()]
    del second
    imports.map([_export(3, "cuda-abcd-1", 1)])  # a segment gone from the export: released
    assert (imports.releases, len(imports)) == (2, 1) and held[0]() is None and held[1]() is not None
    imports.release()
    assert (imports.releases, len(imports)) == (3, 0) and held[1]() is None


def test_the_producer_exports_once_per_consumer_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each consumer gets an export of its own, the same at every sync; a consumer that
    (re)starts gets a new one (its old reference went with its process)."""
    import torch.multiprocessing.reductions as reductions

    slots = iter(range(100, 200))

    def reduce(t: torch.Tensor) -> tuple[None, tuple[Any, ...]]:
        args = list(torch_args(numel=t.numel()))
        args[12] = next(slots)  # torch gives each export a counter slot of its own
        return None, tuple(args)

    monkeypatch.setattr(reductions, "reduce_tensor", reduce)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda device: UUID)
    monkeypatch.setattr(cuda_ipc, "ipc_collect", lambda: None)
    seg = CudaSegment("cuda-abcd-0", torch.empty(4096, dtype=torch.uint8))  # the CPU stands in for the GPU
    a = seg.export_handle(0)
    b = seg.export_handle(1)
    assert a[0].ref_counter_offset != b[0].ref_counter_offset
    for _ in range(100):
        assert seg.export_handle(0) == a and seg.export_handle(1) == b
    assert seg.exports == 2
    seg.new_cycle(1)  # replica 1 restarted
    c = seg.export_handle(1)
    assert c != b and seg.export_handle(0) == a and seg.exports == 3
    seg.close()
    assert seg.buffer is None


def test_shared_mode_refuses_another_gpu() -> None:
    assert other_gpu(cuda_manifest(UUID), UUID) is None
    problem = other_gpu(cuda_manifest(OTHER), UUID)
    assert problem is not None and "same physical GPU" in problem and OTHER in problem


@pytest.mark.anyio
async def test_shared_resume_waits_for_the_device(
    dirs: dict[str, Path], nonce: str, child_factory: ChildFactory
) -> None:
    """The resume after a shared-mode step comes after the arena's device synchronisation."""
    child = child_factory.reuse()
    model = make_model(0)
    sync = SharedSync(nonce=nonce, weights_dir=dirs["weights"], control_socket=child.socket)
    events: list[str] = []
    try:
        await sync.attach(model, 0)
        assert sync.arena is not None
        arena = sync.arena
        real_sync, real_call = arena.synchronize, sync.replicas.call

        def synchronize() -> None:
            events.append("synchronize")
            real_sync()

        async def call(method: str, *args: Any, **kw: Any) -> dict[str, Any]:
            events.append(method)
            return await real_call(method, *args, **kw)

        object.__setattr__(arena, "synchronize", synchronize)
        object.__setattr__(sync.replicas, "call", call)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        async with sync.paused(1):
            train_step(model, opt)
            events.append("step")
        assert events == ["pause", "step", "synchronize", "resume"]
    finally:
        sync.close()


def test_host_staging_pages_are_pinned_portable() -> None:
    """The staging segment is page-locked for every CUDA context of the process (portable), not
    only the device current on the pinning thread; a replica's view also read-only."""
    import secrets

    from atroposd.weights.shm import ShmSegment
    from atroposd.weights.staging import REGISTER_PORTABLE, REGISTER_READ_ONLY, pin_host

    calls: list[tuple[int, int, int]] = []

    def register(address: int, size: int, flags: int) -> int:  # cudaHostRegister's place
        calls.append((address, size, flags))
        return 0

    seg = ShmSegment.create(f"atroposd-{secrets.token_hex(6)}-0", 1 << 16)
    try:
        pin_host(seg, register=register)
        pin_host(seg, read_only=True, register=register)
        assert calls == [
            (seg.address, seg.size, REGISTER_PORTABLE),
            (seg.address, seg.size, REGISTER_PORTABLE | REGISTER_READ_ONLY),
        ]
        assert (REGISTER_PORTABLE, REGISTER_READ_ONLY) == (0x01, 0x08)  # cudaHostRegisterPortable, ...ReadOnly
        with pytest.raises(RuntimeError, match=r"cudaHostRegister .* failed: CUDA error 2"):
            pin_host(seg, register=lambda address, size, flags: 2)
    finally:
        seg.unlink()
        seg.close()

"""``atroposd.client`` against a real API: transports, fallbacks, tokens, the batch's views, and
weights written for the inference server."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atroposd.api.shmbatch import BATCH_PREFIX
from atroposd.client import ApiError, BatchClient, InferenceControl
from atroposd.client import batches as client_batches
from tests.api.conftest import Api, Server, group, start_atroposd
from tests.support import REPO, stop_process


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_atroposd(tmp_path_factory.mktemp("client"), "--token", "secret")
    try:
        yield s
    finally:
        stop_process(s.proc)


@pytest.fixture
def api(server: Server) -> Api:
    assert server.api.get("/reset_data").status == 200
    return server.api


def client(api: Api, **kw: Any) -> BatchClient:
    return BatchClient(api.url, token="secret", batch_size=4, max_token_len=64, **kw)


def test_client_registers_and_reads_shared_memory(api: Api) -> None:
    with client(api) as c:
        assert c.transport == "shm", "the API is on this host"
        assert c.get_batch() is None, "registered; nothing queued"
        assert api.ok("GET", "/info")["batch_size"] == 4
        g = group(
            4, length=6, group_overrides={"atroposd": {"weight_version": 2}}, generation_params={"temperature": 0.7}
        )
        api.ok("POST", "/scored_data", g)
        b = c.next_batch(timeout=10)
        assert b.transport == "shm" and b.batch_id and b.metadata["format"] == "atroposd-batch-1"
        assert b.tokens.shape == (4, 6) and b.tokens.dtype == np.int64 and b.sequences == 4
        assert b.tokens.flags.writeable
        assert b.groups == [
            {"generation_params": {"temperature": 0.7}, "group_overrides": {"atroposd": {"weight_version": 2}}}
        ]
        assert not list(Path("/dev/shm").glob(f"{BATCH_PREFIX}*")), "acknowledged: unlinked"
        prompt, response, logprobs, loss_mask = b.prompt_response()[1]
        assert prompt.tolist() == g["tokens"][1][:2] and response.tolist() == g["tokens"][1][2:]
        assert np.allclose(logprobs, g["inference_logprobs"][1][2:]) and loss_mask.tolist() == [1] * 4
        t = b.torch()
        assert t["masks"].dtype.is_floating_point is False and tuple(t["masks"].shape) == (4, 6)
        assert "groups_json" not in t
        b.tokens[:] = 0  # copy-on-write: the trainer's own memory


def test_unmappable_segment_is_released_and_http_used(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that cannot map the API's segments (another mount namespace, another user) gives
    the batch back at once and uses safetensors from then on: nothing is lost or waits."""

    def refuse(name: str, size: int) -> Any:
        raise PermissionError(f"segment {name!r}: not ours")

    monkeypatch.setattr(client_batches, "_map_segment", refuse)
    with client(api) as c:
        c.register()
        api.ok("POST", "/scored_data", group(4, tag=5.0))
        b = c.next_batch(timeout=10)
        assert b.transport == "safetensors" and c.transport == "safetensors"
        assert "not ours" in c.fallbacks[0]
        assert b.scores[0] == np.float32(5.0)
        assert api.ok("GET", "/status")["queued_sequences"] == 0


def test_json_transport_and_a_wrong_token(api: Api) -> None:
    with client(api, transport="json") as c:
        api_ok = c.get_batch()
        assert api_ok is None
        api.ok("POST", "/scored_data", group(4, logprobs=False))
        b = c.next_batch(timeout=10)
        assert b.transport == "json" and (b.inference_logprobs == 1.0).all()
    with BatchClient(api.url, token="wrong", batch_size=4, max_token_len=64) as bad, pytest.raises(ApiError) as err:
        bad.get_batch()
    assert err.value.status == 401


def test_next_batch_times_out_and_waits_for_an_api_that_is_not_up_yet() -> None:
    from tests.support import free_port

    c = BatchClient(f"http://127.0.0.1:{free_port()}", batch_size=4, max_token_len=64, max_backoff=0.05)
    with pytest.raises(TimeoutError):
        c.next_batch(timeout=0.3)
    with pytest.raises(ValueError, match="transport"):
        BatchClient("http://127.0.0.1:1", batch_size=1, max_token_len=1, transport="carrier-pigeon")


def test_client_imports_no_torch() -> None:
    code = (
        "import sys, atroposd.client, atroposd.api.server\n"
        "assert not [m for m in sys.modules if m == 'torch' or m.startswith('torch.')], 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_weights_written_for_the_inference_server(tmp_path: Path) -> None:
    control = InferenceControl(tmp_path / "inference-1.sock", tmp_path / "sync")
    path = control.write({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, 7, tied={"lm_head.weight": "w"})
    assert path == tmp_path / "sync" / "v7" and (path / "model.safetensors").stat().st_mode & 0o777 == 0o600
    from atroposd.weights.receiver import inspect_sync_dir

    _, version, exported, tied, _ = inspect_sync_dir(path, 7, None)
    assert version == 7 and tied == {"lm_head.weight": "w"} and "w" in str(exported)
    with pytest.raises(Exception, match="not reachable"):
        control.weight_version()

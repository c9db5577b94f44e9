"""``atroposd plot`` as a real CLI subprocess: a PNG from metrics.jsonl, clear errors otherwise."""

from __future__ import annotations

import math
from pathlib import Path

import orjson

from atroposd.plot import moving_average
from tests.support import atroposd, write_config


def _config(tmp_path: Path) -> Path:
    return write_config(tmp_path / "atroposd.toml", {"daemon": {"state_dir": str(tmp_path / "state"),
                                                                "runtime_dir": str(tmp_path / "run")}})


def test_moving_average() -> None:
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    state = tmp_path / "state"
    state.mkdir()
    lines = []
    for step in range(1, 121):
        row = {"step": step, "reward_mean": 0.1 + step / 200, "loss": math.sin(step / 10), "mean_kl": step / 1e4,
               "clipped_fraction": 0.01, "staleness": step % 3, "accuracy": None if step < 5 else step / 150}
        lines.append(orjson.dumps(row))
    (state / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n{\"step\": 121, \"loss")  # a torn last line
    out = tmp_path / "out" / "m.png"
    r = atroposd("plot", "-c", str(cfg), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_missing_or_empty_metrics_is_a_clear_error(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    r = atroposd("plot", "-c", str(cfg), "-o", str(tmp_path / "m.png"))
    assert r.returncode == 1 and "no metrics file" in r.stderr and "metrics.jsonl" in r.stderr
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "metrics.jsonl").write_text("")
    r = atroposd("plot", "-c", str(cfg), "-o", str(tmp_path / "m.png"))
    assert r.returncode == 1 and "no metrics yet" in r.stderr
    assert not (tmp_path / "m.png").exists()

"""``atroposd plot`` as a real CLI subprocess: a PNG from metrics.jsonl, clear errors otherwise."""

from __future__ import annotations

import math
from pathlib import Path

import orjson

from atroposd.plot import moving_average
from tests.support import atroposd, write_config


def _config(tmp_path: Path) -> Path:
    return write_config(
        tmp_path / "atroposd.toml",
        {"daemon": {"state_dir": str(tmp_path / "state"), "runtime_dir": str(tmp_path / "run")}},
    )


def test_moving_average() -> None:
    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    state = tmp_path / "state"
    state.mkdir()
    lines = []
    for step in range(1, 121):
        row = {
            "step": step,
            "reward_mean": 0.1 + step / 200,
            "loss": math.sin(step / 10),
            "mean_kl": step / 1e4,
            "clipped_fraction": 0.01,
            "staleness": step % 3,
            "accuracy": None if step < 5 else step / 150,
        }
        lines.append(orjson.dumps(row))
    (state / "metrics.jsonl").write_bytes(b"\n".join(lines) + b'\n{"step": 121, "loss')  # a torn last line
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


def _rows(n: int, *, reward0: float = 0.1) -> list[dict[str, object]]:
    return [
        {
            "step": s,
            "reward_mean": reward0 + s / (2 * n),
            "accuracy": s / (2 * n),
            "loss": 1 / s,
            "mean_kl": s / 1e4,
            "clipped_fraction": 0.01,
            "staleness": s % 2,
            "tokens": 600,
            "batch_wait_s": 0.05,
            "compute_s": 0.2,
            "sync_s": 0.01,
            "step_s": 0.22,
        }
        for s in range(1, n + 1)
    ]


def test_the_panels_moving_averages_and_the_time_split() -> None:
    from atroposd.plot import TIME_PANEL, Run, draw

    fig = draw([Run("only", _rows(60))])
    try:
        titles = [ax.get_title() for ax in fig.axes]
        assert len(fig.axes) == 8, titles
        assert TIME_PANEL in titles and any("tokens" in t for t in titles)
        by_title = dict(zip(titles, fig.axes, strict=True))
        staleness = next(ax for t, ax in by_title.items() if t.startswith("staleness"))
        averaged = staleness.get_lines()[-1].get_ydata()
        assert 0.3 < averaged[-1] < 0.7  # 0/1 per step; its moving average is drawn over it
        accuracy = by_title["exact-match accuracy"]
        assert any("moving average" in t.get_text() for t in accuracy.get_legend().get_texts())
        split = by_title[TIME_PANEL]
        assert [t.get_text() for t in split.get_legend().get_texts()] == ["waiting for data", "compute", "weight sync"]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_two_runs_overlay_with_a_legend(tmp_path: Path) -> None:
    for name, r0 in (("run-a", 0.1), ("run-b", 0.3)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_bytes(b"\n".join(orjson.dumps(r) for r in _rows(40, reward0=r0)))
    out = tmp_path / "both.png"
    cfg = _config(tmp_path)
    r = atroposd(
        "plot", "-c", str(cfg), str(tmp_path / "run-a"), str(tmp_path / "run-b" / "metrics.jsonl"), "-o", str(out)
    )
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000

    from atroposd.plot import Run, draw, load_rows, run_labels

    files = [tmp_path / "run-a" / "metrics.jsonl", tmp_path / "run-b" / "metrics.jsonl"]
    assert run_labels(files) == ["run-a", "run-b"]
    fig = draw([Run(label, load_rows(f)) for label, f in zip(run_labels(files), files, strict=True)])
    try:
        reward = fig.axes[0]
        assert [t.get_text() for t in reward.get_legend().get_texts()] == ["run-a", "run-b"]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_a_missing_run_is_named(tmp_path: Path) -> None:
    r = atroposd("plot", "-c", str(_config(tmp_path)), str(tmp_path / "nowhere"), "-o", str(tmp_path / "m.png"))
    assert r.returncode == 1 and str(tmp_path / "nowhere") in r.stderr

"""``atroposd plot``: metrics.jsonl → one PNG: reward, accuracy and staleness with their moving
averages, loss, KL, clipped fraction, where each step's time went (waiting for data, compute,
weight sync) and the trained tokens per second; a rollback after a collapse (SPEC §15) is a
dashed red line at its step in every panel. Several runs (state dirs or metrics files)
overlay, one colour each, with a legend. Needs matplotlib (the ``plot`` extra); drawn with the
Agg backend, so no display is needed."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from atroposd.exitcodes import Exit

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from atroposd.config import Config

__all__ = ["Run", "draw", "main", "moving_average", "plot_metrics", "plot_runs", "rollback_steps"]


# (title, metric key): each panel draws the moving average over the faint per-step values
# (staleness is 0/1 step to step: its raw line alone is a solid block; loss and KL are noisy).
PANELS: tuple[tuple[str, str], ...] = (
    ("reward", "reward_mean"),
    ("exact-match accuracy", "accuracy"),
    ("loss", "loss"),
    ("KL to reference (k3)", "mean_kl"),
    ("clipped fraction", "clipped_fraction"),
    ("staleness (weight versions)", "staleness"),
)
TIME_PANEL = "time per step (s, moving average)"
THROUGHPUT_PANEL = "trained tokens / s (moving average)"
# The parts of a step's time: metrics key, legend label, line style when several runs overlay.
TIME_PARTS = (("batch_wait_s", "waiting for data", "--"), ("compute_s", "compute", "-"), ("sync_s", "weight sync", ":"))


class PlotError(Exception):
    pass


@dataclass
class Run:
    """One run's rows and its label in the legend."""

    label: str
    rows: list[dict[str, Any]]


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` points (the first points average what exists)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def window_for(n: int) -> int:
    """The moving-average window for ``n`` steps: about a tenth of the run, 5 to 50 steps."""
    return max(1, min(n, max(5, min(50, n // 10))))


def _number(v: object) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if _number(v) and isinstance(r.get("step"), int):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def rollback_steps(rows: Sequence[dict[str, Any]]) -> list[int]:
    """The first step after each rollback: where ``rollbacks`` grows (counts kept across
    restarts, so a run resumed after one is not marked again)."""
    out, before = [], None
    for r in rows:
        n, step = r.get("rollbacks"), r.get("step")
        if not isinstance(n, int) or isinstance(n, bool) or not isinstance(step, int):
            continue
        if before is not None and n > before:
            out.append(step)
        before = n
    return out


def _throughput(rows: Sequence[dict[str, Any]]) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        wall = sum(float(r[k]) for k in ("batch_wait_s", "step_s") if _number(r.get(k)))
        if _number(r.get("tokens")) and wall > 0 and isinstance(r.get("step"), int):
            xs.append(r["step"])
            ys.append(float(r["tokens"]) / wall)
    return xs, ys


def draw(runs: Sequence[Run], *, title: str = "") -> Figure:
    """The figure: the learning panels, the per-step time split and the throughput; one colour
    per run, with a legend when several runs overlay. Raises PlotError without matplotlib."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotError("atroposd plot needs matplotlib: pip install 'atroposd[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 2, figsize=(13, 13), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    several = len(runs) > 1
    flat = list(axes.flat)
    for ax, (name, key) in zip(flat, PANELS, strict=False):
        ax.set_title(name)
        drawn = False
        ranges: list[tuple[float, float]] = []
        for i, run in enumerate(runs):
            xs, ys = _series(run.rows, key)
            if not xs:
                continue
            drawn = True
            color = colors[i % len(colors)]
            window = window_for(len(run.rows))
            ax.plot(xs, ys, color=color, alpha=0.15 if several else 0.25, linewidth=0.8)
            label = run.label if several else f"moving average ({window} steps)"
            smooth = moving_average(ys, window)
            ax.plot(xs, smooth, color=color, linewidth=1.6, label=label)
            ranges.append(_robust_range(ys, smooth))
        if ranges:  # a rare spike in the raw values must not flatten the curves
            low, high = min(r[0] for r in ranges), max(r[1] for r in ranges)
            pad = (high - low) * 0.05 or 0.05
            ax.set_ylim(low - pad, high + pad)
        _finish_panel(ax, drawn, legend=True)
    _time_split(flat[6], runs, colors)
    ax = flat[7]
    ax.set_title(THROUGHPUT_PANEL)
    drawn = False
    for i, run in enumerate(runs):
        xs, ys = _throughput(run.rows)
        if xs:
            drawn = True
            ax.plot(
                xs,
                moving_average(ys, window_for(len(run.rows))),
                color=colors[i % len(colors)],
                linewidth=1.4,
                label=run.label,
            )
    _finish_panel(ax, drawn, legend=several)
    for i, run in enumerate(runs):  # rollbacks: a dashed line at the first step after each
        for n, step in enumerate(rollback_steps(run.rows)):
            for panel in flat:
                panel.axvline(
                    step,
                    color="tab:red" if not several else colors[i % len(colors)],
                    linestyle="--",
                    linewidth=1.0,
                    alpha=0.8,
                    label="rollback" if n == 0 and panel is flat[0] else None,
                )
        if rollback_steps(run.rows) and not several:
            flat[0].legend(loc="best", fontsize="small")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _time_split(ax: Axes, runs: Sequence[Run], colors: Sequence[str]) -> None:
    """Where each step's time went. One run: stacked areas; several: a line per part and run."""
    ax.set_title(TIME_PANEL)
    drawn = False
    if len(runs) == 1:
        rows = runs[0].rows
        window = window_for(len(rows))
        steps = [r["step"] for r in rows if isinstance(r.get("step"), int)]
        parts = []
        for key, label, _style in TIME_PARTS:
            values = [float(r[key]) if _number(r.get(key)) else 0.0 for r in rows if isinstance(r.get("step"), int)]
            if any(values):
                parts.append((label, moving_average(values, window)))
        if parts and steps:
            drawn = True
            ax.stackplot(steps, *[v for _, v in parts], labels=[label for label, _ in parts], alpha=0.8)
            totals = [sum(v) for v in zip(*[v for _, v in parts], strict=True)]
            _clip_start(ax, [totals], window)
    else:
        shown: list[list[float]] = []
        for i, run in enumerate(runs):
            window = window_for(len(run.rows))
            for key, label, style in TIME_PARTS:
                xs, ys = _series(run.rows, key)
                if xs:
                    drawn = True
                    smooth = moving_average(ys, window)
                    shown.append(smooth[window:])
                    ax.plot(
                        xs,
                        smooth,
                        color=colors[i % len(colors)],
                        linestyle=style,
                        linewidth=1.2,
                        label=f"{run.label}: {label}",
                    )
        _clip_start(ax, shown, 0)
    _finish_panel(ax, drawn, legend=True)


def _robust_range(raw: Sequence[float], smooth: Sequence[float]) -> tuple[float, float]:
    """The y range that shows the moving average and all but the rarest raw values (0.5 %)."""
    ordered = sorted(raw)
    cut = len(ordered) // 200
    kept = ordered[cut : len(ordered) - cut] or ordered
    return min(kept[0], min(smooth)), max(kept[-1], max(smooth))


def _clip_start(ax: Axes, series: Sequence[Sequence[float]], skip: int) -> None:
    """Scale the y axis to the values after the first ``skip`` steps (the start-up steps, a
    model load or a first compile, would flatten the rest)."""
    tops = [max(s[skip:]) for s in series if len(s) > skip]
    if tops and max(tops) > 0:
        ax.set_ylim(0, max(tops) * 1.15)


def _finish_panel(ax: Axes, drawn: bool, *, legend: bool) -> None:
    ax.grid(alpha=0.3)
    if not drawn:
        ax.text(0.5, 0.5, "not reported", ha="center", va="center", transform=ax.transAxes, color="gray")
    elif legend:
        ax.legend(loc="best", fontsize=7)


def plot_runs(runs: Sequence[Run], output: Path, *, title: str = "") -> Path:
    """Draw ``runs`` to ``output`` (PNG); raises PlotError on bad input."""
    import matplotlib.pyplot as plt

    fig = draw(runs, title=title)
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(output, dpi=100)
    except OSError as exc:
        raise PlotError(f"cannot write {output}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)
    return output


def plot_metrics(rows: Sequence[dict[str, Any]], output: Path, *, title: str = "") -> Path:
    """One run's rows to ``output`` (PNG)."""
    return plot_runs([Run("", list(rows))], output, title=title)


def metrics_path(run: Path) -> Path:
    """A run given as a state dir or a metrics file."""
    return run / "metrics.jsonl" if run.is_dir() else run


def run_labels(paths: Sequence[Path]) -> list[str]:
    """Short legend labels: a state dir's name (the parent's, for a metrics.jsonl), the full
    path where two would read the same."""
    short = [(p.parent.name if p.name == "metrics.jsonl" else p.stem) or str(p) for p in paths]
    return [str(p) if short.count(s) > 1 else s for s, p in zip(short, paths, strict=True)]


def load_rows(path: Path) -> list[dict[str, Any]]:
    from atroposd.trainer.metrics import read_metrics

    if not path.is_file():
        raise PlotError(f"no metrics file at {path} (the trainer writes it once it has trained a step)")
    try:
        rows = read_metrics(path)
    except OSError as exc:
        raise PlotError(f"cannot read {path}: {exc.strerror or exc}") from exc
    rows = [r for r in rows if isinstance(r.get("step"), int)]
    if not rows:
        raise PlotError(f"{path} holds no metrics yet (no step has been trained)")
    return rows


def main(cfg: Config, args: argparse.Namespace) -> int:
    """The ``atroposd plot`` command: 0 when the PNG is written, 1 with a clear message if not.

    ``RUN ...`` (state dirs or metrics files) overlays several runs; without, the config's run."""
    from atroposd.paths import Paths

    paths = Paths.of(cfg)
    given = [Path(r) for r in getattr(args, "runs", None) or []]
    if getattr(args, "metrics", None):
        given.append(Path(args.metrics))
    files = [metrics_path(p) for p in given] or [paths.metrics_file]
    default_out = paths.state_dir / "metrics.png" if not given else Path("metrics.png")
    output = Path(getattr(args, "output", None) or default_out)
    try:
        runs = [Run(label, load_rows(f)) for label, f in zip(run_labels(files), files, strict=True)]
        if len(runs) == 1:
            title = f"{files[0]} — {len(runs[0].rows)} steps"
        else:
            title = " vs ".join(f"{r.label} ({len(r.rows)} steps)" for r in runs)
        plot_runs(runs, output, title=title)
    except PlotError as exc:
        print(f"atroposd plot: {exc}", file=sys.stderr)
        return Exit.RUNTIME
    print(output)
    return Exit.OK

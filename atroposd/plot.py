"""``atroposd plot``: metrics.jsonl → one PNG (reward with its moving average, accuracy, loss,
KL, clipped fraction, staleness over the steps). Needs matplotlib (the ``plot`` extra); drawn
with the Agg backend, so no display is needed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atroposd.exitcodes import Exit

if TYPE_CHECKING:
    from atroposd.config import Config

__all__ = ["main", "moving_average", "plot_metrics"]


# (title, metric keys drawn on the panel)
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward_mean",)),
    ("exact-match accuracy", ("accuracy",)),
    ("loss", ("loss",)),
    ("KL to reference (k3)", ("mean_kl",)),
    ("clipped fraction", ("clipped_fraction",)),
    ("staleness (steps)", ("staleness",)),
)


class PlotError(Exception):
    pass


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` points (the first points average what exists)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(r.get("step"), int):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def plot_metrics(rows: Sequence[dict[str, Any]], output: Path, *, title: str = "") -> Path:
    """Draw the panels to ``output`` (PNG); raises PlotError on bad input."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotError("atroposd plot needs matplotlib: pip install 'atroposd[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(12, 10), sharex=True)
    window = max(1, min(50, len(rows) // 20 or 1))
    for ax, (name, keys) in zip(axes.flat, PANELS, strict=True):
        ax.set_title(name)
        ax.grid(alpha=0.3)
        drawn = False
        for key in keys:
            xs, ys = _series(rows, key)
            if not xs:
                continue
            drawn = True
            if key == "reward_mean":
                ax.plot(xs, ys, color="tab:blue", alpha=0.3, linewidth=0.8, label="per step")
                ax.plot(xs, moving_average(ys, window), color="tab:blue", label=f"moving average ({window})")
                ax.legend(loc="best", fontsize=8)
            else:
                ax.plot(xs, ys, linewidth=1.0)
        if not drawn:
            ax.text(0.5, 0.5, "not reported", ha="center", va="center", transform=ax.transAxes, color="gray")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(output, dpi=100)
    except OSError as exc:
        raise PlotError(f"cannot write {output}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)
    return output


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
    """The ``atroposd plot`` command: 0 when the PNG is written, 1 with a clear message if not."""
    from atroposd.paths import Paths

    paths = Paths.of(cfg)
    metrics = Path(getattr(args, "metrics", None) or paths.metrics_file)
    output = Path(getattr(args, "output", None) or paths.state_dir / "metrics.png")
    try:
        rows = load_rows(metrics)
        plot_metrics(rows, output, title=f"{metrics} — {len(rows)} steps")
    except PlotError as exc:
        print(f"atroposd plot: {exc}", file=sys.stderr)
        return Exit.RUNTIME
    print(output)
    return Exit.OK

"""Learning curve of a run as a PNG (episode return, route completion, driving score vs samples).

    python scripts/plot_curves.py runs/quick-20250101-120000 [-o curve.png]

Reads the TensorBoard event files under ``<run dir>/tb`` with tensorboard's EventAccumulator and draws with
matplotlib (Agg, no display): one panel per metric, training curve and, where present, evaluation points.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

PANELS = [
    ("episode return", "charts/episode_return", "eval/return"),
    ("route completion (%)", "charts/episode_route_completion", "eval/route_completion"),
    ("driving score", "charts/episode_driving_score", "eval/driving_score"),
]
TRAIN_COLOUR, EVAL_COLOUR = "#1f77b4", "#d62728"
W, H = 9.0, 2.6  # inches per panel (100 dpi: 900 x 260 pixels)


def load_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """All scalar series of the run (tag -> [(step, value)], sorted, later events win on duplicate steps)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir = run_dir / "tb" if (run_dir / "tb").is_dir() else run_dir
    if not any(tb_dir.glob("events.out.tfevents*")):
        raise SystemExit(f"no TensorBoard event files in {tb_dir}")
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    series = {}
    for tag in acc.Tags()["scalars"]:
        by_step = {e.step: e.value for e in acc.Scalars(tag)}
        series[tag] = sorted(by_step.items())
    return series


def fmt(v: float, _pos: object = None) -> str:
    """Tick label: 1.5M, 250k, 12."""
    if abs(v) >= 1e6:
        return f"{v / 1e6:g}M"
    if abs(v) >= 1e3:
        return f"{v / 1e3:g}k"
    return f"{v:g}"


def draw_panel(ax: Any, title: str, lines: list[tuple[str, list[tuple[int, float]], str]]) -> None:
    """One metric: each (label, [(step, value)], colour) as a line (with markers when it has few points)."""
    ax.set_title(title, loc="left", fontsize=9)
    ax.grid(color="0.9")
    drawn = False
    for label, pts, colour in lines:
        pts = [(s, v) for s, v in pts if math.isfinite(v)]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, color=colour, linewidth=1.5, marker="o" if len(pts) < 40 else None, markersize=3,
                    label=label)
            drawn = True
    if drawn:
        ax.legend(loc="best", fontsize=7)
    else:
        ax.text(0.02, 0.85, "no data", transform=ax.transAxes, color="0.5", fontsize=8)


def plot(run_dir: Path, out: Path) -> Path:
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    series = load_scalars(run_dir)
    steps = [s for tag, pts in series.items() for s, _ in pts if tag.startswith(("charts/", "eval/"))]
    fig = Figure(figsize=(W, H * len(PANELS) + 0.3), dpi=100, layout="constrained")
    axes = fig.subplots(len(PANELS), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, train_tag, eval_tag) in zip(axes, PANELS):
        draw_panel(ax, title, [("train", series.get(train_tag, []), TRAIN_COLOUR),
                               ("eval (mean)", series.get(eval_tag, []), EVAL_COLOUR)])
        ax.yaxis.set_major_formatter(FuncFormatter(fmt))
    axes[-1].set_xlim(0.0, float(max(steps) if steps else 1))
    axes[-1].xaxis.set_major_formatter(FuncFormatter(fmt))
    axes[-1].set_xlabel("samples (env steps)")
    fig.suptitle(str(run_dir)[-60:], fontsize=8, color="0.45", x=0.99, ha="right")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("-o", "--output", type=Path, help="default: <run dir>/curve.png")
    args = parser.parse_args()
    if not args.run_dir.is_dir():
        sys.exit(f"{args.run_dir} is not a directory")
    print(plot(args.run_dir, args.output or args.run_dir / "curve.png"))


if __name__ == "__main__":
    main()

"""Learning curve of a run as a PNG (episode return, route completion, driving score vs samples).

    python scripts/plot_curves.py runs/quick-20250101-120000 [-o curve.png]

Reads the TensorBoard event files under ``<run dir>/tb`` with tensorboard's EventAccumulator and draws with PIL
(matplotlib is not a dependency): one panel per metric, training curve and, where present, evaluation points.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

PANELS = [
    ("episode return", "charts/episode_return", "eval/return"),
    ("route completion (%)", "charts/episode_route_completion", "eval/route_completion"),
    ("driving score", "charts/episode_driving_score", "eval/driving_score"),
]
TRAIN_COLOUR, EVAL_COLOUR = (31, 119, 180), (214, 39, 40)
W, H, PAD_L, PAD_R, PAD_T, PAD_B = 900, 260, 70, 20, 30, 40


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


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=10 * mag)
    start = math.ceil(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step) + 1)]


def fmt(v: float) -> str:
    if abs(v) >= 1e6:
        return f"{v / 1e6:g}M"
    if abs(v) >= 1e3:
        return f"{v / 1e3:g}k"
    return f"{v:g}"


def draw_panel(draw: ImageDraw.ImageDraw, top: int, title: str, lines: list[tuple[str, list[tuple[int, float]], tuple]],
               x_range: tuple[float, float], font: ImageFont.ImageFont) -> None:
    x0, x1, y0, y1 = PAD_L, W - PAD_R, top + PAD_T, top + H - PAD_B
    values = [v for _, pts, _ in lines for _, v in pts if math.isfinite(v)]
    draw.text((PAD_L, top + 8), title, fill=(0, 0, 0), font=font)
    draw.rectangle([x0, y0, x1, y1], outline=(0, 0, 0))
    if not values:
        draw.text((x0 + 10, y0 + 10), "no data", fill=(120, 120, 120), font=font)
        return
    lo, hi = min(values), max(values)
    if hi - lo < 1e-9:
        lo, hi = lo - 1, hi + 1
    margin = 0.05 * (hi - lo)
    lo, hi = lo - margin, hi + margin
    sx = lambda s: x0 + (s - x_range[0]) / max(x_range[1] - x_range[0], 1e-9) * (x1 - x0)  # noqa: E731
    sy = lambda v: y1 - (v - lo) / (hi - lo) * (y1 - y0)  # noqa: E731
    for t in nice_ticks(lo, hi):
        y = sy(t)
        draw.line([x0, y, x1, y], fill=(230, 230, 230))
        draw.line([x0 - 4, y, x0, y], fill=(0, 0, 0))
        draw.text((5, y - 6), fmt(t), fill=(0, 0, 0), font=font)
    for t in nice_ticks(*x_range):
        x = sx(t)
        draw.line([x, y1, x, y1 + 4], fill=(0, 0, 0))
        draw.text((x - 10, y1 + 6), fmt(t), fill=(0, 0, 0), font=font)
    legend_x = x1 - 150
    for i, (label, pts, colour) in enumerate(lines):
        pts = [(s, v) for s, v in pts if math.isfinite(v)]
        xy = [(sx(s), sy(v)) for s, v in pts]
        if len(xy) > 1:
            draw.line(xy, fill=colour, width=2)
        for x, y in xy if len(xy) < 40 else []:
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
        if pts:
            ly = y0 + 8 + 14 * i
            draw.line([legend_x, ly + 6, legend_x + 20, ly + 6], fill=colour, width=3)
            draw.text((legend_x + 26, ly), label, fill=(0, 0, 0), font=font)


def plot(run_dir: Path, out: Path) -> Path:
    series = load_scalars(run_dir)
    steps = [s for tag, pts in series.items() for s, _ in pts if tag.startswith(("charts/", "eval/"))]
    x_range = (0.0, float(max(steps) if steps else 1))
    img = Image.new("RGB", (W, H * len(PANELS) + 30), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    for i, (title, train_tag, eval_tag) in enumerate(PANELS):
        lines = [("train", series.get(train_tag, []), TRAIN_COLOUR), ("eval (mean)", series.get(eval_tag, []), EVAL_COLOUR)]
        draw_panel(draw, i * H, title, lines, x_range, font)
    draw.text((W // 2 - 60, H * len(PANELS) + 8), "samples (env steps)", fill=(0, 0, 0), font=font)
    draw.text((W - 300, H * len(PANELS) + 8), str(run_dir)[-45:], fill=(120, 120, 120), font=font)
    out.parent.mkdir(parents=True, exist_ok=True)
    img.save(out)
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

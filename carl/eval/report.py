"""Reports of a carl-eval run: ``summary.md`` / ``summary.csv`` tables (one row per policy), the PIL charts
(``score_per_route.png``, ``infractions.png``) and BEV videos of the worst routes (``videos/<route>.gif``)."""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any, Callable

import torch

from carl.eval.benchmarks import Benchmark
from carl.eval.loop import make_group_env
from carl.eval.policies import PolicySource
from envs.metrics.leaderboard import LB_INFRACTION_KEYS

TABLE_COLUMNS = ("policy", "routes", "driving_score", "route_completion", "infraction_score", "km")
# Reward-shaping counters of the simulator (speeding, ttc, comfort) are not Leaderboard infractions: they stay in
# summary.json but not in the tables and plots.
TABLE_INFRACTIONS = tuple(LB_INFRACTION_KEYS)


def table_rows(summaries: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Header and rows: the main columns, then infractions per km of every type seen in any summary."""
    kinds = [k for k in TABLE_INFRACTIONS if any(k in s.get("infractions_per_km", {}) for s in summaries.values())]
    header = [*TABLE_COLUMNS, *(f"{k}/km" for k in kinds)]
    cls = any(s.get("closed_loop_score") is not None for s in summaries.values())  # Val14 (nuPlan)
    if cls:
        header.insert(2, "nuplan_cls")

    def fmt(v: Any, digits: int = 2) -> str:
        return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{digits}f}"

    rows = []
    for name, s in summaries.items():
        rows.append([name, f"{s['routes']}/{s['routes_total']}", fmt(s["driving_score"]), fmt(s["route_completion"]),
                     fmt(s["infraction_score"], 3), fmt(s["km"])]
                    + [fmt(s.get("infractions_per_km", {}).get(k), 3) for k in kinds])
        if cls:
            rows[-1].insert(2, fmt(s.get("closed_loop_score")))
    return header, rows


def write_tables(summaries: dict[str, dict[str, Any]], out_dir: Path, title: str) -> None:
    """``summary.md`` and ``summary.csv``: one row per policy."""
    header, rows = table_rows(summaries)
    md = [f"# {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    (out_dir / "summary.md").write_text("\n".join(md) + "\n")
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(header)
    writer.writerows(rows)
    (out_dir / "summary.csv").write_text(buf.getvalue())


def _font() -> Any:
    from PIL import ImageFont

    return ImageFont.load_default()


def plot_scores(records: list[dict[str, Any]], path: Path, title: str) -> None:
    """Bar chart: route completion (light) and driving score (dark) per route, by group and route number."""
    from PIL import Image, ImageDraw

    def number(r: dict[str, Any]) -> int:  # route ids end in their number (Town01_3, ..._rand7919_12)
        tail = str(r["route_id"]).rsplit("_", 1)[-1]
        return int(tail) if tail.isdigit() else int(r["carl"]["route_index"])

    recs = sorted(records, key=lambda r: (r["carl"]["group"], number(r)))
    n = max(len(recs), 1)
    bar = max(6, min(24, 900 // n))
    left, top, bottom, right = 40, 30, 40, 20
    w, h = left + right + n * bar, 320
    img = Image.new("RGB", (max(w, 560), h), "white")
    d = ImageDraw.Draw(img)
    font = _font()
    ph = h - top - bottom
    for v in (0, 25, 50, 75, 100):
        y = top + ph - ph * v / 100
        d.line([(left, y), (left + n * bar, y)], fill=(220, 220, 220))
        d.text((4, y - 6), f"{v:3d}", fill="black", font=font)
    for i, r in enumerate(recs):
        x = left + i * bar
        for key, colour in (("score_route", (170, 200, 235)), ("score_composed", (30, 90, 170))):
            v = max(0.0, min(100.0, r["scores"][key]))
            d.rectangle([x + 1, top + ph - ph * v / 100, x + bar - 2, top + ph], fill=colour)
        if bar >= 12 or i % max(1, 12 // bar) == 0:
            d.text((x + 1, top + ph + 4), str(number(r)), fill="black", font=font)
    d.text((left, 8), f"{title}: driving score (dark) and route completion (light) per route", fill="black", font=font)
    d.text((left, h - 16), "route id (grouped by town)", fill=(90, 90, 90), font=font)
    img.save(path)


def plot_infractions(summary: dict[str, Any], path: Path, title: str) -> None:
    """Horizontal bars: infractions per km driven, by type."""
    from PIL import Image, ImageDraw

    items = [(k, v) for k, v in summary.get("infractions_per_km", {}).items() if k in TABLE_INFRACTIONS]
    font = _font()
    row, left, width = 20, 150, 360
    img = Image.new("RGB", (left + width + 80, 40 + row * max(len(items), 1)), "white")
    d = ImageDraw.Draw(img)
    d.text((8, 8), f"{title}: infractions per km ({summary['km']:.2f} km driven)", fill="black", font=font)
    top = max([v for _, v in items if v is not None] + [1e-9])
    for i, (name, v) in enumerate(items):
        y = 30 + i * row
        d.text((8, y + 3), name, fill="black", font=font)
        v = v or 0.0
        d.rectangle([left, y + 2, left + width * v / top, y + row - 4], fill=(200, 70, 60))
        d.text((left + width * v / top + 4, y + 3), f"{v:.3f}", fill="black", font=font)
    img.save(path)


def record_worst(records: list[dict[str, Any]], bench: Benchmark, policy: PolicySource, device: torch.device,
                 seed: int, count: int, max_frames: int, out_dir: Path, log: Callable[[str], None]) -> list[Path]:
    """Re-drive the ``count`` lowest-scoring routes with the BEV on and save annotated GIFs (sim backends only).

    The route is re-driven alone (one row), so traffic may differ from the evaluated episode."""
    if count <= 0 or bench.env != "sim":
        return []
    from PIL import Image

    from envs.sim.recorder import record_episode

    groups = {g.name: g for g in bench.groups}
    worst = sorted(records, key=lambda r: (r["scores"]["score_composed"], r["scores"]["score_route"]))[:count]
    paths = []
    (out_dir / "videos").mkdir(parents=True, exist_ok=True)
    for r in worst:
        group = groups[r["carl"]["group"]]
        idx = int(r["carl"]["route_index"]) - group.first_route  # the row that drove it
        extra = {**policy.env_options(), "bev": True}
        env = make_group_env(group, idx + 1, device, seed, extra)  # rows 0..idx; row idx drives that route
        try:
            frames, stats = record_episode(env, policy.make(env, group.env), row=idx, max_steps=max_frames,
                                           scale=max(1, 256 // env.cfg.bev_size))  # frames >= 256 px
        finally:
            env.close()
        if not frames:
            continue
        path = out_dir / "videos" / f"{r['route_id']}.gif"
        images = [Image.fromarray(f) for f in frames]
        images[0].save(path, save_all=True, append_images=images[1:], duration=100, loop=0, optimize=False)
        paths.append(path)
        end = (f"DS {stats['driving_score']:.1f} when re-driven" if "driving_score" in stats
               else f"cut at video_max_frames={max_frames}")
        log(f"  video {path} ({len(frames)} frames, {end})")
    return paths

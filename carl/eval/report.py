"""Reports of a carl-eval run: ``summary.md`` / ``summary.csv`` tables (one row per policy), the matplotlib charts
(``score_per_route.png``, ``infractions.png``; Agg, no display) and BEV videos of the worst routes
(``videos/<route>.gif``, PIL)."""
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


SCENARIO_COLUMNS = ("total", "skipped", "triggered", "passed", "collided", "timed_out", "preempted", "not_reached")


def scenario_tables(summaries: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown lines: per policy, each town's scores and each scenario type's outcomes with the mean scores of the
    routes that carry it (when the benchmark played scenarios)."""
    md = []
    for name, s in summaries.items():
        if s.get("groups"):
            md += ["", f"## {name}: per town", "", "| town | routes | DS | RC | IS |", "|---|---|---|---|---|"]
            md += [f"| {g} | {v['routes']} | {v['driving_score']:.2f} | {v['route_completion']:.2f} | "
                   f"{v['infraction_score']:.3f} |" for g, v in s["groups"].items()]
        if s.get("scenarios"):
            md += ["", f"## {name}: per scenario type", "",
                   "| type | routes | " + " | ".join(SCENARIO_COLUMNS) + " | DS | RC | IS |",
                   "|---|---|" + "---|" * (len(SCENARIO_COLUMNS) + 3)]
            md += [f"| {k} | {v['routes']} | " + " | ".join(str(v.get(c, 0)) for c in SCENARIO_COLUMNS)
                   + f" | {v['driving_score']:.2f} | {v['route_completion']:.2f} | {v['infraction_score']:.3f} |"
                   for k, v in s["scenarios"].items()]
    return md


def ds_lost_table(summaries: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown lines: DS points lost per cause (rows), one column per policy; with the DS each column sums to
    100."""
    names = [n for n, s in summaries.items() if s.get("ds_lost") is not None]
    causes = list(dict.fromkeys(c for n in names for c in summaries[n]["ds_lost"]))
    if not causes:
        return []
    md = ["", "## DS lost per cause", "",
          "Points of 100 per route, averaged over the routes: the route completion missed (by why the route ended) "
          "and RC x (1 - IS) shared among the penalties by the logarithm of their factors. With the DS each column "
          "sums to 100.", "", "| cause | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    md += [f"| {c} | " + " | ".join(f"{summaries[n]['ds_lost'].get(c, 0.0):.2f}" for n in names) + " |"
           for c in causes]
    md.append("| driving score | " + " | ".join(f"{summaries[n]['driving_score']:.2f}" for n in names) + " |")
    return md


def repetition_lines(summaries: dict[str, dict[str, Any]]) -> list[str]:
    """One line per policy whose routes were driven several times: DS per repetition and the spreads."""
    lines = []
    for name, s in summaries.items():
        rep = s.get("repetitions")
        if rep:
            ds = rep["driving_score"]
            lines.append(f"{name}: {rep['count']} repetitions (traffic seed {s.get('seed', 0)} + k): DS per repetition "
                         + " / ".join(f"{v:.2f}" for v in ds["per_repetition"])
                         + f", sd over repetitions {ds['sd_over_repetitions']:.2f}; a route's DS moves by "
                         f"{ds['mean_route_sd']:.2f} (mean sd over routes)")
    return ["", *lines] if lines else []


def write_tables(summaries: dict[str, dict[str, Any]], out_dir: Path, title: str) -> None:
    """``summary.md`` and ``summary.csv``: one row per policy."""
    header, rows = table_rows(summaries)
    md = [f"# {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    md += repetition_lines(summaries)
    md += ds_lost_table(summaries)
    md += scenario_tables(summaries)
    (out_dir / "summary.md").write_text("\n".join(md) + "\n")
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(header)
    writer.writerows(rows)
    (out_dir / "summary.csv").write_text(buf.getvalue())


def _figure(width_in: float, height_in: float) -> Any:
    """A matplotlib Figure drawn by the Agg canvas (no pyplot state, no display needed)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width_in, height_in), dpi=100, layout="constrained")


def plot_scores(records: list[dict[str, Any]], path: Path, title: str) -> None:
    """Bar chart: route completion (light) and driving score (dark) per route, by group and route number."""

    def number(r: dict[str, Any]) -> int:  # route ids end in their number (Town01_3, ..._rand7919_12)
        tail = str(r["route_id"]).rsplit("_", 1)[-1]
        return int(tail) if tail.isdigit() else int(r["carl"]["route_index"])

    recs = sorted(records, key=lambda r: (r["carl"]["group"], number(r)))
    n = max(len(recs), 1)
    fig = _figure(max(5.6, min(24.0, 1.2 + 0.16 * n)), 3.4)
    ax = fig.add_subplot()
    x = list(range(len(recs)))
    clip = lambda v: max(0.0, min(100.0, float(v)))  # noqa: E731
    ax.bar(x, [clip(r["scores"]["score_route"]) for r in recs], width=0.8, color="#aac8eb",
           label="route completion")
    ax.bar(x, [clip(r["scores"]["score_composed"]) for r in recs], width=0.8, color="#1e5aaa", label="driving score")
    step = max(1, -(-n // 60))  # at most ~60 tick labels
    ax.set_xticks(x[::step], [str(number(r)) for r in recs][::step], fontsize=7)
    groups = [r["carl"]["group"] for r in recs]
    for i in range(1, len(groups)):  # a line between groups (towns), each named above its routes
        if groups[i] != groups[i - 1]:
            ax.axvline(i - 0.5, color="0.6", linewidth=0.8)
    starts = [i for i in range(len(groups)) if i == 0 or groups[i] != groups[i - 1]]
    if len(starts) > 1:
        for i, j in zip(starts, starts[1:] + [len(groups)]):
            ax.text((i + j - 1) / 2, 101, str(groups[i]), ha="center", va="bottom", fontsize=7, color="0.3")
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylim(0, 100)
    ax.set_yticks([0, 25, 50, 75, 100])
    ax.grid(axis="y", color="0.88")
    ax.set_axisbelow(True)
    ax.set_xlabel("route id (grouped by town)")
    ax.set_title(f"{title}: driving score (dark) and route completion (light) per route", fontsize=9,
                 pad=14 if len(starts) > 1 else 6)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    fig.savefig(path)


def plot_infractions(summary: dict[str, Any], path: Path, title: str) -> None:
    """Horizontal bars: infractions per km driven, by type."""
    items = [(k, v or 0.0) for k, v in summary.get("infractions_per_km", {}).items() if k in TABLE_INFRACTIONS]
    fig = _figure(6.0, 1.0 + 0.28 * max(len(items), 1))
    ax = fig.add_subplot()
    names = [k for k, _ in items]
    values = [v for _, v in items]
    bars = ax.barh(range(len(items)), values, color="#c8463c")
    ax.bar_label(bars, [f"{v:.3f}" for v in values], padding=3, fontsize=7)
    ax.set_yticks(range(len(items)), names, fontsize=7)
    ax.invert_yaxis()  # first type on top, as in the tables
    ax.set_xlim(0, 1.18 * max(values, default=0.0) or 1.0)
    if not items:
        ax.text(0.5, 0.5, "no infraction types recorded", ha="center", va="center", transform=ax.transAxes,
                fontsize=8, color="0.4")
    ax.set_xlabel("per km", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(f"{title}: infractions per km ({summary['km']:.2f} km driven)", fontsize=9)
    fig.savefig(path)


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

"""``carl-compare A B``: two evaluations of the same benchmark, route by route (a paired comparison).

Two policies driven on the same routes with the same traffic seed differ far less between themselves than either
differs from its own mean over routes: longest6's 36 routes give a standard error of ~5 DS for one policy's score,
while the paired difference of two similar policies is often known to +-2. The tool matches the routes of two
``carl-eval`` folders, averages each route over its repetitions (``benchmark.repetitions``), and reports for DS, RC
and IS the mean difference B - A, its 95 % interval (Student's t over routes), the routes B won and lost and a sign
test; then the difference per route group (town), per cause of lost DS, per scenario outcome, and the routes that
moved most.

    carl-compare runs/eval/longest6-a runs/eval/longest6-b
    carl-compare a/results.json b/results.json --out runs/eval/a_vs_b   # also a_vs_b/compare.md and .json

The interval covers the evaluation's noise only (which routes, which traffic), for these two checkpoints: two
training runs of one recipe differ by their seed too, which only more training seeds measure (docs/evaluation.md).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from scipy import stats

from carl.eval import EvalError
from carl.eval.report import SCENARIO_COLUMNS
from carl.eval.store import SUMMARY_SCORES, mean_std, read_results, write_result
from envs.metrics.leaderboard import ds_lost

TIE = 1e-6  # |B - A| at most this: the route is a tie (scores are rounded to 1e-6 in the records)
MOVED = 5  # routes listed each way in "the routes that moved most"


def load_records(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A ``carl-eval`` folder's (or ``results.json``'s) identity block and route records."""
    path = Path(path)
    file = path / "results.json" if path.is_dir() else path
    if not file.is_file():
        raise EvalError(f"{path}: no carl-eval results here (expected {file}); name a carl-eval out_dir or its "
                        "results.json")
    data = read_results(file)
    records = data["_checkpoint"]["records"]
    if not records:
        raise EvalError(f"{file} holds no finished route yet; run carl-eval to the end (re-running it resumes)")
    return data.get("carl") or {}, records


def _route_key(r: dict[str, Any]) -> tuple[str, int]:
    return r["carl"]["group"], int(r["carl"]["route_index"])


def per_route(records: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """Each route's scores, DS lost per cause and scenario outcomes, averaged (counts: summed) over its repetitions;
    ``name`` is the route id without the repetition suffix."""
    reps: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        reps.setdefault(_route_key(r), []).append(r)
    out = {}
    for key, rs in reps.items():
        lost: dict[str, float] = {}
        outcomes: dict[str, dict[str, int]] = {}
        for r in rs:
            for cause, points in ds_lost(r["carl"]["episode"]).items():
                lost[cause] = lost.get(cause, 0.0) + points / len(rs)
            for kind, counts in r.get("scenarios", {}).items():
                agg = outcomes.setdefault(kind, {})
                for c in SCENARIO_COLUMNS:
                    agg[c] = agg.get(c, 0) + int(counts.get(c, 0))
        name = str(rs[0]["route_id"]).removesuffix(f"_rep{rs[0]['carl'].get('repetition', 0)}")
        out[key] = {"name": name, "repetitions": len(rs), "ds_lost": lost,
                    "scenarios": outcomes, "ends": sorted({r["meta"].get("termination", "?") for r in rs}),
                    **{score: mean_std([r["scores"][score] for r in rs])[0] for _, score in SUMMARY_SCORES}}
    return out


def paired(a: list[float], b: list[float]) -> dict[str, float]:
    """B - A over paired values: the means, the mean difference with its sd and 95 % t interval, the pairs B won,
    lost and tied, and the two-sided sign test's p over the pairs that differ."""
    n = len(a)
    diffs = [y - x for x, y in zip(a, b)]
    mean, sd = mean_std(diffs)
    sd = sd if n > 1 else float("nan")
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n) if n > 1 else float("nan")
    won = sum(d > TIE for d in diffs)
    lost = sum(d < -TIE for d in diffs)
    p = stats.binomtest(won, won + lost, 0.5).pvalue if won + lost else 1.0
    return {"a": mean_std(a)[0], "b": mean_std(b)[0], "diff": mean, "diff_sd": sd,
            "ci_low": mean - half, "ci_high": mean + half,
            "won": won, "lost": lost, "tied": n - won - lost, "sign_test_p": float(p), "pairs": n}


def compare(a_records: list[dict[str, Any]], b_records: list[dict[str, Any]]) -> dict[str, Any]:
    """The paired comparison of two evaluations' records over the routes both drove (see the module docstring)."""
    ra, rb = per_route(a_records), per_route(b_records)
    keys = sorted(set(ra) & set(rb))
    if not keys:
        raise EvalError("the two evaluations share no route (group and route index): compare evaluations of the same "
                        "benchmark")
    result: dict[str, Any] = {
        "routes": len(keys), "only_a": sorted(ra[k]["name"] for k in set(ra) - set(rb)),
        "only_b": sorted(rb[k]["name"] for k in set(rb) - set(ra)),
        "scores": {key: paired([ra[k][score] for k in keys], [rb[k][score] for k in keys])
                   for key, score in SUMMARY_SCORES}}
    groups = sorted({k[0] for k in keys})
    result["groups"] = {g: paired([ra[k]["score_composed"] for k in keys if k[0] == g],
                                  [rb[k]["score_composed"] for k in keys if k[0] == g]) for g in groups}
    causes = list(dict.fromkeys(c for k in keys for side in (ra, rb) for c in side[k]["ds_lost"]))
    result["ds_lost"] = {c: {side: mean_std([routes[k]["ds_lost"].get(c, 0.0) for k in keys])[0]
                             for side, routes in (("a", ra), ("b", rb))} for c in causes}
    kinds = sorted({t for k in keys for side in (ra, rb) for t in side[k]["scenarios"]})
    result["scenarios"] = {t: {side_name: {c: sum(side[k]["scenarios"].get(t, {}).get(c, 0) for k in keys)
                                           for c in SCENARIO_COLUMNS}
                               for side_name, side in (("a", ra), ("b", rb))} for t in kinds}
    def gain(k: tuple[str, int]) -> float:
        return rb[k]["score_composed"] - ra[k]["score_composed"]

    def row(k: tuple[str, int]) -> dict[str, Any]:
        return {"route": ra[k]["name"], "a": ra[k]["score_composed"], "b": rb[k]["score_composed"],
                "a_ends": ra[k]["ends"], "b_ends": rb[k]["ends"]}

    moved = sorted(keys, key=gain)
    result["moved"] = {"b_gained": [row(k) for k in reversed(moved[-MOVED:]) if gain(k) > TIE],
                       "b_lost": [row(k) for k in moved[:MOVED] if gain(k) < -TIE]}
    return result


def describe(identity: dict[str, Any]) -> str:
    """One line for an evaluation's identity block: the policy (its kind, a checkpoint's sha256 prefix), the
    benchmark and the traffic seed."""
    policy = identity.get("policy", {})
    who = policy.get("kind", "?") + (f" sha256 {policy['sha256'][:12]}" if "sha256" in policy else "")
    return f"{who}, benchmark {identity.get('benchmark', '?')}, traffic seed {identity.get('seed', '?')}"


def _table(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """Markdown lines: a section title (none if empty), the header (first column left, the rest right) and rows."""
    lines = ["", f"## {title}", ""] if title else [""]
    return lines + ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)] + [
        "| " + " | ".join(r) + " |" for r in rows]


def to_markdown(result: dict[str, Any], a_name: str, b_name: str, a_id: dict[str, Any], b_id: dict[str, Any]) -> str:
    """The comparison as a markdown report (what ``carl-compare`` prints)."""
    md = [f"# {b_name} against {a_name}", "", f"- A: {a_name} ({describe(a_id)})", f"- B: {b_name} ({describe(b_id)})",
          f"- {result['routes']} routes in common (each averaged over its repetitions); B - A with its 95 % interval "
          "over routes (evaluation noise only, not the training seed's)"]
    for side, names in (("A", result["only_a"]), ("B", result["only_b"])):
        if names:
            more = " ..." if len(names) > 8 else ""
            md.append(f"- only in {side} (left out): {len(names)}: {', '.join(names[:8])}{more}")
    if a_id.get("benchmark_config") != b_id.get("benchmark_config"):
        md.append("- the benchmarks' options differ (benchmark_config): the same routes may have been driven under "
                  "other conditions")
    if a_id.get("seed") != b_id.get("seed"):
        md.append(f"- the traffic seeds differ ({a_id.get('seed')} against {b_id.get('seed')}): the routes are paired, "
                  "their traffic is not")

    def interval(s: dict[str, float], d: int = 2) -> str:
        return f"[{s['ci_low']:+.{d}f}, {s['ci_high']:+.{d}f}]"

    rows = []
    for key, s in result["scores"].items():
        d = 3 if key == "infraction_score" else 2
        rows.append([key, f"{s['a']:.{d}f}", f"{s['b']:.{d}f}", f"{s['diff']:+.{d}f}", interval(s, d),
                     f"{s['won']} / {s['lost']} / {s['tied']}", f"{s['sign_test_p']:.3f}"])
    md += _table("", ["score", "A", "B", "B - A", "95 % interval", "B won / lost / tied", "sign test p"], rows)
    md += _table("DS per route group", ["group", "routes", "A", "B", "B - A", "95 % interval"],
                 [[g, str(s["pairs"]), f"{s['a']:.2f}", f"{s['b']:.2f}", f"{s['diff']:+.2f}", interval(s)]
                  for g, s in result["groups"].items()])
    md += _table("DS lost per cause", ["cause", "A", "B", "B - A"],
                 [[c, f"{v['a']:.2f}", f"{v['b']:.2f}", f"{v['b'] - v['a']:+.2f}"]
                  for c, v in result["ds_lost"].items()])
    if result["scenarios"]:
        cols = list(SCENARIO_COLUMNS[2:])
        md += _table("Scenario outcomes (A -> B)", ["type", *cols],
                     [[t, *(f"{v['a'][c]} -> {v['b'][c]}" for c in cols)] for t, v in result["scenarios"].items()])
    for title, moved in (("B gained most", result["moved"]["b_gained"]), ("B lost most", result["moved"]["b_lost"])):
        if moved:
            md += _table(f"Routes where {title}", ["route", "A", "B", "A ended", "B ended"],
                         [[r["route"], f"{r['a']:.2f}", f"{r['b']:.2f}", ", ".join(r["a_ends"]), ", ".join(r["b_ends"])]
                          for r in moved])
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="carl-compare", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="carl-eval out_dir (or its results.json): the reference")
    parser.add_argument("b", help="carl-eval out_dir (or its results.json): compared with A")
    parser.add_argument("--out", help="also write compare.md and compare.json into this folder (created)")
    args = parser.parse_args(argv)
    try:
        (a_id, a_records), (b_id, b_records) = load_records(args.a), load_records(args.b)
        if a_id.get("benchmark") != b_id.get("benchmark"):
            raise EvalError(f"{args.a} evaluated benchmark {a_id.get('benchmark')!r} and {args.b} "
                            f"{b_id.get('benchmark')!r}: compare evaluations of the same benchmark")
        result = compare(a_records, b_records)
    except EvalError as exc:
        sys.exit(f"carl-compare: {exc}")
    md = to_markdown(result, args.a, args.b, a_id, b_id)
    print(md, end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.md").write_text(md)
        write_result({"a": str(args.a), "b": str(args.b), **result}, out / "compare.json")


if __name__ == "__main__":
    main()

"""``carl-compare A B``: two evaluations (or two sets of them) of the same benchmark, route by route.

Two policies driven on the same routes with the same traffic seed differ far less between themselves than either
differs from its own mean over routes: longest6's 36 routes give a standard error of ~5 DS for one policy's score,
while the paired difference of two similar policies is often known to +-2. The tool matches the routes of two
``carl-eval`` folders, averages each route over its repetitions (``benchmark.repetitions``), and reports for DS, RC
and IS the mean difference B - A, its 95 % interval (Student's t over routes), the routes B won and lost and a sign
test; then the difference per route group (town), per cause of lost DS, per scenario outcome, and the routes that
moved most.

    carl-compare runs/eval/longest6-a runs/eval/longest6-b
    carl-compare a/results.json b/results.json --out runs/eval/a_vs_b   # also a_vs_b/compare.md and .json
    carl-compare eval/expert eval/s1,eval/s2,eval/s3                    # a recipe's three training seeds

The route interval covers the evaluation's noise only (which routes, which traffic), for these checkpoints: two
training runs of one recipe differ by their seed too. A side given as several comma-separated evaluations (one per
training seed) is paired route by route on its evaluations' average, and the report adds each evaluation's score,
each side's mean +- sd over its evaluations and the difference of those means with a 95 % interval over the seeds
(Welch's t; against a single evaluation, the other side's one-sample t), the comparison of recipes
(docs/evaluation.md).
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
    identity = dict(data.get("carl") or {})
    done, total = (data["_checkpoint"].get("progress") or [len(records), len(records)])[:2]
    if done < total:  # still running, or stopped: compared as it stands
        identity["unfinished"] = [int(done), int(total)]
    return identity, records


def load_side(spec: str) -> list[tuple[str, dict[str, Any], list[dict[str, Any]]]]:
    """A side's evaluations, ``spec`` one folder (or results.json) or several comma-separated: (path, identity,
    records) each."""
    paths = [p for p in spec.split(",") if p]
    if not paths:
        raise EvalError(f"{spec!r}: name one carl-eval out_dir, or several separated by commas")
    if len(set(paths)) < len(paths):
        raise EvalError(f"{spec!r} names an evaluation twice: each training seed's evaluation once")
    return [(p, *load_records(p)) for p in paths]


def _route_key(r: dict[str, Any]) -> tuple[str, int]:
    return r["carl"]["group"], int(r["carl"]["route_index"])


def _route_row(r: dict[str, Any]) -> dict[str, Any]:
    """One record as a route row: its scores, DS lost per cause, scenario outcomes and how it ended; ``name`` is
    the route id without the repetition suffix."""
    return {"name": str(r["route_id"]).removesuffix(f"_rep{r['carl'].get('repetition', 0)}"), "repetitions": 1,
            "ds_lost": ds_lost(r["carl"]["episode"]),
            "scenarios": {kind: {c: int(counts.get(c, 0)) for c in SCENARIO_COLUMNS}
                          for kind, counts in r.get("scenarios", {}).items()},
            "ends": [r["meta"].get("termination", "?")], **{score: r["scores"][score] for _, score in SUMMARY_SCORES}}


def _merged(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Route rows of one route as one: scores and DS lost averaged (each row weighs the same), scenario counts and
    repetitions summed, the ends gathered."""
    lost: dict[str, float] = {}
    outcomes: dict[str, dict[str, int]] = {}
    for row in rows:
        for cause, points in row["ds_lost"].items():
            lost[cause] = lost.get(cause, 0.0) + points / len(rows)
        for kind, counts in row["scenarios"].items():
            agg = outcomes.setdefault(kind, {})
            for c, n in counts.items():
                agg[c] = agg.get(c, 0) + n
    return {"name": rows[0]["name"], "repetitions": sum(r["repetitions"] for r in rows), "ds_lost": lost,
            "scenarios": outcomes, "ends": sorted({e for r in rows for e in r["ends"]}),
            **{score: mean_std([r[score] for r in rows])[0] for _, score in SUMMARY_SCORES}}


def per_route(records: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """Each route's row (:func:`_route_row`), averaged over its repetitions (:func:`_merged`)."""
    reps: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        reps.setdefault(_route_key(r), []).append(_route_row(r))
    return {key: _merged(rows) for key, rows in reps.items()}


def pooled(evaluations: list[dict[tuple[str, int], dict[str, Any]]]) -> dict[tuple[str, int], dict[str, Any]]:
    """Several evaluations' :func:`per_route` tables as one, on the routes all of them drove, each evaluation
    weighing the same whatever its repetitions (:func:`_merged`)."""
    keys = set.intersection(*(set(e) for e in evaluations))
    return {key: _merged([e[key] for e in evaluations]) for key in keys}


def over_seeds(a: list[float], b: list[float]) -> dict[str, Any]:
    """B's mean over its evaluations against A's, with a 95 % interval for the difference of the means: Welch's t
    when both sides have several, the several side's one-sample t when the other has one (taken as exact)."""
    (ma, sa), (mb, sb) = mean_std(a), mean_std(b)
    va, vb = (sa ** 2 / len(a) if len(a) > 1 else 0.0), (sb ** 2 / len(b) if len(b) > 1 else 0.0)
    se = math.sqrt(va + vb)
    parts = [v ** 2 / (len(x) - 1) for v, x in ((va, a), (vb, b)) if len(x) > 1]
    half = stats.t.ppf(0.975, se ** 4 / sum(parts)) * se if se > 0 and parts else float("nan")
    return {"a_each": a, "b_each": b, "a": ma, "a_sd": sa, "b": mb, "b_sd": sb, "diff": mb - ma,
            "ratio": mb / ma if ma else float("nan"), "ci_low": mb - ma - half, "ci_high": mb - ma + half}


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


def compare(a: list[list[dict[str, Any]]], b: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The paired comparison of two sides' evaluations (each a list of records) over the routes all of them drove
    (see the module docstring)."""
    each_a, each_b = [per_route(r) for r in a], [per_route(r) for r in b]
    ra, rb = pooled(each_a), pooled(each_b)
    keys = sorted(set(ra) & set(rb))
    if not keys:
        raise EvalError("the two sides share no route (group and route index) that all their evaluations drove: "
                        "compare evaluations of the same benchmark")
    names = {k: e[k]["name"] for e in (*each_a, *each_b) for k in e}
    result: dict[str, Any] = {
        "routes": len(keys), "evaluations": {"a": len(a), "b": len(b)},
        "only_a": sorted(names[k] for k in set(ra) - set(rb)), "only_b": sorted(names[k] for k in set(rb) - set(ra)),
        "partial": sorted(names[k] for k in set(names) - set(ra) - set(rb)),  # some evaluation of each side lacks it
        "scores": {key: paired([ra[k][score] for k in keys], [rb[k][score] for k in keys])
                   for key, score in SUMMARY_SCORES}}
    if len(a) > 1 or len(b) > 1:
        result["seeds"] = {key: over_seeds(*([mean_std([e[k][score] for k in keys])[0] for e in side]
                                             for side in (each_a, each_b)))
                           for key, score in SUMMARY_SCORES}
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
    """One line for an evaluation's identity block: the policy (its kind, a checkpoint's sha256 prefix, its
    arithmetic where not float32), the benchmark and the traffic seed."""
    policy = identity.get("policy", {})
    who = policy.get("kind", "?") + (f" sha256 {policy['sha256'][:12]}" if "sha256" in policy else "")
    who += f" in {policy['precision']}" if "precision" in policy else ""
    line = f"{who}, benchmark {identity.get('benchmark', '?')}, traffic seed {identity.get('seed', '?')}"
    if "unfinished" in identity:
        line += ", **unfinished: {} of {} route runs**".format(*identity["unfinished"])
    return line


def _table(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """Markdown lines: a section title (none if empty), the header (first column left, the rest right) and rows."""
    lines = ["", f"## {title}", ""] if title else [""]
    return lines + ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)] + [
        "| " + " | ".join(r) + " |" for r in rows]


def to_markdown(result: dict[str, Any], a_side: list[tuple[str, dict[str, Any]]],
                b_side: list[tuple[str, dict[str, Any]]]) -> str:
    """The comparison as a markdown report (what ``carl-compare`` prints); each side's (name, identity) pairs."""
    def title(side: list[tuple[str, dict[str, Any]]]) -> str:
        return side[0][0] if len(side) == 1 else f"{len(side)} evaluations ({', '.join(n for n, _ in side)})"

    md = [f"# {title(b_side)} against {title(a_side)}", ""]
    md += [f"- {label}: {name} ({describe(identity)})" for label, side in (("A", a_side), ("B", b_side))
           for name, identity in side]
    md.append(f"- {result['routes']} routes in common (each averaged over its repetitions"
              + (" and its side's evaluations" if len(a_side) + len(b_side) > 2 else "")
              + "); B - A with its 95 % interval over routes (evaluation noise only, not the training seed's)")
    for side, names in (("A", result["only_a"]), ("B", result["only_b"]), ("some evaluations", result["partial"])):
        if names:
            more = " ..." if len(names) > 8 else ""
            md.append(f"- only in {side} (left out): {len(names)}: {', '.join(names[:8])}{more}")
    identities = [identity for _, identity in (*a_side, *b_side)]
    if any("unfinished" in i for i in identities):
        md.append("- an evaluation is unfinished: its routes not driven yet are left out or averaged over fewer "
                  "repetitions, so these figures will move; compare again when it ends (re-running carl-eval resumes)")
    if len({str(i.get("benchmark_config")) for i in identities}) > 1:
        md.append("- the benchmarks' options differ (benchmark_config): the same routes may have been driven under "
                  "other conditions")
    if len({str(i.get("seed")) for i in identities}) > 1:
        seeds = ", ".join(str(i.get("seed")) for i in identities)
        md.append(f"- the traffic seeds differ ({seeds}): the routes are paired, their traffic is not")
    if len(a_side) != len(b_side) and result["scenarios"]:
        md.append(f"- scenario outcomes are sums over each side's evaluations ({len(a_side)} against {len(b_side)})")

    def interval(s: dict[str, float], d: int = 2) -> str:
        return f"[{s['ci_low']:+.{d}f}, {s['ci_high']:+.{d}f}]"

    rows = []
    for key, s in result["scores"].items():
        d = 3 if key == "infraction_score" else 2
        rows.append([key, f"{s['a']:.{d}f}", f"{s['b']:.{d}f}", f"{s['diff']:+.{d}f}", interval(s, d),
                     f"{s['won']} / {s['lost']} / {s['tied']}", f"{s['sign_test_p']:.3f}"])
    md += _table("", ["score", "A", "B", "B - A", "95 % interval", "B won / lost / tied", "sign test p"], rows)
    if "seeds" in result:
        def each(values: list[float], d: int) -> str:
            return " / ".join(f"{v:.{d}f}" for v in values)

        rows = [[key, each(s["a_each"], d), each(s["b_each"], d), f"{s['a']:.{d}f} +- {s['a_sd']:.{d}f}",
                 f"{s['b']:.{d}f} +- {s['b_sd']:.{d}f}", f"{s['diff']:+.{d}f}", interval(s, d), f"{s['ratio']:.3f}"]
                for key, s in result["seeds"].items() for d in [3 if key == "infraction_score" else 2]]
        md += _table("Over the evaluations (training seeds)", ["score", "A each", "B each", "A mean +- sd",
                                                               "B mean +- sd", "B - A", "95 % interval", "B / A"], rows)
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
    parser.add_argument("a", help="carl-eval out_dir (or its results.json), or several separated by commas (one per "
                                  "training seed): the reference")
    parser.add_argument("b", help="the same for the side compared with A")
    parser.add_argument("--out", help="also write compare.md and compare.json into this folder (created)")
    args = parser.parse_args(argv)
    try:
        a_side, b_side = load_side(args.a), load_side(args.b)
        benchmarks = {str(identity.get("benchmark")) for _, identity, _ in (*a_side, *b_side)}
        if len(benchmarks) > 1:
            which = ", ".join(f"{path}: {identity.get('benchmark')!r}" for path, identity, _ in (*a_side, *b_side))
            raise EvalError(f"the evaluations ran different benchmarks ({which}): compare evaluations of the same "
                            "benchmark")
        result = compare([r for _, _, r in a_side], [r for _, _, r in b_side])
    except EvalError as exc:
        sys.exit(f"carl-compare: {exc}")
    for path, identity, _ in (*a_side, *b_side):
        if "unfinished" in identity:
            print("carl-compare: warning: {} is unfinished ({} of {} route runs); its figures will move".format(
                path, *identity["unfinished"]), file=sys.stderr)
    md = to_markdown(result, [(p, i) for p, i, _ in a_side], [(p, i) for p, i, _ in b_side])
    print(md, end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.md").write_text(md)
        write_result({"a": [p for p, _, _ in a_side], "b": [p for p, _, _ in b_side], **result}, out / "compare.json")


if __name__ == "__main__":
    main()

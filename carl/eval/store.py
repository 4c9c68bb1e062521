"""Results: aggregates over episodes and route records, and the resumable results folder of one policy on one
benchmark (:class:`ResultStore`: ``results.json`` in the Leaderboard 2.0 layout, :mod:`envs.metrics.leaderboard`).

Aggregates are Leaderboard-style: mean driving score, route completion and infraction score over routes (with
sample standard deviations), infractions per km (sum of counts / km driven); Val14 adds nuPlan's closed-loop score.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from carl.eval import EvalError
from carl.monitor import EpisodeStats
from envs.metrics.leaderboard import LB_RECORD_KEYS, GlobalScores, ds_lost, lb_global_infraction, results_file

# summary key -> the route record's score key
SUMMARY_SCORES = (("driving_score", "score_composed"), ("route_completion", "score_route"),
                  ("infraction_score", "score_penalty"))


def _json_safe(obj: Any) -> Any:
    """NaN/inf (e.g. the means of zero finished episodes) become null so the file is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_result(result: dict[str, Any], path: str | Path) -> Path:
    """Write ``result`` as JSON atomically (tmp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_json_safe(result), indent=2, sort_keys=True, allow_nan=False) + "\n")
    tmp.replace(path)
    return path


def aggregate(episodes: list[dict[str, float]], requested: int) -> dict[str, Any]:
    """Leaderboard-style means over episodes (+ per-km infractions, termination reasons)."""
    stats = EpisodeStats()
    for ep in episodes:
        stats.add_episode(ep)
    summary = stats.summary()
    result: dict[str, Any] = {
        "driving_score": summary.get("episode/driving_score", float("nan")),
        "route_completion": summary.get("episode/route_completion", float("nan")),
        "infraction_score": summary.get("episode/infraction_score", float("nan")),
        "return": summary.get("episode/return", float("nan")),
        "episodes": len(episodes),
        "unfinished": requested - len(episodes),
        "infractions_per_km": {},
        "termination": {},
        "ds_lost": mean_ds_lost(episodes),
    }
    if "episode/nuplan_score" in summary:  # nuPlan's closed-loop score (x 100, as CLS is reported)
        result["closed_loop_score"] = 100.0 * summary["episode/nuplan_score"]
    for key, val in summary.items():
        if key.startswith("episode/infractions_per_km/"):
            result["infractions_per_km"][key.rsplit("/", 1)[1]] = val
        elif key.startswith("episode/termination/"):
            result["termination"][key.rsplit("/", 1)[1]] = val
        elif key.startswith("episode/") and key not in ("episode/count",) and "/infractions/" not in key:
            result.setdefault("means", {})[key[len("episode/"):]] = val
    return result


def mean_ds_lost(episodes: list[dict[str, float]]) -> dict[str, float]:
    """DS points lost per cause (:func:`~envs.metrics.leaderboard.ds_lost`), averaged over the episodes as the DS is,
    largest first: with the mean DS they sum to 100."""
    total: dict[str, float] = {}
    for ep in episodes:
        for cause, points in ds_lost(ep).items():
            total[cause] = total.get(cause, 0.0) + points
    return {k: v / len(episodes) for k, v in sorted(total.items(), key=lambda kv: -kv[1])} if episodes else {}


def headline(result: dict[str, Any]) -> float:
    """The one number an evaluation is ranked by (best.pt): nuPlan's closed-loop score where the env reports it, the
    driving score elsewhere."""
    return float(result.get("closed_loop_score", result["driving_score"]))


def keeps_final(final: dict[str, Any], periodic_best: dict[str, Any] | None) -> bool:
    """Whether a run keeps its final policy as best.pt: unless the periodic best scores higher on the same final
    routes (ties go to the final policy)."""
    return periodic_best is None or headline(final) >= headline(periodic_best)


def mean_std(values: list[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (0 for one value, NaN for none)."""
    if not values:
        return float("nan"), float("nan")
    m = sum(values) / len(values)
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return m, sd


def summarize(records: list[dict[str, Any]], total: int) -> dict[str, Any]:
    """Aggregates as the Leaderboard computes them (means over routes; infractions per km driven, the km outside the
    route lanes in total)."""
    result = aggregate([r["carl"]["episode"] for r in records], total)
    result["routes"] = len(records)
    result["routes_total"] = total
    for key, score in SUMMARY_SCORES:
        mean, sd = mean_std([r["scores"][score] for r in records])
        result[key], result[f"{key}_std"] = mean, sd
    km = sum((r["meta"]["route_length"] or 0.0) / 1000.0 * r["scores"]["score_route"] / 100.0 for r in records)
    result["km"] = km
    result["infractions_per_km_lb"] = {key: lb_global_infraction(records, key, km) for key in LB_RECORD_KEYS}
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(r["carl"]["group"], []).append(r)
    result["groups"] = {g: {"routes": len(rs),
                            "driving_score": mean_std([r["scores"]["score_composed"] for r in rs])[0],
                            "route_completion": mean_std([r["scores"]["score_route"] for r in rs])[0],
                            "infraction_score": mean_std([r["scores"]["score_penalty"] for r in rs])[0]}
                        for g, rs in sorted(groups.items())}
    if any("scenarios" in r for r in records):
        result["scenarios"] = scenario_summary(records)
    if len({r["carl"].get("repetition", 0) for r in records}) > 1:
        result["repetitions"] = repetition_summary(records)
    return result


def repetition_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """With each route driven several times (``carl.repetition`` of a record): the benchmark's means per repetition
    and their sample sd (how far the headline figure moves with the traffic seed), and the mean over routes of each
    route's own sd across its repetitions (how far one route's score moves)."""
    out: dict[str, Any] = {"count": len({r["carl"].get("repetition", 0) for r in records})}
    for key, score in SUMMARY_SCORES:
        per_rep: dict[int, list[float]] = {}
        per_route: dict[tuple[str, int], list[float]] = {}
        for r in records:
            per_rep.setdefault(r["carl"].get("repetition", 0), []).append(r["scores"][score])
            per_route.setdefault((r["carl"]["group"], r["carl"]["route_index"]), []).append(r["scores"][score])
        means = [mean_std(v)[0] for _, v in sorted(per_rep.items())]
        out[key] = {"per_repetition": means, "sd_over_repetitions": mean_std(means)[1],
                    "mean_route_sd": mean_std([mean_std(v)[1] for v in per_route.values()])[0]}
    return out


def scenario_record_fields(ep: dict[str, float], placed: tuple) -> dict[str, dict[str, Any]]:
    """A longest6 record's ``scenarios`` field: per scenario type, the route's scenarios (``placed``: the world's
    :class:`~envs.maps.scenarios.RouteScenario` of the route) and what became of them in this episode (the env's
    ``episode/scenarios/<type>/<outcome>``), those not played with their reasons."""
    from envs.api import SCENARIO_OUTCOMES, SCENARIO_TYPES

    out: dict[str, dict[str, Any]] = {}
    for rs in placed:
        kind = out.setdefault(rs.defn.type, {"total": 0, "skipped": 0, "skipped_reasons": []})
        kind["total"] += 1
        if not rs.kept:
            kind["skipped"] += 1
            kind["skipped_reasons"].append(f"{rs.defn.name}: {rs.reason}")
    for name, kind in out.items():
        if name in SCENARIO_TYPES:
            kind.update({o: int(round(ep.get(f"episode/scenarios/{name}/{o}", 0.0))) for o in SCENARIO_OUTCOMES})
    return out


def scenario_summary(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per scenario type over the records: the outcome counts summed, and the mean DS / RC / IS of the routes that
    carry the type (a route counts for each type it carries)."""
    out: dict[str, dict[str, Any]] = {}
    for r in records:
        for name, kind in r.get("scenarios", {}).items():
            agg = out.setdefault(name, {"routes": 0, "_ds": [], "_rc": [], "_is": []})
            agg["routes"] += 1
            for k, v in kind.items():
                if isinstance(v, int):
                    agg[k] = agg.get(k, 0) + v
            agg["_ds"].append(r["scores"]["score_composed"])
            agg["_rc"].append(r["scores"]["score_route"])
            agg["_is"].append(r["scores"]["score_penalty"])
    for agg in out.values():
        for key, name in (("_ds", "driving_score"), ("_rc", "route_completion"), ("_is", "infraction_score")):
            agg[name] = mean_std(agg.pop(key))[0]
    return dict(sorted(out.items()))


def nuplan_record_fields(ep: dict[str, float], scenario_type: str) -> dict[str, Any]:
    """A Val14 record's ``nuplan`` field from the env's ``episode/nuplan_score`` and ``episode/nuplan/<metric>``."""
    from envs.metrics.nuplan import MULTIPLIERS, WEIGHTS

    return {"score": ep.get("episode/nuplan_score"), "scenario_type": scenario_type,
            "multipliers": {k: ep.get(f"episode/nuplan/{k}") for k in MULTIPLIERS},
            "weighted": {k: ep.get(f"episode/nuplan/{k}") for k in WEIGHTS}}


def nuplan_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Val14 aggregates from the records' ``nuplan`` fields: closed-loop score (mean scenario score × 100), the
    per-metric means, per-type scores."""
    from envs.metrics.nuplan import ScenarioScore, aggregate as nuplan_aggregate

    scores = [ScenarioScore(r["route_id"], r["nuplan"]["scenario_type"], r["nuplan"]["multipliers"],
                            r["nuplan"]["weighted"]) for r in records if "nuplan" in r]
    agg = nuplan_aggregate(scores)
    return {"closed_loop_score": 100.0 * agg["score"] if scores else None,
            "nuplan_metrics": {k[len("metric/"):]: v for k, v in agg.items() if k.startswith("metric/")},
            "nuplan_types": {k[len("type/"):]: 100.0 * v for k, v in agg.items() if k.startswith("type/")}}


def read_results(path: Path) -> dict[str, Any]:
    """A carl-eval ``results.json``; an :class:`EvalError` naming the file if it is not one."""
    try:
        data = json.loads(path.read_text())
        for r in data["_checkpoint"]["records"]:  # the layout check: what the readers index
            r["scores"]["score_composed"], r["carl"]["group"]  # noqa: B018
        return data
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise EvalError(f"{path} is not a carl-eval results file ({type(exc).__name__}: {exc})") from None


def _precision_hint(found: Any, mine: dict[str, Any]) -> str:
    """A line for a folder whose results differ from this run's only in the policy's arithmetic (carl-eval's
    ``precision``; a folder written before the key existed holds float32 results)."""
    if not isinstance(found, dict) or not isinstance(found.get("policy"), dict):
        return ""
    strip = lambda d: {**d, "policy": {k: v for k, v in d["policy"].items() if k != "precision"}}  # noqa: E731
    if strip(found) != strip(mine):
        return ""
    return (f"; the two differ only in precision (the folder's {found['policy'].get('precision', 'float32')}): pass "
            f"precision={found['policy'].get('precision', 'float32')} to resume it")


class ResultStore:
    """``results.json`` of one policy on one benchmark; each finished route is written at once (atomically)."""

    OUTPUTS = ("results.json", "summary.json", "summary.md", "summary.csv", "score_per_route.png",
               "infractions.png", "videos", "baselines")

    def __init__(self, out_dir: Path, identity: dict[str, Any], total: int, overwrite: bool) -> None:
        self.out_dir = out_dir
        self.path = out_dir / "results.json"
        self.identity = identity
        self.total = total
        existing = self._load(overwrite)
        if not overwrite:
            if existing is not None and existing.get("carl") != identity:
                raise EvalError(
                    f"{out_dir} already holds results of another evaluation:\n  found    {json.dumps(existing.get('carl'))}"
                    f"\n  this run {json.dumps(identity)}\npick another out_dir=, or pass overwrite=true to replace them"
                    + _precision_hint(existing.get("carl"), identity))
            if existing is None and (out_dir / "summary.json").exists():
                raise EvalError(f"{out_dir} holds a summary.json without results.json; pick another out_dir= or pass "
                                "overwrite=true")
        else:
            self._clear()
            existing = None
        self.records: list[dict[str, Any]] = existing["_checkpoint"]["records"] if existing else []
        self.done = {r["route_id"] for r in self.records}

    def _load(self, overwrite: bool) -> dict[str, Any] | None:
        """The existing results.json (None if absent; unreadable is an error unless it will be overwritten)."""
        if not self.path.exists():
            return None
        try:
            return read_results(self.path)
        except EvalError as exc:
            if overwrite:
                return None
            raise EvalError(f"{exc}; pass overwrite=true to start over") from None

    def _clear(self) -> None:
        for name in self.OUTPUTS:
            p = self.out_dir / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()

    def add(self, record: dict[str, Any]) -> None:
        record["index"] = len(self.records)
        self.records.append(record)
        self.done.add(record["route_id"])
        self.write()

    def write(self, summary: dict[str, Any] | None = None) -> None:
        """Rewrite results.json; ``summary`` (:func:`summarize`) fills its ``global_record``."""
        scores = None if summary is None else GlobalScores(
            mean={score: summary[key] for key, score in SUMMARY_SCORES},
            std_dev={score: summary[f"{key}_std"] for key, score in SUMMARY_SCORES},
            infractions_per_km=summary["infractions_per_km_lb"], total_length=summary["km"] * 1000.0)
        write_result(results_file(self.records, self.total, self.identity, scores), self.path)

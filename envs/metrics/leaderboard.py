"""CARLA Leaderboard 2.0 results format (``../shared/docs/benchmarks.md`` §2): route records and the results file.

:func:`make_record` turns one episode's ``episode/...`` statistics (the shared infraction code's counters, every
backend) into a route record of the Leaderboard's results JSON; :func:`results_file` lays records out as that file
(``_checkpoint.records``, ``global_record``, ``progress``, ``entry_status`` ...). Every Leaderboard key is defined
here, once.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Mapping

# Leaderboard 2.0 record keys (benchmarks.md §2) for the simulator's infraction counters. off_road has no
# Leaderboard key (CARLA has no such test); it is reported under its own name.
LB_INFRACTION_KEYS: dict[str, str] = {
    "collision_pedestrian": "collisions_pedestrian",
    "collision_vehicle": "collisions_vehicle",
    "collision_static": "collisions_layout",
    "red_light": "red_light",
    "stop_sign": "stop_infraction",
    "outside_lanes": "outside_route_lanes",
    "route_deviation": "route_dev",
    "blocked": "vehicle_blocked",
    "timeout": "route_timeout",
    "off_road": "off_road",
    "min_speed": "min_speed_infractions",
    "scenario_timeout": "scenario_timeouts",
}
# Leaderboard 2.0's penalty factors (benchmarks.md §2.1): each event multiplies the infraction score
LB_COEFFICIENTS = {"collision_pedestrian": 0.5, "collision_vehicle": 0.6, "collision_static": 0.65,
                   "red_light": 0.7, "stop_sign": 0.8}
SCENARIO_TIMEOUT_PENALTY = 0.7  # per scenario timeout (statistics_manager; scenarios.md)
LB_EMPTY_KEYS = ("yield_emergency_vehicle_infractions",)
LB_RECORD_KEYS = (*LB_INFRACTION_KEYS.values(), *LB_EMPTY_KEYS)  # the infraction lists of every record
FAILED_STATUS = {
    "route_deviation": "Failed - Agent deviated from the route",
    "blocked": "Failed - Agent got blocked",
    "timeout": "Failed - Agent timed out",
    "max_steps": "Failed - Still running at max_steps (carl-eval's step limit)",
}


def termination_reason(ep: Mapping[str, float]) -> str:
    """Why an episode ended: the name of its set ``episode/termination/<name>`` flag ("unknown" without one)."""
    return next((k.rsplit("/", 1)[1] for k, v in ep.items() if k.startswith("episode/termination/") and v), "unknown")


def make_record(index: int, route_id: str, ep: dict[str, float], route_length: float | None, group: str,
                route_index: int, wall_s: float, dt: float) -> dict[str, Any]:
    """One Leaderboard 2.0 route record from the simulator's ``episode/...`` statistics (``dt``: seconds per step)."""
    counts = {name: int(round(ep.get(f"episode/infractions/{name}", 0.0))) for name in LB_INFRACTION_KEYS}
    infractions: dict[str, list[str]] = {key: [] for key in LB_RECORD_KEYS}
    for name, n in counts.items():
        infractions[LB_INFRACTION_KEYS[name]] += [f"{name.replace('_', ' ')} #{i + 1} (built-in simulator)"
                                                  for i in range(n)]
    if counts.get("outside_lanes") and "episode/outside_lanes_pct" in ep:  # the Leaderboard's one event, worded as
        # its OutsideRouteLanesTest writes it: its statistics read the metres as the message's 9th word
        pct = float(ep["episode/outside_lanes_pct"])
        metres = pct / 100.0 * (route_length or 0.0)
        infractions[LB_INFRACTION_KEYS["outside_lanes"]] = [
            f"Agent went outside its route lanes for about {metres:.3f} meters ({pct:.2f}% of the completed route)"]
    reason = termination_reason(ep)
    rc = round(float(ep["episode/route_completion"]), 4)
    penalty = round(float(ep["episode/infraction_score"]), 6)
    if reason == "route_completed":
        status = "Perfect" if sum(counts.values()) == 0 else "Completed"
    else:
        status = FAILED_STATUS.get(reason, f"Failed - Agent ended the route: {reason.replace('_', ' ')}")
    return {
        "index": index,
        "route_id": route_id,
        "status": status,
        "num_infractions": sum(len(v) for v in infractions.values()),
        "infractions": infractions,
        "scores": {"score_route": rc, "score_penalty": penalty,
                   "score_composed": round(max(rc * penalty, 0.0), 6)},
        "meta": {"route_length": route_length, "duration_game": round(float(ep.get("episode/length", 0)) * dt, 2),
                 "duration_system": round(wall_s, 2), "termination": reason},
        "carl": {"group": group, "route_index": route_index, "episode": ep},
        "timestamp": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def lb_global_infraction(records: list[dict[str, Any]], key: str, km: float) -> float | None:
    """A results file's global infraction entry as the Leaderboard's statistics compute it: the events per km driven
    (``km``; None when nothing was driven), except the route lanes' entry, the km driven outside them in total."""
    if key == LB_INFRACTION_KEYS["outside_lanes"]:
        return sum(_outside_lanes_km(r) for r in records)
    return sum(len(r["infractions"].get(key, [])) for r in records) / km if km > 0 else None


def _outside_lanes_km(record: dict[str, Any]) -> float:
    events = record["infractions"].get(LB_INFRACTION_KEYS["outside_lanes"], [])
    if not events:
        return 0.0
    try:  # as the Leaderboard reads it: the metres are its message's 9th word
        return float(events[0].split(" ")[8]) / 1000.0
    except (IndexError, ValueError):  # worded otherwise (carl before 2026-12-07): from the route's % and length
        pct = float(record.get("carl", {}).get("episode", {}).get("episode/outside_lanes_pct", 0.0))
        return pct / 100.0 * (record["meta"].get("route_length") or 0.0) / 1000.0


@dataclass
class GlobalScores:
    """The aggregates of a results file's ``global_record``."""

    mean: dict[str, float]  # by score key (score_composed, score_route, score_penalty)
    std_dev: dict[str, float]  # the same keys: sample standard deviations over routes
    infractions_per_km: dict[str, float | None]  # by Leaderboard infraction key (None: no km driven; the route
    # lanes' entry: km outside them, as the Leaderboard's; lb_global_infraction)
    total_length: float  # m driven (route length x route completion, summed)


def results_file(records: list[dict[str, Any]], total: int, identity: dict[str, Any],
                 scores: GlobalScores | None = None) -> dict[str, Any]:
    """The Leaderboard results JSON of ``records`` (``total`` routes in the benchmark); ``identity`` is the
    top-level ``carl`` block, ``scores`` fills ``global_record`` (left empty without them)."""
    finished = len(records) >= total
    status = "Finished" if finished else "Started"
    route_scores = [r["scores"] for r in records]
    return {
        "_checkpoint": {
            "global_record": {} if scores is None else {
                "index": -1, "route_id": -1, "status": status,
                "scores_mean": scores.mean, "scores_std_dev": scores.std_dev,
                "infractions": scores.infractions_per_km,
                "meta": {"total_length": scores.total_length, "exceptions": []},
            },
            "progress": [len(records), total],
            "records": records,
        },
        "entry_status": status,
        "eligible": finished,
        "sensors": [],
        "values": [] if not route_scores else [f"{sum(s[k] for s in route_scores) / len(route_scores):.3f}"
                                               for k in ("score_composed", "score_route", "score_penalty")],
        "labels": ["Avg. driving score", "Avg. route completion", "Avg. infraction penalty"],
        "carl": identity,
    }


def ds_lost(ep: Mapping[str, float]) -> dict[str, float]:
    """Where one route's driving score went, from its ``episode/...`` statistics: 100 - DS as the route completion
    it missed (``incomplete/<why the route ended>``) plus the infraction score's loss, RC x (1 - IS), shared among the
    penalties in proportion to the logarithm of their factors (the factors multiply, so their logarithms add and the
    split does not depend on their order). The parts sum to 100 - DS; a loss no known factor explains is
    ``other``. Empty for an episode without a route completion or an infraction score (an env that reports
    neither)."""
    if "episode/route_completion" not in ep or "episode/infraction_score" not in ep:
        return {}
    rc, score = float(ep["episode/route_completion"]), float(ep["episode/infraction_score"])
    logs = {name: ep.get(f"episode/infractions/{name}", 0.0) * math.log(c) for name, c in LB_COEFFICIENTS.items()}
    logs["scenario_timeout"] = ep.get("episode/infractions/scenario_timeout", 0.0) * math.log(SCENARIO_TIMEOUT_PENALTY)
    logs["outside_lanes"] = math.log(max(1.0 - ep.get("episode/outside_lanes_pct", 0.0) / 100.0, 1e-12))
    logs["min_speed"] = math.log(max(ep.get("episode/min_speed_factor", 1.0), 1e-12))
    total = sum(logs.values())
    penalty = rc * (1.0 - score)
    lost = {k: penalty * v / total for k, v in logs.items() if v < 0} if total < 0 else {}
    if penalty > 1e-9 and not lost:
        lost["other"] = penalty
    if rc < 100.0:
        lost[f"incomplete/{termination_reason(ep)}"] = 100.0 - rc
    return lost

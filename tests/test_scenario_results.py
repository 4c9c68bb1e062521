"""carl-eval's per-scenario-type results: a route record's ``scenarios`` field from the env's outcome counts and the
world's placed scenarios, and the per-type summary (counts summed, mean scores of the routes carrying a type)."""
from __future__ import annotations

import pytest

from carl.eval.report import scenario_tables
from carl.eval.store import scenario_record_fields, scenario_summary
from envs.maps.scenarios import RouteScenario, ScenarioDef


def placed(name: str, kind: str, kept: bool, reason: str = "") -> RouteScenario:
    return RouteScenario(ScenarioDef(name, kind, (0.0, 0.0), 0.0), 5 if kept else -1, reason)


def test_a_record_accounts_for_every_scenario_of_its_route() -> None:
    route = (placed("D1", "DynamicObjectCrossing", True), placed("D2", "DynamicObjectCrossing", True),
             placed("D3", "DynamicObjectCrossing", False, "not on the route"),
             placed("A1", "Accident", False, "type Accident is not played"))
    ep = {"episode/scenarios/DynamicObjectCrossing/triggered": 2.0,
          "episode/scenarios/DynamicObjectCrossing/passed": 1.0,
          "episode/scenarios/DynamicObjectCrossing/collided": 1.0}
    rec = scenario_record_fields(ep, route)
    doc = rec["DynamicObjectCrossing"]
    assert (doc["total"], doc["skipped"], doc["triggered"], doc["passed"], doc["collided"]) == (3, 1, 2, 1, 1)
    assert doc["skipped_reasons"] == ["D3: not on the route"] and doc["not_reached"] == 0
    assert rec["Accident"] == {"total": 1, "skipped": 1, "skipped_reasons": ["A1: type Accident is not played"]}


def test_the_summary_sums_counts_and_averages_the_routes_of_a_type() -> None:
    def record(ds: float, rc: float, is_: float, scenarios: dict) -> dict:
        return {"scores": {"score_composed": ds, "score_route": rc, "score_penalty": is_}, "scenarios": scenarios}

    recs = [record(50.0, 100.0, 0.5, {"ControlLoss": {"total": 2, "skipped": 0, "triggered": 2, "passed": 2}}),
            record(30.0, 60.0, 0.5, {"ControlLoss": {"total": 1, "skipped": 1, "triggered": 0},
                                     "SignalizedJunctionLeftTurn": {"total": 1, "skipped": 0, "timed_out": 1}}),
            record(90.0, 100.0, 0.9, {})]
    out = scenario_summary(recs)
    cl = out["ControlLoss"]
    assert (cl["routes"], cl["total"], cl["skipped"], cl["triggered"], cl["passed"]) == (2, 3, 1, 2, 2)
    assert cl["driving_score"] == pytest.approx(40.0) and cl["route_completion"] == pytest.approx(80.0)
    assert out["SignalizedJunctionLeftTurn"]["timed_out"] == 1
    assert out["SignalizedJunctionLeftTurn"]["driving_score"] == pytest.approx(30.0)
    md = "\n".join(scenario_tables({"expert": {"scenarios": out, "groups": {
        "Town01": {"routes": 3, "driving_score": 56.67, "route_completion": 86.67, "infraction_score": 0.633}}}}))
    assert "| ControlLoss | 2 | 3 | 1 | 2 | 2 | 0 | 0 | 0 | 0 | 40.00 | 80.00 | 0.500 |" in md
    assert "| Town01 | 3 | 56.67 | 86.67 | 0.633 |" in md


def test_longest6_plays_its_scenarios_unless_told_not_to() -> None:
    from carl.cli import load_config

    assert load_config("eval", ["benchmark=longest6"])["benchmark"]["options"]["route_scenarios"] is True
    off = load_config("eval", ["benchmark=longest6", "benchmark.options.route_scenarios=false"])
    assert off["benchmark"]["options"]["route_scenarios"] is False

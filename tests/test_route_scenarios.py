"""Scenarios of a Leaderboard 2.0 route file: parsed into our frame, and kept or dropped by the Leaderboard's route
filter (a route point closer than 2.0 m with a heading within 10 deg; ../shared/docs/scenarios.md §1)."""
from __future__ import annotations

import logging
import re
import math
from pathlib import Path

import numpy as np
import pytest

from envs.maps.routes import RouteError
from envs.maps.scenarios import parse_route_scenarios, scenarios_on_route

XML = """<routes>
 <route id="7" town="Town01">
  <waypoints><position x="0" y="0" z="0"/><position x="100" y="0" z="0"/></waypoints>
  <scenarios>
   <scenario name="DynamicObjectCrossing_1" type="DynamicObjectCrossing">
     <trigger_point x="30.0" y="-1.5" z="1.0" yaw="0"/>
     <distance value="15"/><direction value="left"/>
   </scenario>
   <scenario name="ControlLoss_1" type="ControlLoss"><trigger_point x="60" y="2.5" z="0" yaw="0"/></scenario>
   <scenario name="Left_1" type="SignalizedJunctionLeftTurn"><trigger_point x="80" y="0" z="0" yaw="-15"/>
     <source_dist_interval from="25" to="50"/></scenario>
   <scenario name="Back_1" type="ControlLoss"><trigger_point x="40" y="0" z="0" yaw="180"/></scenario>
  </scenarios>
 </route>
 <route id="8" town="Town01"><waypoints><position x="0" y="0" z="0"/></waypoints></route>
</routes>"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "routes.xml"
    p.write_text(text)
    return p


def test_scenarios_are_read_in_our_frame_with_their_parameters(tmp_path: Path) -> None:
    got = parse_route_scenarios(write(tmp_path, XML))
    assert list(got) == ["7", "8"] and got["8"] == []
    a, b, c, d = got["7"]
    # CARLA's left-handed (x, y) -> ours (x, -y); yaw clockwise degrees -> counter-clockwise radians
    assert (a.type, a.xy, a.yaw) == ("DynamicObjectCrossing", (30.0, 1.5), 0.0)
    assert a.value("distance", 12.0) == 15.0 and a.params["direction"] == {"value": "left"}
    assert a.value("crossing_angle", 0.0) == 0.0  # absent: the scenario's default
    assert c.yaw == pytest.approx(math.radians(15.0)) and c.params["source_dist_interval"] == {"from": "25", "to": "50"}
    assert d.yaw == pytest.approx(-math.pi)


def test_the_leaderboard_route_filter(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Route: 1 m points from (0, 0) to (100, 0) heading +x. Kept: the trigger 1.5 m beside x = 30, heading 0; it
    matches the first point closer than 2 m (|x - 30| < sqrt(2² - 1.5²) = 1.32: x = 29). Dropped: 2.5 m off; 15 deg
    off the heading; facing backwards (180 deg)."""
    defs = parse_route_scenarios(write(tmp_path, XML))["7"]
    points = np.stack([np.arange(101.0), np.zeros(101)], -1)
    with caplog.at_level(logging.WARNING):
        placed = scenarios_on_route(defs, points, "Town01_7")
    first_inside = math.floor(30.0 - math.sqrt(2.0**2 - 1.5**2)) + 1  # 29: |x - 30| < 1.32
    assert [(p.defn.name, p.index) for p in placed if p.kept] == [("DynamicObjectCrossing_1", first_inside)]
    assert [p.defn.name for p in placed if not p.kept] == ["ControlLoss_1", "Left_1", "Back_1"]
    assert all("not on the route" in p.reason for p in placed if not p.kept)
    dropped = " ".join(r.getMessage() for r in caplog.records)
    assert "ControlLoss_1" in dropped and "Left_1" in dropped and "Back_1" in dropped


def test_an_unknown_scenario_type_is_dropped_and_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = write(tmp_path, '<routes><route id="3" town="Town01"><scenarios><scenario name="s" type="Accident">'
                        '<trigger_point x="5" y="0" yaw="0"/></scenario></scenarios></route></routes>')
    points = np.stack([np.arange(20.0), np.zeros(20)], -1)
    with caplog.at_level(logging.WARNING):
        (placed,) = scenarios_on_route(parse_route_scenarios(p)["3"], points, "Town01_3")
    assert not placed.kept and "type Accident is not played" in placed.reason
    assert "Town01_3: scenario s (Accident) dropped" in caplog.text


@pytest.mark.parametrize("body,message", [
    ('<scenario name="s"><trigger_point x="1" y="2"/></scenario>', "scenario s has no 'type'"),
    ('<scenario name="s" type="ControlLoss"></scenario>', "scenario s (ControlLoss) has 0 <trigger_point>"),
    ('<scenario name="s" type="ControlLoss"><trigger_point x="a" y="2"/></scenario>',
     "scenario s (ControlLoss): trigger point without numeric x/y/yaw"),
])
def test_bad_scenarios_name_the_file_route_and_scenario(tmp_path: Path, body: str, message: str) -> None:
    p = write(tmp_path, f'<routes><route id="3" town="Town01"><scenarios>{body}</scenarios></route></routes>')
    with pytest.raises(RouteError, match=rf"route file .*routes.xml: route 3, {re.escape(message)}"):
        parse_route_scenarios(p)


def test_a_bad_parameter_value_is_named(tmp_path: Path) -> None:
    p = write(tmp_path, '<routes><route id="3" town="Town01"><scenarios><scenario name="s" type="ControlLoss">'
                        '<trigger_point x="1" y="2"/><distance value="far"/></scenario></scenarios></route></routes>')
    sd = parse_route_scenarios(p)["3"][0]
    with pytest.raises(RouteError, match=r"scenario s \(ControlLoss\): parameter <distance value='far'>"):
        sd.value("distance", 12.0)

"""The scenarios a Leaderboard 2.0 route file attaches to its routes, read and filtered as the Leaderboard does.

A route file's ``<route>`` may hold ``<scenarios><scenario name type><trigger_point x y z yaw/> ...</scenario>``;
any other child of a ``<scenario>`` is a parameter (``<distance value="12"/>``, ``<source_dist_interval from to/>``;
LB ``route_parser.parse_routes_file``). Positions and yaws come in CARLA's left-handed frame and are converted to
ours (``../shared/docs/scenarios.md`` §0).

The Leaderboard keeps a scenario only if some point of its route, interpolated every 1 m, lies closer than 2.0 m to
the trigger (2-D) with a yaw difference under 10° (``RouteParser.is_scenario_at_route``); the others are dropped
with a warning. :func:`scenarios_on_route` applies that filter on our dense routes (1 m spacing) and returns, for
each kept scenario, the route point it matched. A 2-D simulator has no heights, so the Leaderboard's height check
(trigger z - route z < 2 m) is not applied (docs/fidelity.md).
"""
from __future__ import annotations

import logging
import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from envs.api import SCENARIO_TYPES
from envs.maps.opendrive import carla_to_world, carla_yaw_to_world
from envs.maps.routes import RouteError, read_route_elements

log = logging.getLogger(__name__)

ROUTE_MATCH_DIST_M = 2.0  # LB route_parser DIST_THRESHOLD
ROUTE_MATCH_ANGLE_DEG = 10.0  # LB route_parser ANGLE_THRESHOLD


@dataclass(frozen=True)
class ScenarioDef:
    """One ``<scenario>`` of a route: its name and type, its trigger (our frame: x, y in m, yaw in rad) and its
    parameters (tag -> attributes, e.g. ``{"distance": {"value": "12"}}``)."""

    name: str
    type: str
    xy: tuple[float, float]
    yaw: float
    params: dict[str, dict[str, str]] = field(default_factory=dict)

    def value(self, tag: str, default: float) -> float:
        """A numeric ``<tag value=.../>`` parameter, or ``default`` (the scenario's own default) when absent."""
        return self.number(tag, "value", default)

    def number(self, tag: str, attr: str, default: float) -> float:
        """A numeric attribute ``<tag attr=.../>`` (e.g. ``source_dist_interval``'s ``from``), or ``default`` when
        absent; :class:`RouteError` naming the scenario and parameter when it is not a number."""
        attrs = self.params.get(tag)
        if attrs is None or attr not in attrs:
            return default
        try:
            return float(attrs[attr])
        except ValueError:
            raise RouteError(f"scenario {self.name} ({self.type}): parameter <{tag} {attr}={attrs[attr]!r}> "
                             "is not a number") from None


@dataclass(frozen=True)
class RouteScenario:
    """A scenario on its route: ``index`` is the route point that matched its trigger (-1: dropped, ``reason`` says
    why)."""

    defn: ScenarioDef
    index: int
    reason: str = ""
    last: int = -1  # the last route point of the trigger's 2 m circle (the ego activates it between index and last)
    nearest: int = -1  # the route point nearest the trigger (the trigger's own waypoint: the scenario's geometry)

    @property
    def kept(self) -> bool:
        return self.index >= 0


def parse_route_scenarios(path: str | Path) -> dict[str, list[ScenarioDef]]:
    """Route id -> the scenarios of that route, in file order (routes without scenarios map to []). Raises
    :class:`RouteError` naming the file, route and scenario for a scenario without a type, without exactly one
    trigger point, or with non-numeric trigger coordinates."""
    path, routes = read_route_elements(path)
    out: dict[str, list[ScenarioDef]] = {}
    for r in routes:
        rid = r.get("id", "?")
        out[rid] = [_scenario(path, rid, k, s) for k, s in enumerate(r.findall("scenarios/scenario"))]
    return out


def _scenario(path: Path, rid: str, k: int, s: ET.Element) -> ScenarioDef:
    name, kind = s.get("name") or f"{rid}_{k}", s.get("type")
    where = f"route file {path}: route {rid}, scenario {name}"
    if not kind:
        raise RouteError(f"{where} has no 'type' attribute")
    triggers = s.findall("trigger_point")
    if len(triggers) != 1:
        raise RouteError(f"{where} ({kind}) has {len(triggers)} <trigger_point> elements; the Leaderboard needs one")
    t = triggers[0].attrib
    try:
        x, y = carla_to_world(float(t["x"]), float(t["y"]))
        yaw = float(carla_yaw_to_world(float(t.get("yaw", 0.0))))
    except (KeyError, ValueError) as e:
        raise RouteError(f"{where} ({kind}): trigger point without numeric x/y/yaw ({e})") from e
    if not (math.isfinite(x) and math.isfinite(y) and math.isfinite(yaw)):
        raise RouteError(f"{where} ({kind}): non-finite trigger point")
    params = {c.tag: dict(c.attrib) for c in s if c.tag != "trigger_point"}
    return ScenarioDef(name, kind, (float(x), float(y)), yaw, params)


def scenarios_on_route(defs: list[ScenarioDef], points: np.ndarray, route_name: str = "route"
                       ) -> list[RouteScenario]:
    """Every scenario of a route of dense ``points`` [N, 2] (1 m apart, our frame), in file order: kept ones with the
    index of the route point that matched their trigger (the first one closer than 2.0 m with a heading within 10°
    of the trigger's), dropped ones (a type carl does not play, a trigger off the route) with the reason, each
    dropped one with a warning naming the route and scenario."""
    pts = np.asarray(points, np.float64)
    d = np.diff(pts, axis=0)
    heading = np.arctan2(d[:, 1], d[:, 0])
    heading = np.concatenate([heading, heading[-1:]])  # the last point keeps the last segment's heading
    out = []
    for sd in defs:
        if sd.type not in SCENARIO_TYPES:
            out.append(RouteScenario(sd, -1, f"type {sd.type} is not played by carl (it plays {', '.join(SCENARIO_TYPES)})"))
        else:
            dist = np.linalg.norm(pts - np.asarray(sd.xy), axis=1)
            dyaw = np.abs((heading - sd.yaw + np.pi) % (2 * np.pi) - np.pi)
            ok = np.nonzero((dist < ROUTE_MATCH_DIST_M) & (dyaw < math.radians(ROUTE_MATCH_ANGLE_DEG)))[0]
            near = dist < ROUTE_MATCH_DIST_M
            last = int(ok[0]) + int(np.argmin(near[ok[0]:])) - 1 if len(ok) and not near[ok[0]:].all() else len(pts) - 1
            nearest = int(ok[0]) + int(np.argmin(dist[ok[0]:last + 1])) if len(ok) else -1
            out.append(RouteScenario(sd, int(ok[0]), last=last, nearest=nearest) if len(ok) else RouteScenario(
                sd, -1, f"not on the route (no route point within {ROUTE_MATCH_DIST_M:.1f} m and "
                        f"{ROUTE_MATCH_ANGLE_DEG:.0f} deg of its trigger), as the Leaderboard drops it"))
        if not out[-1].kept:
            log.warning("%s: scenario %s (%s) dropped: %s", route_name, sd.name, sd.type, out[-1].reason)
    return out

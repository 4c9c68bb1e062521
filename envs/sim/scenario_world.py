"""Route scenarios compiled into the world's tensors: where each scenario triggers, what it spawns, where its actors
go and which lights it overrides, computed once on the lane graph (numpy) so that the step only indexes tables.

The geometry follows Leaderboard 2.0's scenario classes in their 2-D form (``../shared/docs/scenarios.md`` §3-4);
each function below names the class it follows. A scenario that cannot be placed on its map (no junction after
the trigger, no traffic light there, no lane from the side it needs) is skipped with a warning and a reason, as the
Leaderboard skips a scenario with a setup error; :func:`random_route_scenarios` places scenarios of the six types on
training routes where each can be played.

One file, on purpose: the six classes' geometry shares the map queries (:class:`Roads`) and the route walks, and the
tables they fill are defined here once.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from envs.maps.lanegraph import CONTROL_LIGHT, LaneGraph
from envs.maps.routes import Route, RouteError
from envs.api import SCENARIO_TYPES
from envs.maps.scenarios import RouteScenario, ScenarioDef, scenarios_on_route

log = logging.getLogger(__name__)

DOC, LEFT, LOSS, RIGHT, RED, TURN = (SCENARIO_TYPES.index(n) for n in (
    "DynamicObjectCrossing", "SignalizedJunctionLeftTurn", "ControlLoss", "SignalizedJunctionRightTurn",
    "OppositeVehicleRunningRedLight", "VehicleTurningRoute"))

# Actor slot groups: a scenario's actors live in one group, chosen by its ordinal among its route's scenarios of the
# same family (ordinal mod the family's group count). Group 0 carries a junction flow (up to FLOW_SLOTS cars), groups
# 1-2 one vehicle each (emergency vehicle, cyclist), groups 3-4 a pedestrian and its blocker each.
FLOW_SLOTS = 8
GROUP_FAMILY = {LEFT: (0, 1), RIGHT: (0, 1), RED: (1, 2), TURN: (1, 2), DOC: (3, 2)}  # type -> (first group, count)
NUM_GROUPS = 5
VEHICLE_GROUPS = (0, 1, 2)  # groups whose actors are vehicles (the rest: pedestrians)
SIDEWALK_M = 1.0  # the sidewalk's centre, metres beyond the kerb (CARLA town sidewalks are ~2 m wide)
PATH_SPACING = 1.0  # m between path points: a path's arc length is its point index
# Leaderboard constants (scenarios.md §3)
DOC_DISTANCE, DOC_SPEED, DOC_REACT, DOC_MIN_DIST, DOC_END_M = 12.0, 2.0, 2.1, 6.0, 40.0
DOC_BLOCKER_HALF = (0.5, 0.6)  # m: a vending machine's footprint (approximate; not in the scenario's source)
WALKER_HEIGHT = 1.2  # m the pedestrian spawns above C (in its collision distance)
FLOW_SPEED, FLOW_GAP = 20.0, (25.0, 50.0)
LEFT_SOURCE, LEFT_SINK, RIGHT_SOURCE, RIGHT_SINK = 4.0, 2.5, 5.0, 3.0  # times flow_speed, m
JUNCTION_END_M, GREEN_DELAY, SCENARIO_TIMEOUT = 10.0, 5.0, 240.0
LOSS_PATCHES, LOSS_RADIUS, LOSS_END_M = (14.0, 48.0, 74.0), 2.0, 110.0
SITE_LEAD = (15, 40)  # m: a training route's junction scenario triggers U(15, 40) m before its junction
LEFT_EXIT_CLEAR, RIGHT_EXIT_CLEAR = 70.0, 80.0  # m of the ego's exit road cleared of background (extend_road_exit)
RED_SPEED, RED_SOURCE, RED_SINK, RED_REACT, RED_MIN_DIST = 60 / 3.6, 30.0, 10.0, 2.2, 12.0
EMERGENCY_HALF = (3.2, 1.2)  # m: an ambulance-sized emergency vehicle
TURN_AFTER, TURN_SPEED, TURN_REACT, TURN_MIN_DIST, TURN_END_M = 11.0, 1.8, 1.8, 6.0, 40.0
BICYCLE_HALF = (0.9, 0.4)


class ScenarioSkip(Exception):
    """A scenario that cannot be placed on its map; the message says why."""


@dataclass
class ScenarioTables:
    """Every placed scenario of the route bank (``S`` rows, padded with one inert row), and each route's scenarios
    (``route_scn`` [NR, K], -1 padding, in route order). Paths are polylines 1 m apart (arc length = index)."""

    route_scn: Tensor  # [NR, K] long
    type: Tensor  # [S] long: index into SCENARIO_TYPES
    group: Tensor  # [S] long: actor slot group, -1 none
    act_first: Tensor  # [S] long: the route points whose trigger circle activates it: act_first .. act_last
    act_last: Tensor
    c_xy: Tensor  # [S, 2] the conflict point the start rule measures the ego's time to arrival at
    path: Tensor  # [S, P, 2] the actors' path
    path_len: Tensor  # [S] m
    path_last: Tensor  # [S] long: its last segment (points 0 .. path_last + 1; the rest pads)
    path_junction: Tensor  # [S, P] bool: path points inside the junction (no pre-filled flow car there)
    speed: Tensor  # [S] m/s of the actors
    react: Tensor  # [S] s: actors start when the ego's time to arrival at c_xy falls below this ...
    min_dist: Tensor  # [S] m: ... or its distance to c_xy below this
    move_dist: Tensor  # [S] m an actor travels before it is removed (inf: to the path's end)
    gap_lo: Tensor  # [S] m: a flow's next car spawns once the last one is this far (uniform lo..hi) from the source
    gap_hi: Tensor
    prefill: Tensor  # [S] bool: the flow starts filled along its path
    light_junction: Tensor  # [S] long: light junction whose lights it overrides (-1 none)
    light_ego: Tensor  # [S] long: the ego's light group there
    light_src: Tensor  # [S] long: the flow's light group (-1 none)
    ego_red_s: Tensor  # [S] s the ego's light stays red after activation (then green)
    timeout_s: Tensor  # [S] s after activation that end it as a scenario timeout (inf: none)
    end_idx: Tensor  # [S] long: it ends when the ego reaches this route point (-1: by distance)
    end_after_m: Tensor  # [S] m the ego drives after its actors are done (or after activation: end_from_act)
    end_from_act: Tensor  # [S] bool
    show_early: Tensor  # [S] bool: its actor stands visible before activation (the cyclist)
    blocker_xy: Tensor  # [S, 2] a static blocker (-: none, blocker_on False)
    blocker_yaw: Tensor
    blocker_on: Tensor
    actor_half: Tensor  # [S, 2] single actors' half extent (flows draw car sizes)
    emergency: Tensor  # [S] bool: its vehicle shows emergency lights
    patch_idx: Tensor  # [S, 3] long: ControlLoss's debris patches as route points (-1 none)
    patch_xy: Tensor  # [S, 3, 2]
    clear_junction: Tensor  # [S] long: junction whose background vehicles are removed while it is live (-1 none)
    clear_lane: Tensor  # [S, C] long: ... and those on these lanes (-1 padding) ...
    clear_lo: Tensor  # [S, C] ... from this many metres along the lane ...
    clear_hi: Tensor  # [S, C] ... to this many (inf: its end)

    @property
    def slots(self) -> int:
        return self.route_scn.shape[1]


# ---------------------------------------------------------------------------------------------- the map's roads
class Roads:
    """The lane graph's junction topology, as the scenario classes query it (``scenario_helper``)."""

    def __init__(self, graph: LaneGraph):
        self.g = graph
        self.pred = graph.predecessors()
        self.lens = graph.lane_lengths()
        L = graph.num_lanes
        self.entries: dict[int, list[int]] = {}
        for lane in range(L):
            if graph.is_junction[lane]:
                continue
            for nxt in graph.successors(lane):
                j = int(graph.junction[nxt])
                if graph.is_junction[nxt] and j >= 0 and lane not in self.entries.setdefault(j, []):
                    self.entries[j].append(lane)
        self.lane_stop = np.full(L, -1, np.int64)
        self.lane_stop[graph.stop_lane] = np.arange(len(graph.stop_lane))

    def heading(self, lane: int, at_end: bool = True) -> float:
        p = self.g.lane_points(lane)
        d = p[-1] - p[-2] if at_end else p[1] - p[0]
        return math.atan2(d[1], d[0])

    def light(self, lane: int) -> int:
        """The light group at the end of ``lane`` (-1: none)."""
        k = self.lane_stop[lane]
        return int(self.g.stop_light_group[k]) if k >= 0 and self.g.stop_control[k] == CONTROL_LIGHT else -1

    def direction_class(self, ego_lane: int, lane: int) -> str:
        """``filter_junction_wp_direction``: the heading difference in CARLA's clockwise degrees, mod 360."""
        d = math.degrees(self.heading(ego_lane) - self.heading(lane)) % 360.0
        if 135 < d <= 225:
            return "opposite"
        if 30 < d <= 135:
            return "left"
        if 225 < d <= 330:
            return "right"
        return "same"

    def back(self, lane: int, dist: float) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """The polyline from ``dist`` m before the end of ``lane`` up to its end, going back through predecessors
        and stopping at a previous junction; with its per-point junction flags and the lanes it runs on."""
        parts, need = [lane], dist - self.lens[lane]
        while need > 0:
            prev = [p for p in self.pred[parts[0]] if not self.g.is_junction[p]]
            if not prev:
                break
            parts.insert(0, min(prev, key=lambda p: _turn(self.heading(p), self.heading(parts[0], False))))
            need -= self.lens[parts[0]]
        pts, junction = self._chain(parts)
        cum = _cumulative(pts)
        keep = cum >= cum[-1] - dist - 1e-6
        first = max(int(np.argmax(keep)) - 1, 0)
        return _cut_start(pts, cum, cum[-1] - dist, first), junction[first:], parts

    def straight_through(self, entry: int, beyond: float) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """``generate_target_waypoint(wp, 0)`` then ``beyond`` m: from the end of ``entry`` straight through its
        junction and on along the straightest successors; with per-point junction flags and the lanes it runs on."""
        inside = [n for n in self.g.successors(entry) if self.g.is_junction[n]]
        if not inside:
            raise ScenarioSkip(f"lane {entry} does not enter a junction")
        h = self.heading(entry)
        parts = [min(inside, key=lambda n: _turn(h, self.heading(int(n))))]
        need = beyond
        while True:
            nxt = list(self.g.successors(int(parts[-1])))
            if not nxt or (need <= 0 and not self.g.is_junction[parts[-1]]):
                break
            parts.append(min(nxt, key=lambda n: _turn(self.heading(int(parts[-1])), self.heading(int(n), False))))
            if not self.g.is_junction[parts[-1]]:
                need -= self.lens[parts[-1]]
        parts = [int(p) for p in parts]
        pts, junction = self._chain(parts)
        # cut ``beyond`` m after the junction's exit (the first non-junction point)
        exit_k = int(np.argmax(~junction)) if (~junction).any() else len(pts) - 1
        cum = _cumulative(pts)
        end = np.searchsorted(cum, cum[exit_k] + beyond) + 1
        return pts[:end], junction[:end], parts

    def _chain(self, lanes: list[int]) -> tuple[np.ndarray, np.ndarray]:
        pts, flags = [], []
        for k, lane in enumerate(lanes):
            p = self.g.lane_points(lane)[(1 if k else 0):]
            pts.append(p)
            flags.append(np.full(len(p), bool(self.g.is_junction[lane])))
        return np.concatenate(pts).astype(np.float64), np.concatenate(flags)

    def kerb_offset(self, lane: int) -> float:
        """Metres from the centre of ``lane`` to the right kerb (over the same-direction lanes to its right)."""
        off, seen = self.g.width[lane] / 2, {lane}
        while self.g.right[lane] >= 0 and int(self.g.right[lane]) not in seen:
            lane = int(self.g.right[lane])
            seen.add(lane)
            off += self.g.width[lane]
        return float(off)


def _turn(a: float, b: float) -> float:
    return abs((a - b + math.pi) % (2 * math.pi) - math.pi)


def _cumulative(p: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.linalg.norm(np.diff(p, axis=0), axis=1))])


def _cut_start(pts: np.ndarray, cum: np.ndarray, s0: float, first: int) -> np.ndarray:
    out = pts[first:].copy()
    if s0 > cum[first] and first + 1 < len(pts):
        t = (s0 - cum[first]) / max(cum[first + 1] - cum[first], 1e-9)
        out[0] = pts[first] + (pts[first + 1] - pts[first]) * min(t, 1.0)
    return out


def dense_path(pts: np.ndarray, flags: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A polyline resampled every :data:`PATH_SPACING` m (arc length = index), with the nearest flags."""
    cum = _cumulative(pts)
    s = np.arange(0.0, cum[-1] + 1e-9, PATH_SPACING)
    if s[-1] < cum[-1] - 1e-6:
        s = np.append(s, cum[-1])
    out = np.stack([np.interp(s, cum, pts[:, 0]), np.interp(s, cum, pts[:, 1])], -1)
    f = np.zeros(len(s), bool) if flags is None else flags[np.clip(np.searchsorted(cum, s), 0, len(flags) - 1)]
    return out, f


# ---------------------------------------------------------------------------------------------- one scenario
class _RouteGeo:
    """A route's points, arc lengths, lanes and junction flags, and walks along it."""

    def __init__(self, route: Route, roads: Roads):
        self.pts, self.lanes = route.points.astype(np.float64), route.lanes.astype(np.int64)
        self.cum = route.cumulative()
        self.junction = roads.g.is_junction[self.lanes]
        self.n = len(self.pts)

    def walk(self, i: int, d: float) -> int:
        return int(min(np.searchsorted(self.cum, self.cum[i] + d - 1e-6), self.n - 1))

    def point_at(self, i: int, d: float) -> tuple[np.ndarray, float]:
        """The route's point ``d`` m after point ``i`` (interpolated; clamped at the route's end) and its heading."""
        s = min(self.cum[i] + d, self.cum[-1])
        k = int(min(max(np.searchsorted(self.cum, s) - 1, 0), self.n - 2))
        t = (s - self.cum[k]) / max(self.cum[k + 1] - self.cum[k], 1e-9)
        return self.pts[k] + (self.pts[k + 1] - self.pts[k]) * t, self.yaw(k)

    def yaw(self, i: int) -> float:
        a, b = (i, i + 1) if i + 1 < self.n else (i - 1, i)
        d = self.pts[b] - self.pts[a]
        return math.atan2(d[1], d[0])

    def junction_after(self, i: int) -> tuple[int, int]:
        """(first route point in a junction at or after ``i``, first point after it out of the junction)."""
        inside = np.nonzero(self.junction[i:])[0]
        if not len(inside):
            raise ScenarioSkip("no junction on the route after its trigger")
        j_in = i + int(inside[0])
        out = np.nonzero(~self.junction[j_in:])[0]
        if j_in == 0 or not len(out):
            raise ScenarioSkip("the route starts or ends inside the junction after its trigger")
        return j_in, j_in + int(out[0])


def _base(kind: int) -> dict:
    inf = math.inf
    return dict(type=kind, c_xy=np.zeros(2), path=np.zeros((2, 2)), path_junction=np.zeros(2, bool), speed=0.0,
                react=0.0, min_dist=0.0, move_dist=inf, gap_lo=0.0, gap_hi=0.0, prefill=False, light_junction=-1,
                light_ego=-1, light_src=-1, ego_red_s=0.0, timeout_s=inf, end_idx=-1, end_after_m=0.0,
                end_from_act=False, show_early=False, blocker_xy=np.zeros(2), blocker_yaw=0.0, blocker_on=False,
                actor_half=np.zeros(2), emergency=False, patch_idx=np.full(3, -1), patch_xy=np.zeros((3, 2)),
                clear_junction=-1, clear_lane=np.zeros(0, np.int64), clear_lo=np.zeros(0), clear_hi=np.zeros(0))


def _same_direction(roads: Roads, lanes: list[int]) -> list[int]:
    """``lanes`` and their same-direction neighbours (``get_same_dir_lanes``)."""
    out: list[int] = []
    for lane in lanes:
        if lane not in out:
            out.append(lane)
        for side in (roads.g.left, roads.g.right):
            k = int(side[lane])
            while k >= 0 and k not in out:
                out.append(k)
                k = int(side[k])
    return out


def _background_hooks(geo: _RouteGeo, roads: Roads, j_in: int, j_out: int, remove: list[int], exit_m: float
                      ) -> dict:
    """``HandleJunctionScenario`` (``ba._handle_junction_scenario``) as what the step removes of the background
    traffic while the scenario is live: every vehicle in its junction (``clear_junction``), on the ego's approach
    (``clear_ego_entry``) and on the ``remove`` lanes (the entries and exits the scenario names), and on the first
    ``exit_m`` m of the ego's exit road (``extend_road_exit``, which pushes them that far on). A lane segment is
    (lane, from, to) in metres along the lane."""
    lanes = [int(geo.lanes[j_in - 1]), *remove]
    lo, hi = [0.0] * len(lanes), [math.inf] * len(lanes)
    # the exit road's lanes, each up to exit_m from the junction
    for k in range(j_out, geo.walk(j_out, exit_m) + 1 if exit_m > 0 else j_out):
        lane = int(geo.lanes[k])
        if roads.g.is_junction[lane]:
            break
        at = _lane_arc(roads, lane, geo.pts[k])
        reach = at + exit_m - (geo.cum[k] - geo.cum[j_out])
        if lane in lanes:
            hi[lanes.index(lane)] = max(hi[lanes.index(lane)], reach)
        else:
            lanes.append(lane)
            lo.append(0.0)
            hi.append(reach)
    return dict(clear_junction=int(roads.g.junction[geo.lanes[j_in]]), clear_lane=np.array(lanes, np.int64),
                clear_lo=np.array(lo), clear_hi=np.array(hi))


def _lane_arc(roads: Roads, lane: int, xy: np.ndarray) -> float:
    """Metres along ``lane`` to its point nearest ``xy``."""
    p = roads.g.lane_points(lane)
    return float(_cumulative(p)[int(np.argmin(np.linalg.norm(p - xy, axis=1)))])


def _sidewalk_actor(geo: _RouteGeo, roads: Roads, i: int, d: float, ahead: float, angle: float
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """A crossing actor on the right sidewalk abreast of C, ``d`` m after route point ``i`` (``ahead`` m further
    on), facing the road turned by ``angle``: (C, start, unit direction, lane yaw)."""
    c_xy, yaw = geo.point_at(i, d)
    lane = int(geo.lanes[geo.walk(i, d)])
    fwd, right = np.array([math.cos(yaw), math.sin(yaw)]), np.array([math.sin(yaw), -math.cos(yaw)])
    start = c_xy + fwd * ahead + right * (roads.kerb_offset(lane) + SIDEWALK_M)
    heading = yaw + math.pi / 2 + angle
    return c_xy, start, np.array([math.cos(heading), math.sin(heading)]), yaw


def _crossing(start: np.ndarray, direction: np.ndarray, length: float) -> np.ndarray:
    """A straight crossing path from ``start``, every metre."""
    return dense_path(np.stack([start, start + direction * length]))[0]


def dynamic_object_crossing(sd: ScenarioDef, geo: _RouteGeo, roads: Roads, i: int) -> dict:
    """``DynamicObjectCrossing``: a blocker on the right sidewalk abreast of C (12 m on), a pedestrian just beyond
    it who walks across at 2 m/s once the ego is < 2.1 s or < 6 m from C, for twice its distance to C."""
    direction = sd.params.get("direction", {}).get("value", "right")
    if direction != "right":
        raise ScenarioSkip(f"direction={direction!r}: only 'right' (the default, and longest6's) is played")
    dist, angle = sd.value("distance", DOC_DISTANCE), sd.value("crossing_angle", 0.0)
    if abs(angle) > 90:
        raise ScenarioSkip(f"crossing_angle={angle}: must lie in [-90, 90]")
    if geo.cum[-1] - geo.cum[i] < dist:
        raise ScenarioSkip(f"the route ends less than {dist:.0f} m after the trigger")
    c, start, d, yaw = _sidewalk_actor(geo, roads, i, dist, DOC_BLOCKER_HALF[0] + 0.5, math.radians(angle))
    collision = math.sqrt(float(np.sum((start - c) ** 2)) + WALKER_HEIGHT ** 2)
    out = _base(DOC)
    out.update(c_xy=c, path=_crossing(start, d, 2 * collision), speed=DOC_SPEED,
               react=DOC_REACT + 0.1 * math.floor(angle / 5), min_dist=DOC_MIN_DIST, move_dist=2 * collision,
               end_after_m=DOC_END_M, blocker_on=True, actor_half=np.array([0.3, 0.3]),
               blocker_xy=start - np.array([math.cos(yaw), math.sin(yaw)]) * (DOC_BLOCKER_HALF[0] + 0.5),
               blocker_yaw=yaw - math.pi / 2)
    return out


def control_loss(sd: ScenarioDef, geo: _RouteGeo, roads: Roads, i: int) -> dict:
    """``ControlLoss``: three debris patches 14/48/74 m on (stopping at the first junction); the ego's controls get
    noise while it is within 2 m of one; it ends 110 m after activation."""
    stop = int(np.argmax(geo.junction[i:])) + i if geo.junction[i:].any() else geo.n - 1
    idx = np.array([min(geo.walk(i, d), stop) for d in LOSS_PATCHES])
    out = _base(LOSS)
    out.update(patch_idx=idx, patch_xy=geo.pts[idx], end_after_m=LOSS_END_M, end_from_act=True)
    return out


def _junction(geo: _RouteGeo, roads: Roads, i: int) -> tuple[int, int, int, int]:
    """(junction entry route point, exit route point, the ego's approach lane, its light group)."""
    j_in, j_out = geo.junction_after(i)
    approach = int(geo.lanes[j_in - 1])
    ego_light = roads.light(approach)
    if ego_light < 0:
        raise ScenarioSkip("the junction after the trigger has no traffic light on the ego's approach")
    return j_in, j_out, approach, ego_light


def _entry(roads: Roads, approach: int, side: str, target_deg: float, rng: np.random.Generator | None) -> int:
    """An entry lane of the approach's junction coming from ``side`` (random among them with ``rng``, else the
    one whose heading difference is nearest ``target_deg``)."""
    j = int(roads.g.junction[[n for n in roads.g.successors(approach) if roads.g.is_junction[n]][0]])
    cands = [e for e in roads.entries.get(j, []) if e != approach and roads.direction_class(approach, e) == side]
    if not cands:
        raise ScenarioSkip(f"its junction has no entry lane from the ego's {side} side")
    if rng is not None:
        return int(cands[rng.integers(len(cands))])
    d = [abs(math.degrees(roads.heading(approach) - roads.heading(e)) % 360.0 - target_deg) for e in cands]
    return int(cands[int(np.argmin(d))])


def junction_flow(sd: ScenarioDef, geo: _RouteGeo, roads: Roads, i: int, rng: np.random.Generator) -> dict:
    """``SignalizedJunctionLeftTurn`` (an opposite stream, source 4v back, sink 2.5v past the exit) and
    ``SignalizedJunctionRightTurn`` (the rightmost lane of the stream from the ego's left, 5v back, 3v past,
    pre-filled): constant ``flow_speed`` cars every U(25, 50) m; ego light red for 5 s then green, the flow's
    green, the junction's others red; ends 10 m after the ego leaves the junction, or after 240 s (timeout)."""
    kind = SCENARIO_TYPES.index(sd.type)
    v = sd.value("flow_speed", FLOW_SPEED)
    lo, hi = sd.number("source_dist_interval", "from", FLOW_GAP[0]), sd.number("source_dist_interval", "to", FLOW_GAP[1])
    if not (v > 0 and 0 < lo <= hi):
        raise ScenarioSkip(f"flow_speed={v}, source_dist_interval=({lo}, {hi}): need a positive speed and 0 < from <= to")
    j_in, j_out, approach, ego_light = _junction(geo, roads, i)
    if kind == LEFT:
        source = _entry(roads, approach, "opposite", 180.0, rng)
        back, beyond = LEFT_SOURCE * v, LEFT_SINK * v
    else:
        source = _entry(roads, approach, "left", 90.0, None)
        while roads.g.right[source] >= 0:  # its rightmost lane
            source = int(roads.g.right[source])
        back, beyond = RIGHT_SOURCE * v, RIGHT_SINK * v
    p0, f0, entries = roads.back(source, back)
    p1, f1, through = roads.straight_through(source, beyond)
    path, flags = dense_path(np.concatenate([p0, p1[1:]]), np.concatenate([f0, f1[1:]]))
    src_light = roads.light(source)
    # the background hooks: the source road's lanes; a left turn also the sink road's (a right turn's sink is the
    # ego's exit road, cleared for RIGHT_EXIT_CLEAR m)
    remove = _same_direction(roads, entries)
    if kind == LEFT:
        remove += [k for k in _same_direction(roads, [p for p in through if not roads.g.is_junction[p]])
                   if k not in remove]
    out = _base(kind)
    out.update(path=path, path_junction=flags, speed=v, gap_lo=lo, gap_hi=hi, prefill=kind == RIGHT,
               light_junction=int(roads.g.light_junction[ego_light]), light_ego=ego_light, light_src=src_light,
               ego_red_s=GREEN_DELAY, timeout_s=SCENARIO_TIMEOUT, end_idx=geo.walk(j_out, JUNCTION_END_M),
               **_background_hooks(geo, roads, j_in, j_out, remove,
                                   LEFT_EXIT_CLEAR if kind == LEFT else RIGHT_EXIT_CLEAR))
    return out


def _line_intersection(a0: np.ndarray, a1: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> np.ndarray | None:
    da, db = a1 - a0, b1 - b0
    den = da[0] * db[1] - da[1] * db[0]
    if abs(den) < 1e-9:
        return None
    t = ((b0[0] - a0[0]) * db[1] - (b0[1] - a0[1]) * db[0]) / den
    return a0 + da * t


def opposite_vehicle_running_red_light(sd: ScenarioDef, geo: _RouteGeo, roads: Roads, i: int) -> dict:
    """``OppositeVehicleRunningRedLight``: an emergency vehicle 30 m up the entry from the ego's right drives
    straight through at 60 km/h once the ego is < 2.2 s or < 12 m from the crossing point C; ego light green, the
    junction's others red until the ego leaves the junction; removed after straight(spawn, sink) / speed."""
    side = sd.params.get("direction", {}).get("value", "right")
    if side not in ("right", "left"):
        raise ScenarioSkip(f"direction={side!r}: use 'right' or 'left'")
    j_in, j_out, approach, ego_light = _junction(geo, roads, i)
    entry = _entry(roads, approach, side, 270.0 if side == "right" else 90.0, None)
    p0, f0, entries = roads.back(entry, RED_SOURCE)
    p1, f1, through = roads.straight_through(entry, RED_SINK)
    path, flags = dense_path(np.concatenate([p0, p1[1:]]), np.concatenate([f0, f1[1:]]))
    ego_pts, adv_pts = roads.g.lane_points(approach), roads.g.lane_points(entry)
    c = _line_intersection(ego_pts[-2], ego_pts[-1], adv_pts[-2], adv_pts[-1])
    if c is None:
        raise ScenarioSkip("the adversary's entry runs parallel to the ego's approach (no crossing point)")
    out = _base(RED)
    out.update(c_xy=c, path=path, path_junction=flags, speed=RED_SPEED, react=RED_REACT, min_dist=RED_MIN_DIST,
               move_dist=float(np.linalg.norm(path[-1] - path[0])), light_junction=int(roads.g.light_junction[ego_light]),
               light_ego=ego_light, end_idx=j_out, actor_half=np.array(EMERGENCY_HALF), emergency=True,
               **_background_hooks(geo, roads, j_in, j_out, entries + [p for p in through if not roads.g.is_junction[p]],
                                   0.0))
    return out


def vehicle_turning_route(sd: ScenarioDef, geo: _RouteGeo, roads: Roads, i: int) -> dict:
    """``VehicleTurningRoute``: a bicycle on the right sidewalk 11 m past the junction's exit, visible from the start,
    crossing at 1.8 m/s once the ego is < 1.8 s or < 6 m from C, for twice its distance to C."""
    _, j_out = geo.junction_after(i)
    if geo.cum[-1] - geo.cum[j_out] < TURN_AFTER:
        raise ScenarioSkip("the route ends less than 11 m after the junction")
    c, start, d, _ = _sidewalk_actor(geo, roads, j_out, TURN_AFTER, 0.0, 0.0)
    dist = 2 * math.sqrt(float(np.sum((start - c) ** 2)) + 0.2 ** 2)
    out = _base(TURN)
    out.update(c_xy=c, path=_crossing(start, d, dist), speed=TURN_SPEED, react=TURN_REACT,
               min_dist=TURN_MIN_DIST, move_dist=dist, end_after_m=TURN_END_M, show_early=True,
               actor_half=np.array(BICYCLE_HALF))
    return out


def place_scenario(rs: RouteScenario, geo: _RouteGeo, roads: Roads, rng: np.random.Generator) -> dict:
    """The tables' row of one kept scenario (raises :class:`ScenarioSkip`)."""
    kind, i = SCENARIO_TYPES.index(rs.defn.type), max(rs.nearest, rs.index)
    if kind == DOC:
        row = dynamic_object_crossing(rs.defn, geo, roads, i)
    elif kind == LOSS:
        row = control_loss(rs.defn, geo, roads, i)
    elif kind in (LEFT, RIGHT):
        row = junction_flow(rs.defn, geo, roads, i, rng)
    elif kind == RED:
        row = opposite_vehicle_running_red_light(rs.defn, geo, roads, i)
    else:
        row = vehicle_turning_route(rs.defn, geo, roads, i)
    row.update(act_first=rs.index, act_last=max(rs.last, rs.index))
    return row


# ---------------------------------------------------------------------------------------------- the route bank
def compile_scenarios(graph: LaneGraph, routes: list[Route], device: torch.device, seed: int = 2000
                      ) -> tuple[ScenarioTables, list[tuple[RouteScenario, ...]]]:
    """The tables of every route's kept scenarios, and each route's scenarios with the reason of those skipped
    here (a warning names route, scenario and reason). ``seed``: the random choice of a left turn's source lane
    (the Leaderboard's CarlaDataProvider seed)."""
    roads = Roads(graph) if any(r.scenarios for r in routes) else None
    rows, per_route, accounted = [], [], []
    for r in routes:
        ids, acc = [], []
        geo = _RouteGeo(r, roads) if r.scenarios else None
        family_count: dict[int, int] = {}
        for rs in r.scenarios:
            if rs.kept:
                try:
                    row = place_scenario(rs, geo, roads, np.random.default_rng([seed, len(rows)]))
                except (ScenarioSkip, RouteError) as e:  # the Leaderboard, too, skips a scenario it cannot set up
                    why = "cannot be placed on the map" if isinstance(e, ScenarioSkip) else "bad parameter"
                    rs = replace(rs, index=-1, reason=f"{why}: {e}")
                    log.warning("%s: scenario %s (%s) skipped: %s", r.source or r.name, rs.defn.name, rs.defn.type,
                                rs.reason)
                else:
                    first, count = GROUP_FAMILY.get(row["type"], (-1, 1))
                    o = family_count.get(first, 0)
                    family_count[first] = o + 1
                    row["group"] = first + o % count if first >= 0 else -1
                    ids.append(len(rows))
                    rows.append(row)
            acc.append(rs)
        per_route.append(ids)
        accounted.append(tuple(acc))
    return _tables(rows, per_route, device), accounted


def _tables(rows: list[dict], per_route: list[list[int]], device: torch.device) -> ScenarioTables:
    pad = _base(LOSS)
    pad.update(group=-1, act_first=-1, act_last=-2)  # never activates
    rows = rows + [pad]
    order = [sorted(ids, key=lambda k: rows[k]["act_first"]) for ids in per_route]
    K = max(1, max((len(o) for o in order), default=0))
    route_scn = np.full((len(per_route), K), -1, np.int64)
    for r, ids in enumerate(order):
        route_scn[r, :len(ids)] = ids
    P = max(len(row["path"]) for row in rows)
    path = np.stack([np.concatenate([row["path"], np.repeat(row["path"][-1:], P - len(row["path"]), 0)]) for row in rows])
    junction = np.stack([np.pad(row["path_junction"], (0, P - len(row["path_junction"]))) for row in rows])
    t = lambda key, dtype=torch.float32: torch.as_tensor(np.array([row[key] for row in rows]), dtype=dtype,  # noqa
                                                        device=device)
    lens = np.array([_cumulative(row["path"])[-1] for row in rows])
    C = max(1, max(len(row["clear_lane"]) for row in rows))
    segs = lambda key, fill: torch.as_tensor(np.stack([np.pad(row[key], (0, C - len(row[key])), constant_values=fill)  # noqa
                                                        for row in rows]), device=device)
    return ScenarioTables(
        route_scn=torch.as_tensor(route_scn, device=device), type=t("type", torch.long), group=t("group", torch.long),
        act_first=t("act_first", torch.long), act_last=t("act_last", torch.long), c_xy=t("c_xy"),
        path=torch.as_tensor(path, dtype=torch.float32, device=device), path_len=torch.as_tensor(lens, dtype=torch.float32, device=device),
        path_last=torch.as_tensor([max(len(row["path"]) - 2, 0) for row in rows], dtype=torch.long, device=device),
        path_junction=torch.as_tensor(junction, device=device), speed=t("speed"), react=t("react"),
        min_dist=t("min_dist"), move_dist=t("move_dist"), gap_lo=t("gap_lo"), gap_hi=t("gap_hi"),
        prefill=t("prefill", torch.bool), light_junction=t("light_junction", torch.long),
        light_ego=t("light_ego", torch.long), light_src=t("light_src", torch.long), ego_red_s=t("ego_red_s"),
        timeout_s=t("timeout_s"), end_idx=t("end_idx", torch.long), end_after_m=t("end_after_m"),
        end_from_act=t("end_from_act", torch.bool), show_early=t("show_early", torch.bool),
        blocker_xy=t("blocker_xy"), blocker_yaw=t("blocker_yaw"), blocker_on=t("blocker_on", torch.bool),
        actor_half=t("actor_half"), emergency=t("emergency", torch.bool), patch_idx=t("patch_idx", torch.long),
        patch_xy=t("patch_xy"), clear_junction=t("clear_junction", torch.long), clear_lane=segs("clear_lane", -1),
        clear_lo=segs("clear_lo", 0.0).float(), clear_hi=segs("clear_hi", 0.0).float())


# ---------------------------------------------------------------------------------------------- training routes
def random_route_scenarios(graph: LaneGraph, route: Route, per_km: float, weights: tuple[float, ...],
                           rng: np.random.Generator) -> tuple[RouteScenario, ...]:
    """Scenarios of the six types on a training route: Poisson(``per_km`` x length) of them, each type by
    ``weights`` (SCENARIO_TYPES order) among the types the route can still play, each trigger at a random route
    point where its type can be played (the junction types and the cyclist 15-40 m before a junction the route turns
    at as the type needs and after the junction before it, with a light for the junction types, and the entry lane
    their stream or red-light runner comes from: a site where :func:`place_scenario` would skip the type is no
    site). A junction holds one scenario, as in longest6's route files (4 pairs of its 233 junction scenarios trigger
    within 30 m of each other): a second flow there would preempt the first and restart its stream."""
    if per_km <= 0 or sum(weights) <= 0:
        return ()
    roads = _roads_cache(graph)
    geo = _RouteGeo(route, roads)
    lead = _site_leads(geo)  # junction entry point -> the farthest a trigger may lie before it
    turn = {k: _route_turn(geo, k) for k in lead}  # degrees, left positive
    lit = [k for k in lead if roads.light(int(geo.lanes[k - 1])) >= 0]
    where = {LEFT: [k for k in lit if turn[k] > 30], RIGHT: [k for k in lit if turn[k] < -30],
             RED: [k for k in lit if abs(turn[k]) <= 30], TURN: [k for k in lead if abs(turn[k]) > 30]}
    for kind in where:  # and whose junction has what they need (entry lanes, room after it; else skipped at compile)
        where[kind] = [k for k in where[kind] if _places(kind, geo, roads, k)]
    out, used = [], set()
    for n in range(rng.poisson(per_km * geo.cum[-1] / 1000.0)):
        # only the types the route has a free site for are drawn, so the density holds while sites last
        free = {k: [t for t in sites if t not in used] for k, sites in where.items()}
        playable = np.asarray([w if free.get(k, True) else 0.0 for k, w in enumerate(weights)])
        if playable.sum() <= 0:
            break
        kind = int(rng.choice(len(SCENARIO_TYPES), p=playable / playable.sum()))
        targets = free.get(kind)
        if targets is not None:
            site = int(targets[rng.integers(len(targets))])
            used.add(site)
            i = site - int(rng.uniform(SITE_LEAD[0], lead[site] + 1))
        else:
            i = int(rng.integers(0, max(1, geo.n - 20)))
        sd = ScenarioDef(f"{SCENARIO_TYPES[kind]}_{n}", SCENARIO_TYPES[kind], tuple(geo.pts[i]), geo.yaw(i))
        out.extend(scenarios_on_route([sd], geo.pts, route.name))
    return tuple(sorted(out, key=lambda rs: rs.index))


def start_before_scenario(route: Route, rng: np.random.Generator, lead_m: tuple[float, float] = (20.0, 60.0)
                          ) -> Route:
    """``route`` cut to start U(``lead_m``) m before the trigger of one of its scenarios (uniform among them), with
    the scenarios from there on: a training curriculum that meets a scenario within seconds of each start, not after
    hundreds of metres of plain driving (``env.options.scenario_start``)."""
    pick = route.scenarios[int(rng.integers(len(route.scenarios)))]
    i0 = max(0, pick.index - int(rng.uniform(*lead_m)))
    kept = tuple(replace(rs, index=rs.index - i0, last=rs.last - i0, nearest=rs.nearest - i0)
                 for rs in route.scenarios if rs.kept and rs.index >= i0)
    return Route(route.name, route.points[i0:], route.lanes[i0:], kept)


def _site_leads(geo: _RouteGeo) -> dict[int, int]:
    """The route's junction entry points that can take a junction scenario, each with the farthest its trigger may
    lie before it (points, ~1 m): at most ``SITE_LEAD[1]``, and after the previous junction with the trigger's 2 m
    circle clear of it, since a trigger before an earlier junction plays its scenario there (or skips it); at least
    ``SITE_LEAD[0]``, else the entry is no site."""
    j = geo.junction
    entries = np.nonzero(j[1:] & ~j[:-1])[0] + 1
    last = np.maximum.accumulate(np.where(j, np.arange(geo.n), -1))  # the last junction point up to each point
    hi = np.minimum(SITE_LEAD[1], entries - last[entries - 1] - 3)
    return {int(k): int(h) for k, h in zip(entries, hi) if h >= SITE_LEAD[0]}


def _places(kind: int, geo: _RouteGeo, roads: Roads, k: int) -> bool:
    """Whether a junction scenario of ``kind`` triggered ``SITE_LEAD[0]`` m before the junction the route enters at
    point ``k`` can be placed (:func:`place_scenario` does not skip it; nor at any lead up to the site's)."""
    i = k - SITE_LEAD[0]
    sd = ScenarioDef("site", SCENARIO_TYPES[kind], tuple(geo.pts[i]), geo.yaw(i))
    try:
        place_scenario(scenarios_on_route([sd], geo.pts)[0], geo, roads, np.random.default_rng(0))
    except ScenarioSkip:
        return False
    return True


def _route_turn(geo: _RouteGeo, k: int) -> float:
    """How far the route turns through the junction it enters at point ``k`` (degrees, left positive)."""
    out = k + int(np.argmax(~geo.junction[k:])) if (~geo.junction[k:]).any() else geo.n - 1
    a, b = geo.yaw(max(k - 2, 0)), geo.yaw(min(out + 1, geo.n - 1))
    return math.degrees((b - a + math.pi) % (2 * math.pi) - math.pi)


_ROADS: dict[int, Roads] = {}


def _roads_cache(graph: LaneGraph) -> Roads:
    if id(graph) not in _ROADS:
        _ROADS.clear()  # one graph at a time: worlds are built map by map
        _ROADS[id(graph)] = Roads(graph)
    return _ROADS[id(graph)]

"""Tests of envs.maps.routes: random routes, keypoint planning and leaderboard route files."""
from __future__ import annotations

import math
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from envs.maps.lanegraph import MARK_BROKEN, Lane, LaneGraph
from envs.maps.routes import Route, RouteError, load_leaderboard_routes, parse_leaderboard_xml, plan_route, random_routes

ROUTES_DIR = Path("/work/shared/data/carla/routes")
LONGEST6_V2 = ROUTES_DIR / "longest6_v2.xml"
LONGEST6_V1 = ROUTES_DIR / "longest6_v1.xml"
TOWNS = {f"Town0{i}" for i in range(1, 7)}


# ---------------------------------------------------------------------------------------------- fixtures
def _arc(radius: float, a0: float, a1: float, n: int = 40) -> np.ndarray:
    a = np.linspace(a0, a1, n)
    return np.stack([radius * np.cos(a), radius * np.sin(a)], axis=1)


def ring_graph() -> LaneGraph:
    """Two counter-clockwise ring lanes (outer r=50, inner r=46.5), each split into four quarter arcs.
    Lanes 0-3 outer, 4-7 inner; inner is the outer lane's left neighbour."""
    lanes = []
    for ring, radius in enumerate((50.0, 46.5)):
        for q in range(4):
            i = 4 * ring + q
            lanes.append(Lane(points=_arc(radius, q * math.pi / 2, (q + 1) * math.pi / 2),
                              successors=[4 * ring + (q + 1) % 4],
                              left=i + 4 if ring == 0 else -1, right=i - 4 if ring == 1 else -1,
                              left_marking=MARK_BROKEN if ring == 0 else 2,
                              right_marking=MARK_BROKEN if ring == 1 else 2))
    return LaneGraph.build("ring", lanes)


def _control(p0: np.ndarray, u0: np.ndarray, p2: np.ndarray, u2: np.ndarray) -> np.ndarray:
    """Quadratic Bezier control point: intersection of p0 + t u0 and p2 - s u2 (midpoint when parallel)."""
    m = np.stack([u0, u2], axis=1)
    if abs(np.linalg.det(m)) < 1e-9:
        return 0.5 * (p0 + p2)
    t, _ = np.linalg.solve(m, p2 - p0)
    return p0 + t * u0


def cross_graph() -> tuple[LaneGraph, dict[str, int]]:
    """A 4-way junction (box half-size 10 m) with 100 m arms, right-hand traffic, one lane per direction except
    the eastbound exit, which has two lanes (the right one only reachable by a lane change). Returns the graph
    and lane ids by name ("in_W", "out_E", "out_E2", "W->N", ...)."""
    half, arm, off = 10.0, 100.0, 1.75
    dirs = {"E": np.array([1.0, 0.0]), "N": np.array([0.0, 1.0]), "W": np.array([-1.0, 0.0]),
            "S": np.array([0.0, -1.0])}
    lanes: list[Lane] = []
    ids: dict[str, int] = {}

    def add(name: str, lane: Lane) -> int:
        ids[name] = len(lanes)
        lanes.append(lane)
        return ids[name]

    for k, d in dirs.items():
        r = np.array([d[1], -d[0]])  # right-hand normal of the outward direction
        add(f"out_{k}", Lane(points=np.stack([d * half + r * off, d * (half + arm) + r * off])))
        add(f"in_{k}", Lane(points=np.stack([d * (half + arm) - r * off, d * half - r * off])))
    # second eastbound exit lane to the right of out_E
    d, r = dirs["E"], np.array([0.0, -1.0])
    add("out_E2", Lane(points=np.stack([d * half + r * 3 * off, d * (half + arm) + r * 3 * off])))
    lanes[ids["out_E"]].right, lanes[ids["out_E"]].right_marking = ids["out_E2"], MARK_BROKEN
    lanes[ids["out_E2"]].left, lanes[ids["out_E2"]].left_marking = ids["out_E"], MARK_BROKEN
    for a, da in dirs.items():
        for b, db in dirs.items():
            if a == b:
                continue
            ra, rb = np.array([da[1], -da[0]]), np.array([db[1], -db[0]])
            p0, p2 = da * half - ra * off, db * half + rb * off
            c = _control(p0, -da, p2, db)
            t = np.linspace(0.0, 1.0, 25)[:, None]
            pts = (1 - t) ** 2 * p0 + 2 * (1 - t) * t * c + t ** 2 * p2
            j = add(f"{a}->{b}", Lane(points=pts, is_junction=True, junction=0, successors=[ids[f"out_{b}"]]))
            lanes[ids[f"in_{a}"]].successors.append(j)
    return LaneGraph.build("cross", lanes), ids


def _dist_to_lane(graph: LaneGraph, lane: int, p: np.ndarray) -> float:
    q = graph.lane_points(lane).astype(np.float64)
    a, b = q[:-1], q[1:]
    ab = b - a
    t = np.clip(((p - a) * ab).sum(1) / np.maximum((ab * ab).sum(1), 1e-12), 0.0, 1.0)
    return float(np.linalg.norm(a + ab * t[:, None] - p, axis=1).min())


def _check_spacing(route: Route) -> None:
    gaps = np.linalg.norm(np.diff(route.points, axis=0), axis=1)
    assert route.points.dtype == np.float32 and route.lanes.dtype == np.int32
    assert route.points.shape == (len(route.lanes), 2)
    assert gaps.max() < 1.5 and gaps.min() > 0.3, (gaps.min(), gaps.max())
    cum = route.cumulative()
    assert cum[0] == 0.0 and np.all(np.diff(cum) > 0) and math.isclose(cum[-1], route.length)


# ---------------------------------------------------------------------------------------------- random routes
def test_random_routes_deterministic_in_range_dense_and_on_lane():
    g = ring_graph()
    a = random_routes(g, 30, (200.0, 600.0), seed=3)
    b = random_routes(g, 30, (200.0, 600.0), seed=3)
    c = random_routes(g, 30, (200.0, 600.0), seed=4)
    assert len(a) == 30
    assert all(np.array_equal(x.points, y.points) and np.array_equal(x.lanes, y.lanes) for x, y in zip(a, b))
    assert not all(np.array_equal(x.points, y.points) for x, y in zip(a, c))
    for r in a:
        assert 200.0 <= r.length <= 600.0
        _check_spacing(r)
        for p, lane in zip(r.points[::7].astype(np.float64), r.lanes[::7]):
            assert _dist_to_lane(g, int(lane), p) < 0.05
        # driving direction: counter-clockwise, so the cross product of position and step is positive
        step = np.diff(r.points, axis=0)
        assert np.all(r.points[:-1, 0] * step[:, 1] - r.points[:-1, 1] * step[:, 0] > 0)


def test_random_routes_with_lane_changes_and_dead_ends():
    g = ring_graph()
    routes = random_routes(g, 40, (150.0, 300.0), seed=0, allow_lane_changes=True)
    changed = 0
    for r in routes:
        _check_spacing(r)
        ring = r.lanes // 4
        changed += int(np.any(ring[1:] != ring[:-1]))
        for p, lane in zip(r.points.astype(np.float64), r.lanes):  # during a change: within a lane of the target
            assert _dist_to_lane(g, int(lane), p) < 3.6
    assert changed > 5
    # the cross junction has dead ends (exits): walks that hit one are redrawn, short routes still work
    cross, _ = cross_graph()
    for r in random_routes(cross, 20, (60.0, 150.0), seed=1):
        assert 60.0 <= r.length <= 150.0
        _check_spacing(r)
    with pytest.raises(RouteError, match="cross"):
        random_routes(cross, 5, (1000.0, 2000.0), seed=1)  # longer than any path of the map
    with pytest.raises(RouteError):
        random_routes(cross, 5, (100.0, 50.0), seed=1)


# ---------------------------------------------------------------------------------------------- plan_route
def test_plan_route_through_junction():
    g, ids = cross_graph()
    r = plan_route(g, np.array([[-60.0, -1.75], [60.0, -1.75]]), name="straight")
    assert r.name == "straight"
    _check_spacing(r)
    assert list(dict.fromkeys(r.lanes.tolist())) == [ids["in_W"], ids["W->E"], ids["out_E"]]
    assert abs(r.length - 120.0) < 0.5
    left = plan_route(g, np.array([[-60.0, -1.75], [1.75, 60.0]]), name="left")
    assert list(dict.fromkeys(left.lanes.tolist())) == [ids["in_W"], ids["W->N"], ids["out_N"]]
    for p, lane in zip(left.points.astype(np.float64), left.lanes):
        assert _dist_to_lane(g, int(lane), p) < 0.05
    # three keypoints, the middle one inside the junction on the right-turn lane
    right = plan_route(g, np.array([[-80.0, -1.75], [-3.5, -4.0], [-1.75, -60.0]]))
    assert ids["W->S"] in right.lanes
    assert np.linalg.norm(right.points[0] - [-80.0, -1.75]) < 0.1
    assert np.linalg.norm(right.points[-1] - [-1.75, -60.0]) < 0.1


def test_plan_route_with_required_lane_change():
    g, ids = cross_graph()
    kps = np.array([[-60.0, -1.75], [80.0, -5.25]])
    r = plan_route(g, kps, name="change")
    _check_spacing(r)
    seq = list(dict.fromkeys(r.lanes.tolist()))
    assert seq == [ids["in_W"], ids["W->E"], ids["out_E"], ids["out_E2"]]
    assert np.linalg.norm(r.points[-1] - kps[1]) < 0.1
    # smooth transition: lateral offset moves monotonically from lane 1 to lane 2 over ~10 m
    on_exit = (r.points[:, 0] > 10.5) & (r.points[:, 0] < 79.0)
    y = r.points[on_exit, 1]
    assert np.all(np.diff(y) <= 1e-4)
    moving = np.flatnonzero((y < -1.80) & (y > -5.20))
    assert 5 <= len(moving) <= 16
    # lateral step per metre stays gentle (no jump)
    assert np.abs(np.diff(y)).max() < 0.6
    # a high lane-change cost does not make the change impossible (it is required)
    assert plan_route(g, kps, lane_change_cost=500.0).lanes[-1] == ids["out_E2"]


def test_plan_route_errors():
    g, _ = cross_graph()
    with pytest.raises(RouteError, match=r"'offmap'.*keypoint 1") as e:
        plan_route(g, np.array([[-60.0, -1.75], [0.0, 500.0]]), name="offmap")
    assert isinstance(e.value, ValueError)
    # an exit is a dead end: nothing beyond it is reachable
    with pytest.raises(RouteError, match=r"'stuck'.*keypoint 0.*keypoint 1"):
        plan_route(g, np.array([[60.0, -1.75], [-60.0, -1.75]]), name="stuck")
    with pytest.raises(RouteError, match=r"'short'"):
        plan_route(g, np.array([[60.0, -1.75]]), name="short")
    # keypoint 4.9 m from a lane centre still snaps
    plan_route(g, np.array([[-60.0, -1.75 - 4.9], [60.0, -1.75]]))


def test_plan_route_keypoint_slightly_behind_is_not_a_loop():
    g = ring_graph()
    r = plan_route(g, np.array([_arc(50.0, 0.5, 0.5, 1)[0], _arc(50.0, 0.495, 0.495, 1)[0],
                                _arc(50.0, 1.5, 1.5, 1)[0]]))
    assert abs(r.length - 50.0) < 1.0


# ---------------------------------------------------------------------------------------------- leaderboard files
@pytest.mark.skipif(not LONGEST6_V2.exists(), reason="longest6 route files not available")
@pytest.mark.parametrize("path", [LONGEST6_V2, LONGEST6_V1])
def test_parse_longest6(path: Path):
    routes = parse_leaderboard_xml(path)
    assert len(routes) == 36
    assert {town for _, town, _ in routes} == TOWNS
    assert len({rid for rid, _, _ in routes}) == 36
    for _, _, kps in routes:
        assert kps.ndim == 2 and kps.shape[1] == 2 and len(kps) >= 10 and np.isfinite(kps).all()
    # first waypoint, converted from CARLA's left-handed frame: y flipped
    first = ET.parse(path).getroot().find("route")
    wp = first.find("waypoints/position") if first.find("waypoints") is not None else first.find("waypoint")
    assert routes[0][0] == first.get("id")
    np.testing.assert_allclose(routes[0][2][0], [float(wp.get("x")), -float(wp.get("y"))])


def _write(tmp_path: Path, text: str, name: str = "r.xml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_leaderboard_errors(tmp_path: Path):
    bad = _write(tmp_path, "<routes><route id='1' town='Town01'><waypoints>", "broken.xml")
    with pytest.raises(RouteError, match="broken.xml"):
        parse_leaderboard_xml(bad)
    with pytest.raises(RouteError, match="nope.xml"):
        parse_leaderboard_xml(tmp_path / "nope.xml")
    with pytest.raises(RouteError, match=r"empty.xml.*no <route>"):
        parse_leaderboard_xml(_write(tmp_path, "<routes/>", "empty.xml"))
    with pytest.raises(RouteError, match=r"nowp.xml.*route 7"):
        parse_leaderboard_xml(_write(tmp_path, "<routes><route id='7' town='T'><waypoints/></route></routes>",
                                     "nowp.xml"))
    with pytest.raises(RouteError, match=r"nonum.xml.*route 3"):
        parse_leaderboard_xml(_write(tmp_path, "<routes><route id='3' town='T'><waypoint x='a' y='1'/>"
                                               "<waypoint x='1' y='1'/></route></routes>", "nonum.xml"))
    ok = _write(tmp_path, "<routes><route id='9' town='Nowhere'><waypoints><position x='0' y='0' z='0'/>"
                          "<position x='5' y='0' z='0'/></waypoints></route></routes>", "town.xml")

    def no_town(town: str) -> LaneGraph:
        raise KeyError(f"no map for {town}")

    with pytest.raises(RouteError, match=r"town.xml.*route 9.*Nowhere"):
        load_leaderboard_routes(ok, no_town)


def test_load_leaderboard_routes_on_fixture(tmp_path: Path):
    """LB 2.0 and 1.0 files in CARLA coordinates (y flipped) plan on the cross junction."""
    g, ids = cross_graph()
    # our (-60, -1.75) -> (1.75, 60): a left turn; in CARLA coordinates y is negated
    v2 = _write(tmp_path, "<routes><route id='4' town='Cross'><waypoints>"
                          "<position x='-60' y='1.75' z='0'/><position x='1.75' y='-60' z='0'/>"
                          "</waypoints></route></routes>", "v2.xml")
    v1 = _write(tmp_path, "<routes><route id='5' town='Cross'><waypoint x='-60' y='1.75' z='0' yaw='0'/>"
                          "<waypoint x='1.75' y='-60' z='0' yaw='-90'/></route></routes>", "v1.xml")
    calls = []

    def graph_for_town(town: str) -> LaneGraph:
        calls.append(town)
        return g

    for path, name in ((v2, "Cross_4"), (v1, "Cross_5")):
        (route,) = load_leaderboard_routes(path, graph_for_town)
        assert route.name == name
        assert ids["W->N"] in route.lanes
    assert calls == ["Cross", "Cross"]  # once per town per file
    off = _write(tmp_path, "<routes><route id='6' town='Cross'><waypoints>"
                           "<position x='-60' y='-1.75' z='0'/><position x='1.75' y='60' z='0'/>"
                           "</waypoints></route></routes>", "flipped.xml")  # y not flipped: off the lanes
    with pytest.raises(RouteError, match=r"flipped.xml.*route 6.*keypoint 0"):
        load_leaderboard_routes(off, graph_for_town)


# ---------------------------------------------------------------------------------------------- real maps
def test_random_routes_procedural_town_fast():
    procedural = pytest.importorskip("envs.maps.procedural")
    g = procedural.generate_town(procedural.ProceduralConfig(rows=5, cols=5), 0)
    t0 = time.perf_counter()
    routes = random_routes(g, 2000, (200.0, 600.0), seed=0)
    elapsed = time.perf_counter() - t0
    assert len(routes) == 2000 and elapsed < 10.0
    lengths = np.array([r.length for r in routes])
    assert lengths.min() >= 200.0 and lengths.max() <= 600.0
    for r in routes[:50]:
        _check_spacing(r)
        for p, lane in zip(r.points[::5].astype(np.float64), r.lanes[::5]):
            assert _dist_to_lane(g, int(lane), p) < 0.05


def _carla_towns_available() -> bool:
    try:
        import carla  # noqa: F401

        from envs.maps.opendrive import available_towns
    except ImportError:
        return False
    return TOWNS <= set(available_towns()) and LONGEST6_V2.exists()


@pytest.mark.slow
@pytest.mark.carla
@pytest.mark.skipif(not _carla_towns_available(), reason="carla package, CARLA town maps or routes missing")
def test_longest6_v2_plans_on_carla_towns():
    from envs.maps.opendrive import load_town

    routes = load_leaderboard_routes(LONGEST6_V2, load_town)
    assert len(routes) == 36
    total = sum(r.length for r in routes)
    # road-following length of longest6: ~58 km, 1.62 km per route on average
    assert 50_000 < total < 66_000, total
    for r, (_, _, kps) in zip(routes, parse_leaderboard_xml(LONGEST6_V2)):
        _check_spacing(r)
        d = np.linalg.norm(kps[:, None, :] - r.points[None].astype(np.float64), axis=2).min(1)
        assert d.max() < 5.0  # passes every keypoint (at most one lane over)


def test_route_file_keypoint_off_every_lane_names_file_route_and_fix(tmp_path: Path):
    """A Leaderboard file whose keypoint lies off every lane: the error names the file, the route id, the keypoint
    (index and coordinates in both frames), the distance to the nearest lane and the fix -- also when the caller
    plans the parsed keypoints itself (as the simulator and the CARLA worker do)."""
    g, _ = cross_graph()
    f = _write(tmp_path, "<routes><route id='12' town='Cross'><waypoints>"
                         "<position x='-60' y='1.75' z='0'/><position x='0' y='-300' z='0'/>"
                         "</waypoints></route></routes>", "offlane.xml")
    (rid, town, kps), = parse_leaderboard_xml(f)
    assert kps.source == str(f) and kps.route_id == "12"
    with pytest.raises(RouteError) as e:
        plan_route(g, kps, name=f"{town}_{rid}")
    msg = str(e.value)
    for part in (str(f), "route 12", "'Cross_12'", "keypoint 1 at (0.0, 300.0)", "CARLA x=0.0, y=-300.0",
                 "190.0 m from the nearest lane centre", "Fix:"):
        assert part in msg, (part, msg)
    with pytest.raises(RouteError) as e:
        load_leaderboard_routes(f, lambda town: g)
    assert str(e.value).count("route file") == 1 and "keypoint 1" in str(e.value)
    # Keypoints stay plain float arrays for everything else (slicing, arithmetic, pickling keep them usable)
    import pickle

    again = pickle.loads(pickle.dumps(kps))
    assert again.source == str(f) and np.array_equal(np.asarray(again), np.asarray(kps))
    assert isinstance(kps[:, :2] + 1.0, np.ndarray)

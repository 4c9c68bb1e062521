"""Library-backed geometry and graph code against brute-force references: GeoPackage geometries (shapely's WKB
reader after our header parsing), route planning (scipy's Dijkstra) and nearest-lane queries (scipy's KD-tree) on
real and procedural maps, the crosswalk rectangle and lane polygon area (shapely), and the report charts
(matplotlib)."""
from __future__ import annotations

import heapq
import math
import sqlite3
import struct
from pathlib import Path

import numpy as np
import pytest
import shapely

from envs.maps import routes
from envs.maps import procedural
from envs.nuplan import gpkg

MAPS_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "carla" / "maps"


# ---------------------------------------------------------------------------------------------- GeoPackage
def _reference(g: shapely.Geometry):
    """The numpy representation of gpkg's docstring, built with shapely's object API."""
    if g.geom_type == "Point":
        return np.array([g.x, g.y]) if not g.is_empty else np.array([np.nan, np.nan])
    if g.geom_type in ("LineString", "LinearRing"):
        return np.array([c[:2] for c in g.coords], np.float64).reshape(-1, 2)
    if g.geom_type == "Polygon":
        return [] if g.is_empty else [_reference(r) for r in (g.exterior, *g.interiors)]
    return [_reference(p) for p in g.geoms]


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)
    return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def _blob(wkb: bytes, srs: int, little: bool, envelope: int) -> bytes:
    """A GeoPackage binary geometry around ``wkb`` with an envelope of code ``envelope`` (zeros: not read)."""
    size = {0: 0, 1: 32, 2: 48, 3: 48, 4: 64}[envelope]
    return b"GP\x00" + bytes([int(little) | envelope << 1]) + struct.pack("<i" if little else ">i", srs) + bytes(size) \
        + wkb


GEOMETRIES = [
    "POINT (1 2)", "POINT Z (1 2 3)", "LINESTRING (0 0, 1 2.5, 3 5)", "LINESTRING M (0 0 5, 1 1 6)",
    "POLYGON ((0 0, 4 0, 4 3, 0 0), (1 0.5, 2 0.5, 2 1, 1 0.5))", "POLYGON ZM ((0 0 1 2, 1 0 1 2, 1 1 1 2, 0 0 1 2))",
    "MULTIPOLYGON (((0 0, 1 0, 1 1, 0 0)), ((5 5, 6 5, 6 6, 5 5)))", "MULTILINESTRING ((0 0, 1 1), (2 2, 3 3, 4 5))",
    "MULTIPOINT ((0 1), (2 3))", ("GEOMETRYCOLLECTION (POINT (0 1), POLYGON ((0 0, 1 0, 1 1, 0 0)), "
                                  "MULTIPOLYGON (((0 0, 1 0, 1 1, 0 0))))"), "LINESTRING EMPTY", "POLYGON EMPTY", "MULTIPOLYGON EMPTY", "POINT EMPTY",
]


@pytest.mark.parametrize("wkt", GEOMETRIES)
def test_gpkg_geometries_decode_like_shapely_objects(wkt: str) -> None:
    g = shapely.from_wkt(wkt)
    want = _reference(g)
    for little in (True, False):
        for flavor, srid in (("iso", False), ("extended", False), ("extended", True)):
            wkb = shapely.to_wkb(shapely.set_srid(g, 4326) if srid else g, byte_order=int(little), flavor=flavor,
                                 include_srid=srid, output_dimension=4)
            for envelope in (0, 1, 4):
                geom, srs = gpkg.decode_gpkg_geometry(_blob(wkb, 32611, little, envelope))
                assert srs == 32611 and _same(want, geom), (wkt, little, flavor, srid, envelope, geom)


def test_gpkg_hand_packed_wkb_and_header_flags() -> None:
    # big-endian ISO LineString Z, packed by hand
    wkb = struct.pack(">BI", 0, 1002) + struct.pack(">I", 2) + struct.pack(">6d", 1, 2, 9, 3, 4, 9)
    geom, srs = gpkg.decode_gpkg_geometry(b"GP\x00\x00" + struct.pack(">i", 4326) + wkb)
    assert srs == 4326 and np.array_equal(geom, [[1, 2], [3, 4]])
    # little-endian EWKB polygon with an SRID (flag 0x20000000): the SRID is skipped
    ring = [(0.0, 0.0), (2.0, 0.0), (2.0, 1.0), (0.0, 0.0)]
    wkb = struct.pack("<BII", 1, 3 | 0x20000000, 32611) + struct.pack("<II", 1, 4) + struct.pack("<8d", *sum(ring, ()))
    geom, _ = gpkg.decode_gpkg_geometry(_blob(wkb, 32611, True, 2))
    assert np.array_equal(geom[0], ring)
    # an unclosed ring is closed; the empty flag gives None; None stays None
    wkb = struct.pack("<BI", 1, 3) + struct.pack("<II", 1, 3) + struct.pack("<6d", 0, 0, 1, 0, 1, 1)
    assert np.array_equal(gpkg.decode_gpkg_geometry(_blob(wkb, 1, True, 0))[0][0], [[0, 0], [1, 0], [1, 1], [0, 0]])
    assert gpkg.decode_gpkg_geometry(b"GP\x00\x11" + struct.pack("<i", 7)) == (None, 7)
    assert gpkg.decode_gpkg_geometry(None) == (None, 0)
    with pytest.raises(gpkg.GeoPackageError, match="magic"):
        gpkg.decode_gpkg_geometry(b"XX\x00\x01\x00\x00\x00\x00")
    with pytest.raises(gpkg.GeoPackageError, match="envelope code 5"):
        gpkg.decode_gpkg_geometry(b"GP\x00" + bytes([1 | 5 << 1]) + bytes(60))
    with pytest.raises(gpkg.GeoPackageError, match="unsupported WKB geometry type"):  # a circular string
        gpkg.decode_gpkg_geometry(_blob(struct.pack("<BII", 1, 8, 3) + struct.pack("<6d", 0, 0, 1, 1, 2, 0), 1, True, 0))


def test_gpkg_write_is_the_wkb_a_hand_packer_writes(tmp_path: Path) -> None:
    ring = np.array([[0.0, 0.0], [2.0, 0.0], [2.0, 1.0], [0.0, 1.0]])  # not closed: the writer closes it
    blob = gpkg.encode_gpkg_geometry([ring], gpkg.WKB_POLYGON, 32611, envelope=True)
    closed = np.vstack([ring, ring[:1]])
    want = (b"GP\x00\x03" + struct.pack("<i", 32611) + struct.pack("<4d", 0, 2, 0, 1) + struct.pack("<BI", 1, 3)
            + struct.pack("<II", 1, 5) + closed.astype("<f8").tobytes())
    assert blob == want
    line = np.array([[0.0, 1.0], [2.0, 3.0]])
    assert gpkg.encode_gpkg_geometry(line, gpkg.WKB_LINESTRING, -1) == (
        b"GP\x00\x01" + struct.pack("<i", -1) + struct.pack("<BII", 1, 2, 2) + line.astype("<f8").tobytes())


def test_gpkg_layer_errors_name_the_feature(tmp_path: Path) -> None:
    p = tmp_path / "t.gpkg"
    con = sqlite3.connect(p)
    gpkg.init_geopackage(con, 32611, "utm")
    rows = [(fid, np.array([[0.0, fid], [1.0, fid]]), ()) for fid in (3, 5, 9)]
    gpkg.write_layer(con, "lines", gpkg.WKB_LINESTRING, 32611, {}, rows)
    con.commit()
    lay = gpkg.read_layer(gpkg.open_geopackage(p), "lines", p)
    assert lay.fids.tolist() == [3, 5, 9] and all(np.array_equal(g, r[1]) for g, r in zip(lay.geometries, rows))
    con.execute("UPDATE lines SET geom=? WHERE fid=5", (b"GP\x00\x01" + struct.pack("<i", 32611) + b"\x01\x02",))
    con.commit()
    with pytest.raises(gpkg.GeoPackageError, match=r"layer 'lines', feature 5: bad geometry"):
        gpkg.read_layer(gpkg.open_geopackage(p), "lines", p)
    curve = _blob(struct.pack("<BII", 1, 8, 3) + struct.pack("<6d", 0, 0, 1, 1, 2, 0), 32611, True, 0)
    con.execute("UPDATE lines SET geom=? WHERE fid=5", (curve,))
    con.commit()
    with pytest.raises(gpkg.GeoPackageError, match=r"feature 5: bad geometry \(unsupported WKB geometry type"):
        gpkg.read_layer(gpkg.open_geopackage(p), "lines", p)
    other = gpkg.encode_gpkg_geometry(rows[0][1], gpkg.WKB_LINESTRING, 4326)
    con.execute("UPDATE lines SET geom=? WHERE fid=5", (gpkg.encode_gpkg_geometry(rows[1][1], gpkg.WKB_LINESTRING,
                                                                                   32611),))
    con.execute("UPDATE lines SET geom=? WHERE fid=9", (other,))
    con.commit()
    with pytest.raises(gpkg.GeoPackageError, match=r"feature 9: geometry srs_id 4326 differs"):
        gpkg.read_layer(gpkg.open_geopackage(p), "lines", p)
    con.close()


# ---------------------------------------------------------------------------------------------- route planning
def reference_legs(idx: routes._GraphIndex, src: routes._Place, targets: list[routes._Place], lcc: float) -> list:
    """Textbook binary-heap Dijkstra over the planning graph's edge list (entries ordered by distance, then node),
    stopping SEARCH_SLACK beyond the cheapest target: (cost, segments) per target, or None."""
    out: list = [None] * len(targets)
    entry: dict[int, list[int]] = {}
    for t, tg in enumerate(targets):
        if tg.lane == src.lane and tg.s >= src.s - routes.BACKTRACK_TOLERANCE:
            out[t] = (max(tg.s, src.s) - src.s, [(routes._SEG_LANE, src.lane, src.s, max(tg.s, src.s))])
            continue
        a, b = int(idx.node_off[tg.lane]), int(idx.node_off[tg.lane + 1])
        entry.setdefault(max(a + int(np.searchsorted(idx.node_s[a:b], tg.s, side="right")) - 1, a), []).append(t)
    if not entry:
        return out
    a, b = int(idx.node_off[src.lane]), int(idx.node_off[src.lane + 1])
    first = min(a + int(np.searchsorted(idx.node_s[a:b], src.s - 1e-9, side="left")), b - 1)
    dist = {first: max(0.0, float(idx.node_s[first]) - src.s)}
    prev: dict[int, int] = {}  # node -> edge id
    heap = [(dist[first], first, -1)]
    settled: set[int] = set()
    best = math.inf
    src_l, dst_l, cost_l, change_l = idx.edge_lists
    while heap:
        d, u, t = heapq.heappop(heap)
        if d > best + routes.SEARCH_SLACK:
            break
        if t >= 0:
            if out[t] is None:
                edges, v = [], u
                while v in prev:
                    edges.append(prev[v])
                    v = src_l[prev[v]]
                out[t] = (d, routes._path_segments(idx, src, targets[t], edges[::-1]))
                best = min(best, d)
            continue
        if u in settled:
            continue
        settled.add(u)
        for t in entry.get(u, ()):
            heapq.heappush(heap, (d + targets[t].s - float(idx.node_s[u]), u, t))
        for e in idx.edges_out[u]:
            nd = d + cost_l[e] + (lcc if change_l[e] else 0.0)
            if nd < dist.get(dst_l[e], math.inf):
                dist[dst_l[e]], prev[dst_l[e]] = nd, e
                heapq.heappush(heap, (nd, dst_l[e], -1))
    return out


def _maps() -> dict:
    maps = {"grid5x5": procedural.generate_town(procedural.ProceduralConfig(rows=5, cols=5), 0),
            "grid3x4": procedural.generate_town(procedural.ProceduralConfig(rows=3, cols=4), 7)}
    try:
        import carla  # noqa: F401

        from envs.maps.opendrive import load_town
    except ImportError:
        return maps
    for town in ("Town01", "Town02"):
        if (MAPS_DIR / f"{town}.xodr").exists():
            maps[town] = load_town(town, maps_dir=MAPS_DIR)
    return maps


@pytest.fixture(scope="module")
def maps() -> dict:
    return _maps()


def _keypoint_routes(g, n: int, seed: int) -> list[np.ndarray]:
    """Keypoints every 20-90 m along random routes (with lane changes), moved up to ~1 m off the lane centre."""
    rng = np.random.default_rng(seed)
    out = []
    for r in routes.random_routes(g, n, (150.0, 900.0), seed=seed, allow_lane_changes=True):
        kps = r.points[::int(rng.integers(20, 90))].astype(np.float64)
        out.append(kps + rng.normal(0.0, 0.5, kps.shape))
    return out


def test_shortest_paths_match_a_reference_dijkstra(maps: dict) -> None:
    checked = 0
    for name, g in maps.items():
        idx = routes._index(g)
        for kps in _keypoint_routes(g, 6, 1):
            for lcc in (0.0, 5.0, 40.0):
                cands = [routes._candidates(idx, g.is_junction, p, name, k, routes.OFF_LANE_COST + 2 * lcc)
                         for k, p in enumerate(kps)]
                for k in range(1, len(kps)):
                    sources, targets = [c for c, _ in cands[k - 1]], [c for c, _ in cands[k]]
                    got = routes._shortest_paths(idx, sources, targets, lcc)
                    for src, legs in zip(sources, got):
                        want = reference_legs(idx, src, targets, lcc)
                        assert legs == want, (name, lcc, k, src)  # the same floats, the same segments
                        checked += sum(x is not None for x in legs)
    assert checked > 500


def test_plan_route_is_unchanged_with_the_reference_search(maps: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    planned = {}
    for name, g in maps.items():
        planned[name] = [routes.plan_route(g, kps, name=name) for kps in _keypoint_routes(g, 5, 2)]

    def reference(idx, sources, targets, lcc):
        return [reference_legs(idx, s, targets, lcc) for s in sources]

    monkeypatch.setattr(routes, "_shortest_paths", reference)
    for name, g in maps.items():
        for got, kps in zip(planned[name], _keypoint_routes(g, 5, 2)):
            want = routes.plan_route(g, kps, name=name)
            assert np.array_equal(got.points, want.points) and np.array_equal(got.lanes, want.lanes), name


def test_kd_tree_finds_the_lane_points_brute_force_does(maps: dict) -> None:
    rng = np.random.default_rng(0)
    for g in maps.values():
        idx = routes._index(g)
        lo, hi = idx.pts.min(0) - 10, idx.pts.max(0) + 10
        for p in rng.uniform(lo, hi, (300, 2)):
            for radius in (0.5, 3.0, routes.SNAP_RADIUS):
                want = np.flatnonzero(np.linalg.norm(idx.pts - p, axis=1) <= radius + 1.5)
                assert np.array_equal(idx.nearby_points(p, radius), want)


# ---------------------------------------------------------------------------------------------- nuPlan patches
def test_patch_lanes_and_expert_lanes_match_brute_force() -> None:
    from envs.nuplan import mapgraph

    from envs.nuplan.synthetic import tiled_map

    m = tiled_map(3, 230.0)
    rng = np.random.default_rng(0)
    fids = list(m.lanes)
    for trial in range(40):
        path = m.lanes[fids[rng.integers(len(fids))]].baseline
        path = path + rng.normal(0.0, 1.5, path.shape) + (rng.normal(0.0, 30.0, 2) if trial % 4 == 0 else 0.0)
        radius = float(rng.uniform(5.0, 90.0))
        want = [f for f, lane in m.lanes.items()
                if np.linalg.norm(lane.baseline[:, None, :] - path[None], axis=-1).min() <= radius]
        assert mapgraph._lanes_near(m, path, radius) == want
        lanes = [m.lanes[f] for f in want] or [m.lanes[fids[0]]]
        graph_lanes = [mapgraph.Lane(points=lane.baseline, width=3.5, speed_limit=10.0) for lane in lanes]
        locator = mapgraph._LaneLocator(graph_lanes)
        prefer = {int(i) for i in rng.choice(len(graph_lanes), size=min(3, len(graph_lanes)), replace=False)}
        for q in path[::3]:
            heading = float(rng.uniform(-np.pi, np.pi))
            best, best_d = 0, np.inf  # brute force: every lane's nearest point, heading within 60 degrees
            for i, lane in enumerate(graph_lanes):
                d = np.linalg.norm(lane.points - q, axis=1)
                k = int(d.argmin())
                seg = lane.points[min(k + 1, len(d) - 1)] - lane.points[max(k - 1, 0)]
                if np.cos(np.arctan2(seg[1], seg[0]) - heading) >= 0.5 and d[k] - (i in prefer) < best_d:
                    best, best_d = i, d[k] - (i in prefer)
            assert locator.nearest(q, heading, prefer) == best


def test_polygon_area_is_the_shoelace_area() -> None:
    from envs.nuplan.mapgraph import polygon_area

    rng = np.random.default_rng(0)
    for _ in range(50):
        a = np.sort(rng.uniform(0, 2 * np.pi, 9))
        ring = np.stack([np.cos(a), np.sin(a)], 1) * rng.uniform(1, 5, (9, 1))  # star-shaped, simple
        x, y = ring[:, 0], ring[:, 1]
        shoelace = 0.5 * abs(float(x @ np.roll(y, -1) - y @ np.roll(x, -1)))
        assert polygon_area(ring + [664_000.0, 3_996_000.0]) == pytest.approx(shoelace, rel=1e-9)
        assert polygon_area(np.vstack([ring, ring[:1]])) == pytest.approx(shoelace, rel=1e-12)
    assert polygon_area(np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])) == 0.0


# ---------------------------------------------------------------------------------------------- crosswalk rectangles
def test_min_area_rect_is_the_smallest_enclosing_rectangle() -> None:
    from envs.maps.opendrive import _min_area_rect

    rng = np.random.default_rng(0)
    for _ in range(200):
        p = rng.normal(size=(int(rng.integers(3, 12)), 2)) * rng.uniform(0.5, 20, 2) + rng.normal(size=2) * 100
        r = _min_area_rect(p)
        e = np.roll(r, -1, axis=0) - r
        assert np.all(e[:, 0] * np.roll(e, -1, axis=0)[:, 1] - e[:, 1] * np.roll(e, -1, axis=0)[:, 0] > 0)  # CCW
        assert abs(float(e[0] @ e[1])) < 1e-6 * float(e[0] @ e[0] + e[1] @ e[1])  # right angles
        assert np.lexsort((r[:, 1], r[:, 0]))[0] == 0  # starts at its lowest-x corner
        assert shapely.Polygon(r).buffer(1e-6).contains(shapely.MultiPoint(p))
        # brute force over edge directions of the hull, then a fine sweep of angles: nothing smaller
        angles = np.linspace(0, np.pi / 2, 2001)
        u = np.stack([np.cos(angles), np.sin(angles)], 1)
        v = np.stack([-u[:, 1], u[:, 0]], 1)
        sweep = (np.ptp(p @ u.T, axis=0) * np.ptp(p @ v.T, axis=0)).min()
        assert shapely.Polygon(r).area <= sweep * (1 + 1e-9)
    with pytest.raises(ValueError, match="degenerate"):
        _min_area_rect(np.array([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]))


# ---------------------------------------------------------------------------------------------- charts
def test_report_charts_are_pngs_drawn_by_matplotlib(tmp_path: Path) -> None:
    from carl.eval.report import plot_infractions, plot_scores

    records = [{"route_id": f"Town0{1 + i // 3}_{i % 3}", "carl": {"group": f"Town0{1 + i // 3}", "route_index": i},
                "scores": {"score_route": 90.0 - 10 * i, "score_composed": 50.0 - 5 * i}} for i in range(6)]
    plot_scores(records, tmp_path / "score_per_route.png", "p on b")
    plot_scores([], tmp_path / "empty_scores.png", "p on b")
    plot_infractions({"km": 1.5, "infractions_per_km": {"collision_vehicle": 0.5, "red_light": None, "speeding": 2}},
                     tmp_path / "infractions.png", "p on b")
    plot_infractions({"km": 0.0, "infractions_per_km": {}}, tmp_path / "empty_infractions.png", "p on b")
    from PIL import Image

    for f in ("score_per_route.png", "empty_scores.png", "infractions.png", "empty_infractions.png"):
        with Image.open(tmp_path / f) as im:
            assert im.format == "PNG" and im.width >= 400 and im.height >= 80
            assert "matplotlib" in str(im.info.get("Software", ""))

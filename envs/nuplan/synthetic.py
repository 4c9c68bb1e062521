"""A small synthetic dataset in nuPlan's own formats, for tests and a demo run.

``make_synthetic_dataset(root)`` writes::

    root/maps/nuplan-maps-v1.0.json
    root/maps/us-nv-las-vegas-strip/9.15.1915/map.gpkg      (real layer and column names, GeoPackage binary)
    root/nuplan-v1.1/splits/mini/<log>.db                    (real table and column names, BLOB tokens)

The map is a four-arm signalised intersection (one lane each way per arm, twelve lane connectors) placed at UTM
coordinates of zone 11N, with a car park north-east of it reached by a driveway (``carpark_areas``,
``generic_drivable_areas`` as a multipolygon with a second part, a turnout on the west arm), so that every polygon
layer of the drivable areas and the route is present; ``layer_srs`` stores chosen layers in another CRS (e.g. lon/lat,
EPSG:4326, as real nuPlan maps do; needs pyproj). Every log drives the ego from a standstill at a red light through
the intersection (straight, left or right turn) with a lead vehicle, crossing traffic, a pedestrian on a crosswalk
and a traffic cone. Scenes are 5 s long; tags sit in valid and invalid scenes so that scenario extraction rules are
exercised.
"""
from __future__ import annotations

import json
import math
import pickle
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np

from envs.nuplan.gpkg import (WKB_LINESTRING, WKB_MULTIPOLYGON, WKB_POLYGON, init_geopackage, register_srs,
                              require, write_layer)

LOCATION, MAP_VERSION, EPSG = "us-nv-las-vegas-strip", "9.15.1915", 32611
ORIGIN = np.array([664_000.0, 3_996_000.0])  # intersection centre (UTM 11N metres)
ARM_LENGTH, HALF_BOX, LANE_WIDTH = 200.0, 10.0, 3.5
ARMS = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])  # E, N, W, S (outward)
SPEED_LIMIT = 13.41
HZ, LOG_SECONDS, SCENE_SECONDS = 20, 45.0, 5.0
LANE_FID, CONN_FID, RB_FID, RBC_FID = 1000, 2000, 100, 200
# per log: (inbound arm, outbound arm, tag at 28 s)
LOG_PLANS = ((2, 0, "starting_straight_traffic_light_intersection_traversal"), (2, 1, "starting_left_turn"),
             (2, 3, "starting_right_turn"), (3, 1, "starting_straight_traffic_light_intersection_traversal"))


# ---------------------------------------------------------------------------------------------- map geometry
def _inbound(a: int) -> np.ndarray:
    d = ARMS[a]
    off = 0.5 * LANE_WIDTH * np.array([-d[1], d[0]])
    s = np.linspace(ARM_LENGTH + HALF_BOX, HALF_BOX, 41)[:, None]
    return ORIGIN + off + d * s


def _outbound(a: int) -> np.ndarray:
    d = ARMS[a]
    off = 0.5 * LANE_WIDTH * np.array([d[1], -d[0]])
    s = np.linspace(HALF_BOX, ARM_LENGTH + HALF_BOX, 41)[:, None]
    return ORIGIN + off + d * s


def _connector(a: int, b: int) -> np.ndarray:
    """Quadratic Bezier from the end of arm ``a``'s inbound lane to the start of arm ``b``'s outbound lane."""
    p0, p2 = _inbound(a)[-1], _outbound(b)[0]
    u, v = -ARMS[a], ARMS[b]
    den = u[0] * v[1] - u[1] * v[0]
    if abs(den) < 1e-9:
        p1 = 0.5 * (p0 + p2)
    else:
        t = ((p2 - p0)[0] * v[1] - (p2 - p0)[1] * v[0]) / den
        p1 = p0 + u * t
    t = np.linspace(0, 1, 21)[:, None]
    return (1 - t) ** 2 * p0 + 2 * (1 - t) * t * p1 + t ** 2 * p2


def _buffer(line: np.ndarray, half: float) -> list[np.ndarray]:
    """A polygon (one ring) around a polyline: offset both sides by ``half``."""
    d = np.gradient(line, axis=0)
    n = np.stack([-d[:, 1], d[:, 0]], -1) / np.linalg.norm(d, axis=1, keepdims=True)
    ring = np.vstack([line + n * half, (line - n * half)[::-1]])
    return [np.vstack([ring, ring[:1]])]


def connector_index(a: int, b: int) -> int:
    """Index of the connector from arm ``a`` to arm ``b`` (b != a) among the twelve."""
    return a * 3 + (b - a - 1) % 4


def _rect(x0: float, y0: float, x1: float, y1: float) -> list[np.ndarray]:
    """An axis-aligned rectangle (offsets from ORIGIN, metres) as polygon rings."""
    r = ORIGIN + np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1], [x0, y0]])
    return [r]


# car park north-east of the intersection, a driveway from the east arm to it, and a turnout beside the west arm
CARPARK = _rect(40.0, 15.0, 70.0, 40.0)
DRIVEWAY = _rect(50.0, LANE_WIDTH, 56.0, 15.0)
TURNOUT = _rect(-40.0, -LANE_WIDTH - 4.0, -30.0, -LANE_WIDTH)


def _reprojector(srs: int) -> Any:
    """A function moving nested numpy geometry from EPSG:32611 to ``srs``."""
    pyproj = require("pyproj", f"writing a synthetic map layer in EPSG:{srs}")
    tr = pyproj.Transformer.from_crs(f"EPSG:{EPSG}", f"EPSG:{srs}", always_xy=True)

    def move(g: Any) -> Any:
        if isinstance(g, np.ndarray):
            a = g.reshape(-1, 2)
            return np.stack(tr.transform(a[:, 0], a[:, 1]), -1).reshape(g.shape)
        return [move(x) for x in g]

    return move


def write_map(path: Path, layer_srs: dict[str, int] | None = None) -> None:
    """The synthetic map.gpkg (projected coordinates, srs EPSG:32611; the layers of ``layer_srs`` in that EPSG)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    con = sqlite3.connect(path)
    init_geopackage(con, EPSG, "WGS 84 / UTM zone 11N")
    layer_srs = dict(layer_srs or {})
    moves = {}
    for lname, srs in layer_srs.items():
        register_srs(con, srs, f"EPSG:{srs}")
        moves[lname] = _reprojector(srs)

    def write(name: str, kind: int | None, srs: int, columns: dict[str, str], rows: list, **kw: Any) -> None:
        if name in moves:
            rows = [(fid, moves[name](g), vals) for fid, g, vals in rows]
        write_layer(con, name, kind, layer_srs.get(name, srs), columns, rows, **kw)

    lanes, baselines, conns, rbs, rbcs = [], [], [], [], []
    for a in range(4):
        for k, (line, fid) in enumerate(((_inbound(a), LANE_FID + 2 * a), (_outbound(a), LANE_FID + 2 * a + 1))):
            rb = RB_FID + 2 * a + k
            lanes.append((fid, _buffer(line, LANE_WIDTH / 2), (rb, 0, SPEED_LIMIT, None, None)))
            rbs.append((rb, _buffer(line, LANE_WIDTH / 2), ()))
            baselines.append((len(baselines) + 1, line, (fid, None)))
    for a in range(4):
        for b in range(4):
            if a == b:
                continue
            c = connector_index(a, b)
            line = _connector(a, b)
            fid, rbc = CONN_FID + c, RBC_FID + c
            conns.append((fid, line, (LANE_FID + 2 * a, LANE_FID + 2 * b + 1, rbc, None, "[1]")))
            rbcs.append((rbc, _buffer(line, LANE_WIDTH / 2), (RB_FID + 2 * a, RB_FID + 2 * b + 1, 1)))
            baselines.append((len(baselines) + 1, line, (None, fid)))
    h = HALF_BOX + 1.0
    box = [ORIGIN + np.array([[-h, -h], [h, -h], [h, h], [-h, h], [-h, -h]])]
    roads = [(a + 1, _buffer(np.vstack([ORIGIN + ARMS[a] * HALF_BOX, ORIGIN + ARMS[a] * (HALF_BOX + ARM_LENGTH)]),
                             LANE_WIDTH), ()) for a in range(4)]
    cw_c = ORIGIN + ARMS[1] * (HALF_BOX + 3.0)
    crosswalk = [np.array([cw_c + [-LANE_WIDTH - 1, -1.5], cw_c + [LANE_WIDTH + 1, -1.5],
                           cw_c + [LANE_WIDTH + 1, 1.5], cw_c + [-LANE_WIDTH - 1, 1.5], cw_c + [-LANE_WIDTH - 1, -1.5]])]
    stops = [(a + 1, _buffer(_inbound(a)[-3:], LANE_WIDTH / 2), (2,)) for a in range(4)]
    write("meta", None, EPSG, {"key": "TEXT", "value": "TEXT"},
          [(1, None, ("projectedCoordSystem", f"EPSG:{EPSG}")), (2, None, ("version", MAP_VERSION))])
    write("lanes_polygons", WKB_POLYGON, EPSG,
          {"lane_group_fid": "INTEGER", "lane_index": "INTEGER", "speed_limit_mps": "REAL",
           "left_boundary_fid": "INTEGER", "right_boundary_fid": "INTEGER"}, lanes)
    write("baseline_paths", WKB_LINESTRING, EPSG, {"lane_fid": "INTEGER", "lane_connector_fid": "INTEGER"},
          baselines, envelope=True)
    write("lane_connectors", WKB_LINESTRING, EPSG,
          {"exit_lane_fid": "INTEGER", "entry_lane_fid": "INTEGER", "lane_group_connector_fid": "INTEGER",
           "speed_limit_mps": "REAL", "traffic_light_stop_line_fids": "TEXT"}, conns)
    write("lane_groups_polygons", WKB_POLYGON, EPSG, {}, rbs)
    write("lane_group_connectors", WKB_POLYGON, EPSG,
          {"from_lane_group_fid": "INTEGER", "to_lane_group_fid": "INTEGER", "intersection_fid": "INTEGER"}, rbcs)
    write("intersections", WKB_POLYGON, EPSG, {}, [(1, box, ())])
    write("road_segments", WKB_POLYGON, EPSG, {}, roads)
    write("crosswalks", WKB_POLYGON, EPSG, {}, [(1, crosswalk, ())])
    write("stop_polygons", WKB_POLYGON, EPSG, {"stop_polygon_type_fid": "INTEGER"}, stops)
    write("carpark_areas", WKB_POLYGON, EPSG, {}, [(1, CARPARK, ())])
    write("generic_drivable_areas", WKB_MULTIPOLYGON, EPSG, {}, [(1, [DRIVEWAY, TURNOUT], ())])
    write("walkways", WKB_POLYGON, EPSG, {}, [])
    con.commit()
    con.close()


# ---------------------------------------------------------------------------------------------- logs
LOG_SCHEMA = """
CREATE TABLE log (token BLOB PRIMARY KEY, vehicle_name TEXT, date TEXT, timestamp INTEGER, logfile TEXT,
                  location TEXT, map_version TEXT);
CREATE TABLE lidar (token BLOB PRIMARY KEY, log_token BLOB, channel TEXT, model TEXT, translation BLOB,
                    rotation BLOB);
CREATE TABLE scene (token BLOB PRIMARY KEY, log_token BLOB, name TEXT, goal_ego_pose_token BLOB, roadblock_ids TEXT);
CREATE TABLE ego_pose (token BLOB PRIMARY KEY, timestamp INTEGER, x REAL, y REAL, z REAL, qw REAL, qx REAL, qy REAL,
                       qz REAL, vx REAL, vy REAL, vz REAL, acceleration_x REAL, acceleration_y REAL,
                       acceleration_z REAL, angular_rate_x REAL, angular_rate_y REAL, angular_rate_z REAL,
                       epsg INTEGER, log_token BLOB);
CREATE TABLE lidar_pc (token BLOB PRIMARY KEY, next_token BLOB, prev_token BLOB, ego_pose_token BLOB,
                       lidar_token BLOB, scene_token BLOB, filename TEXT, timestamp INTEGER);
CREATE TABLE category (token BLOB PRIMARY KEY, name TEXT, description TEXT);
CREATE TABLE track (token BLOB PRIMARY KEY, category_token BLOB, width REAL, length REAL, height REAL);
CREATE TABLE lidar_box (token BLOB PRIMARY KEY, lidar_pc_token BLOB, track_token BLOB, next_token BLOB,
                        prev_token BLOB, x REAL, y REAL, z REAL, width REAL, length REAL, height REAL, vx REAL,
                        vy REAL, vz REAL, yaw REAL, confidence REAL);
CREATE TABLE scenario_tag (token BLOB PRIMARY KEY, lidar_pc_token BLOB, type TEXT, agent_track_token BLOB);
CREATE TABLE traffic_light_status (token BLOB PRIMARY KEY, lidar_pc_token BLOB, lane_connector_id INTEGER,
                                   status TEXT);
CREATE INDEX idx_lidar_box_pc ON lidar_box (lidar_pc_token);
CREATE INDEX idx_lidar_pc_ts ON lidar_pc (timestamp);
"""


def _path_pose(line: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Position and heading at arc lengths ``s`` along a polyline (clamped)."""
    cum = np.concatenate([[0.0], np.cumsum(np.linalg.norm(np.diff(line, axis=0), axis=1))])
    s = np.clip(s, 0.0, cum[-1])
    xy = np.stack([np.interp(s, cum, line[:, 0]), np.interp(s, cum, line[:, 1])], -1)
    seg = np.clip(np.searchsorted(cum, s, side="right") - 1, 0, len(line) - 2)
    d = line[seg + 1] - line[seg]
    return xy, np.arctan2(d[:, 1], d[:, 0])


def _route_line(a: int, b: int) -> np.ndarray:
    return np.vstack([_inbound(a), _connector(a, b)[1:], _outbound(b)[1:]])


def ego_profile(t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Arc length, speed and acceleration of the ego: stopped 10 s, then 1 m/s² up to 8 m/s."""
    tm = np.clip(t - 10.0, 0.0, None)
    ramp = np.minimum(tm, 8.0)
    v = ramp * 1.0
    s = 0.5 * ramp ** 2 + 8.0 * (tm - ramp)
    a = np.where((tm > 0) & (tm < 8.0), 1.0, 0.0)
    return 100.0 + s, v, a


def write_log(path: Path, log_index: int, seed: int = 0) -> None:
    """One synthetic log following ``LOG_PLANS[log_index % 4]``."""
    rng = np.random.default_rng(seed * 1000 + log_index)
    tok = lambda: rng.bytes(8)
    a_in, b_out, turn_tag = LOG_PLANS[log_index % len(LOG_PLANS)]
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    con = sqlite3.connect(path)
    con.executescript(LOG_SCHEMA)
    log_tok, lidar_tok = tok(), tok()
    t0 = 1_623_067_200_000_000 + log_index * 3_600_000_000
    con.execute("INSERT INTO log VALUES (?,?,?,?,?,?,?)", (log_tok, "veh-99", "2021-06-07", t0, path.stem, "las_vegas",
                                                           LOCATION))
    con.execute("INSERT INTO lidar VALUES (?,?,?,?,?,?)", (lidar_tok, log_tok, "MergedPointCloud", "merged",
                                                           pickle.dumps([0.0, 0.0, 1.8]),
                                                           pickle.dumps([1.0, 0.0, 0.0, 0.0])))
    n = int(LOG_SECONDS * HZ)
    t = np.arange(n) / HZ
    ts = t0 + np.arange(n, dtype=np.int64) * (1_000_000 // HZ)
    # ego
    line = _route_line(a_in, b_out)
    s, v, acc = ego_profile(t)
    xy, yaw = _path_pose(line, s)
    yaw = np.unwrap(yaw)
    yaw_rate = np.gradient(yaw, t)
    ego_toks = [tok() for _ in range(n)]
    con.executemany("INSERT INTO ego_pose VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", [
        (ego_toks[i], int(ts[i]) + 700, xy[i, 0], xy[i, 1], 0.0, math.cos(yaw[i] / 2), 0.0, 0.0, math.sin(yaw[i] / 2),
         v[i], 0.0, 0.0, acc[i], v[i] * yaw_rate[i], 0.0, 0.0, 0.0, yaw_rate[i], EPSG, log_tok) for i in range(n)])
    # scenes (5 s each) with the ego's route roadblocks and the final ego pose as goal
    route = f"{RB_FID + 2 * a_in} {RBC_FID + connector_index(a_in, b_out)} {RB_FID + 2 * b_out + 1}"
    n_scenes = int(LOG_SECONDS / SCENE_SECONDS)
    scene_toks = [tok() for _ in range(n_scenes)]
    con.executemany("INSERT INTO scene VALUES (?,?,?,?,?)", [
        (scene_toks[k], log_tok, f"scene-{k:04d}", ego_toks[-1], route) for k in range(n_scenes)])
    pc_toks = [tok() for _ in range(n)]
    frame_scene = np.minimum((t // SCENE_SECONDS).astype(int), n_scenes - 1)
    con.executemany("INSERT INTO lidar_pc VALUES (?,?,?,?,?,?,?,?)", [
        (pc_toks[i], pc_toks[i + 1] if i + 1 < n else None, pc_toks[i - 1] if i else None, ego_toks[i], lidar_tok,
         scene_toks[frame_scene[i]], f"sensor_blobs/{i:06d}.pcd", int(ts[i])) for i in range(n)])
    # agents: (category, polyline, arc-length function, size, valid function)
    cats = ["vehicle", "pedestrian", "bicycle", "traffic_cone", "barrier", "czone_sign", "generic_object"]
    cat_toks = {c: tok() for c in cats}
    con.executemany("INSERT INTO category VALUES (?,?,?)", [(cat_toks[c], c, c) for c in cats])
    cross_a = (a_in + 1) % 4
    cw_c = ORIGIN + ARMS[1] * (HALF_BOX + 3.0)
    cone_xy, cone_yaw = _path_pose(line, np.array([130.0]))
    cone = cone_xy[0] + 3.5 * np.array([math.sin(cone_yaw[0]), -math.cos(cone_yaw[0])])
    agents = [
        ("vehicle", line, s + 15.0, (4.8, 2.0), np.ones(n, bool)),
        ("vehicle", _route_line(cross_a, (cross_a + 2) % 4), 60.0 + 8.0 * t, (4.5, 1.9), t < 30.0),
        ("pedestrian", np.vstack([cw_c + [-5.0, 0.0], cw_c + [5.0, 0.0]]), 5.0 + 4.5 * np.sin(0.25 * t), (0.6, 0.6),
         np.ones(n, bool)),
        ("bicycle", _route_line((a_in + 2) % 4, a_in), 20.0 + 4.0 * t, (1.8, 0.6), t > 5.0),
        ("traffic_cone", np.vstack([cone, cone + [0.1, 0.0]]), np.zeros(n), (0.5, 0.5), np.ones(n, bool)),
    ]
    boxes, tracks = [], []
    for cat, poly, arc, (length, width), valid in agents:
        track = tok()
        tracks.append((track, cat_toks[cat], width, length, 1.6))
        p, h = _path_pose(poly, arc)
        vel = np.gradient(p, t, axis=0)
        for i in np.nonzero(valid)[0]:
            boxes.append((tok(), pc_toks[i], track, None, None, p[i, 0], p[i, 1], 0.8, width, length, 1.6,
                          vel[i, 0], vel[i, 1], 0.0, h[i], 0.9))
    con.executemany("INSERT INTO track VALUES (?,?,?,?,?)", tracks)
    con.executemany("INSERT INTO lidar_box VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", boxes)
    # tags: two at 12 s (MAX picks the larger name), one at 20 s, one at 28 s; one in an invalid scene (3 s)
    tags = [(12.0, "following_lane_with_lead"), (12.0, "stationary_in_traffic"), (20.0, "near_multiple_vehicles"),
            (28.0, turn_tag), (3.0, "high_magnitude_speed"), (40.5, "low_magnitude_speed")]
    con.executemany("INSERT INTO scenario_tag VALUES (?,?,?,?)", [
        (tok(), pc_toks[int(round(ts_ * HZ))], typ, None) for ts_, typ in tags])
    # traffic lights: the ego's approach red until 9 s, yellow until 10 s, then green; crossing approach the reverse
    lights = []
    for i in range(n):
        ego_state = "red" if t[i] < 9.0 else "yellow" if t[i] < 10.0 else "green"
        cross_state = "green" if t[i] < 9.0 else "red"
        for b in range(4):
            if b != a_in:
                lights.append((tok(), pc_toks[i], CONN_FID + connector_index(a_in, b), ego_state))
            if b != cross_a:
                lights.append((tok(), pc_toks[i], CONN_FID + connector_index(cross_a, b), cross_state))
        if i % 40 == 0:
            lights.append((tok(), pc_toks[i], CONN_FID + connector_index((a_in + 2) % 4, a_in), "unknown"))
    con.executemany("INSERT INTO traffic_light_status VALUES (?,?,?,?)", lights)
    con.commit()
    con.close()


def log_name(index: int) -> str:
    return f"2021.06.07.{12 + index:02d}.00.00_veh-99_{index:05d}_{index + 1:05d}"


def make_synthetic_dataset(root: str | Path, num_logs: int = 3, split: str = "mini", seed: int = 0,
                           layer_srs: dict[str, int] | None = None) -> Path:
    """Write the dataset under ``root`` (maps + ``num_logs`` logs) and return ``root``; ``layer_srs`` stores the
    named map layers in another EPSG CRS (e.g. ``{"intersections": 4326}``, lon/lat like the real maps)."""
    root = Path(root)
    maps = root / "maps"
    maps.mkdir(parents=True, exist_ok=True)
    (maps / "nuplan-maps-v1.0.json").write_text(json.dumps({LOCATION: {"version": MAP_VERSION, "layers": {}}}))
    write_map(maps / LOCATION / MAP_VERSION / "map.gpkg", layer_srs)
    for k in range(num_logs):
        write_log(root / "nuplan-v1.1" / "splits" / split / f"{log_name(k)}.db", k, seed)
    return root


if __name__ == "__main__":  # python -m envs.nuplan.synthetic <root> [num_logs]
    import sys

    out = make_synthetic_dataset(sys.argv[1] if len(sys.argv) > 1 else "data/nuplan_synthetic",
                                 int(sys.argv[2]) if len(sys.argv) > 2 else 3)
    print(f"synthetic nuPlan dataset written to {out}")


def tiled_map(tiles: int, spacing: float) -> Any:
    """The synthetic map repeated on a ``tiles`` x ``tiles`` grid ``spacing`` metres apart, ids prefixed per tile: a
    large map for timing and checking map queries (``scripts/bench_maps.py``, ``tests/test_libraries.py``)."""
    import dataclasses
    import tempfile

    from envs.nuplan.nuplan_map import load_map

    with tempfile.TemporaryDirectory() as tmp:
        write_map(Path(tmp) / "map.gpkg")
        load_map.cache_clear()
        m = load_map(str(Path(tmp) / "map.gpkg"))
    load_map.cache_clear()
    lanes, inter, crosswalks = {}, {}, []
    for ty in range(tiles):
        for tx in range(tiles):
            off, tag = np.array([spacing * tx, spacing * ty]), f"{tx}_{ty}_"
            for fid, lane in m.lanes.items():
                lanes[tag + fid] = dataclasses.replace(
                    lane, fid=tag + fid, baseline=lane.baseline + off, group=tag + lane.group,
                    polygon=None if lane.polygon is None else [r + off for r in lane.polygon],
                    exit_lane=lane.exit_lane and tag + lane.exit_lane,
                    entry_lane=lane.entry_lane and tag + lane.entry_lane)
            inter.update({tag + k: v and tag + v for k, v in m.roadblock_connector_intersection.items()})
            crosswalks += [[r + off for r in cw] for cw in m.crosswalks]
    return dataclasses.replace(m, lanes=lanes, roadblock_connector_intersection=inter, crosswalks=crosswalks)

"""Map and route timings outside the simulator step: route planning, OpenDRIVE compilation, GeoPackage reading and
the nuPlan lane patch. Prints one JSON line per measurement, e.g.
``{"bench": "plan_routes", "town": "Town01", "routes": 6, "index_s": 0.11, "plan_s": 0.19, "km": 9.7}``.

    python scripts/bench_maps.py [--only routes xodr gpkg patch] [--repeat 3]
        [--route-file ../shared/data/carla/routes/longest6_v2.xml] [--maps-dir ../shared/data/carla/maps]
        [--towns Town01 Town02 Town06] [--features 20000] [--tiles 30]

* ``routes``: plan every route of ``--route-file`` on its town (towns from the map cache); ``index_s`` builds the
  planning graph and lane index, ``plan_s`` snaps keypoints and runs the shortest paths (one line per town, then
  the total).
* ``xodr``: compile ``--towns`` from their ``.xodr`` (no cache; needs the ``carla`` package).
* ``gpkg``: read a GeoPackage of ``--features`` polygons (40-vertex rings), linestrings (50 points) and a tenth as
  many two-part multipolygons, written once to a temporary file (``read_layer`` per layer: header parsing and WKB).
* ``patch``: ``build_patch`` (the lanes within 60 m of an ego path, nearest-lane tagging of the expert route) on the
  synthetic nuPlan map tiled ``--tiles`` x ``--tiles`` times (about 20 lanes per tile).

Every measurement is the best of ``--repeat`` runs (the lines carry all runs under ``runs``). Runs the tree the script
is in: copy it into another checkout to compare versions.
"""
from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def best_of(repeat: int, fn: Callable[[], Any]) -> tuple[float, list[float], Any]:
    runs, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        runs.append(time.perf_counter() - t0)
    return min(runs), [round(r, 4) for r in runs], out


def bench_routes(route_file: Path, repeat: int) -> None:
    from envs.maps import routes
    from envs.maps.opendrive import load_town

    parsed = routes.parse_leaderboard_xml(route_file)
    towns = sorted({town for _, town, _ in parsed})
    graphs = {town: load_town(town) for town in towns}
    total_index = total_plan = total_km = 0.0
    for town in towns:
        mine = [(rid, kps) for rid, t, kps in parsed if t == town]

        def index(g=graphs[town]) -> None:
            routes._INDEX_CACHE.clear()
            routes._index(g)

        def plan(g=graphs[town], town=town, mine=mine) -> list:
            return [routes.plan_route(g, kps, name=f"{town}_{rid}") for rid, kps in mine]

        index_s, index_runs, _ = best_of(repeat, index)
        plan_s, plan_runs, planned = best_of(repeat, plan)
        km = sum(r.length for r in planned) / 1000
        total_index, total_plan, total_km = total_index + index_s, total_plan + plan_s, total_km + km
        emit(bench="plan_routes", town=town, routes=len(mine), index_s=round(index_s, 4), plan_s=round(plan_s, 4),
             km=round(km, 3), index_runs=index_runs, plan_runs=plan_runs)
    emit(bench="plan_routes", town="all", file=route_file.name, routes=len(parsed), index_s=round(total_index, 4),
         plan_s=round(total_plan, 4), km=round(total_km, 3))


def bench_xodr(maps_dir: Path, towns: list[str], repeat: int) -> None:
    from envs.maps.opendrive import load_opendrive

    for town in towns:
        s, runs, g = best_of(repeat, lambda t=town: load_opendrive(maps_dir / f"{t}.xodr", name=t))
        emit(bench="compile_xodr", town=town, s=round(s, 4), lanes=g.num_lanes, crosswalks=len(g.crosswalks),
             runs=runs)


def bench_gpkg(features: int, repeat: int) -> None:
    from envs.nuplan import gpkg

    rng = np.random.default_rng(0)
    tmp = tempfile.TemporaryDirectory()
    path = Path(tmp.name) / "bench.gpkg"
    con = sqlite3.connect(path)
    gpkg.init_geopackage(con, 32611, "WGS 84 / UTM zone 11N")
    centres = rng.uniform(0, 5000, (features, 2)) + [664_000.0, 3_996_000.0]
    angle = np.linspace(0, 2 * np.pi, 40)
    ring = np.stack([np.cos(angle), np.sin(angle)], 1) * 3.0
    ring[-1] = ring[0]
    line = np.stack([np.linspace(0, 50, 50), np.sin(np.linspace(0, 3, 50))], 1)
    t0 = time.perf_counter()
    gpkg.write_layer(con, "polygons", gpkg.WKB_POLYGON, 32611, {"kind": "INTEGER"},
                     [(i + 1, [c + ring], (i % 7,)) for i, c in enumerate(centres)])
    gpkg.write_layer(con, "lines", gpkg.WKB_LINESTRING, 32611, {}, [(i + 1, c + line, ()) for i, c in enumerate(centres)],
                     envelope=True)
    gpkg.write_layer(con, "multipolygons", gpkg.WKB_MULTIPOLYGON, 32611, {},
                     [(i + 1, [[c + ring], [c + 10 + ring]], ()) for i, c in enumerate(centres[:features // 10])])
    con.commit()
    con.close()
    emit(bench="gpkg_write", features=features, s=round(time.perf_counter() - t0, 4),
         mb=round(path.stat().st_size / 2**20, 2))
    con = gpkg.open_geopackage(path)
    for layer in ("polygons", "lines", "multipolygons"):
        s, runs, lay = best_of(repeat, lambda n=layer: gpkg.read_layer(con, n, path))
        emit(bench="gpkg_read_layer", layer=layer, features=len(lay), s=round(s, 4), runs=runs)
    con.close()
    from envs.nuplan.nuplan_map import load_map
    from envs.nuplan.synthetic import write_map

    synthetic = Path(tmp.name) / "map.gpkg"
    write_map(synthetic)

    def load() -> Any:
        load_map.cache_clear()
        return load_map(str(synthetic))

    s, runs, m = best_of(repeat, load)
    emit(bench="gpkg_load_map", map="synthetic", lanes=len(m.lanes), s=round(s, 4), runs=runs)
    tmp.cleanup()


def bench_patch(tiles: int, repeat: int) -> None:
    from envs.nuplan.mapgraph import build_patch

    t0 = time.perf_counter()
    from envs.nuplan.synthetic import tiled_map

    m = tiled_map(tiles, 600.0)
    build_s = time.perf_counter() - t0
    centre = f"{tiles // 2}_{tiles // 2}_"
    paths = [lane.baseline for fid, lane in m.lanes.items() if fid.startswith(centre) and not lane.is_connector]
    paths = [np.concatenate([p, p[-1] + (p[-1] - p[-2]) * np.arange(1, 4)[:, None]]) for p in paths]

    def run() -> list:
        return [build_patch(m, p, p[0], set(), [], name=f"patch{k}") for k, p in enumerate(paths)]

    s, runs, patches = best_of(repeat, run)
    emit(bench="nuplan_build_patch", tiles=tiles, map_lanes=len(m.lanes), patches=len(paths),
         lanes_per_patch=round(float(np.mean([p.graph.num_lanes for p in patches])), 1),
         s_per_patch=round(s / len(paths), 5), runs=runs, tile_map_s=round(build_s, 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", default=["routes", "xodr", "gpkg", "patch"],
                    choices=["routes", "xodr", "gpkg", "patch"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--route-file", type=Path, default=ROOT.parent / "shared/data/carla/routes/longest6_v2.xml")
    ap.add_argument("--maps-dir", type=Path, default=ROOT.parent / "shared/data/carla/maps")
    ap.add_argument("--towns", nargs="+", default=["Town01", "Town02", "Town06"])
    ap.add_argument("--features", type=int, default=20000)
    ap.add_argument("--tiles", type=int, default=30)
    a = ap.parse_args()
    if "routes" in a.only:
        bench_routes(a.route_file, a.repeat)
    if "xodr" in a.only:
        bench_xodr(a.maps_dir, a.towns, a.repeat)
    if "gpkg" in a.only:
        bench_gpkg(a.features, a.repeat)
    if "patch" in a.only:
        bench_patch(a.tiles, a.repeat)


if __name__ == "__main__":
    main()

"""The nuPlan scenario cache at scale: map polygon layers, cache versions, atomic writes and resume, the parallel CLI,
and bad input (damaged logs, map layers in an unexpected CRS, short scenarios, missing packages, unknown tokens)."""
import json
import shutil
import sqlite3
import sys

import numpy as np
import pytest

from envs.nuplan import cache, gpkg, reader
from envs.nuplan.nuplan_map import load_location, load_map
from envs.nuplan.synthetic import CARPARK, EPSG, LOCATION, MAP_VERSION, ORIGIN, make_synthetic_dataset

pytestmark = pytest.mark.nuplan
shapely = pytest.importorskip("shapely")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_synthetic_dataset(tmp_path_factory.mktemp("nuplan"), num_logs=2)


@pytest.fixture(scope="module")
def built(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache")
    specs = reader.select_scenarios(data, split="mini")
    rep = cache.build_cache(specs, data / "maps", out, progress=False)
    assert not rep.failed
    return out, specs


def map_path(root):
    return root / "maps" / LOCATION / MAP_VERSION / "map.gpkg"


def centre_path(sc: cache.CachedScenario) -> np.ndarray:
    return sc.ego[:, :2] + cache.REAR_AXLE_TO_CENTRE * np.stack([np.cos(sc.ego[:, 2]), np.sin(sc.ego[:, 2])], -1)


# ---------------------------------------------------------------------------------------------- map layers
def test_polygon_layers_are_cached_clipped_and_usable(data, built):
    out, specs = built
    scs = [cache.load(cache.cache_path(out, s)) for s in specs]
    # the scenario that drives past the car park holds every drivable layer
    sc = next(s for s in scs if any(i.startswith("carpark_areas:") for i in s.drivable.ids))
    kinds = {i.split(":")[0] for i in sc.drivable.ids}
    assert kinds == {"road_segments", "intersections", "generic_drivable_areas", "carpark_areas"}
    assert {i.split(":")[0] for i in sc.carl_drivable.ids} == {"lane_groups_polygons", "intersections",
                                                                "carpark_areas"}
    # the route polygons are exactly the route's roadblocks and roadblock connectors
    assert sorted(sc.route_polygons.ids) == sorted(sc.meta["route_roadblock_ids"])
    assert sc.drivable.xy.dtype == np.float32 and len(sc.drivable) == len(sc.drivable.ids)
    # local frame: the ego starts at the origin, inside every layer; 25 m beside the road is off-road
    start = shapely.Point(centre_path(sc)[0])
    for layer in cache.POLYGON_FIELDS:
        assert sc.geometry(layer).contains(start), layer
    heading = sc.ego[0, 2]
    aside = shapely.Point(centre_path(sc)[0] + 25.0 * np.array([-np.sin(heading), np.cos(heading)]))
    assert not sc.geometry("drivable").contains(aside) and not sc.geometry("carl_drivable").contains(aside)
    # clipped to the scenario's radius around the ego path
    region = shapely.buffer(shapely.LineString(centre_path(sc)), 60.0 + 0.01)
    assert all(region.contains(shapely.Point(p)) for p in sc.drivable.xy[::7])
    # the same area as clipping the map's layers directly (car park included), to float32 precision
    m = load_location(data / "maps", LOCATION)
    full = shapely.union_all([shapely.Polygon(r[0] - sc.origin, [h - sc.origin for h in r[1:]])
                              for n in ("road_segments", "intersections", "generic_drivable_areas", "carpark_areas")
                              for _, r in m.polygon_layers[n]])
    direct = full.intersection(shapely.buffer(shapely.LineString(centre_path(sc)), 60.0, quad_segs=4))
    assert sc.geometry("drivable").symmetric_difference(direct).area < 1e-2
    assert sc.geometry("drivable").intersection(shapely.Polygon(CARPARK[0] - sc.origin)).area > 1.0
    # STRtree-friendly: one polygon per entry, local frame
    tree = shapely.STRtree(sc.carl_drivable.polygons())
    assert len(tree.query(start, predicate="within")) >= 1
    assert np.allclose(sc.carl_drivable.rings_of(0)[0], shapely.get_coordinates(sc.carl_drivable.polygons()[0]
                                                                                .exterior), atol=1e-4)
    with pytest.raises(ValueError, match="unknown polygon layer"):
        sc.geometry("lanes")


def test_lonlat_map_layers_are_reprojected(tmp_path, built):
    pytest.importorskip("pyproj")
    out, specs = built
    root = make_synthetic_dataset(tmp_path / "ll", num_logs=1,
                                  layer_srs={n: 4326 for n in ("lane_groups_polygons", "intersections",
                                                               "carpark_areas", "generic_drivable_areas")})
    con = gpkg.open_geopackage(map_path(root))
    assert gpkg.read_layer(con, "intersections").srs_id == 4326
    con.close()
    spec = reader.select_scenarios(root)[2]
    rep = cache.build_cache([spec], root / "maps", tmp_path / "c", progress=False)
    assert rep.built == [spec.token]
    got = cache.load(cache.cache_path(tmp_path / "c", spec))
    ref = cache.load(cache.cache_path(out, next(s for s in specs if s.token == spec.token)))
    for layer in cache.POLYGON_FIELDS:
        assert getattr(got, layer).ids == getattr(ref, layer).ids
        assert got.geometry(layer).symmetric_difference(ref.geometry(layer)).area < 1e-2


# ---------------------------------------------------------------------------------------------- versions, resume
def test_old_cache_version_is_named_and_rebuilt(data, built, tmp_path):
    _, specs = built
    spec = specs[0]
    cache.build_cache([spec], data / "maps", tmp_path, progress=False)
    f = cache.cache_path(tmp_path, spec)
    with np.load(f) as z:
        arrays = {k: z[k] for k in z.files if not k.startswith("poly_")}
    h = json.loads(bytes(arrays["header"]).decode())
    h["version"] = 1
    arrays["header"] = np.frombuffer(json.dumps(h).encode(), np.uint8)
    np.savez(f, **arrays)
    with pytest.raises(cache.CacheError, match=f"{f}.*version 1.*rebuild"):
        cache.load(f)
    assert not cache.is_cached(f)
    rep = cache.build_cache([spec], data / "maps", tmp_path, progress=False)  # what data_root triggers
    assert rep.built == [spec.token] and len(cache.load(f).drivable) > 0


def test_interrupted_build_leaves_nothing_that_looks_valid(data, built, tmp_path, monkeypatch):
    _, specs = built
    f = cache.cache_path(tmp_path, specs[0])
    # a write that dies half way: neither the final file nor the temp file is left
    real = np.savez_compressed

    def dies(file, **arrays):
        real(file, **arrays)
        with open(file, "r+b") as fh:
            fh.truncate(100)
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez_compressed", dies)
    with pytest.raises(KeyboardInterrupt):
        cache.build_cache([specs[0]], data / "maps", tmp_path, progress=False)
    monkeypatch.setattr(np, "savez_compressed", real)
    assert not f.exists() and not list(tmp_path.rglob("*.tmp.npz"))
    # a half file under the final name (e.g. copied in from elsewhere) and a stray temp file from a killed build
    f.parent.mkdir(parents=True, exist_ok=True)
    good = cache.cache_path(built[0], specs[0]).read_bytes()
    f.write_bytes(good[: len(good) // 2])
    (f.parent / f"{specs[0].token}.999.tmp.npz").write_bytes(good[:100])
    assert not cache.is_cached(f)
    with pytest.raises(cache.CacheError, match=str(f)):
        cache.load(f)
    rep = cache.build_cache(specs[:2], data / "maps", tmp_path, progress=False)
    assert sorted(rep.built) == sorted(s.token for s in specs[:2])
    assert sorted(p.stem for p in cache.list_cache(tmp_path)) == sorted(s.token for s in specs[:2])  # no temp file
    again = cache.build_cache(specs[:2], data / "maps", tmp_path, progress=False)
    assert not again.built and len(again.skipped) == 2


def test_cli_parallel_build_reports_figures(data, tmp_path, capsys):
    rc = cache.main(["--data-root", str(data), "--cache-dir", str(tmp_path / "c"), "--workers", "2",
                     "--no-progress"])
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and rep["built"] == 6 and rep["failed"] == 0 and rep["workers"] == 2
    assert rep["seconds"] > 0 and rep["scenarios_per_s"] > 0
    assert rep["peak_memory_mb"]["self"] > 0 and rep["peak_memory_mb"]["children"] > 0
    assert len(cache.list_cache(tmp_path / "c")) == 6
    rc = cache.main([str(data), str(tmp_path / "c"), "--no-progress"])  # the positional form; resumes
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and rep["built"] == 0 and rep["skipped"] == 6


# ---------------------------------------------------------------------------------------------- bad logs
def edit_log(log, sql_and_args):
    con = sqlite3.connect(log)
    for sql, args in sql_and_args:
        con.execute(sql, args)
    con.commit()
    con.close()


def frame_ts(log, t_s: float) -> int:
    """lidar_pc timestamp of the 20 Hz frame at ``t_s`` seconds into a synthetic log."""
    con = sqlite3.connect(log)
    t0 = con.execute("SELECT MIN(timestamp) FROM lidar_pc").fetchone()[0]
    con.close()
    return t0 + int(round(t_s * 1e6))


@pytest.fixture()
def bad_data(tmp_path):
    """Three logs: log 0 loses 0.5 s of frames at 10 s (its 12 s scenario has a gap), log 1 ends at 35 s (its 28 s
    scenario is shorter than the horizon), log 2 has two frames swapped at 13 s (out of order)."""
    root = make_synthetic_dataset(tmp_path / "bad", num_logs=3)
    logs = reader.find_logs(root)
    edit_log(logs[0], [("DELETE FROM lidar_pc WHERE timestamp >= ? AND timestamp < ?",
                        (frame_ts(logs[0], 10.0), frame_ts(logs[0], 10.5)))])
    edit_log(logs[1], [("DELETE FROM lidar_pc WHERE timestamp > ?", (frame_ts(logs[1], 35.0),))])
    a, b = frame_ts(logs[2], 13.0), frame_ts(logs[2], 13.1)
    edit_log(logs[2], [("UPDATE lidar_pc SET timestamp = -1 WHERE timestamp = ?", (a,)),
                       ("UPDATE lidar_pc SET timestamp = ? WHERE timestamp = ?", (a, b)),
                       ("UPDATE lidar_pc SET timestamp = ? WHERE timestamp = -1", (b,))])
    return root, logs


def test_missing_frames_are_refused(bad_data):
    _, logs = bad_data
    spec = reader.list_scenarios(logs[0])[0]
    with pytest.raises(reader.NuplanDataError, match=f"{spec.token} of log file {logs[0]}: frames missing: a gap"):
        reader.load_scenario(spec)
    reader.load_scenario(reader.list_scenarios(logs[0])[1])  # the log's other scenarios are fine


def test_frames_out_of_order_are_refused(bad_data, tmp_path):
    _, logs = bad_data
    spec = reader.list_scenarios(logs[2])[0]
    with pytest.raises(reader.NuplanDataError, match=f"{logs[2]}: frames out of order: the ego pose"):
        reader.load_scenario(spec)
    # repeated frame timestamps
    log = tmp_path / "dup.db"
    shutil.copy(logs[1], log)
    t = frame_ts(log, 14.0)
    edit_log(log, [("UPDATE lidar_pc SET timestamp = ? WHERE timestamp = ?", (t, frame_ts(log, 14.1)))])
    with pytest.raises(reader.NuplanDataError, match="frames out of order: lidar_pc timestamps .* repeat"):
        reader.load_scenario(reader.list_scenarios(log)[0])


def test_scenario_shorter_than_the_horizon_is_refused(bad_data):
    _, logs = bad_data
    spec = reader.list_scenarios(logs[1])[2]  # anchor 28 s: window 25-40 s, the log ends at 35 s
    with pytest.raises(reader.NuplanDataError, match=f"{spec.token} of log file {logs[1]}: shorter than the 15.0 s "
                                                     "horizon: the log ends inside the window"):
        reader.load_scenario(spec)


def test_cache_build_skips_and_lists_bad_scenarios(bad_data, tmp_path, capsys):
    root, logs = bad_data
    rc = cache.main(["--data-root", str(root), "--cache-dir", str(tmp_path / "c"), "--no-progress"])
    io = capsys.readouterr()
    rep = json.loads(io.out.strip().splitlines()[-1])
    assert rc == 0 and rep["built"] == 6 and rep["failed"] == 3
    bad = {reader.list_scenarios(logs[0])[0].token: (logs[0].stem, "frames missing"),
           reader.list_scenarios(logs[1])[2].token: (logs[1].stem, "shorter than the 15.0 s horizon"),
           reader.list_scenarios(logs[2])[0].token: (logs[2].stem, "frames out of order")}
    assert set(rep["bad_scenarios"]) == set(bad)
    for tok, (log, why) in bad.items():
        assert log in rep["bad_scenarios"][tok] and why in rep["bad_scenarios"][tok]
        assert f"skipped bad scenario {tok}: log {log}" in io.err
        assert not cache.cache_path(tmp_path / "c", reader.list_scenarios(logs[0])[0]).exists()
    assert {f.stem for f in cache.list_cache(tmp_path / "c")}.isdisjoint(bad)
    assert cache.main(["--data-root", str(root), "--cache-dir", str(tmp_path / "c"), "--no-progress",
                       "--strict"]) == 1


# ---------------------------------------------------------------------------------------------- bad maps
def copy_dataset(data, dst):
    shutil.copytree(data, dst)
    load_map.cache_clear()
    return dst


def redeclare(path, layer: str, srs: int, rewrite_blobs: bool = True, register: bool = True) -> None:
    """Declare ``layer`` in EPSG ``srs`` without moving its coordinates (as a wrong export would)."""
    con = sqlite3.connect(path)
    if register:
        gpkg.register_srs(con, srs, f"EPSG:{srs}")
    con.execute("UPDATE gpkg_geometry_columns SET srs_id=? WHERE table_name=?", (srs, layer))
    if rewrite_blobs:
        for fid, blob in con.execute(f"SELECT fid, geom FROM {layer}").fetchall():
            blob = bytearray(blob)
            blob[4:8] = int(srs).to_bytes(4, "little", signed=True)
            con.execute(f"UPDATE {layer} SET geom=? WHERE fid=?", (bytes(blob), fid))
    con.commit()
    con.close()


def test_map_layer_in_an_unexpected_crs(data, tmp_path):
    pytest.importorskip("pyproj")
    root = copy_dataset(data, tmp_path / "d1")
    redeclare(map_path(root), "intersections", 3857)  # UTM metres declared as web mercator
    with pytest.raises(gpkg.GeoPackageError, match=r"layer 'intersections' is declared in EPSG:3857.*outside the "
                                                    r"area of the map's CRS EPSG:32611.*re-export"):
        load_location(root / "maps", LOCATION)
    root = copy_dataset(data, tmp_path / "d2")
    redeclare(map_path(root), "carpark_areas", 4326, rewrite_blobs=False)  # column and geometries disagree
    with pytest.raises(gpkg.GeoPackageError, match=r"layer 'carpark_areas', feature 1: geometry srs_id 32611 "
                                                    r"differs from the layer's srs_id 4326"):
        load_location(root / "maps", LOCATION)
    root = copy_dataset(data, tmp_path / "d3")
    redeclare(map_path(root), "lane_groups_polygons", 2999, register=False)
    with pytest.raises(gpkg.GeoPackageError, match="layer 'lane_groups_polygons' uses srs_id 2999, which "
                                                   "gpkg_spatial_ref_sys does not define"):
        load_location(root / "maps", LOCATION)
    root = copy_dataset(data, tmp_path / "d4")
    redeclare(map_path(root), "road_segments", -1, register=False)
    with pytest.raises(gpkg.GeoPackageError, match=r"layer 'road_segments' has an undefined CRS \(srs_id -1\)"):
        load_location(root / "maps", LOCATION)
    # and the cache build lists every scenario of that map as failed, naming the map file and layer
    specs = reader.select_scenarios(root)
    rep = cache.build_cache(specs, root / "maps", tmp_path / "c", progress=False)
    assert len(rep.failed) == len(specs) and all("road_segments" in r and str(map_path(root)) in r
                                                 for r in rep.failed.values())


def test_lonlat_degrees_under_a_metric_srs(data, tmp_path):
    root = copy_dataset(data, tmp_path / "d")
    con = sqlite3.connect(map_path(root))
    for fid, blob in con.execute("SELECT fid, geom FROM intersections").fetchall():
        geom, srs = gpkg.decode_gpkg_geometry(blob)
        geom = [(r - ORIGIN) * 1e-5 + [-115.17, 36.11] for r in geom]  # degrees under the UTM srs id
        con.execute("UPDATE intersections SET geom=? WHERE fid=?",
                    (gpkg.encode_gpkg_geometry(geom, gpkg.WKB_POLYGON, srs), fid))
    con.commit()
    con.close()
    with pytest.raises(gpkg.GeoPackageError, match=f"layer 'intersections' is declared in EPSG:{EPSG}.*look like "
                                                   "longitude/latitude"):
        load_location(root / "maps", LOCATION)


# ---------------------------------------------------------------------------------------------- missing packages
def test_missing_pyproj_names_the_package_and_the_fix(tmp_path, monkeypatch):
    pytest.importorskip("pyproj")
    root = make_synthetic_dataset(tmp_path / "ll", num_logs=1, layer_srs={"intersections": 4326})
    load_map.cache_clear()
    monkeypatch.setitem(sys.modules, "pyproj", None)  # import pyproj now fails
    with pytest.raises(gpkg.MissingPackageError, match=r"layer 'intersections' is stored in EPSG:4326.*needs the "
                                                       r"Python package 'pyproj'.*pip install -e '\.\[nuplan\]'"):
        load_location(root / "maps", LOCATION)
    # a build stops at once (every scenario of the map would fail the same way)
    with pytest.raises(gpkg.MissingPackageError, match="pyproj"):
        cache.build_cache(reader.select_scenarios(root), root / "maps", tmp_path / "c", progress=False)
    load_map.cache_clear()


def test_missing_shapely_names_the_package_and_the_fix(data, built, tmp_path, monkeypatch):
    out, specs = built
    sc = cache.load(cache.cache_path(out, specs[0]))
    monkeypatch.setitem(sys.modules, "shapely", None)
    with pytest.raises(gpkg.MissingPackageError, match=r"'shapely'.*pip install -e '\.\[nuplan\]'"):
        cache.build_cache(specs[:1], data / "maps", tmp_path, progress=False)
    with pytest.raises(gpkg.MissingPackageError, match="shapely"):
        sc.geometry("drivable")
    assert len(sc.drivable) > 0  # the flat arrays need no shapely


def test_missing_module_error_is_an_import_error():
    with pytest.raises(ImportError, match=r"frobnicating needs the Python package 'no-such-pkg'.*pip install "
                                          "no-such-pkg"):
        gpkg.require("no_such_module_xyz", "frobnicating", "no-such-pkg")


# ---------------------------------------------------------------------------------------------- unknown tokens
def invalid_scene_token(log) -> str:
    """The token of the frame tagged in the log's first scene (never a scenario: edge scenes are skipped)."""
    con = sqlite3.connect(log)
    row = con.execute("SELECT lidar_pc_token FROM scenario_tag WHERE type = 'high_magnitude_speed'").fetchone()
    con.close()
    return bytes(row[0]).hex()


def test_unknown_tokens_name_the_real_cause(data):
    logs = reader.find_logs(data, "mini")
    good = reader.select_scenarios(data)[0].token
    edge = invalid_scene_token(logs[0])
    with pytest.raises(reader.NuplanDataError) as e:
        reader.select_scenarios(data, "mini", tokens=[good, "deadbeefdeadbeef", edge])
    msg = str(e.value)
    assert "2 of 3 requested scenario token(s) are not scenarios of the 2 log(s) under" in msg
    assert "splits/mini (split 'mini')" in msg and logs[0].stem in msg and logs[1].stem in msg
    assert "deadbeefdeadbeef: in none of these logs" in msg
    assert f"{edge}: a frame of log {logs[0].stem} in one of its first or last two scenes" in msg
    assert "yaml" not in msg
    # a type filter that excludes a token says so
    with pytest.raises(reader.NuplanDataError, match=f"{good}: a stationary_in_traffic scenario of log .*not among "
                                                     "the requested scenario types"):
        reader.select_scenarios(data, tokens=[good], scenario_types=["starting_left_turn"])
    # allow_missing builds what exists
    assert [s.token for s in reader.select_scenarios(data, tokens=[good, "deadbeefdeadbeef"],
                                                     allow_missing=True)] == [good]


def test_prepare_cache_without_any_token_names_the_logs_searched(data, tmp_path):
    with pytest.raises(reader.NuplanDataError, match=r"none of the 1 scenario tokens is in the dataset: 1 of 1 "
                                                     r"requested scenario token\(s\) are not scenarios of the 2 "
                                                     r"log\(s\) under .*deadbeefdeadbeef: in none of these logs"):
        cache.prepare_cache(["deadbeefdeadbeef"], tmp_path / "c", data)
    have = cache.prepare_cache([reader.select_scenarios(data)[0].token, "deadbeefdeadbeef"], tmp_path / "c", data)
    assert len(have) == 1

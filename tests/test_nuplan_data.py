"""nuPlan reader, scenario extraction, cache and bad input, on the synthetic nuPlan-format dataset."""
import sqlite3

import numpy as np
import pytest

from envs.nuplan import cache, gpkg, reader
from envs.nuplan.nuplan_map import MapVersionError, load_location
from envs.nuplan.synthetic import EPSG, LOCATION, MAP_VERSION, ORIGIN, ego_profile, make_synthetic_dataset

pytestmark = pytest.mark.nuplan


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_synthetic_dataset(tmp_path_factory.mktemp("nuplan"), num_logs=2)


@pytest.fixture(scope="module")
def built(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache")
    specs = reader.select_scenarios(data, split="mini")
    rep = cache.build_cache(specs, data / "maps", out, workers=1, progress=False)
    return out, specs, rep


def test_gpkg_round_trip(tmp_path):
    p = tmp_path / "t.gpkg"
    con = sqlite3.connect(p)
    gpkg.init_geopackage(con, EPSG, "utm")
    line = np.array([[0.0, 0.0], [1.0, 2.0], [3.0, 5.0]])
    ring = np.array([[0.0, 0.0], [2.0, 0.0], [2.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    gpkg.write_layer(con, "lines", gpkg.WKB_LINESTRING, EPSG, {"name": "TEXT"}, [(7, line, ("a",))], envelope=True)
    gpkg.write_layer(con, "polys", gpkg.WKB_POLYGON, EPSG, {}, [(1, [ring], ())])
    con.commit()
    con.close()
    con = gpkg.open_geopackage(p)
    lay = gpkg.read_layer(con, "lines", p)
    assert lay.fids.tolist() == [7] and lay.columns["name"] == ["a"] and lay.srs_id == EPSG
    assert np.allclose(lay.geometries[0], line)
    assert np.allclose(gpkg.read_layer(con, "polys", p).geometries[0][0], ring)
    # big-endian ISO WKB with Z is decoded too (Z dropped)
    import struct
    wkb = struct.pack(">BI", 0, 1002) + struct.pack(">I", 2) + struct.pack(">6d", 1, 2, 9, 3, 4, 9)
    geom, srs = gpkg.decode_gpkg_geometry(b"GP\x00\x00" + struct.pack(">i", 4326) + wkb)
    assert srs == 4326 and np.allclose(geom, [[1, 2], [3, 4]])
    with pytest.raises(gpkg.GeoPackageError, match="magic"):
        gpkg.decode_gpkg_geometry(b"XX\x00\x01\x00\x00\x00\x00")


def test_reader_round_trip(data):
    specs = reader.select_scenarios(data, split="mini")
    # per log: anchors at 12 s (two tags -> MAX), 20 s and 28 s; tags in the first/last two scenes are ignored
    assert len(specs) == 6
    types = [s.scenario_type for s in specs[:3]]
    assert types == ["stationary_in_traffic", "near_multiple_vehicles",
                     "starting_straight_traffic_light_intersection_traversal"]
    sd = reader.load_scenario(specs[0])
    # window: 15 s from 3 s before the anchor, 10 Hz -> 151 frames, 0.1 s apart
    assert sd.num_frames == 151
    assert np.all(np.diff(sd.timestamps) == 100_000)
    assert sd.timestamps[0] == specs[0].anchor_ts - 3_000_000
    # ego (rear axle) matches the generator's profile at t = 9 s .. 24 s
    t = 9.0 + np.arange(151) * 0.1
    s, v, _ = ego_profile(t)
    assert np.allclose(sd.ego[:, 3], v, atol=1e-6)
    assert np.allclose(sd.ego[0, :2], ORIGIN + [-HALF_BOX_PLUS(s[0]), -1.75], atol=1e-6)
    assert sd.route_roadblock_ids == ["104", "207", "101"]
    assert sd.agents.shape == (151, 5, 7) and sd.agent_valid[0].sum() == 5
    assert {lc for lc, _ in sd.traffic_lights[0]} >= {2006, 2007, 2008}
    assert dict(sd.traffic_lights[0])[2007] == 1  # yellow between 9 s and 10 s
    assert dict(sd.traffic_lights[20])[2007] == 0  # green from 10 s
    m = load_location(data / "maps", specs[0].map_name)
    assert len(m.lanes) == 20 and m.lanes["2007"].exit_lane == "1004" and m.lanes["2007"].entry_lane == "1001"
    assert m.meta["projectedCoordSystem"] == f"EPSG:{EPSG}"
    # the polygon layers of the drivable areas and the route (a multipolygon split into its two parts)
    assert {n: len(v) for n, v in m.polygon_layers.items()} == {
        "lane_groups_polygons": 8, "lane_group_connectors": 12, "intersections": 1, "road_segments": 4,
        "generic_drivable_areas": 2, "carpark_areas": 1}


def HALF_BOX_PLUS(s0: float) -> float:
    """x offset of the ego start on the west arm's inbound lane (arc length s0 from its far end)."""
    from envs.nuplan.synthetic import ARM_LENGTH, HALF_BOX
    return ARM_LENGTH + HALF_BOX - s0


def test_selection_filters(data):
    all_specs = reader.select_scenarios(data, split="mini")
    assert [s.token for s in reader.select_scenarios(data, tokens=[all_specs[2].token])] == [all_specs[2].token]
    assert len(reader.select_scenarios(data, scenario_types=["starting_left_turn"])) == 1
    assert len(reader.select_scenarios(data, num_scenarios_per_type=1)) == 4
    logs = reader.find_logs(data, "mini")
    assert len(reader.select_scenarios(data, log_names=[logs[0].stem])) == 3
    # 15 s threshold per type: anchors 12/20/28 s have different types, so all survive
    assert len(reader.filter_scenarios(all_specs, timestamp_threshold_s=15)) == 6
    y = reader.load_split_yaml("/work/shared/data/nuplan/val14_split.yaml")
    assert len(set(y["scenario_tokens"])) == 1118 and len(y["scenario_types"]) == 14


def test_cache_build_reload_and_resume(data, built):
    out, specs, rep = built
    assert len(rep.built) == len(specs) and not rep.failed
    files = cache.list_cache(out)
    assert len(files) == len(specs)
    sc = cache.load(cache.cache_path(out, specs[0]))
    assert sc.token == specs[0].token and sc.num_frames == 151 and sc.graph.num_lanes > 4
    assert np.allclose(sc.ego[0, :2], 0.0)  # local frame around the ego start
    assert len(sc.route) > 20 and sc.lights.shape[0] == 151
    again = cache.build_cache(specs, data / "maps", out, progress=False)
    assert len(again.skipped) == len(specs) and not again.built


def test_bad_input(data, built, tmp_path):
    out, specs, _ = built
    with pytest.raises(reader.NuplanDataError, match="does not exist"):
        reader.open_log(tmp_path / "missing.db")
    log = reader.find_logs(data, "mini")[0]
    trunc = tmp_path / "trunc" / "t.db"
    trunc.parent.mkdir()
    trunc.write_bytes(log.read_bytes()[:4096])
    with pytest.raises(reader.NuplanDataError, match=str(trunc)):
        reader.list_scenarios(trunc)
    with pytest.raises(reader.NuplanDataError, match="deadbeefdeadbeef"):
        reader.select_scenarios(data, tokens=["deadbeefdeadbeef"])
    with pytest.raises(cache.CacheError, match="deadbeefdeadbeef"):
        cache.list_cache(out, tokens=["deadbeefdeadbeef"])
    # a log whose map is absent, and a map version mismatch
    (tmp_path / "maps").mkdir()
    (tmp_path / "maps" / "nuplan-maps-v1.0.json").write_text('{"%s": {"version": "1.0.0"}}' % LOCATION)
    with pytest.raises(MapVersionError, match="sg-one-north"):
        load_location(tmp_path / "maps", "sg-one-north")
    (tmp_path / "maps" / LOCATION / MAP_VERSION).mkdir(parents=True)
    (tmp_path / "maps" / LOCATION / MAP_VERSION / "map.gpkg").write_bytes(
        (data / "maps" / LOCATION / MAP_VERSION / "map.gpkg").read_bytes())
    with pytest.raises(MapVersionError, match="version mismatch"):
        load_location(tmp_path / "maps", LOCATION)
    # the cache build reports a bad scenario and goes on
    bad = reader.ScenarioSpec("0000000000000000", "badlog", str(trunc), "x", 0, LOCATION)
    rep = cache.build_cache([bad, specs[0]], data / "maps", tmp_path / "c2", progress=False)
    assert list(rep.failed) == ["0000000000000000"] and rep.built == [specs[0].token]
    # a cache file from another version
    f = cache.cache_path(tmp_path / "c2", specs[0])
    with np.load(f) as z:
        arrays = {k: z[k] for k in z.files}
    import json
    h = json.loads(bytes(arrays["header"]).decode())
    h["version"] = 0
    arrays["header"] = np.frombuffer(json.dumps(h).encode(), np.uint8)
    np.savez(f, **arrays)
    with pytest.raises(cache.CacheError, match=f"{f}.*version 0"):
        cache.load(f)

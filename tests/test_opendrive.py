"""OpenDRIVE -> LaneGraph through the real ``carla`` client, offline (no CARLA server needed).

Skipped when the ``carla`` package cannot be imported or the shared CARLA maps directory is missing.
Loading all eight towns takes a few seconds, so every town is tested by default.
"""
from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from envs.maps.lanegraph import CONTROL_LIGHT, LaneGraph, MapError
from envs.maps.opendrive import (
    available_towns,
    carla_to_world,
    carla_yaw_to_world,
    default_maps_dir,
    load_opendrive,
    load_town,
    world_to_carla,
    world_yaw_to_carla,
)

carla = pytest.importorskip("carla", reason="the carla client package (carla==0.9.16) is not installed")

MAPS_DIR = default_maps_dir()
TOWNS = ["Town01", "Town02", "Town03", "Town04", "Town05", "Town06", "Town07", "Town10HD"]
ROUTE_00 = Path(__file__).resolve().parents[1].parent / "shared/data/carla/routes/longest6_v2_split/00.xml"

needs_maps = pytest.mark.skipif(MAPS_DIR is None or not MAPS_DIR.is_dir(),
                                reason="shared CARLA maps dir not found (set CARL_CARLA_MAPS)")

# A 100 m straight road along OpenDRIVE +x: lanes -1 and -2 drive with s, lane 1 against it.
STRAIGHT_XODR = """<?xml version="1.0" standalone="yes"?>
<OpenDRIVE>
  <header revMajor="1" revMinor="4" name="straight" version="1"/>
  <road name="r" length="100.0" id="1" junction="-1">
    <planView><geometry s="0" x="0" y="0" hdg="0" length="100.0"><line/></geometry></planView>
    <lanes>
      <laneSection s="0">
        <left>
          <lane id="1" type="driving" level="false"><width sOffset="0" a="3.5" b="0" c="0" d="0"/>
            <roadMark sOffset="0" type="solid" width="0.15" laneChange="none"/></lane>
        </left>
        <center><lane id="0" type="driving" level="false">
            <roadMark sOffset="0" type="solid" width="0.15" laneChange="none"/></lane></center>
        <right>
          <lane id="-1" type="driving" level="false"><width sOffset="0" a="3.5" b="0" c="0" d="0"/>
            <roadMark sOffset="0" type="broken" width="0.15" laneChange="both"/></lane>
          <lane id="-2" type="driving" level="false"><width sOffset="0" a="3.5" b="0" c="0" d="0"/>
            <roadMark sOffset="0" type="solid" width="0.15" laneChange="none"/></lane>
          <lane id="-3" type="shoulder" level="false"><width sOffset="0" a="1.5" b="0" c="0" d="0"/>
            <roadMark sOffset="0" type="none" width="0.15"/></lane>
        </right>
      </laneSection>
    </lanes>
  </road>
</OpenDRIVE>
"""


@pytest.fixture(scope="module")
def towns() -> dict[str, LaneGraph]:
    """Every town, loaded once for the module (no cache: exercises the loader itself)."""
    if MAPS_DIR is None or not MAPS_DIR.is_dir():
        pytest.skip("shared CARLA maps dir not found (set CARL_CARLA_MAPS)")
    return {t: load_opendrive(MAPS_DIR / f"{t}.xodr") for t in TOWNS}


def _heading_at(g: LaneGraph, i: int, k: int) -> np.ndarray:
    p = g.lane_points(i)
    a, b = p[max(k - 1, 0)], p[min(k + 1, len(p) - 1)]
    return b - a


def _left_side_ok(g: LaneGraph) -> tuple[int, int]:
    """(checked, correct) neighbour pairs: left neighbours at cross > 0, right neighbours at cross < 0."""
    checked = correct = 0
    for i in range(g.num_lanes):
        p = g.lane_points(i)
        k = len(p) // 2
        d = _heading_at(g, i, k)
        for nb, sign in ((int(g.left[i]), 1.0), (int(g.right[i]), -1.0)):
            if nb < 0:
                continue
            q = g.lane_points(nb)
            c = q[np.argmin(np.linalg.norm(q - p[k], axis=1))] - p[k]
            checked += 1
            correct += bool(sign * (d[0] * c[1] - d[1] * c[0]) > 0)
    return checked, correct


# ------------------------------------------------------------------------------------------ frame conversion
def test_frame_conversion_round_trip() -> None:
    x, y = carla_to_world(np.array([1.0, -2.0]), np.array([3.0, 4.0]))
    np.testing.assert_allclose(y, [-3.0, -4.0])
    np.testing.assert_allclose(world_to_carla(x, y), ([1.0, -2.0], [3.0, 4.0]))
    # CARLA yaw 90 deg points along CARLA +y, which is our -y: heading -pi/2.
    assert math.isclose(carla_yaw_to_world(90.0), -math.pi / 2)
    assert math.isclose(world_yaw_to_carla(carla_yaw_to_world(37.0)), 37.0)


def test_straight_road_left_neighbour_lies_left(tmp_path: Path) -> None:
    f = tmp_path / "straight.xodr"
    f.write_text(STRAIGHT_XODR)
    g = load_opendrive(f)
    assert g.num_lanes == 3
    linked = [i for i in range(g.num_lanes) if g.left[i] >= 0 or g.right[i] >= 0]
    assert linked, "lanes -1/-2 should be lane-change neighbours"
    checked, correct = _left_side_ok(g)
    assert checked >= 1 and correct == checked
    # lane -1 drives along our +x (OpenDRIVE +x is CARLA +x) and sits at our y = -1.75 (right of the centre line)
    i = next(i for i in range(g.num_lanes) if g.left[i] < 0 and g.right[i] >= 0)
    p = g.lane_points(i)
    assert p[-1, 0] > p[0, 0] and np.allclose(p[:, 1], -1.75, atol=0.05)
    assert len(g.shoulder_width) == 1 and math.isclose(float(g.shoulder_width[0]), 1.5, rel_tol=1e-3)


# ------------------------------------------------------------------------------------------ towns
@needs_maps
def test_available_towns_lists_all() -> None:
    assert set(TOWNS) <= set(available_towns())


@needs_maps
@pytest.mark.parametrize("town", TOWNS)
def test_town_geometry(towns: dict[str, LaneGraph], town: str) -> None:
    g = towns[town]
    counts = np.diff(g.offsets)
    assert g.num_lanes > 50
    assert (counts >= 2).all()
    assert np.isfinite(g.points).all() and (g.width > 0).all()
    assert np.isfinite(g.speed_limit).all() and (g.speed_limit > 0).all()
    # successor continuity: end of a lane to start of its successor
    gaps = [np.linalg.norm(g.lane_points(int(j))[0] - g.lane_points(i)[-1])
            for i in range(g.num_lanes) for j in g.successors(i)]
    assert len(gaps) > 0
    assert np.mean(np.asarray(gaps) < 1.0) > 0.99
    # lane-change neighbours lie on the correct side of the driving direction
    checked, correct = _left_side_ok(g)
    assert correct == checked
    assert g.crosswalks.shape[1:] == (4, 2) and np.isfinite(g.crosswalks).all()


@needs_maps
def test_town01_control(towns: dict[str, LaneGraph]) -> None:
    g = towns["Town01"]
    assert g.is_junction.sum() > 0
    assert len(g.stop_lane) > 0 and len(g.light_junction) > 0
    assert g.meta["derived_control"] is False
    light = g.stop_control == CONTROL_LIGHT
    assert light.any()
    # stop lines sit on approach lanes that enter the junction their light group belongs to
    for lane, grp in zip(g.stop_lane[light], g.stop_light_group[light]):
        assert not g.is_junction[lane]
        succ_j = {int(g.junction[s]) for s in g.successors(int(lane)) if g.is_junction[s]}
        assert int(g.light_junction[grp]) in succ_j
    # phases of a junction are 0..num_phases-1
    for j in np.unique(g.light_junction):
        ph = g.light_phase[g.light_junction == j]
        assert sorted(ph) == list(range(int(g.light_num_phases[g.light_junction == j][0])))
    # Town01 carries 90 km/h signs on its outer ring: some lanes get them
    assert np.isclose(g.speed_limit, 90 / 3.6).any() and np.isclose(g.speed_limit, 30 / 3.6).any()


@needs_maps
@pytest.mark.parametrize("town", ["Town03", "Town05"])
def test_signal_free_towns_get_derived_control(towns: dict[str, LaneGraph], town: str) -> None:
    g = towns[town]
    assert g.meta["derived_control"] is True
    assert len(g.light_junction) > 0 and (g.stop_control == CONTROL_LIGHT).all()


@needs_maps
def test_stop_signs_town07(towns: dict[str, LaneGraph]) -> None:
    g = towns["Town07"]
    assert (g.stop_control != CONTROL_LIGHT).sum() > 0
    assert len(set(g.stop_lane.tolist())) == len(g.stop_lane)  # one stop line per lane


@needs_maps
@pytest.mark.skipif(not ROUTE_00.is_file(), reason="longest6 route files not found")
def test_longest6_keypoint_on_a_lane(towns: dict[str, LaneGraph]) -> None:
    root = ET.parse(ROUTE_00).getroot()
    route = root.find("route")
    pos = route.find("waypoints/position")
    g = towns[route.get("town")]
    x, y = carla_to_world(float(pos.get("x")), float(pos.get("y")))
    assert np.linalg.norm(g.points - np.array([x, y]), axis=1).min() < 2.0
    # without the flip the point is nowhere near the road network
    assert np.linalg.norm(g.points - np.array([x, -y]), axis=1).min() > 10.0


# ------------------------------------------------------------------------------------------ errors and cache
@pytest.mark.parametrize("text, problem", [
    ("this is not xml <<<", "not well-formed"),
    ("<?xml version='1.0'?><map><road/></map>", "expected <OpenDRIVE>"),
    ("<?xml version='1.0'?><OpenDRIVE><header/></OpenDRIVE>", "no <road>"),
])
def test_malformed_file_raises_map_error(tmp_path: Path, text: str, problem: str) -> None:
    f = tmp_path / "broken.xodr"
    f.write_text(text)
    with pytest.raises(MapError, match=problem) as e:
        load_opendrive(f)
    assert str(f) in str(e.value)


def test_missing_file_raises_map_error(tmp_path: Path) -> None:
    with pytest.raises(MapError, match="does not exist"):
        load_opendrive(tmp_path / "nope.xodr")


@needs_maps
def test_unknown_town_lists_available() -> None:
    with pytest.raises(MapError, match="Town99") as e:
        load_town("Town99")
    assert "Town01" in str(e.value)


@needs_maps
def test_cache_round_trip(tmp_path: Path) -> None:
    g = load_town("Town02", cache_dir=tmp_path)
    files = list(tmp_path.glob("Town02-*.npz"))
    assert len(files) == 1 and len(files[0].stem.split("-")[1]) == 16
    mtime = files[0].stat().st_mtime_ns
    g2 = load_town("Town02", cache_dir=tmp_path)
    assert files[0].stat().st_mtime_ns == mtime  # served from the cache, not rebuilt
    for name in ("points", "offsets", "succ_index", "stop_lane", "light_phase", "speed_limit"):
        np.testing.assert_array_equal(getattr(g, name), getattr(g2, name))
    assert g2.meta["derived_control"] is False
    # a cache from another loader version is rebuilt
    g2.meta["loader_version"] = -1
    g2.save(files[0])
    g3 = load_town("Town02", cache_dir=tmp_path)
    assert g3.meta["loader_version"] != -1
    assert LaneGraph.load(files[0]).meta["loader_version"] == g3.meta["loader_version"]
    # an unreadable cache file is rebuilt too
    files[0].write_bytes(b"garbage")
    assert load_town("Town02", cache_dir=tmp_path).num_lanes == g.num_lanes


# ------------------------------------------------------------------------------------------ maps of our own (issue #11)
# Three small hand-made OpenDRIVE maps (tests/data/xodr, written by make_maps.py there): a roundabout without any
# signal, a junction whose approach roads are whole multiples of the sampling spacing long (600/100/200/100 m), and
# an oval whose lane -1 widens along a cubic width polynomial inside one lane section.
XODR_DIR = Path(__file__).resolve().parent / "data" / "xodr"
OWN_MAPS = ["roundabout_no_signals", "whole_length_junction", "width_taper"]
# <width> records of lane -1 of road 1 in width_taper.xodr: (sOffset, a, b, c, d); 3.0 -> 4.5 m over 60 m with zero
# slope at both ends, 4.5 m for 30 m, 4.5 -> 3.0 m over 60 m.
TAPER_RECORDS = [(0.0, 3.0, 0.0, 3 * 1.5 / 60 ** 2, -2 * 1.5 / 60 ** 3), (60.0, 4.5, 0.0, 0.0, 0.0),
                 (90.0, 4.5, 0.0, -3 * 1.5 / 60 ** 2, 2 * 1.5 / 60 ** 3)]


def _taper_width(s: float) -> float:
    s_off, a, b, c, d = [r for r in TAPER_RECORDS if r[0] <= s][-1]
    ds = s - s_off
    return a + b * ds + c * ds ** 2 + d * ds ** 3


@pytest.fixture(scope="module")
def own_maps() -> dict[str, LaneGraph]:
    return {m: load_opendrive(XODR_DIR / f"{m}.xodr") for m in OWN_MAPS}


@pytest.mark.parametrize("name", OWN_MAPS)
def test_own_map_loads_connected(own_maps: dict[str, LaneGraph], name: str) -> None:
    g = own_maps[name]
    assert g.num_lanes >= 8 and np.isfinite(g.points).all() and (g.point_widths() > 0).all()
    assert len(g.point_width) == len(g.points)
    # every lane continues (turnarounds / loops: no dead ends) and starts where its predecessor ends
    for i in range(g.num_lanes):
        assert len(g.successors(i)) > 0, f"{name}: lane {i} is a dead end"
        for j in g.successors(i):
            assert np.linalg.norm(g.lane_points(int(j))[0] - g.lane_points(i)[-1]) < 0.5


def test_roundabout_without_signals_has_no_control_and_routes(own_maps: dict[str, LaneGraph]) -> None:
    from envs.maps.routes import random_routes

    g = own_maps["roundabout_no_signals"]
    assert len(g.stop_lane) == 0 and len(g.light_junction) == 0  # four junctions with two approach roads each
    assert g.is_junction.any()
    routes = random_routes(g, 16, (150.0, 400.0), seed=0)
    assert len(routes) == 16 and all(150.0 <= r.length <= 400.0 for r in routes)


def test_whole_length_roads_load_with_full_length(own_maps: dict[str, LaneGraph]) -> None:
    # carla itself fails on the 600 m road at 1 m spacing: next_until_lane_end's last step lands on the lane end
    cmap = carla.Map("w", (XODR_DIR / "whole_length_junction.xodr").read_text())
    entry = next(a for a, _ in cmap.get_topology() if a.road_id == 10 and a.lane_id == -1)
    with pytest.raises(RuntimeError, match="distance > 0.0"):
        entry.next_until_lane_end(1.0)
    g = own_maps["whole_length_junction"]
    lengths = g.lane_lengths()
    for length, n_lanes in ((600.0, 2), (100.0, 4), (200.0, 2)):  # the approach roads, both directions, full length
        lanes = [i for i in range(g.num_lanes) if abs(lengths[i] - length) < 1e-3 and not g.is_junction[i]]
        assert len(lanes) == n_lanes, f"the {length:.0f} m road(s) lost lanes or length"
    i = next(i for i in range(g.num_lanes) if abs(lengths[i] - 600.0) < 1e-3 and g.lane_points(i)[0, 0] < 11)
    np.testing.assert_allclose(g.lane_points(i)[[0, -1]], [[10.0, -1.75], [610.0, -1.75]], atol=1e-3)
    # straight connectors of 20 m, and two light phases (approach axes E-W and N-S) from derived control
    assert np.isclose(lengths[g.is_junction], 20.0, atol=1e-3).sum() == 4
    assert g.meta["derived_control"] and sorted(g.light_phase.tolist()) == [0, 1]
    # coarser spacings (whole multiples of every road length) load as well
    for spacing in (2.0, 5.0):
        assert load_opendrive(XODR_DIR / "whole_length_junction.xodr", spacing=spacing).num_lanes == g.num_lanes


def test_width_taper_follows_the_cubic_polynomial(own_maps: dict[str, LaneGraph]) -> None:
    g = own_maps["width_taper"]
    # lane -1 of road 1 drives along +x from (0, 0) (our frame equals the OpenDRIVE frame: carla flips y, we flip back)
    i = next(i for i in range(g.num_lanes) if np.allclose(g.lane_points(i)[0], [0.0, -1.5], atol=0.05))
    p, w = g.lane_points(i).astype(np.float64), g.lane_widths(i).astype(np.float64)
    assert abs(p[-1, 0] - 150.0) < 1e-3
    for s in (0.0, 10.0, 25.0, 30.0, 45.0, 60.0, 75.0, 97.5, 120.0, 135.0, 150.0):
        expected = _taper_width(s)
        assert abs(np.interp(s, p[:, 0], w) - expected) < 0.01, (s, expected)
        assert abs(np.interp(s, p[:, 0], p[:, 1]) + expected / 2) < 0.01  # the lane centre moves out with it
    assert math.isclose(_taper_width(75.0), 4.5) and math.isclose(_taper_width(0.0), 3.0)
    # the road raster follows the taper: 4.4 m right of the reference line is road where the lane is 4.5 m wide only
    from envs.maps.rasterize import LAYER_ROAD, compile_raster

    r = compile_raster(g, ppm=4.0)

    def road_at(x: float, y: float) -> bool:
        col, row = int((x - r.origin[0]) * r.ppm), int((y - r.origin[1]) * r.ppm)
        return bool(r.layers[LAYER_ROAD, row, col] > 0)

    assert road_at(75.0, -4.4) and not road_at(5.0, -4.4) and road_at(5.0, -2.9)


def test_lane_graph_format_1_still_loads(tmp_path: Path, own_maps: dict[str, LaneGraph]) -> None:
    import json
    from dataclasses import fields

    g = own_maps["width_taper"]
    f = tmp_path / "v1.npz"
    arrays = {x.name: getattr(g, x.name) for x in fields(g) if x.name not in ("name", "meta", "point_width")}
    header = json.dumps({"version": 1, "name": g.name, "meta": g.meta})
    np.savez_compressed(f, __header__=np.frombuffer(header.encode(), np.uint8), **arrays)
    old = LaneGraph.load(f)
    assert len(old.point_width) == 0
    np.testing.assert_array_equal(old.point_widths(), np.repeat(g.width, np.diff(g.offsets)))
    g.save(tmp_path / "v2.npz")
    np.testing.assert_array_equal(LaneGraph.load(tmp_path / "v2.npz").point_width, g.point_width)


@pytest.mark.parametrize("name", OWN_MAPS)
def test_expert_drives_own_map_with_traffic(name: str, tmp_path: Path) -> None:
    import torch

    from envs.sim.config import SimConfig
    from envs.sim.env import SimEnv
    from envs.sim.expert import Expert

    env = SimEnv(SimConfig(map=str(XODR_DIR / f"{name}.xodr"), traffic=True, bev=False, num_routes=16, map_ppm=2.0,
                           cache_dir=str(tmp_path)), num_envs=8)
    obs, expert = env.reset(), Expert(env)
    for _ in range(200):
        r = env.step(expert(obs))
        obs = r.obs
    assert torch.isfinite(env.state.ego_xy).all() and (env.state.ego_speed > 1.0).any()


# ------------------------------------------------------------------------------------------ bad input -> MapError
def _variant(name: str, road: int, old: str, new: str) -> str:
    """Our width_taper map with ``old`` replaced by ``new`` inside road ``road``."""
    import re

    text = (XODR_DIR / f"{name}.xodr").read_text()
    m = re.search(rf'<road [^>]*id="{road}".*?</road>', text, flags=re.S)
    assert old in m.group(0)
    return text[:m.start()] + m.group(0).replace(old, new, 1) + text[m.end():]


@pytest.mark.parametrize("road, old, new, message", [
    # each of these crashes carla's parser (segmentation fault) without the checks
    (2, '<successor id="-1"/>', '<successor id="-9"/>', r"road 2 lane -1: its successor is lane -9 of road 3"),
    (2, '<predecessor id="1"/>', '<predecessor id="9"/>', r"road 2 lane 1: its predecessor is lane 9 of road 1"),
    (3, "<line/>", "", r"road 3 .*exactly one of <line>, <arc>"),
    (1, '<lane id="1" type="driving"', '<lane id="-3" type="driving"', r"road 1 .*lane -3 sits in <left>"),
    # these make carla raise without naming the road
    (4, '<laneSection s="0">', '<laneSection s="500">', r"road 4 .*laneSection s='500'.* outside its length"),
    (1, 'length="150" id="1"', 'length="abc" id="1"', r"road 1 .*length 'abc'"),
])
def test_malformed_road_is_a_map_error_naming_the_road(tmp_path: Path, road: int, old: str, new: str,
                                                       message: str) -> None:
    f = tmp_path / "bad.xodr"
    f.write_text(_variant("width_taper", road, old, new))
    with pytest.raises(MapError, match=message) as e:
        load_opendrive(f)
    assert str(f) in str(e.value) and "fix" in str(e.value).lower()


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="isolation forks (Linux)")
def test_carla_crash_is_a_map_error(tmp_path: Path) -> None:
    """Without the XML checks this file segfaults carla; the forked compile turns that into a MapError."""
    import re

    from envs.maps.opendrive import _compile_isolated

    text = re.sub(r'(<road [^>]*id="2".*?)<planView>.*?</planView>', r"\1", (XODR_DIR / "width_taper.xodr").read_text(),
                  count=1, flags=re.S)
    f = tmp_path / "crash.xodr"
    with pytest.raises(MapError, match=r"carla crashed \(signal SIG\w+\) while parsing the file") as e:
        _compile_isolated((f, text, {}, "crash", 1.0))
    assert str(f) in str(e.value) and "fix" in str(e.value)


def test_carla_errors_name_file_and_road(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from envs.maps import opendrive

    f = XODR_DIR / "width_taper.xodr"

    def walk_fails(self, wp, k):
        raise RuntimeError("distance > 0.0")

    monkeypatch.setattr(opendrive._Builder, "_walk", walk_fails)
    with pytest.raises(MapError, match=r"while walking road \d+ lane -?\d+ .*RuntimeError: distance > 0.0.*fix") as e:
        load_opendrive(f, isolate=False)
    assert str(f) in str(e.value)

    class Unparsable:
        def Map(self, name, text):  # noqa: N802 - carla's name
            raise RuntimeError("s <= road->GetLength()")

    monkeypatch.setattr(opendrive, "_import_carla", lambda: Unparsable())
    with pytest.raises(MapError, match=r"carla could not parse it \(RuntimeError: s <= road->GetLength\(\)\); fix"):
        load_opendrive(f, isolate=False)

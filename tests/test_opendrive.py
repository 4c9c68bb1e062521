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

"""Multi-map worlds: several maps side by side in one batched environment (envs/maps/atlas.py)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from envs import make_env
from envs.maps.atlas import build_atlas
from envs.maps.lanegraph import Lane, LaneGraph, MapError
from envs.maps.procedural import ProceduralConfig, generate_world
from envs.maps.rasterize import compile_raster
from envs.maps.routes import RouteError, random_routes
from envs.sim.agents import LEADERBOARD_VEHICLES, vehicles_per_map
from envs.config import ConfigError
from envs.sim.world import bev_reach_m
from envs.sim.world import lane_lookup

XODR = Path(__file__).parent / "data" / "xodr"
MAPS = ("procedural", str(XODR / "roundabout_no_signals.xodr"), str(XODR / "whole_length_junction.xodr"))
SMALL = dict(town_seeds=(0,), num_routes=16, route_length=(40.0, 80.0), bev_size=64, bev_ego_from_bottom=24,
             bev_ppm=1.0, maps=MAPS)


def mm_env(num_envs: int = 12, seed: int = 0, **kw):
    return make_env("sim", num_envs, "cpu", seed, **{**SMALL, **kw})


def map_of_lane(world, lane: torch.Tensor) -> torch.Tensor:
    return world.lane_map[lane]


def world_lane_offsets(world) -> list[int]:
    """[M + 1] lane offsets: map k's lanes are one block."""
    return [0] + torch.cumsum(torch.bincount(world.lane_map, minlength=world.num_maps), 0).tolist()


def test_concatenate_shifts_every_index() -> None:
    a = generate_world(ProceduralConfig(), [0])
    b = generate_world(ProceduralConfig(), [1])
    m = LaneGraph.concatenate("ab", [a, b.translated((5000.0, -20.0))])
    La, Pa, Ga, Ja, Ka = a.num_lanes, len(a.points), len(a.light_junction), a.num_junctions(), len(a.stop_lane)
    assert m.num_lanes == La + b.num_lanes and len(m.points) == Pa + len(b.points)
    np.testing.assert_allclose(m.points[Pa:], b.points + np.float32([5000.0, -20.0]), atol=1e-3)
    np.testing.assert_allclose(m.crosswalks[len(a.crosswalks):], b.crosswalks + np.float32([5000.0, -20.0]), atol=1e-3)
    for i in range(b.num_lanes):
        assert m.successors(La + i).tolist() == (b.successors(i) + La).tolist()
        np.testing.assert_array_equal(m.lane_points(La + i), m.points[Pa + b.offsets[i]:Pa + b.offsets[i + 1]])
        for side in ("left", "right"):
            j = int(getattr(b, side)[i])
            assert int(getattr(m, side)[La + i]) == (-1 if j < 0 else j + La)
        j = int(b.junction[i])
        assert int(m.junction[La + i]) == (-1 if j < 0 else j + Ja)
    np.testing.assert_array_equal(m.stop_lane[Ka:], b.stop_lane + La)
    np.testing.assert_array_equal(m.stop_light_group[Ka:], np.where(b.stop_light_group >= 0, b.stop_light_group + Ga,
                                                                    -1))
    np.testing.assert_array_equal(m.light_junction[Ga:], b.light_junction + Ja)
    # the first map is untouched
    np.testing.assert_array_equal(m.points[:Pa], a.points)
    assert [m.successors(i).tolist() for i in range(La)] == [a.successors(i).tolist() for i in range(La)]


def test_compact_junctions_keeps_the_partition() -> None:
    g = generate_world(ProceduralConfig(), [0])
    sparse = LaneGraph.concatenate("s", [g]).compact_junctions()  # already dense: unchanged partition
    spread = g.__class__(**{**g.__dict__, "junction": np.where(g.junction >= 0, g.junction * 7 + 100, -1).astype(np.int32),
                            "light_junction": (g.light_junction * 7 + 100).astype(np.int32)})
    c = spread.compact_junctions()
    assert c.num_junctions() == len(np.unique(np.concatenate([g.junction[g.junction >= 0], g.light_junction])))
    # lanes share a junction after compaction exactly when they did before; lights keep their junction
    same = lambda j: (j[:, None] == j[None, :]) & (j[:, None] >= 0)  # noqa: E731
    np.testing.assert_array_equal(same(c.junction), same(g.junction))
    np.testing.assert_array_equal(c.junction[g.stop_lane], sparse.junction[g.stop_lane])
    for k, lane in enumerate(g.stop_lane):
        grp = g.stop_light_group[k]
        if grp >= 0 and g.junction[lane] >= 0:
            assert (c.light_junction[grp] == c.junction[lane]) == (g.light_junction[grp] == g.junction[lane])


def test_atlas_keeps_maps_apart_and_lookups_find_each_maps_lanes() -> None:
    env = mm_env(4)
    w = env.world
    assert w.map_names == list(MAPS) and w.num_maps == 3
    offs = world_lane_offsets(w)
    boxes = []
    for k in range(3):
        lanes = torch.arange(int(offs[k]), int(offs[k + 1]))
        pts = w.lane_pts[lanes, :2].reshape(-1, 2)  # the first points of each lane of map k
        lane, _, _, found, _ = lane_lookup(w, pts)
        assert found.all()
        assert ((lane >= offs[k]) & (lane < offs[k + 1])).all(), f"map {k}: a lookup found another map's lane"
        p = w.graph.points[w.graph.offsets[int(offs[k])]:w.graph.offsets[int(offs[k + 1])]]
        boxes.append((p.min(0), p.max(0)))
    reach = bev_reach_m(env.cfg)
    for i in range(3):
        for j in range(i + 1, 3):
            gap = np.maximum(boxes[j][0] - boxes[i][1], boxes[i][0] - boxes[j][1]).max()
            assert gap >= reach, f"maps {i} and {j} are {gap:.0f} m apart; a BEV reaches {reach:.0f} m"


def test_one_map_is_left_where_it_is() -> None:
    g = generate_world(ProceduralConfig(), [0])
    r = compile_raster(g, 2.0)
    atlas = build_atlas([g], [r], gap_m=100.0)
    assert atlas.graph is g and atlas.raster is r and not atlas.shifts.any()


def test_rows_and_their_traffic_stay_on_their_map() -> None:
    env = mm_env(12, num_vehicles=6)
    w = env.world
    env.reset()
    gen = torch.Generator().manual_seed(0)
    maps_seen = set()
    for t in range(150):
        a = torch.rand(12, 2, generator=gen) * 2 - 1
        a[:, 1] = a[:, 1].abs() * 0.5
        env.step(a)
        s = env.state
        row_map = w.route_map[s.route_id]
        maps_seen |= set(row_map.tolist())
        veh_map = map_of_lane(w, s.veh.lane)
        assert (veh_map[s.veh.valid] == row_map.unsqueeze(1).expand_as(veh_map)[s.veh.valid]).all(), t
        lane, _, _, found, _ = lane_lookup(w, s.ego_xy)
        assert (map_of_lane(w, lane)[found] == row_map[found]).all(), t
    assert maps_seen == {0, 1, 2}


def test_map_weights_set_how_often_each_map_is_driven() -> None:
    env = mm_env(8, map_weights=(1.0, 0.0, 3.0))
    w = env.world
    p_route = torch.diff(w.route_cdf, prepend=torch.zeros(1))
    p_map = torch.zeros(3).index_add_(0, w.route_map, p_route)
    torch.testing.assert_close(p_map, torch.tensor([0.25, 0.0, 0.75]), atol=1e-5, rtol=0)
    picks = env.starts.pick(torch.arange(8000) % 8)
    counts = torch.bincount(w.route_map[picks], minlength=3).float()
    assert counts[1] == 0
    assert 2.7 < counts[2] / counts[0] < 3.3


def test_eval_split_covers_every_map_first() -> None:
    env = mm_env(6, route_split="eval")
    env.reset()
    assert sorted(env.world.route_map[env.state.route_id].tolist()) == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("opts, err, match", [
    (dict(maps=("procedural", "Town99")), MapError, r"env\.options\.maps\[1\]='Town99': unknown town 'Town99'.*available: Town01"),
    (dict(map_weights=(1.0, 2.0)), ConfigError, r"env\.options\.map_weights=\(1\.0, 2\.0\): give one weight per map"),
    (dict(map_weights=(1.0, -1.0, 1.0)), ConfigError, r"env\.options\.map_weights.*>= 0"),
    (dict(map_weights=(0.0, 0.0, 0.0)), ConfigError, r"env\.options\.map_weights.*positive sum"),
    (dict(maps=("procedural", "procedural")), ConfigError, r"env\.options\.maps=.*name each map once"),
    (dict(maps=("procedural", "DEAD_END"), route_length=(100.0, 200.0)), RouteError,
     r"env\.options\.maps\[1\]=.*dead_end.npz': random routes on map 'dead_end'.* routes of 100-200 m.*Fix: shorter routes"),
    (dict(traffic_density="dense"), ConfigError, r"env\.options\.traffic_density='dense'.*'fixed'.*'leaderboard'"),
])
def test_bad_map_lists_name_the_key_and_the_fix(opts, err, match, tmp_path) -> None:
    if "DEAD_END" in opts.get("maps", ()):  # one 50 m lane that leads nowhere: no route of 100 m exists
        path = tmp_path / "dead_end.npz"
        LaneGraph.build("dead_end", [Lane(points=np.array([[0.0, 0.0], [50.0, 0.0]]))]).save(path)
        opts = {**opts, "maps": tuple(str(path) if m == "DEAD_END" else m for m in opts["maps"])}
    with pytest.raises(err, match=match):
        mm_env(2, **opts)


def test_leaderboard_density_per_town() -> None:
    # Town01 with 6 lane km, 1.5 of them around the ego: 120 / 6 * 1.5 = 30 vehicles, capped at the 20 slots;
    # Town04 with 30 lane km, 1.5 around the ego: 200 / 30 * 1.5 = 10; a map the Leaderboard does not drive: 20
    world = SimpleNamespace(map_names=["Town01", "Town04", "mine.xodr"], num_maps=3, device=torch.device("cpu"),
                            map_lane_km=torch.tensor([6.0, 30.0, 2.0]), map_local_lane_km=torch.tensor([1.5, 1.5, 1.0]))
    assert LEADERBOARD_VEHICLES["Town01"] == 120 and LEADERBOARD_VEHICLES["Town04"] == 200
    assert vehicles_per_map(world, 20, "leaderboard").tolist() == [20, 10, 20]
    assert vehicles_per_map(world, 20, "fixed").tolist() == [20, 20, 20]


def test_vehicle_slots_follow_the_rows_map() -> None:
    env = mm_env(6, num_vehicles=8)
    env.actors.map_vehicles = torch.tensor([8, 0, 3])  # as vehicles_per_map would give
    env.reset()
    for _ in range(25):
        env.step(torch.zeros(6, 2))
    row_map = env.world.route_map[env.state.route_id]
    n = env.state.veh.valid.sum(1)
    assert (n[row_map == 1] == 0).all() and (n[row_map == 2] <= 3).all()


def test_turn_bias_makes_routes_turn_more() -> None:
    """At every choice between turning and straight successors, a route turns with the rule's probability:
    sum over turning exits of (1 + bias) / sum over all exits of (1 + bias * turning)."""
    g = generate_world(ProceduralConfig(), [0, 1])
    from envs.maps.routes import _turning_lanes

    turning = _turning_lanes(g)

    def observed_and_expected(bias: float) -> tuple[float, float, int]:
        turned, expected = [], []
        for r in random_routes(g, 300, (150.0, 300.0), seed=3, turn_bias=bias):
            seq = r.lanes[np.concatenate([[True], np.diff(r.lanes) != 0])]
            for a, b in zip(seq[:-1], seq[1:]):
                succ = g.successors(int(a))
                t = turning[succ]
                if int(b) not in succ.tolist() or t.all() or not t.any():
                    continue  # not a choice between turning and straight
                w = 1.0 + bias * t
                turned.append(bool(turning[int(b)]))
                expected.append(float(w[t].sum() / w.sum()))
        return float(np.mean(turned)), float(np.mean(expected)), len(turned)

    for bias in (0.0, 4.0):
        got, want, n = observed_and_expected(bias)
        assert n > 200
        assert abs(got - want) < 3 * np.sqrt(want * (1 - want) / n) + 0.01, (bias, got, want, n)
    assert observed_and_expected(4.0)[0] > observed_and_expected(0.0)[0] + 0.1


def test_junction_start_puts_route_starts_before_junctions() -> None:
    g = generate_world(ProceduralConfig(), [0])

    def first_junction_m(bias: float) -> np.ndarray:
        out = []
        for r in random_routes(g, 60, (120.0, 200.0), seed=5, junction_start=bias):
            inside = np.flatnonzero(g.is_junction[r.lanes])
            out.append(r.cumulative()[inside[0]] if len(inside) else np.inf)
        return np.array(out)

    always = first_junction_m(1.0)
    assert (always <= 50.0 + 1.0).all(), always.max()  # starts 5-50 m before the end of an approach lane
    assert (always >= 5.0 - 1.0).all(), always.min()
    uniform = first_junction_m(0.0)  # uniform starts also land closer than 5 m or further than 50 m
    assert ((uniform < 4.0) | (uniform > 51.0)).sum() >= 3, uniform

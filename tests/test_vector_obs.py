"""The vector observation (envs/sim/vector_obs.py) on a hand-built road, every expectation computed here from the
map and the documented frame (x forward, y left; yaw relative to the ego's):

two same-direction lanes eastwards, A on y = 0 (x 0..200, the kerb on its right) and B on y = 3.5 (A's left
neighbour) ending at a light's stop line at x = 200, then C (x 200..300, y = 3.5) on; an oncoming lane D on y = 7.
The route drives A, changes to B at x = 50, then B and C."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from envs.api import (OBS_LANES, OBS_PEDESTRIANS, OBS_ROUTE, OBS_STOPS, OBS_VEHICLES, PATH_FEATURES, VECTOR_FEATURES,
                      vector_features)
from envs.config import ConfigError, from_dict
from envs.maps.lanegraph import CONTROL_LIGHT, Lane, LaneGraph, LightGroup, StopLine
from envs.maps.routes import Route
from envs.sim.config import SimConfig
from envs.sim.env import SimEnv
from envs.sim.world import build_world
from tests.support.roads import straight

W = 3.5
F = {k: {name: i for i, name in enumerate(v)} for k, v in VECTOR_FEATURES.items()}


def road() -> LaneGraph:
    lanes = [Lane(points=straight(0, 200, 0.0), width=W, left=1),  # A
             Lane(points=straight(0, 200, W), width=W, right=0, successors=[2]),  # B
             Lane(points=straight(200, 300, W), width=W),  # C
             Lane(points=straight(300, 0, 2 * W), width=W)]  # D, oncoming
    return LaneGraph.build("road", lanes, [StopLine(lane=1, control=CONTROL_LIGHT, light_group=0)],
                           [LightGroup(junction=0, phase=0, num_phases=2)])


def route() -> Route:
    """1 m points: A for x 0..49, B from x 50 (the lane change), C from x 200."""
    xs = np.arange(0, 300, dtype=np.float32)
    ys = np.where(xs < 50, 0.0, W).astype(np.float32)
    lanes = np.where(xs < 50, 0, np.where(xs < 200, 1, 2)).astype(np.int32)
    return Route("r", np.stack([xs, ys], 1), lanes)


def make_env(**vector: float) -> SimEnv:
    cfg = _cfg(**vector)
    env = SimEnv(cfg, 1, world=build_world(road(), [route()], cfg, torch.device("cpu")))
    env.reset()
    return env


def _cfg(**vector: float) -> SimConfig:
    """No traffic (the tests place the actors), 3 vehicle, 2 pedestrian and 1 static slots, ``vector`` sizes."""
    return from_dict(SimConfig, {"traffic": False, "bev": False, "observation": "vector", "num_vehicles": 3,
                                 "num_pedestrians": 2, "num_statics": 1, "vector": vector}, "env.options").validate()


def place(env: SimEnv, x: float, y: float, yaw: float, route_idx: int) -> None:
    s = env.state
    s.ego_xy[0] = torch.tensor([x, y])
    s.ego_yaw[0] = yaw
    s.route_idx[0] = route_idx


def test_route_points_every_spacing_metres_with_the_lane_change_marked_once() -> None:
    """Ego on its route point x = 10: samples at route metres 10 + 4k (k = 1..20). Route metres: x up to x = 49; the
    hop to (50, 3.5) is sqrt(1 + 3.5^2) m; then 1 m per point. So sample k sits on the last point at or before its
    metre, on lane B from the first sample past the hop, where (and only where) lane_change is +1 (to the left)."""
    env = make_env()
    place(env, 10.0, 0.0, 0.0, 10)
    r = env.observe()[OBS_ROUTE][0]
    hop = math.hypot(1.0, W)
    cum = np.concatenate([np.arange(50.0), 49.0 + hop + np.arange(250.0)])
    for k in range(20):
        at = 10.0 + 4.0 * (k + 1)
        i = int(np.searchsorted(cum, at, side="right") - 1)
        x, y = float(i), (0.0 if i < 50 else W)
        assert r[k, F[OBS_ROUTE]["x_m"]].item() == pytest.approx(x - 10.0, abs=1e-4)
        assert r[k, F[OBS_ROUTE]["y_m"]].item() == pytest.approx(y, abs=1e-4)
        prev_i = 10 if k == 0 else int(np.searchsorted(cum, at - 4.0, side="right") - 1)
        expect = 1.0 if prev_i < 50 <= i else 0.0
        assert r[k, F[OBS_ROUTE]["lane_change"]].item() == expect, k
        assert r[k, F[OBS_ROUTE]["valid"]].item() == 1.0
    assert r[:, F[OBS_ROUTE]["lane_change"]].sum().item() == 1.0


def test_the_route_past_its_end_is_padding() -> None:
    """Ego at route point 290: the route's last point is metre 49 + hop + 249; samples beyond it are all zero."""
    env = make_env()
    place(env, 290.0, W, 0.0, 290)
    r = env.observe()[OBS_ROUTE][0]
    end = 49.0 + math.hypot(1.0, W) + 249.0
    here = 49.0 + math.hypot(1.0, W) + 240.0
    valid = [here + 4.0 * (k + 1) <= end for k in range(20)]
    assert r[:, -1].tolist() == [float(v) for v in valid]
    assert not r[~torch.tensor(valid)].any()


def test_vehicles_in_the_ego_frame_nearest_first_and_beyond_the_radius_masked() -> None:
    """Ego at (10, 0) heading 0.3 rad; vehicles at 30 m, 10 m and 70 m (beyond actor_radius 60), headings 0.3 + 0.5
    and speeds 4 m/s; vector.vehicles=2 keeps the nearest two, nearest first."""
    env = make_env(vehicles=2)
    place(env, 10.0, 0.0, 0.3, 10)
    v = env.state.veh
    ego = np.array([10.0, 0.0])
    spots = [ego + 30 * np.array([math.cos(1.0), math.sin(1.0)]), ego + np.array([10.0, 0.0]),
             ego + np.array([0.0, 70.0])]
    for i, p in enumerate(spots):
        v.xy[0, i] = torch.tensor(p, dtype=torch.float32)
        v.yaw[0, i], v.speed[0, i], v.valid[0, i] = 0.8, 4.0, True
    v.lights[0, 1] = 1  # LIGHT_BRAKE
    obs = env.observe()[OBS_VEHICLES][0]
    f = F[OBS_VEHICLES]
    assert obs.shape == (2, len(f))
    c, s = math.cos(0.3), math.sin(0.3)
    for row, p in ((0, spots[1]), (1, spots[0])):
        dx, dy = p - ego
        assert obs[row, f["x_m"]].item() == pytest.approx(c * dx + s * dy, abs=1e-4)
        assert obs[row, f["y_m"]].item() == pytest.approx(c * dy - s * dx, abs=1e-4)
        assert obs[row, f["cos_yaw"]].item() == pytest.approx(math.cos(0.5), abs=1e-5)
        assert obs[row, f["vx_mps"]].item() == pytest.approx(4 * math.cos(0.5), abs=1e-4)
        assert obs[row, f["vy_mps"]].item() == pytest.approx(4 * math.sin(0.5), abs=1e-4)
        assert obs[row, f["valid"]].item() == 1.0
    assert obs[0, f["brake_light"]].item() == 1.0 and obs[1, f["brake_light"]].item() == 0.0
    # the 70 m vehicle is out of reach: with all three slots asked, its row is padding
    env = make_env(vehicles=3)
    place(env, 10.0, 0.0, 0.3, 10)
    for i, p in enumerate(spots):
        env.state.veh.xy[0, i] = torch.tensor(p, dtype=torch.float32)
        env.state.veh.valid[0, i] = True
    obs = env.observe()[OBS_VEHICLES][0]
    assert obs[:, -1].tolist() == [1.0, 1.0, 0.0] and not obs[2].any()


def test_more_actor_rows_than_slots_are_padding_and_standing_walkers_have_no_velocity() -> None:
    """vector.pedestrians=5 on an env of 2 pedestrian slots: 5 rows, the last 3 all zero; a walker that is not
    moving reports zero velocity whatever its speed field."""
    env = make_env(pedestrians=5)
    place(env, 10.0, 0.0, 0.0, 10)
    p = env.state.ped
    p.xy[0, 0], p.yaw[0, 0], p.speed[0, 0], p.valid[0, 0], p.moving[0, 0] = torch.tensor([15.0, -3.0]), 1.0, 1.4, True, False
    obs = env.observe()[OBS_PEDESTRIANS][0]
    f = F[OBS_PEDESTRIANS]
    assert obs.shape == (5, len(f)) and obs[0, f["valid"]].item() == 1.0
    assert obs[0, f["x_m"]].item() == pytest.approx(5.0) and obs[0, f["y_m"]].item() == pytest.approx(-3.0)
    assert obs[0, f["vx_mps"]].item() == 0.0 and obs[0, f["vy_mps"]].item() == 0.0
    assert not obs[1:].any()


def test_lane_points_are_the_maps_points_within_the_radius() -> None:
    """Lane points every 5 m of each lane (its end included) within 40 m of the ego at (100, 0): all of them (64 rows
    hold them: A x 60..140 -> 17 points, B and D x 65..135 -> 15 each, C none), each with its lane's direction,
    width and kerb flag."""
    env = make_env(lanes=64)
    place(env, 100.0, 0.0, 0.0, 100)
    obs = env.observe()[OBS_LANES][0]
    f = F[OBS_LANES]
    got = sorted((round(r[f["x_m"]].item() + 100, 3), round(r[f["y_m"]].item(), 3), r[f["cos_yaw"]].item(),
                  r[f["kerb_right"]].item()) for r in obs if r[f["valid"]] > 0)
    want = []
    for y, xs, cos, kerb in ((0.0, range(0, 201, 5), 1.0, 1.0), (W, range(0, 201, 5), 1.0, 0.0),
                             (W, range(200, 301, 5), 1.0, 1.0), (2 * W, range(300, -1, -5), -1.0, 1.0)):
        want += [(float(x), y, cos, kerb) for x in xs if (x - 100.0) ** 2 + y ** 2 <= 40.0 ** 2]
    assert len(want) == 17 + 15 + 15 and got == sorted(want)
    assert all(r[f["width_m"]].item() == pytest.approx(W) for r in obs if r[f["valid"]] > 0)
    assert not obs[obs[:, -1] == 0].any()


def test_the_next_stop_line_with_its_light_and_distance_along_the_route() -> None:
    """Ego at route point x = 120 on B: the stop line at B's end (route point x = 199, its centre (200, 3.5)) is
    79 route metres ahead; a light part answering red shows red, and the second row is padding."""
    env = make_env()
    place(env, 120.0, W, 0.0, 120)
    red = lambda group: (torch.full_like(group, 2), torch.zeros(group.shape))  # noqa: E731
    obs = env.observer.observe(env.state, red)[OBS_STOPS][0]
    f = F[OBS_STOPS]
    assert obs[0, f["ahead_m"]].item() == pytest.approx(79.0, abs=1e-3)
    assert obs[0, f["x_m"]].item() == pytest.approx(80.0, abs=1e-3) and obs[0, f["y_m"]].item() == pytest.approx(0.0)
    assert obs[0, [f["green"], f["yellow"], f["red"], f["stop_sign"]]].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert obs[0, f["valid"]].item() == 1.0 and not obs[1].any()


@pytest.mark.parametrize("key, value, fix", [("lanes", 0, "[1, 4096]"), ("lanes", 1000, "more than the 164 lane points"),
                                             ("lane_radius", -1.0, "(0, 1000]")])
def test_bad_sizes_name_the_key(key: str, value: float, fix: str) -> None:
    with pytest.raises(ConfigError, match=rf"env\.options\.vector\.{key}=.*{re.escape(fix)}"):
        make_env(**{key: value})


def test_a_backend_that_cannot_build_it_says_so() -> None:
    from envs.sim.observation import CarlaObserver

    cfg = _cfg()
    with pytest.raises(ConfigError, match="observation=vector.*CarlaObserver.*use env.options.observation=bev"):
        SimEnv(cfg, 1, world=build_world(road(), [route()], cfg, torch.device("cpu")), observer=CarlaObserver())


def test_actors_are_placed_along_and_across_the_route_ahead() -> None:
    """Ego at route point x = 10 (heading 0.3: the route frame does not turn with the ego). A vehicle at (30, 2) is
    20 route metres ahead, 2 m left of it. One at (63, 2.5), past the lane change to y = 3.5, lies beside the route
    point x = 63 (a sample: route metre 10 + 4 * 14 = 66 falls on it), 49 + hop + 13 route metres from the start:
    s = that - 10, d = 2.5 - 3.5 = -1 (right of the route)."""
    env = make_env(vehicles=3)
    place(env, 10.0, 0.0, 0.3, 10)
    v = env.state.veh
    for i, p in enumerate(((30.0, 2.0), (63.0, 2.5))):
        v.xy[0, i], v.valid[0, i] = torch.tensor(p), True
    obs = env.observe()[OBS_VEHICLES][0]
    f = F[OBS_VEHICLES]
    assert obs[0, f["route_s_m"]].item() == pytest.approx(20.0, abs=1e-3)
    assert obs[0, f["route_d_m"]].item() == pytest.approx(2.0, abs=1e-3)
    assert obs[1, f["route_s_m"]].item() == pytest.approx(49.0 + math.hypot(1.0, W) + 13.0 - 10.0, abs=1e-3)
    assert obs[1, f["route_d_m"]].item() == pytest.approx(-1.0, abs=1e-3)


def test_route_coordinates_measure_from_the_first_nearest_valid_point() -> None:
    """route_coordinates on its own: route points (x, y, cos, sin) p0 = (0, 0) heading +x at route metre 0, p1 =
    (4, 0) heading +y at metre 4, p2 = (8, 0) at metre 8 but not valid.
    - (2, 1) is as near to p0 as to p1 (squared distance 5): the first counts, s = 0 + 2, d = 1 (from p1 it would
      be s = 4 + 1, d = 2);
    - (7, -2) is nearest p2 (5), which is not valid; then p1 (13): rel (3, -2), s = 4 + (-2) = 2, d = -3;
    - on a row without a valid point, the first point: (3, 1) from p0 -> s = 3, d = 1."""
    from envs.sim.vector_obs import route_coordinates
    route = torch.tensor([[0.0, 0.0, 1.0, 0.0], [4.0, 0.0, 0.0, 1.0], [8.0, 0.0, 1.0, 0.0]]).expand(2, 3, 4)
    arc = torch.tensor([[0.0, 4.0, 8.0]] * 2)
    ok = torch.tensor([[True, True, False], [False, False, False]])
    xy = torch.tensor([[[2.0, 1.0], [7.0, -2.0]], [[3.0, 1.0], [3.0, 1.0]]])
    out = route_coordinates(xy, route, arc, ok)
    assert out[0].tolist() == [[2.0, 1.0], [2.0, -3.0]]
    assert out[1, 0].tolist() == [3.0, 1.0]


def test_path_conflicts_say_where_and_when_each_moving_actor_meets_the_route() -> None:
    """Ego at route point x = 10 heading east; the route samples every 4 m lie at (10 + 4k, 0), route metres 4k, up
    to the lane change at x = 50. A car at (30, 20) heading south at 10 m/s crosses y = 0 at x = 30, the sample 20 m
    ahead, after 20 / 10 = 2 s. A car at (0, 0) heading east at 5 m/s (behind the ego, on its route) reaches the ego's
    route point after 10 / 5 = 2 s. A car at (30, 10) heading north moves away: no sample comes within 3 m. A walker at
    (38, -6) heading north at 2 m/s reaches the sample at x = 38 (28 m ahead) after 3 s. Then a car standing 0.5 m
    beside the route at x = 22 meets the sample there (12 m) at once."""
    env = make_env(path_conflicts=True)
    place(env, 10.0, 0.0, 0.0, 10)
    v, p = env.state.veh, env.state.ped
    for i, (xy, yaw, speed) in enumerate((((30.0, 20.0), -math.pi / 2, 10.0), ((0.0, 0.0), 0.0, 5.0),
                                          ((30.0, 10.0), math.pi / 2, 10.0))):
        v.xy[0, i], v.yaw[0, i], v.speed[0, i], v.valid[0, i] = torch.tensor(xy), yaw, speed, True
    p.xy[0, 0], p.yaw[0, 0], p.speed[0, 0], p.moving[0, 0], p.valid[0, 0] = torch.tensor([38.0, -6.0]), \
        math.pi / 2, 2.0, True, True
    obs = env.observe()
    names = vector_features(True)
    assert names[OBS_VEHICLES][-4:] == (*PATH_FEATURES, "valid") and names[OBS_PEDESTRIANS][-4:-1] == PATH_FEATURES
    f, fp = {n: i for i, n in enumerate(names[OBS_VEHICLES])}, {n: i for i, n in enumerate(names[OBS_PEDESTRIANS])}
    got = lambda row, ff: [round(row[ff[n]].item(), 3) for n in PATH_FEATURES]  # noqa: E731
    cars = obs[OBS_VEHICLES][0]
    assert got(cars[0], f) == [20.0, 2.0, 1.0]
    assert got(cars[1], f) == [0.0, 2.0, 1.0]
    assert got(cars[2], f) == [0.0, 10.0, 0.0]  # the horizon where it never meets
    assert got(obs[OBS_PEDESTRIANS][0][0], fp) == [28.0, 3.0, 1.0]
    v.xy[0, 0], v.speed[0, 0], v.valid[0, 1], v.valid[0, 2] = torch.tensor([22.0, 0.5]), 0.0, False, False
    cars = env.observe()[OBS_VEHICLES][0]
    assert got(cars[0], f) == [12.0, 0.0, 1.0] and not cars[1:].any()
    # off by default: the layout of policies trained without them is unchanged
    assert make_env().observation_spec[OBS_VEHICLES].names == VECTOR_FEATURES[OBS_VEHICLES]


def test_scripted_paths_flag_a_car_whose_path_bends_across_the_route() -> None:
    """Ego at route point x = 10 heading east, route samples every 4 m at (10 + 4k, 0) before the lane change. Two cars
    at (30, 20) heading east at 10 m/s: the background one (slot 0) goes straight on, parallel to the route 20 m off,
    and never meets it. The scenario one (the last slot) is scripted east to (40, 20) in 1 s, then south at 10 m/s: it
    reaches (40, 0) at t = 3 s, 2 m from the samples at x = 38 and 42 (route metres 28 and 32), each nearest there; of
    the two at once the nearer on the route counts. Marked gone from 2.5 s on (its path ends at (40, 5)) it meets
    nothing. Not shown now, it keeps the straight line's features: turned south at (30, 20), its straight line crosses
    the route at x = 30 (route metre 20) after 20 / 10 = 2 s, which its dead scripted path would not say."""
    env = make_env(path_conflicts=True, scripted_paths=True)
    place(env, 10.0, 0.0, 0.0, 10)
    v = env.state.veh
    for i in (0, 2):
        v.xy[0, i], v.yaw[0, i], v.speed[0, i], v.valid[0, i] = torch.tensor([30.0, 20.0]), 0.0, 10.0, True
    taus = env.observer.scripted_taus
    assert taus[1] - taus[0] == 0.5 and taus[-1] == 10.0
    bend = torch.stack((30.0 + 10.0 * taus.clamp(max=1.0), 20.0 - 10.0 * (taus - 1.0).clamp(min=0.0)), -1)
    f = {n: i for i, n in enumerate(vector_features(True)[OBS_VEHICLES])}
    got = lambda cars, row: [round(cars[row, f[n]].item(), 3) for n in PATH_FEATURES]  # noqa: E731

    def observe(gone: torch.Tensor) -> torch.Tensor:
        forecast = lambda t: (bend.view(1, 1, -1, 2), torch.zeros(1, 1, len(t)), gone.view(1, 1, -1))  # noqa: E731
        return env.observer.observe(env.state, env.light_lookup(env.state), None, forecast)[OBS_VEHICLES][0]

    none = torch.zeros(len(taus), dtype=torch.bool)
    cars = observe(none)
    assert got(cars, 0) == [0.0, 10.0, 0.0] and got(cars, 2) == [28.0, 3.0, 1.0]
    assert got(observe(taus >= 2.5), 2) == [0.0, 10.0, 0.0]
    v.yaw[0, 2] = -math.pi / 2
    assert got(observe(taus >= 0.0), 2) == [20.0, 2.0, 1.0]
    v.yaw[0, 2] = 0.0
    # the env's own observation has no scenarios to forecast here: the straight line
    assert got(env.observe()[OBS_VEHICLES][0], 2) == [0.0, 10.0, 0.0]
    with pytest.raises(ConfigError, match=r"env\.options\.vector\.scripted_paths=true needs .*path_conflicts=true"):
        _cfg(scripted_paths=True)


def test_episodes_of_a_vector_policy_are_recorded_with_the_bev_of_the_state() -> None:
    """carl-eval's videos: an env observing vectors (and asked for pictures, bev=True) records the BEV drawn from its
    state, the frames a BEV env of the same seed records for the same actions."""
    from envs import make_env
    from envs.sim.recorder import record_episode

    opts = dict(town_seeds=(0,), num_routes=8, route_length=(80.0, 120.0), bev_size=32, bev_ego_from_bottom=12)
    drive = lambda obs: torch.tensor([[0.0, 0.4]])  # noqa: E731
    frames = {}
    for observation in ("vector", "bev"):
        env = make_env("sim", 1, "cpu", 3, observation=observation, bev=True, **opts)
        frames[observation], _ = record_episode(env, drive, max_steps=5, scale=1)
    assert len(frames["vector"]) == 5
    assert all(np.array_equal(a, b) for a, b in zip(frames["vector"], frames["bev"]))


def test_compiled_stages_observe_what_the_uncompiled_stages_do(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """``vector.compile``: the same observation (to float rounding: inductor reorders sums) and the same rewards over 30
    steps with traffic, route scenarios and their light overrides (torch's compiled code cached in ``tmp_path``)."""
    from envs import make_env as build

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))

    opts = dict(bev=False, observation="vector", traffic=True, num_routes=16, scenario_density=7.4, town_seeds=(0,))
    envs = [build("sim", 8, "cpu", 0, vector={"compile": c}, **opts) for c in (False, True)]
    obs = [e.reset() for e in envs]
    actions = torch.rand(30, 8, 2, generator=torch.Generator().manual_seed(0)) * torch.tensor([0.2, 1.2]) - torch.tensor(
        [0.1, 0.2])
    for t in range(31):
        for key in obs[0]:
            torch.testing.assert_close(obs[1][key], obs[0][key], atol=1e-4, rtol=1e-5, msg=f"step {t}, {key}")
        if t < 30:
            results = [e.step(actions[t]) for e in envs]
            assert torch.equal(results[0].reward, results[1].reward)
            obs = [r.obs for r in results]


def test_a_platform_that_cannot_compile_names_the_option(tmp_path) -> None:  # noqa: ANN001
    """No working C++ compiler: a ConfigError naming env.options.vector.compile and the fix, at the first observation
    (a subprocess: the compiler setting is process-wide; its own inductor cache, so nothing is left behind)."""
    import os
    import subprocess
    import sys
    import textwrap

    probe = textwrap.dedent("""
        import torch._inductor.config as ic
        ic.cpp.cxx = ("/nonexistent/c++",)
        from envs import make_env
        from envs.config import ConfigError
        env = make_env("sim", 2, "cpu", 0, bev=False, observation="vector", traffic=False, num_routes=2,
                       town_seeds=(0,), vector={"compile": True})
        try:
            env.reset()
        except ConfigError as e:
            print("ConfigError:", e)
    """)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert re.search(r"ConfigError: env\.options\.vector\.compile=true: torch\.compile cannot compile .*"
                     r"set env\.options\.vector\.compile=false", out.stdout), out.stdout + out.stderr[-2000:]

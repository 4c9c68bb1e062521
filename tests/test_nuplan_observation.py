"""CaRL's nuPlan observation (``carl-reference.md`` §17), computed by hand: the colour scale, the area (78 m ahead,
50 m behind, 64 m to each side of the ego centre at 2 px/m), the channel order, UNKNOWN lights, the 10 + 4
measurements; and the observation part in the core (the CARLA layout stays the default)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from envs import make_env
from envs.api import (ACTIONS, BEV_CHANNELS, LAYOUT_CARLA, LAYOUT_NUPLAN, NUPLAN_ACTION_SCALING, NUPLAN_ACTIONS,
                      NUPLAN_BEV_CHANNELS, NUPLAN_MEASUREMENTS, NUPLAN_VALUE_MEASUREMENTS, action_permutation,
                      layout_of)
from envs.nuplan import dynamics
from envs.nuplan.observation import (BOUNDARIES, DRIVABLE, EGO, LIGHTS, PEDESTRIANS, ROUTE, SPEED_LIMIT, STOP_LINES,
                                     VEHICLES, NuplanObserver, nuplan_measurements,
                                     nuplan_value_measurements, value)
from envs.sim.observation import CarlaObserver

# CaRL's geometry: 256 x 256 at 2 px/m, the ego centre 100 px above the bottom edge (row 155, column 128)
CARL = dict(town_seeds=(0,), num_routes=16, route_length=(150.0, 250.0), bev_size=256, bev_ppm=2.0,
            bev_ego_from_bottom=100, num_vehicles=2, num_pedestrians=2, num_statics=2)
EGO_ROW, EGO_COL = 155, 128


@pytest.fixture(scope="module")
def sim():
    """A built-in simulator env (its world and actors) with the nuPlan observer bound to it."""
    env = make_env("sim", 1, "cpu", 0, **CARL)
    env.reset()
    obs = NuplanObserver()
    obs.bind(env.setup)
    return env, obs


def clear(env) -> None:
    for group in (env.state.veh, env.state.ped, env.state.statics):
        group.valid[:] = False


def put(env, group, forward: float, left: float = 0.0, half=(1.25, 1.25), speed: float = 0.0) -> None:
    """Slot 0 of ``group`` at ``forward``/``left`` metres from the ego centre, aligned with the ego."""
    s = env.state
    c, si = math.cos(float(s.ego_yaw[0])), math.sin(float(s.ego_yaw[0]))
    group.xy[:, 0] = s.ego_xy[0] + torch.tensor([c * forward - si * left, si * forward + c * left])
    group.yaw[:, 0] = s.ego_yaw
    group.valid[:, 0] = True
    if hasattr(group, "half"):
        group.half[:, 0] = torch.tensor(half)
    if hasattr(group, "speed"):
        group.speed[:, 0] = speed


def rows_drawn(canvas: torch.Tensor, col: int = EGO_COL) -> list[int]:
    return torch.nonzero(canvas[:, col]).flatten().tolist()


def test_colour_scale_by_hand():
    v = torch.tensor([-3.0, 0.0, 1.0, 15.0, 29.9, 30.0, 45.0])
    # int(127.5 + 127.5 * clip(v / 30, 0, 1)): 127.5 + 4.25 = 131.75 -> 131; + 63.75 -> 191; 29.9 / 30 -> 254.575
    assert value(v, 30.0).tolist() == [127, 127, 131, 191, 254, 255, 255]
    assert value(torch.tensor([0.0, 1.0, 2.0, 4.0, 9.0]), 4.0).tolist() == [127, 159, 191, 255, 255]
    assert value(torch.tensor([0.0]), 30.0).dtype == torch.uint8


def test_area_78_ahead_50_behind_64_to_each_side(sim):
    env, obs = sim
    clear(env)
    v = env.state.veh
    # 70 m ahead, 1.25 m half extent: rows 155 - 2 * 70 = 15 +- 2 px (2.5 px reach)
    put(env, v, 70.0)
    bev = obs.render(env.state, env.light_lookup(env.state))[0, VEHICLES]
    assert rows_drawn(bev) == [13, 14, 15, 16, 17]
    assert torch.nonzero(bev[15]).flatten().tolist() == [126, 127, 128, 129, 130]
    # 77 m ahead: the centre is on row 1, the box is cut at the top edge
    put(env, v, 77.0)
    assert rows_drawn(obs.render(env.state, env.light_lookup(env.state))[0, VEHICLES]) == [0, 1, 2, 3]
    # centre 78.5 m ahead (row -2: outside the area); its back would reach rows 0..2, but CaRL draws an object only
    # when its centre is in the area
    put(env, v, 78.5, half=(2.0, 1.0))
    assert int(obs.render(env.state, env.light_lookup(env.state))[0, VEHICLES].sum()) == 0
    # 49 m behind: row 155 + 98 = 253; 51 m behind (row 257): gone
    put(env, v, -49.0)
    assert rows_drawn(obs.render(env.state, env.light_lookup(env.state))[0, VEHICLES]) == [251, 252, 253, 254, 255]
    put(env, v, -51.0)
    assert int(obs.render(env.state, env.light_lookup(env.state))[0, VEHICLES].sum()) == 0
    # 60 m to the left: column 128 - 120 = 8; 65 m to the right: column 258 (outside)
    put(env, v, 0.0, left=60.0)
    bev = obs.render(env.state, env.light_lookup(env.state))[0, VEHICLES]
    assert torch.nonzero(bev[EGO_ROW]).flatten().tolist() == [6, 7, 8, 9, 10]
    put(env, v, 0.0, left=-65.0)
    assert int(obs.render(env.state, env.light_lookup(env.state))[0, VEHICLES].sum()) == 0


def test_channel_order_and_values(sim):
    env, obs = sim
    clear(env)
    s = env.state
    put(env, s.veh, 20.0, half=(2.0, 1.0), speed=15.0)
    put(env, s.ped, 10.0, left=-8.0, speed=2.0)  # pedestrians: value(speed, 4)
    put(env, s.statics, -10.0, left=8.0)  # static objects: 127
    bev = obs.render(s, env.light_lookup(s))[0]
    assert obs.spec()["bev"].names == NUPLAN_BEV_CHANNELS and bev.shape == (9, 256, 256)
    assert int(bev[VEHICLES, EGO_ROW - 40, EGO_COL]) == 191  # value(15, 30)
    assert int(bev[PEDESTRIANS, EGO_ROW - 20, EGO_COL + 16]) == 191  # value(2, 4)
    assert int(bev[PEDESTRIANS, EGO_ROW + 20, EGO_COL - 16]) == 127
    assert int(bev[VEHICLES, EGO_ROW + 20, EGO_COL - 16]) == 0 and int(bev[PEDESTRIANS, EGO_ROW - 40, EGO_COL]) == 0
    assert int(bev[EGO, EGO_ROW, EGO_COL]) == int(value(s.ego_speed, 30.0)[0]) == 127  # standing ego
    assert int((bev[EGO] > 0).sum()) > 0 and int(bev[EGO, 0:100].sum()) == 0
    # the ego stands on its route, on the road, on its lane's baseline (coloured by the lane's speed limit)
    assert int(bev[DRIVABLE, EGO_ROW, EGO_COL]) == 255 and int(bev[ROUTE, EGO_ROW, EGO_COL]) == 255
    limit = env.world.lane_speed[env.world.route_lane[s.route_id[0], s.route_idx[0]]]
    assert int(bev[SPEED_LIMIT, EGO_ROW, EGO_COL]) == int(value(limit, 30.0))
    assert set(bev[BOUNDARIES].unique().tolist()) == {0, 255} and int((bev[BOUNDARIES] > 0).sum()) > 100
    assert int(bev[STOP_LINES].sum()) == 0  # CaRL's map cache has no stop lines
    # the route lies on the road
    assert bool(((bev[ROUTE] > 0) <= (bev[DRIVABLE] > 0)).all())


def _a_route_with_lights(env, obs) -> int:
    """A route id whose view holds light segments (the procedural town has signalled junctions)."""
    group = obs.tables()["light_group"]
    counts = (group >= 0).sum(-1)
    assert int(counts.max()) > 0, "no signalled junction near any route"
    return int(counts.argmax())


def test_unknown_lights_are_not_drawn(sim):
    env, obs = sim
    clear(env)
    s = env.state
    route = _a_route_with_lights(env, obs)
    segments = obs.tables()["light_p0"][route]
    near = segments[obs.tables()["light_group"][route] >= 0][0]
    saved = (s.route_id.clone(), s.ego_xy.clone())
    try:
        s.route_id[:] = route
        s.ego_xy[:] = near  # stand at the first signalled connector
        s.light_known = None
        drawn = obs.render(s, env.light_lookup(s))[0, LIGHTS]
        assert int((drawn > 0).sum()) > 0
        assert set(drawn.unique().tolist()) <= {0, 80, 170, 255}
        G = env.world.group_junction.shape[0]
        s.light_known = torch.zeros(1, G, dtype=torch.bool)  # every status UNKNOWN
        assert int(obs.render(s, env.light_lookup(s))[0, LIGHTS].sum()) == 0
        groups = obs.tables()["light_group"][route]
        one = int(groups[groups >= 0][0])
        s.light_known[0, one] = True  # only this group is known: fewer pixels, still some
        some = obs.render(s, env.light_lookup(s))[0, LIGHTS]
        assert 0 < int((some > 0).sum()) <= int((drawn > 0).sum())
    finally:
        s.route_id[:], s.ego_xy[:] = saved
        del s.light_known


def test_light_colours_follow_the_light_source(sim):
    env, obs = sim
    clear(env)
    s = env.state
    route = _a_route_with_lights(env, obs)
    saved = (s.route_id.clone(), s.ego_xy.clone())
    try:
        s.route_id[:] = route
        s.ego_xy[:] = obs.tables()["light_p0"][route][obs.tables()["light_group"][route] >= 0][0]
        for state, colour in ((0, 80), (1, 170), (2, 255)):
            env.lights.state = lambda st, g, k=state: (torch.full_like(g, k), torch.zeros(g.shape))
            assert set(obs.render(s, env.light_lookup(s))[0, LIGHTS].unique().tolist()) == {0, colour}
    finally:
        s.route_id[:], s.ego_xy[:] = saved
        del env.lights.state  # the instance attribute: the class's method again


def fake_state(**kw) -> SimpleNamespace:
    s = dict(raw_action=torch.tensor([[0.5, -0.25]]), ego_vel_local=torch.tensor([[8.0, 0.3]]),
             ego_acc_local=torch.tensor([[1.5, -0.4]]), ego_steer=torch.tensor([0.05]),
             ego_steer_rate=torch.tensor([0.2]), ego_yaw_rate=torch.tensor([0.13]), ego_yaw_acc=torch.tensor([-0.7]),
             steps=torch.tensor([30]), horizon=torch.tensor([120]), progress=torch.tensor([0.4]),
             comfort_score=torch.tensor([0.5]), ttc_score=torch.tensor([0.0]))
    s.update(kw)
    return SimpleNamespace(**s)


def test_measurements_and_value_measurements_from_a_state():
    s = fake_state()
    m = nuplan_measurements(s)
    assert m.shape == (1, len(NUPLAN_MEASUREMENTS)) == (1, 10) and m.dtype == torch.float32
    assert m[0].tolist() == pytest.approx([0.5, -0.25, 8.0, 0.3, 1.5, -0.4, 0.05, 0.2, 0.13, -0.7])
    # an env that takes (steer, accel): the measurements still start with the acceleration
    assert nuplan_measurements(s, ("steer", "accel"))[0, :2].tolist() == [-0.25, 0.5]
    v = nuplan_value_measurements(s)
    assert v.shape == (1, len(NUPLAN_VALUE_MEASUREMENTS)) == (1, 4)
    assert v[0].tolist() == pytest.approx([1.0 - 30 / 120, 0.6, 0.5, 0.0])
    # at reset: all four are 1.0
    fresh = fake_state(steps=torch.tensor([0]), progress=torch.tensor([0.0]), comfort_score=torch.tensor([1.0]),
                       ttc_score=torch.tensor([1.0]))
    assert nuplan_value_measurements(fresh)[0].tolist() == [1.0, 1.0, 1.0, 1.0]


def test_centre_kinematics_of_the_bicycle_model():
    k = {key: (tuple(float(x) for x in v) if isinstance(v, tuple) else float(v))
         for key, v in dynamics.centre_kinematics(10.0, 1.0, 0.1, 0.05, 0.2, 0.1).items()}
    yaw_rate = 10.0 * math.tan(0.1) / dynamics.WHEELBASE
    assert k["yaw_rate"] == pytest.approx(yaw_rate, rel=1e-6) and k["steer_rate"] == pytest.approx(0.5, rel=1e-6)
    yaw_acc = (yaw_rate - 0.2) / 0.1
    assert k["yaw_acc"] == pytest.approx(yaw_acc, rel=1e-5)
    assert k["vel"][0] == 10.0 and k["vel"][1] == pytest.approx(yaw_rate * 1.461, rel=1e-6)
    # the devkit's centre acceleration: a + d (ω² + α) forward, the rear axle's 0 sideways
    assert k["acc"][0] == pytest.approx(1.0 + 1.461 * (yaw_rate ** 2 + yaw_acc), rel=1e-5) and k["acc"][1] == 0.0


def test_observer_part_in_the_core_and_the_default_layout():
    env = make_env("sim", 2, "cpu", 0, **{**CARL, "bev_size": 64, "bev_ppm": 0.5, "bev_ego_from_bottom": 25})
    assert isinstance(env.observer, CarlaObserver) and env.observer.layout == LAYOUT_CARLA
    spec = env.observation_spec
    assert spec["bev"].names == BEV_CHANNELS and spec["bev"].shape == (10, 64, 64)
    assert len(spec["measurements"].names) == spec["measurements"].shape[0] == 8
    assert len(spec["value_measurements"].names) == spec["value_measurements"].shape[0] == 10
    assert env.action_spec.names == ACTIONS
    from envs.sim.env import SimEnv

    nuplan = SimEnv(env.cfg, 2, world=env.world, observer=NuplanObserver())
    assert nuplan.observation_spec["bev"].shape == (9, 64, 64)
    assert nuplan.observation_spec["measurements"].shape == (10,)
    assert nuplan.observation_spec["value_measurements"].shape == (4,)
    assert layout_of(nuplan.observation_spec["bev"].names) == LAYOUT_NUPLAN


def test_layout_and_action_names():
    assert layout_of(()) == LAYOUT_CARLA and layout_of(BEV_CHANNELS) == LAYOUT_CARLA
    assert layout_of(NUPLAN_BEV_CHANNELS) == LAYOUT_NUPLAN and layout_of(("a", "b")) == "custom"
    # a CARLA-order policy on a nuPlan-order env and back: accel is the longitudinal component
    assert action_permutation(ACTIONS, NUPLAN_ACTIONS) == [1, 0]
    assert action_permutation(NUPLAN_ACTIONS, ("steer", "accel")) == [1, 0]
    assert action_permutation(NUPLAN_ACTIONS, NUPLAN_ACTIONS) == [0, 1]
    with pytest.raises(ValueError, match="cannot be mapped"):
        action_permutation(("steer", "brake"), ACTIONS)
    # the scaling a bundle records (and the dynamics apply) is CaRL's (carl-reference.md §16.2): full throttle 2.4 m/s²,
    # full brake 3.2 m/s², full steer a 48° tire angle
    assert NUPLAN_ACTION_SCALING["accel"] == {"positive_mps2": 2.4, "negative_mps2": 3.2}
    assert NUPLAN_ACTION_SCALING["steer"]["max_tire_angle_rad"] == pytest.approx(math.radians(48.0), abs=1e-8)
    rear, yaw, speed, accel, steer = dynamics.bicycle_step(torch.zeros(1, 2), torch.zeros(1), torch.full((1,), 5.0),
                                                           torch.zeros(1), torch.zeros(1),
                                                           torch.tensor([[1.0, 1.0]]), 0.1, NUPLAN_ACTIONS)
    assert float(accel[0]) == pytest.approx(2.4 * 0.1 / (0.1 + 0.2))  # one 0.1 s step of the 0.2 s lag to 2.4 m/s²


@pytest.mark.nuplan
def test_logged_unknown_lights_on_the_synthetic_dataset(tmp_path):
    """On nuPlan's env the known groups come from the log (status 3 = UNKNOWN): a red log draws 255, UNKNOWN
    nothing."""
    from envs.nuplan.env import make_nuplan_env
    from envs.nuplan.synthetic import make_synthetic_dataset

    root = make_synthetic_dataset(tmp_path / "data", num_logs=1)
    env = make_nuplan_env(1, "cpu", 0, cache_dir=str(tmp_path / "cache"), data_root=str(root), route_split="eval",
                          sim={"bev_size": 256, "bev_ego_from_bottom": 100})
    env.reset(seed=0)
    obs = NuplanObserver(env.data)
    obs.bind(env.setup)
    s = env.state
    s.light_known = None
    lights = env.data.log_lights.clone()
    try:
        env.data.log_lights[:] = 2  # every group red
        s.light_offset = env.data.light_offsets(s.scenario, s.steps, s.t, s.light_offset)
        red = obs.render(s, env.light_lookup(s))[0, LIGHTS]
        assert int((red == 255).sum()) > 0 and set(red.unique().tolist()) == {0, 255}
        env.data.log_lights[:] = 3  # every group UNKNOWN
        s.light_offset = env.data.light_offsets(s.scenario, s.steps, s.t, s.light_offset)
        assert obs.light_known(s).any().item() is False
        assert int(obs.render(s, env.light_lookup(s))[0, LIGHTS].sum()) == 0
    finally:
        env.data.log_lights[:] = lights
        del s.light_known

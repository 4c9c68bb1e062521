"""CaRL's observation details, computed by hand from ``carl-reference.md`` §2: light encodings, box sizes, speed lines,
the yellow ramp and the measurement vector."""
from __future__ import annotations

import math

import pytest
import torch

from envs import make_env
from envs.maps.rasterize import speed_encoding
from envs.sim.agents import LIGHT_BRAKE
from envs.sim.env import SimEnv
from envs.sim.observation import bev_config, yellow_value
from envs.sim.bev_draw import world_to_bev

SMALL = dict(town_seeds=(0,), num_routes=16, route_length=(150.0, 250.0), bev_size=128, bev_ppm=2.0,
             bev_ego_from_bottom=50, num_vehicles=2, num_pedestrians=2, num_statics=2)


def frozen(**kw) -> SimEnv:
    env = make_env("sim", 1, "cpu", 0, **{**SMALL, **kw})
    env.reset()
    for group in (env.state.veh, env.state.ped, env.state.statics):
        group.valid[:] = False
    return env


def pixel(env: SimEnv, forward: float, left: float = 0.0) -> tuple[int, int]:
    """(row, col) of the point ``forward``/``left`` metres from the ego."""
    s = env.state
    c, si = math.cos(float(s.ego_yaw[0])), math.sin(float(s.ego_yaw[0]))
    xy = s.ego_xy[0] + torch.tensor([c * forward - si * left, si * forward + c * left])
    col, row = world_to_bev(xy.view(1, 1, 2), s.ego_xy, s.ego_yaw, bev_config(env.cfg))[0, 0]
    return int(round(float(row))), int(round(float(col)))


def put(env: SimEnv, group, forward: float, half=(2.3, 1.0), speed: float = 0.0) -> None:
    s = env.state
    fwd = torch.stack((torch.cos(s.ego_yaw), torch.sin(s.ego_yaw)), -1)
    group.xy[:, 0] = s.ego_xy + fwd * forward
    group.yaw[:, 0] = s.ego_yaw
    group.valid[:, 0] = True
    if hasattr(group, "half"):
        group.half[:, 0] = torch.tensor(half)
    if hasattr(group, "speed"):
        group.speed[:, 0] = speed


def test_yellow_ramp_170_to_255_over_the_last_3_s():
    left = torch.tensor([5.0, 3.0, 1.5, 0.0])
    # int((1 - min(left / 3, 1) * (1 - 0.67)) * 255)
    assert yellow_value(left).tolist() == [170, 170, 212, 255]


def test_brake_light_box_over_the_vehicle_and_speed_value_elsewhere():
    env = frozen()
    put(env, env.state.veh, 12.0)
    env.state.veh.lights[:, 0] = LIGHT_BRAKE
    bev = env.observe(env.state)["bev"][0, 3]
    r, c = pixel(env, 12.0 - 1.5)  # brake box: 1.5 m behind the vehicle centre, 0.5 m half extent
    assert int(bev[r, c]) == 111
    r, c = pixel(env, 12.0 + 1.0)
    assert int(bev[r, c]) == 127 + math.floor(128 * (0.0 + 2.67) / 36.0)  # standing vehicle: 136
    env.state.veh.lights[:, 0] = 0
    bev = env.observe(env.state)["bev"][0, 3]
    r, c = pixel(env, 12.0 - 1.5)
    assert int(bev[r, c]) == 136


def test_simulator_vehicles_light_brakes_when_decelerating():
    env = make_env("sim", 16, "cpu", 0, **{**SMALL, "bev": False, "num_vehicles": 12})
    env.reset()
    env.actors.refresh = lambda s: None  # no respawns: every speed change below is IDM's
    checked = 0
    for _ in range(80):
        before = env.state.veh.speed.clone()
        valid = env.state.veh.valid.clone()
        r = env.step(torch.zeros(16, 2))
        v = env.state.veh
        decel = (before - v.speed) / env.cfg.dt  # IDM braking harder than 0.5 m/s^2, or standing: brake light
        same = valid & v.valid & (v.speed > 0.5) & ~r.info["done"].unsqueeze(1)
        braking = same & (decel > 0.6)
        cruising = same & (decel < 0.4)
        assert ((v.lights[braking] & LIGHT_BRAKE) != 0).all()
        assert ((v.lights[cruising] & LIGHT_BRAKE) == 0).all()
        checked += int(braking.sum())
    assert checked > 0


def test_boxes_have_at_least_0_8_m_half_extent():
    env = frozen()
    put(env, env.state.statics, 10.0, half=(0.2, 0.2))  # a bollard: drawn 1.6 m x 1.6 m (3.2 px at 2 px/m)
    bev = env.observe(env.state)["bev"][0, 8]
    assert 9 <= int((bev == 255).sum()) <= 16
    r, c = pixel(env, 10.0, 0.7)
    assert int(bev[r, c]) == 255


def test_pedestrian_speed_line():
    env = frozen()
    put(env, env.state.ped, 10.0)
    env.state.ped.moving[:] = True
    env.state.ped.speed[:, 0] = 2.0  # line from the box front (0.8 m) forward by 2.0 m x 1 s
    bev = env.observe(env.state)["bev"][0, 4]
    value = int(speed_encoding(torch.tensor(2.0)))
    r, c = pixel(env, 10.0 + 0.8 + 1.5)
    assert int(bev[r, c]) == value
    r, c = pixel(env, 10.0 + 0.8 + 3.5)
    assert int(bev[r, c]) == 0


def test_measurements_gear_and_ego_frame_velocity():
    env = make_env("sim", 1, "cpu", 0, **{**SMALL, "bev": False, "traffic": False})
    env.reset()
    m = env.observe(env.state)["measurements"][0]
    assert m[3] == 1.0 and m[4] == 0.0 and m[5] == 0.0  # standing: first gear, no velocity
    for _ in range(20):
        r = env.step(torch.tensor([[0.1, 1.0]]))  # full throttle, steering a little left
    assert not r.info["done"][0]
    m = r.obs["measurements"][0]
    speed = float(env.state.ego_speed[0])
    beta = math.atan(0.5 * math.tan(0.1 * env.cfg.max_steer))  # side slip of the kinematic bicycle at the CoG
    assert float(m[4]) == pytest.approx(speed * math.cos(beta), rel=1e-4)
    assert float(m[5]) == pytest.approx(speed * math.sin(beta), rel=1e-4)  # positive: to the left, like steer
    assert float(m[6]) == float(m[4])  # forward speed = velocity . forward vector
    gears = 1 + sum(speed > v for v in (6.0, 11.0, 16.0, 22.0))
    assert float(m[3]) == gears and gears >= 2

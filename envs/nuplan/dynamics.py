"""nuPlan's ego model: the kinematic bicycle of nuPlan's closed-loop simulation (rear axle, lagged acceleration and
steering) for the Chrysler Pacifica, driven by CaRL's nuPlan action mapping (``carl-reference.md`` §16).

:func:`bicycle_step` is the model; :class:`NuplanBicycle` is the env's ego-dynamics part built on it; the devkit
planner adapter (``carl.deploy.nuplan_planner``) rolls its trajectories out with the same function."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from envs.nuplan.cache import REAR_AXLE_TO_CENTRE
from envs.sim.geometry import wrap_angle
from envs.sim.parts import EgoDynamics

if TYPE_CHECKING:
    from envs.nuplan.env import NuplanState

WHEELBASE = 3.089
EGO_HALF = (2.588, 1.1485)  # (4.049 + 1.127) / 2, 2.297 / 2
MAX_ACCEL, MAX_DECEL = 2.4, 3.2
MAX_STEER = 0.83775804  # rad (48°): target tire angle at |action| = 1
STEER_LIMIT = math.pi / 3
ACCEL_LAG, STEER_LAG = 0.2, 0.05  # s


def bicycle_step(rear: Tensor, yaw: Tensor, speed: Tensor, accel: Tensor, steer: Tensor, action: Tensor, dt: float
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One step of nuPlan's kinematic bicycle model (rear axle, forward Euler, 0.2 s acceleration and 0.05 s steering
    lags) driven by CaRL's action mapping ``action`` [B, 2] = (steer, longitudinal) in [-1, 1]; a reverse guard
    stops instead of driving backwards. Returns (rear [B, 2], yaw, speed, accel, steer)."""
    steer_cmd, acc_cmd = action[:, 0], action[:, 1]
    a_target = torch.where(acc_cmd >= 0, acc_cmd * MAX_ACCEL, acc_cmd * MAX_DECEL)
    a_target = torch.where(speed + a_target * dt < 0, -speed - 0.75 * accel, a_target).clamp(-MAX_DECEL, MAX_ACCEL)
    steer_rate = (steer_cmd * MAX_STEER - steer) / dt
    fwd = torch.stack((torch.cos(yaw), torch.sin(yaw)), -1)
    rear = rear + fwd * (speed * dt).unsqueeze(-1)
    new_yaw = wrap_angle(yaw + speed * torch.tan(steer) / WHEELBASE * dt)
    new_accel = accel + dt / (dt + ACCEL_LAG) * (a_target - accel)
    ideal = steer + dt * steer_rate
    new_steer = (steer + dt / (dt + STEER_LAG) * (ideal - steer)).clamp(-STEER_LIMIT, STEER_LIMIT)
    new_speed = (speed + new_accel * dt).clamp(min=0.0)
    return rear, new_yaw, new_speed, new_accel, new_steer


class NuplanBicycle(EgoDynamics):
    """:func:`bicycle_step` on the simulator's centre-referenced ego; the model's own state is ``NuplanState``'s
    ``ego_accel`` (set to the logged acceleration when the ego is placed) and ``ego_steer`` (tire angle)."""

    def reset(self, s: NuplanState, rows: Tensor) -> None:
        s.ego_steer = torch.zeros_like(s.ego_speed)  # the log has no tire angle

    def step(self, s: NuplanState, action: Tensor) -> None:
        fwd = torch.stack((torch.cos(s.ego_yaw), torch.sin(s.ego_yaw)), -1)
        rear, yaw, speed, accel, steer = bicycle_step(s.ego_xy - REAR_AXLE_TO_CENTRE * fwd, s.ego_yaw, s.ego_speed,
                                                      s.ego_accel, s.ego_steer, action, self.env.cfg.dt)
        s.ego_steer, s.ego_speed, s.ego_accel, s.ego_yaw = steer, speed, accel, yaw
        s.ego_vel_local = torch.stack((speed, torch.zeros_like(speed)), -1)  # the rear axle moves along the heading
        s.ego_xy = rear + REAR_AXLE_TO_CENTRE * torch.stack((torch.cos(yaw), torch.sin(yaw)), -1)
        steer_cmd, acc_cmd = action[:, 0], action[:, 1]
        s.last_action = torch.stack((steer_cmd, acc_cmd.clamp(min=0.0), (-acc_cmd).clamp(min=0.0)), -1)

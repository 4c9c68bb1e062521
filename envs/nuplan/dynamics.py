"""nuPlan's ego model: the kinematic bicycle of nuPlan's closed-loop simulation (rear axle, lagged acceleration and
steering) for the Chrysler Pacifica, driven by CaRL's nuPlan action mapping (``carl-reference.md`` §16).

:func:`bicycle_step` is the model; :class:`NuplanBicycle` is the env's ego-dynamics part built on it; the devkit
planner adapter (``carl.deploy.nuplan_planner``) rolls its trajectories out with the same function."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from envs.api import NUPLAN_ACTION_SCALING
from envs.comfort import rear_axle_to_center_acceleration
from envs.nuplan.cache import REAR_AXLE_TO_CENTRE
from envs.sim.geometry import wrap_angle
from envs.sim.parts import EgoDynamics

if TYPE_CHECKING:
    from envs.nuplan.logs import NuplanState, ScenarioLogs

WHEELBASE = 3.089
EGO_HALF = (2.588, 1.1485)  # (4.049 + 1.127) / 2, 2.297 / 2
# CaRL's action scaling (envs.api.NUPLAN_ACTION_SCALING, which bundles record): m/s² at |a| = 1 and the target tire
# angle (rad, 48°) at |steer| = 1
MAX_ACCEL = NUPLAN_ACTION_SCALING["accel"]["positive_mps2"]
MAX_DECEL = NUPLAN_ACTION_SCALING["accel"]["negative_mps2"]
MAX_STEER = NUPLAN_ACTION_SCALING["steer"]["max_tire_angle_rad"]
STEER_LIMIT = math.pi / 3
ACCEL_LAG, STEER_LAG = 0.2, 0.05  # s


def bicycle_step(rear: Tensor, yaw: Tensor, speed: Tensor, accel: Tensor, steer: Tensor, action: Tensor, dt: float,
                 order: tuple[str, ...] = ("steer", "accel")) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One step of nuPlan's kinematic bicycle model (rear axle, forward Euler, 0.2 s acceleration and 0.05 s steering
    lags) driven by CaRL's action mapping ``action`` [B, 2] in [-1, 1] (its columns named by ``order``); a reverse
    guard stops instead of driving backwards. ``rear`` may be float64 (its dtype is kept). Returns (rear [B, 2], yaw,
    speed, accel, steer)."""
    steer_cmd, acc_cmd = action[:, order.index("steer")], action[:, order.index("accel")]
    a_target = torch.where(acc_cmd >= 0, acc_cmd * MAX_ACCEL, acc_cmd * MAX_DECEL)
    a_target = torch.where(speed + a_target * dt < 0, -speed - 0.75 * accel, a_target).clamp(-MAX_DECEL, MAX_ACCEL)
    steer_rate = (steer_cmd * MAX_STEER - steer) / dt
    fwd = torch.stack((torch.cos(yaw), torch.sin(yaw)), -1)
    rear = rear + (fwd * (speed * dt).unsqueeze(-1)).to(rear.dtype)
    new_yaw = wrap_angle(yaw + speed * torch.tan(steer) / WHEELBASE * dt)
    new_accel = accel + dt / (dt + ACCEL_LAG) * (a_target - accel)
    ideal = steer + dt * steer_rate
    new_steer = (steer + dt / (dt + STEER_LAG) * (ideal - steer)).clamp(-STEER_LIMIT, STEER_LIMIT)
    new_speed = (speed + new_accel * dt).clamp(min=0.0)
    return rear, new_yaw, new_speed, new_accel, new_steer


def centre_kinematics(speed: Tensor | float, accel: Tensor | float, steer: Tensor | float,
                      prev_steer: Tensor | float, prev_yaw_rate: Tensor | float, dt: float) -> dict:
    """The ego at its centre from the model's rear-axle state, as nuPlan's ``EgoState`` reports it: ``vel`` and
    ``acc`` (forward, left; body frame; the devkit's centre transfer, :func:`envs.comfort.rear_axle_to_center_
    acceleration`), ``steer_rate``, ``yaw_rate`` (``v tan(δ) / L``) and ``yaw_acc`` (finite differences against the
    previous step's steering angle and yaw rate). Floats or tensors (tensors out)."""
    t = lambda v: torch.as_tensor(v, dtype=torch.float32) if not isinstance(v, Tensor) else v  # noqa: E731
    speed, accel, steer, prev_steer, prev_yaw_rate = map(t, (speed, accel, steer, prev_steer, prev_yaw_rate))
    yaw_rate = speed * torch.tan(steer) / WHEELBASE
    yaw_acc = (yaw_rate - prev_yaw_rate) / dt
    centre = rear_axle_to_center_acceleration(accel, yaw_rate, yaw_acc, REAR_AXLE_TO_CENTRE)
    return {"vel": (speed, yaw_rate * REAR_AXLE_TO_CENTRE), "acc": (centre.lon, centre.lat),
            "steer_rate": (steer - prev_steer) / dt, "yaw_rate": yaw_rate, "yaw_acc": yaw_acc}


class NuplanBicycle(EgoDynamics):
    """:func:`bicycle_step` on the scenario-frame rear axle (``NuplanState.ego_rear``, float64, so a scenario drives
    the same wherever its map sits in the batch's world); the simulator's centre pose is derived from it. The model's
    own state is ``ego_accel`` (the logged acceleration at the start) and ``ego_steer`` (tire angle, 0 at the start:
    the log has none); the yaw rate is the model's ``v tan(δ) / L`` and the yaw acceleration its finite
    difference, as nuPlan's model reports them."""

    def __init__(self, logs: ScenarioLogs):
        self.shifts, self.action_names = logs.shifts, logs.action_names

    def reset(self, s: NuplanState, rows: Tensor) -> None:
        z = torch.zeros_like(s.ego_speed)
        s.ego_steer, s.ego_steer_rate, s.ego_yaw_rate, s.ego_yaw_acc = z, z.clone(), z.clone(), z.clone()
        s.raw_action = torch.zeros(len(z), 2, device=z.device)
        s.ego_acc_local = torch.stack((s.ego_accel, z), -1)

    def step(self, s: NuplanState, action: Tensor) -> None:
        dt, names = self.setup.cfg.dt, self.action_names
        rear, yaw, speed, accel, steer = bicycle_step(s.ego_rear, s.ego_yaw, s.ego_speed, s.ego_accel, s.ego_steer,
                                                      action, dt, names)
        kin = centre_kinematics(speed, accel, steer, s.ego_steer, s.ego_yaw_rate, dt)
        s.ego_yaw_rate, s.ego_yaw_acc, s.ego_steer_rate = kin["yaw_rate"], kin["yaw_acc"], kin["steer_rate"]
        s.ego_rear, s.ego_steer, s.ego_speed, s.ego_accel, s.ego_yaw = rear, steer, speed, accel, yaw
        s.ego_acc_local = torch.stack(kin["acc"], -1)
        s.ego_vel_local = torch.stack(kin["vel"], -1)  # the centre moves with the yaw rate's lateral part too
        d = REAR_AXLE_TO_CENTRE
        fwd = torch.stack((torch.cos(yaw), torch.sin(yaw)), -1)
        s.ego_xy = (rear + self.shifts[s.scenario]).float() + d * fwd
        s.raw_action = action.clone()
        steer_cmd, acc_cmd = action[:, names.index("steer")], action[:, names.index("accel")]
        s.last_action = torch.stack((steer_cmd, acc_cmd.clamp(min=0.0), (-acc_cmd).clamp(min=0.0)), -1)

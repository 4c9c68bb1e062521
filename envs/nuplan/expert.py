"""Log-following expert for ``env=nuplan``: tracks the logged ego path and speed (pure pursuit on the rear axle and
a speed P-controller) through CaRL's action mapping. ``carl-eval policy=expert`` uses it (``make_expert``); it is
the "expert-like" reference of the closed-loop score tests. It reads the env's privileged state (scenario, step)."""
from __future__ import annotations

import torch
from torch import Tensor

from envs.nuplan.cache import REAR_AXLE_TO_CENTRE
from envs.nuplan.dynamics import MAX_ACCEL, MAX_DECEL, MAX_STEER, WHEELBASE

LOOKAHEAD_FRAMES = 8  # 0.8 s ahead on the logged path
MIN_LOOKAHEAD = 3.0  # m
SPEED_HORIZON = 0.5  # s to reach the logged speed
POSITION_GAIN = 1.0  # 1/s²: acceleration per metre behind (or ahead of) the logged pose


def make_expert(env):  # noqa: ANN001 - NuplanEnv (import cycle)
    def act(obs: dict[str, Tensor] | None = None) -> Tensor:
        s = env.state
        last = env.num_frames - 1
        f = (s.steps + LOOKAHEAD_FRAMES).clamp(max=last)
        target = env.log_ego[s.scenario, f, :2]  # rear axle, world frame
        v_log = env.log_ego[s.scenario, (s.steps + 1).clamp(max=last), 3]
        fwd = torch.stack((torch.cos(s.ego_yaw), torch.sin(s.ego_yaw)), -1)
        rear = s.ego_xy - REAR_AXLE_TO_CENTRE * fwd
        d = target - rear
        ld = d.norm(dim=-1).clamp(min=MIN_LOOKAHEAD)
        alpha = torch.atan2(d[:, 1], d[:, 0]) - s.ego_yaw
        alpha = torch.atan2(torch.sin(alpha), torch.cos(alpha))
        tire = torch.atan(2.0 * WHEELBASE * torch.sin(alpha) / ld)
        steer = (tire / MAX_STEER).clamp(-1, 1)
        # speed tracking plus the along-track position error to the logged pose of the next frame (time-indexed)
        here = env.log_ego[s.scenario, (s.steps + 1).clamp(max=last), :2]
        lag = ((here - rear) * fwd).sum(-1)
        a = (v_log - s.ego_speed) / SPEED_HORIZON + POSITION_GAIN * lag
        lon = torch.where(a >= 0, a / MAX_ACCEL, a / MAX_DECEL).clamp(-1, 1)
        return torch.stack((steer, lon), -1)

    return act

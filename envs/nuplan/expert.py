"""Log-following expert for ``env=nuplan``: tracks the logged ego path and speed (pure pursuit on the rear axle and
a speed P-controller) through CaRL's action mapping. ``carl-eval policy=expert`` uses it (``make_expert``); it is
the "expert-like" reference of the closed-loop score tests. It reads the env's privileged state (scenario, step)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from envs.nuplan.dynamics import MAX_ACCEL, MAX_DECEL, MAX_STEER, WHEELBASE

if TYPE_CHECKING:
    from envs.nuplan.logs import ScenarioLogs
    from envs.sim.env import SimEnv

LOOKAHEAD_FRAMES = 8  # 0.8 s ahead on the logged path
MIN_LOOKAHEAD = 3.0  # m
SPEED_HORIZON = 0.5  # s to reach the logged speed
POSITION_GAIN = 1.0  # 1/s²: acceleration per metre behind (or ahead of) the logged pose


def make_expert(env: SimEnv) -> Callable[[dict[str, Tensor] | None], Tensor]:
    """The expert's policy function for a nuPlan ``env`` (actions in its logs' ``action_names`` order). It works in
    each scenario's own frame (``log_ego_local``, ``ego_rear``), so it drives the same in any batch."""
    logs: ScenarioLogs = env.data
    order = logs.action_names

    def act(obs: dict[str, Tensor] | None = None) -> Tensor:
        s = env.state
        last = logs.num_frames - 1
        log = logs.log_ego_local[s.scenario]  # [B, T, 7] rear axle, scenario frame, float64
        rows = torch.arange(len(s.scenario), device=s.scenario.device)
        nxt = (s.steps + 1).clamp(max=last)
        target = log[rows, (s.steps + LOOKAHEAD_FRAMES).clamp(max=last), :2]
        v_log = log[rows, nxt, 3].float()
        fwd = torch.stack((torch.cos(s.ego_yaw), torch.sin(s.ego_yaw)), -1)
        d = (target - s.ego_rear).float()
        ld = d.norm(dim=-1).clamp(min=MIN_LOOKAHEAD)
        alpha = torch.atan2(d[:, 1], d[:, 0]) - s.ego_yaw
        alpha = torch.atan2(torch.sin(alpha), torch.cos(alpha))
        tire = torch.atan(2.0 * WHEELBASE * torch.sin(alpha) / ld)
        steer = (tire / MAX_STEER).clamp(-1, 1)
        # speed tracking plus the along-track position error to the logged pose of the next frame (time-indexed)
        lag = ((log[rows, nxt, :2] - s.ego_rear).float() * fwd).sum(-1)
        a = (v_log - s.ego_speed) / SPEED_HORIZON + POSITION_GAIN * lag
        lon = torch.where(a >= 0, a / MAX_ACCEL, a / MAX_DECEL).clamp(-1, 1)
        cols = {"steer": steer, "accel": lon}
        return torch.stack([cols[k] for k in order], -1)

    return act

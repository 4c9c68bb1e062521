"""Rule-based expert on privileged simulator state: a baseline policy and the proof that routes are drivable.

Lateral: pure pursuit on the dense route. Longitudinal: IDM towards the speed limit (slower in turns), treating as
obstacles every actor near the route path ahead (pedestrians also at their position 1.5 s ahead), red and yellow
lights, and stop signs until it has stopped. Batched like the simulator: one call drives every environment.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from envs.sim import agents, infractions
from envs.sim.dynamics import DRAG, ROLLING
from envs.sim.observation import upcoming_stop_lines
from envs.sim.state import obstacles
from envs.sim.geometry import to_local, wrap_angle

if TYPE_CHECKING:  # the env is what these read, not a dependency of theirs
    from envs.sim.env import SimEnv

PATH_POINTS = 24  # path samples ahead (every 2 m)
PATH_STEP = 2
TURN_SPEED = 5.5  # m/s through sharp turns


class Expert:
    """``Expert(env)(obs) -> actions [B, 2]``; reads ``env.state`` (privileged), ignores ``obs``."""

    def __init__(self, env: SimEnv, speed_fraction: float = 0.9):
        self.env = env
        self.speed_fraction = speed_fraction

    def __call__(self, obs: dict[str, Tensor] | None = None) -> Tensor:
        env, cfg = self.env, self.env.cfg
        s = env.state
        v = s.ego_speed
        v0 = self.target_speed(s)
        gap, lead_v = self.obstacle_gap(s, v0)
        # traffic control: a line to stop at, if it comes before the obstacle, stops the ego there
        line_gap = self.stop_line_gap(s)
        stop_first = line_gap < gap
        gap = torch.minimum(gap, line_gap)
        lead_v = torch.where(stop_first, torch.zeros_like(lead_v), lead_v)
        acc = agents.idm_accel(v, v0, gap.clamp(min=0.05), v - lead_v)
        drag = DRAG * v * v + ROLLING * (v > 0).float()  # the ego model's resistance, made up for by throttle
        lon = torch.where(acc + drag >= 0, (acc + drag) / cfg.max_accel, acc / cfg.max_brake)
        # hold still at a standstill when the way is not clear
        lon = torch.where((gap < 1.0) & (v < 0.5), torch.full_like(lon, -1.0), lon)
        return torch.stack((self.steer(s), lon.clamp(-1.0, 1.0)), -1)

    def steer(self, s) -> Tensor:  # noqa: ANN001 - SimState
        """Pure pursuit on the dense route, looking further ahead the faster the ego drives."""
        w, cfg = self.env.world, self.env.cfg
        n = w.route_n[s.route_id]
        look = (2.5 + 0.6 * s.ego_speed).clamp(4.0, 14.0)
        k = (s.route_idx + look.round().long()).clamp(max=n - 1)
        local = to_local(w.route_pts[s.route_id, k], s.ego_xy, s.ego_yaw)
        ld = local.norm(dim=-1).clamp(min=1.0)
        alpha = torch.atan2(local[:, 1], local[:, 0])
        delta = torch.atan(2.0 * cfg.wheelbase * torch.sin(alpha) / ld)
        return (delta / cfg.max_steer).clamp(-1.0, 1.0)

    def target_speed(self, s) -> Tensor:  # noqa: ANN001 - SimState
        """A fraction of the speed limit, at most :data:`TURN_SPEED` where the route turns within ~24 m."""
        w = self.env.world
        n = w.route_n[s.route_id]
        limit = infractions.lane_measures(w, s.ego_xy, s.ego_yaw)["speed_limit"]
        p10 = w.route_pts[s.route_id, (s.route_idx + 12).clamp(max=n - 1)]
        p20 = w.route_pts[s.route_id, (s.route_idx + 24).clamp(max=n - 1)]
        h1 = torch.atan2((p10 - s.ego_xy)[:, 1], (p10 - s.ego_xy)[:, 0])
        h2 = torch.atan2((p20 - p10)[:, 1], (p20 - p10)[:, 0])
        turning = (wrap_angle(h2 - h1).abs() > 0.35) | (wrap_angle(h1 - s.ego_yaw).abs() > 0.35)
        v0 = limit * self.speed_fraction
        return torch.where(turning, v0.clamp(max=TURN_SPEED), v0)

    def obstacle_gap(self, s, v0: Tensor) -> tuple[Tensor, Tensor]:  # noqa: ANN001 - SimState
        """(gap to the first actor on or crossing the path ahead, now or in 1.5 s; its speed along the ego's
        heading); no such actor: a gap of ~1 km and the target speed ``v0``."""
        env, w = self.env, self.env.world
        B, dev = env.num_envs, env.device
        n = w.route_n[s.route_id]
        j = s.route_idx.unsqueeze(1) + PATH_STEP * torch.arange(1, PATH_POINTS + 1, device=dev)
        j = torch.minimum(j, (n - 1).unsqueeze(1))
        rid = s.route_id.unsqueeze(1).expand_as(j)
        path = w.route_pts[rid, j]  # [B,K,2]
        dist_along = w.route_cum[rid, j] - w.route_cum[s.route_id, s.route_idx].unsqueeze(1)
        a_xy, a_yaw, a_speed, a_half, a_valid = obstacles(s, env.ego_half, include_ego=False)
        a_dir = torch.stack((torch.cos(a_yaw), torch.sin(a_yaw)), -1)
        future = a_xy + a_dir * (a_speed * 1.5).unsqueeze(-1)
        clearance = env.ego_half[:, 1:2] + a_half[..., 1] + 0.5  # [B,N]
        d_now = (path.unsqueeze(2) - a_xy.unsqueeze(1)).norm(dim=-1)  # [B,K,N]
        d_fut = (path.unsqueeze(2) - future.unsqueeze(1)).norm(dim=-1)
        blocked = ((d_now < clearance.unsqueeze(1)) | (d_fut < clearance.unsqueeze(1))) & a_valid.unsqueeze(1)
        # ignore what is behind the ego (its own route behind is not on the path anyway)
        blocked &= (to_local(a_xy, s.ego_xy.unsqueeze(1), s.ego_yaw.unsqueeze(1))[..., 0] > 0).unsqueeze(1)
        gap_k = torch.where(blocked.any(-1), dist_along, torch.full_like(dist_along, 1e3))
        gap, kk = gap_k.min(1)
        first_obs = torch.where(blocked, d_now, torch.full_like(d_now, 1e3))
        lead = torch.gather(first_obs, 1, kk.view(B, 1, 1).expand(B, 1, first_obs.shape[2])).squeeze(1).argmin(-1)
        lead_v = (a_speed * torch.cos(a_yaw - s.ego_yaw.unsqueeze(1))).gather(1, lead.unsqueeze(1)).squeeze(1)
        gap = gap - env.ego_half[:, 0] - 1.0
        return gap, torch.where(gap < 500, lead_v.clamp(min=0.0), v0)

    def stop_line_gap(self, s) -> Tensor:  # noqa: ANN001 - SimState
        """Distance to aim at for the next stop line the ego must stop at (red, a yellow it can stop for, a stop
        sign not yet obeyed); ~1 km when none."""
        env, w = self.env, self.env.world
        stop, ev_idx, near = upcoming_stop_lines(w, s.route_id, s.route_idx)
        ahead = (ev_idx - s.route_idx.unsqueeze(1)).float()
        is_sign = w.stop_control[stop] == 2
        group = torch.where(is_sign, torch.full_like(stop, -1), w.stop_group[stop])
        state, _ = env.light_lookup(s)(group)
        to_line = ahead - env.ego_half[:, :1]  # nose to line
        can_stop = to_line > s.ego_speed.unsqueeze(1) ** 2 / (2 * 4.0) - 0.5
        must = near & (ahead > -1.0) & (((state == 2) | ((state == 1) & can_stop)) & ~is_sign
                                         | is_sign & ~s.stop_done.unsqueeze(1))
        # IDM halts ~2 m short of an obstacle: aim 1 m past the line point so the centre stops ~3 m before it
        return torch.where(must, (ahead - 1.0).clamp(min=0.0), torch.full_like(to_line, 1e3)).min(1).values

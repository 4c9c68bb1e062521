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
FORECAST = torch.arange(0.0, 4.01, 0.5)  # s: the times at which moving actors and the ego's own progress are compared
EGO_ACCEL = 2.0  # m/s^2: how the ego is assumed to speed up when it goes on


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
        gap, lead_v, yielding = self.obstacle_gap(s, v0)
        # traffic control: a line to stop at, if it comes before the obstacle, stops the ego there
        line_gap = self.stop_line_gap(s)
        stop_first = line_gap < gap
        gap = torch.minimum(gap, line_gap)
        lead_v = torch.where(stop_first, torch.zeros_like(lead_v), lead_v)
        acc = agents.idm_accel(v, v0, gap.clamp(min=0.05), v - lead_v)
        drag = DRAG * v * v + ROLLING * (v > 0).float()  # the ego model's resistance, made up for by throttle
        lon = torch.where(acc + drag >= 0, (acc + drag) / cfg.max_accel, acc / cfg.max_brake)
        # hold still at a standstill when the way is not clear
        # (short of a stream it yields to: no creeping towards it)
        lon = torch.where(((gap < 1.0) | (yielding & (gap < 6.0))) & (v < 0.5), torch.full_like(lon, -1.0), lon)
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

    def obstacle_gap(self, s, v0: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # noqa: ANN001 - SimState
        """(gap to the first actor on or crossing the path ahead, now or in 1.5 s, or to where the ego yields to a
        stream (:meth:`forecast_gap`); its speed along the ego's heading; whether the gap is a yield); no such actor:
        a gap of ~1 km and the target speed ``v0``."""
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
        clearance = env.ego_half[:, 1:2] + a_half[..., 1] + 1.0  # [B,N]
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
        # gap acceptance: a moving actor that would be where the ego would be, at the same time within the forecast,
        # if the ego went on (crossing and merging streams), holds the ego before the first path point it sweeps
        yield_gap = self.forecast_gap(s, v0, path, dist_along, a_xy, a_dir, a_speed, a_half, a_valid, a_yaw)
        stop_first = yield_gap < gap
        gap = torch.minimum(gap, yield_gap)
        lead_v = torch.where(stop_first, torch.zeros_like(lead_v), lead_v)
        return gap, torch.where(gap < 500, lead_v.clamp(min=0.0), v0), stop_first

    def forecast_gap(self, s, v0: Tensor, path: Tensor, dist_along: Tensor, a_xy: Tensor, a_dir: Tensor,  # noqa: ANN001
                     a_speed: Tensor, a_half: Tensor, a_valid: Tensor, a_yaw: Tensor) -> Tensor:
        """Distance to stop at before a moving actor's sweep when, going on (speeding up to ``v0``), the ego would
        meet it; ~1 km when none. Actors behind the ego driving its way (followers) and sweeps the ego is already in
        with its centre (it is committed) do not count; it stops with its nose 2 m short of the sweep."""
        env = self.env
        taus = FORECAST.to(s.ego_speed.device)
        v = s.ego_speed.unsqueeze(1)
        t_full = ((v0.unsqueeze(1) - v) / EGO_ACCEL).clamp(min=0.0)
        tt = torch.minimum(taus, t_full)
        ego_d = v * tt + 0.5 * EGO_ACCEL * tt ** 2 + torch.maximum(v, v0.unsqueeze(1)) * (taus - tt)  # [B,T]
        k = torch.searchsorted(dist_along.contiguous(), ego_d.contiguous()).clamp(max=path.shape[1] - 1)
        ego_at = torch.gather(path, 1, k.unsqueeze(-1).expand(-1, -1, 2))  # [B,T,2]
        ego_at = torch.where((ego_d < dist_along[:, :1]).unsqueeze(-1), s.ego_xy.unsqueeze(1), ego_at)
        actor_at = a_xy.unsqueeze(2) + a_dir.unsqueeze(2) * (a_speed.unsqueeze(-1) * taus).unsqueeze(-1)  # [B,N,T,2]
        reach = env.ego_half[:, :1] + a_half[..., 0] + 1.0  # [B,N] lengths: a crossing or a rear end
        meet = ((actor_at - ego_at.unsqueeze(1)).norm(dim=-1) < reach.unsqueeze(-1)).any(-1)  # [B,N]
        local = to_local(a_xy, s.ego_xy.unsqueeze(1), s.ego_yaw.unsqueeze(1))
        follower = (local[..., 0] < 0) & (torch.cos(a_yaw - s.ego_yaw.unsqueeze(1)) > 0.8)
        relevant = meet & a_valid & (a_speed > 0.5) & ~follower
        clearance = env.ego_half[:, 1:2] + a_half[..., 1] + 1.0  # [B,N]
        swept = ((path.unsqueeze(2).unsqueeze(3) - actor_at.unsqueeze(1)).norm(dim=-1)
                 < clearance.unsqueeze(1).unsqueeze(-1)).any(-1) & relevant.unsqueeze(1)  # [B,K,N]
        first = torch.where(swept.any(-1), dist_along, torch.full_like(dist_along, 1e3)).min(1).values
        ignore = (first < 0.5) | (first >= 1e3)  # committed, or nothing to yield to
        return torch.where(ignore, torch.full_like(first, 1e3), first - env.ego_half[:, 0] - 2.0)

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

"""Infraction checks and route completion as CaRL defines them (``carl-reference.md`` §1), batched.

Every function takes [B]-shaped ego quantities and padded actor tensors and returns [B] results; the CARLA and
nuPlan workers convert their world into the same tensors and call the same functions.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor

from envs.maps.raster import LAYER_ROAD, LAYER_SHOULDER
from envs.sim.geometry import boxes_overlap, wrap_angle
from envs.sim.raster import box_fraction_on
from envs.sim.world import World, lane_lookup

# Leaderboard 2.0 infraction coefficients (benchmarks.md §2.1)
LB_COEFFICIENTS = {"collision_pedestrian": 0.5, "collision_vehicle": 0.6, "collision_static": 0.65,
                   "red_light": 0.7, "stop_sign": 0.8}
# Everything counted per episode; the first nine end the episode.
INFRACTIONS = ("collision_vehicle", "collision_pedestrian", "collision_static", "red_light", "stop_sign",
               "off_road", "route_deviation", "blocked", "timeout", "speeding", "ttc", "comfort", "outside_lanes")
HARD = INFRACTIONS[:9]
TERMINAL_PENALTY = ("collision_vehicle", "collision_pedestrian", "collision_static", "red_light")
ROUTE_WINDOW = 10
TTC_NEAREST = 6  # actors considered by the TTC forecast


def route_progress(world: World, route_id: Tensor, idx: Tensor, ego_xy: Tensor) -> tuple[Tensor, Tensor]:
    """Advance the route index to the furthest of the next points already passed (forward-vector test, as
    ``RouteCompletionTest``); also return the distance to the nearest point of the window (for route deviation)."""
    n = world.route_n[route_id]
    k = (idx.unsqueeze(1) + torch.arange(ROUTE_WINDOW, device=idx.device)).clamp(max=(n - 1).unsqueeze(1))
    rid = route_id.unsqueeze(1).expand_as(k)
    p = world.route_pts[rid, k]
    p_next = world.route_pts[rid, (k + 1).clamp(max=(n - 1).unsqueeze(1))]
    fwd = p_next - p
    rel = ego_xy.unsqueeze(1) - p
    dist = rel.norm(dim=-1)
    passed = ((fwd * rel).sum(-1) > 0) & (dist < 8.0)
    furthest = torch.where(passed, k, torch.zeros_like(k)).max(1).values
    return torch.maximum(idx, furthest), dist.min(1).values


def route_completion(world: World, route_id: Tensor, idx: Tensor) -> Tensor:
    """Percent of the route length up to the route index, rounded to 2 decimals like the leaderboard."""
    done = world.route_cum[route_id, idx] / world.route_len[route_id].clamp(min=1e-3) * 100.0
    return torch.round(done * 100.0) / 100.0


def collisions(ego_xy: Tensor, ego_yaw: Tensor, ego_half: Tensor, actors: dict[str, tuple[Tensor, ...]]
               ) -> dict[str, Tensor]:
    """Oriented-box overlap of the ego with each actor class: {"vehicle"|"pedestrian"|"static": bool [B]}."""
    out = {}
    for name, (xy, yaw, half, valid) in actors.items():
        hit = boxes_overlap(ego_xy.unsqueeze(1), ego_yaw.unsqueeze(1), ego_half.unsqueeze(1), xy, yaw, half)
        out[name] = (hit & valid).any(1)
    return out


def ttc_violation(ego_xy: Tensor, ego_yaw: Tensor, ego_speed: Tensor, ego_half: Tensor, xy: Tensor, yaw: Tensor,
                  speed: Tensor, half: Tensor, valid: Tensor, times: tuple[float, ...]) -> Tensor:
    """Constant-velocity forecast of every box at the TTC times: any overlap with the ego's forecast (CaRL §1.2)."""
    if xy.shape[1] > TTC_NEAREST:  # only the nearest actors can be reached within the horizon
        dist = torch.where(valid, (xy - ego_xy.unsqueeze(1)).norm(dim=-1), torch.full_like(speed, 1e9))
        near = dist.topk(TTC_NEAREST, dim=1, largest=False).indices
        xy = xy.gather(1, near.unsqueeze(-1).expand(-1, -1, 2))
        half = half.gather(1, near.unsqueeze(-1).expand(-1, -1, 2))
        yaw, speed, valid = yaw.gather(1, near), speed.gather(1, near), valid.gather(1, near)
    tt = torch.tensor(times, device=ego_xy.device)  # [T]
    ego_dir = torch.stack((torch.cos(ego_yaw), torch.sin(ego_yaw)), -1)
    odir = torch.stack((torch.cos(yaw), torch.sin(yaw)), -1)
    ego_f = ego_xy[:, None, None] + (ego_dir * ego_speed.unsqueeze(-1))[:, None, None] * tt[None, None, :, None]
    oth_f = xy[:, :, None] + (odir * speed.unsqueeze(-1))[:, :, None] * tt[None, None, :, None]  # [B,N,T,2]
    hit = boxes_overlap(ego_f, ego_yaw[:, None, None], ego_half[:, None, None], oth_f, yaw[..., None],
                        half[:, :, None])
    return (hit.any(-1) & valid).any(-1) & (ego_speed >= 0.1)


@lru_cache(maxsize=None)
def savgol_kernel(window: int, order: int, deriv: int, dt: float) -> np.ndarray:
    """Savitzky-Golay weights that evaluate the ``deriv``-th derivative at the newest of ``window`` samples."""
    t = (np.arange(window) - (window - 1)) * dt
    vander = np.vander(t, order + 1, increasing=True)
    coeffs = np.linalg.pinv(vander)  # [order+1, window]
    return (coeffs[deriv] * math.factorial(deriv)).astype(np.float32)


def comfort_metrics(hist_speed: Tensor, hist_yaw: Tensor, count: Tensor, dt: float) -> tuple[Tensor, ...]:
    """Six comfort metrics from the 15-sample history (newest last), Savitzky-Golay smoothed as in CaRL.

    Returns (lon_acc, lat_acc, jerk, lon_jerk, yaw_rate, yaw_acc); metrics whose window is not yet full are 0.
    """
    def sg(h: Tensor, window: int, order: int, deriv: int) -> Tensor:
        k = torch.as_tensor(savgol_kernel(window, order, deriv, dt), device=h.device)
        val = (h[:, -window:] * k).sum(-1)
        return torch.where(count >= window, val, torch.zeros_like(val))

    yaw = hist_yaw[:, :1] + torch.cumsum(wrap_angle(torch.diff(hist_yaw, dim=1, prepend=hist_yaw[:, :1])), dim=1)
    lon_acc = sg(hist_speed, 8, 2, 1)
    lon_jerk = sg(hist_speed, 15, 2, 2)
    yaw_rate = sg(yaw, 5, 2, 1)
    yaw_acc = sg(yaw, 5, 3, 2)
    speed = hist_speed[:, -1]
    lat_acc = speed * yaw_rate
    lat_jerk = speed * yaw_acc + lon_acc * yaw_rate
    jerk = torch.sqrt(lon_jerk ** 2 + lat_jerk ** 2)
    return lon_acc, lat_acc, jerk, lon_jerk, yaw_rate, yaw_acc


def off_road(world: World, ego_xy: Tensor, ego_yaw: Tensor, ego_half: Tensor, threshold: float) -> Tensor:
    """More than ``threshold`` of the ego box off road and shoulder."""
    on = box_fraction_on(world.raster, [LAYER_ROAD, LAYER_SHOULDER], ego_xy, ego_yaw, ego_half)
    return (1.0 - on) > threshold


def lane_measures(world: World, ego_xy: Tensor, ego_yaw: Tensor) -> dict[str, Tensor]:
    """Nearest driving lane under the ego: speed limit, lane-centre ratio, outside-lanes flag, junction flag."""
    lane, lateral, lane_yaw, found = lane_lookup(world, ego_xy)
    width = world.lane_width[lane]
    junction = world.lane_junction[lane] & found
    wrong_way = wrap_angle(ego_yaw - lane_yaw).abs() > math.radians(120)
    outside = ~found | (lateral.abs() > width / 2 + 0.5) | (wrong_way & ~junction)
    ratio = torch.where(junction | ~found, torch.zeros_like(lateral), lateral.abs() / (width / 2))
    limit = torch.where(found, world.lane_speed[lane], torch.full_like(lateral, 6.0))
    return {"lane": lane, "speed_limit": limit, "lane_ratio": ratio, "outside": outside, "junction": junction}


def infraction_score(counts: Tensor, outside_pct: Tensor) -> Tensor:
    """Leaderboard 2.0 infraction score from per-episode counts [B, len(INFRACTIONS)]."""
    score = torch.ones_like(outside_pct)
    for name, coef in LB_COEFFICIENTS.items():
        score = score * coef ** counts[:, INFRACTIONS.index(name)].float()
    return score * (1.0 - outside_pct.clamp(0.0, 100.0) / 100.0)

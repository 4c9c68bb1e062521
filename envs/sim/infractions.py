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

from envs.maps.rasterize import LAYER_ROAD, LAYER_SHOULDER
from envs.metrics.leaderboard import LB_COEFFICIENTS
from envs.sim.geometry import boxes_overlap, boxes_overlap_moving, true_first, wrap_angle
from envs.sim.bev_draw import box_fraction_on
from envs.sim.world import World, lane_lookup

# Everything counted per episode; the first nine end the episode.
INFRACTIONS = ("collision_vehicle", "collision_pedestrian", "collision_static", "red_light", "stop_sign",
               "off_road", "route_deviation", "blocked", "timeout", "speeding", "ttc", "comfort", "outside_lanes")
HARD = INFRACTIONS[:9]
TERMINAL_PENALTY = ("collision_vehicle", "collision_pedestrian", "collision_static", "red_light")
HISTORY = 15  # samples of ego speed and yaw kept for the comfort metrics (newest last)
RC_WINDOW = 2  # RouteCompletionTest: the next 3 route points (window 2)
DEVIATION_WINDOW = 5  # InRouteTest: the nearest of the next 6 route points
WRONG_WAY_LANE_CHANGE = math.radians(150)  # a lane change outside junctions with this lane-heading jump flips the direction
WRONG_WAY_JUNCTION_EXIT = math.radians(120)  # leaving a junction with this ego-vs-lane angle: wrong way


def route_progress(world: World, route_id: Tensor, idx: Tensor, ego_xy: Tensor) -> Tensor:
    """``RouteCompletionTest``: the route index moves to the furthest of the points ``idx .. idx + RC_WINDOW`` whose
    forward vector has a positive dot product with (ego - point), i.e. that the ego has passed."""
    n = world.route_n[route_id]
    k = (idx.unsqueeze(1) + torch.arange(RC_WINDOW + 1, device=idx.device)).clamp(max=(n - 1).unsqueeze(1))
    rid = route_id.unsqueeze(1).expand_as(k)
    p = world.route_pts[rid, k]
    # the direction of each point: towards the next one; the last point keeps its incoming direction
    last = k >= (n - 1).unsqueeze(1)
    fwd = torch.where(last.unsqueeze(-1), p - world.route_pts[rid, (k - 1).clamp(min=0)],
                      world.route_pts[rid, (k + 1).clamp(max=(n - 1).unsqueeze(1))] - p)
    passed = (fwd * (ego_xy.unsqueeze(1) - p)).sum(-1) > 0
    furthest = torch.where(passed, k, torch.zeros_like(k)).max(1).values
    return torch.maximum(idx, furthest)


def route_deviation(world: World, route_id: Tensor, dev_idx: Tensor, ego_xy: Tensor, out_m: Tensor,
                    safe_m: float, max_m: float, max_fraction: float) -> tuple[Tensor, Tensor, Tensor]:
    """``InRouteTest`` (CaRL's and Leaderboard 2.0's): the nearest of the route points ``dev_idx .. dev_idx + 5``.

    Deviated when that point is ``max_m`` (30 m) or more away, or when the route length advanced while ``safe_m``
    (15 m) or more from the route exceeds ``max_fraction`` (30 %) of the route (``max_fraction`` 0: rule off).
    Returns (deviated, new index, new out-of-route metres).
    """
    n = world.route_n[route_id]
    k = (dev_idx.unsqueeze(1) + torch.arange(DEVIATION_WINDOW + 1, device=dev_idx.device)).clamp(
        max=(n - 1).unsqueeze(1))
    rid = route_id.unsqueeze(1).expand_as(k)
    dist = (ego_xy.unsqueeze(1) - world.route_pts[rid, k]).norm(dim=-1)
    shortest, j = dist.flip(1).min(1)  # the last of equally near points, like the criterion's "<=" scan
    nearest = k.gather(1, (DEVIATION_WINDOW - j).unsqueeze(1)).squeeze(1)
    advanced = world.route_cum[route_id, nearest] - world.route_cum[route_id, dev_idx]
    out_m = torch.where(shortest >= safe_m, out_m + advanced, out_m)
    deviated = shortest >= max_m
    if max_fraction > 0:
        deviated = deviated | (out_m > max_fraction * world.route_len[route_id])
    return deviated, nearest, out_m


def route_completion(world: World, route_id: Tensor, idx: Tensor) -> Tensor:
    """Percent of the route length up to the route index, rounded to 2 decimals like the leaderboard."""
    done = world.route_cum[route_id, idx] / world.route_len[route_id].clamp(min=1e-3) * 100.0
    return torch.round(done * 100.0) / 100.0


def collisions(ego_xy: Tensor, ego_yaw: Tensor, ego_half: Tensor, actors: dict[str, tuple[Tensor, ...]]
               ) -> dict[str, Tensor]:
    """Oriented-box overlap of the ego with each valid actor of each class: {"vehicle"|...: bool [B, N]}."""
    out = {}
    for name, (xy, yaw, half, valid) in actors.items():
        hit = boxes_overlap(ego_xy.unsqueeze(1), ego_yaw.unsqueeze(1), ego_half.unsqueeze(1), xy, yaw, half)
        out[name] = hit & valid
    return out


def ttc_violation(ego_xy: Tensor, ego_yaw: Tensor, ego_speed: Tensor, ego_half: Tensor, xy: Tensor, yaw: Tensor,
                  speed: Tensor, half: Tensor, valid: Tensor, times: tuple[float, ...]) -> Tensor:
    """Constant-velocity forecast of every box at the TTC times: any overlap with the ego's forecast (CaRL §1.2).

    Every actor is checked (vehicles, walkers, statics), as CaRL does; no nearest-N cap. The boxes are tested only
    for the actors that can reach the ego by the last time (centre distance within both boxes' circumradii plus the
    distance both can cover, + 0.5 m), gathered first: the others cannot overlap it, and most slots are empty or far.
    """
    reach = (ego_half.norm(dim=-1).unsqueeze(1) + half.norm(dim=-1) + 0.5
             + (ego_speed.abs().unsqueeze(1) + speed.abs()) * max(times, default=0.0))
    near = valid & ((xy - ego_xy.unsqueeze(1)).norm(dim=-1) <= reach)  # [B, N]
    k = true_first(near)  # [B, K]: the near ones first
    if k.shape[1] == 0:
        return torch.zeros_like(ego_speed, dtype=torch.bool)
    if k.shape[1] < near.shape[1]:
        xy, half = xy.gather(1, k.unsqueeze(-1).expand(-1, -1, 2)), half.gather(1, k.unsqueeze(-1).expand(-1, -1, 2))
        yaw, speed, near = yaw.gather(1, k), speed.gather(1, k), near.gather(1, k)
    tt = torch.tensor(times, device=ego_xy.device)  # [T]
    ego_v = torch.stack((torch.cos(ego_yaw), torch.sin(ego_yaw)), -1) * ego_speed.unsqueeze(-1)
    other_v = torch.stack((torch.cos(yaw), torch.sin(yaw)), -1) * speed.unsqueeze(-1)
    hit = boxes_overlap_moving(ego_xy.unsqueeze(1), ego_yaw.unsqueeze(1), ego_half.unsqueeze(1), ego_v.unsqueeze(1),
                               xy, yaw, half, other_v, tt)  # [B, K, T]
    return (hit.any(-1) & near).any(-1) & (ego_speed >= 0.1)


@lru_cache(maxsize=None)
def savgol_kernel(window: int, order: int, deriv: int, dt: float) -> np.ndarray:
    """Savitzky-Golay weights that evaluate the ``deriv``-th derivative at the newest of ``window`` samples."""
    t = (np.arange(window) - (window - 1)) * dt
    vander = np.vander(t, order + 1, increasing=True)
    coeffs = np.linalg.pinv(vander)  # [order+1, window]
    return (coeffs[deriv] * math.factorial(deriv)).astype(np.float32)


def comfort_metrics(hist_speed: Tensor, hist_yaw: Tensor, count: Tensor, dt: float) -> tuple[Tensor, ...]:
    """Six comfort metrics from the ``HISTORY``-sample history (newest last), Savitzky-Golay smoothed as in CaRL.

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
    """Nearest driving lane under the ego: lane, its heading, speed limit, lane-centre ratio, junction flag, and
    ``off_lane`` (no lane within half its width + 0.5 m)."""
    lane, lateral, lane_yaw, found, width = lane_lookup(world, ego_xy)
    junction = world.lane_junction[lane] & found
    off_lane = ~found | (lateral.abs() > width / 2 + 0.5)
    ratio = torch.where(junction | ~found, torch.zeros_like(lateral), lateral.abs() / (width / 2))
    limit = torch.where(found, world.lane_speed[lane], torch.full_like(lateral, 6.0))
    return {"lane": lane, "lane_yaw": lane_yaw, "speed_limit": limit, "lane_ratio": ratio, "off_lane": off_lane,
            "junction": junction, "found": found}


def wrong_way(lane: dict[str, Tensor], ego_yaw: Tensor, prev_lane: Tensor, prev_lane_yaw: Tensor,
              prev_junction: Tensor, active: Tensor) -> Tensor:
    """``OutsideRouteLanesTest``'s wrong-direction state after this step (CaRL §1.2, Leaderboard 2.0).

    Junctions are never wrong way. Leaving a junction: wrong when the ego heads more than 120 deg off the lane. A lane
    change outside junctions whose lane heading jumps by more than 150 deg (onto the oncoming lane, or back) flips
    the state. ``prev_*`` describe the lane under the ego at the previous step (``prev_lane`` -1: none yet).
    """
    junction = lane["junction"]
    changed = lane["found"] & (lane["lane"] != prev_lane) & (prev_lane >= 0)  # -1: the episode's first lane
    exit_junction = changed & prev_junction & ~junction
    flip = changed & ~prev_junction & ~junction & (wrap_angle(lane["lane_yaw"] - prev_lane_yaw).abs()
                                                   > WRONG_WAY_LANE_CHANGE)
    off_angle = wrap_angle(ego_yaw - lane["lane_yaw"]).abs() > WRONG_WAY_JUNCTION_EXIT
    active = torch.where(exit_junction, off_angle, active ^ flip)
    return active & ~junction


def infraction_score(counts: Tensor, outside_pct: Tensor) -> Tensor:
    """Leaderboard 2.0 infraction score from per-episode counts [B, len(INFRACTIONS)]."""
    score = torch.ones_like(outside_pct)
    for name, coef in LB_COEFFICIENTS.items():
        score = score * coef ** counts[:, INFRACTIONS.index(name)].float()
    return score * (1.0 - outside_pct.clamp(0.0, 100.0) / 100.0)

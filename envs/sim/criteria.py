"""Route criteria with memory, batched: what ends a route and what is recorded, under CaRL's training rules or
Leaderboard 2.0's evaluation rules (``SimConfig.rules``).

``carl`` (training, CaRL §1.4): every hard infraction ends the episode at once.
``leaderboard`` (evaluation, ``benchmarks.md`` Part A): collisions, red lights, stop signs and off-road events are
recorded and the route goes on; only route deviation (InRouteTest), being blocked (180 s) and the route timeout end it;
min-speed is scored at 4 checkpoints; a route completed beyond 99 % (ego within 10 m of its end) counts as 100 %.

Every function here works on [B] tensors; the state lives in :class:`CriteriaState`, one row per environment.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

RULES = ("carl", "leaderboard")

# Leaderboard 2.0 constants (scenario_runner atomic_criteria / atomic_behaviors, leaderboard statistics_manager)
COLLISION_RADIUS = 5.0  # m: a collision within this distance of the last one is the same collision
COLLISION_SAME_ACTOR_S = 5.0  # s: a collision with the last actor within this time is the same collision
COLLISION_MIN_EGO_SPEED = 0.1  # m/s: a slower ego is not at fault (not recorded)
LB_BLOCKED_TIME = 180.0  # s below LB_BLOCKED_SPEED
LB_BLOCKED_SPEED = 0.1
ROUTE_TIMEOUT_BASE = 300.0  # s, plus the time to drive the progressed distance at ...
ROUTE_TIMEOUT_SPEED_FRACTION = 0.1  # ... 10 % of the speed limit
MIN_SPEED_CHECKPOINTS = 4  # per route, evenly spaced by route length
MIN_SPEED_WEIGHT = 0.3  # factor = 1 - 0.3 * (1 - pct / 100), recorded only when pct < 100
MIN_SPEED_FINAL = 0.95  # a route ending beyond this fraction of its length scores its last checkpoint then
COMPLETED_RC = 99.0  # % route completion beyond which, with the ego ...
COMPLETED_END_DIST = 10.0  # ... within this many metres of the route's end, the route is completed (RC = 100)

ACTOR_CLASSES = ("vehicle", "pedestrian", "static")


@dataclass
class CriteriaState:
    """Per-episode memory of the route criteria."""

    dev_idx: Tensor  # [B] long: InRouteTest's own route index
    out_route_m: Tensor  # [B] route metres advanced while >= 15 m from the route (CaRL's deviation rule 2)
    prev_lane: Tensor  # [B] long: lane under the ego at the previous step (-1 none)
    prev_lane_yaw: Tensor  # [B]
    prev_junction: Tensor  # [B] bool
    wrong_way: Tensor  # [B] bool: OutsideRouteLanesTest's wrong-direction state
    off_road: Tensor  # [B] bool: off road at the previous step (Leaderboard mode counts each excursion once)
    col_actor: Tensor  # [B] long: class * 1_000_000 + index of the last recorded collision's actor, -1 none
    col_time: Tensor  # [B] simulation time of the last recorded collision
    col_xy: Tensor  # [B, 2] ego position at the last recorded collision
    col_near: Tensor  # [B] bool: the ego is still within COLLISION_RADIUS of it
    timeout: Tensor  # [B] s: the route timeout reached so far (Leaderboard)
    ms_last_m: Tensor  # [B] route distance at the last min-speed checkpoint
    ms_ego: Tensor  # [B] sum of the ego's speed over the ticks of the current checkpoint interval (with traffic)
    ms_traffic: Tensor  # [B] sum of the background traffic's mean speed over the same ticks
    ms_factor: Tensor  # [B] product of the min-speed factors so far
    ms_events: Tensor  # [B] long: min-speed infractions (checkpoints with pct < 100)

    @classmethod
    def zeros(cls, batch: int, device: torch.device) -> "CriteriaState":
        z = torch.zeros(batch, device=device)
        zl = torch.zeros(batch, dtype=torch.long, device=device)
        zb = torch.zeros(batch, dtype=torch.bool, device=device)
        return cls(dev_idx=zl.clone(), out_route_m=z.clone(), prev_lane=zl - 1, prev_lane_yaw=z.clone(),
                   prev_junction=zb.clone(), wrong_way=zb.clone(), off_road=zb.clone(), col_actor=zl - 1, col_time=z - 1e9,
                   col_xy=torch.zeros(batch, 2, device=device), col_near=zb.clone(),
                   timeout=z + ROUTE_TIMEOUT_BASE, ms_last_m=z.clone(), ms_ego=z.clone(), ms_traffic=z.clone(),
                   ms_factor=z + 1.0, ms_events=zl.clone())


def first_hit(hits: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Per-class overlap masks {class: bool [B, N]} -> (class index [B] (-1 none), actor key [B] (-1 none)).

    The first class in ACTOR_CLASSES order with an overlap wins (at most one collision is recorded per tick: a
    second one would lie within COLLISION_RADIUS of the first)."""
    any_hit = torch.stack([hits[c].any(1) for c in ACTOR_CLASSES], 1)  # [B, C]
    first = torch.stack([hits[c].float().argmax(1) for c in ACTOR_CLASSES], 1)  # [B, C] first actor hit per class
    cls = torch.where(any_hit.any(1), any_hit.float().argmax(1), -1)
    key = cls * 1_000_000 + first.gather(1, cls.clamp(min=0).unsqueeze(1)).squeeze(1)
    return cls, torch.where(cls >= 0, key, -1)


def record_collisions(st: CriteriaState, cls: Tensor, key: Tensor, ego_xy: Tensor, ego_speed: Tensor, t: Tensor
                      ) -> Tensor:
    """``CollisionTest``: which overlaps of this tick are recorded as a new collision (bool [B]); updates ``st``.

    Not recorded: the ego slower than 0.1 m/s (not its fault); the same actor as the last collision within 5 s
    (statics have no identity there, as CARLA's id 0); the ego still within 5 m of the last collision's position (the
    memory is cleared once it moves farther away).
    """
    st.col_near &= (ego_xy - st.col_xy).norm(dim=-1) <= COLLISION_RADIUS
    same_actor = (key == st.col_actor) & (t - st.col_time <= COLLISION_SAME_ACTOR_S)
    new = (cls >= 0) & ~same_actor & ~st.col_near & (ego_speed >= COLLISION_MIN_EGO_SPEED)
    static = cls == ACTOR_CLASSES.index("static")
    st.col_actor = torch.where(new, torch.where(static, torch.full_like(key, -1), key), st.col_actor)
    st.col_time = torch.where(new, t, st.col_time)
    st.col_xy = torch.where(new.unsqueeze(-1), ego_xy, st.col_xy)
    st.col_near |= new
    return new


def extend_timeout(st: CriteriaState, advanced_m: Tensor, speed_limit: Tensor) -> None:
    """``RouteTimeoutBehavior``: the route may last 300 s plus, for every metre of route progress, the time to drive it
    at 10 % of the speed limit there."""
    st.timeout = st.timeout + advanced_m / (ROUTE_TIMEOUT_SPEED_FRACTION * speed_limit.clamp(min=0.1))


def min_speed_factor(pct: Tensor) -> Tensor:
    """Leaderboard's min-speed penalty factor for an ego speed of ``pct`` % of the traffic's: 0.7 at 0 %, 1 at 100 %."""
    return 1.0 - MIN_SPEED_WEIGHT * (1.0 - pct.clamp(0.0, 100.0) / 100.0)


def min_speed_pct(st: CriteriaState) -> Tensor:
    """The ego's mean speed as a percentage of the traffic's over the current interval, 2 decimals (100 if no
    traffic was seen)."""
    pct = torch.where(st.ms_traffic > 0, 100.0 * st.ms_ego / st.ms_traffic.clamp(min=1e-9),
                      torch.full_like(st.ms_ego, 100.0))
    return torch.round(pct * 100.0) / 100.0


def update_min_speed(st: CriteriaState, route_m: Tensor, route_len: Tensor, ego_speed: Tensor,
                     traffic_speed: Tensor, has_traffic: Tensor, ends: Tensor) -> Tensor:
    """``MinimumSpeedRouteTest`` (4 checkpoints): a checkpoint is scored once the route distance reached has grown by
    more than a quarter of the route since the last one (checked before this tick's sample, which then opens the
    next interval), and when the route ends beyond 95 % of its length. Each tick with background traffic adds the
    ego's speed and the traffic's mean speed; a checkpoint with pct < 100 is an infraction with factor
    1 - 0.3 (1 - pct / 100). Returns the rows with an infraction this tick."""
    checkpoint = route_m - st.ms_last_m > route_len / MIN_SPEED_CHECKPOINTS
    final = ends & ~checkpoint & (route_m > MIN_SPEED_FINAL * route_len)
    scored = checkpoint | final
    pct = min_speed_pct(st)
    infraction = scored & (pct < 100.0)
    st.ms_factor = torch.where(infraction, st.ms_factor * min_speed_factor(pct), st.ms_factor)
    st.ms_events = st.ms_events + infraction.long()
    st.ms_last_m = torch.where(checkpoint, route_m, st.ms_last_m)
    zero = torch.zeros_like(st.ms_ego)
    st.ms_ego = torch.where(scored, zero, st.ms_ego) + torch.where(has_traffic, ego_speed, zero)
    st.ms_traffic = torch.where(scored, zero, st.ms_traffic) + torch.where(has_traffic, traffic_speed, zero)
    return infraction


def background_speed(speed: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Mean speed of every valid background vehicle ([B, N] -> [B]; no radius, as the Leaderboard) and whether any
    exists."""
    n = valid.sum(1)
    return torch.where(valid, speed, torch.zeros_like(speed)).sum(1) / n.clamp(min=1), n > 0

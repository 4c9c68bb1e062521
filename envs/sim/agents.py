"""Background actors: lane-following IDM vehicles, crosswalk pedestrians, static obstacles.

All functions act on whole batches ([B, N] tensors); nothing loops over environments or actors.
Vehicles live in lane coordinates (lane, arc position s) and are placed on the world by :func:`lane_pose`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from envs.maps.lanegraph import CONTROL_STOP
from envs.sim.config import SimConfig
from envs.sim.geometry import polyline_pose
from envs.sim.world import LightFn, World

# IDM parameters (textbook values, urban driving)
IDM_ACCEL, IDM_DECEL, IDM_GAP, IDM_HEADWAY = 2.0, 3.0, 2.0, 1.5
VEHICLE_SIZES = ((2.3, 1.0), (2.45, 1.05), (2.6, 1.1), (3.2, 1.2))  # half (length, width), m
PEDESTRIAN_HALF = 0.3
JUNCTION_SPEED = 6.0  # m/s cap on junction lanes (turns)
# Vehicle light state, a bitmask per vehicle (CARLA's VehicleLightState subset that CaRL's BEV draws).
LIGHT_BRAKE, LIGHT_LEFT_BLINKER, LIGHT_RIGHT_BLINKER, LIGHT_EMERGENCY = 1, 2, 4, 8
BRAKE_LIGHT_DECEL = 0.5  # m/s^2: IDM braking harder than this (or holding the car at a standstill) lights the brakes


def lane_pose(world: World, lane: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """World position and heading at arc length ``s`` on ``lane`` (any shape)."""
    return polyline_pose(world.lane_pts, lane, s / world.lane_spacing[lane], world.lane_pts.shape[1] - 2)


def idm_accel(v: Tensor, v0: Tensor, gap: Tensor, dv: Tensor) -> Tensor:
    """Intelligent Driver Model acceleration; ``gap`` = bumper distance to the obstacle, ``dv`` = v - v_obstacle."""
    s_star = IDM_GAP + v * IDM_HEADWAY + v * dv / (2 * math.sqrt(IDM_ACCEL * IDM_DECEL))
    free = 1.0 - (v / v0.clamp(min=0.1)) ** 4
    inter = (s_star.clamp(min=0.0) / gap.clamp(min=0.1)) ** 2
    return (IDM_ACCEL * (free - inter)).clamp(min=-8.0, max=IDM_ACCEL)


def corridor_gap(xy: Tensor, yaw: Tensor, half: Tensor, obs_xy: Tensor, obs_yaw: Tensor, obs_speed: Tensor,
                 obs_half: Tensor, obs_valid: Tensor, horizon: float = 40.0, ignore: Tensor | None = None
                 ) -> tuple[Tensor, Tensor]:
    """Nearest obstacle ahead inside a straight corridor of the actor's width.

    xy [B,M,2], yaw [B,M], half [B,M,2]; obstacles [B,N,...]; ``ignore`` [B,M,N] excludes pairs. Returns (gap [B,M],
    obstacle speed along the actor's heading [B,M]) — gap is ``horizon`` when the corridor is free (the speed then
    that of the first obstacle). Explicit components on broadcast [B,M,1] x [B,1,N] operands: no [B,M,N,2]
    temporaries, no trigonometry on [B,M,N], and nothing materialised to [B,M,N] first (on CPU, copying the 14
    operands cost more than the arithmetic on them: docs/simulator.md, "Broadcasts and reductions").
    """
    c, s = torch.cos(yaw).unsqueeze(2), torch.sin(yaw).unsqueeze(2)
    dx = obs_xy[..., 0].unsqueeze(1) - xy[..., 0].unsqueeze(2)
    dy = obs_xy[..., 1].unsqueeze(1) - xy[..., 1].unsqueeze(2)
    ahead = dx * c + dy * s
    side = dy * c - dx * s
    in_corr = (ahead > 0) & (side.abs() < half[..., 1].unsqueeze(2) + obs_half[..., 1].unsqueeze(1) + 0.3) & \
        obs_valid.unsqueeze(1) & (ahead < horizon)
    if ignore is not None:
        in_corr &= ~ignore
    gap = torch.where(in_corr, ahead - half[..., 0].unsqueeze(2) - obs_half[..., 0].unsqueeze(1),
                      torch.full_like(ahead, horizon))
    gmin, j = gap.min(-1)
    lead_yaw = torch.gather(obs_yaw, 1, j)  # the lead's heading difference only: [B,M], not [B,M,N]
    cos_rel = c.squeeze(2) * torch.cos(lead_yaw) + s.squeeze(2) * torch.sin(lead_yaw)
    return gmin, torch.gather(obs_speed, 1, j) * cos_rel


def corridor_gap_rows(xy: Tensor, yaw: Tensor, half: Tensor, obs_xy: Tensor, obs_yaw: Tensor, obs_speed: Tensor,
                      obs_half: Tensor, obs_valid: Tensor, horizon: float = 40.0) -> tuple[Tensor, Tensor]:
    """:func:`corridor_gap` (gap, obstacle speed) computed only on the rows with a valid obstacle: for obstacles
    that exist on few rows (the route scenarios' actors). The other rows get a free corridor (``horizon``, 0)."""
    gap, lead_v = torch.full_like(yaw, horizon), torch.zeros_like(yaw)
    rows = obs_valid.any(1).nonzero().squeeze(1)  # one host sync
    if len(rows):
        g, v = corridor_gap(xy[rows], yaw[rows], half[rows], obs_xy[rows], obs_yaw[rows], obs_speed[rows],
                            obs_half[rows], obs_valid[rows], horizon)
        gap[rows], lead_v[rows] = g, v
    return gap, lead_v


@dataclass
class Vehicles:
    lane: Tensor  # [B,A]
    s: Tensor
    speed: Tensor
    next_lane: Tensor
    valid: Tensor  # bool
    half: Tensor  # [B,A,2]
    v_factor: Tensor  # desired speed as a fraction of the limit
    stopped_at_sign: Tensor  # bool: has stopped at the stop sign ending its lane
    still_time: Tensor  # seconds at standstill
    xy: Tensor  # [B,A,2] derived pose, refreshed every step
    yaw: Tensor
    lights: Tensor  # [B,A] int32 bitmask of LIGHT_* (brake, blinkers, emergency)


def random_successor(world: World, lane: Tensor, gen: torch.Generator) -> Tensor:
    u = torch.rand(lane.shape, generator=gen, device=lane.device)
    k = (u * world.succ_count[lane]).long().clamp(max=(world.succ_count[lane] - 1).clamp(min=0))
    nxt = world.succ_idx[(world.succ_off[lane] + k).clamp(max=max(len(world.succ_idx) - 1, 0))]
    return torch.where(world.succ_count[lane] > 0, nxt, lane)


def sizes(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> Tensor:
    table = torch.tensor(VEHICLE_SIZES, device=device)
    k = torch.randint(len(VEHICLE_SIZES), shape, generator=gen, device=device)
    return table[k]


# Background vehicles the CARLA Leaderboard spawns per town (leaderboard RouteScenario's town amounts)
LEADERBOARD_VEHICLES = {"Town01": 120, "Town02": 100, "Town03": 120, "Town04": 200, "Town05": 120, "Town06": 150,
                        "Town07": 110, "Town08": 180, "Town09": 300, "Town10HD": 120}


def vehicles_per_map(world: World, num_vehicles: int, density: str) -> Tensor:
    """[M] vehicle slots in use around the ego on each map.

    ``"fixed"``: ``num_vehicles`` everywhere. ``"leaderboard"``: the town's Leaderboard count spread evenly over its
    lanes, times the lane length within ``LOCAL_RADIUS`` of the ego (``world.map_local_lane_km``), at most
    ``num_vehicles`` (the padded slots); maps the Leaderboard does not drive keep ``num_vehicles``.
    """
    n = torch.full((world.num_maps,), num_vehicles, dtype=torch.long, device=world.device)
    if density == "leaderboard":
        for k, name in enumerate(world.map_names):
            if name in LEADERBOARD_VEHICLES:
                local = LEADERBOARD_VEHICLES[name] / world.map_lane_km[k] * world.map_local_lane_km[k]
                n[k] = local.round().long().clamp(max=num_vehicles)
    return n


def spawn_vehicles(world: World, num_envs: int, num: int, ego_xy: Tensor, map_id: Tensor,
                   gen: torch.Generator) -> Vehicles:
    """Random vehicles on each row's whole map, none within 15 m of the ego or overlapping each other."""
    dev = world.device
    from envs.sim.world import sample_spawn  # local import keeps the public surface of world small

    lane, s = sample_spawn(world, (num_envs, num), gen, map_id)
    xy, yaw = lane_pose(world, lane, s)
    d = (xy.unsqueeze(2) - xy.unsqueeze(1)).norm(dim=-1)
    earlier = torch.ones(num, num, dtype=torch.bool, device=dev).tril(-1)
    clash = ((d < 10.0) & earlier).any(-1)
    valid = ~clash & ((xy - ego_xy.unsqueeze(1)).norm(dim=-1) > 15.0)
    return Vehicles(
        lane=lane, s=s, speed=world.lane_speed[lane] * 0.5, next_lane=random_successor(world, lane, gen), valid=valid,
        half=sizes((num_envs, num), gen, dev),
        v_factor=0.7 + 0.3 * torch.rand((num_envs, num), generator=gen, device=dev),
        stopped_at_sign=torch.zeros(num_envs, num, dtype=torch.bool, device=dev),
        still_time=torch.zeros(num_envs, num, device=dev), xy=xy, yaw=yaw,
        lights=torch.zeros(num_envs, num, dtype=torch.int32, device=dev))


def step_vehicles(world: World, veh: Vehicles, obstacles: tuple[Tensor, Tensor, Tensor, Tensor, Tensor],
                  lights: LightFn, cfg: SimConfig, gen: torch.Generator,
                  sparse: tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None = None) -> None:
    """IDM along lanes: follow the nearest obstacle in the corridor, stop for red/yellow lights and stop signs.

    ``obstacles`` = (xy, yaw, speed, half, valid) of everything else ([B, N]); the first ``A`` entries must be the
    vehicles themselves (they get the priority rule that prevents junction deadlocks). ``sparse``: more obstacles
    in the same form, valid on few rows (checked only there; no priority rule), as if appended to ``obstacles``.
    """
    A = veh.lane.shape[1]
    oxy, oyaw, ospeed, ohalf, ovalid = obstacles
    # Priority rule: a vehicle ignores crossing (heading differs by > 45 deg) vehicles with a higher index,
    # so waiting relations are acyclic and junctions cannot deadlock.
    N = oxy.shape[1]
    idx = torch.arange(N, device=oxy.device)
    higher = (idx.unsqueeze(0) > torch.arange(A, device=oxy.device).unsqueeze(1)) & (idx.unsqueeze(0) < A)  # [A,N]
    crossing = torch.cos(oyaw.unsqueeze(1) - veh.yaw.unsqueeze(2)) < math.cos(math.pi / 4)
    self_mask = torch.eye(A, N, dtype=torch.bool, device=oxy.device)
    ignore = (higher.unsqueeze(0) & crossing) | self_mask.unsqueeze(0)
    gap, lead_v = corridor_gap(veh.xy, veh.yaw, veh.half, oxy, oyaw, ospeed, ohalf, ovalid, ignore=ignore)
    if sparse is not None:
        gap2, lead2 = corridor_gap_rows(veh.xy, veh.yaw, veh.half, *sparse)
        nearer = gap2 < gap
        gap, lead_v = torch.where(nearer, gap2, gap), torch.where(nearer, lead2, lead_v)
    # traffic control at the end of the current lane
    stop = world.lane_stop[veh.lane]
    has_stop = stop >= 0
    stop_c = stop.clamp(min=0)
    to_line = world.lane_len[veh.lane] - veh.s - veh.half[..., 0]
    is_sign = has_stop & (world.stop_control[stop_c] == CONTROL_STOP)
    group = torch.where(has_stop & ~is_sign, world.stop_group[stop_c], torch.full_like(stop, -1))
    state, _ = lights(group)
    can_stop = to_line > veh.speed ** 2 / (2 * IDM_DECEL) - 0.5
    must_stop = ((state == 2) | ((state == 1) & can_stop)) | (is_sign & ~veh.stopped_at_sign)
    must_stop &= has_stop & (to_line > -1.0)
    gap = torch.where(must_stop, torch.minimum(gap, to_line.clamp(min=0.0) + 0.5), gap)
    lead_v = torch.where(must_stop & (to_line + 0.5 <= gap), torch.zeros_like(lead_v), lead_v)
    v0 = world.lane_speed[veh.lane] * veh.v_factor
    v0 = torch.where(world.lane_junction[veh.lane], v0.clamp(max=JUNCTION_SPEED), v0)
    acc = idm_accel(veh.speed, v0, gap, veh.speed - lead_v)
    speed = (veh.speed + acc * cfg.dt).clamp(min=0.0)
    braking = (acc < -BRAKE_LIGHT_DECEL) | (speed < 0.1)
    veh.lights = torch.where(braking, veh.lights | LIGHT_BRAKE, veh.lights & ~LIGHT_BRAKE)
    veh.stopped_at_sign |= is_sign & (speed < 0.1) & (to_line < 3.0)
    veh.still_time = torch.where(speed < 0.1, veh.still_time + cfg.dt, torch.zeros_like(veh.still_time))
    s = veh.s + speed * cfg.dt
    over = s > world.lane_len[veh.lane]
    s = torch.where(over, s - world.lane_len[veh.lane], s)
    lane = torch.where(over, veh.next_lane, veh.lane)
    veh.next_lane = torch.where(over, random_successor(world, lane, gen), veh.next_lane)
    veh.stopped_at_sign &= ~over
    veh.lane, veh.s, veh.speed = lane, s, speed
    veh.xy, veh.yaw = lane_pose(world, lane, s)


def respawn_vehicles(world: World, veh: Vehicles, ego_xy: Tensor, route_id: Tensor, route_idx: Tensor,
                     gen: torch.Generator, far: float = 120.0, ahead: tuple[int, int] = (60, 150),
                     min_ego_dist: float = 40.0) -> None:
    """Move vehicles that are far from the ego, or stuck out of sight, onto the ego's route ahead."""
    B, A = veh.lane.shape
    dev = ego_xy.device
    dist = (veh.xy - ego_xy.unsqueeze(1)).norm(dim=-1)
    stale = ~veh.valid | (dist > far) | ((veh.still_time > 40.0) & (dist > 40.0))
    ahead = torch.randint(ahead[0], ahead[1], (B, A), generator=gen, device=dev)
    n = world.route_n[route_id].unsqueeze(1)
    k = torch.minimum(route_idx.unsqueeze(1) + ahead, n - 1)
    rid = route_id.unsqueeze(1).expand(B, A)
    lane = world.route_lane[rid, k]
    s = world.route_s[rid, k]
    # keep a few slots on other lanes so traffic also comes from the sides: 30 % of the stale slots use the map
    from envs.sim.world import sample_spawn

    lane2, s2 = sample_spawn(world, (B, A), gen, world.route_map[route_id])
    use_map = torch.rand((B, A), generator=gen, device=dev) < 0.3
    lane = torch.where(use_map, lane2, lane)
    s = torch.where(use_map, s2, s)
    xy, _ = lane_pose(world, lane, s)
    # every new place, wherever it came from, clear of the other vehicles and of the ego (map places: within ``far``)
    others = torch.where(stale.unsqueeze(-1), torch.full_like(veh.xy, 1e6), veh.xy)
    d = (xy.unsqueeze(2) - others.unsqueeze(1)).norm(dim=-1).min(-1).values
    dup = (xy.unsqueeze(2) - xy.unsqueeze(1)).norm(dim=-1) < 10.0
    dup &= torch.ones(A, A, dtype=torch.bool, device=dev).tril(-1)
    ego_d = (xy - ego_xy.unsqueeze(1)).norm(dim=-1)
    ok = stale & (d > 10.0) & ~dup.any(-1) & (ego_d > min_ego_dist) & (~use_map | (ego_d < far))
    veh.lane = torch.where(ok, lane, veh.lane)
    veh.s = torch.where(ok, s, veh.s)
    veh.speed = torch.where(ok, world.lane_speed[lane] * 0.5, veh.speed)
    veh.next_lane = torch.where(ok, random_successor(world, lane, gen), veh.next_lane)
    veh.valid = torch.where(ok, torch.ones_like(veh.valid), veh.valid & ~stale)
    veh.still_time = torch.where(ok, torch.zeros_like(veh.still_time), veh.still_time)
    veh.stopped_at_sign &= ~ok
    veh.xy, veh.yaw = lane_pose(world, veh.lane, veh.s)


@dataclass
class Pedestrians:
    crosswalk: Tensor  # [B,P]
    progress: Tensor  # metres along the crossing
    direction: Tensor  # +1 / -1
    wait: Tensor  # seconds left before walking
    speed: Tensor  # walking speed when moving
    valid: Tensor
    xy: Tensor
    yaw: Tensor
    moving: Tensor  # bool


def crosswalk_axis(world: World, cw: Tensor) -> tuple[Tensor, Tensor]:
    """Start point and vector across the road for crosswalk quads: the long axis, between short-edge midpoints."""
    q = world.crosswalks[cw]  # [...,4,2]
    e01 = (q[..., 1, :] - q[..., 0, :]).norm(dim=-1)
    e12 = (q[..., 2, :] - q[..., 1, :]).norm(dim=-1)
    long01 = (e01 >= e12).unsqueeze(-1)
    # if edge 0-1 is long, the short edges are 1-2 and 3-0
    start = torch.where(long01, (q[..., 3, :] + q[..., 0, :]) / 2, (q[..., 0, :] + q[..., 1, :]) / 2)
    end = torch.where(long01, (q[..., 1, :] + q[..., 2, :]) / 2, (q[..., 2, :] + q[..., 3, :]) / 2)
    return start, end - start


def place_pedestrians(world: World, ped: Pedestrians) -> None:
    start, vec = crosswalk_axis(world, ped.crosswalk)
    length = vec.norm(dim=-1).clamp(min=1e-3)
    frac = (ped.progress / length).clamp(0.0, 1.0)
    frac = torch.where(ped.direction > 0, frac, 1.0 - frac)
    ped.xy = start + vec * frac.unsqueeze(-1)
    ped.yaw = torch.atan2(vec[..., 1], vec[..., 0]) + torch.where(ped.direction > 0, 0.0, math.pi)


def spawn_pedestrians(world: World, num_envs: int, num: int, near: Tensor, gen: torch.Generator) -> Pedestrians:
    """Pedestrians on the crosswalks nearest to ``near`` [B, P, 2] (points on the ego's route ahead)."""
    dev = world.device
    C = world.crosswalks.shape[0]
    if C == 0 or num == 0:
        z = lambda: torch.zeros(num_envs, num, device=dev)  # noqa: E731 - one tensor per field: fields are written
        return Pedestrians(z().long(), z(), z() + 1, z(), z(), z().bool(), torch.zeros(num_envs, num, 2, device=dev), z(),
                           z().bool())
    centres = world.crosswalks.mean(-2)  # [C,2]
    d = (near.unsqueeze(-2) - centres).norm(dim=-1)  # [B,P,C]
    cw = d.argmin(-1)
    valid = d.min(-1).values < 60.0
    ped = Pedestrians(
        crosswalk=cw, progress=torch.zeros(num_envs, num, device=dev),
        direction=torch.where(torch.rand((num_envs, num), generator=gen, device=dev) < 0.5, 1.0, -1.0),
        wait=torch.rand((num_envs, num), generator=gen, device=dev) * 15.0,
        speed=1.1 + 0.6 * torch.rand((num_envs, num), generator=gen, device=dev), valid=valid,
        xy=torch.zeros(num_envs, num, 2, device=dev), yaw=torch.zeros(num_envs, num, device=dev),
        moving=torch.zeros(num_envs, num, dtype=torch.bool, device=dev))
    place_pedestrians(world, ped)
    return ped


def step_pedestrians(world: World, ped: Pedestrians, dt: float, gen: torch.Generator) -> None:
    """Wait, cross, turn round at the far kerb and wait again."""
    if ped.crosswalk.numel() == 0 or world.crosswalks.shape[0] == 0:
        return
    _, vec = crosswalk_axis(world, ped.crosswalk)
    length = vec.norm(dim=-1)
    waiting = ped.wait > 0
    ped.wait = (ped.wait - dt).clamp(min=0.0)
    ped.moving = ~waiting
    ped.progress = torch.where(waiting, ped.progress, ped.progress + ped.speed * dt)
    arrived = ped.progress >= length
    ped.direction = torch.where(arrived, -ped.direction, ped.direction)
    ped.progress = torch.where(arrived, torch.zeros_like(ped.progress), ped.progress)
    new_wait = 5.0 + 20.0 * torch.rand(ped.wait.shape, generator=gen, device=ped.wait.device)
    ped.wait = torch.where(arrived, new_wait, ped.wait)
    place_pedestrians(world, ped)


@dataclass
class Statics:
    xy: Tensor  # [B,O,2]
    yaw: Tensor
    half: Tensor
    valid: Tensor


def roadside_points(world: World, route_id: Tensor, idx: Tensor, gen: torch.Generator, half_width: Tensor
                    ) -> tuple[Tensor, Tensor]:
    """Points beside the route's lane at route indices ``idx`` [B, O]: on the right edge, just off the lane."""
    rid = route_id.unsqueeze(1).expand_as(idx)
    lane = world.route_lane[rid, idx]
    xy, yaw = lane_pose(world, lane, world.route_s[rid, idx])
    offset = world.lane_width[lane] / 2 + half_width + 0.4
    right = torch.stack((torch.sin(yaw), -torch.cos(yaw)), -1)
    return xy + right * offset.unsqueeze(-1), yaw


def spawn_statics(world: World, route_id: Tensor, route_idx: Tensor, num: int, gen: torch.Generator) -> Statics:
    """Parked obstacles at the kerb of the route ahead (only where the route's lane is the rightmost one)."""
    B = route_id.shape[0]
    dev = route_id.device
    half = sizes((B, num), gen, dev)
    ahead = torch.randint(30, 300, (B, num), generator=gen, device=dev)
    n = world.route_n[route_id].unsqueeze(1)
    idx = torch.minimum(route_idx.unsqueeze(1) + ahead, n - 1)
    xy, yaw = roadside_points(world, route_id, idx, gen, half[..., 1])
    rid = route_id.unsqueeze(1).expand_as(idx)
    junction = world.route_junction[rid, idx]
    kerb = world.lane_kerb[world.route_lane[rid, idx]]  # never in a lane to the right of the route's
    valid = (idx < n - 1) & ~junction & kerb
    return Statics(xy, yaw, half, valid)

"""The simulator's data: the batched episode state every stage reads and writes, and the fixed setup parts get.

Waymax's split: datatypes here, the stages that change them in :mod:`envs.sim.rules` (and the parts of
:mod:`envs.sim.parts`), the order of the step in :mod:`envs.sim.env`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import torch
from torch import Tensor

from envs.reward import RewardState
from envs.sim.agents import PEDESTRIAN_HALF, Pedestrians, Statics, Vehicles
from envs.sim.config import SimConfig
from envs.sim.criteria import CriteriaState
from envs.sim.scenario_world import FLOW_SLOTS, NUM_GROUPS, VEHICLE_GROUPS
from envs.sim.world import World

@dataclass
class ScenarioState:
    """Each row's route scenarios ([B, K]: the route's scenarios in route order) and the actors of its slot groups
    ([B, G, F]); see :mod:`envs.sim.scenarios`."""

    scn: Tensor  # [B,K] long: row of the world's scenario tables (the inert padding row where the route has fewer)
    status: Tensor  # [B,K] long: 0 pending, 1 live, 2 done
    t_act: Tensor  # [B,K] s: activation time
    act_m: Tensor  # [B,K] route metres at activation
    fin_m: Tensor  # [B,K] route metres when its actors finished (inf: not yet)
    moving: Tensor  # [B,K] bool: its actor has started to move
    collided: Tensor  # [B,K] bool: the ego collided while it was live, or hit its actor
    hit: Tensor  # [B,K] bool: the ego hit one of its actors (the rules removed it): the actors react (scenarios.md)
    timed_out: Tensor  # [B,K] bool
    preempted: Tensor  # [B,K] bool: ended because a later one of its slot group activated
    patch: Tensor  # [B,K] long: ControlLoss's next debris patch (3: none left)
    near: Tensor  # [B,K] bool: the ego is within the patch's radius
    signs: Tensor  # [B,K,3,2] ControlLoss's noise sign per patch (steer, throttle)
    owner: Tensor  # [B,G] long: the scenario (K index; K = none) whose actors the slot group shows
    act_s: Tensor  # [B,G,F] m along the path
    act_v: Tensor  # [B,G,F] m/s
    act_alive: Tensor  # [B,G,F] bool
    act_half: Tensor  # [B,G,F,2]
    next_gap: Tensor  # [B,G] m: the flow's next car spawns when the last one is this far from the source
    prev_collisions: Tensor  # [B] long: the ego's collisions counted before this step
    timeouts: Tensor  # [B] long: scenario timeouts this episode (each x0.7 under Leaderboard scoring)


@dataclass
class SimState:
    """Everything that changes during an episode, batched over environments. A backend whose parts keep per-row
    state of their own extends it (e.g. :class:`envs.nuplan.logs.NuplanState`)."""

    ego_xy: Tensor  # [B,2]
    ego_yaw: Tensor
    ego_speed: Tensor
    ego_vel_local: Tensor  # [B,2] velocity in the ego frame (forward, left), m/s
    gear: Tensor  # [B] float
    last_action: Tensor  # [B,3] steer, throttle, brake
    route_id: Tensor
    route_idx: Tensor
    rc: Tensor  # route completion %, 2 decimals
    t: Tensor  # seconds since episode start
    steps: Tensor
    still_time: Tensor  # seconds below the blocked speed
    light_offset: Tensor  # [B,J]
    stop_done: Tensor  # the next stop sign on the route has been obeyed
    hist_speed: Tensor  # [B,HISTORY]
    hist_yaw: Tensor
    veh: Vehicles
    ped: Pedestrians
    statics: Statics
    reward_state: RewardState
    ep_return: Tensor
    counts: Tensor  # [B, len(INFRACTIONS)] int
    outside_m: Tensor  # metres of route progress made outside the lanes
    prev_soft: Tensor  # [B,4] bool: speeding, ttc, comfort, outside last step (to count events on rising edges)
    crit: CriteriaState
    scn: ScenarioState


@dataclass
class Setup:
    """What a part may read besides the state, fixed when the env is built: its world, config, batch, device and
    random stream, the actor slot counts (at least one each: empty groups keep their shape) and the ego's extent."""

    cfg: SimConfig
    world: World
    num_envs: int
    device: torch.device
    gen: torch.Generator
    num_vehicles: int
    num_pedestrians: int
    num_statics: int
    ego_half: Tensor  # [B, 2] half length, half width
    scenario_slots: tuple[int, int, int] = (0, 0, 0)  # the last vehicle, pedestrian and static slots scenarios own

    @property
    def background_vehicles(self) -> int:
        """Vehicle slots of the background traffic: the ones before the scenario vehicles' slots."""
        return self.num_vehicles - self.scenario_slots[0]

    @classmethod
    def build(cls, cfg: SimConfig, world: World, num_envs: int, device: torch.device, gen: torch.Generator
              ) -> Setup:
        extra = ((FLOW_SLOTS + len(VEHICLE_GROUPS) - 1, NUM_GROUPS - len(VEHICLE_GROUPS),
                  NUM_GROUPS - len(VEHICLE_GROUPS)) if world.has_scenarios else (0, 0, 0))
        return cls(cfg, world, num_envs, device, gen, max(1, cfg.num_vehicles) + extra[0],
                   max(1, cfg.num_pedestrians) + extra[1], max(1, cfg.num_statics) + extra[2],
                   torch.tensor(cfg.ego_half_extent, device=device).expand(num_envs, 2), extra)


def assign_rows(state, rows: Tensor, fresh) -> None:
    """Write ``fresh`` (a state tree for ``len(rows)`` environments) into rows ``rows`` of ``state``, in place."""
    for f in dataclasses.fields(state):
        old, new = getattr(state, f.name), getattr(fresh, f.name)
        if dataclasses.is_dataclass(old):
            assign_rows(old, rows, new)
        else:
            old[rows] = new


def obstacles(s: SimState, ego_half: Tensor, include_ego: bool, include_statics: bool = True,
              vehicles: slice = slice(None), pedestrians: slice = slice(None)) -> tuple[Tensor, ...]:
    """All actors (or the ``vehicles`` and ``pedestrians`` slots given) as padded obstacle tensors (xy, yaw, speed,
    half, valid): vehicles first, then (the ego,) pedestrians, (statics)."""
    v, p = vehicles, pedestrians
    p_half = torch.full_like(s.ped.xy[:, p], PEDESTRIAN_HALF)
    p_speed = torch.where(s.ped.moving[:, p], s.ped.speed[:, p], 0.0)
    groups = [(s.veh.xy[:, v], s.veh.yaw[:, v], s.veh.speed[:, v], s.veh.half[:, v], s.veh.valid[:, v])]
    if include_ego:
        groups.append((s.ego_xy.unsqueeze(1), s.ego_yaw.unsqueeze(1), s.ego_speed.unsqueeze(1),
                       ego_half.unsqueeze(1), torch.ones_like(s.ego_speed, dtype=torch.bool).unsqueeze(1)))
    groups.append((s.ped.xy[:, p], s.ped.yaw[:, p], p_speed, p_half, s.ped.valid[:, p]))
    if include_statics:
        groups.append((s.statics.xy, s.statics.yaw, torch.zeros_like(s.statics.yaw), s.statics.half,
                       s.statics.valid))
    return tuple(torch.cat(x, 1) for x in zip(*groups))

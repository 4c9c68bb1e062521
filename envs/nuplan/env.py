"""The nuPlan environment: the simulator core in log-replay mode, batched across cached scenarios.

``NuplanEnv`` is the core (:class:`~envs.sim.env.SimEnv`) holding the scenarios' logs, assembled from nuPlan's parts
(:mod:`envs.sim.parts`):

* :class:`LogStarts`: a scenario per environment (random for training, fixed order for evaluation), the ego at its
  logged start pose, speed and acceleration;
* :class:`~envs.nuplan.dynamics.NuplanBicycle`: nuPlan's kinematic bicycle model (rear-axle reference, first-order
  lags of 0.2 s on acceleration and 0.05 s on steering) driven by CaRL's nuPlan action mapping
  (``carl-reference.md`` §16);
* :class:`LogReplay`: agents replayed from the log (non-reactive), or vehicles driven by the shared lane-following
  IDM from their logged start (reactive; pedestrians and static objects stay replayed);
* :class:`LoggedLights`: the logged traffic-light states, written into the simulator's light model;
* :class:`NuplanMetrics`: the scenario of every episode and, with ``score``, nuPlan's closed-loop score.

Observation, infractions and reward are the shared ones. Every cached scenario's map patch is laid out on one
grid (each in its own cell) so one ``World`` holds them all and the step stays a fixed sequence of tensor ops.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from envs.maps.lanegraph import LaneGraph
from envs.nuplan.cache import REAR_AXLE_TO_CENTRE, CachedScenario, build_cache, list_cache, load
from envs.routes import Route
from envs.sim import agents
from envs.sim.agents import Pedestrians, Statics, Vehicles
from envs.nuplan.config import NuplanOptions
from envs.config import ConfigError, from_dict
from envs.sim.config import SimConfig
from envs.nuplan.dynamics import EGO_HALF, WHEELBASE, NuplanBicycle
from envs.sim.env import SimEnv, SimState
from envs.sim.geometry import wrap_angle
from envs.sim.infractions import HISTORY
from envs.sim.parts import ActorSource, LightCycle, StartSource, StepHook
from envs.sim.world import build_world, lane_lookup
from envs.sim.geometry import boxes_overlap
from envs.sim.infractions import HARD
from envs.metrics import nuplan as M

# light model: a 3 s cycle per light group; the logged state picks the time inside it
LIGHT_PHASE = (1.0, 1.0, 1.0)  # green, yellow, all-red
LIGHT_REL = (0.5, 1.5, 2.5, 0.5)  # green, yellow, red, unknown (shown as green)
VEHICLE_TYPES, PEDESTRIAN_TYPES = (0, 2), (1,)
IDM_TARGET_SPEED = 10.0  # m/s, nuPlan IDMAgents
GRID_MARGIN = 100.0  # m between scenario map patches
NO_SPEED_LIMIT = 1e3  # m/s: off the lanes there is no speed limit to break
OFF_LANE_M = 10.0  # corner distance to the drivable area when the corner is on no lane at all
TTC_NEAREST_NUPLAN = 8  # actors considered per step by the nuPlan TTC check (nearest valid ones)
TRACE_KEYS = ("speed", "yaw", "accel", "limit", "lane_prog", "outside", "multi_lane", "junction", "ttc")
NUPLAN_COMPONENTS = M.MULTIPLIERS + tuple(M.WEIGHTS)


@dataclass
class NuplanState(SimState):
    """SimState plus the log-replay and bicycle-model state (set by the parts when an episode starts)."""

    scenario: Tensor = None  # [B] index into the env's scenarios
    ego_accel: Tensor = None  # [B] rear-axle longitudinal acceleration (lagged)
    ego_steer: Tensor = None  # [B] tire steering angle


def merge_graphs(graphs: list[LaneGraph], shifts: np.ndarray, name: str) -> tuple[LaneGraph, np.ndarray, np.ndarray]:
    """Concatenate lane graphs translated by ``shifts`` [S, 2]; returns (graph, lane offset and junction offset of
    every input)."""
    merged = LaneGraph.concatenate(name, [g.translated(s) for g, s in zip(graphs, shifts)],
                                   meta={"source": "nuplan", "scenarios": len(graphs)})
    lane_off = np.cumsum([0] + [g.num_lanes for g in graphs])[:-1]
    junc_off = np.cumsum([0] + [g.num_junctions() for g in graphs])[:-1]
    return merged, lane_off, junc_off


def grid_shifts(graphs: list[LaneGraph]) -> np.ndarray:
    """Translations [S, 2] that put every scenario's patch in its own cell of a square grid."""
    b = np.array([g.bounds(0.0) for g in graphs])
    cell = float(max((b[:, 2] - b[:, 0]).max(), (b[:, 3] - b[:, 1]).max())) + GRID_MARGIN
    cols = int(math.ceil(math.sqrt(len(graphs))))
    k = np.arange(len(graphs))
    centre = np.stack([(b[:, 0] + b[:, 2]) / 2, (b[:, 1] + b[:, 3]) / 2], -1)
    return np.stack([(k % cols) * cell, (k // cols) * cell], -1) - centre


def _pad_stack(arrays: list[np.ndarray], n: int, t: int) -> np.ndarray:
    """Stack [T_i, N_i, ...] arrays into [S, t, n, ...] (time padded by repeating the last frame)."""
    out = np.zeros((len(arrays), t, n) + arrays[0].shape[2:], arrays[0].dtype)
    for k, a in enumerate(arrays):
        a = np.concatenate([a, np.repeat(a[-1:], t - len(a), 0)]) if len(a) < t else a[:t]
        out[k, :, : a.shape[1]] = a
    return out


def box_corners_t(xy: Tensor, yaw: Tensor, half: Tensor) -> Tensor:
    """Corners [..., 4, 2] (front-left, front-right, rear-right, rear-left) of oriented boxes (torch)."""
    f = torch.stack((torch.cos(yaw), torch.sin(yaw)), -1)
    l = torch.stack((-torch.sin(yaw), torch.cos(yaw)), -1)
    f, l = f * half[..., :1], l * half[..., 1:2]
    return torch.stack((xy + f + l, xy + f - l, xy - f - l, xy - f + l), -2)


def nuplan_ttc_violation(ego_xy: Tensor, ego_yaw: Tensor, ego_speed: Tensor, ego_half: Tensor, junction: Tensor,
                         xy: Tensor, yaw: Tensor, speed: Tensor, half: Tensor, valid: Tensor) -> Tensor:
    """nuPlan's time-to-collision check for one step, batched [B]: True when the TTC is at most 0.95 s.

    Ego and actors move at constant speed and heading in 0.1 s steps (only steps up to the 0.95 s bound matter);
    relevant actors are ahead (within 30° of the ego heading) or, in an intersection, not behind (150°); actors
    already overlapping the ego are excluded; a stopped ego (<= 0.005 m/s) has no TTC."""
    rel = xy - ego_xy.unsqueeze(1)
    ang = wrap_angle(torch.atan2(rel[..., 1], rel[..., 0]) - ego_yaw.unsqueeze(1)).abs()
    relevant = valid & ((ang < M.TTC_AHEAD_ANGLE) | (junction.unsqueeze(1) & (ang < M.REAR_ANGLE)))
    now = boxes_overlap(ego_xy.unsqueeze(1), ego_yaw.unsqueeze(1), ego_half.unsqueeze(1), xy, yaw, half)
    relevant = relevant & ~now
    if xy.shape[1] > TTC_NEAREST_NUPLAN:
        dist = torch.where(relevant, rel.norm(dim=-1), torch.full_like(speed, 1e9))
        near = dist.topk(TTC_NEAREST_NUPLAN, dim=1, largest=False).indices
        xy = xy.gather(1, near.unsqueeze(-1).expand(-1, -1, 2))
        half = half.gather(1, near.unsqueeze(-1).expand(-1, -1, 2))
        yaw, speed, relevant = yaw.gather(1, near), speed.gather(1, near), relevant.gather(1, near)
    n = int(M.TTC_THRESHOLD / M.TTC_STEP + 1e-6)
    tt = torch.arange(1, n + 1, device=ego_xy.device, dtype=ego_xy.dtype) * M.TTC_STEP  # [K]
    ed = torch.stack((torch.cos(ego_yaw), torch.sin(ego_yaw)), -1) * ego_speed.unsqueeze(-1)
    od = torch.stack((torch.cos(yaw), torch.sin(yaw)), -1) * speed.unsqueeze(-1)
    ego_f = ego_xy[:, None, None] + ed[:, None, None] * tt[None, None, :, None]  # [B,1,K,2]
    oth_f = xy[:, :, None] + od[:, :, None] * tt[None, None, :, None]  # [B,N,K,2]
    hit = boxes_overlap(ego_f, ego_yaw[:, None, None], ego_half[:, None, None], oth_f, yaw[..., None],
                        half[:, :, None])
    return (hit.any(-1) & relevant).any(-1) & (ego_speed > M.TTC_STOPPED_SPEED)


class NuplanEnv(SimEnv):
    """Closed-loop simulation of cached nuPlan scenarios (see the module docstring): the core with nuPlan's parts
    and the scenarios' logs (``log_*`` tensors in the world frame, read by the parts)."""

    def __init__(self, scenarios: list[CachedScenario], opts: NuplanOptions, num_envs: int,
                 device: str | torch.device = "cpu", seed: int = 0):
        if not scenarios:
            raise ConfigError("env=nuplan: no scenarios to simulate; check env.options.cache_dir and the filters")
        self.opts = opts
        self.scenarios = scenarios  # the cached scenarios, in route (scenario index) order
        dev = torch.device(device)
        graphs = [sc.graph for sc in scenarios]
        shifts = grid_shifts(graphs)
        graph, lane_off, junc_off = merge_graphs(graphs, shifts, f"nuplan_{len(scenarios)}")
        routes = [Route(sc.token, sc.route.points + shifts[k].astype(np.float32), sc.route.lanes + lane_off[k])
                  for k, sc in enumerate(scenarios)]
        T = min(sc.num_frames for sc in scenarios)
        self.num_frames = max(sc.num_frames for sc in scenarios)
        kinds = [np.isin(sc.agent_types, VEHICLE_TYPES) for sc in scenarios]
        peds = [np.isin(sc.agent_types, PEDESTRIAN_TYPES) for sc in scenarios]
        n_veh = max(1, max(int(k.sum()) for k in kinds))
        n_ped = max(1, max(int(p.sum()) for p in peds))
        n_st = max(1, max(int((~k & ~p).sum()) for k, p in zip(kinds, peds)))
        sim = {"map": "nuplan", "dt": 0.1, "wheelbase": WHEELBASE, "ego_half_extent": EGO_HALF,
               "max_time": (T - 2) * 0.1 - 0.05, "num_vehicles": n_veh, "num_pedestrians": n_ped,
               "num_statics": n_st, "route_split": opts.route_split, "light_green": LIGHT_PHASE[0],
               "light_yellow": LIGHT_PHASE[1], "light_all_red": LIGHT_PHASE[2], "map_ppm": 2.0,
               "cache_dir": str(Path(opts.cache_dir) / "_rasters"), "reward": {"terminal_penalty": 0.0}}
        for k, v in opts.sim.items():
            sim[k] = {**sim.get(k, {}), **v} if isinstance(v, dict) and isinstance(sim.get(k), dict) else v
        cfg = from_dict(SimConfig, sim, "env.options.sim").validate()
        world = build_world(graph, routes, cfg, dev)
        super().__init__(cfg, num_envs, dev, seed, world=world, starts=LogStarts(), ego=NuplanBicycle(),
                         actors=LogReplay(opts.reactive), lights=LoggedLights(), hooks=(NuplanMetrics(opts.score),),
                         state_type=NuplanState, check_stop_lines=opts.red_light)
        # log tensors, world frame: [S, T, N, 7] = x, y, heading, length, width, vx, vy
        t_pad = self.num_frames
        f32 = lambda a: torch.as_tensor(a, dtype=torch.float32, device=dev)  # noqa: E731

        def part(masks: list[np.ndarray], n: int) -> tuple[Tensor, Tensor]:
            arr, val = [], []
            for sc, m, s in zip(scenarios, masks, shifts):
                a = sc.agents[:, m].copy()
                a[..., :2] += s
                arr.append(a)
                val.append(sc.agent_valid[:, m])
            return f32(_pad_stack(arr, n, t_pad)), torch.as_tensor(_pad_stack(val, n, t_pad), device=dev)

        self.log_veh, self.log_veh_valid = part(kinds, n_veh)
        self.log_ped, self.log_ped_valid = part(peds, n_ped)
        self.log_st, self.log_st_valid = part([~k & ~p for k, p in zip(kinds, peds)], n_st)
        ego = []
        for sc, s in zip(scenarios, shifts):
            e = sc.ego.copy()
            e[:, :2] += s
            ego.append(e[:, None])
        self.log_ego = f32(_pad_stack(ego, 1, t_pad)[:, :, 0])  # [S, T, 7]
        g_max = max(sc.lights.shape[1] for sc in scenarios)
        lights = np.full((len(scenarios), t_pad, g_max), 3, np.int64)
        junc = np.full((len(scenarios), g_max), world.num_junctions, np.int64)  # padding -> a spare column
        for k, sc in enumerate(scenarios):
            ng = len(sc.graph.light_junction)
            lights[k, :, :sc.lights.shape[1]] = _pad_stack([sc.lights[:, None, :]], 1, t_pad)[0, :, 0]
            junc[k, :ng] = sc.graph.light_junction + junc_off[k]
        self.log_lights = torch.as_tensor(lights, device=dev)
        self.light_junc = torch.as_tensor(junc, device=dev)
        self.light_rel = torch.tensor(LIGHT_REL, device=dev)
        self.scenario_tokens = [sc.token for sc in scenarios]
        self.scenario_types = [sc.scenario_type for sc in scenarios]
        # expert progress per scenario: the logged rear-axle path length over the simulated horizon (T - 2 steps)
        self.expert_progress = np.array([
            float(np.linalg.norm(np.diff(sc.ego[: max(sc.num_frames - 1, 1), :2], axis=0), axis=-1).sum())
            for sc in scenarios])

    @property
    def options(self) -> NuplanOptions:
        return self.opts

    # ------------------------------------------------------------------ log access
    def _frame(self, frame: Tensor) -> Tensor:
        return frame.clamp(max=self.num_frames - 1)

    def logged_vehicles(self, scenario: Tensor, frame: Tensor) -> Vehicles:
        """The logged vehicles of ``scenario`` [B] at ``frame`` [B] (the last frame beyond the log's end)."""
        f = self._frame(frame)
        a, v = self.log_veh[scenario, f], self.log_veh_valid[scenario, f]
        z = torch.zeros_like(a[..., 0])
        return Vehicles(lane=z.long(), s=z.clone(), speed=a[..., 5:7].norm(dim=-1), next_lane=z.long(), valid=v,
                        half=a[..., 3:5] / 2, v_factor=torch.ones_like(z), stopped_at_sign=torch.zeros_like(v),
                        still_time=z.clone(), xy=a[..., :2].contiguous(), yaw=a[..., 2].contiguous(),
                        lights=torch.zeros_like(z, dtype=torch.int32))

    def logged_pedestrians(self, scenario: Tensor, frame: Tensor) -> Pedestrians:
        f = self._frame(frame)
        a, v = self.log_ped[scenario, f], self.log_ped_valid[scenario, f]
        z = torch.zeros_like(a[..., 0])
        speed = a[..., 5:7].norm(dim=-1)
        return Pedestrians(crosswalk=z.long(), progress=z.clone(), direction=torch.ones_like(z), wait=z.clone(),
                           speed=speed, valid=v, xy=a[..., :2].contiguous(), yaw=a[..., 2].contiguous(),
                           moving=speed > 0.2)

    def logged_statics(self, scenario: Tensor, frame: Tensor) -> Statics:
        f = self._frame(frame)
        a = self.log_st[scenario, f]
        return Statics(xy=a[..., :2].contiguous(), yaw=a[..., 2].contiguous(), half=a[..., 3:5] / 2,
                       valid=self.log_st_valid[scenario, f])

    def light_offsets(self, scenario: Tensor, frame: Tensor, t: Tensor, out: Tensor) -> Tensor:
        """Per-junction cycle offsets that make every light group show its logged state at time ``t``."""
        state = self.log_lights[scenario, self._frame(frame)]  # [B, G]
        cycle = sum(LIGHT_PHASE)
        val = torch.remainder(self.light_rel[state] - t.unsqueeze(-1), cycle)
        return out.scatter(1, self.light_junc[scenario], val)


# ---------------------------------------------------------------------------------------------- nuPlan's parts
class LogStarts(StartSource):
    """A scenario per fresh episode (random for training, the fixed assignment for evaluation); the ego at the
    scenario's first logged pose, speed and acceleration."""

    env: NuplanEnv

    def pick(self, rows: Tensor) -> Tensor:
        env = self.env
        if env.opts.route_split == "eval":
            return env.next_route[rows]
        return torch.randint(len(env.scenarios), (len(rows),), generator=env.gen, device=env.device)

    def place(self, s: NuplanState, rows: Tensor) -> None:
        e = self.env.log_ego[s.route_id, 0]
        yaw = e[:, 2]
        speed = e[:, 3].clamp(min=0.0)
        s.scenario = s.route_id.clone()  # one route per scenario
        s.ego_xy = e[:, :2] + REAR_AXLE_TO_CENTRE * torch.stack((torch.cos(yaw), torch.sin(yaw)), -1)
        s.ego_yaw, s.ego_speed, s.ego_accel = yaw, speed, e[:, 5].clone()
        s.ego_vel_local = torch.stack((speed, torch.zeros_like(speed)), -1)
        s.hist_speed, s.hist_yaw = e[:, 3:4].repeat(1, HISTORY), yaw.unsqueeze(1).repeat(1, HISTORY)


class LogReplay(ActorSource):
    """Agents replayed from the log frame by frame; ``reactive``: vehicles driven by the shared lane-following IDM
    from their logged start instead (pedestrians and static objects stay replayed). Nothing re-spawns."""

    env: NuplanEnv

    def __init__(self, reactive: bool = False):
        self.reactive = reactive

    def reset(self, s: NuplanState, rows: Tensor) -> None:
        env, frame = self.env, s.steps  # 0: the first logged frame
        veh = env.logged_vehicles(s.scenario, frame)
        if self.reactive:
            self._snap_to_lanes(veh)
        s.veh, s.ped, s.statics = veh, env.logged_pedestrians(s.scenario, frame), env.logged_statics(s.scenario, frame)

    def step(self, s: NuplanState) -> None:
        env = self.env
        frame = s.steps + 1
        if self.reactive:
            agents.step_vehicles(env.world, s.veh, env.obstacles(s, include_ego=True),
                                 lambda g: env.lights.state(s, g), env.cfg, env.gen)
        else:
            s.veh = env.logged_vehicles(s.scenario, frame)
        s.ped = env.logged_pedestrians(s.scenario, frame)
        s.statics = env.logged_statics(s.scenario, frame)

    def _snap_to_lanes(self, veh: Vehicles) -> None:
        """Put logged vehicles on their nearest lane (lane, arc position) to drive them with IDM."""
        w = self.env.world
        lane, lateral, lane_yaw, found, _ = lane_lookup(w, veh.xy)
        pts = w.lane_pts[lane]  # [B, N, P, 2]
        s = (pts - veh.xy.unsqueeze(-2)).norm(dim=-1).argmin(-1).float() * w.lane_spacing[lane]
        aligned = torch.cos(wrap_angle(veh.yaw - lane_yaw)) > 0.5
        veh.lane, veh.s = lane, s
        veh.valid = veh.valid & found & aligned
        veh.v_factor = (IDM_TARGET_SPEED / w.lane_speed[lane].clamp(min=1.0)).clamp(0.3, 1.5)
        veh.next_lane = agents.random_successor(w, lane, self.env.gen)
        veh.xy, veh.yaw = agents.lane_pose(w, lane, s)


class LoggedLights(LightCycle):
    """The logged light states, written into the simulator's light model (a short cycle whose per-junction offsets
    show every group's logged state at the current time)."""

    env: NuplanEnv

    def reset(self, s: NuplanState, rows: Tensor) -> None:
        out = torch.zeros(len(rows), self.env.world.num_junctions + 1, device=self.env.device)
        s.light_offset = self.env.light_offsets(s.scenario, s.steps, s.t, out)

    def step(self, s: NuplanState) -> None:
        s.light_offset = self.env.light_offsets(s.scenario, s.steps, s.t, s.light_offset)


class NuplanMetrics(StepHook):
    """``episode/scenario`` of every episode; with ``score``, nuPlan's closed-loop score of finished episodes
    (``episode/nuplan_score``, ``episode/nuplan/<metric>``) from a per-step trace of the metrics' inputs."""

    env: NuplanEnv

    def __init__(self, score: bool = True):
        self.score = score

    def bind(self, env: NuplanEnv) -> None:
        super().bind(env)
        # per-step trace for nuPlan's metrics: a ring buffer [B, L] per signal, written at column (steps - 1) % L
        self.trace_len = env.num_frames + 2
        self.trace = {k: torch.zeros(env.num_envs, self.trace_len, device=env.device,
                                     dtype=torch.bool if k in ("multi_lane", "junction", "ttc") else torch.float32)
                      for k in TRACE_KEYS}
        self._rows = torch.arange(env.num_envs, device=env.device)

    def episode_info(self, s: NuplanState, done: Tensor, ending: Tensor, truncated: Tensor) -> dict[str, Tensor]:
        info = {"episode/scenario": s.scenario.float()}
        if self.score:
            self._record_trace(s)
            info.update(self._nuplan_scores(s, done, ending))
        return info

    def _record_trace(self, s: NuplanState) -> None:
        """Write this step's metric inputs into the ring buffers (batched tensor ops, no host sync)."""
        env = self.env
        w, dt = env.world, env.cfg.dt
        lane, _, lane_yaw, found, _ = lane_lookup(w, s.ego_xy)
        corners = box_corners_t(s.ego_xy, s.ego_yaw, env.ego_half)  # [B, 4, 2]
        c_lane, c_lat, _, c_found, c_width = lane_lookup(w, corners)
        c_out = torch.where(c_found, (c_lat.abs() - c_width / 2).clamp(min=0.0),
                            torch.full_like(c_lat, OFF_LANE_M))
        junction = w.lane_junction[lane] & found
        a_xy, a_yaw, a_speed, a_half, a_valid = env.obstacles(s, include_ego=False)
        values = {
            "speed": s.ego_speed, "yaw": s.ego_yaw, "accel": s.ego_accel,
            "limit": torch.where(found, w.lane_speed[lane], torch.full_like(s.ego_speed, NO_SPEED_LIMIT)),
            # progress along the current lane's baseline this step (negative = against the lane direction)
            "lane_prog": torch.where(found, s.ego_speed * dt * torch.cos(s.ego_yaw - lane_yaw),
                                     torch.zeros_like(s.ego_speed)),
            "outside": c_out.max(-1).values,
            "multi_lane": (~c_found | (c_lane != lane.unsqueeze(-1))).any(-1),
            "junction": junction,
            "ttc": nuplan_ttc_violation(s.ego_xy, s.ego_yaw, s.ego_speed, env.ego_half, junction, a_xy, a_yaw,
                                        a_speed, a_half, a_valid),
        }
        col = (s.steps - 1).clamp(min=0) % self.trace_len
        for k, v in values.items():
            self.trace[k][self._rows, col] = v

    def _at_fault_collisions(self, s: NuplanState, row: int, multi_lane: bool) -> dict[str, int]:
        """nuPlan's at-fault collisions of the final step of ``row`` (the episode ends at the first collision):
        counts per class {vru, vehicle, object}."""
        counts = {"vru": 0, "vehicle": 0, "object": 0}
        ego_xy, ego_yaw = s.ego_xy[row], s.ego_yaw[row]
        ego_half, ego_speed = self.env.ego_half[row], float(s.ego_speed[row])
        classes = (("vehicle", s.veh.xy, s.veh.yaw, s.veh.half, s.veh.speed, s.veh.valid, False),
                   ("vru", s.ped.xy, s.ped.yaw, torch.full_like(s.ped.xy, agents.PEDESTRIAN_HALF), s.ped.speed,
                    s.ped.valid, False),
                   ("object", s.statics.xy, s.statics.yaw, s.statics.half, torch.zeros_like(s.statics.yaw),
                    s.statics.valid, True))
        for cls, xy, yaw, half, speed, valid, static in classes:
            hit = boxes_overlap(ego_xy, ego_yaw, ego_half, xy[row], yaw[row], half[row]) & valid[row]
            for j in torch.nonzero(hit).flatten().tolist():
                kind = M.collision_type(ego_xy.cpu().numpy(), float(ego_yaw), ego_half.cpu().numpy(), ego_speed,
                                        xy[row, j].cpu().numpy(), float(yaw[row, j]), half[row, j].cpu().numpy(),
                                        float(speed[row, j]), static)
                counts[cls] += int(M.is_at_fault(kind, multi_lane))
        return counts

    def _nuplan_scores(self, s: NuplanState, done: Tensor, hard_t: Tensor) -> dict[str, Tensor]:
        """``episode/nuplan_score`` and ``episode/nuplan/<metric>`` of the finished rows (0 elsewhere)."""
        env = self.env
        out = {"episode/nuplan_score": torch.zeros(env.num_envs, device=env.device)}
        for k in NUPLAN_COMPONENTS:
            out[f"episode/nuplan/{k}"] = torch.zeros(env.num_envs, device=env.device)
        if not bool(done.any()):
            return out
        rows = torch.nonzero(done).flatten()
        tr = {k: v[rows].cpu().numpy() for k, v in self.trace.items()}
        steps = s.steps[rows].cpu().numpy()
        collided = hard_t[rows][:, [HARD.index(k) for k in ("collision_vehicle", "collision_pedestrian",
                                                             "collision_static")]].any(-1).cpu().numpy()
        route_id, route_idx = s.route_id[rows], s.route_idx[rows]
        ego_prog = env.world.route_cum[route_id, route_idx].cpu().numpy()
        scen = s.scenario[rows].cpu().numpy()
        for i, row in enumerate(rows.tolist()):
            sc = self.scenario_score(row, {k: v[i] for k, v in tr.items()}, int(steps[i]), bool(collided[i]),
                                     float(ego_prog[i]), int(scen[i]), s)
            out["episode/nuplan_score"][row] = sc.score
            for k in M.MULTIPLIERS:
                out[f"episode/nuplan/{k}"][row] = sc.multipliers[k]
            for k in M.WEIGHTS:
                out[f"episode/nuplan/{k}"][row] = sc.weighted[k]
        return out

    def scenario_score(self, row: int, tr: dict[str, np.ndarray], steps: int, collided: bool, ego_progress: float,
                       scenario: int, s: NuplanState) -> M.ScenarioScore:
        """nuPlan's scenario score from one row's trace (chronological order restored from the ring buffer)."""
        env = self.env
        n = max(1, min(steps, self.trace_len))
        end = (steps - 1) % self.trace_len + 1
        tr = {k: np.roll(v, -end)[-n:] for k, v in tr.items()}
        at_fault = self._at_fault_collisions(s, row, bool(tr["multi_lane"][-1] or tr["outside"][-1] > 0)) \
            if collided else {}
        ratio = M.progress_ratio(ego_progress, float(env.expert_progress[scenario]))
        mult = {"no_at_fault_collisions": M.collision_score(at_fault),
                "drivable_area_compliance": M.drivable_area_compliance(tr["outside"][:, None]),
                "driving_direction_compliance": M.driving_direction_compliance(tr["lane_prog"], env.cfg.dt),
                "making_progress": M.making_progress(ratio)}
        any_fault = sum(at_fault.values()) > 0
        weighted = {"ego_progress": ratio,
                    "time_to_collision": 0.0 if (any_fault or tr["ttc"].any()) else 1.0,
                    "speed_limit": M.speed_limit_compliance(tr["speed"], tr["limit"], env.cfg.dt),
                    "comfort": M.ego_is_comfortable(M.comfort_signals(tr["speed"], tr["yaw"], env.cfg.dt,
                                                                      accel=tr["accel"]))}
        return M.ScenarioScore(env.scenario_tokens[scenario], env.scenario_types[scenario], mult, weighted)


def load_scenarios(opts: NuplanOptions, seed: int = 0) -> list[CachedScenario]:
    """The env's scenario pool: build missing cache files from ``data_root`` if given, then load up to
    ``max_scenarios`` (the first ones for evaluation, a seeded random subset for training)."""
    tokens, types = opts.tokens, opts.scenario_types
    if opts.split_yaml:
        from envs.nuplan.reader import load_split_yaml

        y = load_split_yaml(opts.split_yaml)
        tokens = tokens or y["scenario_tokens"]
        types = types or y["scenario_types"]
    if opts.data_root:
        from envs.nuplan.reader import select_scenarios

        specs = select_scenarios(opts.data_root, opts.split, opts.log_names, types, tokens)
        build_cache(specs, opts.maps_root or Path(opts.data_root) / "maps", opts.cache_dir, opts.workers)
    files = list_cache(opts.cache_dir, tokens, opts.log_names, types)
    if opts.route_split == "train" and len(files) > opts.max_scenarios:
        pick = np.random.default_rng(seed).choice(len(files), opts.max_scenarios, replace=False)
        files = [files[i] for i in sorted(pick)]
    return [load(f) for f in files[: opts.max_scenarios]]


def make_nuplan_env(num_envs: int, device: str | torch.device = "cpu", seed: int = 0, **options: Any) -> NuplanEnv:
    """``envs.make_env("nuplan", ...)``: validate ``options`` (see :class:`NuplanOptions`) and build the env."""
    opts = from_dict(NuplanOptions, options, "env.options").validate()
    return NuplanEnv(load_scenarios(opts, seed), opts, num_envs, device, seed)


def options_dict(opts: NuplanOptions) -> dict:
    return dataclasses.asdict(opts)

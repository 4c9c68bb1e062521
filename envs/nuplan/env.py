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
from envs.sim.parts import ActorSource, LightCycle, StartSource
from envs.sim.world import build_world, lane_lookup
from envs.api import TensorSpec
from envs.nuplan.carl_reward import CarlNuplanReward
from envs.nuplan.observation import NuplanObserver
from envs.nuplan.scoring import NuplanMetrics
from envs.metrics import nuplan as M
from envs.sim.infractions import HARD

# light model: a 3 s cycle per light group; the logged state picks the time inside it
LIGHT_PHASE = (1.0, 1.0, 1.0)  # green, yellow, all-red
LIGHT_REL = (0.5, 1.5, 2.5, 0.5)  # green, yellow, red, unknown (shown as green)
VEHICLE_TYPES, PEDESTRIAN_TYPES = (0, 2), (1,)
IDM_TARGET_SPEED = 10.0  # m/s, nuPlan IDMAgents
GRID_MARGIN = 100.0  # m between scenario map patches


@dataclass
class NuplanState(SimState):
    """SimState plus the log-replay and bicycle-model state (set by the parts when an episode starts)."""

    scenario: Tensor = None  # [B] index into the env's scenarios
    horizon: Tensor = None  # [B] steps of the row's scenario (its own length, not the batch's)
    ego_rear: Tensor = None  # [B, 2] float64 rear axle in the scenario's own frame (batch-independent precision)
    ego_accel: Tensor = None  # [B] rear-axle longitudinal acceleration (lagged)
    ego_steer: Tensor = None  # [B] tire steering angle
    ego_steer_rate: Tensor = None  # [B] rad/s
    ego_yaw_rate: Tensor = None  # [B] rad/s
    ego_yaw_acc: Tensor = None  # [B] rad/s², finite difference of the yaw rate
    ego_acc_local: Tensor = None  # [B, 2] acceleration of the centre, body frame (forward, left)
    raw_action: Tensor = None  # [B, 2] last action in the env's action order (zeros at the start)
    progress: Tensor = None  # [B] CaRL's nuPlan route completion (0..1, best so far)
    comfort_score: Tensor = None  # [B] CaRL's comfort factor now (1 at the start)
    ttc_score: Tensor = None  # [B] CaRL's TTC factor now


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
        self.num_frames = max(sc.num_frames for sc in scenarios)
        run_to_end = opts.route_split == "eval" if opts.run_to_end is None else opts.run_to_end
        # each scenario's own horizon: the devkit simulates to the last frame; CaRL's training stops 2 frames before
        self.horizons = torch.tensor([sc.num_frames - (1 if run_to_end else 2) for sc in scenarios], device=dev)
        if int(self.horizons.min()) < 1:
            short = [sc.token for sc in scenarios if sc.num_frames < 3]
            raise ConfigError(f"env=nuplan: scenarios {short[:8]} have fewer than 3 frames; rebuild the cache or "
                              "filter them out (env.options.tokens)")
        kinds = [np.isin(sc.agent_types, VEHICLE_TYPES) for sc in scenarios]
        peds = [np.isin(sc.agent_types, PEDESTRIAN_TYPES) for sc in scenarios]
        n_veh = max(1, max(int(k.sum()) for k in kinds))
        n_ped = max(1, max(int(p.sum()) for p in peds))
        n_st = max(1, max(int((~k & ~p).sum()) for k, p in zip(kinds, peds)))
        sim = {"map": "nuplan", "dt": 0.1, "wheelbase": WHEELBASE, "ego_half_extent": EGO_HALF,
               "max_time": (self.num_frames + 1) * 0.1, "num_vehicles": n_veh, "num_pedestrians": n_ped,
               "num_statics": n_st, "route_split": opts.route_split, "light_green": LIGHT_PHASE[0],
               "light_yellow": LIGHT_PHASE[1], "light_all_red": LIGHT_PHASE[2], "map_ppm": 2.0,
               "cache_dir": str(Path(opts.cache_dir) / "_rasters"), "reward": {"mode": "carl_nuplan"}}
        for k, v in opts.sim.items():
            sim[k] = {**sim.get(k, {}), **v} if isinstance(v, dict) and isinstance(sim.get(k), dict) else v
        cfg = from_dict(SimConfig, sim, "env.options.sim").validate()
        world = build_world(graph, routes, cfg, dev)
        self.run_to_end = run_to_end
        self.action_names = tuple(opts.action_order)
        self.action_spec = TensorSpec((2,), torch.float32, -1.0, 1.0, self.action_names)
        self.rear_to_centre = REAR_AXLE_TO_CENTRE
        self.shifts = torch.as_tensor(shifts, dtype=torch.float64, device=dev)  # scenario frame -> world frame
        super().__init__(cfg, num_envs, dev, seed, world=world, starts=LogStarts(), ego=NuplanBicycle(),
                         actors=LogReplay(opts.reactive), lights=LoggedLights(), observer=NuplanObserver(),
                         hooks=(NuplanMetrics(opts.score), CarlNuplanReward()), state_type=NuplanState,
                         check_stop_lines=opts.red_light,
                         # CaRL's nuPlan reward ends episodes by its own hard constraints; the devkit never does
                         ending_events=() if run_to_end or cfg.reward.mode == "carl_nuplan" else HARD)
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
        # the same in each scenario's own frame, float64: the ego's pose and the expert read these
        self.log_ego_local = torch.as_tensor(_pad_stack([sc.ego[:, None] for sc in scenarios], 1, t_pad)[:, :, 0],
                                             dtype=torch.float64, device=dev)
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
        # the expert's route (scenario frame) and the logged drive's progress along it over the scored horizon
        self.route_paths = [sc.route.points.astype(np.float64) for sc in scenarios]
        self._drivable: dict[int, Any] = {}
        self.expert_progress = np.array([M.path_progress(logged_centres(sc)[: h + 1], p) for sc, p, h in
                                         zip(scenarios, self.route_paths, self.horizons.tolist())])

    def drivable_area(self, scenario: int):  # noqa: ANN201 - a shapely geometry (optional import)
        """The drivable area of ``scenario`` (its frame) as one prepared shapely geometry, None when it was cached
        without map polygons (e.g. the devkit planner adapter's scenario)."""
        if scenario not in self._drivable:
            sc = self.scenarios[scenario]
            area = None
            if len(sc.drivable):
                import shapely

                area = sc.geometry("drivable")
                shapely.prepare(area)
            self._drivable[scenario] = area
        return self._drivable[scenario]

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
        env = self.env
        e = env.log_ego[s.route_id, 0]
        yaw = e[:, 2]
        speed = e[:, 3].clamp(min=0.0)
        s.scenario = s.route_id.clone()  # one route per scenario
        s.horizon = env.horizons[s.scenario]
        s.ego_rear = env.log_ego_local[s.scenario, 0, :2].clone()
        s.ego_xy = (s.ego_rear + env.shifts[s.scenario]).float() + REAR_AXLE_TO_CENTRE * torch.stack(
            (torch.cos(yaw), torch.sin(yaw)), -1)
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


def logged_centres(sc: CachedScenario) -> np.ndarray:
    """The logged ego's centre [T, 2] in the scenario's frame (the log holds the rear axle)."""
    yaw = sc.ego[:, 2].astype(np.float64)
    return sc.ego[:, :2].astype(np.float64) + REAR_AXLE_TO_CENTRE * np.stack([np.cos(yaw), np.sin(yaw)], -1)


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

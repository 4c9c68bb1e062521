"""The nuPlan environment: the simulator core in log-replay mode, batched across cached scenarios.

:func:`build_nuplan_env` assembles the core (:class:`~envs.sim.env.SimEnv`) from nuPlan's parts, which share the
scenarios' logs (:class:`~envs.nuplan.logs.ScenarioLogs`, also ``env.data``):

* :class:`LogStarts`: a scenario per environment (random for training, fixed order for evaluation), the ego at its
  logged start pose, speed and acceleration;
* :class:`~envs.nuplan.dynamics.NuplanBicycle`: nuPlan's kinematic bicycle model (rear-axle reference, first-order
  lags of 0.2 s on acceleration and 0.05 s on steering) driven by CaRL's nuPlan action mapping
  (``carl-reference.md`` §16);
* :class:`LogReplay`: agents replayed from the log (non-reactive), or vehicles driven by the shared lane-following
  IDM from their logged start (reactive; pedestrians and static objects stay replayed);
* :class:`LoggedLights`: the logged traffic-light states, written into the simulator's light model;
* the rules: CaRL's (:class:`~envs.sim.rules.Rules`) with each scenario's own horizon as the episode's end;
* :class:`~envs.nuplan.carl_reward.CarlNuplanReward` (``reward.mode=carl_nuplan``, the default) or the shared CaRL
  CARLA reward; :class:`~envs.nuplan.observation.NuplanObserver` (CaRL's nuPlan observation);
* :class:`~envs.nuplan.scoring.NuplanMetrics`: the scenario of every episode and, with ``score``, nuPlan's
  closed-loop score.

Infraction checks are the shared ones. Every cached scenario's map patch is laid out on one
grid (each in its own cell) so one ``World`` holds them all and the step stays a fixed sequence of tensor ops.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from envs.config import ConfigError, from_dict
from envs.maps.lanegraph import LaneGraph
from envs.nuplan.cache import REAR_AXLE_TO_CENTRE, CachedScenario, build_cache, list_cache, load
from envs.nuplan.carl_reward import CarlNuplanReward
from envs.nuplan.config import NuplanOptions
from envs.nuplan.dynamics import EGO_HALF, WHEELBASE, NuplanBicycle
from envs.nuplan.logs import LIGHT_PHASE, NuplanState, ScenarioLogs, agent_slots, horizon, runs_to_end
from envs.nuplan.reader import FRAME_S
from envs.nuplan.observation import NuplanObserver
from envs.nuplan.scoring import NuplanMetrics
from envs.maps.routes import Route
from envs.sim import agents
from envs.sim.agents import Vehicles
from envs.sim.config import SimConfig
from envs.sim.env import SimEnv
from envs.sim.geometry import wrap_angle
from envs.sim.infractions import HARD, HISTORY
from envs.sim.parts import ActorSource, LightCycle, StartSource
from envs.sim.rewards import CarlCarlaReward
from envs.sim.rules import Rules
from envs.sim.state import obstacles
from envs.sim.vector_obs import VectorObserver
from envs.sim.world import LightFn, build_world, lane_lookup

IDM_TARGET_SPEED = 10.0  # m/s, nuPlan IDMAgents
GRID_MARGIN = 100.0  # m between scenario map patches


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


def build_nuplan_env(scenarios: list[CachedScenario], opts: NuplanOptions, num_envs: int,
                     device: str | torch.device = "cpu", seed: int = 0) -> SimEnv:
    """Closed-loop simulation of cached nuPlan scenarios (see the module docstring); ``env.data`` holds their logs."""
    if not scenarios:
        raise ConfigError("env=nuplan: no scenarios to simulate; check env.options.cache_dir and the filters")
    dev = torch.device(device)
    graphs = [sc.graph for sc in scenarios]
    shifts = grid_shifts(graphs)
    graph, lane_off, junc_off = merge_graphs(graphs, shifts, f"nuplan_{len(scenarios)}")
    routes = [Route(sc.token, sc.route.points + shifts[k].astype(np.float32), sc.route.lanes + lane_off[k])
              for k, sc in enumerate(scenarios)]
    if min(horizon(sc.num_frames, runs_to_end(opts)) for sc in scenarios) < 1:
        short = [sc.token for sc in scenarios if sc.num_frames < 3]
        raise ConfigError(f"env=nuplan: scenarios {short[:8]} have fewer than 3 frames; rebuild the cache or "
                          "filter them out (env.options.tokens)")
    cfg = sim_config(opts, scenarios)
    world = build_world(graph, routes, cfg, dev)
    logs = ScenarioLogs(scenarios, opts, shifts, junc_off, world.num_junctions, dev)
    carl_nuplan = cfg.reward.mode == "carl_nuplan"
    # CaRL's nuPlan reward ends episodes by its own hard constraints; the devkit never does
    rules = Rules(ending_events=() if logs.run_to_end or carl_nuplan else HARD, check_stop_lines=opts.red_light,
                  episode_end=lambda s: s.steps >= s.horizon)
    return SimEnv(cfg, num_envs, dev, seed, world=world, starts=LogStarts(logs), ego=NuplanBicycle(logs),
                  actors=LogReplay(logs, opts.reactive), lights=LoggedLights(logs), rules=rules,
                  reward=CarlNuplanReward(logs) if carl_nuplan else CarlCarlaReward(),
                  observer=VectorObserver() if cfg.observation == "vector" else NuplanObserver(logs), metrics=(NuplanMetrics(logs, opts.score),), state_type=NuplanState,
                  data=logs)


def sim_config(opts: NuplanOptions, scenarios: list[CachedScenario]) -> SimConfig:
    """The simulator config of the scenarios: nuPlan's step, ego and light model, slots for the most agents of one
    scenario, then ``opts.sim`` on top."""
    num_frames = max(sc.num_frames for sc in scenarios)
    n_veh, n_ped, n_st = agent_slots(scenarios)
    sim = {"map": "nuplan", "dt": FRAME_S, "wheelbase": WHEELBASE, "ego_half_extent": EGO_HALF,
           "max_time": (num_frames + 1) * FRAME_S, "num_vehicles": n_veh, "num_pedestrians": n_ped,
           "num_statics": n_st, "route_split": opts.route_split, "light_green": LIGHT_PHASE[0],
           "light_yellow": LIGHT_PHASE[1], "light_all_red": LIGHT_PHASE[2], "map_ppm": 2.0,
           "cache_dir": str(Path(opts.cache_dir) / "_rasters"), "reward": {"mode": "carl_nuplan"}}
    for k, v in opts.sim.items():
        sim[k] = {**sim.get(k, {}), **v} if isinstance(v, dict) and isinstance(sim.get(k), dict) else v
    return from_dict(SimConfig, sim, "env.options.sim").validate()


# ---------------------------------------------------------------------------------------------- nuPlan's parts
class LogStarts(StartSource):
    """A scenario per fresh episode (random for training, the fixed assignment for evaluation); the ego at the
    scenario's first logged pose, speed and acceleration."""

    def __init__(self, logs: ScenarioLogs):
        self.logs = logs

    def pick(self, rows: Tensor) -> Tensor:
        st = self.setup
        if self.logs.opts.route_split == "eval":
            return self.next_route[rows]
        return torch.randint(len(self.logs.scenarios), (len(rows),), generator=st.gen, device=st.device)

    def place(self, s: NuplanState, rows: Tensor) -> None:
        logs = self.logs
        e = logs.log_ego[s.route_id, 0]
        yaw = e[:, 2]
        speed = e[:, 3].clamp(min=0.0)
        s.scenario = s.route_id.clone()  # one route per scenario
        s.horizon = logs.horizons[s.scenario]
        s.ego_rear = logs.log_ego_local[s.scenario, 0, :2].clone()
        s.ego_xy = (s.ego_rear + logs.shifts[s.scenario]).float() + REAR_AXLE_TO_CENTRE * torch.stack(
            (torch.cos(yaw), torch.sin(yaw)), -1)
        s.ego_yaw, s.ego_speed, s.ego_accel = yaw, speed, e[:, 5].clone()
        s.ego_vel_local = torch.stack((speed, torch.zeros_like(speed)), -1)
        s.hist_speed, s.hist_yaw = e[:, 3:4].repeat(1, HISTORY), yaw.unsqueeze(1).repeat(1, HISTORY)
        # CaRL's nuPlan reward's measures, for the critic (the reward part updates them when it is on)
        s.progress = torch.zeros_like(speed)
        s.comfort_score, s.ttc_score = torch.ones_like(speed), torch.ones_like(speed)


class LogReplay(ActorSource):
    """Agents replayed from the log frame by frame; ``reactive``: vehicles driven by the shared lane-following IDM
    from their logged start instead (pedestrians and static objects stay replayed). Nothing re-spawns."""

    def __init__(self, logs: ScenarioLogs, reactive: bool = False):
        self.logs, self.reactive = logs, reactive

    def reset(self, s: NuplanState, rows: Tensor) -> None:
        logs, frame = self.logs, s.steps  # 0: the first logged frame
        veh = logs.logged_vehicles(s.scenario, frame)
        if self.reactive:
            self._snap_to_lanes(veh)
        s.veh, s.ped, s.statics = veh, logs.logged_pedestrians(s.scenario, frame), logs.logged_statics(s.scenario,
                                                                                                       frame)

    def step(self, s: NuplanState, lights: LightFn) -> None:
        logs, st = self.logs, self.setup
        frame = s.steps + 1
        if self.reactive:
            agents.step_vehicles(st.world, s.veh, obstacles(s, st.ego_half, include_ego=True), lights, st.cfg, st.gen)
        else:
            s.veh = logs.logged_vehicles(s.scenario, frame)
        s.ped = logs.logged_pedestrians(s.scenario, frame)
        s.statics = logs.logged_statics(s.scenario, frame)

    def _snap_to_lanes(self, veh: Vehicles) -> None:
        """Put logged vehicles on their nearest lane (lane, arc position) to drive them with IDM."""
        w = self.setup.world
        lane, lateral, lane_yaw, found, _ = lane_lookup(w, veh.xy)
        pts = w.lane_pts[lane]  # [B, N, P, 2]
        s = (pts - veh.xy.unsqueeze(-2)).norm(dim=-1).argmin(-1).float() * w.lane_spacing[lane]
        aligned = torch.cos(wrap_angle(veh.yaw - lane_yaw)) > 0.5
        veh.lane, veh.s = lane, s
        veh.valid = veh.valid & found & aligned
        veh.v_factor = (IDM_TARGET_SPEED / w.lane_speed[lane].clamp(min=1.0)).clamp(0.3, 1.5)
        veh.next_lane = agents.random_successor(w, lane, self.setup.gen)
        veh.xy, veh.yaw = agents.lane_pose(w, lane, s)


class LoggedLights(LightCycle):
    """The logged light states, written into the simulator's light model (a short cycle whose per-junction offsets
    show every group's logged state at the current time)."""

    def __init__(self, logs: ScenarioLogs):
        self.logs = logs

    def reset(self, s: NuplanState, rows: Tensor) -> None:
        out = torch.zeros(len(rows), self.setup.world.num_junctions + 1, device=self.setup.device)
        s.light_offset = self.logs.light_offsets(s.scenario, s.steps, s.t, out)

    def step(self, s: NuplanState) -> None:
        s.light_offset = self.logs.light_offsets(s.scenario, s.steps, s.t, s.light_offset)


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


def make_nuplan_env(num_envs: int, device: str | torch.device = "cpu", seed: int = 0, **options: Any) -> SimEnv:
    """``envs.make_env("nuplan", ...)``: validate ``options`` (see :class:`NuplanOptions`) and build the env."""
    opts = from_dict(NuplanOptions, options, "env.options").validate()
    return build_nuplan_env(load_scenarios(opts, seed), opts, num_envs, device, seed)

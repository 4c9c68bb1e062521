"""The nuPlan scenarios' logs, as tensors the nuPlan parts share: every cached scenario's logged agents, ego and
light states in the world frame (each scenario's map patch has its own cell of one grid, ``shifts``), and what the
metrics and the expert read (the logged ego in each scenario's own frame, its route, its progress)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from envs.metrics import nuplan as M
from envs.nuplan.cache import REAR_AXLE_TO_CENTRE, CachedScenario
from envs.nuplan.config import NuplanOptions
from envs.sim.agents import Pedestrians, Statics, Vehicles
from envs.sim.state import SimState

# light model: a 3 s cycle per light group; the logged state picks the time inside it
LIGHT_PHASE = (1.0, 1.0, 1.0)  # green, yellow, all-red
LIGHT_REL = (0.5, 1.5, 2.5, 0.5)  # green, yellow, red, unknown (shown as green)
VEHICLE_TYPES, PEDESTRIAN_TYPES = (0, 2), (1,)


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


def _pad_stack(arrays: list[np.ndarray], n: int, t: int) -> np.ndarray:
    """Stack [T_i, N_i, ...] arrays into [S, t, n, ...] (time padded by repeating the last frame)."""
    out = np.zeros((len(arrays), t, n) + arrays[0].shape[2:], arrays[0].dtype)
    for k, a in enumerate(arrays):
        a = np.concatenate([a, np.repeat(a[-1:], t - len(a), 0)]) if len(a) < t else a[:t]
        out[k, :, : a.shape[1]] = a
    return out


def logged_centres(sc: CachedScenario) -> np.ndarray:
    """The logged ego's centre [T, 2] in the scenario's frame (the log holds the rear axle)."""
    yaw = sc.ego[:, 2].astype(np.float64)
    return sc.ego[:, :2].astype(np.float64) + REAR_AXLE_TO_CENTRE * np.stack([np.cos(yaw), np.sin(yaw)], -1)


def runs_to_end(opts: NuplanOptions) -> bool:
    """Whether episodes run to each scenario's last frame (the devkit's closed loop; default for evaluation)."""
    return opts.route_split == "eval" if opts.run_to_end is None else opts.run_to_end


def horizon(num_frames: int, run_to_end: bool) -> int:
    """Steps of a scenario of ``num_frames`` frames: the devkit simulates to the last frame; CaRL's training stops 2
    frames before."""
    return num_frames - (1 if run_to_end else 2)


def agent_slots(scenarios: list[CachedScenario]) -> tuple[int, int, int]:
    """Vehicle, pedestrian and static-object slots for the most of each in one scenario (at least one each)."""
    kinds = [np.isin(sc.agent_types, VEHICLE_TYPES) for sc in scenarios]
    peds = [np.isin(sc.agent_types, PEDESTRIAN_TYPES) for sc in scenarios]
    return (max(1, max(int(k.sum()) for k in kinds)), max(1, max(int(p.sum()) for p in peds)),
            max(1, max(int((~k & ~p).sum()) for k, p in zip(kinds, peds))))


class ScenarioLogs:
    """The logs of ``scenarios`` (route / scenario index order) on ``device``; ``shifts`` [S, 2] move each scenario's
    frame into the world's; ``junction_offsets`` [S] and ``num_junctions`` place each scenario's light groups among
    the world's junctions."""

    def __init__(self, scenarios: list[CachedScenario], opts: NuplanOptions, shifts: np.ndarray,
                 junction_offsets: np.ndarray, num_junctions: int, device: torch.device):
        self.scenarios, self.opts, dev = scenarios, opts, device
        self.num_frames = max(sc.num_frames for sc in scenarios)
        self.run_to_end = runs_to_end(opts)
        self.horizons = torch.tensor([horizon(sc.num_frames, self.run_to_end) for sc in scenarios], device=dev)
        self.action_names = tuple(opts.action_order)
        self.rear_to_centre = REAR_AXLE_TO_CENTRE
        self.shifts = torch.as_tensor(shifts, dtype=torch.float64, device=dev)  # scenario frame -> world frame
        kinds = [np.isin(sc.agent_types, VEHICLE_TYPES) for sc in scenarios]
        peds = [np.isin(sc.agent_types, PEDESTRIAN_TYPES) for sc in scenarios]
        self.num_vehicles, self.num_pedestrians, self.num_statics = agent_slots(scenarios)
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

        self.log_veh, self.log_veh_valid = part(kinds, self.num_vehicles)
        self.log_ped, self.log_ped_valid = part(peds, self.num_pedestrians)
        self.log_st, self.log_st_valid = part([~k & ~p for k, p in zip(kinds, peds)], self.num_statics)
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
        junc = np.full((len(scenarios), g_max), num_junctions, np.int64)  # padding -> a spare column
        for k, sc in enumerate(scenarios):
            ng = len(sc.graph.light_junction)
            lights[k, :, :sc.lights.shape[1]] = _pad_stack([sc.lights[:, None, :]], 1, t_pad)[0, :, 0]
            junc[k, :ng] = sc.graph.light_junction + junction_offsets[k]
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

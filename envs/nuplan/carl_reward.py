"""What CaRL's nuPlan reward reads, measured by the nuPlan env each step (``carl-reference.md`` §18).

The rules live in :mod:`envs.reward` (``mode="carl_nuplan"``); this reward part measures their inputs from the env's
state, batched: route completion as the ego centre's projection onto the logged expert's centre path, off-road
(any corner outside CaRL's drivable polygons: lane groups, intersections, car parks; 0 m tolerance), the current
lane's centre and boundary distances and speed limit, off-route (ego and expert centre against the route's roadblock
and connector polygons), the constant-velocity TTC forecast over every track (0.2 s steps to 1 s, as CaRL v2), the
comfort history's next state and the ego's overlaps with each track slot (for the non-stationary collision rule).
Polygons are point-in-polygon tests on edge tables, in each scenario's own frame.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from envs.comfort import rear_axle_to_center_acceleration
from envs.reward import NuplanRewardInputs, NuplanRewardState, compute_reward
from envs.sim.geometry import box_corners, boxes_overlap, boxes_overlap_moving, points_in_polygons
from envs.sim.rewards import Reward
from envs.sim.rules import Judgement
from envs.sim.state import obstacles
from envs.sim.world import lane_lookup

if TYPE_CHECKING:
    from envs.nuplan.cache import CachedScenario
    from envs.nuplan.logs import NuplanState, ScenarioLogs
    from envs.nuplan.mapgraph import PolygonSet
    from envs.sim.state import Setup

TTC_TIMES = (0.2, 0.4, 0.6, 0.8, 1.0)  # s: CaRL's TTC v2 forecast grid
HARD_REASONS = ("collision", "off_road")


def edge_table(sets: list[PolygonSet]) -> tuple[Tensor, Tensor, int]:
    """Every ring edge of each scenario's polygons, padded: (edges [S, E, 4], polygon of each edge [S, E], the most
    polygons of one scenario). An empty set has no edges (nothing is inside it)."""
    per = []
    for ps in sets:
        e, owner = [np.zeros((0, 4))], [np.zeros(0, np.int64)]
        for i in range(len(ps)):
            for ring in ps.rings_of(i):
                ring = np.asarray(ring, np.float64)
                e.append(np.concatenate([ring[:-1], ring[1:]], 1))
                owner.append(np.full(len(ring) - 1, i))
        per.append((np.concatenate(e), np.concatenate(owner)))
    E = max(1, max(len(e) for e, _ in per))
    edges = np.zeros((len(sets), E, 4), np.float32)  # padding: a horizontal edge at y = 0 never spans a point
    owner = np.zeros((len(sets), E), np.int64)
    for k, (e, o) in enumerate(per):
        edges[k, : len(e)], owner[k, : len(o)] = e, o
    return torch.as_tensor(edges), torch.as_tensor(owner), max(1, max(len(ps) for ps in sets))


def logged_centre_paths(scenarios: list[CachedScenario], rear_to_centre: float) -> tuple[Tensor, Tensor]:
    """The logged ego centres [S, T, 2] (float64, scenario frame; padded by the last one) and their arc lengths."""
    T = max(sc.num_frames for sc in scenarios)
    out = np.zeros((len(scenarios), T, 2))
    for k, sc in enumerate(scenarios):
        yaw = sc.ego[:, 2].astype(np.float64)
        c = sc.ego[:, :2].astype(np.float64) + rear_to_centre * np.stack([np.cos(yaw), np.sin(yaw)], -1)
        out[k, : len(c)], out[k, len(c):] = c, c[-1]
    paths = torch.as_tensor(out)
    cum = torch.cat((torch.zeros(len(scenarios), 1, dtype=paths.dtype),
                     (paths[:, 1:] - paths[:, :-1]).norm(dim=-1).cumsum(-1)), 1)
    return paths, cum


def project_on_paths(points: Tensor, paths: Tensor, cum: Tensor) -> Tensor:
    """Normalised arc length [B] of each point [B, 2] projected onto its polyline ``paths`` [B, T, 2] (``cum`` its
    arc lengths [B, T]); 0 for a path without length (an expert that stands still)."""
    a, d = paths[:, :-1], paths[:, 1:] - paths[:, :-1]
    seg = d.norm(dim=-1)
    rel = points.unsqueeze(1) - a
    u = ((rel * d).sum(-1) / seg.clamp(min=1e-9) ** 2).clamp(0.0, 1.0)
    dist = (rel - u.unsqueeze(-1) * d).norm(dim=-1)
    k = dist.argmin(-1, keepdim=True)
    arc = cum[:, :-1].gather(1, k) + u.gather(1, k) * seg.gather(1, k)
    total = cum[:, -1:]
    return torch.where(total > 1e-6, arc / total.clamp(min=1e-6), torch.zeros_like(arc)).squeeze(1)


class CarlNuplanReward(Reward):
    """CaRL's nuPlan reward (``reward.mode == "carl_nuplan"``); its state (:class:`NuplanRewardState`) is kept here,
    batched, reset per row, and it sets ``progress``, ``comfort_score`` and ``ttc_score`` on the state for the
    critic's value measurements. Its hard constraints end episodes, except where the devkit's closed loop runs every
    scenario to its end (``ScenarioLogs.run_to_end``)."""

    mode = "carl_nuplan"

    def __init__(self, logs: ScenarioLogs):
        self.logs = logs

    def bind(self, setup: Setup) -> None:
        super().bind(setup)
        self.last_hard: dict[str, Tensor] = {}  # this step's hard constraints, for the termination reasons
        dev, sc = setup.device, self.logs.scenarios
        self.paths, self.cum = (t.to(dev) for t in logged_centre_paths(sc, self.logs.rear_to_centre))
        self.drivable = [t.to(dev) if isinstance(t, Tensor) else t for t in edge_table([s.carl_drivable for s in sc])]
        self.route = [t.to(dev) if isinstance(t, Tensor) else t for t in edge_table([s.route_polygons for s in sc])]
        self.has_drivable = torch.tensor([len(s.carl_drivable) > 0 for s in sc], device=dev)
        self.all_drivable = bool(self.has_drivable.all())  # else some scenarios fall back to the lanes
        self.state: NuplanRewardState | None = None

    def _alloc(self, s: NuplanState) -> None:
        n = s.veh.valid.shape[1] + s.ped.valid.shape[1] + s.statics.valid.shape[1]
        self.state = NuplanRewardState.zeros(self.setup.num_envs, self.setup.device, num_objects=n,
                                             history=self.logs.num_frames + 1)

    def reset(self, s: NuplanState, rows: Tensor) -> None:
        if self.state is None:
            self._alloc(s)
        B = self.setup.num_envs
        mask = torch.zeros(B, dtype=torch.bool, device=self.setup.device)
        mask[rows] = True
        self.state.reset(mask)
        acc = rear_axle_to_center_acceleration(s.ego_accel, s.ego_yaw_rate, s.ego_yaw_acc, self.logs.rear_to_centre)

        def full(v: Tensor) -> Tensor:
            out = torch.zeros(B, dtype=v.dtype, device=v.device)
            out[rows] = v
            return out

        self.state.record_state(full(acc.lon), full(acc.lat), full(s.ego_yaw), full(acc.rear_magnitude), mask)

    def reward(self, s: NuplanState, judged: Judgement) -> Tensor:
        inp = self._inputs(s)
        terms = compute_reward(inp, self.state, self.setup.cfg.reward)
        s.progress = self.state.rc_best.to(s.ego_speed.dtype)
        s.comfort_score, s.ttc_score = terms.factors["comfort"], terms.factors["ttc"]
        self.last_hard = {k: terms.factors[k] for k in HARD_REASONS}
        if not self.logs.run_to_end:  # the devkit's closed loop runs every scenario to its end
            judged.end_more(terms.terminated)
        return terms.reward.to(s.ego_speed.dtype)

    def episode_info(self, s: NuplanState, done: Tensor, ending: Tensor, truncated: Tensor) -> dict[str, Tensor]:
        if not self.last_hard:
            return {}
        return {f"episode/termination/carl_{k}": (done & ~truncated & v.bool()).float()
                for k, v in self.last_hard.items()}

    # ------------------------------------------------------------------ the inputs
    def _inputs(self, s: NuplanState) -> NuplanRewardInputs:
        w = self.setup.world
        d = self.logs.rear_to_centre
        fwd = torch.stack((torch.cos(s.ego_yaw), torch.sin(s.ego_yaw)), -1)
        centre = s.ego_rear + (d * fwd).double()  # scenario frame, float64
        rc = project_on_paths(centre, self.paths[s.scenario], self.cum[s.scenario])
        half = self.setup.ego_half
        corners = box_corners(centre.float(), s.ego_yaw, half)  # [B, 4, 2] scenario frame
        edges, owner, n_poly = self.drivable
        inside = points_in_polygons(corners, edges[s.scenario], owner[s.scenario], n_poly)
        off_road = ~inside.all(-1)
        if not self.all_drivable:  # a scenario cached without polygons: off the road = a corner on no lane
            _, _, _, c_found, _ = lane_lookup(w, box_corners(s.ego_xy, s.ego_yaw, half))
            off_road = torch.where(self.has_drivable[s.scenario], off_road, ~c_found.all(-1))
        lane, lateral, _, found, width = lane_lookup(w, s.ego_xy)
        on_lane = found & ~w.lane_junction[lane]
        limit = torch.where(found, w.lane_speed[lane], torch.full_like(s.ego_speed, float("nan")))
        redges, rowner, r_poly = self.route
        frame = s.steps.clamp(max=self.paths.shape[1] - 1)
        expert = self.paths[s.scenario, frame]
        in_route = points_in_polygons(torch.stack((centre, expert), 1).float(), redges[s.scenario],
                                      rowner[s.scenario], r_poly)
        acc = rear_axle_to_center_acceleration(s.ego_accel, s.ego_yaw_rate, s.ego_yaw_acc, d)
        xy, yaw, speed, obj_half, valid = obstacles(s, half, include_ego=False)
        ego_v = fwd * s.ego_speed.unsqueeze(-1)
        other_v = torch.stack((torch.cos(yaw), torch.sin(yaw)), -1) * speed.unsqueeze(-1)
        ttc = (boxes_overlap_moving(s.ego_xy.unsqueeze(1), s.ego_yaw.unsqueeze(1), half.unsqueeze(1),
                                    ego_v.unsqueeze(1), xy, yaw, obj_half, other_v,
                                    torch.tensor(TTC_TIMES, device=xy.device)).any(-1) & valid).any(-1)
        overlap = boxes_overlap(s.ego_xy.unsqueeze(1), s.ego_yaw.unsqueeze(1), half.unsqueeze(1), xy, yaw,
                                obj_half) & valid
        return NuplanRewardInputs(
            rc=rc, off_road=off_road, on_lane=on_lane, lane_center_dist=lateral.abs(),
            lane_boundary_dist=(width / 2 - lateral.abs()).clamp(min=0.0), speed=s.ego_speed, speed_limit=limit,
            ego_in_route=in_route[:, 0], expert_in_route=in_route[:, 1], ttc_violation=ttc, lon_acc=acc.lon,
            lat_acc=acc.lat, heading=s.ego_yaw, acc_magnitude=acc.rear_magnitude, overlap=overlap,
            dt=self.setup.cfg.dt)

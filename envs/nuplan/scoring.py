"""nuPlan's closed-loop score of the nuPlan env's episodes, as the devkit computes it (``benchmarks.md`` Part B).

:class:`NuplanMetrics` is the env's metrics part. Each step it writes what the devkit's metrics read into a per-row
trace (the ego's rear axle in the scenario's own frame in float64, heading, speed, acceleration, yaw rate and yaw
acceleration, the lane relations, the time-to-collision check and the at-fault collisions), batched, without a host
sync on most steps. When a row's episode ends its trace is scored with the pure functions of
:mod:`envs.metrics.nuplan`. Everything a score reads is in the scenario's own frame and the row's own horizon, so a
scenario scores the same alone and in any batch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from envs.metrics import nuplan as M
from envs.sim import agents
from envs.sim.geometry import box_corners, boxes_overlap, wrap_angle
from envs.sim.parts import Metrics
from envs.sim.world import lane_lookup

if TYPE_CHECKING:
    from envs.nuplan.logs import NuplanState, ScenarioLogs
    from envs.sim.state import Setup

NO_SPEED_LIMIT = 1e3  # m/s: off the lanes there is no speed limit to break
OFF_LANE_M = 10.0  # corner distance to the drivable area when the corner is on no lane at all
CLASSES = ("vehicle", "vru", "object")  # the devkit's collision classes: vehicles, pedestrians, static objects
FLOAT64 = ("rear_x", "rear_y")
BOOL = ("common", "junction", "ttc", "fault")
TRACE_KEYS = FLOAT64 + ("yaw", "speed", "accel", "yaw_rate", "yaw_acc", "limit", "lane_prog", "outside") + BOOL
COMPONENTS = M.MULTIPLIERS + tuple(M.WEIGHTS)


def ttc_violation(ego_xy: Tensor, ego_yaw: Tensor, ego_speed: Tensor, ego_half: Tensor, rear_xy: Tensor,
                  wide: Tensor, xy: Tensor, yaw: Tensor, speed: Tensor, half: Tensor, valid: Tensor) -> Tensor:
    """The devkit's time-to-collision check of one step, batched [B]: True when TTC <= 0.95 s.

    ``valid`` [B, N]: the tracks not yet collided with. Tracks are relevant when ahead of the rear axle (within 30°
    of the heading) or, where ``wide`` (the ego is in an intersection or not in a common or connected lane), not
    behind it (150°). Ego centre and tracks move at constant speed and heading in 0.1 s steps; only the steps up to
    the 0.95 s bound decide the metric. A stopped ego (<= 0.005 m/s) has no TTC. The devkit's elongated-box
    pre-filter is not needed: it keeps every track whose projected box can meet the ego's within the horizon."""
    rel = xy - rear_xy.unsqueeze(1)
    ang = wrap_angle(torch.atan2(rel[..., 1], rel[..., 0]) - ego_yaw.unsqueeze(1)).abs()
    relevant = valid & ((ang < M.TTC_AHEAD_ANGLE) | (wide.unsqueeze(1) & (ang <= M.REAR_ANGLE)))
    n = int(M.TTC_THRESHOLD / M.TTC_STEP + 1e-6)
    tt = torch.arange(1, n + 1, device=ego_xy.device, dtype=ego_xy.dtype) * M.TTC_STEP  # [K]
    ed = torch.stack((torch.cos(ego_yaw), torch.sin(ego_yaw)), -1) * ego_speed.unsqueeze(-1)
    od = torch.stack((torch.cos(yaw), torch.sin(yaw)), -1) * speed.unsqueeze(-1)
    ego_f = ego_xy[:, None, None] + ed[:, None, None] * tt[None, None, :, None]  # [B,1,K,2]
    oth_f = xy[:, :, None] + od[:, :, None] * tt[None, None, :, None]  # [B,N,K,2]
    hit = boxes_overlap(ego_f, ego_yaw[:, None, None], ego_half[:, None, None], oth_f, yaw[..., None],
                        half[:, :, None])
    return (hit.any(-1) & relevant).any(-1) & (ego_speed > M.TTC_STOPPED_SPEED)


class NuplanMetrics(Metrics):
    """``episode/scenario`` of every episode, whether it ended at its scenario's horizon and, with ``score``,
    nuPlan's closed-loop score of finished episodes (``episode/nuplan_score``, ``episode/nuplan/<metric>``)."""

    def __init__(self, logs: ScenarioLogs, score: bool = True):
        self.logs, self.score = logs, score

    def bind(self, setup: Setup) -> None:
        super().bind(setup)
        B, dev = setup.num_envs, setup.device
        self.trace_len = self.logs.num_frames + 1  # every state of the longest scenario, the initial one included
        self.trace = {k: torch.zeros(B, self.trace_len, device=dev, dtype=torch.bool if k in BOOL else
                                     torch.float64 if k in FLOAT64 else torch.float32) for k in TRACE_KEYS}
        self.collided: dict[str, Tensor] = {}  # class -> [B, N] tracks already collided with (each counted once)
        self.at_fault = torch.zeros(B, len(CLASSES), dtype=torch.long, device=dev)
        # dense successor table [L, K] (-1 padded) for the "common or connected lanes" relation of the ego's corners
        w = setup.world
        k = max(1, int(w.succ_count.max()) if len(w.succ_count) else 1)
        j = torch.arange(k, device=dev)
        idx = (w.succ_off.unsqueeze(1) + j).clamp(max=max(len(w.succ_idx) - 1, 0))
        self.succ = torch.where(j < w.succ_count.unsqueeze(1), w.succ_idx[idx] if len(w.succ_idx) else
                                torch.zeros_like(idx), torch.full_like(idx, -1))

    # ------------------------------------------------------------------ the part
    def reset(self, s: NuplanState, rows: Tensor) -> None:
        if not self.collided:  # first reset: size the memories like the actor slots
            self.collided = {c: torch.zeros(self.setup.num_envs, g.valid.shape[1], dtype=torch.bool,
                                            device=self.setup.device)
                             for c, g in zip(CLASSES, (s.veh, s.ped, s.statics))}
        for m in self.collided.values():
            m[rows] = False
        self.at_fault[rows] = 0
        if self.score:
            self._record(s, rows)

    def record(self, s: NuplanState) -> None:
        """The trace takes this step's state."""
        if self.score:
            self._record(s, torch.arange(self.setup.num_envs, device=self.setup.device))

    def episode_info(self, s: NuplanState, done: Tensor, ending: Tensor, truncated: Tensor) -> dict[str, Tensor]:
        info = {"episode/scenario": s.scenario.float(),
                "episode/termination/scenario_end": (truncated & (s.steps >= s.horizon)).float()}
        if self.score:
            info.update(self._scores(s, done))
        return info

    # ------------------------------------------------------------------ per-step trace
    def _lane_relations(self, s: NuplanState) -> dict[str, Tensor]:
        st, w, dt = self.setup, self.setup.world, self.setup.cfg.dt
        lane, _, lane_yaw, found, _ = lane_lookup(w, s.ego_xy)
        corners = box_corners(s.ego_xy, s.ego_yaw, st.ego_half[: len(s.ego_xy)])  # [B, 4, 2]
        c_lane, c_lat, _, c_found, c_width = lane_lookup(w, corners)
        # the devkit's "common or connected": every pair of corners on the same lane or on lanes that follow each other
        a, b = c_lane.unsqueeze(-1), c_lane.unsqueeze(-2)  # [B, 4, 1], [B, 1, 4]
        linked = (a == b) | (self.succ[a] == b.unsqueeze(-1)).any(-1) | (self.succ[b] == a.unsqueeze(-1)).any(-1)
        common = c_found.all(-1) & linked.flatten(1).all(-1)
        rear = s.ego_xy - self.logs.rear_to_centre * torch.stack((torch.cos(s.ego_yaw), torch.sin(s.ego_yaw)), -1)
        r_lane, _, _, r_found, _ = lane_lookup(w, rear)
        return {
            "lane": lane, "found": found, "rear": rear, "common": common,
            "junction": w.lane_junction[r_lane] & r_found,
            "limit": torch.where(found, w.lane_speed[lane], torch.full_like(s.ego_speed, NO_SPEED_LIMIT)),
            # progress along the current lane's baseline this step (negative = against the lane direction)
            "lane_prog": torch.where(found, s.ego_speed * dt * torch.cos(s.ego_yaw - lane_yaw),
                                     torch.zeros_like(s.ego_speed)),
            "outside": torch.where(c_found, (c_lat.abs() - c_width / 2).clamp(min=0.0),
                                   torch.full_like(c_lat, OFF_LANE_M)).max(-1).values,
        }

    def _record(self, s: NuplanState, rows: Tensor) -> None:
        """Write the metrics' inputs of state ``s`` (rows ``rows`` of the batch) at column ``s.steps``."""
        rel = self._lane_relations(s)
        fault = self._collisions(s, rows, rel["common"])
        tracks = []
        for c, g, speed in zip(CLASSES, (s.veh, s.ped, s.statics),
                               (s.veh.speed, s.ped.speed, torch.zeros_like(s.statics.yaw))):
            half = torch.full_like(g.xy, agents.PEDESTRIAN_HALF) if c == "vru" else g.half
            tracks.append((g.xy, g.yaw, speed, half, g.valid & ~self.collided[c][rows]))
        xy, yaw, speed, half, valid = (torch.cat(x, 1) for x in zip(*tracks))
        wide = rel["junction"] | ~rel["common"]
        ttc = ttc_violation(s.ego_xy, s.ego_yaw, s.ego_speed, self.setup.ego_half[: len(rows)], rel["rear"], wide, xy, yaw,
                            speed, half, valid) | fault
        values = {"rear_x": s.ego_rear[:, 0], "rear_y": s.ego_rear[:, 1], "yaw": s.ego_yaw, "speed": s.ego_speed,
                  "accel": s.ego_accel, "yaw_rate": s.ego_yaw_rate, "yaw_acc": s.ego_yaw_acc, "limit": rel["limit"],
                  "lane_prog": rel["lane_prog"], "outside": rel["outside"], "common": rel["common"],
                  "junction": rel["junction"], "ttc": ttc, "fault": fault}
        col = s.steps.clamp(max=self.trace_len - 1)
        for k, v in values.items():
            self.trace[k][rows, col] = v.to(self.trace[k].dtype)

    def _collisions(self, s: NuplanState, rows: Tensor, common: Tensor) -> Tensor:
        """New collisions of this step (each track once), classified as the devkit does; returns whether the ego has an
        at-fault collision now [len(rows)] and adds to the per-class at-fault counts. Collisions are rare: the
        classification loops over them only."""
        fault = torch.zeros(len(rows), dtype=torch.bool, device=self.setup.device)
        groups = ((s.veh, s.veh.half), (s.ped, torch.full_like(s.ped.xy, agents.PEDESTRIAN_HALF)),
                  (s.statics, s.statics.half))
        news = []
        for c, (g, half) in zip(CLASSES, groups):
            hit = boxes_overlap(s.ego_xy.unsqueeze(1), s.ego_yaw.unsqueeze(1), self.setup.ego_half[: len(rows)].unsqueeze(1),
                                g.xy, g.yaw, half) & g.valid
            new = hit & ~self.collided[c][rows]
            self.collided[c][rows] |= hit
            news.append(new)
        if not bool(torch.stack([n.any() for n in news]).any()):
            return fault
        rear = s.ego_xy - self.logs.rear_to_centre * torch.stack((torch.cos(s.ego_yaw), torch.sin(s.ego_yaw)), -1)
        for k, (c, (g, half), new) in enumerate(zip(CLASSES, groups, news)):
            speed = torch.zeros_like(g.yaw) if c == "object" else g.speed
            for i, j in torch.nonzero(new).tolist():
                kind = M.collision_type(s.ego_xy[i].double().cpu().numpy(), float(s.ego_yaw[i]),
                                        self.setup.ego_half[0].double().cpu().numpy(), float(s.ego_speed[i]),
                                        g.xy[i, j].double().cpu().numpy(), float(g.yaw[i, j]),
                                        half[i, j].double().cpu().numpy(), float(speed[i, j]), c == "object",
                                        rear_xy=rear[i].double().cpu().numpy())
                if M.is_at_fault(kind, not bool(common[i])):
                    self.at_fault[rows[i], k] += 1
                    fault[i] = True
        return fault

    # ------------------------------------------------------------------ scores
    def _scores(self, s: NuplanState, done: Tensor) -> dict[str, Tensor]:
        """``episode/nuplan_score`` and ``episode/nuplan/<metric>`` of the finished rows (0 elsewhere)."""
        st = self.setup
        out = {"episode/nuplan_score": torch.zeros(st.num_envs, device=st.device)}
        for k in COMPONENTS:
            out[f"episode/nuplan/{k}"] = torch.zeros(st.num_envs, device=st.device)
        if not bool(done.any()):
            return out
        rows = torch.nonzero(done).flatten()
        n = (s.steps[rows] + 1).clamp(max=self.trace_len).cpu().numpy()
        tr = {k: v[rows].cpu().numpy() for k, v in self.trace.items()}
        counts = self.at_fault[rows].cpu().numpy()
        scen = s.scenario[rows].cpu().numpy()
        for i, row in enumerate(rows.tolist()):
            sc = self.scenario_score({k: v[i, : n[i]] for k, v in tr.items()}, dict(zip(CLASSES, counts[i].tolist())),
                                     int(scen[i]))
            out["episode/nuplan_score"][row] = sc.score
            for k in M.MULTIPLIERS:
                out[f"episode/nuplan/{k}"][row] = sc.multipliers[k]
            for k in M.WEIGHTS:
                out[f"episode/nuplan/{k}"][row] = sc.weighted[k]
        return out

    def scenario_score(self, tr: dict[str, np.ndarray], at_fault: dict[str, int], scenario: int) -> M.ScenarioScore:
        """nuPlan's scenario score from one row's trace (``tr``: the states from the episode's start, in order)."""
        logs, dt = self.logs, self.setup.cfg.dt
        d = logs.rear_to_centre
        yaw = tr["yaw"].astype(np.float64)
        centre = np.stack([tr["rear_x"] + d * np.cos(yaw), tr["rear_y"] + d * np.sin(yaw)], -1)
        path = logs.route_paths[scenario]
        ratio = M.progress_ratio(M.path_progress(centre, path), logs.expert_progress[scenario])
        mult = {"no_at_fault_collisions": M.collision_score(at_fault),
                "drivable_area_compliance": M.drivable_area_compliance(self._corners_outside(tr, centre, yaw,
                                                                                            scenario)),
                "driving_direction_compliance": M.driving_direction_compliance(tr["lane_prog"], dt),
                "making_progress": M.making_progress(ratio)}
        weighted = {"ego_progress": ratio,
                    "time_to_collision": 0.0 if tr["ttc"].any() else 1.0,
                    "speed_limit": M.speed_limit_compliance(tr["speed"], tr["limit"], dt),
                    "comfort": M.ego_is_comfortable(tr["accel"], tr["yaw_rate"], tr["yaw_acc"], yaw, d, dt)}
        return M.ScenarioScore(logs.scenario_tokens[scenario], logs.scenario_types[scenario], mult, weighted)

    def _corners_outside(self, tr: dict[str, np.ndarray], centre: np.ndarray, yaw: np.ndarray, scenario: int
                         ) -> np.ndarray:
        """Each ego corner's distance [T, 4] to the map's drivable area (its road segments, intersections, generic
        drivable areas and car parks, as cached); a scenario cached without them falls back to the lanes."""
        area = self.logs.drivable_area(scenario)
        if area is None:
            return tr["outside"][:, None]
        import shapely

        half = np.asarray(self.setup.cfg.ego_half_extent, np.float64)
        corners = M.box_corners(centre, yaw, np.broadcast_to(half, (len(yaw), 2)))  # [T, 4, 2]
        return shapely.distance(shapely.points(corners.reshape(-1, 2)), area).reshape(len(yaw), 4)

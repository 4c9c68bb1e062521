"""The vector observation: the batched state as padded entity sets in the ego frame, for a set-encoder policy.

``env.options.observation=vector`` (sizes in ``env.options.vector``). Beside CaRL's measurements and value
measurements it holds, nearest first and padded with a validity flag (``envs.api.VECTOR_FEATURES`` names every
feature): the route ahead at fixed spacing with its junction and lane-change marks, the lane-centre points around the
ego, the nearest vehicles, pedestrians and static objects, and the next stop lines on the route with their lights.
It reads only the batched state and the world, so every backend that fills the state (the simulator, the CARLA
worker, the nuPlan logs) gets it unchanged.

Cheap by construction (the point of the vector path): the map side is compiled once per world into lookup tables,
so a step costs gathers and one ``topk`` per actor type, with no search over the map:

* lane points: each lane resampled every ``lane_spacing`` m; a grid of ``GRID_CELL_M`` cells holds, for each cell
  centre, its ``lanes`` nearest points (``scipy``'s KD-tree, at build). A step gathers the ego's cell's list and masks
  the points beyond ``lane_radius`` of the ego itself.
* route: the route point at every whole metre of each route (a step adds the spacing and gathers), and a running
  count of the route's lane changes to each side (a mark covers the whole interval since the previous point).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy.spatial import cKDTree
from torch import Tensor

from envs.api import (LAYOUT_VECTOR, MEASUREMENTS, OBS_LANES, OBS_MEASUREMENTS, OBS_PEDESTRIANS, OBS_ROUTE,
                      OBS_STATICS, OBS_STOPS, OBS_VALUE_MEASUREMENTS, OBS_VEHICLES, PATH_HORIZON_S, PATH_MEET_M,
                      PATH_SETS, VALUE_MEASUREMENTS, TensorSpec, vector_features)
from envs.compiled import compiled
from envs.config import ConfigError
from envs.maps.lanegraph import CONTROL_STOP
from envs.sim.agents import LIGHT_BRAKE, LIGHT_EMERGENCY
from envs.sim.config import VectorConfig
from envs.sim.geometry import to_local
from envs.sim.infractions import lane_measures
from envs.sim.observation import measurements, stop_lines_ahead, upcoming_stop_lines, value_measurements
from envs.sim.parts import Observer
from envs.sim.world import ForecastFn, LightFn, World

F_ORIGIN = torch.tensor([[1.0], [0.0], [0.0]])  # which column pairs of ego_frame are positions (the first)
GRID_CELL_M = 5.0  # m: the lane-point grid's cell (the nearest points are those of the cell centre, <= 3.6 m away)
SCRIPTED_STEP_S = 0.5  # s between the samples of a scripted path (10 m at a junction stream's 20 m/s: a chord of a
                       # 15 m-radius bend is within 0.9 m of the arc)


@dataclass
class VectorMaps:
    """The map side of the vector observation, compiled once per world and sizes."""

    lane_feat: Tensor  # [P+1, 9] x, y, cos, sin, width, speed limit, junction, kerb, 1 (last row: padding, all 0)
    grid: Tensor  # [GX, GY] long: row of ``cell_points`` for each cell (the last row: no point near)
    cell_points: Tensor  # [C+1, K] long: each cell's K nearest lane points, nearest first (P: none)
    origin: Tensor  # [2] the grid's lower corner
    route_at_m: Tensor  # [NR, M] long: the route point (flat over [NR, R]) at each whole metre of each route
    route_feat: Tensor  # [NR * R, 9] x, y, cos, sin, junction, speed limit, lane changes to the left and to the right
    # so far (running counts), route metres, at each route point


def vector_maps(world: World, vc: VectorConfig) -> VectorMaps:
    """The world's tables for sizes ``vc`` (built on first use, kept on the world: worlds are immutable and shared)."""
    key = ("vector_obs", vc.lanes, vc.lane_spacing, vc.lane_radius)
    if key not in world.derived:
        world.derived[key] = _build(world, vc)
    return world.derived[key]


def _lane_points(world: World, spacing: float) -> np.ndarray:
    """Every lane's centre every ``spacing`` m (its last point included): [P, 8] as ``VectorMaps.lane_feat``."""
    pts = world.lane_pts.cpu().numpy()
    lens, lane_sp = world.lane_len.cpu().numpy(), world.lane_spacing.cpu().numpy()
    n = np.maximum(2, np.round(lens / np.maximum(lane_sp, 1e-6)).astype(np.int64) + 1)  # valid resampled points
    step = np.maximum(1, np.round(spacing / np.maximum(lane_sp, 1e-6)).astype(np.int64))
    count = (n - 1 + step - 1) // step + 1  # 0, step, 2 step, ..., and the last point
    lane = np.repeat(np.arange(len(n)), count)
    first = np.cumsum(count) - count
    j = np.arange(count.sum()) - np.repeat(first, count)
    idx = np.minimum(j * step[lane], n[lane] - 1)
    prev = np.maximum(np.minimum(idx, n[lane] - 2), 0)
    d = pts[lane, prev + 1] - pts[lane, prev]
    d = d / np.maximum(np.linalg.norm(d, axis=-1, keepdims=True), 1e-6)
    cols = [pts[lane, idx, 0], pts[lane, idx, 1], d[:, 0], d[:, 1]] + [
        x.cpu().numpy()[lane].astype(np.float32) for x in (world.lane_width, world.lane_speed, world.lane_junction,
                                                           world.lane_kerb)]
    return np.stack(cols, -1).astype(np.float32)


def _cell_table(xy: np.ndarray, k: int, radius: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(origin [2], grid [GX, GY], cell points [C+1, k]): the ``k`` nearest of points ``xy`` to each cell centre,
    within ``radius`` plus the cell's half diagonal; cells with none share the last (empty) row."""
    reach = radius + GRID_CELL_M * math.sqrt(0.5)
    origin = xy.min(0) - reach
    shape = np.ceil((xy.max(0) + reach - origin) / GRID_CELL_M).astype(np.int64) + 1
    tree = cKDTree(xy)
    gx, gy = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
    centres = origin + (np.stack((gx.ravel(), gy.ravel()), -1) + 0.5) * GRID_CELL_M
    near = tree.query_ball_point(centres, reach, return_length=True) > 0
    rows = np.full(len(centres), int(near.sum()), np.int64)
    rows[near] = np.arange(int(near.sum()))
    _, idx = tree.query(centres[near], k=min(k, len(xy)), distance_upper_bound=reach)
    idx = np.asarray(idx, np.int64).reshape(int(near.sum()), -1)  # misses come back as len(xy): the padding row
    table = np.full((int(near.sum()) + 1, k), len(xy), np.int64)
    table[:-1, :idx.shape[1]] = idx
    return origin.astype(np.float32), rows.reshape(shape), table


def _route_tables(world: World) -> tuple[np.ndarray, np.ndarray]:
    """(route point at each whole metre [NR, M], flat over [NR, R]; route features [NR * R, 9]). A lane
    change is a step to the lane's left / right neighbour, or to a lane that is no successor (then its side is the
    side the route moves to over the next 5 points)."""
    g = world.graph
    lane = world.route_lane.cpu().numpy()
    pts, cum = world.route_pts.cpu().numpy(), world.route_cum.cpu().numpy()
    n = world.route_n.cpu().numpy()
    a, b = lane[:, :-1], lane[:, 1:]
    L = g.num_lanes
    succ_pairs = np.repeat(np.arange(L), np.diff(g.succ_offsets)) * L + g.succ_index
    is_succ = np.isin(a * L + b, succ_pairs)
    heading = pts[:, 1:] - pts[:, :-1]
    ahead = pts[:, np.minimum(np.arange(1, pts.shape[1]) + 5, pts.shape[1] - 1)] - pts[:, :-1]
    side = np.sign(heading[..., 0] * ahead[..., 1] - heading[..., 1] * ahead[..., 0])
    left = (b == g.left[a]) | ((a != b) & ~is_succ & (b != g.right[a]) & (side > 0))
    right = (b == g.right[a]) | ((a != b) & ~is_succ & (b != g.left[a]) & (side < 0))
    valid = np.arange(1, pts.shape[1])[None] < n[:, None]
    zero = np.zeros((len(n), 1), np.int64)
    left_cum = np.concatenate((zero, np.cumsum(left & (a != b) & valid, 1)), 1)
    right_cum = np.concatenate((zero, np.cumsum(right & (a != b) & valid, 1)), 1)
    metres = int(np.ceil(cum.max())) + 1
    R = pts.shape[1]
    at_m = np.stack([np.minimum(np.searchsorted(c[:k], np.arange(metres), side="right") - 1, k - 1) + i * R
                     for i, (c, k) in enumerate(zip(cum, n))])
    k1 = np.minimum(np.arange(R)[None] + 1, n[:, None] - 1)
    k0 = np.maximum(k1 - 1, 0)
    rows = np.arange(len(n))[:, None]
    d = pts[rows, k1] - pts[rows, k0]
    d = d / np.maximum(np.linalg.norm(d, axis=-1, keepdims=True), 1e-6)
    feat = np.concatenate((pts, d, world.route_junction.cpu().numpy()[..., None],
                           world.lane_speed.cpu().numpy()[lane][..., None], left_cum[..., None],
                           right_cum[..., None], cum[..., None]), -1)
    return at_m, feat.reshape(-1, 9).astype(np.float32)


def _build(world: World, vc: VectorConfig) -> VectorMaps:
    dev = world.device
    feat = _lane_points(world, vc.lane_spacing)
    origin, grid, table = _cell_table(feat[:, :2].astype(np.float64), vc.lanes, vc.lane_radius)
    feat = np.concatenate((feat, np.ones((len(feat), 1), np.float32)), 1)  # the validity flag
    feat = np.concatenate((feat, np.zeros((1, feat.shape[1]), np.float32)))  # the padding point: all zero
    at_m, route_feat = _route_tables(world)
    t = lambda x: torch.as_tensor(x, device=dev)  # noqa: E731
    return VectorMaps(lane_feat=t(feat), grid=t(grid), cell_points=t(table), origin=t(origin), route_at_m=t(at_m),
                      route_feat=t(route_feat))


def ego_frame(f: Tensor, ego_xy: Tensor, ego_yaw: Tensor, pairs: int) -> Tensor:
    """Features [B, N, F] whose first column pair is a world position and the next ``pairs - 1`` pairs world
    vectors (headings, velocities), the rest frame-free, in the egos' frames (every pair rotated at once)."""
    B, N, _ = f.shape
    p = f[..., :2 * pairs].view(B, N, pairs, 2)
    p = p - F_ORIGIN[:pairs].to(f) * ego_xy.view(B, 1, 1, 2)  # only the position moves with the ego
    c, s = torch.cos(ego_yaw).view(B, 1, 1), torch.sin(ego_yaw).view(B, 1, 1)
    x, y = p[..., 0], p[..., 1]
    out = f.clone()  # written into a copy, not stacked and concatenated: 1.2-1.4x faster over the five calls of a
    # step at batch 1024 (docs/simulator.md, "Broadcasts and reductions")
    out[..., 0:2 * pairs:2] = c * x + s * y
    out[..., 1:2 * pairs:2] = c * y - s * x
    return out


def _within(f: Tensor, radius: float) -> Tensor:
    """Ego-frame features [B, N, F] (x, y first, the validity flag last) with the rows that are not valid or lie
    beyond ``radius`` all zero (their flag too)."""
    x, y = f[..., :1], f[..., 1:2]
    near = x * x + y * y <= radius * radius  # not square().sum(-1) over a last dim of 2: 242 vs 341 us at [1024, 32, 9]
    return f * (near & (f[..., -1:] > 0))


def route_coordinates(xy: Tensor, route: Tensor, arc: Tensor, ok: Tensor) -> Tensor:
    """Ego-frame points [B, A, 2] in the route's frame: (metres along the route from the ego's route point, metres
    to its left) [B, A, 2], measured from the nearest valid route point (``route`` [B, N, 4]: x, y, cos, sin; its
    route metres ``arc`` [B, N]; ``ok`` [B, N]; of equally near points the first).

    The distances are laid out [N, B, A] and the nearest found by ``amin`` over the first dim and a match, not by
    ``argmin`` over a last dim of N ~ 21: on CPU that reduction alone is ~10x slower (docs/simulator.md, "Broadcasts
    and reductions")."""
    B, N = route.shape[:2]
    px, py = xy[..., 0].contiguous().unsqueeze(0), xy[..., 1].contiguous().unsqueeze(0)  # [1, B, A]
    rx, ry = route[..., 0].t().contiguous().unsqueeze(-1), route[..., 1].t().contiguous().unsqueeze(-1)  # [N, B, 1]
    dx, dy = px - rx, py - ry  # [N, B, A]
    d = dx.mul_(dx).addcmul_(dy, dy).add_(torch.where(ok, 0.0, math.inf).t().unsqueeze(-1))  # + inf: where is slow
    hit = torch.eq(d, d.amin(0), out=torch.empty_like(d))  # 0/1 as floats
    first = hit.mul_(torch.arange(N, 0, -1, dtype=d.dtype, device=d.device).view(N, 1, 1)).amax(0)
    j = (N - first.long()).clamp_(max=N - 1)  # the first nearest (a NaN point matches none: the last, not out of range)
    q = route.reshape(B * N, 4).index_select(0, (j + torch.arange(B, device=j.device).unsqueeze(1) * N).view(-1))
    q = q.view(*j.shape, 4)
    rel = xy - q[..., :2]
    along = torch.gather(arc, 1, j) + rel[..., 0] * q[..., 2] + rel[..., 1] * q[..., 3]
    left = q[..., 2] * rel[..., 1] - q[..., 3] * rel[..., 0]
    return torch.stack((along, left), -1)


def path_meeting(pts: Tensor, taus: Tensor, route: Tensor, arc: Tensor, ok: Tensor,
                 live: Tensor | None = None) -> Tensor:
    """Where and when each actor's path first meets the route ahead: the path as ego-frame positions [B, A, T, 2] at
    times ``taus`` [T] (a straight line: T = 2, now and at ``PATH_HORIZON_S``), the route frame's samples (``route``
    [B, N, 4], their route metres ``arc`` [B, N], ``ok`` [B, N]) -> [B, A, 3]: route metres of the sample met, seconds
    until then, 1/0 (``envs.api.PATH_FEATURES``). ``live`` [B, A, T - 1]: the path segments that count (None: all).

    An actor meets a sample when its closest approach to it on a segment (the fraction ``u = (r - p).d / |d|^2`` of
    the segment's displacement ``d``, clamped to [0, 1]; 0 for a segment standing still) is within ``PATH_MEET_M``; of
    those samples the earliest (then the nearest on the route) counts. One broadcast over actors x segments x samples:
    no loop."""
    B, N = arc.shape
    p, d = pts[:, :, :-1], pts[:, :, 1:] - pts[:, :, :-1]  # [B, A, K, 2]
    # per component, [B, A, K, N] each (no [.., 2] intermediates): segment start -> sample, its projection on d
    rx = route[..., 0].view(B, 1, 1, N) - p[..., :1]
    ry = route[..., 1].view(B, 1, 1, N) - p[..., 1:]
    dx, dy = d[..., :1], d[..., 1:]
    dd = dx * dx + dy * dy  # [B, A, K, 1]
    dot = rx * dx + ry * dy
    u = (dot / dd.clamp(min=1e-9)).clamp_(0.0, 1.0).mul_(dd > 1e-9)
    miss = rx.square_().add_(ry.square_()).sub_(2 * u * dot).add_(u * u * dd)  # |r - p - u d|^2
    t = u.mul_((taus[1:] - taus[:-1]).view(-1, 1)).add_(taus[:-1].view(-1, 1))  # seconds from now
    meets = ok.view(B, 1, 1, N) & (miss <= PATH_MEET_M * PATH_MEET_M)
    if live is not None:
        meets &= live.unsqueeze(-1)
    # earliest, then nearest along the route (metres are < 1e4, so one key orders both)
    key = torch.where(meets, t * 1e4 + arc.clamp(min=0).view(B, 1, 1, N), math.inf).flatten(2)
    first, j = key.min(-1, keepdim=True)  # [B, A, 1]; not argmin: 2-3x slower on CPU for the same indices
    hit = torch.isfinite(first.squeeze(-1))  # some sample met
    when = torch.where(hit, torch.gather(t.flatten(2), -1, j).squeeze(-1), PATH_HORIZON_S)
    where = torch.where(hit, torch.gather(arc, 1, (j.squeeze(-1) % N)), 0.0)
    return torch.stack((where, when, hit.float()), -1)


def straight_paths(xy: Tensor, vel: Tensor) -> tuple[Tensor, Tensor]:
    """Constant-velocity paths for :func:`path_meeting`: positions [B, A, 2] now and after ``PATH_HORIZON_S`` at
    velocities [B, A, 2] -> ([B, A, 2, 2], the times [2])."""
    return torch.stack((xy, xy + vel * PATH_HORIZON_S), 2), torch.tensor([0.0, PATH_HORIZON_S], device=xy.device)


class VectorObserver(Observer):
    """The vector observation (module docstring); the critic keeps CaRL's value measurements."""

    layout = LAYOUT_VECTOR

    def bind(self, setup) -> None:  # noqa: ANN001 - Setup
        super().bind(setup)
        vc, w = setup.cfg.vector, setup.world
        held = {"vehicles": setup.num_vehicles, "pedestrians": setup.num_pedestrians, "statics": setup.num_statics}
        self.maps = vector_maps(w, vc)
        points = self.maps.lane_feat.shape[0] - 1
        if vc.lanes > points:
            raise ConfigError(f"env.options.vector.lanes={vc.lanes} is more than the {points} lane points the world "
                              f"holds (every {vc.lane_spacing} m of its lanes): use at most {points}, or a smaller "
                              "env.options.vector.lane_spacing")
        self.counts = {OBS_ROUTE: vc.route_points, OBS_LANES: vc.lanes, OBS_STOPS: vc.stops,
                       **{key: getattr(vc, k) or held[k] for key, k in ((OBS_VEHICLES, "vehicles"),
                                                                          (OBS_PEDESTRIANS, "pedestrians"),
                                                                          (OBS_STATICS, "statics"))}}
        self.offsets = torch.arange(1, vc.route_points + 1, device=setup.device) * vc.route_spacing
        self.scripted_taus = torch.arange(0.0, PATH_HORIZON_S + 1e-6, SCRIPTED_STEP_S, device=setup.device)
        # the observation in two stages around the light lookup (the light part's and the scenarios', which hold
        # state between calls): each compiled as one graph with vector.compile
        self._stop_lines, self._features = self.stop_lines, self.features
        if vc.compile:
            self._stop_lines, self._features = (compiled(f, "env.options.vector.compile")
                                                for f in (self.stop_lines, self.features))

    def spec(self) -> dict[str, TensorSpec]:
        spec = {OBS_MEASUREMENTS: TensorSpec((len(MEASUREMENTS),), torch.float32, names=MEASUREMENTS),
                OBS_VALUE_MEASUREMENTS: TensorSpec((len(VALUE_MEASUREMENTS),), torch.float32,
                                                   names=VALUE_MEASUREMENTS)}
        names = vector_features(self.setup.cfg.vector.path_conflicts)
        spec.update({k: TensorSpec((n, len(names[k])), torch.float32, names=names[k]) for k, n in self.counts.items()})
        return spec

    def observe(self, s, lights: LightFn, speed_limit: Tensor | None = None,  # noqa: ANN001
                forecast: ForecastFn | None = None) -> dict[str, Tensor]:
        stop, dist, sign = self._stop_lines(s)
        state, yellow_left = lights(torch.where(sign, torch.full_like(stop, -1), self.setup.world.stop_group[stop]))
        scripted = None
        if forecast is not None and self.setup.cfg.vector.scripted_paths:  # eager: it keeps only the live pairs
            xy, _, gone = forecast(self.scripted_taus)
            scripted = self.scripted_meeting(s, xy, gone)
        return self._features(s, speed_limit, stop, dist, sign, state, yellow_left, scripted)

    def features(self, s, speed_limit: Tensor | None, stop: Tensor, dist: Tensor, sign: Tensor,  # noqa: ANN001
                 state: Tensor, yellow_left: Tensor, scripted: Tensor | None = None) -> dict[str, Tensor]:
        """Every key of the observation, given the next stop lines and their lights (:meth:`stop_lines`) and where
        the scenario vehicles' scripted paths meet the route (:meth:`scripted_meeting`) if used."""
        w, cfg = self.setup.world, self.setup.cfg
        if speed_limit is None:
            speed_limit = lane_measures(w, s.ego_xy, s.ego_yaw)["speed_limit"]
        route, frame = self.route(s)
        return {OBS_MEASUREMENTS: measurements(s, speed_limit),
                OBS_VALUE_MEASUREMENTS: value_measurements(w, s, cfg, cfg.reward),
                OBS_ROUTE: route, OBS_LANES: self.lanes(s), **self.actors(s, frame, scripted),
                OBS_STOPS: self.stop_features(s, stop, dist, sign, state, yellow_left)}

    def route(self, s) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:  # noqa: ANN001
        """The route every ``route_spacing`` m ahead of the ego's route point (invalid past the route's end), and the
        route frame the actors are placed in: the ego's route point and those samples (ego-frame x, y, cos, sin
        [B, N+1, 4], route metres from the ego's point [B, N+1], validity [B, N+1])."""
        w, m = self.setup.world, self.maps
        B, N = s.route_id.shape[0], self.offsets.shape[0]
        at = w.route_cum[s.route_id, s.route_idx].unsqueeze(1) + self.offsets  # [B, N] route metres
        valid = (at <= w.route_len[s.route_id].unsqueeze(1)).unsqueeze(-1).float()
        k = m.route_at_m[s.route_id.unsqueeze(1), at.long().clamp(max=m.route_at_m.shape[1] - 1)]
        here = (s.route_id * w.route_pts.shape[1] + s.route_idx).unsqueeze(1)
        f = m.route_feat.index_select(0, torch.cat((here, k), 1).view(-1)).view(B, N + 1, 9)
        turns = (f[:, 1:, 6:8] > f[:, :-1, 6:8]).float()  # a lane change since the previous point, to the left / right
        pose = ego_frame(f[..., :6], s.ego_xy, s.ego_yaw, 2)  # x, y, cos, sin, junction, speed limit
        route = torch.cat((pose[:, 1:, :5], turns[..., :1] - turns[..., 1:], pose[:, 1:, 5:], torch.ones_like(valid)),
                          -1) * valid
        frame_ok = torch.cat((torch.ones_like(valid[:, :1, 0]), valid[..., 0]), 1) > 0
        return route, (pose[..., :4], f[..., 8] - f[:, :1, 8], frame_ok)

    def lanes(self, s) -> Tensor:  # noqa: ANN001
        """The ego's grid cell's nearest lane points, masked beyond ``lane_radius`` of the ego."""
        m = self.maps
        GX, GY = m.grid.shape
        cell = ((s.ego_xy - m.origin) / GRID_CELL_M).long()
        inside = (cell >= 0).all(-1) & (cell[:, 0] < GX) & (cell[:, 1] < GY)
        row = m.grid.view(-1)[(cell[:, 0].clamp(0, GX - 1) * GY + cell[:, 1].clamp(0, GY - 1))]
        row = torch.where(inside, row, torch.full_like(row, m.cell_points.shape[0] - 1))
        idx = m.cell_points.index_select(0, row)  # [B, K]
        B, K = idx.shape
        f = m.lane_feat.index_select(0, idx.view(-1)).view(B, K, -1)  # the padding point is all zero
        return _within(ego_frame(f, s.ego_xy, s.ego_yaw, 2), self.setup.cfg.vector.lane_radius)

    def actors(self, s, frame: tuple[Tensor, Tensor, Tensor],  # noqa: ANN001
               scripted: Tensor | None = None) -> dict[str, Tensor]:
        """The nearest vehicles, pedestrians and static objects within ``actor_radius`` (all of them, in slot order,
        where the set holds every slot), each also placed in the route ``frame`` (:func:`route_coordinates`), the
        moving ones with where their paths meet the route (:func:`path_meeting`; the scenario vehicles' along their
        ``scripted`` paths where given: :meth:`scripted_meeting`)."""
        v, p, o = s.veh, s.ped, s.statics
        col = lambda x: x.unsqueeze(-1).float()  # noqa: E731
        heading = lambda a: torch.stack((torch.cos(a.yaw), torch.sin(a.yaw)), -1)  # noqa: E731
        v_dir, p_dir = heading(v), heading(p)
        p_speed = torch.where(p.moving, p.speed, torch.zeros_like(p.speed)).unsqueeze(-1)
        # the scripted meetings ride along the vehicles' frame-free columns through the selection of the nearest
        extra = () if scripted is None else (scripted,)
        sets = ((OBS_VEHICLES, (v.xy, v_dir, v_dir * v.speed.unsqueeze(-1), v.half, col((v.lights & LIGHT_BRAKE) != 0),
                                col((v.lights & LIGHT_EMERGENCY) != 0), *extra, col(v.valid)), 3),
                (OBS_PEDESTRIANS, (p.xy, p_dir, p_dir * p_speed, col(p.valid)), 3),
                (OBS_STATICS, (o.xy, heading(o), o.half, col(o.valid)), 2))
        posed = [ego_frame(self._nearest(torch.cat(cols, -1), s.ego_xy, self.counts[key]), s.ego_xy, s.ego_yaw, pairs)
                 for key, cols, pairs in sets]
        if scripted is not None:  # split off again: [B, A, 4] of the vehicles kept
            extra, posed[0] = posed[0][..., -5:-1], torch.cat((posed[0][..., :-5], posed[0][..., -1:]), -1)
        along = list(route_coordinates(torch.cat([f[..., :2] for f in posed], 1), *frame).split(  # one pass for all
            [f.shape[1] for f in posed], 1))
        if self.setup.cfg.vector.path_conflicts:  # velocities are columns 4, 5 of the moving actors' sets
            moving = [i for i, (key, _, _) in enumerate(sets) if key in PATH_SETS]
            met = list(path_meeting(*straight_paths(torch.cat([posed[i][..., :2] for i in moving], 1),
                                                    torch.cat([posed[i][..., 4:6] for i in moving], 1)),
                                    *frame).split([posed[i].shape[1] for i in moving], 1))
            if scripted is not None:  # vehicles are the first moving set
                met[0] = torch.where(extra[..., 3:] > 0, extra[..., :3], met[0])
            for i, m in zip(moving, met):
                along[i] = torch.cat((along[i], m), -1)
        return {key: _within(torch.cat((f[..., :-1], a, f[..., -1:]), -1), self.setup.cfg.vector.actor_radius)
                for (key, _, _), f, a in zip(sets, posed, along)}

    def scripted_meeting(self, s, xy: Tensor, gone: Tensor) -> Tensor:  # noqa: ANN001
        """Per vehicle slot [B, A, 4]: where the scenario vehicles' scripted paths (xy [B, V, T, 2] at
        :attr:`scripted_taus`, gone [B, V, T]; the last V slots) meet the route (:func:`path_meeting`), then 1 for
        those slots; zeros for the others and for the scenario vehicles not shown or beyond ``actor_radius``. Only
        those pairs are measured (a few per cent of B x V: one host sync)."""
        B, V, T, _ = xy.shape
        A, vc = s.veh.xy.shape[1], self.setup.cfg.vector
        near = (s.veh.xy[:, A - V:] - s.ego_xy.unsqueeze(1)).square().sum(-1) <= vc.actor_radius ** 2
        b, v = (s.veh.valid[:, A - V:] & near & ~gone[..., 0]).nonzero(as_tuple=True)
        out = xy.new_zeros(B, A, 4)
        if len(b):
            _, (route, arc, ok) = self.route(s)
            pts = ego_frame(xy[b, v], s.ego_xy[b], s.ego_yaw[b], 1)  # [P, T, 2]
            met = path_meeting(pts.unsqueeze(1), self.scripted_taus, route[b], arc[b], ok[b],
                               live=~gone[b, v, :-1].unsqueeze(1)).squeeze(1)
            out[b, A - V + v] = torch.cat((met, torch.ones_like(met[:, :1])), -1)
        return out

    def _nearest(self, f: Tensor, ego_xy: Tensor, k: int) -> Tensor:
        """Of the actors (features [B, A, F]: x, y first, the validity flag last) the ``k`` nearest valid ones, nearest
        first; all of them, in slot order, when ``k`` is every slot (the radius masks them later), padded with empty
        rows when ``k`` is more (a policy trained with more slots than this env has)."""
        if k >= f.shape[1]:
            return torch.cat((f, f.new_zeros(f.shape[0], k - f.shape[1], f.shape[2])), 1) if k > f.shape[1] else f
        d = (f[..., :2] - ego_xy.unsqueeze(1)).square().sum(-1)
        d = torch.where(f[..., -1] > 0, d, torch.full_like(d, math.inf))
        _, idx = torch.topk(d, k, dim=1, largest=False)
        return torch.gather(f, 1, idx.unsqueeze(-1).expand(-1, -1, f.shape[-1]))

    def stop_lines(self, s) -> tuple[Tensor, Tensor, Tensor]:  # noqa: ANN001
        """The next ``stops`` stop lines ahead (stop-line ids, route metres to them: inf where none, stop sign or
        not), [B, stops] each."""
        w, k = self.setup.world, self.setup.cfg.vector.stops
        stop, ev_idx, near = upcoming_stop_lines(w, s.route_id, s.route_idx)
        ahead = stop_lines_ahead(w, s.route_id, s.route_idx, ev_idx)
        key = torch.where(near & (ev_idx >= s.route_idx.unsqueeze(1)), ahead, torch.full_like(ahead, math.inf))
        if key.shape[1] < k:
            key = torch.cat((key, key.new_full((key.shape[0], k - key.shape[1]), math.inf)), 1)
        dist, idx = torch.topk(key, k, dim=1, largest=False)
        stop = torch.gather(stop, 1, idx.clamp(max=stop.shape[1] - 1))
        return stop, dist, w.stop_control[stop] == CONTROL_STOP

    def stop_features(self, s, stop: Tensor, dist: Tensor, sign: Tensor, state: Tensor,  # noqa: ANN001
                      yellow_left: Tensor) -> Tensor:
        """The stop lines' features (``envs.api.VECTOR_FEATURES``) from :meth:`stop_lines` and their lights."""
        w = self.setup.world
        valid = torch.isfinite(dist)
        light = ~sign
        first_sign = sign & (torch.cumsum(sign.long(), 1) == 1)  # stop_done refers to the next sign
        line_xy = to_local(w.stop_xy[stop], s.ego_xy.unsqueeze(1), s.ego_yaw.unsqueeze(1))
        cols = torch.stack((dist.clamp(max=1e4), *line_xy.unbind(-1),
                            ((state == 0) & light).float(), ((state == 1) & light).float(),
                            ((state == 2) & light).float(), yellow_left * ((state == 1) & light), sign.float(),
                            (first_sign & s.stop_done.unsqueeze(1)).float(), valid.float()), -1)
        return cols * valid.unsqueeze(-1)

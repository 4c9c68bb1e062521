"""CaRL's nuPlan observation (``carl-reference.md`` §17) as an observation part: ``NuplanEnv(..., observer=
NuplanObserver())``.

* ``bev`` uint8 [9, H, W], ego-centred, heading up, drawn by the simulator's batched rasteriser
  (:mod:`envs.sim.bev_draw`) from the world's map raster and the state's actors. With CaRL's geometry (``bev_size``
  256, ``bev_ppm`` 2, ``bev_ego_from_bottom`` 100: the SimConfig options, so tests can run small) it covers 78 m
  ahead of the ego centre, 50 m behind and 64 m to each side. Channels (:data:`envs.api.NUPLAN_BEV_CHANNELS`):

  0. drivable area 255: the map raster's road layer (lanes and connectors; the patch has no car parks);
  1. route 255: the lanes of the route's roadblocks (the route's lanes and their left/right neighbours) and the
     connectors between two of them, where they are road;
  2. lane boundaries 255: left and right boundaries of lanes (not connectors), 1 px;
  3. traffic lights: the baselines of the connectors leaving a signalled lane, green 80 / yellow 170 / red 255;
     a group whose logged status is UNKNOWN is not drawn;
  4. stop lines: empty (CaRL's map cache has none);
  5. speed limit: lane and connector baselines, value(limit, 30 m/s);
  6. vehicles and bicycles: boxes, value(speed, 30);
  7. pedestrians value(speed, 4) and static objects 127 (value(0));
  8. ego: its box, value(speed, 30).

  value(v, vmax) = int(127.5 + 127.5 * clip(v / vmax, 0, 1)). Actors are drawn only when their centre lies in the
  area. The static layers (boundaries, speed limits) are rasterised once per world and cropped like the road.
* ``measurements`` [10] (:data:`envs.api.NUPLAN_MEASUREMENTS`): the last action in CaRL's nuPlan order (accel,
  steer; normalised, whatever the env's ``action_names`` order), then at the vehicle centre in the body frame vx,
  vy, ax, ay, then the tire steering angle, steering rate, yaw rate and yaw acceleration.
* ``value_measurements`` [4] (critic only): 1 - steps / horizon, 1 - route progress, the current comfort and TTC
  scores (all 1.0 at reset).

The measurements read these state fields (``NuplanState``): ``raw_action`` [B, 2] (the last action in the env's
order, ``ScenarioLogs.action_names``), ``ego_vel_local`` [B, 2], ``ego_acc_local`` [B, 2], ``ego_steer``,
``ego_steer_rate``, ``ego_yaw_rate``, ``ego_yaw_acc``, ``steps``, ``horizon``, ``progress``, ``comfort_score``,
``ttc_score``. Light colours come from the env's light source; which groups are known comes from ``s.light_known``
[B, G] when the state has it, else from the logged statuses (``ScenarioLogs.log_lights``, 3 = UNKNOWN), else every
group counts as known.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from envs.api import (LAYOUT_NUPLAN, NUPLAN_ACTIONS, NUPLAN_BEV_CHANNELS, NUPLAN_MEASUREMENTS,
                      NUPLAN_VALUE_MEASUREMENTS, OBS_BEV, OBS_MEASUREMENTS, OBS_VALUE_MEASUREMENTS, TensorSpec,
                      action_permutation)
from envs.maps.lanegraph import CONTROL_LIGHT
from envs.maps.rasterize import (LAYER_ROAD, MapRaster, _draw_capsules, _polyline_segments,  # noqa: PLC2701
                              _vertex_normals)
from envs.sim.agents import PEDESTRIAN_HALF
from envs.sim.world import bev_reach_m
from envs.sim.observation import bev_config
from envs.sim.parts import Observer
from envs.sim.bev_draw import BevConfig, crop_index, crop_static, draw_boxes, draw_segments, world_to_bev
from envs.sim.world import ForecastFn, LightFn, World

if TYPE_CHECKING:
    from envs.nuplan.logs import ScenarioLogs
    from envs.sim.state import Setup, SimState

# channel indices (envs.api.NUPLAN_BEV_CHANNELS)
DRIVABLE, ROUTE, BOUNDARIES, LIGHTS, STOP_LINES, SPEED_LIMIT, VEHICLES, PEDESTRIANS, EGO = range(9)
VEHICLE_VMAX, PEDESTRIAN_VMAX, SPEED_LIMIT_VMAX = 30.0, 4.0, 30.0  # m/s
STATIC_VALUE = 127  # value(0)
LIGHT_VALUES = (80, 170, 255)  # green, yellow, red (CaRL nuPlan: no yellow ramp)
LIGHT_UNKNOWN = 3  # the scenario cache's status code of an UNKNOWN light (envs/nuplan/cache.py)
MAX_HALF_EXTENT_M = 6.0  # boxes are drawn up to this half extent (a 12 m bus); longer ones are clipped
LIGHT_SEGMENT_M = 2.0  # connector baselines are drawn as chords of at most this length
LIGHT_REACH_MARGIN_M = 60.0  # a stop line this much beyond the view may still have a connector in it


def value(v: Tensor, vmax: float) -> Tensor:
    """CaRL nuPlan's colour scale: ``int(127.5 + 127.5 * clip(v / vmax, 0, 1))`` as uint8 (0 -> 127, vmax -> 255)."""
    return torch.floor(127.5 + 127.5 * (v.float() / vmax).clamp(0.0, 1.0)).to(torch.uint8)


def nuplan_measurements(s, action_order: tuple[str, ...] = NUPLAN_ACTIONS) -> Tensor:
    """The 10 policy measurements [B, 10] (:data:`envs.api.NUPLAN_MEASUREMENTS`) of a state with the fields named in
    the module docstring; ``action_order`` names the columns of ``s.raw_action`` (the env's action order): the
    measurements hold the last action in CaRL's nuPlan order (accel, steer) whatever it is."""
    accel, steer = (s.raw_action[:, i] for i in action_permutation(action_order, NUPLAN_ACTIONS))
    return torch.stack((accel, steer, s.ego_vel_local[:, 0], s.ego_vel_local[:, 1],
                        s.ego_acc_local[:, 0], s.ego_acc_local[:, 1], s.ego_steer, s.ego_steer_rate, s.ego_yaw_rate,
                        s.ego_yaw_acc), -1).float()


def nuplan_value_measurements(s) -> Tensor:
    """The 4 critic values [B, 4]: remaining time 1 - steps / horizon, remaining progress 1 - progress, comfort score,
    TTC score."""
    steps = torch.as_tensor(s.steps, device=s.progress.device).float()
    horizon = torch.as_tensor(s.horizon, device=s.progress.device).float().clamp(min=1.0)
    return torch.stack((1.0 - steps / horizon, 1.0 - s.progress.float(), s.comfort_score.float(),
                        s.ttc_score.float()), -1)


# ---------------------------------------------------------------------------------------------- per-world tables
def static_layers(world: World) -> MapRaster:
    """The road, lane-boundary and speed-limit layers on the world raster's grid (a raster of 3 layers sharing the
    world raster's ``seg_id``), rasterised once per world and cached on its raster."""
    key = ("nuplan_observation_layers",)
    hit = world.raster.cache.get(key)
    if hit is not None:
        return hit
    g, r = world.graph, world.raster
    h, w = r.height, r.width
    layers = torch.zeros(2, h, w, dtype=torch.uint8)
    i0, lane, _, _ = _polyline_segments(g.points, g.offsets, 0.0)
    if len(i0):
        radius = torch.full((len(i0),), 0.5 / r.ppm)  # 1 px lines (CaRL: cv2 polylines, thickness 1)
        inf = torch.full((len(i0),), float("inf"))
        pw = g.point_widths().astype(np.float64)
        normals = _vertex_normals(g.points, g.offsets)
        lane_keep = ~g.is_junction[lane]
        for side in (1.0, -1.0):
            p0 = g.points[i0] + side * 0.5 * pw[i0, None] * normals[i0]
            p1 = g.points[i0 + 1] + side * 0.5 * pw[i0 + 1, None] * normals[i0 + 1]
            k = torch.from_numpy(lane_keep)
            _draw_capsules(layers[0], torch.from_numpy(p0.astype(np.float32))[k],
                           torch.from_numpy(p1.astype(np.float32))[k], radius[k], -inf[k], inf[k],
                           torch.full((int(k.sum()),), 255, dtype=torch.uint8), r.origin, r.ppm)
        limit = value(torch.from_numpy(g.speed_limit[lane].astype(np.float32)), SPEED_LIMIT_VMAX)
        pts = torch.from_numpy(g.points.astype(np.float32))
        _draw_capsules(layers[1], pts[i0], pts[i0 + 1], radius, -inf, inf, limit, r.origin, r.ppm)
    stack = torch.cat((r.layers[LAYER_ROAD:LAYER_ROAD + 1].cpu(), layers)).to(r.device)
    out = MapRaster(origin=r.origin, ppm=r.ppm, layers=stack, seg_id=r.seg_id)
    r.cache[key] = out
    return out


def lane_of_pixel(world: World) -> Tensor:
    """int32 [H, W] on the world raster's grid: the lane whose segment covers each pixel (``seg_id``), -1 none."""
    seg = world.raster.seg_id.long()
    return torch.where(seg >= 0, world.seg_lane[seg.clamp(min=0)], -1).to(torch.int32)


def route_block_lanes(world: World) -> Tensor:
    """[NR, K] long: per route, the lanes of its roadblocks (its lanes and their left/right neighbours, transitively,
    for non-junction lanes) and the junction lanes joining two of them; padded with -1."""
    g = world.graph
    succ_off, succ_idx = g.succ_offsets, g.succ_index
    route_lane = world.route_lane.cpu().numpy()
    route_n = world.route_n.cpu().numpy()
    sets = []
    for k in range(len(route_n)):
        block: set[int] = set()
        for lane in np.unique(route_lane[k, :route_n[k]]).tolist():
            block.add(lane)
            if g.is_junction[lane]:
                continue
            for side in (g.left, g.right):
                nb = int(side[lane])
                while nb >= 0 and nb not in block:
                    block.add(nb)
                    nb = int(side[nb])
        conn = set()
        for lane in block:
            for c in succ_idx[succ_off[lane]:succ_off[lane + 1]].tolist():
                if g.is_junction[c] and any(int(x) in block for x in succ_idx[succ_off[c]:succ_off[c + 1]]):
                    conn.add(c)
        sets.append(sorted(block | conn))
    width = max(1, max(len(s) for s in sets))
    table = np.full((len(sets), width), -1, np.int64)
    for k, s in enumerate(sets):
        table[k, :len(s)] = s
    return torch.as_tensor(table, device=world.device)


def _chords(p: np.ndarray, step: float) -> np.ndarray:
    """A polyline resampled at equal arc length of at most ``step`` metres: [n, 2] points."""
    cum = np.concatenate([[0.0], np.cumsum(np.linalg.norm(np.diff(p, axis=0), axis=1))])
    s = np.linspace(0.0, cum[-1], max(2, int(math.ceil(cum[-1] / step)) + 1))
    return np.stack([np.interp(s, cum, p[:, 0]), np.interp(s, cum, p[:, 1])], -1)


def route_light_segments(world: World, reach_m: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per route, the connector baselines of every signalled stop line within ``reach_m`` of the route, as chords:
    (start [NR, S, 2], end [NR, S, 2], light group [NR, S], -1 padding). A stop line's connectors are the junction
    lanes leaving its lane; they show the stop line's light group."""
    g = world.graph
    succ_off, succ_idx = g.succ_offsets, g.succ_index
    per_stop = []  # (stop xy, group, [S, 2, 2] chords)
    for k in range(len(g.stop_lane)):
        if g.stop_control[k] != CONTROL_LIGHT or g.stop_light_group[k] < 0:
            continue
        lane = int(g.stop_lane[k])
        chords = []
        for c in succ_idx[succ_off[lane]:succ_off[lane + 1]].tolist():
            if g.is_junction[c]:
                q = _chords(g.lane_points(c).astype(np.float64), LIGHT_SEGMENT_M)
                chords.append(np.stack([q[:-1], q[1:]], 1))
        if chords:
            per_stop.append((g.lane_points(lane)[-1], int(g.stop_light_group[k]), np.concatenate(chords)))
    route_pts = world.route_pts.cpu().numpy()
    route_n = world.route_n.cpu().numpy()
    picks = []
    if per_stop:
        stop_xy = np.stack([xy for xy, _, _ in per_stop]).astype(np.float64)
        for k in range(len(route_n)):
            pts = route_pts[k, :route_n[k]].astype(np.float64)
            d = np.linalg.norm(pts[:, None, :] - stop_xy[None], axis=-1).min(0)
            picks.append(np.nonzero(d <= reach_m)[0])
    else:
        picks = [np.zeros(0, np.int64)] * len(route_n)
    width = max([1] + [sum(len(per_stop[i][2]) for i in p) for p in picks])
    seg = np.zeros((len(route_n), width, 2, 2), np.float32)
    group = np.full((len(route_n), width), -1, np.int64)
    for k, p in enumerate(picks):
        at = 0
        for i in p:
            _, grp, ch = per_stop[i]
            seg[k, at:at + len(ch)] = ch
            group[k, at:at + len(ch)] = grp
            at += len(ch)
    t = lambda a: torch.as_tensor(a, device=world.device)  # noqa: E731
    return t(seg[:, :, 0]).contiguous(), t(seg[:, :, 1]).contiguous(), t(group)


# ---------------------------------------------------------------------------------------------- the part
class NuplanObserver(Observer):
    """CaRL's nuPlan observation (see the module docstring) for the simulator core's state."""

    layout = LAYOUT_NUPLAN

    def __init__(self, logs: ScenarioLogs | None = None):
        self.logs = logs  # the scenarios' logs: the action order and which light statuses are known
        self.order = logs.action_names if logs is not None else NUPLAN_ACTIONS

    def bind(self, setup: Setup) -> None:
        super().bind(setup)
        self.bev: BevConfig = bev_config(setup.cfg)
        self._tables: dict | None = None  # built at the first render
        self._known_table: Tensor | None = None

    def spec(self) -> dict[str, TensorSpec]:
        n = self.setup.cfg.bev_size
        return {OBS_BEV: TensorSpec((len(NUPLAN_BEV_CHANNELS), n, n), torch.uint8, 0, 255, NUPLAN_BEV_CHANNELS),
                OBS_MEASUREMENTS: TensorSpec((len(NUPLAN_MEASUREMENTS),), torch.float32, names=NUPLAN_MEASUREMENTS),
                OBS_VALUE_MEASUREMENTS: TensorSpec((len(NUPLAN_VALUE_MEASUREMENTS),), torch.float32,
                                                   names=NUPLAN_VALUE_MEASUREMENTS)}

    def observe(self, s: SimState, lights: LightFn, speed_limit: Tensor | None = None,
                forecast: ForecastFn | None = None) -> dict[str, Tensor]:
        obs = {OBS_MEASUREMENTS: nuplan_measurements(s, self.order),
               OBS_VALUE_MEASUREMENTS: nuplan_value_measurements(s)}
        obs[OBS_BEV] = self.render(s, lights) if self.setup.cfg.bev else self.blank_bev()
        return obs

    # ------------------------------------------------------------------ the BEV
    def tables(self) -> dict:
        """The per-world tables the BEV is drawn from (built once)."""
        if self._tables is None:
            w = self.setup.world
            p0, p1, group = route_light_segments(w, bev_reach_m(self.setup.cfg) + LIGHT_REACH_MARGIN_M)
            self._tables = {"layers": static_layers(w), "route_lanes": route_block_lanes(w), "light_p0": p0,
                            "light_p1": p1, "light_group": group,
                            "light_values": torch.tensor(LIGHT_VALUES, dtype=torch.uint8, device=w.device)}
        return self._tables

    def light_known(self, s: SimState) -> Tensor | None:
        """[B, G] bool over the world's light groups: False where the status is UNKNOWN (see the module
        docstring); None when every group is known."""
        known = getattr(s, "light_known", None)
        if known is not None:
            return known
        st, scenario = self.setup, getattr(s, "scenario", None)
        if self.logs is None or scenario is None:
            return None
        log, scenarios = self.logs.log_lights, self.logs.scenarios
        G = int(st.world.group_junction.shape[0])
        if self._known_table is None:  # scenario k's column j is world group offset[k] + j (LaneGraph.concatenate)
            counts = [len(sc.graph.light_junction) for sc in scenarios]
            offset = np.cumsum([0] + counts)[:-1]
            table = np.full((len(scenarios), log.shape[-1]), G, np.int64)
            for k, (o, c) in enumerate(zip(offset, counts)):
                table[k, :c] = o + np.arange(c)
            self._known_table = torch.as_tensor(table, device=st.device)
        status = log[scenario, torch.as_tensor(s.steps, device=st.device).clamp(0, log.shape[1] - 1)]
        known = torch.zeros(len(scenario), G + 1, dtype=torch.bool, device=st.device)  # other scenarios: unknown
        known.scatter_(1, self._known_table[scenario], status != LIGHT_UNKNOWN)
        return known[:, :G]

    def render(self, s: SimState, lights: LightFn) -> Tensor:
        """The 9-channel BEV of every row of ``s``."""
        w, bc, tb = self.setup.world, self.bev, self.tables()
        B, dev = s.ego_xy.shape[0], s.ego_xy.device
        out = torch.zeros(B, len(NUPLAN_BEV_CHANNELS), bc.size, bc.size, dtype=torch.uint8, device=dev)
        crop_static(tb["layers"], [0, 1, 2], s.ego_xy, s.ego_yaw, bc, out=out,
                    out_channels=[DRIVABLE, BOUNDARIES, SPEED_LIMIT])
        pose = (s.ego_xy, s.ego_yaw, bc)
        # route: road pixels whose lane is one of the route's roadblock lanes
        lanes = crop_index(w.raster, "lane_of_pixel", lambda: lane_of_pixel(w), s.ego_xy, s.ego_yaw, bc)
        member = torch.zeros(B, w.graph.num_lanes + 1, dtype=torch.bool, device=dev)
        member.scatter_(1, tb["route_lanes"][s.route_id] + 1, True)
        member[:, 0] = False
        on_route = member.gather(1, (lanes.view(B, -1).long() + 1)).view_as(lanes) & (out[:, DRIVABLE] > 0)
        out[:, ROUTE] = on_route.view(torch.uint8) * 255
        # traffic lights on the connector baselines (UNKNOWN: not drawn)
        group = tb["light_group"][s.route_id]
        state, _ = lights(group)
        colour = tb["light_values"][state.clamp(0, 2)]
        show = group >= 0
        known = self.light_known(s)
        if known is not None:
            show &= known.gather(1, group.clamp(min=0))
        draw_segments(out[:, LIGHTS], tb["light_p0"][s.route_id], tb["light_p1"][s.route_id], 1.0 / bc.ppm, colour,
                      show, *pose, max_length_m=LIGHT_SEGMENT_M + 0.5)
        # actors whose centre lies in the area
        v, p, st = s.veh, s.ped, s.statics
        draw_boxes(out[:, VEHICLES], v.xy, v.yaw, v.half, value(v.speed, VEHICLE_VMAX), v.valid & self.in_area(v.xy, s),
                   *pose, max_extent_m=MAX_HALF_EXTENT_M)
        draw_boxes(out[:, PEDESTRIANS], p.xy, p.yaw, torch.full_like(p.xy, PEDESTRIAN_HALF),
                   value(p.speed, PEDESTRIAN_VMAX), p.valid & self.in_area(p.xy, s), *pose, max_extent_m=1.0)
        draw_boxes(out[:, PEDESTRIANS], st.xy, st.yaw, st.half, STATIC_VALUE, st.valid & self.in_area(st.xy, s),
                   *pose, max_extent_m=MAX_HALF_EXTENT_M)
        ego_half = self.setup.ego_half[:1].expand(B, 2)
        draw_boxes(out[:, EGO], s.ego_xy.unsqueeze(1), s.ego_yaw.unsqueeze(1), ego_half.unsqueeze(1),
                   value(s.ego_speed, VEHICLE_VMAX).unsqueeze(1), torch.ones(B, 1, dtype=torch.bool, device=dev),
                   *pose, max_extent_m=MAX_HALF_EXTENT_M)
        return out

    def in_area(self, xy: Tensor, s: SimState) -> Tensor:
        """[B, N] bool: points whose BEV pixel lies in the image (CaRL renders objects whose centre is in the area)."""
        px = world_to_bev(xy.float(), s.ego_xy.float(), s.ego_yaw.float(), self.bev)
        lim = self.bev.size - 0.5
        return ((px > -0.5) & (px < lim)).all(-1)

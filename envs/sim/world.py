"""The static world on the device: lane tensors, traffic control, crosswalks, map raster and the route bank.

Built once per environment object from a :class:`~envs.maps.lanegraph.LaneGraph` and a list of routes; everything
the step needs is a tensor here so that the step itself never touches Python objects.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from envs.maps.lanegraph import LaneGraph, MapError
from envs.maps.atlas import build_atlas
from envs.maps.rasterize import MapRaster, load_or_compile_raster
from envs.maps.routes import (MIN_LANE_CHANGE_LENGTH, Route, RouteError, parse_leaderboard_xml, plan_route,
                              project_on_segments, random_routes)
from envs.sim.config import SimConfig
from envs.sim.scenario_world import ScenarioTables, compile_scenarios, random_route_scenarios, start_before_scenario
from envs.maps.scenarios import parse_route_scenarios, scenarios_on_route


@dataclass
class World:
    graph: LaneGraph
    raster: MapRaster
    device: torch.device
    # lanes, resampled uniformly per lane (spacing lane_len / (n-1))
    lane_pts: Tensor  # [L, Pmax, 2]
    lane_len: Tensor  # [L]
    lane_spacing: Tensor  # [L]
    lane_width: Tensor  # [L]
    lane_speed: Tensor  # [L]
    lane_junction: Tensor  # [L] bool
    lane_junction_id: Tensor  # [L] long: the junction a junction lane belongs to (-1: none)
    lane_kerb: Tensor  # [L] bool: no same-direction lane to the right (its right edge is the kerb)
    succ_off: Tensor  # [L] start of successors in succ_idx
    succ_count: Tensor  # [L]
    succ_idx: Tensor  # [E]
    lane_stop: Tensor  # [L] stop-line index at the end of the lane, -1 none
    spawn_lanes: Tensor  # [S] non-junction lanes long enough to spawn on
    spawn_cdf: Tensor  # [S] cumulative length weights
    # traffic control
    stop_control: Tensor  # [K]
    stop_group: Tensor  # [K] light group (-1 for stop signs)
    stop_xy: Tensor  # [K, 2] stop-line centre
    stop_yaw: Tensor  # [K]
    stop_width: Tensor  # [K] lane width
    group_junction: Tensor  # [G]
    group_phase: Tensor  # [G]
    group_phases: Tensor  # [G]
    num_junctions: int
    # map lookups through the raster's seg_id
    seg_start: Tensor  # [P, 2] graph.points (a lane's last point: the point before it)
    seg_end: Tensor  # [P, 2] next point of the same lane (a lane's last point: itself)
    seg_lane: Tensor  # [P]
    seg_width: Tensor  # [P] lane width at each lane point (follows width polynomials; lane graph format 2)
    crosswalks: Tensor  # [C, 4, 2]
    # routes
    route_pts: Tensor  # [NR, R, 2] (padded by repeating the last point)
    route_cum: Tensor  # [NR, R]
    route_len: Tensor  # [NR]
    route_n: Tensor  # [NR] number of valid points
    route_lane: Tensor  # [NR, R]
    route_s: Tensor  # [NR, R] arc position of each route point on its lane
    route_junction: Tensor  # [NR, R] bool
    route_ev_idx: Tensor  # [NR, E] route point index of each stop line passed, R (past the end) as padding
    route_ev_stop: Tensor  # [NR, E] stop-line index, -1 padding
    route_names: list[str]
    # maps (a multi-map world holds several maps side by side: envs/maps/atlas.py)
    map_names: list[str]
    route_map: Tensor  # [NR] map of each route
    lane_map: Tensor  # [L] map of each lane
    route_cdf: Tensor  # [NR] cumulative probability of drawing each route (map weight / routes of that map)
    map_lane_km: Tensor  # [M] lane length of each map
    map_local_lane_km: Tensor  # [M] mean lane length within LOCAL_RADIUS of a lane point
    # route scenarios (envs/sim/scenario_world.py): the tables, and every route's scenarios, kept or skipped with why
    scn: ScenarioTables
    route_scenarios: list[tuple]
    # tables that parts derive from the world once and share (e.g. the vector observation's), by the part's key
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def has_scenarios(self) -> bool:
        """Whether any route of the world carries a scenario to play."""
        return bool((self.scn.route_scn >= 0).any())

    @property
    def num_routes(self) -> int:
        return self.route_pts.shape[0]

    @property
    def num_maps(self) -> int:
        return len(self.map_names)


# a route crosses a lane's stop line where it leaves the lane within this of the lane's end (route points are ~1 m
# apart; a lane change leaves a lane at least MIN_LANE_CHANGE_LENGTH before its end, and does not cross its line)
STOP_LINE_REACH = 0.5 * MIN_LANE_CHANGE_LENGTH
LOCAL_RADIUS = 120.0  # metres around the ego that background traffic lives in (agents.respawn_vehicles' ``far``)


def _local_lane_km(points: np.ndarray, spacing: float, seed: int = 0, samples: int = 64) -> float:
    """Mean lane length (km) within :data:`LOCAL_RADIUS` of a random lane point: what the ego's surroundings hold."""
    rng = np.random.default_rng(seed)
    probe = points[rng.integers(len(points), size=min(samples, len(points)))]
    near = np.zeros(len(probe))
    for c in range(0, len(points), 65536):
        d = np.linalg.norm(points[None, c:c + 65536] - probe[:, None], axis=-1)
        near += (d < LOCAL_RADIUS).sum(1)
    return float(near.mean() * spacing / 1000.0)


def map_cache_dir(cfg: SimConfig) -> Path:
    """Where compiled map rasters are cached (``env.cache_dir``, default ``~/.cache/carl/maps``)."""
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else Path.home() / ".cache" / "carl" / "maps"


def build_world(graph: LaneGraph, routes: list[Route], cfg: SimConfig, device: torch.device,
                raster: MapRaster | None = None, map_names: list[str] | None = None,
                lane_offsets: np.ndarray | None = None, route_map: np.ndarray | None = None,
                map_weights: tuple[float, ...] = ()) -> World:
    """Compile a lane graph and routes into device tensors.

    A multi-map world (an :class:`~envs.maps.atlas.Atlas`) passes its raster, the maps' names, the lane range of
    each map (``lane_offsets`` [M + 1]), the map of every route and the maps' sampling weights (default: equal).
    """
    if not routes:
        raise MapError(f"map '{graph.name}': no routes to drive; check env.route_length and the route file")
    if raster is None:
        raster = load_or_compile_raster(graph, cfg.map_ppm, map_cache_dir(cfg))
    raster = raster.to(device)
    map_names = map_names or [graph.name]
    M = len(map_names)
    lane_offsets = np.asarray([0, graph.num_lanes] if lane_offsets is None else lane_offsets)
    route_map = np.zeros(len(routes), np.int64) if route_map is None else np.asarray(route_map, np.int64)
    weights = np.asarray(map_weights or [1.0] * M, np.float64)
    L = graph.num_lanes
    lane_pts, lens, spacing = _resampled_lanes(graph)
    lane_stop = np.full(L, -1, np.int64)
    lane_stop[graph.stop_lane] = np.arange(len(graph.stop_lane))
    graph = graph.with_control_rows()  # no lights/stop lines (roundabouts): an inert row keeps padded indices valid
    spawn_lanes, spawn_cdf, lane_km, local_km = _spawn_tables(graph, lens, lane_offsets, M)
    per_route = weights[route_map] / np.bincount(route_map, minlength=M)[route_map]
    route_cdf = np.cumsum(per_route) / per_route.sum()
    end_pts, end_dir = _stop_line_poses(graph)
    seg_start, seg_end, seg_lane = _lane_segments(graph)
    rt = _route_tables(routes, lane_stop, end_pts)
    scn, route_scenarios = compile_scenarios(graph, routes, device)

    t = lambda a, dtype=None: torch.as_tensor(np.ascontiguousarray(a), dtype=dtype, device=device)  # noqa: E731
    lane_pts_t, route_lane_t, spacing_t = t(lane_pts), t(rt["route_lane"]), t(spacing, torch.float32)
    return World(
        graph=graph, raster=raster, device=device, lane_pts=lane_pts_t, lane_len=t(lens, torch.float32),
        lane_spacing=spacing_t, lane_width=t(graph.width), lane_speed=t(graph.speed_limit),
        lane_junction=t(graph.is_junction),
        lane_junction_id=t(np.where(graph.is_junction, graph.junction, -1), torch.long),
        lane_kerb=t(graph.right < 0), succ_off=t(graph.succ_offsets[:-1], torch.long),
        succ_count=t(np.diff(graph.succ_offsets), torch.long), succ_idx=t(graph.succ_index, torch.long),
        lane_stop=t(lane_stop), spawn_lanes=t(spawn_lanes, torch.long), spawn_cdf=t(spawn_cdf, torch.float32),
        stop_control=t(graph.stop_control, torch.long), stop_group=t(graph.stop_light_group, torch.long),
        stop_xy=t(end_pts, torch.float32), stop_yaw=t(np.arctan2(end_dir[:, 1], end_dir[:, 0]), torch.float32),
        stop_width=t(graph.width[graph.stop_lane]),
        group_junction=t(graph.light_junction, torch.long), group_phase=t(graph.light_phase, torch.long),
        group_phases=t(graph.light_num_phases, torch.long),
        num_junctions=int(max(graph.junction.max(initial=-1), graph.light_junction.max(initial=-1)) + 1),
        seg_start=t(seg_start, torch.float32), seg_end=t(seg_end, torch.float32), seg_lane=t(seg_lane, torch.long),
        seg_width=t(graph.point_widths(), torch.float32), crosswalks=t(graph.crosswalks),
        route_pts=t(rt["route_pts"]), route_cum=t(rt["route_cum"]), route_len=t(rt["route_len"]),
        route_n=t(rt["route_n"]), route_lane=route_lane_t,
        route_s=_route_arc(lane_pts_t, spacing_t, route_lane_t, rt["route_pts"], device),
        route_junction=t(graph.is_junction)[route_lane_t],
        route_ev_idx=t(rt["ev_idx"]), route_ev_stop=t(rt["ev_stop"]), route_names=[r.name for r in routes],
        map_names=list(map_names), route_map=t(route_map),
        lane_map=t(np.repeat(np.arange(M), np.diff(lane_offsets)), torch.long), route_cdf=t(route_cdf, torch.float32),
        map_lane_km=t(lane_km, torch.float32), map_local_lane_km=t(local_km, torch.float32),
        scn=scn, route_scenarios=route_scenarios,
    )


def _resampled_lanes(graph: LaneGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every lane resampled at ~1 m (lane points [L, P, 2], padded by a tiny extrapolation past the end), the lanes'
    lengths and their point spacing."""
    L = graph.num_lanes
    lens = graph.lane_lengths().astype(np.float64)
    n_pts = np.maximum(2, np.ceil(lens / 1.0).astype(np.int64) + 1)
    pmax = int(n_pts.max())
    lane_pts = np.zeros((L, pmax, 2), np.float32)
    for i in range(L):
        p = graph.lane_points(i).astype(np.float64)
        cum = np.concatenate([[0.0], np.cumsum(np.linalg.norm(np.diff(p, axis=0), axis=1))])
        s = np.linspace(0.0, cum[-1], n_pts[i])
        res = np.stack([np.interp(s, cum, p[:, 0]), np.interp(s, cum, p[:, 1])], -1)
        lane_pts[i, : n_pts[i]] = res
        lane_pts[i, n_pts[i]:] = res[-1] + (res[-1] - res[-2]) * np.arange(1, pmax - n_pts[i] + 1)[:, None] * 1e-3
    return lane_pts, lens, lens / (n_pts - 1)


def _spawn_tables(graph: LaneGraph, lens: np.ndarray, lane_offsets: np.ndarray, M: int) -> tuple[np.ndarray, ...]:
    """Spawn places per map: map k's cumulative length weights run over (k, k + 1], so one searchsorted of
    ``map + uniform`` draws a place on the row's own map. Returns (spawn lanes, their cdf, each map's lane km, its
    lane km around a point)."""
    L = graph.num_lanes
    spawn_parts, cdf_parts, lane_km, local_km = [], [], [], []
    for k in range(M):
        lo, hi = int(lane_offsets[k]), int(lane_offsets[k + 1])
        own = np.zeros(L, bool)
        own[lo:hi] = True
        spawnable = own & (~graph.is_junction) & (lens > 10.0)
        if not spawnable.any():
            spawnable = own & (lens > 0)
        lanes_k = np.nonzero(spawnable)[0]
        cdf = np.cumsum(lens[lanes_k])
        spawn_parts.append(lanes_k)
        cdf_parts.append(k + cdf / cdf[-1])
        pts_k = graph.points[graph.offsets[lo]:graph.offsets[hi]]
        lane_km.append(float(lens[lo:hi].sum()) / 1000.0)
        local_km.append(_local_lane_km(pts_k, float(lens[lo:hi].sum()) / max(len(pts_k), 1)))
    return np.concatenate(spawn_parts), np.concatenate(cdf_parts), np.asarray(lane_km), np.asarray(local_km)


def _stop_line_poses(graph: LaneGraph) -> tuple[np.ndarray, np.ndarray]:
    """Stop lines sit at lane ends: their points [S, 2] and the lanes' directions there."""
    if not len(graph.stop_lane):
        return np.zeros((0, 2), np.float32), np.zeros((0, 2), np.float32)
    end_pts = np.stack([graph.lane_points(int(l))[-1] for l in graph.stop_lane])
    end_dir = np.stack([graph.lane_points(int(l))[-1] - graph.lane_points(int(l))[-2] for l in graph.stop_lane])
    return end_pts, end_dir


def _lane_segments(graph: LaneGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, lane) of the segment at every lane point: each point starts the segment to its successor; a
    lane's last point reuses its last segment, so no segment is degenerate (a zero-length one has no direction:
    lane heading 0 whatever the lane's)."""
    seg_lane = np.repeat(np.arange(graph.num_lanes), np.diff(graph.offsets))
    idx = np.arange(len(graph.points))
    nxt = np.minimum(idx + 1, len(graph.points) - 1)
    prv = np.maximum(idx - 1, 0)
    last = seg_lane[nxt] != seg_lane
    last[-1] = True
    has_prev = seg_lane[prv] == seg_lane
    has_prev[0] = False
    seg_start = np.where((last & has_prev)[:, None], graph.points[prv], graph.points)
    seg_end = np.where(last[:, None], graph.points, graph.points[nxt])
    return seg_start, seg_end, seg_lane


def _route_tables(routes: list[Route], lane_stop: np.ndarray, stop_xy: np.ndarray) -> dict[str, np.ndarray]:
    """The route bank padded to its longest route (by repeating the last point): points, lanes, lengths, arc
    lengths, and each route's stop-line events: the route point index where the route leaves a lane through its
    stop line (its step off the lane passes within ``STOP_LINE_REACH`` of the line's point ``stop_xy`` [S, 2], the
    lane's end), and the stop line. A route that changes lanes off a lane before its line never crosses that line (lane changes start
    at least ``MIN_LANE_CHANGE_LENGTH`` before a lane's end); it crosses the line of the lane it changed to."""
    R = max(len(r.points) for r in routes)
    NR = len(routes)
    route_pts = np.zeros((NR, R, 2), np.float32)
    route_lane = np.zeros((NR, R), np.int64)
    route_n = np.zeros(NR, np.int64)
    events: list[list[tuple[int, int]]] = []
    for k, r in enumerate(routes):
        n = len(r.points)
        if n < 3:
            raise MapError(f"route '{r.name}' has {n} points; a route needs at least 3")
        route_pts[k, :n] = r.points
        route_pts[k, n:] = r.points[-1]
        route_lane[k, :n] = r.lanes
        route_lane[k, n:] = r.lanes[-1]
        route_n[k] = n
        lanes = np.asarray(r.lanes, np.int64)
        i = np.nonzero((lanes[:-1] != lanes[1:]) & (lane_stop[lanes[:-1]] >= 0))[0]
        stop = lane_stop[lanes[i]]
        _, off = project_on_segments(r.points[i], r.points[i + 1], np.zeros(len(i)), stop_xy[stop])
        keep = off <= STOP_LINE_REACH
        events.append(list(zip(i[keep].tolist(), stop[keep].tolist())))
    E = max(1, max(len(e) for e in events))
    ev_idx = np.full((NR, E), R, np.int64)
    ev_stop = np.full((NR, E), -1, np.int64)
    for k, ev in enumerate(events):
        for j, (i, s) in enumerate(ev):
            ev_idx[k, j], ev_stop[k, j] = i, s
    seg = np.linalg.norm(np.diff(route_pts, axis=1), axis=-1)
    route_cum = np.concatenate([np.zeros((NR, 1)), np.cumsum(seg, axis=1)], axis=1).astype(np.float32)
    return {"route_pts": route_pts, "route_lane": route_lane, "route_n": route_n, "ev_idx": ev_idx,
            "ev_stop": ev_stop, "route_cum": route_cum, "route_len": route_cum[np.arange(NR), route_n - 1]}


def _route_arc(lane_pts: Tensor, spacing: Tensor, route_lane: Tensor, route_pts: np.ndarray,
               device: torch.device) -> Tensor:
    """Arc position of each route point on its lane (nearest resampled lane point), chunked over routes."""
    NR, R = route_lane.shape
    route_s = torch.empty(NR, R, device=device)
    for c in range(0, NR, 16):
        lanes = route_lane[c:c + 16]
        pts = torch.as_tensor(np.ascontiguousarray(route_pts[c:c + 16]), device=device)
        d = (lane_pts[lanes] - pts.unsqueeze(-2)).norm(dim=-1)
        route_s[c:c + 16] = d.argmin(-1).float() * spacing[lanes]
    return route_s


LightFn = Callable[[Tensor], tuple[Tensor, Tensor]]
"""Light groups [B, N] (-1 = none) -> (state 0 green / 1 yellow / 2 red, seconds of yellow left): how a backend
tells the shared code the colour of its lights (the simulator's cycle model, CARLA's actors, nuPlan's log)."""


ForecastFn = Callable[[Tensor], tuple[Tensor, Tensor, Tensor]]
"""Times [T] (s from now) -> where the route scenarios' vehicles will be on their scripted paths (xy [B, V, T, 2], yaw
[B, V, T], gone [B, V, T]), V the scenario vehicle slots (the last of the vehicle slots) in slot order: what a backend
that plays the scenarios itself knows of their paths."""


def light_state(world: World, group: Tensor, t: Tensor, offset: Tensor, cfg: SimConfig) -> tuple[Tensor, Tensor]:
    """Colour of light groups at time ``t``: (state 0 green / 1 yellow / 2 red, seconds of yellow left).

    group: [B, N] light-group indices (-1 = none -> green); t: [B]; offset: [B, J] per-junction cycle offsets.
    """
    g = group.clamp(min=0)
    phase_len = cfg.light_green + cfg.light_yellow + cfg.light_all_red
    cycle = world.group_phases[g].float() * phase_len
    junction = world.group_junction[g]
    local = torch.remainder(t.unsqueeze(-1) + torch.gather(offset, 1, junction), cycle)
    rel = local - world.group_phase[g].float() * phase_len
    green = (rel >= 0) & (rel < cfg.light_green)
    yellow = (rel >= cfg.light_green) & (rel < cfg.light_green + cfg.light_yellow)
    state = torch.where(green, 0, torch.where(yellow, 1, 2))
    state = torch.where(group < 0, torch.zeros_like(state), state)
    yellow_left = (cfg.light_green + cfg.light_yellow - rel).clamp(0.0, cfg.light_yellow)
    return state, yellow_left


def lane_lookup(world: World, xy: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Nearest lane under points ``xy[..., 2]`` via the raster: (lane, signed lateral offset, lane yaw, found, lane
    width there)."""
    r = world.raster
    pix = r.world_to_pixel(xy)
    H, W = r.seg_id.shape
    col = pix[..., 0].floor().long()
    row = pix[..., 1].floor().long()
    inside = (col >= 0) & (col < W) & (row >= 0) & (row < H)
    seg = r.seg_id[row.clamp(0, H - 1), col.clamp(0, W - 1)].long()
    found = inside & (seg >= 0)
    seg = seg.clamp(min=0)
    a, b = world.seg_start[seg], world.seg_end[seg]
    d = b - a
    yaw = torch.atan2(d[..., 1], d[..., 0])
    n = d / d.norm(dim=-1, keepdim=True).clamp(min=1e-6)
    w = xy - a
    lateral = n[..., 0] * w[..., 1] - n[..., 1] * w[..., 0]
    return world.seg_lane[seg], lateral, yaw, found, world.seg_width[seg]


def sample_spawn(world: World, shape: tuple[int, ...], gen: torch.Generator, map_id: Tensor) -> tuple[Tensor, Tensor]:
    """Random (lane, s) positions on spawnable lanes of each row's map (``map_id`` [B], rows first in ``shape``),
    uniform over length."""
    u = torch.rand(shape, generator=gen, device=world.device) + map_id.view(-1, *([1] * (len(shape) - 1)))
    k = torch.searchsorted(world.spawn_cdf, u.reshape(-1), right=True).reshape(shape).clamp(max=len(world.spawn_lanes) - 1)
    lane = world.spawn_lanes[k]
    s = torch.rand(shape, generator=gen, device=world.device) * world.lane_len[lane]
    return lane, s


# ---------------------------------------------------------------------------------------------- a config's world
_WORLDS: dict[tuple, World] = {}


def load_world(cfg: SimConfig, device: torch.device, route_seed: int = 0) -> World:
    """The maps and route bank for ``cfg`` (procedural towns, CARLA towns, map files, or a mix of them) on
    ``device``.

    Worlds are immutable, so they are shared between environment objects of the same process.
    """
    key = (cfg.map, cfg.maps, cfg.map_weights, repr(cfg.procedural), cfg.town_seeds, cfg.eval_town_seeds,
           cfg.route_split, cfg.route_file, cfg.route_scenarios, cfg.scenario_density, cfg.scenario_weights, cfg.scenario_start,
           cfg.route_length, cfg.route_turn_bias, cfg.route_junction_start, cfg.route_lane_changes, cfg.num_routes,
           cfg.map_ppm, cfg.bev_size, cfg.bev_ppm, cfg.bev_ego_from_bottom, str(device), route_seed)
    if key not in _WORLDS:
        _WORLDS[key] = _build_world(cfg, device, route_seed)
    return _WORLDS[key]


EVAL_ROUTE_SEED = 7919  # seed of the held-out random route bank (route_split=eval)


def map_routes(graph: LaneGraph, name: str, cfg: SimConfig, route_seed: int = 0,
               key: str = "env.options.map (or env.options.maps)", noun: str = "map") -> list[Route]:
    """The routes of one map: those of ``cfg.route_file`` for this town, else a seeded bank of random routes
    (``key``, ``noun``: the option that picks the map and what it calls it, for the error)."""
    if cfg.route_file:
        town = Path(name).stem
        defs = parse_route_scenarios(cfg.route_file) if cfg.route_scenarios else {}
        routes = []
        for rid, t, kp in parse_leaderboard_xml(cfg.route_file):
            if t == town:
                r = plan_route(graph, kp, name=f"{t}_{rid}")
                r.source = f"route file {cfg.route_file}: route {rid} ({r.name})"
                r.scenarios = tuple(scenarios_on_route(defs.get(rid, []), r.points, r.source))
                routes.append(r)
        if not routes:
            raise MapError(f"route file {cfg.route_file} has no routes for {noun} '{town}'; set {key} to a {noun} it uses")
        return routes
    seed = EVAL_ROUTE_SEED if cfg.route_split == "eval" else route_seed
    routes = random_routes(graph, cfg.num_routes, cfg.route_length, seed=seed, turn_bias=cfg.route_turn_bias,
                           junction_start=cfg.route_junction_start, allow_lane_changes=cfg.route_lane_changes)
    rng = np.random.default_rng([seed, 23])
    for r in routes:
        r.scenarios = random_route_scenarios(graph, r, cfg.scenario_density, cfg.scenario_weights, rng)
    if cfg.scenario_start > 0:  # its own stream: the banks without it stay as they were
        lead = np.random.default_rng([seed, 29])
        routes = [start_before_scenario(r, lead) if r.scenarios and lead.random() < cfg.scenario_start else r
                  for r in routes]
    return routes


def bev_reach_m(cfg: SimConfig) -> float:
    """Farthest distance from the ego that its BEV shows (the corner of the image farthest from the ego)."""
    row = cfg.bev_size - 1 - cfg.bev_ego_from_bottom
    return math.hypot(cfg.bev_size // 2 + 1, max(row, cfg.bev_size - 1 - row) + 1) / cfg.bev_ppm


def _build_world(cfg: SimConfig, device: torch.device, route_seed: int) -> World:
    names = list(cfg.maps) or [cfg.map]
    graphs, routes_by_map = [], []
    for k, name in enumerate(names):
        try:
            graph = load_graph(dataclasses.replace(cfg, map=name)).compact_junctions()
            routes_by_map.append(map_routes(graph, name, cfg, route_seed))
        except (MapError, RouteError) as exc:
            if not cfg.maps:
                raise
            raise type(exc)(f"env.options.maps[{k}]={name!r}: {exc}") from None
        graphs.append(graph)
    if len(names) == 1:
        return build_world(graphs[0], routes_by_map[0], cfg, device)
    rasters = [load_or_compile_raster(g, cfg.map_ppm, map_cache_dir(cfg)) for g in graphs]
    # no BEV shows another map (traffic, pedestrians and spawns are drawn on the row's own map anyway)
    atlas = build_atlas(graphs, rasters, gap_m=bev_reach_m(cfg) + 10.0)
    moved = [[Route(r.name, (r.points + atlas.shifts[k]).astype(np.float32), r.lanes + atlas.lane_offsets[k], r.scenarios)
              for r in rs] for k, rs in enumerate(routes_by_map)]
    # interleaved (route j of every map, then route j + 1, ...): the first N routes of a fixed assignment (the eval
    # split) cover every map
    order = sorted(((j, k) for k, rs in enumerate(moved) for j in range(len(rs))))
    routes = [moved[k][j] for j, k in order]
    return build_world(atlas.graph, routes, cfg, device, raster=atlas.raster, map_names=names,
                       lane_offsets=atlas.lane_offsets, route_map=np.array([k for _, k in order]),
                       map_weights=cfg.map_weights)


def load_graph(cfg: SimConfig) -> LaneGraph:
    if cfg.map == "procedural":
        from envs.maps.procedural import generate_world

        seeds = cfg.eval_town_seeds if cfg.route_split == "eval" else cfg.town_seeds
        return generate_world(cfg.procedural, list(seeds))
    if cfg.map.endswith(".npz"):
        return LaneGraph.load(cfg.map)
    from envs.maps import opendrive

    if cfg.map.endswith(".xodr"):
        return opendrive.load_opendrive(cfg.map)
    return opendrive.load_town(cfg.map)

"""Procedural towns compiled to the lane-graph map format.

A town is a set of junction *nodes* on a ``rows x cols`` lattice joined by two-way *roads* between 4-neighbours.
``kind="irregular"`` jitters node positions and drops some roads while keeping every node at degree >= 2 and the
lane graph strongly connected. Every road gets ``n`` lanes per direction (right-hand traffic: each direction's
lanes lie to the right of the road axis, lane 0 innermost next to the centre line, lane ``n-1`` outermost).

Design decisions (documented here because downstream code relies on them):

* **Junction radius.** Roads stop ``R`` metres before a node's centre. ``R`` is per node:
  ``R = max(w, w / tan(theta_min / 2)) + JUNCTION_EXTRA`` where ``w`` is the widest half-road (lanes plus shoulder)
  meeting there and ``theta_min`` the smallest angle between two of its roads (capped at 90 degrees). The first term
  keeps the road boxes of neighbouring arms from overlapping, the extra leaves room for the crosswalk band (1 m gap,
  3 m deep, 1 m gap) and gives the tightest right turn a radius of about ``lane_width / 2 + shoulder + 5`` m.
* **Degree-2 nodes** (corners, and bends left by dropped roads) are connected through with one connector per lane
  pair, marked ``is_junction=True`` with ``junction=<node id>`` so every lane inside a node area is a junction
  lane, but they get no traffic control, stop lines or crosswalks.
* **Movements.** For each approach, the outgoing road with the smallest turn angle below 60 degrees is
  *straight* (lane k -> lane k; when the lane count changes, surplus lanes merge into, or fan out from, the
  outermost lane, so a straight movement links every lane of both roads); other roads to the left get a left
  turn from the leftmost incoming lane to the leftmost outgoing lane, roads to the right a right turn from the
  rightmost to the rightmost; U-turns are never generated. Two fill-in rules keep the graph free of dead ends:
  an incoming lane without any movement (e.g. the middle lane of a T-junction stem) turns into the same-side
  lane of the nearest left/right road, and an outgoing lane nothing reaches is fed from the same-side lane of
  the most straight approach. Parallel same-side mappings do not cross each other.
* **Connectivity** is verified on the driving graph of successors *plus* lane changes (``left``/``right`` on road
  lanes), the graph the route planner searches. Successors alone are in general not strongly connected under the
  turn rules above: on a multi-lane road the inner lane is fed only by left turns and the outer only by right
  turns, so clockwise and counter-clockwise circulation may never meet without a lane change (a 2x3 grid is an
  example). Every lane still has a successor (no dead ends), and with one lane per direction successors alone are
  strongly connected.
* **Irregular layouts** jitter nodes by up to ``JITTER * block`` (less when ``block`` is near its minimum), drop
  up to ``DROP_FRACTION`` of the roads without creating degree-1 nodes or disconnecting the town, restore dropped
  roads (latest first) until the lane graph is strongly connected, and redraw the jitter if a road is too short.
* **Shoulders** are stored as the centre line of the shoulder strip (offset ``n * lane_width + shoulder / 2`` to
  the right of the road axis) with the shoulder width, one per road direction.
* Node ids are junction ids; in :func:`generate_world` they are offset per town so they stay unique.

One file, on purpose: layout, movements, controls and compilation are one algorithm over the private ``_Town`` /
``_Road`` records; the public surface is :class:`ProceduralConfig`, :func:`generate_town` and :func:`generate_world`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

from envs.maps.lanegraph import (
    CONTROL_LIGHT,
    CONTROL_STOP,
    MARK_BROKEN,
    MARK_NONE,
    MARK_SOLID,
    Lane,
    LaneGraph,
    LightGroup,
    MapError,
    StopLine,
)

JUNCTION_EXTRA = 5.0  # m added to the junction radius: crosswalk band and turn room (see module docstring)
CROSSWALK_GAP = 1.0  # m between the stop line and the crosswalk, and between the crosswalk and the junction core
CROSSWALK_DEPTH = 3.0  # m along the road
MIN_ROAD_LENGTH = 15.0  # m of straight road needed between two junction areas (speed sign, stop line, queueing)
JITTER = 0.2  # irregular: max node displacement as a fraction of block (less for short blocks: _jitter)
DROP_FRACTION = 0.25  # irregular: fraction of roads we try to remove
STRAIGHT_MAX_TURN = math.radians(60.0)  # a movement turning less than this may be the straight one
MAX_LAYOUT_TRIES = 50
CONNECTOR_SPACING = 0.25  # m target spacing of Bezier samples (build resamples to <= 1 m anyway)


@dataclass
class ProceduralConfig:
    """Parameters of a procedural town; everything random is sampled from the seed given to the generator."""

    kind: str = "grid"  # "grid" (regular) or "irregular" (jittered nodes, some roads removed)
    rows: int = 3  # junction nodes
    cols: int = 3  # junction columns of the grid
    block: float = 80.0  # nominal spacing between junction centres (m)
    lanes_per_direction: tuple[int, int] = (1, 2)  # inclusive range sampled per road (1..3 allowed)
    lane_width: float = 3.5  # m
    speed_limits: tuple[float, ...] = (8.33, 11.11, 13.89)  # m/s sampled per road
    signal_fraction: float = 0.6  # fraction of degree>=3 junctions with traffic lights; the rest are all-way stop
    shoulder_width: float = 1.5  # m
    crosswalks: bool = True  # crosswalks at junctions


# ---------------------------------------------------------------------------------------------------- validation
def _min_block(cfg: ProceduralConfig) -> float:
    """Shortest ``block`` that fits two right-angle junction areas plus a minimal road at the widest lane count.

    Irregular towns shrink their jitter towards this bound instead of needing more room (see :func:`_jitter`).
    """
    w = cfg.lanes_per_direction[1] * cfg.lane_width + cfg.shoulder_width
    return 2.0 * (w + JUNCTION_EXTRA) + MIN_ROAD_LENGTH


def _jitter(cfg: ProceduralConfig) -> float:
    """Max node displacement (fraction of block) for irregular towns: ``JITTER``, reduced for short blocks.

    Two jittered neighbours can end up ``(1 - 2 * jitter) * block`` apart, which must still fit two junction areas
    and a road; without this the layout retries would fail for blocks near the minimum.
    """
    return min(JITTER, max(0.0, 0.5 * (1.0 - _min_block(cfg) / cfg.block)))


def validate_config(cfg: ProceduralConfig) -> None:
    """Raise :class:`MapError` naming the field, its value and the allowed range for the first bad field."""

    def bad(field: str, value: object, allowed: str) -> MapError:
        return MapError(f"ProceduralConfig.{field}={value!r} is invalid; allowed: {allowed}")

    if cfg.kind not in ("grid", "irregular"):
        raise bad("kind", cfg.kind, "'grid' or 'irregular'")
    for f in ("rows", "cols"):
        v = getattr(cfg, f)
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not 2 <= v <= 64:
            raise bad(f, v, "an integer in 2..64")
    if cfg.rows == 2 and cfg.cols == 2:
        raise bad("rows", cfg.rows, ">= 3 when cols=2 (a 2x2 grid is a single ring, which cannot be strongly "
                                    "connected without U-turns)")
    lpd = tuple(cfg.lanes_per_direction)
    if (len(lpd) != 2 or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in lpd)
            or not 1 <= lpd[0] <= lpd[1] <= 3):
        raise bad("lanes_per_direction", cfg.lanes_per_direction, "(lo, hi) integers with 1 <= lo <= hi <= 3")
    if not (np.isfinite(cfg.lane_width) and 2.5 <= cfg.lane_width <= 5.0):
        raise bad("lane_width", cfg.lane_width, "2.5..5.0 m")
    if not (np.isfinite(cfg.shoulder_width) and 0.0 <= cfg.shoulder_width <= 5.0):
        raise bad("shoulder_width", cfg.shoulder_width, "0.0..5.0 m")
    if len(cfg.speed_limits) == 0 or not all(np.isfinite(v) and 0.0 < v <= 40.0 for v in cfg.speed_limits):
        raise bad("speed_limits", cfg.speed_limits, "a non-empty tuple of values in (0, 40] m/s")
    if not (np.isfinite(cfg.signal_fraction) and 0.0 <= cfg.signal_fraction <= 1.0):
        raise bad("signal_fraction", cfg.signal_fraction, "0.0..1.0")
    if not isinstance(cfg.crosswalks, (bool, np.bool_)):
        raise bad("crosswalks", cfg.crosswalks, "True or False")
    need = _min_block(cfg)
    if not (np.isfinite(cfg.block) and need <= cfg.block <= 1000.0):
        raise bad("block", cfg.block, f"{need:.1f}..1000 m (shorter blocks cannot fit junctions for "
                                      f"lanes_per_direction up to {lpd[1]} with lane_width={cfg.lane_width})")


# ---------------------------------------------------------------------------------------------------- geometry
def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def _right(d: np.ndarray) -> np.ndarray:
    """Right-hand normal of a unit direction (x east, y north)."""
    return np.array([d[1], -d[0]])


def _wrap(a: float) -> float:
    return (a + math.pi) % (2.0 * math.pi) - math.pi


def _bezier(p0: np.ndarray, h0: np.ndarray, p3: np.ndarray, h3: np.ndarray) -> np.ndarray:
    """Cubic Bezier leaving ``p0`` along ``h0`` and arriving at ``p3`` along ``h3`` (tangent-continuous).

    Handle lengths follow the circular-arc approximation for the turn angle, so turns are near-constant curvature.
    """
    chord = float(np.linalg.norm(p3 - p0))
    phi = abs(_wrap(math.atan2(h3[1], h3[0]) - math.atan2(h0[1], h0[0])))
    k = 1.0 / 3.0 if phi < 1e-3 else (2.0 / 3.0) * math.tan(phi / 4.0) / math.sin(phi / 2.0)
    c1, c2 = p0 + h0 * k * chord, p3 - h3 * k * chord
    ctrl_len = np.linalg.norm(c1 - p0) + np.linalg.norm(c2 - c1) + np.linalg.norm(p3 - c2)
    n = max(4, int(math.ceil(ctrl_len / CONNECTOR_SPACING)))
    t = np.linspace(0.0, 1.0, n + 1)[:, None]
    s = 1.0 - t
    return s**3 * p0 + 3 * s**2 * t * c1 + 3 * s * t**2 * c2 + t**3 * p3


# ---------------------------------------------------------------------------------------------------- topology
def _strongly_connected(succ: list[list[int]]) -> bool:
    """True if every vertex reaches every other (forward and reverse search from vertex 0)."""
    n = len(succ)
    if n == 0:
        return False
    pred: list[list[int]] = [[] for _ in range(n)]
    for i, js in enumerate(succ):
        for j in js:
            pred[j].append(i)
    for adj in (succ, pred):
        seen = np.zeros(n, bool)
        seen[0] = True
        stack = [0]
        while stack:
            for j in adj[stack.pop()]:
                if not seen[j]:
                    seen[j] = True
                    stack.append(j)
        if not seen.all():
            return False
    return True


def driving_graph(lanes: list[Lane]) -> list[list[int]]:
    """Adjacency a vehicle can drive: successors plus lane changes to same-direction neighbours."""
    return [list(lane.successors) + [j for j in (lane.left, lane.right) if j >= 0] for lane in lanes]


def _connected(num_nodes: int, edges: list[tuple[int, int]]) -> bool:
    adj: list[list[int]] = [[] for _ in range(num_nodes)]
    for u, v in edges:
        adj[u].append(v)
        adj[v].append(u)
    return _strongly_connected(adj)


def _grid_edges(rows: int, cols: int) -> list[tuple[int, int]]:
    edges = []
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            if c + 1 < cols:
                edges.append((i, i + 1))
            if r + 1 < rows:
                edges.append((i, i + cols))
    return edges


# ---------------------------------------------------------------------------------------------------- town parts
class _Town(NamedTuple):
    """Loader output of one town before :meth:`LaneGraph.build` (so several towns can be merged)."""

    lanes: list[Lane]
    stop_lines: list[StopLine]
    light_groups: list[LightGroup]
    crosswalks: list[np.ndarray]
    shoulders: list[tuple[np.ndarray, float]]
    speed_signs: list[tuple[float, float, float]]
    num_junctions: int


class _Road(NamedTuple):
    u: int
    v: int
    n: int  # lanes per direction
    speed: float


def _build(cfg: ProceduralConfig, pos: np.ndarray, roads: list[_Road], signal_rank: np.ndarray) -> _Town | None:
    """Lay out lanes, connectors and control for a fixed topology; None if some road is too short to fit."""
    num_nodes = len(pos)
    lw, sw = cfg.lane_width, cfg.shoulder_width
    inc: list[list[int]] = [[] for _ in range(num_nodes)]  # road ids at each node
    for ri, rd in enumerate(roads):
        inc[rd.u].append(ri)
        inc[rd.v].append(ri)

    def away(node: int, ri: int) -> np.ndarray:
        """Unit direction of road ``ri`` pointing away from ``node``."""
        rd = roads[ri]
        other = rd.v if rd.u == node else rd.u
        return _unit(pos[other] - pos[node])

    # Order each node's roads counter-clockwise so approach indices (and light phases) are deterministic.
    for node in range(num_nodes):
        inc[node].sort(key=lambda ri: math.atan2(*away(node, ri)[::-1]))
    radius = np.zeros(num_nodes)
    core = np.zeros(num_nodes)
    for node in range(num_nodes):
        w = max(roads[ri].n * lw + sw for ri in inc[node])
        angs = [math.atan2(*away(node, ri)[::-1]) for ri in inc[node]]
        gaps = [(angs[(i + 1) % len(angs)] - angs[i]) % (2 * math.pi) for i in range(len(angs))]
        theta = min(min(gaps), math.pi / 2)
        core[node] = max(w, w / math.tan(theta / 2.0))
        radius[node] = core[node] + JUNCTION_EXTRA

    lanes: list[Lane] = []
    # lane ids per (road, direction); direction 0 runs u -> v, 1 runs v -> u
    road_lanes: dict[tuple[int, int], list[int]] = {}
    shoulders: list[tuple[np.ndarray, float]] = []
    signs: list[tuple[float, float, float]] = []
    for ri, rd in enumerate(roads):
        for direction, (a, b) in enumerate(((rd.u, rd.v), (rd.v, rd.u))):
            d = _unit(pos[b] - pos[a])
            start, end = pos[a] + d * radius[a], pos[b] - d * radius[b]
            length = float(np.dot(end - start, d))
            if length < MIN_ROAD_LENGTH:
                return None
            rn = _right(d)
            ids = []
            for k in range(rd.n):
                off = rn * (k + 0.5) * lw
                ids.append(len(lanes))
                lanes.append(Lane(
                    points=np.stack([start + off, end + off]), width=lw, speed_limit=rd.speed,
                    left_marking=MARK_SOLID if k == 0 else MARK_BROKEN,
                    right_marking=MARK_SOLID if k == rd.n - 1 else MARK_BROKEN,
                ))
            for k, i in enumerate(ids):
                lanes[i].left = ids[k - 1] if k > 0 else -1
                lanes[i].right = ids[k + 1] if k + 1 < rd.n else -1
            road_lanes[ri, direction] = ids
            if sw > 0:
                off = rn * (rd.n * lw + sw / 2.0)
                shoulders.append((np.stack([start + off, end + off]), sw))
            sign = start + d * min(5.0, length / 4.0) + rn * (rd.n * lw + sw + 0.5)
            signs.append((float(sign[0]), float(sign[1]), rd.speed))

    def in_lanes(node: int, ri: int) -> list[int]:
        return road_lanes[ri, 0 if roads[ri].v == node else 1]

    def out_lanes(node: int, ri: int) -> list[int]:
        return road_lanes[ri, 0 if roads[ri].u == node else 1]

    stop_lines: list[StopLine] = []
    light_groups: list[LightGroup] = []
    crosswalks: list[np.ndarray] = []
    for node in range(num_nodes):
        arms = inc[node]
        controlled = len(arms) >= 3
        pairs: set[tuple[int, int]] = set()
        # turn[(a, b)]: signed turn angle from approach arm a into exit arm b (left positive)
        turn = {(a, b): _wrap(math.atan2(*away(node, b)[::-1]) - math.atan2(*(-away(node, a))[::-1]))
                for a in arms for b in arms if a != b}
        for a in arms:
            li = in_lanes(node, a)
            exits = [b for b in arms if b != a]
            if len(arms) == 2:
                straight = exits[0]
            else:
                best = min(exits, key=lambda b: abs(turn[a, b]))
                straight = best if abs(turn[a, best]) < STRAIGHT_MAX_TURN else None
            has_succ = [False] * len(li)
            for b in exits:
                lo = out_lanes(node, b)
                if b == straight:  # lane k -> k; surplus lanes merge into / fan out from the outermost lane
                    for k in range(max(len(li), len(lo))):
                        pairs.add((li[min(k, len(li) - 1)], lo[min(k, len(lo) - 1)]))
                    has_succ = [True] * len(li)
                elif turn[a, b] > 0:
                    pairs.add((li[0], lo[0]))
                    has_succ[0] = True
                else:
                    pairs.add((li[-1], lo[-1]))
                    has_succ[-1] = True
            lefts = sorted((b for b in exits if b != straight and turn[a, b] > 0), key=lambda b: turn[a, b])
            rights = sorted((b for b in exits if b != straight and turn[a, b] <= 0), key=lambda b: -turn[a, b])
            for k, ok in enumerate(has_succ):
                if ok:
                    continue
                use_left = (k < len(li) / 2.0 and lefts) or not rights
                if use_left:
                    lo = out_lanes(node, lefts[0])
                    pairs.add((li[k], lo[min(k, len(lo) - 1)]))
                else:
                    lo = out_lanes(node, rights[0])
                    pairs.add((li[k], lo[max(0, len(lo) - len(li) + k)]))
        reached = {j for _, j in pairs}
        for b in arms:
            lo = out_lanes(node, b)
            for j, lane_id in enumerate(lo):
                if lane_id in reached:
                    continue
                a = min((x for x in arms if x != b), key=lambda x: abs(turn[x, b]))
                li = in_lanes(node, a)
                k = min(j, len(li) - 1) if turn[a, b] >= 0 else max(0, len(li) - len(lo) + j)
                pairs.add((li[k], lane_id))
        for i, j in sorted(pairs):
            lane_in, lane_out = lanes[i], lanes[j]
            p0, p3 = lane_in.points[-1], lane_out.points[0]
            h0 = _unit(lane_in.points[-1] - lane_in.points[-2])
            h3 = _unit(lane_out.points[1] - lane_out.points[0])
            cid = len(lanes)
            lanes.append(Lane(points=_bezier(p0, h0, p3, h3), width=lw,
                              speed_limit=min(lane_in.speed_limit, lane_out.speed_limit), is_junction=True,
                              successors=[j], left_marking=MARK_NONE, right_marking=MARK_NONE, junction=node))
            lane_in.successors.append(cid)
        if not controlled:
            continue
        signalised = bool(signal_rank[node])
        for phase, a in enumerate(arms):
            group = -1
            if signalised:
                group = len(light_groups)
                light_groups.append(LightGroup(junction=node, phase=phase, num_phases=len(arms)))
            for i in in_lanes(node, a):
                stop_lines.append(StopLine(lane=i, control=CONTROL_LIGHT if signalised else CONTROL_STOP,
                                           light_group=group))
        if cfg.crosswalks:
            for b in arms:
                d = away(node, b)
                nrm = np.array([-d[1], d[0]])  # left normal: (d, nrm) is a right-handed frame -> CCW corners
                half = roads[b].n * lw + sw
                s0 = core[node] + CROSSWALK_GAP
                s1 = s0 + CROSSWALK_DEPTH
                crosswalks.append(np.stack([pos[node] + d * s + nrm * t
                                            for s, t in ((s0, -half), (s1, -half), (s1, half), (s0, half))]))
    return _Town(lanes, stop_lines, light_groups, crosswalks, shoulders, signs, num_nodes)


def _town(cfg: ProceduralConfig, seed: int) -> _Town:
    """Sample a town's topology and attributes from ``seed`` and lay it out (retrying irregular layouts)."""
    validate_config(cfg)
    rng = np.random.default_rng(seed)
    num_nodes = cfg.rows * cfg.cols
    all_edges = _grid_edges(cfg.rows, cfg.cols)
    lo, hi = cfg.lanes_per_direction
    n_lanes = rng.integers(lo, hi + 1, size=len(all_edges))
    speeds = np.asarray(cfg.speed_limits, np.float64)[rng.integers(0, len(cfg.speed_limits), size=len(all_edges))]
    signal_u = rng.random(num_nodes)  # per-node draw, turned into a ranking among controlled junctions below
    base = np.array([[c * cfg.block, r * cfg.block] for r in range(cfg.rows) for c in range(cfg.cols)], float)

    def roads_of(edge_ids: list[int]) -> list[_Road]:
        return [_Road(*all_edges[e], int(n_lanes[e]), float(speeds[e])) for e in edge_ids]

    def signals(edge_ids: list[int]) -> np.ndarray:
        deg = np.zeros(num_nodes, int)
        for e in edge_ids:
            deg[list(all_edges[e])] += 1
        ctrl = np.flatnonzero(deg >= 3)
        chosen = ctrl[np.argsort(signal_u[ctrl], kind="stable")][: int(round(cfg.signal_fraction * len(ctrl)))]
        out = np.zeros(num_nodes, bool)
        out[chosen] = True
        return out

    def lane_graph_ok(town: _Town) -> bool:
        return _strongly_connected(driving_graph(town.lanes))

    if cfg.kind == "grid":
        keep = list(range(len(all_edges)))
        town = _build(cfg, base, roads_of(keep), signals(keep))
        if town is None or not lane_graph_ok(town):  # validation guarantees this cannot happen
            raise MapError(f"procedural grid seed={seed}: internal layout error (cfg={cfg})")
        return town

    for _ in range(MAX_LAYOUT_TRIES):
        ang = rng.uniform(0, 2 * math.pi, num_nodes)
        rad = cfg.block * _jitter(cfg) * np.sqrt(rng.random(num_nodes))
        pos = base + np.stack([np.cos(ang), np.sin(ang)], 1) * rad[:, None]
        keep = list(range(len(all_edges)))
        deg = np.zeros(num_nodes, int)
        for u, v in all_edges:
            deg[[u, v]] += 1
        dropped: list[int] = []
        target = int(round(DROP_FRACTION * len(all_edges)))
        for e in rng.permutation(len(all_edges)):
            if len(dropped) >= target:
                break
            u, v = all_edges[e]
            if deg[u] <= 2 or deg[v] <= 2:
                continue
            trial = [x for x in keep if x != e]
            if _connected(num_nodes, [all_edges[x] for x in trial]):
                keep, deg[u], deg[v] = trial, deg[u] - 1, deg[v] - 1
                dropped.append(int(e))
        # Restore dropped roads (latest first) until the lane graph is strongly connected.
        while True:
            keep_sorted = sorted(keep)
            town = _build(cfg, pos, roads_of(keep_sorted), signals(keep_sorted))
            if town is not None and lane_graph_ok(town):
                return town
            if not dropped:
                break
            keep.append(dropped.pop())
    raise MapError(f"procedural irregular town seed={seed}: no valid layout in {MAX_LAYOUT_TRIES} tries; "
                   f"increase ProceduralConfig.block (now {cfg.block}) or reduce lanes_per_direction")


# ---------------------------------------------------------------------------------------------------- public API
def _meta(cfg: ProceduralConfig) -> dict:
    d = asdict(cfg)
    d["lanes_per_direction"] = list(d["lanes_per_direction"])
    d["speed_limits"] = list(d["speed_limits"])
    return d


def _compile(name: str, towns: list[_Town], offsets: list[np.ndarray], meta: dict) -> LaneGraph:
    """Merge towns (translated by ``offsets``) into one lane graph, re-indexing lanes, groups and junctions."""
    lanes: list[Lane] = []
    stops: list[StopLine] = []
    groups: list[LightGroup] = []
    cws: list[np.ndarray] = []
    shoulders: list[tuple[np.ndarray, float]] = []
    signs: list[tuple[float, float, float]] = []
    junction_base = 0
    for town, off in zip(towns, offsets):
        lb, gb = len(lanes), len(groups)
        for lane in town.lanes:
            lanes.append(Lane(
                points=lane.points + off, width=lane.width, speed_limit=lane.speed_limit,
                is_junction=lane.is_junction, successors=[s + lb for s in lane.successors],
                left=lane.left + lb if lane.left >= 0 else -1, right=lane.right + lb if lane.right >= 0 else -1,
                left_marking=lane.left_marking, right_marking=lane.right_marking,
                junction=lane.junction + junction_base if lane.junction >= 0 else -1,
            ))
        stops += [StopLine(s.lane + lb, s.control, s.light_group + gb if s.light_group >= 0 else -1)
                  for s in town.stop_lines]
        groups += [LightGroup(g.junction + junction_base, g.phase, g.num_phases) for g in town.light_groups]
        cws += [q + off for q in town.crosswalks]
        shoulders += [(p + off, w) for p, w in town.shoulders]
        signs += [(x + off[0], y + off[1], lim) for x, y, lim in town.speed_signs]
        junction_base += town.num_junctions
    return LaneGraph.build(
        name, lanes, stops, groups,
        crosswalks=np.asarray(cws, np.float64).reshape(-1, 4, 2),
        shoulders=shoulders,
        speed_signs=np.asarray(signs, np.float64).reshape(-1, 3),
        meta=meta,
    )


def generate_town(cfg: ProceduralConfig, seed: int, name: str | None = None) -> LaneGraph:
    """One procedural town; same ``cfg`` and ``seed`` give identical arrays (both are recorded in ``meta``)."""
    town = _town(cfg, int(seed))
    name = name or f"procedural_{cfg.kind}_{cfg.rows}x{cfg.cols}_s{int(seed)}"
    meta = {"generator": "procedural", "cfg": _meta(cfg), "seed": int(seed)}
    return _compile(name, [town], [np.zeros(2)], meta)


def _town_bounds(town: _Town) -> tuple[np.ndarray, np.ndarray]:
    pts = [lane.points for lane in town.lanes] + [p for p, _ in town.shoulders] + list(town.crosswalks)
    if town.speed_signs:
        pts.append(np.asarray(town.speed_signs)[:, :2])
    allp = np.concatenate(pts)
    return allp.min(0), allp.max(0)


def generate_world(cfg: ProceduralConfig, seeds: list[int], spacing: float | None = None,
                   name: str | None = None) -> LaneGraph:
    """Several towns side by side along +x in one lane graph, so one batch of envs trains on many towns.

    Towns are not linked to each other. ``spacing`` is the distance between town origins; by default towns are
    packed with a gap of one ``block`` between bounding boxes. A ``spacing`` that would make towns overlap raises.
    """
    if len(seeds) == 0:
        raise MapError("generate_world: seeds=[] is empty; pass at least one seed")
    if len(set(int(s) for s in seeds)) != len(seeds):
        raise MapError(f"generate_world: seeds={list(seeds)} contains duplicates; each town needs its own seed")
    if spacing is not None and not (np.isfinite(spacing) and spacing > 0):
        raise MapError(f"generate_world: spacing={spacing!r} is invalid; allowed: a positive distance in m or None")
    towns = [_town(cfg, int(s)) for s in seeds]
    bounds = [_town_bounds(t) for t in towns]
    offsets: list[np.ndarray] = []
    cursor = 0.0  # x of the previous town's right edge (packed mode)
    for i, (lo, hi) in enumerate(bounds):
        if spacing is None:
            x = 0.0 if i == 0 else cursor + cfg.block - lo[0]
        else:
            x = i * float(spacing)
            if i > 0 and x + lo[0] <= cursor:
                need = max(float(b[1][0] - b[0][0]) for b in bounds)
                raise MapError(f"generate_world: spacing={spacing} makes towns overlap; allowed: > {need:.1f} m "
                               "(the widest town's extent) or None")
        offsets.append(np.array([x, 0.0]))
        cursor = x + hi[0]
    lane_base, junction_base, info = 0, 0, []
    for s, t, off in zip(seeds, towns, offsets):
        info.append({"seed": int(s), "offset": [float(off[0]), float(off[1])],
                     "lanes": [lane_base, lane_base + len(t.lanes)],
                     "junctions": [junction_base, junction_base + t.num_junctions]})
        lane_base += len(t.lanes)
        junction_base += t.num_junctions
    meta = {"generator": "procedural.world", "cfg": _meta(cfg), "seeds": [int(s) for s in seeds], "towns": info}
    name = name or f"procedural_world_{cfg.kind}_{len(seeds)}towns"
    return _compile(name, towns, offsets, meta)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Generate a procedural town (or world) and save it as .npz")
    ap.add_argument("out")
    ap.add_argument("--kind", default="grid", choices=["grid", "irregular"])
    ap.add_argument("--rows", type=int, default=3)
    ap.add_argument("--cols", type=int, default=3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = ap.parse_args()
    c = ProceduralConfig(kind=args.kind, rows=args.rows, cols=args.cols)
    g = generate_town(c, args.seeds[0]) if len(args.seeds) == 1 else generate_world(c, args.seeds)
    g.save(args.out)
    print(f"{g.name}: {g.num_lanes} lanes, {len(g.stop_lane)} stop lines, {len(g.light_phase)} light groups, "
          f"{len(g.crosswalks)} crosswalks -> {args.out}")

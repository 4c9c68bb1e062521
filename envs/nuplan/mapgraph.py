"""Compile the part of a nuPlan map around a scenario into the simulator's ``LaneGraph``, plus the expert route.

* Lanes and lane connectors whose baseline comes within ``radius`` of the logged ego path become lanes (connectors
  are junction lanes); successors follow ``lane_connectors`` (``exit_lane_fid`` -> connector -> ``entry_lane_fid``);
  left/right neighbours are lanes of the same roadblock with ``lane_index`` -1/+1 (smaller index = further left).
* Width = lane polygon area / baseline length; a connector without a limit takes the highest limit of its two
  lanes (as nuPlan's speed-limit metric does).
* Traffic lights: an approach lane whose outgoing connectors carry logged light states gets a stop line at its end
  and one light group of its own; the group shows the state of the connector the expert takes (else the first
  signalled connector). :func:`build_patch` returns the connector id behind every group.
* Coordinates are shifted by ``origin`` (the ego start) so float32 keeps centimetre precision.
* Polygon layers (:func:`map_layers`): the drivable areas (the devkit's and CaRL's) and the route's roadblock
  polygons within ``radius`` of the ego path, clipped, as flat :class:`PolygonSet` arrays (shapely on demand).
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.spatial import cKDTree

from envs.maps.lanegraph import CONTROL_LIGHT, MARK_BROKEN, MARK_SOLID, Lane, LaneGraph, LightGroup, StopLine
from envs.nuplan.gpkg import require
from envs.nuplan.nuplan_map import CARL_DRIVABLE_LAYERS, DRIVABLE_LAYERS, ROUTE_LAYERS, NuplanMap
from envs.maps.routes import Route

DEFAULT_SPEED_LIMIT = 13.89  # m/s where the map has none
POLYGON_FIELDS = ("drivable", "carl_drivable", "route_polygons")  # the scenario's polygon layers (map_layers)


@dataclass
class Patch:
    graph: LaneGraph
    lane_fids: list[str]  # map fid of every graph lane
    light_connectors: list[int]  # lane-connector id whose status drives light group k
    route: Route


def polygon_area(ring: np.ndarray) -> float:
    """Area of a ring (closed or not) by shapely; 0 for fewer than three distinct points."""
    xy = np.asarray(ring, np.float64)[:, :2]
    if len(np.unique(xy, axis=0)) < 3:
        return 0.0
    shapely = shapely_module()
    return float(shapely.area(shapely.polygons(xy)))


def polyline_length(p: np.ndarray) -> float:
    return float(np.linalg.norm(np.diff(p, axis=0), axis=1).sum())


def quad(ring: np.ndarray) -> np.ndarray:
    """A 4-corner box for a polygon: its corners if it has four, else the principal-axis bounding box."""
    r = ring[:-1] if np.allclose(ring[0], ring[-1]) else ring
    if len(r) == 4:
        return r
    c = r.mean(0)
    _, _, vt = np.linalg.svd(r - c)
    loc = (r - c) @ vt.T
    lo, hi = loc.min(0), loc.max(0)
    corners = np.array([[lo[0], lo[1]], [hi[0], lo[1]], [hi[0], hi[1]], [lo[0], hi[1]]])
    return corners @ vt + c


def build_patch(m: NuplanMap, ego_path: np.ndarray, origin: np.ndarray, light_ids: set[int],
                route_roadblocks: list[str], radius: float = 60.0, route_extension: float = 20.0,
                name: str = "patch") -> Patch:
    """The lane graph around ``ego_path`` ([T, 2] global centre positions) and the expert route along it."""
    probe = ego_path[:: max(1, len(ego_path) // 40)]
    probe = np.vstack([probe, ego_path[-1:]])
    chosen = _lanes_near(m, probe, radius)
    if not chosen:
        lo = np.min([ln.baseline.min(0) for ln in m.lanes.values()], 0) if m.lanes else np.zeros(2)
        hi = np.max([ln.baseline.max(0) for ln in m.lanes.values()], 0) if m.lanes else np.zeros(2)
        raise ValueError(f"{name}: no lanes of map '{m.name}' ({m.path}) within {radius} m of the ego path, which "
                         f"starts at {np.round(ego_path[0], 1).tolist()} while the map's lanes span "
                         f"{np.round(lo, 1).tolist()}..{np.round(hi, 1).tolist()}; the log belongs to another map, or "
                         "the map's layers are not in the CRS of meta.projectedCoordSystem")
    index = {fid: i for i, fid in enumerate(chosen)}
    width, limit = {}, {}
    for fid in chosen:
        lane = m.lanes[fid]
        length = max(polyline_length(lane.baseline), 1e-3)
        w = polygon_area(lane.polygon[0]) / length if lane.polygon else 0.0
        width[fid] = float(np.clip(w, 2.5, 6.0)) if w > 0 else None
        limit[fid] = float(lane.speed_limit) if lane.speed_limit else None
    for fid in chosen:
        lane = m.lanes[fid]
        adj = [a for a in (lane.exit_lane, lane.entry_lane) if a in m.lanes]
        if width[fid] is None:
            ws = [width.get(a) or 3.5 for a in adj]
            width[fid] = float(np.mean(ws)) if ws else 3.5
        if limit[fid] is None:
            ls = [float(m.lanes[a].speed_limit) for a in adj if m.lanes[a].speed_limit]
            limit[fid] = max(ls) if ls else DEFAULT_SPEED_LIMIT
    # junction ids: one per intersection, and one per connector group outside any intersection
    junction_ids: dict[str, int] = {}
    lanes: list[Lane] = []
    for fid in chosen:
        lane = m.lanes[fid]
        succ = []
        if lane.is_connector:
            if lane.entry_lane in index:
                succ.append(index[lane.entry_lane])
            key = m.roadblock_connector_intersection.get(lane.group) or f"g{lane.group}"
            junction = junction_ids.setdefault(key, len(junction_ids))
        else:
            succ = [index[c] for c, l2 in m.lanes.items() if l2.is_connector and l2.exit_lane == fid and c in index]
            junction = -1
        lanes.append(Lane(points=lane.baseline - origin, width=width[fid], speed_limit=limit[fid],
                          is_junction=lane.is_connector, successors=succ, junction=junction))
    by_group: dict[str, dict[int, str]] = {}
    for fid in chosen:
        lane = m.lanes[fid]
        if not lane.is_connector:
            by_group.setdefault(lane.group, {})[lane.lane_index] = fid
    for fid in chosen:
        lane = m.lanes[fid]
        if lane.is_connector:
            continue
        grp = by_group[lane.group]
        for side, delta in (("left", -1), ("right", 1)):
            nb = grp.get(lane.lane_index + delta)
            if nb is not None:
                setattr(lanes[index[fid]], side, index[nb])
                setattr(lanes[index[fid]], f"{side}_marking", MARK_BROKEN)
            else:
                setattr(lanes[index[fid]], f"{side}_marking", MARK_SOLID)
    # expert route first: the light groups prefer the connectors it uses
    route = expert_route(lanes, chosen, m, ego_path - origin, route_roadblocks, route_extension, name)
    route_lanes = {chosen[i] for i in np.unique(route.lanes)}
    stop_lines, groups, light_connectors = [], [], []
    base_junction = len(junction_ids)
    for fid in chosen:
        if m.lanes[fid].is_connector:
            continue
        outs = [c for c in chosen if m.lanes[c].is_connector and m.lanes[c].exit_lane == fid and int(c) in light_ids]
        if not outs:
            continue
        pick = next((c for c in outs if c in route_lanes), outs[0])
        g = len(groups)
        groups.append(LightGroup(junction=base_junction + g, phase=0, num_phases=1))
        stop_lines.append(StopLine(lane=index[fid], control=CONTROL_LIGHT, light_group=g))
        light_connectors.append(int(pick))
    crosswalks = [quad(cw[0]) - origin for cw in m.crosswalks
                  if cw and np.linalg.norm(cw[0].mean(0) - probe, axis=1).min() <= radius]
    graph = LaneGraph.build(name, lanes, stop_lines, groups,
                            crosswalks=np.array(crosswalks) if crosswalks else None,
                            meta={"source": "nuplan", "map": m.name, "version": m.version})
    return Patch(graph=graph, lane_fids=chosen, light_connectors=light_connectors, route=route)


_BASELINES: dict[int, tuple[weakref.ref, list[str], list[np.ndarray], np.ndarray, Any]] = {}


def _baseline_index(m: NuplanMap) -> tuple[list[str], list[np.ndarray], np.ndarray, Any]:
    """(fids, baselines, lane of every baseline point, KD-tree of the points) of a map, built once per map object."""
    key = id(m)
    hit = _BASELINES.get(key)
    if hit is None or hit[0]() is not m:
        fids = list(m.lanes)
        lines = [np.asarray(m.lanes[f].baseline, np.float64) for f in fids]
        lane_of = np.repeat(np.arange(len(fids)), [len(x) for x in lines])
        tree = cKDTree(np.concatenate(lines) if lines else np.zeros((0, 2)))
        hit = (weakref.ref(m, lambda _r, k=key: _BASELINES.pop(k, None)), fids, lines, lane_of, tree)
        _BASELINES[key] = hit
    return hit[1:]


def _lanes_near(m: NuplanMap, probe: np.ndarray, radius: float) -> list[str]:
    """fids of the map lanes (in map order) whose baseline has a point within ``radius`` of a ``probe`` point (a
    KD-tree of the map's baseline points; lanes found within a hair of the radius are measured again exactly)."""
    fids, lines, lane_of, tree = _baseline_index(m)
    if not fids:
        return []
    hits = tree.query_ball_point(probe, radius + 1e-6)
    points = np.unique(np.concatenate([np.asarray(h, np.int64) for h in hits]))
    chosen = []
    for k in np.unique(lane_of[points]).tolist():
        if np.linalg.norm(lines[k][:, None, :] - probe[None], axis=-1).min() <= radius:
            chosen.append(fids[k])
    return chosen


class _LaneLocator:
    """Nearest-lane queries over a patch's lanes with a KD-tree of their centreline points (``scipy.spatial``)."""

    def __init__(self, lanes: list[Lane]) -> None:
        self.lanes = lanes
        self.xy = np.concatenate([lane.points for lane in lanes])
        self.lane_of = np.repeat(np.arange(len(lanes)), [len(lane.points) for lane in lanes])
        self.first = np.concatenate([[0], np.cumsum([len(lane.points) for lane in lanes])])
        self.tree = cKDTree(self.xy)
        self.reach = float(np.ptp(self.xy, axis=0).max()) + 1.0  # farther than any lane point from any other

    def nearest(self, p: np.ndarray, heading: float, prefer: set[int]) -> int:
        """Lane whose centreline is nearest to ``p`` among those pointing within 60° of ``heading``; ``prefer``
        (route roadblock lanes) wins ties within 1 m; lane 0 when no lane points that way. Lanes are looked at
        within a radius that grows until no lane beyond it could win."""
        near = float(self.tree.query(p)[0])
        r = near + 2.0
        while True:
            idx = np.sort(np.asarray(self.tree.query_ball_point(p, r), np.int64))
            d = np.linalg.norm(self.xy[idx] - p, axis=1)
            lane = self.lane_of[idx]
            # per lane its nearest point (the first on a tie, as argmin picks), lanes in index order
            order = np.lexsort((idx, d, lane))
            head = order[np.concatenate([[True], lane[order][1:] != lane[order][:-1]])]
            best, best_d = 0, np.inf
            for i, g, dist in zip(lane[head].tolist(), idx[head].tolist(), d[head].tolist()):
                pts, k = self.lanes[i].points, g - int(self.first[i])
                seg = pts[min(k + 1, len(pts) - 1)] - pts[max(k - 1, 0)]
                if np.cos(np.arctan2(seg[1], seg[0]) - heading) < 0.5:
                    continue
                score = dist - (1.0 if i in prefer else 0.0)
                if score < best_d:
                    best, best_d = i, score
            # a lane with no point within r scores more than r - 1
            if best_d < r - 1.0 - 1e-9 or r > near + self.reach:
                return best
            r *= 2.0


def expert_route(lanes: list[Lane], fids: list[str], m: NuplanMap, path: np.ndarray, roadblocks: list[str],
                 extension: float, name: str) -> Route:
    """The logged ego path (local frame) resampled at 1 m, each point tagged with its lane, extended ``extension``
    metres along the lanes past the expert's last pose (so the ego can drive on where the log stops)."""
    keep = np.concatenate([[True], np.linalg.norm(np.diff(path, axis=0), axis=1) > 0.05])
    p = path[keep]
    prefer = {i for i, f in enumerate(fids) if m.lanes[f].group in set(roadblocks)}
    if len(p) >= 2:
        cum = np.concatenate([[0.0], np.cumsum(np.linalg.norm(np.diff(p, axis=0), axis=1))])
        s = np.arange(0.0, cum[-1], 1.0)
        pts = np.stack([np.interp(s, cum, p[:, 0]), np.interp(s, cum, p[:, 1])], -1)
    else:
        pts = p[:1]
    if len(pts) > 1:
        g = np.gradient(pts, axis=0)
        head = np.arctan2(g[:, 1], g[:, 0])
    if len(pts) == 1:  # a standing expert: take the heading of the lane under it
        i = int(np.argmin([np.linalg.norm(l.points - pts[0], axis=1).min() for l in lanes]))
        d = lanes[i].points
        k = int(np.linalg.norm(d - pts[0], axis=1).argmin())
        seg = d[min(k + 1, len(d) - 1)] - d[max(k - 1, 0)]
        head = np.array([np.arctan2(seg[1], seg[0])])
    locator = _LaneLocator(lanes)
    lane_of = np.array([locator.nearest(q, h, prefer) for q, h in zip(pts, head)], np.int64)
    # extend along the lane centre (and its successors, preferring route roadblocks)
    ext, lane, cur = [], int(lane_of[-1]), pts[-1]
    remaining = extension
    ext_lanes = []
    visited = 0
    while remaining > 0 and visited < 20:
        visited += 1
        c = lanes[lane].points
        k = int(np.linalg.norm(c - cur, axis=1).argmin())
        tail = c[k + 1:]
        for q in tail:
            step = float(np.linalg.norm(q - cur))
            if step < 1.0:
                continue
            n_sub = int(step // 1.0)
            for j in range(1, n_sub + 1):
                ext.append(cur + (q - cur) * j / step)  # 1 m steps towards q
                ext_lanes.append(lane)
            cur = ext[-1]
            remaining = extension - len(ext)
            if remaining <= 0:
                break
        if remaining <= 0 or not lanes[lane].successors:
            break
        succ = lanes[lane].successors
        lane = next((s for s in succ if s in prefer), succ[0])
    if ext:
        pts = np.vstack([pts, np.array(ext)])
        lane_of = np.concatenate([lane_of, np.array(ext_lanes, np.int64)])
    if len(pts) < 3:
        raise ValueError(f"{name}: expert route has {len(pts)} points; the map patch has no lane to extend it")
    return Route(name=name, points=pts.astype(np.float32), lanes=lane_of.astype(np.int32))


# ---------------------------------------------------------------------------------------------- polygon layers
def shapely_module() -> Any:
    """shapely, or a MissingPackageError naming it and the pip command."""
    return require("shapely", "the nuPlan map polygons (drivable area, route)")


@dataclass
class PolygonSet:
    """Polygons stored flat (shapely's ragged layout): vertex ``xy`` [V, 2] float32 (local frame, rings closed),
    ``rings`` [R + 1] start vertex of each ring, ``parts`` [P + 1] start ring of each polygon (exterior first), and
    the map feature of each polygon (``ids``: ``layer:fid`` or a roadblock id). Compact on disk, and one call away
    from shapely: :meth:`polygons` (an array for ``shapely.STRtree``) and :meth:`union`."""

    xy: np.ndarray
    rings: np.ndarray
    parts: np.ndarray
    ids: list[str]
    _geoms: Any = field(default=None, repr=False, compare=False)
    _union: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def empty(cls) -> PolygonSet:
        return cls(np.zeros((0, 2), np.float32), np.zeros(1, np.int64), np.zeros(1, np.int64), [])

    @classmethod
    def from_shapely(cls, geoms: Sequence[Any], ids: Sequence[str], origin: np.ndarray | None = None) -> PolygonSet:
        """From shapely Polygons (global frame) and their ids; ``origin`` is subtracted (-> local frame)."""
        if not len(geoms):
            return cls.empty()
        shapely = shapely_module()
        _, xy, (rings, parts) = shapely.to_ragged_array(np.asarray(geoms, dtype=object))
        xy = xy[:, :2] - (origin if origin is not None else 0.0)
        return cls(xy.astype(np.float32), rings.astype(np.int64), parts.astype(np.int64), [str(i) for i in ids])

    def __len__(self) -> int:
        return len(self.parts) - 1

    def rings_of(self, i: int) -> list[np.ndarray]:
        """The rings of polygon ``i`` (exterior first) as [N, 2] arrays."""
        return [self.xy[self.rings[r]:self.rings[r + 1]] for r in range(self.parts[i], self.parts[i + 1])]

    def polygons(self) -> np.ndarray:
        """The polygons as an object array of shapely Polygons (local frame), e.g. for ``shapely.STRtree``."""
        if self._geoms is None:
            shapely = shapely_module()
            if len(self) == 0:
                self._geoms = np.zeros(0, dtype=object)
            else:
                self._geoms = shapely.from_ragged_array(shapely.GeometryType.POLYGON, self.xy.astype(np.float64),
                                                        (self.rings, self.parts))
        return self._geoms

    def union(self) -> Any:
        """All polygons as one shapely geometry (an empty Polygon when there is none)."""
        if self._union is None:
            shapely = shapely_module()
            g = self.polygons()
            self._union = shapely.union_all(g) if len(g) else shapely.Polygon()
        return self._union


def _polygon_parts(g: Any) -> list[Any]:
    """The non-empty Polygons inside any shapely geometry (multi-parts and collections flattened)."""
    shapely = shapely_module()
    out, todo = [], [g]
    while todo:
        x = todo.pop()
        tid = shapely.get_type_id(x)
        if tid == 3 and not x.is_empty:  # Polygon
            out.append(x)
        elif tid in (6, 7):  # MultiPolygon, GeometryCollection
            todo.extend(shapely.get_parts(x))
    return out[::-1]


def clip_layers(m: NuplanMap, layers: Sequence[str], region: Any, select: dict[str, set[str]] | None = None,
                prefix: bool = True) -> tuple[list[Any], list[str]]:
    """The polygons of ``layers`` (absent layers contribute nothing) that meet ``region``, clipped to it, with
    ``layer:fid`` ids (or bare fids without ``prefix``); ``select`` keeps only the given fids of a layer."""
    shapely = shapely_module()
    geoms_out: list[Any] = []
    ids_out: list[str] = []
    for name in layers:
        geoms, fids, tree = m.polygon_index(name)
        if not len(geoms):
            continue
        idx = tree.query(region, predicate="intersects")
        if select is not None:
            keep = select.get(name, set())
            idx = np.array([i for i in idx if fids[i] in keep], np.int64)
        if not len(idx):
            continue
        for i, g in zip(sorted(idx.tolist()), shapely.intersection(geoms[np.sort(idx)], region)):
            for part in _polygon_parts(g):
                geoms_out.append(part)
                ids_out.append(f"{name}:{fids[i]}" if prefix else fids[i])
    return geoms_out, ids_out


def map_layers(m: NuplanMap, centre_path: np.ndarray, origin: np.ndarray, route_roadblock_ids: Sequence[str],
               radius: float = 60.0) -> dict[str, PolygonSet]:
    """The scenario's polygon layers (:data:`POLYGON_FIELDS`): every polygon within ``radius`` of the logged ego
    centre path ([T, 2] global), clipped to that region, in the local frame (minus ``origin``)."""
    shapely = shapely_module()
    pts = np.unique(np.round(centre_path, 3), axis=0)
    line = shapely.Point(pts[0]) if len(pts) < 2 else shapely.LineString(centre_path)
    region = shapely.buffer(line, radius, quad_segs=4)
    route = {str(r) for r in route_roadblock_ids}
    out = {}
    for fld, layers, select in (("drivable", DRIVABLE_LAYERS, None), ("carl_drivable", CARL_DRIVABLE_LAYERS, None),
                                ("route_polygons", ROUTE_LAYERS, {n: route for n in ROUTE_LAYERS})):
        g, ids = clip_layers(m, layers, region, select, prefix=fld != "route_polygons")
        out[fld] = PolygonSet.from_shapely(g, ids, origin)
    return out

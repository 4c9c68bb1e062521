"""The one map format: a compiled lane graph.

Every map source (procedural towns, OpenDRIVE through ``carla.Map``, nuPlan GeoPackage) builds a list of
:class:`Lane` objects plus traffic control and calls :meth:`LaneGraph.build`. The simulator only ever sees a
``LaneGraph`` (numpy, saved to a compact versioned ``.npz``) and its compiled raster layers
(:mod:`envs.maps.rasterize`).

Frame: right-handed, metres, x east, y north, yaw counter-clockwise from +x. Loaders of left-handed sources
(CARLA) flip y before building.

Format versions: 1 stored one width per lane; 2 adds ``point_width`` (the lane width at every lane point, for lanes
whose width changes along them, e.g. OpenDRIVE cubic width polynomials). Version-1 files still load: their
``point_width`` is empty and :meth:`LaneGraph.point_widths` falls back to the lane widths.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np

FORMAT_VERSION = 2
#: Format versions :meth:`LaneGraph.load` reads (older ones are upgraded on load).
READABLE_FORMAT_VERSIONS = (1, 2)

# Lane-marking types stored per lane boundary.
MARK_NONE, MARK_BROKEN, MARK_SOLID = 0, 1, 2
# Junction control kinds.
CONTROL_NONE, CONTROL_LIGHT, CONTROL_STOP = 0, 1, 2


class MapError(ValueError):
    """A map that cannot be built or loaded; the message names the file or element."""


@dataclass
class Lane:
    """One driving lane as a loader describes it (before compilation)."""

    points: np.ndarray  # [N, 2] centre polyline in driving direction, N >= 2
    width: float = 3.5
    speed_limit: float = 13.89  # m/s
    is_junction: bool = False
    successors: list[int] = field(default_factory=list)
    left: int = -1  # same-direction neighbour to the left (lane change target), -1 none
    right: int = -1
    left_marking: int = MARK_SOLID
    right_marking: int = MARK_SOLID
    junction: int = -1  # junction id for junction lanes (and for lanes ending at a junction: see stop lines)
    widths: np.ndarray | None = None  # [N] width at every point of ``points`` (None: ``width`` everywhere)


@dataclass
class StopLine:
    """A place where traffic control applies: the end of ``lane`` (an approach lane into a junction)."""

    lane: int
    control: int  # CONTROL_LIGHT or CONTROL_STOP
    light_group: int = -1  # index into LaneGraph.light_groups for CONTROL_LIGHT


@dataclass
class LightGroup:
    """A set of signal heads that show the same colour: phase ``phase`` of junction ``junction``."""

    junction: int
    phase: int
    num_phases: int


@dataclass
class LaneGraph:
    """Compiled lane graph (numpy arrays). Build with :meth:`build`; save/load with :meth:`save`/:meth:`load`.

    Lanes are concatenated polylines resampled to at most ``max_spacing`` metres: lane ``i`` owns
    ``points[offsets[i]:offsets[i+1]]``. Links are CSR arrays. ``width`` is one representative width per lane (the
    loader's median); ``point_width`` (format 2) is the width at every point, linearly interpolated between the
    loader's samples -- read it through :meth:`point_widths`, which also serves graphs without it.
    """

    name: str
    points: np.ndarray  # [P, 2] float32
    offsets: np.ndarray  # [L+1] int64
    width: np.ndarray  # [L] float32
    speed_limit: np.ndarray  # [L] float32 m/s
    is_junction: np.ndarray  # [L] bool
    junction: np.ndarray  # [L] int32 (-1 none)
    succ_offsets: np.ndarray  # [L+1] int64
    succ_index: np.ndarray  # [E] int32
    left: np.ndarray  # [L] int32
    right: np.ndarray  # [L] int32
    left_marking: np.ndarray  # [L] uint8
    right_marking: np.ndarray  # [L] uint8
    stop_lane: np.ndarray  # [K] int32 lane whose end carries the stop line
    stop_control: np.ndarray  # [K] uint8
    stop_light_group: np.ndarray  # [K] int32
    light_junction: np.ndarray  # [G] int32
    light_phase: np.ndarray  # [G] int32
    light_num_phases: np.ndarray  # [G] int32
    crosswalks: np.ndarray  # [C, 4, 2] float32 convex quads
    shoulder_points: np.ndarray  # [Q, 2] float32 shoulder/parking polylines (drawn, not driven)
    shoulder_offsets: np.ndarray  # [S+1] int64
    shoulder_width: np.ndarray  # [S] float32
    speed_signs: np.ndarray  # [Z, 3] float32 (x, y, limit m/s)
    meta: dict = field(default_factory=dict)
    # [P] float32 lane width at every point (format 2); empty = ``width`` of the point's lane everywhere
    point_width: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))

    # ------------------------------------------------------------------ building
    @classmethod
    def build(
        cls,
        name: str,
        lanes: list[Lane],
        stop_lines: list[StopLine] = (),
        light_groups: list[LightGroup] = (),
        crosswalks: np.ndarray | None = None,
        shoulders: list[tuple[np.ndarray, float]] = (),
        speed_signs: np.ndarray | None = None,
        max_spacing: float = 1.0,
        meta: dict | None = None,
    ) -> "LaneGraph":
        """Validate loader output and compile it. Errors name the map and the offending element."""
        if not lanes:
            raise MapError(f"map '{name}': no driving lanes; a map needs at least one lane")
        n = len(lanes)
        pts, offs, pws = [], [0], []
        for i, lane in enumerate(lanes):
            p = np.asarray(lane.points, dtype=np.float64)
            if p.ndim != 2 or p.shape[1] != 2 or len(p) < 2 or not np.isfinite(p).all():
                raise MapError(f"map '{name}': lane {i} has an invalid polyline of shape {p.shape} "
                               "(need >= 2 finite (x, y) points)")
            if lane.width <= 0 or not np.isfinite(lane.width):
                raise MapError(f"map '{name}': lane {i} has width {lane.width}; widths must be > 0")
            if lane.widths is None:
                w = np.full(len(p), float(lane.width))
            else:
                w = np.asarray(lane.widths, dtype=np.float64)
                if w.shape != (len(p),) or not np.isfinite(w).all() or (w <= 0).any():
                    raise MapError(f"map '{name}': lane {i} has per-point widths of shape {w.shape} (min "
                                   f"{np.nanmin(w) if w.size else 'n/a'}); need one finite width > 0 per point "
                                   f"({len(p)} points)")
            for j in (*lane.successors, lane.left, lane.right):
                if j >= n or j < -1:
                    raise MapError(f"map '{name}': lane {i} links to lane {j}, but the map has {n} lanes")
            p, w = resample_polyline_values(p, w, max_spacing)
            pts.append(p)
            pws.append(w)
            offs.append(offs[-1] + len(p))
        succ_off, succ_idx = [0], []
        for lane in lanes:
            succ_idx.extend(lane.successors)
            succ_off.append(len(succ_idx))
        for k, s in enumerate(stop_lines):
            if not 0 <= s.lane < n:
                raise MapError(f"map '{name}': stop line {k} refers to lane {s.lane}, but the map has {n} lanes")
            if s.control == CONTROL_LIGHT and not 0 <= s.light_group < len(light_groups):
                raise MapError(f"map '{name}': stop line {k} uses light group {s.light_group}, "
                               f"but the map has {len(light_groups)}")
        sh_pts, sh_off, sh_w = [], [0], []
        for p, w in shoulders:
            p = resample_polyline(np.asarray(p, dtype=np.float64), max_spacing)
            sh_pts.append(p)
            sh_off.append(sh_off[-1] + len(p))
            sh_w.append(w)
        return cls(
            name=name,
            points=np.concatenate(pts).astype(np.float32),
            offsets=np.asarray(offs, np.int64),
            width=np.array([l.width for l in lanes], np.float32),
            speed_limit=np.array([l.speed_limit for l in lanes], np.float32),
            is_junction=np.array([l.is_junction for l in lanes], bool),
            junction=np.array([l.junction for l in lanes], np.int32),
            succ_offsets=np.asarray(succ_off, np.int64),
            succ_index=np.asarray(succ_idx, np.int32),
            left=np.array([l.left for l in lanes], np.int32),
            right=np.array([l.right for l in lanes], np.int32),
            left_marking=np.array([l.left_marking for l in lanes], np.uint8),
            right_marking=np.array([l.right_marking for l in lanes], np.uint8),
            stop_lane=np.array([s.lane for s in stop_lines], np.int32),
            stop_control=np.array([s.control for s in stop_lines], np.uint8),
            stop_light_group=np.array([s.light_group for s in stop_lines], np.int32),
            light_junction=np.array([g.junction for g in light_groups], np.int32),
            light_phase=np.array([g.phase for g in light_groups], np.int32),
            light_num_phases=np.array([g.num_phases for g in light_groups], np.int32),
            crosswalks=(np.zeros((0, 4, 2), np.float32) if crosswalks is None
                        else np.asarray(crosswalks, np.float32).reshape(-1, 4, 2)),
            shoulder_points=(np.concatenate(sh_pts).astype(np.float32) if sh_pts
                             else np.zeros((0, 2), np.float32)),
            shoulder_offsets=np.asarray(sh_off, np.int64),
            shoulder_width=np.asarray(sh_w, np.float32),
            speed_signs=(np.zeros((0, 3), np.float32) if speed_signs is None
                         else np.asarray(speed_signs, np.float32).reshape(-1, 3)),
            meta=dict(meta or {}),
            point_width=np.concatenate(pws).astype(np.float32),
        )

    # ------------------------------------------------------------------ queries
    @property
    def num_lanes(self) -> int:
        return len(self.width)

    def lane_points(self, i: int) -> np.ndarray:
        return self.points[self.offsets[i]:self.offsets[i + 1]]

    def point_widths(self) -> np.ndarray:
        """[P] float32 lane width at every point of ``points`` (``point_width``, else each lane's ``width``)."""
        if len(self.point_width) == len(self.points):
            return self.point_width
        return np.repeat(self.width.astype(np.float32), np.diff(self.offsets))

    def lane_widths(self, i: int) -> np.ndarray:
        """Width at every point of lane ``i`` (see :meth:`point_widths`)."""
        if len(self.point_width) == len(self.points):
            return self.point_width[self.offsets[i]:self.offsets[i + 1]]
        return np.full(int(self.offsets[i + 1] - self.offsets[i]), self.width[i], np.float32)

    def successors(self, i: int) -> np.ndarray:
        return self.succ_index[self.succ_offsets[i]:self.succ_offsets[i + 1]]

    def predecessors(self) -> list[list[int]]:
        """Predecessor lists, derived from successors (not stored: one source of truth)."""
        pred: list[list[int]] = [[] for _ in range(self.num_lanes)]
        for i in range(self.num_lanes):
            for j in self.successors(i):
                pred[int(j)].append(i)
        return pred

    def with_control_rows(self) -> "LaneGraph":
        """This graph, or a shallow copy with one inert stop line / light group where it has none.

        Maps without traffic lights or stop lines (roundabouts, motorways, loops) have empty control arrays; code
        that indexes them with padded indices (0 for "none") needs at least one row. The added stop line sits at
        the end of lane 0 with ``CONTROL_NONE`` and no light group, the added light group is phase 0 of 1 at
        junction 0; callers must map lanes to stop lines from the *original* ``stop_lane`` (so no lane or route
        refers to the inert row).
        """
        changes: dict[str, np.ndarray] = {}
        if len(self.stop_lane) == 0:
            changes.update(stop_lane=np.zeros(1, np.int32), stop_control=np.full(1, CONTROL_NONE, np.uint8),
                           stop_light_group=np.full(1, -1, np.int32))
        if len(self.light_junction) == 0:
            changes.update(light_junction=np.zeros(1, np.int32), light_phase=np.zeros(1, np.int32),
                           light_num_phases=np.ones(1, np.int32))
        return replace(self, **changes) if changes else self

    def lane_lengths(self) -> np.ndarray:
        d = np.linalg.norm(np.diff(self.points, axis=0), axis=1)
        seg_lane = np.repeat(np.arange(self.num_lanes), np.diff(self.offsets))[:-1]
        same = np.diff(np.repeat(np.arange(self.num_lanes), np.diff(self.offsets))) == 0
        return np.bincount(seg_lane[same], weights=d[same], minlength=self.num_lanes).astype(np.float32)

    def bounds(self, margin: float = 10.0) -> tuple[float, float, float, float]:
        """(xmin, ymin, xmax, ymax) of everything drawn, with a margin."""
        allp = [self.points, self.shoulder_points, self.crosswalks.reshape(-1, 2)]
        p = np.concatenate([a for a in allp if len(a)])
        lo, hi = p.min(0) - margin, p.max(0) + margin
        return float(lo[0]), float(lo[1]), float(hi[0]), float(hi[1])

    def num_junctions(self) -> int:
        """Junction ids run from 0 to this number - 1 (lanes' ``junction`` and light groups' ``light_junction``)."""
        return int(max(self.junction.max(initial=-1), self.light_junction.max(initial=-1)) + 1)

    # ------------------------------------------------------------------ combining maps
    def translated(self, shift: tuple[float, float]) -> "LaneGraph":
        """This map moved by ``shift`` metres (every drawn or driven coordinate; links are unchanged)."""
        d = np.asarray(shift, np.float64)
        move = lambda a: (a.astype(np.float64) + d).astype(np.float32)  # noqa: E731
        signs = self.speed_signs.copy()
        signs[:, :2] = move(signs[:, :2])
        return replace(self, points=move(self.points), shoulder_points=move(self.shoulder_points),
                       crosswalks=move(self.crosswalks), speed_signs=signs)

    def compact_junctions(self) -> "LaneGraph":
        """This map with junction ids renumbered 0..J-1 in order of first use (OpenDRIVE ids are sparse: Town04's
        run to 1,593 for 60-odd junctions, and the simulator keeps per-junction state for every id)."""
        used = np.unique(np.concatenate([self.junction[self.junction >= 0], self.light_junction]))
        new = np.searchsorted(used, self.junction).astype(np.int32)
        return replace(self, junction=np.where(self.junction >= 0, new, -1).astype(np.int32),
                       light_junction=np.searchsorted(used, self.light_junction).astype(np.int32))

    @classmethod
    def concatenate(cls, name: str, graphs: list["LaneGraph"], meta: dict | None = None) -> "LaneGraph":
        """One graph holding every map of ``graphs`` side by side (place them apart first: :meth:`translated`).

        Lanes, points, stop lines, light groups and junctions of map ``k`` follow those of maps ``0..k-1`` (junction
        ids of map ``k`` are shifted by the :meth:`num_junctions` of the maps before it); every index is shifted
        accordingly, so routes and lookups work unchanged on the combined graph.
        """
        if not graphs:
            raise MapError(f"map '{name}': no maps to combine")
        lanes = np.cumsum([0] + [g.num_lanes for g in graphs])
        pts = np.cumsum([0] + [len(g.points) for g in graphs])
        edges = np.cumsum([0] + [len(g.succ_index) for g in graphs])
        groups = np.cumsum([0] + [len(g.light_junction) for g in graphs])
        juncs = np.cumsum([0] + [g.num_junctions() for g in graphs])
        sh = np.cumsum([0] + [len(g.shoulder_points) for g in graphs])

        def cat(key: str, shift: np.ndarray | None = None, keep_negative: bool = True) -> np.ndarray:
            parts = []
            for k, g in enumerate(graphs):
                a = getattr(g, key)
                if shift is not None:
                    a = np.where(a >= 0, a + shift[k], a) if keep_negative else a + shift[k]
                parts.append(np.asarray(a))
            return np.concatenate(parts).astype(getattr(graphs[0], key).dtype)

        return cls(
            name=name, points=cat("points"),
            offsets=np.concatenate([[0]] + [g.offsets[1:] + pts[k] for k, g in enumerate(graphs)]).astype(np.int64),
            width=cat("width"), speed_limit=cat("speed_limit"), is_junction=cat("is_junction"),
            junction=cat("junction", juncs),
            succ_offsets=np.concatenate([[0]] + [g.succ_offsets[1:] + edges[k] for k, g in enumerate(graphs)]
                                        ).astype(np.int64),
            succ_index=cat("succ_index", lanes), left=cat("left", lanes), right=cat("right", lanes),
            left_marking=cat("left_marking"), right_marking=cat("right_marking"),
            stop_lane=cat("stop_lane", lanes), stop_control=cat("stop_control"),
            stop_light_group=cat("stop_light_group", groups),
            light_junction=cat("light_junction", juncs), light_phase=cat("light_phase"),
            light_num_phases=cat("light_num_phases"), crosswalks=cat("crosswalks"),
            shoulder_points=cat("shoulder_points"),
            shoulder_offsets=np.concatenate([[0]] + [g.shoulder_offsets[1:] + sh[k] for k, g in enumerate(graphs)]
                                            ).astype(np.int64),
            shoulder_width=cat("shoulder_width"), speed_signs=cat("speed_signs"),
            meta={"maps": [g.name for g in graphs]} if meta is None else dict(meta),
            point_width=np.concatenate([g.point_widths() for g in graphs]).astype(np.float32),
        )

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> None:
        """Write a compact versioned ``.npz`` atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("name", "meta")}
        header = json.dumps({"version": FORMAT_VERSION, "name": self.name, "meta": self.meta})
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")  # own name: processes compiling one map at once
        try:
            np.savez_compressed(tmp, __header__=np.frombuffer(header.encode(), np.uint8), **arrays)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | Path) -> "LaneGraph":
        path = Path(path)
        if not path.exists():
            raise MapError(f"map file {path} does not exist")
        try:
            with np.load(path, allow_pickle=False) as z:
                header = json.loads(bytes(z["__header__"]).decode())
                arrays = {k: z[k] for k in z.files if k != "__header__"}
        except Exception as e:  # noqa: BLE001 - any unreadable file gets the same actionable message
            raise MapError(f"map file {path} is not a readable carl lane graph ({e}); rebuild it") from e
        if header.get("version") not in READABLE_FORMAT_VERSIONS:
            raise MapError(f"map file {path} has format version {header.get('version')}, this carl reads "
                           f"versions {', '.join(map(str, READABLE_FORMAT_VERSIONS))}; delete the file to rebuild it")
        known = {f.name for f in fields(cls)}
        return cls(name=header["name"], meta=header.get("meta", {}), **{k: v for k, v in arrays.items() if k in known})


def resample_polyline(p: np.ndarray, max_spacing: float) -> np.ndarray:
    """Insert points so no segment is longer than ``max_spacing``; drops repeated points."""
    return resample_polyline_values(p, np.zeros(len(p)), max_spacing)[0]


def resample_polyline_values(p: np.ndarray, values: np.ndarray, max_spacing: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`resample_polyline` that carries a per-point value along (linear interpolation on inserted points;
    of repeated points the first one's value is kept)."""
    keep = np.concatenate([[True], np.linalg.norm(np.diff(p, axis=0), axis=1) > 1e-6])
    p, values = p[keep], np.asarray(values, np.float64)[keep]
    if len(p) < 2:
        raise MapError("polyline collapses to a single point")
    seg = np.linalg.norm(np.diff(p, axis=0), axis=1)
    n_sub = np.maximum(1, np.ceil(seg / max_spacing).astype(np.int64))
    # output point j of segment k sits at t = j / n_sub[k], j = 1..n_sub[k] (vectorised over all segments)
    k = np.repeat(np.arange(len(seg)), n_sub)
    j = np.arange(len(k)) - np.repeat(np.cumsum(n_sub) - n_sub, n_sub) + 1
    t = j / n_sub[k]
    out = p[k] + (p[k + 1] - p[k]) * t[:, None]
    vals = values[k] + (values[k + 1] - values[k]) * t
    return np.concatenate([p[:1], out]), np.concatenate([values[:1], vals])

"""OpenDRIVE (CARLA Town maps) -> :class:`~envs.maps.lanegraph.LaneGraph`, through the real ``carla`` package.

``carla.Map(name, xodr_text)`` parses OpenDRIVE offline (no server). This module walks the parsed map and emits
the one map format of this project:

* **Lanes.** Every topology lane piece (one ``(road, section, lane)`` of type Driving) becomes a :class:`Lane`:
  its centre line is sampled with ``Waypoint.next_until_lane_end(spacing)`` from the piece's entry waypoint, so the
  polyline already runs in the driving direction. Where carla's walk fails (it asserts "distance > 0.0" when a lane
  driven with s is a whole multiple of ``spacing`` long and its last step lands exactly on the lane end), the piece
  is walked step by step with ``Waypoint.next(spacing)`` and closed with the waypoint at its end; samples that
  repeat the previous one are dropped. The lane width is sampled at every point (``Waypoint.lane_width``), so lanes
  whose OpenDRIVE width polynomial changes inside a lane section keep their shape (``Lane.widths``; ``Lane.width``
  is the median). Successors come from ``Map.get_topology()``; left/right
  neighbours from ``get_left_lane()``/``get_right_lane()`` when the neighbour is a same-direction Driving lane and
  ``Waypoint.lane_change`` allows the change; markings from ``left_lane_marking``/``right_lane_marking``
  (Broken/BrokenBroken/BottsDots -> broken; Solid/SolidSolid/Curb/Grass -> solid; the mixed SolidBroken/BrokenSolid
  -> broken if the lane change to that side is allowed, else solid; NONE/Other -> none). Lanes that have no
  topology edge at all (isolated roads) are recovered from ``generate_waypoints``.
* **Frame.** CARLA is left-handed (its y axis is OpenDRIVE's flipped). All coordinates go through
  :func:`carla_to_world` (``(x, y) -> (x, -y)``) and headings through :func:`carla_yaw_to_world`
  (``yaw_deg -> -radians(yaw_deg)``). Mirroring keeps "left of the driving direction" left: a lane's left
  neighbour lies on the positive side of the cross product in our frame (tested).
* **Traffic lights** (landmark type ``1000001``). CARLA's exports place the signal references on the junction's
  connecting roads, with lane validities. Each (road, lane-in-validity, s) is resolved to a lane piece; a junction
  piece's non-junction predecessors are the approach lanes, a non-junction piece is followed downstream to the
  lane that enters the junction. Each approach lane gets ``StopLine(lane, CONTROL_LIGHT, group)``. Phases: within
  a junction, the signal heads (landmark ids) are clustered by the axis of their approach heading -- heads whose
  approaches are parallel or opposite (heading difference < 30 deg or > 150 deg) share a phase; one
  :class:`LightGroup` per (junction, phase). (CARLA's own server cycles every head of a group in turn; the
  axis-based phases here let opposite approaches go together, which is the usual real-world plan.)
* **Stop signs** (type ``206``) are mapped the same way to ``CONTROL_STOP`` stop lines. **Yield signs** (``205``)
  are ignored: CARLA's Leaderboard only scores running stop signs and red lights.
* **Derived control.** Maps without any traffic-light or stop-sign landmark (the 2019 Town03/Town05 exports
  shipped in ``shared/data``) get derived control: every junction where >= 3 distinct approach roads meet is
  signalised, one light group per approach axis (as above); ``meta["derived_control"]`` is then ``True``. Maps
  without such junctions (roundabouts, motorways, loops) end up with no stop lines and no light groups at all, which
  is valid.
* **Speed limits** (type ``274``; the value is km/h even where the export says "mph", as CARLA reads it). A sign
  seeds the lane pieces of its road/section and valid lanes; every other lane takes the limit of the nearest
  upstream sign along the lane graph (Dijkstra over lane lengths); unreached lanes get CARLA's town default of
  30 km/h. Sign positions are also stored as ``speed_signs`` (x, y, m/s).
* **Shoulders.** Shoulder and Parking lanes adjacent to the outermost driving lanes become shoulder polylines
  with their median width.
* **Crosswalks.** ``Map.get_crosswalks()`` (closed polygons, first point repeated) -> ``[C, 4, 2]`` convex quads;
  non-quads are replaced by their minimum-area bounding rectangle.

Bad input never escapes as a raw ``RuntimeError``/``IndexError``: the XML is checked first for what makes carla's
parser crash the process (missing ``<planView>``/``<geometry>``/``<lanes>``/``<laneSection>``/``<center>``, lane
links in the driving direction to lanes that do not exist, ...) or raise (lane sections beyond the road length,
junction connections to missing roads), and the map is compiled in a forked child process (Linux), so a crash
that the checks miss still becomes a :class:`MapError`. Every error names the file, the road (and lane) when
known, and a fix.

Entry points: :func:`load_opendrive` (any ``.xodr`` file) and :func:`load_town` (``"Town01"`` ..., with an
``.npz`` cache keyed by the xodr's sha256). See ``docs/maps.md``.

One file, on purpose: the builder's passes (lanes, widths, neighbours, lights, stop lines, crosswalks, junction
areas) share one parsed ``carla.Map``, its lane-piece index and the frame conversion; split, each pass would reach
into the others' private index. Its public surface is small: :func:`load_opendrive`, :func:`load_town` and the frame
helpers.
"""
from __future__ import annotations

import hashlib
import heapq
import math
import multiprocessing
import os
import signal
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from envs import data
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

__all__ = [
    "carla_to_world",
    "world_to_carla",
    "carla_yaw_to_world",
    "world_yaw_to_carla",
    "load_opendrive",
    "load_town",
    "available_towns",
    "default_maps_dir",
    "LOADER_VERSION",
]

#: Bumped whenever the loader's output changes, so cached ``.npz`` files are rebuilt.
#: 2: per-point lane widths; robust lane walks (no repeated end sample).
#: 3: crosswalks that are not convex quads: shapely's minimum rectangle, counter-clockwise from its lowest-x corner.
LOADER_VERSION = 3
#: Narrowest per-point lane width stored (m); lanes opening from zero width start at this.
MIN_POINT_WIDTH = 0.1
#: Samples closer than this (m) to the previous sample of a piece are dropped.
MIN_SAMPLE_STEP = 1e-3
#: How far (m) inside a lane section the end waypoint of a step-by-step walk is taken.
END_INSET = 1e-4
#: Geometry primitives carla's parser knows.
GEOMETRY_KINDS = ("line", "arc", "spiral", "poly3", "paramPoly3")
#: CARLA's default town speed limit (30 km/h) in m/s.
DEFAULT_SPEED_LIMIT = 30.0 / 3.6
#: Approaches whose headings differ by less than this (mod 180 deg) share a light phase.
PHASE_AXIS_TOLERANCE_DEG = 30.0
#: How far (m) a signal on a non-junction lane is followed downstream to find the junction it guards.
MAX_APPROACH_SEARCH = 80.0

TYPE_TRAFFIC_LIGHT = "1000001"
TYPE_SPEED_LIMIT = "274"
TYPE_STOP = "206"
TYPE_YIELD = "205"

Key = tuple[int, int, int]  # (road_id, section_id, lane_id)


# ---------------------------------------------------------------------------------------------- frame conversion
def carla_to_world(x: Any, y: Any) -> tuple[Any, Any]:
    """CARLA world (left-handed) position -> our right-handed frame: ``(x, y) -> (x, -y)``.

    Works on scalars and numpy arrays alike. Use it for everything in CARLA coordinates (map waypoints,
    landmark transforms, Leaderboard route XML positions).
    """
    return x, -y


def world_to_carla(x: Any, y: Any) -> tuple[Any, Any]:
    """Inverse of :func:`carla_to_world` (the flip is its own inverse)."""
    return x, -y


def carla_yaw_to_world(yaw_deg: Any) -> Any:
    """CARLA yaw (degrees, clockwise-positive seen from above) -> our yaw (radians, counter-clockwise)."""
    return -np.radians(yaw_deg)


def world_yaw_to_carla(yaw_rad: Any) -> Any:
    """Inverse of :func:`carla_yaw_to_world`: our yaw (radians) -> CARLA yaw (degrees)."""
    return -np.degrees(yaw_rad)


# ---------------------------------------------------------------------------------------------- helpers
def _import_carla() -> Any:
    try:
        import carla  # noqa: PLC0415 - optional dependency, imported on use
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise MapError("loading OpenDRIVE maps needs the carla client package: pip install carla==0.9.16") from e
    return carla


def _validate_xodr(path: Path) -> tuple[str, ET.Element]:
    """Read ``path`` and check it is an OpenDRIVE document with roads; return (text, root). Raises MapError."""
    if not path.is_file():
        raise MapError(f"OpenDRIVE file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MapError(f"OpenDRIVE file {path} cannot be read as UTF-8 text ({e})") from e
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise MapError(f"OpenDRIVE file {path} is not well-formed XML ({e})") from e
    if root.tag != "OpenDRIVE":
        raise MapError(f"OpenDRIVE file {path} has root element <{root.tag}>, expected <OpenDRIVE>")
    if root.find("road") is None:
        raise MapError(f"OpenDRIVE file {path} has no <road> elements")
    _check_structure(path, root)
    return text, root


def _num(elem: ET.Element, attr: str) -> float | None:
    """Attribute ``attr`` of ``elem`` as a finite float, else None."""
    try:
        v = float(elem.get(attr, ""))
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def _check_structure(path: Path, root: ET.Element) -> None:
    """Reject, with a MapError naming the road and the fix, what makes carla's OpenDRIVE parser crash the process
    (segmentation fault) or fail without saying where. Found by feeding carla 0.9.16 broken variants of valid maps."""
    where = f"OpenDRIVE file {path}"
    spec = "see the OpenDRIVE 1.4 spec or re-export the map from its editor"
    roads: dict[int, ET.Element] = {}
    sections_of: dict[int, list[tuple[float, set[int], ET.Element]]] = {}  # road -> (s, lane ids, element), by s
    for n, road in enumerate(root.findall("road")):
        rid_text = road.get("id")
        label = f"road {rid_text}" + (f" ('{road.get('name')}')" if road.get("name") else "")
        try:
            rid = int(rid_text or "")
        except ValueError:
            raise MapError(f"{where}: road #{n} has {'no id' if rid_text is None else f'id {rid_text!r}'}; carla "
                           "reads road ids as integers. Fix: give "
                           "every <road> a unique integer id (and update the links that refer to it)") from None
        if rid in roads:
            raise MapError(f"{where}: road id {rid} is used by more than one <road>; fix: give every road a unique "
                           "id (and update the links that refer to it)")
        roads[rid] = road
        length = _num(road, "length")
        if length is None or length <= 0:
            raise MapError(f"{where}: {label} has length {road.get('length')!r}; a road needs a length > 0. Fix: "
                           "set it to the sum of its <planView><geometry> lengths")
        geoms = road.findall("planView/geometry")
        if not geoms:
            raise MapError(f"{where}: {label} has no <planView><geometry> records (carla crashes on such roads). "
                           "Fix: give it a reference line, e.g. <geometry s=\"0\" x=.. y=.. hdg=.. length=..><line/>"
                           "</geometry>")
        for g in geoms:
            bad = [a for a in ("s", "x", "y", "hdg", "length") if _num(g, a) is None]
            kinds = [c.tag for c in g if c.tag in GEOMETRY_KINDS]
            at = f"{label}, <geometry s={g.get('s')!r}>"
            if bad:
                raise MapError(f"{where}: {at} has missing or non-numeric {', '.join(bad)}; fix: give s, x, y, hdg "
                               "and length as finite numbers")
            if len(kinds) != 1:
                raise MapError(f"{where}: {at} has {len(kinds)} shape elements ({', '.join(kinds) or 'none'}); "
                               f"carla crashes on such records. Fix: give it exactly one of "
                               f"{', '.join(f'<{k}>' for k in GEOMETRY_KINDS)}")
            if kinds[0] == "arc":
                k = _num(g.find("arc"), "curvature")
                if k is None or k == 0:
                    raise MapError(f"{where}: {at} is an <arc> with curvature {g.find('arc').get('curvature')!r}; "
                                   "fix: use a non-zero finite curvature, or <line/> for a straight piece")
            if not -1e-6 <= _num(g, "s") <= length + 1e-6:
                raise MapError(f"{where}: {at} starts at s={g.get('s')} outside the road's length {length:g}; "
                               "fix: correct the road length or the geometry's s")
        sections = road.findall("lanes/laneSection")
        if not sections:
            raise MapError(f"{where}: {label} has no <lanes><laneSection> (carla crashes on such roads); fix: add "
                           "a lane section with a <center> lane and at least one driving lane")
        ids_per_section: list[tuple[float, set[int], ET.Element]] = []
        for sec in sections:
            s0 = _num(sec, "s")
            if s0 is None or not -1e-6 <= s0 <= length + 1e-6:
                raise MapError(f"{where}: {label} has a <laneSection s={sec.get('s')!r}> outside its length "
                               f"{length:g}; fix: lane sections must start within [0, road length]")
            if not sec.findall("center/lane"):
                raise MapError(f"{where}: {label}, lane section s={sec.get('s')}: no <center><lane id=\"0\"/>"
                               "</center> (carla crashes without it); fix: add the centre lane")
            ids: set[int] = set()
            for side, sign in (("left", 1), ("right", -1)):  # (carla takes a centre lane without an id as lane 0)
                for lane in sec.findall(f"{side}/lane"):
                    lid_text = lane.get("id")
                    try:
                        lid = int(lid_text or "")
                    except ValueError:
                        what = "no id" if lid_text is None else f"id {lid_text!r}"
                        raise MapError(f"{where}: {label}, lane section s={sec.get('s')}: a <{side}> lane has {what}; "
                                       "carla crashes on such lanes. Fix: lane ids are integers (left > 0, right < 0, "
                                       "centre 0)") from None
                    if (sign > 0 and lid <= 0) or (sign < 0 and lid >= 0):
                        raise MapError(f"{where}: {label}, lane section s={sec.get('s')}: lane {lid} sits in "
                                       f"<{side}> (carla crashes on such lanes); fix: left lanes have ids > 0, right "
                                       "lanes < 0, the centre lane 0")
                    ids.add(lid)
            ids_per_section.append((s0, ids, sec))
        sections_of[rid] = sorted(ids_per_section, key=lambda t: t[0])
    # Lane links in the driving direction (lanes < 0: successor; lanes > 0: predecessor) must name an existing lane:
    # carla dereferences them without a check and crashes. (Links against the driving direction are not followed.)
    for rid, road in roads.items():
        label = f"road {rid}"
        secs = sections_of[rid]
        link = {t: road.find(f"link/{t}") for t in ("predecessor", "successor")}
        for k, (s0, _, sec) in enumerate(secs):
            for lane in sec.findall("left/lane") + sec.findall("right/lane"):
                lid = int(lane.get("id"))
                tag = "successor" if lid < 0 else "predecessor"
                target = lane.find(f"link/{tag}")
                if target is None:
                    continue
                try:
                    tid = int(target.get("id", ""))
                except ValueError:
                    raise MapError(f"{where}: {label} lane {lid}: <{tag} id={target.get('id')!r}> is not an "
                                   "integer lane id; fix: correct the lane link") from None
                inner = k + 1 < len(secs) if lid < 0 else k > 0
                if inner:
                    nb = secs[k + 1] if lid < 0 else secs[k - 1]
                    if tid not in nb[1]:
                        raise MapError(f"{where}: {label} lane {lid} (lane section s={s0:g}): its {tag} lane {tid} "
                                       f"does not exist in the road's {'next' if lid < 0 else 'previous'} lane "
                                       f"section (s={nb[0]:g}); carla crashes on such links. Fix: link the lane "
                                       "to a lane of that section, or remove the link")
                    continue
                rl = link[tag]
                if rl is None or rl.get("elementType", "road") != "road":
                    continue
                try:
                    other = int(rl.get("elementId", ""))
                except ValueError:
                    continue
                if other in sections_of and not any(tid in ids for _, ids, _ in sections_of[other]):
                    raise MapError(f"{where}: {label} lane {lid}: its {tag} is lane {tid} of road {other}, which has "
                                   f"no lane {tid}; carla crashes on such links. Fix: link it to an existing lane "
                                   f"of road {other} (or remove the link)")
    for junction in root.findall("junction"):
        for c in junction.findall("connection"):
            val = c.get("connectingRoad")
            if val is None:
                continue
            try:
                ok = int(val) in roads
            except ValueError:
                ok = False
            if not ok:
                raise MapError(f"{where}: junction {junction.get('id')} connection {c.get('id')}: connectingRoad "
                               f"{val!r} is not a road in the file; fix: point it to the connecting road's id or "
                               f"remove the connection ({spec})")


def _section_bounds(root: ET.Element) -> dict[tuple[int, int], tuple[float, float]]:
    """(road id, section index) -> (s_start, s_end) of every lane section, from the XML."""
    out: dict[tuple[int, int], tuple[float, float]] = {}
    for road in root.iter("road"):
        try:
            rid, length = int(road.get("id", "")), float(road.get("length", "nan"))
            starts = sorted(float(ls.get("s", "0")) for ls in road.iter("laneSection"))
        except ValueError:
            continue
        for k, s0 in enumerate(starts):
            out[(rid, k)] = (s0, starts[k + 1] if k + 1 < len(starts) else length)
    return out


def _key(wp: Any) -> Key:
    return (wp.road_id, wp.section_id, wp.lane_id)


def _xy(loc: Any) -> tuple[float, float]:
    x, y = carla_to_world(loc.x, loc.y)
    return float(x), float(y)


def _marking(carla: Any, mark_type: Any, change_allowed: bool) -> int:
    T = carla.LaneMarkingType
    if mark_type in (T.Broken, T.BrokenBroken, T.BottsDots):
        return MARK_BROKEN
    if mark_type in (T.SolidBroken, T.BrokenSolid):
        return MARK_BROKEN if change_allowed else MARK_SOLID
    if mark_type in (T.Solid, T.SolidSolid, T.Curb, T.Grass):
        return MARK_SOLID
    return MARK_NONE


def _end_heading(points: np.ndarray) -> float:
    """Heading of the last non-degenerate segment of a polyline (0 if it has none)."""
    d = np.diff(points, axis=0)
    ok = np.nonzero(np.linalg.norm(d, axis=1) > 1e-6)[0]
    if len(ok) == 0:
        return 0.0
    v = d[ok[-1]]
    return math.atan2(v[1], v[0])


def _axial_diff(a: float, b: float) -> float:
    """Angle between two undirected axes, in [0, pi/2]."""
    d = (a - b) % math.pi
    return min(d, math.pi - d)


def _axial_mean(angles: Iterable[float]) -> float:
    """Mean axis (mod pi) of a set of headings (doubled-angle circular mean)."""
    a = np.asarray(list(angles), np.float64)
    return 0.5 * math.atan2(np.sin(2 * a).mean(), np.cos(2 * a).mean())


def _cluster_axes(headings: dict[Any, float]) -> dict[Any, int]:
    """Greedily cluster items by heading axis; returns item -> phase index (phases ordered by first item)."""
    tol = math.radians(PHASE_AXIS_TOLERANCE_DEG)
    reps: list[float] = []
    out: dict[Any, int] = {}
    for item in sorted(headings, key=str):
        h = headings[item]
        for k, r in enumerate(reps):
            if _axial_diff(h, r) < tol:
                out[item] = k
                break
        else:
            out[item] = len(reps)
            reps.append(h)
    return out


def _min_area_rect(points: np.ndarray) -> np.ndarray:
    """Minimum-area bounding rectangle [4, 2] of a 2-D point set (shapely's oriented envelope), counter-clockwise
    from its corner of lowest x (then y)."""
    import shapely  # only for crosswalks that are not convex quads

    p = np.unique(np.round(points, 6), axis=0)
    if len(p) < 3:
        raise ValueError("degenerate polygon")
    rect = shapely.oriented_envelope(shapely.multipoints(p))
    if shapely.get_type_id(rect) != 3 or shapely.area(rect) < 1e-6:  # the envelope of collinear points is a line
        raise ValueError("degenerate polygon")
    clockwise = shapely.get_coordinates(shapely.normalize(rect))[:4]  # normalize: clockwise from the lowest x, y
    return np.roll(clockwise[::-1], 1, axis=0)


def _to_quad(poly: np.ndarray) -> np.ndarray | None:
    """A crosswalk polygon -> a convex counter-clockwise quad, or None if degenerate."""
    try:
        if len(poly) == 4:
            c = poly.mean(0)
            q = poly[np.argsort(np.arctan2(poly[:, 1] - c[1], poly[:, 0] - c[0]))]
            e = np.roll(q, -1, axis=0) - q
            cross = e[:, 0] * np.roll(e, -1, axis=0)[:, 1] - e[:, 1] * np.roll(e, -1, axis=0)[:, 0]
            if (cross > 1e-9).all():
                return q
        return _min_area_rect(poly)
    except ValueError:
        return None


def _crosswalk_quads(locations: list[Any]) -> np.ndarray:
    """Split CARLA's flat crosswalk point list (closed polygons) into convex quads in our frame."""
    pts = np.array([_xy(l) for l in locations], np.float64).reshape(-1, 2)
    quads: list[np.ndarray] = []
    i = 0
    while i < len(pts):
        j = i + 1
        while j < len(pts) and np.linalg.norm(pts[j] - pts[i]) > 1e-3:
            j += 1
        q = _to_quad(pts[i:j])  # pts[j] (if any) repeats pts[i] and closes the polygon
        if q is not None:
            quads.append(q)
        i = j + 1
    return np.array(quads, np.float32).reshape(-1, 4, 2)


# ---------------------------------------------------------------------------------------------- the loader
class _Builder:
    """Walks one ``carla.Map`` and collects lanes, control, shoulders, crosswalks and speed signs."""

    def __init__(self, carla: Any, cmap: Any, name: str, spacing: float,
                 sections: dict[tuple[int, int], tuple[float, float]] | None = None,
                 progress: "_Progress | None" = None):
        self.carla, self.m, self.name, self.spacing = carla, cmap, name, spacing
        self.sections = sections or {}
        self.progress = progress or _Progress()
        self.keys: list[Key] = []
        self.index: dict[Key, int] = {}
        self.entry: list[Any] = []  # entry waypoint per piece
        self.wps: list[list[Any]] = []  # sampled waypoints per piece
        self.wxy: list[list[tuple[float, float]]] = []  # their positions (our frame)
        self.lanes: list[Lane] = []
        self.succ: list[set[int]] = []

    # ----------------------------------------------------------------- lane pieces
    def _add_piece(self, wp: Any) -> int:
        k = _key(wp)
        if k not in self.index:
            self.index[k] = len(self.keys)
            self.keys.append(k)
            self.entry.append(wp)
            self.succ.append(set())
        return self.index[k]

    def collect_pieces(self) -> None:
        topo = self.m.get_topology()
        for a, _ in topo:
            self._add_piece(a)
        for _, b in topo:
            self._add_piece(b)
        for a, b in topo:
            self.succ[self.index[_key(a)]].add(self.index[_key(b)])
        # Lanes without any topology edge (isolated roads): start them at their section's start in driving
        # direction (from the XML; previous_until_lane_start can crash the binding on such lanes).
        first: dict[Key, Any] = {}
        for wp in self.m.generate_waypoints(self.spacing):
            k = _key(wp)
            if k in self.index:
                continue
            prog = wp.s if k[2] < 0 else -wp.s
            if k not in first or prog < (first[k].s if k[2] < 0 else -first[k].s):
                first[k] = wp
        for k, wp in first.items():
            bounds = self.sections.get((k[0], k[1]))
            if bounds is not None:
                s = bounds[0] + 1e-6 if k[2] < 0 else bounds[1] - 1e-6
                start = self.m.get_waypoint_xodr(k[0], k[2], s)
                if start is not None and _key(start) == k:
                    wp = start
            self._add_piece(wp)

    def _walk(self, wp: Any, k: Key) -> tuple[list[Any], list[tuple[float, float]]]:
        """Waypoints of piece ``k`` from its entry ``wp`` to its end, about ``spacing`` apart, none repeated, and
        their positions in our frame."""
        try:
            raw = list(wp.next_until_lane_end(self.spacing))
        except RuntimeError:
            # carla asserts "distance > 0.0" when the walk's last step lands exactly on the lane end (a lane driven
            # with s whose length is a whole multiple of the spacing, in float arithmetic): step by step instead.
            raw = self._walk_steps(wp, k)
        ws, xy = [wp], [_xy(wp.transform.location)]
        for w in raw:
            if _key(w) != k:
                continue
            p = _xy(w.transform.location)
            if math.dist(p, xy[-1]) > MIN_SAMPLE_STEP:
                ws.append(w)
                xy.append(p)
        return ws, xy

    def _walk_steps(self, wp: Any, k: Key) -> list[Any]:
        """``next(spacing)`` while on piece ``k``, then the waypoint just inside the piece's end (from the XML)."""
        bounds = self.sections.get((k[0], k[1]))
        steps = int(((bounds[1] - bounds[0]) if bounds else 1e5) / self.spacing) + 3
        out, cur = [], wp
        for _ in range(steps):
            nxt = [w for w in cur.next(self.spacing) if _key(w) == k]
            if not nxt:
                break
            cur = nxt[0]
            out.append(cur)
        if bounds is not None:
            s_end = bounds[1] - END_INSET if k[2] < 0 else bounds[0] + END_INSET
            end = self.m.get_waypoint_xodr(k[0], k[2], s_end)
            if end is not None and _key(end) == k:
                out.append(end)
        return out

    def sample_pieces(self) -> None:
        for i, wp in enumerate(self.entry):
            k = self.keys[i]
            self.progress.set(f"walking road {k[0]} lane {k[2]} (lane section {k[1]})")
            ws, xy = self._walk(wp, k)
            self.wps.append(ws)
            self.wxy.append(xy)
            # CARLA reports some dead-end lanes as their own successor; keep a self-link only for a closed loop.
            if i in self.succ[i] and math.dist(xy[-1], xy[0]) > self.spacing:
                self.succ[i].discard(i)

    def _polyline(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Centre polyline [N, 2] of piece ``i`` and the lane width [N] at its points."""
        ws = self.wps[i]
        pts = list(self.wxy[i])
        widths = [max(float(w.lane_width), MIN_POINT_WIDTH) for w in ws]
        # Close the gap to the successors' common start (the lane end) when sampling stopped short of it.
        starts = [_xy(self.entry[j].transform.location) for j in sorted(self.succ[i])]
        if starts:
            end = np.mean(starts, axis=0)
            gap = math.dist(pts[-1], end)
            if 1e-3 < gap <= 1.5 * self.spacing + 0.5:
                pts.append((float(end[0]), float(end[1])))
                widths.append(widths[-1])
        p = np.array(pts, np.float64)
        if not np.isfinite(p).all():
            k = self.keys[i]
            raise MapError(f"road {k[0]} lane {k[2]} (lane section {k[1]}): carla computes non-finite positions "
                           "along it; fix: check the road's <geometry> records (spiral or poly3 parameters, huge "
                           "values) and its lane widths/offsets")
        if len(p) < 2 or np.linalg.norm(p[-1] - p[0]) < 1e-3:
            # Degenerate piece (shorter than the tolerance): extend 0.1 m along its heading.
            yaw = float(carla_yaw_to_world(ws[0].transform.rotation.yaw))
            p = np.array([p[0], p[0] + 0.1 * np.array([math.cos(yaw), math.sin(yaw)])])
            widths = widths[:1] * 2
        return p, np.array(widths, np.float64)

    def build_lanes(self) -> None:
        LC = self.carla.LaneChange
        driving = self.carla.LaneType.Driving
        for i, k in enumerate(self.keys):
            self.progress.set(f"reading road {k[0]} lane {k[2]} (lane section {k[1]})")
            ws = self.wps[i]
            mid = ws[len(ws) // 2]
            widths = [w.lane_width for w in ws if w.lane_width > 0.05]
            width = float(np.median(widths)) if widths else 3.5
            left_ok = mid.lane_change in (LC.Left, LC.Both)
            right_ok = mid.lane_change in (LC.Right, LC.Both)
            points, point_widths = self._polyline(i)
            if not widths:  # carla reports no usable width anywhere on the piece: the default everywhere
                point_widths = np.full(len(points), width)
            lane = Lane(
                points=points,
                width=width,
                widths=point_widths,
                speed_limit=DEFAULT_SPEED_LIMIT,
                is_junction=bool(ws[0].is_junction),
                junction=int(ws[0].junction_id) if ws[0].is_junction else -1,
                successors=sorted(self.succ[i]),
                left_marking=_marking(self.carla, mid.left_lane_marking.type, left_ok),
                right_marking=_marking(self.carla, mid.right_lane_marking.type, right_ok),
            )
            for side, ok in (("left", left_ok), ("right", right_ok)):
                nb = mid.get_left_lane() if side == "left" else mid.get_right_lane()
                if (ok and nb is not None and nb.lane_type == driving
                        and (nb.lane_id > 0) == (k[2] > 0) and _key(nb) in self.index):
                    setattr(lane, side, self.index[_key(nb)])
            self.lanes.append(lane)
        # Approach lanes carry the id of the junction they enter (see Lane.junction).
        for lane in self.lanes:
            if not lane.is_junction:
                js = [self.lanes[j].junction for j in lane.successors if self.lanes[j].is_junction]
                if js:
                    lane.junction = js[0]
        self.pred: list[list[int]] = [[] for _ in self.lanes]
        for i, lane in enumerate(self.lanes):
            for j in lane.successors:
                self.pred[j].append(i)
        self.length = [float(np.linalg.norm(np.diff(l.points, axis=0), axis=1).sum()) for l in self.lanes]

    # ----------------------------------------------------------------- signals
    def _signal_pieces(self, lm: Any) -> list[int]:
        """Lane pieces a landmark applies to (its road at its s, every valid driving lane)."""
        out: list[int] = []
        for lo, hi in lm.get_lane_validities():
            for lane_id in range(min(lo, hi), max(lo, hi) + 1):
                if lane_id == 0:
                    continue
                wp = self.m.get_waypoint_xodr(lm.road_id, lane_id, lm.s)
                if wp is not None and _key(wp) in self.index:
                    out.append(self.index[_key(wp)])
        return out

    def _approaches(self, i: int) -> list[int]:
        """The approach lane(s) whose end carries the stop line for a signal found on piece ``i``."""
        lanes = self.lanes
        if lanes[i].is_junction:
            out, frontier, seen = [], [i], {i}
            for _ in range(4):  # walk back through chained junction pieces
                nxt = []
                for j in frontier:
                    for p in self.pred[j]:
                        if p in seen:
                            continue
                        seen.add(p)
                        (nxt if lanes[p].is_junction else out).append(p)
                frontier = nxt
                if not frontier:
                    break
            return sorted(set(out))
        dist = 0.0
        while dist < MAX_APPROACH_SEARCH:
            succ = lanes[i].successors
            if any(lanes[j].is_junction for j in succ):
                return [i]
            if len(succ) != 1:
                return []
            dist += self.length[i]
            i = succ[0]
            if lanes[i].is_junction:
                return []
        return []

    def build_control(self) -> tuple[list[StopLine], list[LightGroup], bool]:
        """Stop lines and light groups from 1000001/206 landmarks, or derived ones; returns (.., .., derived)."""
        m = self.m
        lights = list(m.get_all_landmarks_of_type(TYPE_TRAFFIC_LIGHT))
        stops = list(m.get_all_landmarks_of_type(TYPE_STOP))
        # junction -> head id -> approach lanes
        heads: dict[int, dict[Any, set[int]]] = defaultdict(lambda: defaultdict(set))
        derived = not lights and not stops
        if derived:
            for a in range(len(self.lanes)):
                if not self.lanes[a].is_junction and self.lanes[a].junction >= 0:
                    heads[self.lanes[a].junction][("road", self.keys[a][0])].add(a)
            heads = {j: h for j, h in heads.items() if len(h) >= 3}
        else:
            for lm in lights:
                for piece in self._signal_pieces(lm):
                    for a in self._approaches(piece):
                        if self.lanes[a].junction >= 0:  # the junction the approach lane enters
                            heads[self.lanes[a].junction][("light", lm.id)].add(a)

        stop_lines: list[StopLine] = []
        groups: list[LightGroup] = []
        controlled: set[int] = set()
        for j in sorted(heads):
            hj = heads[j]
            heading = {h: _axial_mean(_end_heading(self.lanes[a].points) for a in lanes) for h, lanes in hj.items()}
            phase = _cluster_axes(heading)
            n_ph = max(phase.values()) + 1
            gid = {p: len(groups) + p for p in range(n_ph)}
            groups.extend(LightGroup(junction=j, phase=p, num_phases=n_ph) for p in range(n_ph))
            for h in sorted(hj, key=str):
                for a in sorted(hj[h]):
                    if a not in controlled:
                        controlled.add(a)
                        stop_lines.append(StopLine(lane=a, control=CONTROL_LIGHT, light_group=gid[phase[h]]))
        for lm in stops:
            for piece in self._signal_pieces(lm):
                for a in self._approaches(piece):
                    if a not in controlled:
                        controlled.add(a)
                        stop_lines.append(StopLine(lane=a, control=CONTROL_STOP))
        return stop_lines, groups, derived

    def assign_speed_limits(self) -> np.ndarray:
        """Set every lane's speed limit from 274 signs; return the signs as [Z, 3] (x, y, m/s).

        A piece carrying signs gets the limit that governs the longest stretch of it (from each sign to the next
        one or the piece end); the last sign passed on it propagates downstream, to the nearest (Dijkstra over
        lane lengths) successors that carry no sign themselves. Lanes no sign reaches keep the town default.
        """
        signs = list(self.m.get_all_landmarks_of_type(TYPE_SPEED_LIMIT))
        on_piece: dict[int, list[tuple[float, float]]] = defaultdict(list)  # piece -> [(progress, limit)]
        sign_rows = []
        for lm in signs:
            limit = float(lm.value) / 3.6  # CARLA reads the value as km/h, whatever the unit attribute says
            if not limit > 0:
                continue
            x, y = _xy(lm.transform.location)
            sign_rows.append((x, y, limit))
            for i in self._signal_pieces(lm):
                # progress along the driving direction: lanes with id < 0 run with s, lanes with id > 0 against it
                on_piece[i].append((lm.s if self.keys[i][2] < 0 else -lm.s, limit))
        outgoing: dict[int, float] = {}
        for i, lst in on_piece.items():
            lst.sort()
            ws = self.wps[i]
            end = ws[-1].s if self.keys[i][2] < 0 else -ws[-1].s
            cover: dict[float, float] = defaultdict(float)
            for (p, lim), nxt in zip(lst, [q for q, _ in lst[1:]] + [max(end, lst[-1][0])]):
                cover[lim] += nxt - p
            self.lanes[i].speed_limit = max(cover, key=lambda lim: (cover[lim], -lim))
            outgoing[i] = lst[-1][1]
        dist = [math.inf] * len(self.lanes)
        heap: list[tuple[float, int, float]] = []
        for i, limit in outgoing.items():
            dist[i] = 0.0
            heap.append((0.0, i, limit))
        heapq.heapify(heap)
        while heap:
            d, i, limit = heapq.heappop(heap)
            if d > dist[i]:
                continue
            for j in self.lanes[i].successors:
                nd = d + self.length[i]
                if nd < dist[j]:
                    dist[j] = nd
                    self.lanes[j].speed_limit = limit
                    heapq.heappush(heap, (nd, j, limit))
        return np.array(sign_rows, np.float32).reshape(-1, 3)

    # ----------------------------------------------------------------- drawn-only features
    def build_shoulders(self) -> list[tuple[np.ndarray, float]]:
        """Shoulder/Parking lanes next to driving pieces -> (polyline, median width); each lane piece once."""
        LT = self.carla.LaneType
        wanted = (LT.Shoulder, LT.Parking)
        samples: dict[Key, tuple[list[tuple[float, float]], list[float]]] = {}
        owner: dict[Key, tuple[int, str]] = {}  # the (driving piece, side) that samples a shoulder piece
        for i, ws in enumerate(self.wps):
            for side in ("left", "right"):
                for w in ws:
                    nb = w.get_left_lane() if side == "left" else w.get_right_lane()
                    if nb is None or nb.lane_type not in wanted:
                        continue
                    k = _key(nb)
                    if owner.setdefault(k, (i, side)) != (i, side):
                        continue
                    pts, widths = samples.setdefault(k, ([], []))
                    pts.append(_xy(nb.transform.location))
                    widths.append(nb.lane_width)
        out = []
        for pts, widths in samples.values():
            p = np.array(pts, np.float64)
            w = float(np.median(widths))
            if len(p) >= 2 and w > 0.05 and np.linalg.norm(np.diff(p, axis=0), axis=1).max() > 1e-3:
                out.append((p, w))
        return out


class _Progress:
    """What the loader is doing now ("walking road 12 lane -1 ..."), for error messages; mirrored into a shared
    buffer when compiling in a child process, so the parent can say where carla crashed."""

    def __init__(self, buffer: Any = None):
        self.stage = "parsing the file"
        self.buffer = buffer

    def set(self, stage: str) -> None:
        self.stage = stage
        if self.buffer is not None:
            self.buffer.value = stage.encode("utf-8", "replace")[: len(self.buffer) - 1]


def _compile(path: Path, text: str, sections: dict[tuple[int, int], tuple[float, float]], name: str,
             spacing: float, progress: _Progress) -> LaneGraph:
    """carla.Map(text) -> LaneGraph. Every failure is a MapError naming the file (and the road, when known)."""
    carla = _import_carla()
    try:
        cmap = carla.Map(name, text)
    except Exception as e:  # noqa: BLE001 - the binding raises RuntimeError, IndexError and friends
        raise MapError(f"OpenDRIVE file {path}: carla could not parse it ({type(e).__name__}: {e}); fix: check the "
                       "file against the OpenDRIVE spec (road and lane-section lengths, road/lane links, junction "
                       "connections) or re-export it from its editor") from e
    b = _Builder(carla, cmap, name, spacing, sections, progress)
    try:
        progress.set("reading the topology")
        b.collect_pieces()
        if not b.keys:
            raise MapError("carla found no driving lanes in it; fix: a map needs lanes of type=\"driving\"")
        b.sample_pieces()
        b.build_lanes()
        progress.set("deriving traffic control")
        stop_lines, groups, derived = b.build_control()
        progress.set("reading speed-limit signs")
        speed_signs = b.assign_speed_limits()
        progress.set("reading shoulders")
        shoulders = b.build_shoulders()
        progress.set("reading crosswalks")
        crosswalks = _crosswalk_quads(list(cmap.get_crosswalks()))
        meta = {
            "source": "opendrive",
            "file": str(path),
            "loader_version": LOADER_VERSION,
            "spacing": spacing,
            "derived_control": derived,
            "frame": "right-handed; (x, y)_ours = (x, -y)_carla",
        }
        progress.set("compiling the lane graph")
        return LaneGraph.build(name, b.lanes, stop_lines, groups, crosswalks=crosswalks, shoulders=shoulders,
                               speed_signs=speed_signs, max_spacing=spacing, meta=meta)
    except MapError as e:
        raise MapError(f"OpenDRIVE file {path}: {e}") from e
    except Exception as e:  # noqa: BLE001 - carla's RuntimeErrors, and whatever an odd map trips in this loader
        raise MapError(f"OpenDRIVE file {path}: failed while {progress.stage} ({type(e).__name__}: {e}); fix: "
                       "check that part of the file (its <geometry>, <laneSection> and <link> records) against "
                       "the OpenDRIVE spec, or re-export the map") from e


def _compile_child(conn: Any, buffer: Any, args: tuple) -> None:
    import faulthandler  # noqa: PLC0415

    faulthandler.disable()  # a crash is reported by the parent (with the stage); no interpreter dump on stderr
    progress = _Progress(buffer)
    try:
        out = ("ok", _compile(*args, progress))
    except MapError as e:
        out = ("error", str(e))
    except BaseException as e:  # noqa: BLE001 - report, never hang the parent
        out = ("error", f"OpenDRIVE file {args[0]}: failed while {progress.stage} ({type(e).__name__}: {e})")
    conn.send(out)
    conn.close()


def _compile_isolated(args: tuple) -> LaneGraph | None:
    """Run :func:`_compile` in a forked child, so a crash inside carla (it segfaults on some malformed maps)
    becomes a MapError. None where a child cannot be started (no fork, or inside a daemonic process)."""
    if not sys.platform.startswith("linux") or os.environ.get("CARL_MAP_ISOLATE", "1") == "0":
        return None
    ctx = multiprocessing.get_context("fork")
    buffer = ctx.Array("c", 512, lock=False)
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_compile_child, args=(send, buffer, args), name="carl-opendrive")
    try:
        proc.start()
    except (AssertionError, OSError):  # daemonic processes may not have children; no fork available
        recv.close()
        send.close()
        return None
    send.close()
    try:
        msg = recv.recv()
    except EOFError:
        msg = None
    finally:
        recv.close()
        proc.join()
    if msg is None:
        code = proc.exitcode
        try:
            why = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        except ValueError:
            why = f"signal {-code}"
        stage = buffer.value.decode("utf-8", "replace") or "parsing the file"
        raise MapError(f"OpenDRIVE file {args[0]}: carla crashed ({why}) while {stage}. The file is malformed in a "
                       "way carla does not check; fix: validate it (e.g. with esmini's odrviewer or the ASAM "
                       "OpenDRIVE checker), look at that road's <planView>, <lanes> and <link> records, or "
                       "re-export the map")
    kind, payload = msg
    if kind == "ok":
        return payload
    raise MapError(payload)


def load_opendrive(path: str | Path, name: str | None = None, spacing: float = 1.0,
                   isolate: bool = True) -> LaneGraph:
    """Parse an OpenDRIVE file with ``carla.Map`` (offline) and compile it to a :class:`LaneGraph`.

    ``name`` defaults to the file stem; ``spacing`` is the waypoint sampling step (metres) and the graph's
    maximum point spacing. With ``isolate`` (default; Linux, unless ``CARL_MAP_ISOLATE=0``) carla runs in a forked
    child process, so that a crash inside carla is reported instead of killing the caller. Raises
    :class:`MapError` naming the file (and the road, when known) and a fix for missing, malformed, empty or
    crashing maps; never a raw ``RuntimeError``/``IndexError``.
    """
    path = Path(path)
    if not spacing > 0:
        raise MapError(f"OpenDRIVE file {path}: spacing must be > 0, got {spacing}")
    text, root = _validate_xodr(path)
    _import_carla()  # a missing package is reported here, not from a child
    args = (path, text, _section_bounds(root), name or path.stem, float(spacing))
    graph = _compile_isolated(args) if isolate else None
    return graph if graph is not None else _compile(*args, _Progress())


# ---------------------------------------------------------------------------------------------- towns + cache
def default_maps_dir() -> Path | None:
    """``$CARL_CARLA_MAPS``, else the development copy ``<repo>/../shared/data/carla/maps`` if it exists, else None
    (:func:`load_town` then fetches the towns of the ``carla-maps`` dataset: envs/data.py)."""
    env = os.environ.get("CARL_CARLA_MAPS")
    if env:
        return Path(env)
    root = data.local_root()
    d = root / "carla" / "maps" if root is not None else None
    return d if d is not None and d.is_dir() else None


def _registry_towns() -> list[str]:
    return [Path(f.name).stem for f in data.files("carla-maps")]


def available_towns(maps_dir: str | Path | None = None) -> list[str]:
    """Town names (file stems of ``*.xodr``) found in ``maps_dir`` (default: :func:`default_maps_dir`); without
    ``maps_dir`` or ``$CARL_CARLA_MAPS`` also the towns :func:`load_town` fetches on first use."""
    d = Path(maps_dir) if maps_dir is not None else default_maps_dir()
    found = sorted(p.stem for p in d.glob("*.xodr")) if d is not None and d.is_dir() else []
    if maps_dir is None and not os.environ.get("CARL_CARLA_MAPS"):
        found = sorted(set(found) | set(_registry_towns()))
    return found


def _cache_dir() -> Path:
    env = os.environ.get("CARL_MAP_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "carl" / "maps"


def load_town(town: str, maps_dir: str | Path | None = None, cache_dir: str | Path | None = None) -> LaneGraph:
    """Load a CARLA town (``"Town01"`` ...) as a :class:`LaneGraph`, via a compiled ``.npz`` cache.

    The file comes from ``maps_dir`` or ``$CARL_CARLA_MAPS`` when given, else from the ``carla-maps`` dataset
    (:func:`envs.data.data_file`: the development copy, the data cache, or fetched on first use). The compiled
    graph is cached in ``cache_dir`` (default ``$CARL_MAP_CACHE`` or ``~/.cache/carl/maps``) as
    ``<town>-<sha256(xodr)[:16]>.npz``; a cache written by another format or loader version, or an unreadable one,
    is rebuilt.
    """
    if maps_dir is None and not os.environ.get("CARL_CARLA_MAPS"):
        if town not in _registry_towns():
            raise MapError(f"unknown town '{town}': not a CARLA town of the carla-maps dataset; available: "
                           f"{', '.join(available_towns())}; set CARL_CARLA_MAPS to a folder of <Town>.xodr files "
                           "(or env.options.map to an .xodr path) for other maps")
        try:
            path = data.data_file("carla-maps", f"{town}.xodr")
        except data.DataError as exc:
            raise MapError(f"town {town!r}: {exc}") from None
    else:
        d = Path(maps_dir) if maps_dir is not None else default_maps_dir()
        if d is None or not d.is_dir():
            raise MapError(f"town {town!r}: CARLA maps directory {d if d is not None else '(none)'} not found; set "
                           "CARL_CARLA_MAPS to a folder of <Town>.xodr files or pass maps_dir")
        path = d / f"{town}.xodr"
        if not path.is_file():
            given = "maps_dir" if maps_dir is not None else (
                "CARL_CARLA_MAPS" if os.environ.get("CARL_CARLA_MAPS") else "the development copy of carla-maps")
            raise MapError(f"unknown town '{town}': no {path.name} in {d} ({given}); available: "
                           f"{', '.join(available_towns(d)) or '(none)'}; to add a map, put {path.name} there or set "
                           f"CARL_CARLA_MAPS to a folder of <Town>.xodr files that has it (or env.options.map to an "
                           ".xodr path)")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    cache = Path(cache_dir) if cache_dir is not None else _cache_dir()
    cache_file = cache / f"{town}-{digest}.npz"
    if cache_file.exists():
        try:
            g = LaneGraph.load(cache_file)
            if g.meta.get("loader_version") == LOADER_VERSION:
                return g
        except MapError:
            pass  # stale or corrupt cache: rebuild below
    g = load_opendrive(path, name=town)
    g.meta["sha256_16"] = digest
    try:
        g.save(cache_file)
    except OSError:
        pass  # a read-only cache location only costs the rebuild next time
    return g


def main(argv: list[str] | None = None) -> int:
    """``python -m envs.maps.opendrive MAP.xodr [...]``: compile each map and print a one-line summary (JSON), or
    the MapError (exit status 1). See ``docs/maps.md``."""
    import argparse  # noqa: PLC0415
    import json  # noqa: PLC0415

    p = argparse.ArgumentParser(description="Check OpenDRIVE maps: compile them as the simulator does.")
    p.add_argument("maps", nargs="+", help=".xodr files")
    p.add_argument("--spacing", type=float, default=1.0, help="waypoint spacing in metres (default 1)")
    args = p.parse_args(argv)
    status = 0
    for f in args.maps:
        try:
            g = load_opendrive(f, spacing=args.spacing)
        except MapError as e:
            print(f"MapError: {e}", flush=True)
            status = 1
            continue
        w = g.point_widths()
        print(json.dumps({
            "map": f, "lanes": g.num_lanes, "km": round(float(g.lane_lengths().sum()) / 1000, 3),
            "junction_lanes": int(g.is_junction.sum()), "dead_ends": int((np.diff(g.succ_offsets) == 0).sum()),
            "stop_lines": len(g.stop_lane), "light_groups": len(g.light_junction),
            "derived_control": bool(g.meta.get("derived_control")), "crosswalks": len(g.crosswalks),
            "width_min": round(float(w.min()), 2), "width_max": round(float(w.max()), 2)}), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

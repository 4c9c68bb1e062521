"""nuPlan GeoPackage maps: version resolution and the vector layers a planner needs, as numpy geometry.

Layout (``nuplan-data.md`` §5): ``{maps_root}/nuplan-maps-v1.0.json`` maps each location to a version, and the map
is ``{maps_root}/{location}/{version}/map.gpkg``. Layers are read with :mod:`envs.nuplan.gpkg` and brought into the
CRS named by the ``meta`` row ``projectedCoordSystem``; when a layer is stored in another CRS the optional
``pyproj`` reprojects it (real nuPlan maps need it; the synthetic dataset stores projected coordinates, and can
store a layer in lon/lat to exercise this). A layer whose CRS is undefined, unregistered, or puts it outside the
area of the map's CRS is an error naming the layer (never a silently misplaced map).

The polygon layers the cache clips per scenario (:data:`POLYGON_LAYERS`) are kept whole (multipolygons split into
parts) in :attr:`NuplanMap.polygon_layers`; :meth:`NuplanMap.polygon_index` gives a shapely STRtree over one.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from envs.nuplan.gpkg import GeoPackageError, Layer, list_layers, open_geopackage, read_layer, require, srs_name

VERSION_FILE = "nuplan-maps-v1.0.json"
# the devkit's DRIVABLE_AREA layer (nuplan_map.py _initialize_drivable_area), which the drivable-area metric uses
DRIVABLE_LAYERS = ("road_segments", "intersections", "generic_drivable_areas", "carpark_areas")
# CaRL's off-road area (its map cache): roadblocks + intersections + car parks, without roadblock connectors
CARL_DRIVABLE_LAYERS = ("lane_groups_polygons", "intersections", "carpark_areas")
# the route's polygons for CaRL's off_route v1 factor: roadblocks and roadblock connectors
ROUTE_LAYERS = ("lane_groups_polygons", "lane_group_connectors")
POLYGON_LAYERS = tuple(dict.fromkeys(DRIVABLE_LAYERS + CARL_DRIVABLE_LAYERS + ROUTE_LAYERS))


class MapVersionError(GeoPackageError):
    """A map that is absent or whose version differs from the version file."""


@dataclass
class MapLane:
    """A lane or lane connector: centreline, polygon and topology (ids are the layer fids as strings)."""

    fid: str
    baseline: np.ndarray  # [N, 2]
    polygon: list[np.ndarray] | None  # rings
    group: str  # lane_group_fid (roadblock) or lane_group_connector_fid
    speed_limit: float | None  # m/s
    is_connector: bool
    lane_index: int = 0
    exit_lane: str | None = None  # connectors: the lane it comes from
    entry_lane: str | None = None  # connectors: the lane it goes to
    has_stop_line: bool = False


@dataclass
class NuplanMap:
    """The vector content of one map.gpkg, in the projected CRS."""

    name: str
    version: str
    path: str
    lanes: dict[str, MapLane]  # lanes and lane connectors together
    roadblocks: dict[str, list[np.ndarray]]  # lane_groups_polygons fid -> polygon rings
    roadblock_connectors: dict[str, list[np.ndarray]]
    roadblock_connector_intersection: dict[str, str | None]
    intersections: dict[str, list[np.ndarray]]
    crosswalks: list[list[np.ndarray]]
    stop_polygons: list[tuple[int, list[np.ndarray]]]  # (stop_polygon_type_fid, rings)
    drivable: list[list[np.ndarray]]  # polygons of the DRIVABLE_AREA union (metric definition)
    meta: dict[str, str] = field(default_factory=dict)
    # every polygon (multipolygons split into parts) of each POLYGON_LAYERS layer the map has: (fid, rings)
    polygon_layers: dict[str, list[tuple[str, list[np.ndarray]]]] = field(default_factory=dict)
    _index: dict[str, tuple[Any, list[str], Any]] = field(default_factory=dict, repr=False, compare=False)

    def lanes_of_group(self, group: str) -> list[MapLane]:
        return [l for l in self.lanes.values() if l.group == group]

    def polygon_index(self, layer: str) -> tuple[Any, list[str], Any]:
        """(shapely polygons, fids, STRtree) of one polygon layer, built once per map (empty for an absent layer).
        Invalid polygons (self-touching rings in survey data) are repaired so that clipping them cannot fail."""
        if layer not in self._index:
            shapely = require("shapely", "the nuPlan map layers (drivable area, route polygons)")
            # a degenerate ring (under 4 points, as survey data may hold) encloses nothing: skip it
            feats = [(f, [x for x in r if len(x) >= 4]) for f, r in self.polygon_layers.get(layer, []) if len(r[0]) >= 4]
            geoms = np.array([shapely.Polygon(r[0], r[1:]) for _, r in feats], dtype=object)
            if len(geoms):
                bad = ~shapely.is_valid(geoms)
                if bad.any():
                    geoms[bad] = shapely.make_valid(geoms[bad])
            self._index[layer] = (geoms, [f for f, _ in feats], shapely.STRtree(geoms))
        return self._index[layer]


def resolve_map(maps_root: str | Path, location: str) -> tuple[Path, str]:
    """(path to map.gpkg, version) of ``location``; errors say whether the map or the expected version is absent."""
    root = Path(maps_root)
    vfile = root / VERSION_FILE
    if not vfile.is_file():
        raise MapVersionError(f"map version file {vfile} does not exist; set the maps root to the folder holding it")
    versions = json.loads(vfile.read_text())
    if location not in versions:
        raise MapVersionError(f"map '{location}' (used by the log) is absent from {vfile}; "
                              f"available: {', '.join(sorted(versions))}")
    version = str(versions[location]["version"])
    path = root / location / version / "map.gpkg"
    if not path.is_file():
        present = sorted(p.parent.name for p in (root / location).glob("*/map.gpkg")) if (root / location).is_dir() \
            else []
        if present:
            raise MapVersionError(f"map version mismatch for '{location}': {vfile} expects version {version} but "
                                  f"{root / location} holds {', '.join(present)}")
        raise MapVersionError(f"map '{location}' version {version} is absent: {path} does not exist")
    return path, version


def _same_crs(a: str, b: str) -> bool | None:
    """Whether two CRS names denote one CRS: by name, else by pyproj when it is installed (None when unknown)."""
    if a.upper().replace(" ", "") == b.upper().replace(" ", ""):
        return True
    try:
        import pyproj
    except ImportError:
        return None
    try:
        return pyproj.CRS.from_user_input(a) == pyproj.CRS.from_user_input(b)
    except pyproj.exceptions.CRSError:
        return False


def _is_geographic(crs: str) -> bool:
    """Whether ``crs`` is in degrees (pyproj when installed; else only the usual lon/lat names)."""
    try:
        import pyproj

        return bool(pyproj.CRS.from_user_input(crs).is_geographic)
    except ImportError:
        return crs.upper().replace(" ", "") in ("EPSG:4326", "OGC:CRS84", "CRS:84")
    except Exception:  # noqa: BLE001 - an unknown CRS is reported where it is used
        return False


@lru_cache(maxsize=32)
def _pyproj_transformer(source: str, target: str) -> Any:
    import pyproj

    return pyproj.Transformer.from_crs(source, target, always_xy=True)


def _bounds(geoms: list[Any]) -> np.ndarray | None:
    """[xmin, ymin, xmax, ymax] of every point of ``geoms`` (None when there is none)."""
    pts = [_all_points(g) for g in geoms if g is not None]
    pts = [p for p in pts if len(p)]
    if not pts:
        return None
    a = np.concatenate(pts)
    return np.array([a[:, 0].min(), a[:, 1].min(), a[:, 0].max(), a[:, 1].max()])


def _all_points(geom: Any) -> np.ndarray:
    if isinstance(geom, np.ndarray):
        return geom.reshape(-1, 2)
    parts = [_all_points(g) for g in geom]
    return np.concatenate(parts) if parts else np.zeros((0, 2))


def _check_area(path: Path, layer: str, source: str, target: str, bounds: np.ndarray) -> None:
    """The layer's extent, read in its declared CRS, must lie where the map's CRS is used (a UTM zone for nuPlan):
    a layer declared in the wrong CRS would otherwise be reprojected to somewhere else on Earth, silently."""
    try:
        import pyproj
    except ImportError:
        return
    try:
        area = pyproj.CRS.from_user_input(target).area_of_use
    except pyproj.exceptions.CRSError as e:
        raise GeoPackageError(f"map file {path}: the meta row projectedCoordSystem = {target!r} is not a CRS pyproj "
                              f"knows ({e})") from e
    if area is None:
        return
    corners = np.array([[bounds[0], bounds[1]], [bounds[2], bounds[1]], [bounds[2], bounds[3]],
                        [bounds[0], bounds[3]]])
    lon, lat = _pyproj_transformer(source, "EPSG:4326").transform(corners[:, 0], corners[:, 1])
    lon, lat = np.asarray(lon), np.asarray(lat)
    margin = 1.0  # degrees: nuPlan's cities lie well inside their UTM zones
    ok = (np.isfinite(lon).all() and np.isfinite(lat).all() and lon.min() >= area.west - margin
          and lon.max() <= area.east + margin and lat.min() >= area.south - margin and lat.max() <= area.north + margin)
    if not ok:
        raise GeoPackageError(
            f"map file {path}: layer '{layer}' is declared in {source}, but read in that CRS it lies at lon "
            f"{np.nanmin(lon):.3f}..{np.nanmax(lon):.3f}, lat {np.nanmin(lat):.3f}..{np.nanmax(lat):.3f}, outside the "
            f"area of the map's CRS {target} (lon {area.west}..{area.east}, lat {area.south}..{area.north}); the "
            "layer's srs_id (gpkg_geometry_columns) is wrong: re-export the layer with its true CRS")


def _transformer(con: Any, layer: Layer, target: str | None, path: Path) -> Callable[[np.ndarray], np.ndarray] | None:
    """None when the layer is already in the map's CRS (``meta.projectedCoordSystem``), else a pyproj xy transform.
    A layer whose CRS is undefined, unregistered or implausible for the map is an error naming the layer."""
    if not target or layer.srs_id is None:
        return None
    bounds = _bounds(layer.geometries)
    if layer.srs_id in (0, -1):
        raise GeoPackageError(f"map file {path}: layer '{layer.name}' has an undefined CRS (srs_id {layer.srs_id}) "
                              f"but the map's projectedCoordSystem is {target}; re-export the layer with its CRS")
    source = srs_name(con, layer.srs_id)
    if source is None:
        raise GeoPackageError(f"map file {path}: layer '{layer.name}' uses srs_id {layer.srs_id}, which "
                              "gpkg_spatial_ref_sys does not define; the map file is damaged or was written by a tool "
                              "that dropped its CRS table: re-export it")
    same = _same_crs(source, target)
    if same:
        if (bounds is not None and np.abs(bounds[[0, 2]]).max() <= 180 and np.abs(bounds[[1, 3]]).max() <= 90
                and not _is_geographic(target)):
            # metric UTM coordinates are never all within +-180 / +-90: these are degrees under a metric srs id
            raise GeoPackageError(f"map file {path}: layer '{layer.name}' is declared in {source} (metres) but its "
                                  f"coordinates look like longitude/latitude degrees ({bounds.round(4).tolist()}); "
                                  "re-export the layer with srs_id 4326 (EPSG:4326)")
        if bounds is not None:
            _check_area(path, layer.name, source, target, bounds)
        return None
    require("pyproj", f"map file {path}: layer '{layer.name}' is stored in {source} while the map's "
                      f"projectedCoordSystem is {target}; reprojecting it")
    if bounds is not None:
        _check_area(path, layer.name, source, target, bounds)
    tr = _pyproj_transformer(source, target)
    return lambda a: np.stack(tr.transform(a[:, 0], a[:, 1]), -1)


def _apply(geom: Any, fn: Callable[[np.ndarray], np.ndarray] | None) -> Any:
    if fn is None or geom is None:
        return geom
    if isinstance(geom, np.ndarray):
        return fn(geom.reshape(-1, 2)).reshape(geom.shape) if geom.ndim == 2 else fn(geom.reshape(1, 2))[0]
    return [_apply(g, fn) for g in geom]


def _polygon(geom: Any) -> list[np.ndarray] | None:
    """First polygon of a (multi)polygon as rings."""
    if geom is None:
        return None
    if isinstance(geom, list) and geom and isinstance(geom[0], list):  # multipolygon
        return geom[0]
    return geom


def _polygons(geom: Any) -> list[list[np.ndarray]]:
    """Every polygon (as rings) of a polygon, multipolygon or collection; [] for None."""
    if geom is None or (isinstance(geom, list) and not geom):
        return []
    if isinstance(geom, list) and all(isinstance(g, np.ndarray) and g.ndim == 2 for g in geom):
        return [geom]
    if isinstance(geom, list):
        return [p for g in geom for p in _polygons(g)]
    return []  # a point or line in a polygon layer carries no area


def _line(geom: Any) -> np.ndarray:
    """A linestring, or the concatenated parts of a multilinestring."""
    if isinstance(geom, list):
        return np.concatenate(geom)
    return geom


def _str(v: Any) -> str | None:
    return None if v is None else str(int(v)) if isinstance(v, (int, float)) else str(v)


@lru_cache(maxsize=8)
def load_map(path: str, name: str = "", version: str = "") -> NuplanMap:
    """Read (and memoise) the vector layers of one map.gpkg; errors name the file and layer."""
    p = Path(path)
    con = open_geopackage(p)
    try:
        layers = set(list_layers(con))
        meta: dict[str, str] = {}
        if "meta" in layers:
            m = read_layer(con, "meta", p)
            meta = {str(k): str(v) for k, v in zip(m.columns.get("key", []), m.columns.get("value", []))}
        target = meta.get("projectedCoordSystem")

        def layer(n: str, required: bool = True) -> tuple[Layer | None, Callable | None]:
            if n not in layers:
                if required:
                    raise GeoPackageError(f"map file {p} has no layer '{n}'")
                return None, None
            lay = read_layer(con, n, p)
            return lay, _transformer(con, lay, target, p)

        base, f = layer("baseline_paths")
        lane_line: dict[str, np.ndarray] = {}
        conn_line: dict[str, np.ndarray] = {}
        for k in range(len(base)):
            g = _line(_apply(base.geometries[k], f))
            lf = _str(base.columns.get("lane_fid", [None] * len(base))[k])
            cf = _str(base.columns.get("lane_connector_fid", [None] * len(base))[k])
            if lf is not None:
                lane_line[lf] = g
            elif cf is not None:
                conn_line[cf] = g
        lanes: dict[str, MapLane] = {}
        lp, f = layer("lanes_polygons")
        for k, fid in enumerate(lp.fids):
            key = str(fid)
            if key not in lane_line:
                raise GeoPackageError(f"map file {p}: lane {key} has no baseline path")
            c = lp.columns
            lanes[key] = MapLane(key, lane_line[key], _polygon(_apply(lp.geometries[k], f)),
                                 group=_str(c["lane_group_fid"][k]), speed_limit=c.get("speed_limit_mps",
                                                                                       [None] * len(lp))[k],
                                 is_connector=False, lane_index=int(c.get("lane_index", [0] * len(lp))[k] or 0))
        lc, f = layer("lane_connectors")
        cpoly: dict[str, list[np.ndarray]] = {}
        cp, fp = layer("gen_lane_connectors_scaled_width_polygons", required=False)
        if cp is not None:
            for k in range(len(cp)):
                cpoly[_str(cp.columns["lane_connector_fid"][k])] = _polygon(_apply(cp.geometries[k], fp))
        for k, fid in enumerate(lc.fids):
            key = str(fid)
            c = lc.columns
            line = conn_line.get(key)
            if line is None:
                line = _apply(lc.geometries[k], f)
                line = _line(line) if line is not None else None
            if line is None:
                raise GeoPackageError(f"map file {p}: lane connector {key} has no baseline path")
            stops = c.get("traffic_light_stop_line_fids", [None] * len(lc))[k]
            lanes[key] = MapLane(key, line, cpoly.get(key), group=_str(c["lane_group_connector_fid"][k]),
                                 speed_limit=c.get("speed_limit_mps", [None] * len(lc))[k], is_connector=True,
                                 exit_lane=_str(c["exit_lane_fid"][k]), entry_lane=_str(c["entry_lane_fid"][k]),
                                 has_stop_line=bool(stops not in (None, "", "[]")))

        parts: dict[str, list[tuple[str, list[np.ndarray]]]] = {}

        def polys(n: str, required: bool = False, lay_fn: tuple | None = None) -> dict[str, list[np.ndarray]]:
            """fid -> first polygon of layer ``n``; every part of every feature goes to ``parts[n]``."""
            lay, fn = lay_fn if lay_fn is not None else layer(n, required)
            if lay is None:
                return {}
            first, every = {}, []
            for k, fid in enumerate(lay.fids):
                ps = _polygons(_apply(lay.geometries[k], fn))
                first[str(fid)] = ps[0] if ps else None
                every.extend((str(fid), p) for p in ps)
            if n in POLYGON_LAYERS:
                parts[n] = every
            return first

        roadblocks = polys("lane_groups_polygons", required=True)
        lgc, f = layer("lane_group_connectors", required=False)
        rb_conn = polys("lane_group_connectors", lay_fn=(lgc, f))
        rb_inter = {} if lgc is None else {str(fid): _str(lgc.columns.get("intersection_fid", [None] * len(lgc))[k])
                                           for k, fid in enumerate(lgc.fids)}
        intersections = polys("intersections")
        crosswalks = list(polys("crosswalks").values())
        sp, f = layer("stop_polygons", required=False)
        stops = [] if sp is None else [(int(sp.columns.get("stop_polygon_type_fid", [5] * len(sp))[k] or 5),
                                        _polygon(_apply(sp.geometries[k], f))) for k in range(len(sp))]
        for n in POLYGON_LAYERS:
            if n not in parts:
                polys(n)
        drivable = [p for n in DRIVABLE_LAYERS for _, p in parts.get(n, [])]
    except KeyError as e:
        raise GeoPackageError(f"map file {p}: missing column {e}") from e
    finally:
        con.close()
    return NuplanMap(name=name or p.parent.parent.name, version=version or p.parent.name, path=str(p), lanes=lanes,
                     roadblocks=roadblocks, roadblock_connectors=rb_conn, roadblock_connector_intersection=rb_inter,
                     intersections=intersections, crosswalks=crosswalks, stop_polygons=stops, drivable=drivable,
                     meta=meta, polygon_layers=parts)


def load_location(maps_root: str | Path, location: str) -> NuplanMap:
    """The map of a log's location (``log.map_version``), version resolved through the version file."""
    path, version = resolve_map(maps_root, location)
    return load_map(str(path), location, version)

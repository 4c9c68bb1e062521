"""nuPlan GeoPackage maps: version resolution and the vector layers a planner needs, as numpy geometry.

Layout (``nuplan-data.md`` §5): ``{maps_root}/nuplan-maps-v1.0.json`` maps each location to a version, and the map
is ``{maps_root}/{location}/{version}/map.gpkg``. Layers are read with :mod:`envs.nuplan.gpkg` and brought into the
CRS named by the ``meta`` row ``projectedCoordSystem``; when a layer is stored in another CRS the optional
``pyproj`` reprojects it (real nuPlan maps need it; the synthetic dataset stores projected coordinates).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import numpy as np

from envs.nuplan.gpkg import GeoPackageError, Layer, list_layers, open_geopackage, read_layer

VERSION_FILE = "nuplan-maps-v1.0.json"
DRIVABLE_LAYERS = ("road_segments", "intersections", "generic_drivable_areas", "carpark_areas")


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

    def lanes_of_group(self, group: str) -> list[MapLane]:
        return [l for l in self.lanes.values() if l.group == group]


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


def _transformer(con, layer: Layer, target: str | None, path: Path) -> Callable[[np.ndarray], np.ndarray] | None:
    """None when the layer is already in the target CRS, else a pyproj xy transform."""
    if not target:
        return None
    row = con.execute("SELECT organization, organization_coordsys_id FROM gpkg_spatial_ref_sys WHERE srs_id=?",
                      (layer.srs_id,)).fetchone()
    source = f"{row[0]}:{row[1]}" if row else f"EPSG:{layer.srs_id}"
    if source.upper() == target.upper().replace(" ", ""):
        return None
    try:
        import pyproj
    except ImportError as e:
        raise GeoPackageError(f"map file {path}: layer '{layer.name}' is in {source} but the map's "
                              f"projectedCoordSystem is {target}; install pyproj to reproject") from e
    tr = pyproj.Transformer.from_crs(source, target, always_xy=True)
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

        def polys(n: str, required: bool = False) -> dict[str, list[np.ndarray]]:
            lay, fn = layer(n, required)
            if lay is None:
                return {}
            return {str(fid): _polygon(_apply(lay.geometries[k], fn)) for k, fid in enumerate(lay.fids)}

        roadblocks = polys("lane_groups_polygons", required=True)
        lgc, f = layer("lane_group_connectors", required=False)
        rb_conn, rb_inter = {}, {}
        if lgc is not None:
            for k, fid in enumerate(lgc.fids):
                rb_conn[str(fid)] = _polygon(_apply(lgc.geometries[k], f))
                rb_inter[str(fid)] = _str(lgc.columns.get("intersection_fid", [None] * len(lgc))[k])
        intersections = polys("intersections")
        crosswalks = list(polys("crosswalks").values())
        sp, f = layer("stop_polygons", required=False)
        stops = [] if sp is None else [(int(sp.columns.get("stop_polygon_type_fid", [5] * len(sp))[k] or 5),
                                        _polygon(_apply(sp.geometries[k], f))) for k in range(len(sp))]
        drivable = [g for n in DRIVABLE_LAYERS for g in polys(n).values() if g is not None]
    except KeyError as e:
        raise GeoPackageError(f"map file {p}: missing column {e}") from e
    finally:
        con.close()
    return NuplanMap(name=name or p.parent.parent.name, version=version or p.parent.name, path=str(p), lanes=lanes,
                     roadblocks=roadblocks, roadblock_connectors=rb_conn, roadblock_connector_intersection=rb_inter,
                     intersections=intersections, crosswalks=crosswalks, stop_polygons=stops, drivable=drivable,
                     meta=meta)


def load_location(maps_root: str | Path, location: str) -> NuplanMap:
    """The map of a log's location (``log.map_version``), version resolved through the version file."""
    path, version = resolve_map(maps_root, location)
    return load_map(str(path), location, version)

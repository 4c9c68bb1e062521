"""GeoPackage reading and writing: SQLite with the standard library, WKB with shapely (OGC GeoPackage 1.2).

A GeoPackage is an SQLite file: ``gpkg_contents`` lists the layers, ``gpkg_geometry_columns`` names each layer's
geometry column and spatial reference id, and every geometry is a *GeoPackage binary* blob: the magic ``b"GP"``,
a version byte, a flags byte (bit 0 byte order of the header, bits 1-3 the envelope code, bit 4 empty), the int32
``srs_id``, an envelope of 0/32/48/48/64 bytes (codes 0-4), then standard WKB. The header is parsed here (no library
reads it); the WKB after it is read by ``shapely.from_wkb`` (ISO or extended WKB, either byte order), a whole layer
in one call.

Geometries decode to numpy:

* Point -> ``[2]``; LineString -> ``[N, 2]``; Polygon -> list of rings ``[N, 2]`` (exterior first);
* Multi* and GeometryCollection -> list of the parts above. Z and M ordinates are dropped.

:func:`write_layer` is the inverse used by the synthetic dataset (no envelope by default; WKB by ``shapely.to_wkb``).
"""
from __future__ import annotations

import importlib
import sqlite3
import struct
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

import numpy as np

ENVELOPE_BYTES = {0: 0, 1: 32, 2: 48, 3: 48, 4: 64}
WKB_POINT, WKB_LINESTRING, WKB_POLYGON = 1, 2, 3  # WKB geometry type codes (what write_layer writes)
WKB_MULTIPOINT, WKB_MULTILINESTRING, WKB_MULTIPOLYGON = 4, 5, 6


class GeoPackageError(ValueError):
    """A GeoPackage that cannot be read; the message names the file, layer and feature."""


class _BadGeometry(GeoPackageError):
    """Geometry ``index`` of a batch could not be read."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index


class MissingPackageError(ImportError):
    """An optional package the nuPlan path needs is not installed; the message names it and the pip command."""


INSTALL_HINT = "pip install -e '.[nuplan]'"


def require(module: str, purpose: str, pip_name: str | None = None) -> ModuleType:
    """Import an optional package of the ``nuplan`` extra, or raise :class:`MissingPackageError` saying what needs
    it and how to install it (so a bare ``ModuleNotFoundError`` deep in a worker never is the only clue)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        name = pip_name or module
        raise MissingPackageError(f"{purpose} needs the Python package '{name}', which is not installed; install the "
                                  f"nuPlan extra with {INSTALL_HINT} (or pip install {name})") from e


@dataclass
class Layer:
    """One vector layer: feature ids, attribute columns and decoded geometries (same order)."""

    name: str
    srs_id: int
    fids: np.ndarray  # [F] int64
    columns: dict[str, list[Any]]
    geometries: list[Any]

    def __len__(self) -> int:
        return len(self.fids)


# ---------------------------------------------------------------------------------------------- decoding
def _header(blob: bytes) -> tuple[int, int | None]:
    """Parse a GeoPackage binary header: (srs_id, offset of the WKB after the envelope; None for an empty
    geometry). The header is GeoPackage's own (shapely reads the WKB after it, not the header)."""
    if len(blob) < 8 or blob[:2] != b"GP":
        raise GeoPackageError("not a GeoPackage binary geometry (missing 'GP' magic)")
    flags = blob[3]
    srs_id = int.from_bytes(blob[4:8], "little" if flags & 1 else "big", signed=True)
    env = (flags >> 1) & 7
    if env not in ENVELOPE_BYTES:
        raise GeoPackageError(f"invalid GeoPackage envelope code {env}")
    if flags & 0x10:  # empty geometry flag
        return srs_id, None
    start = 8 + ENVELOPE_BYTES[env]
    if len(blob) <= start:
        raise GeoPackageError(f"GeoPackage geometry ends inside its header ({len(blob)} bytes, WKB at {start})")
    return srs_id, start


def _from_wkb(wkb: list[bytes]) -> np.ndarray:
    """shapely geometries of the WKB strings (ISO and extended WKB, either byte order) in one call; an unclosed
    polygon ring is closed. A string GEOS cannot read, or a curve type, raises :class:`_BadGeometry` naming its
    index and the reason."""
    shapely = require("shapely", "reading GeoPackage geometries")

    def one(k: int) -> Any:  # a single string, for the reason it cannot be read
        try:
            g = shapely.from_wkb(wkb[k], on_invalid="fix")
            if g is None:
                shapely.from_wkb(wkb[k], on_invalid="raise")
        except NotImplementedError as e:
            raise _BadGeometry(k, f"unsupported WKB geometry type ({e})") from e
        except Exception as e:  # noqa: BLE001 - GEOSException and friends: the reason is in the message
            raise _BadGeometry(k, str(e)) from e
        if g is None:
            raise _BadGeometry(k, "unreadable WKB")
        return g

    try:
        geoms = shapely.from_wkb(np.array(wkb, dtype=object), on_invalid="fix")
    except Exception:  # noqa: BLE001 - e.g. NotImplementedError for a curve: one by one to find it
        geoms = np.array([one(k) for k in range(len(wkb))], dtype=object)
    for k in np.flatnonzero(shapely.is_missing(geoms)).tolist():
        one(k)
    kinds = shapely.get_type_id(geoms)
    bad = np.flatnonzero((kinds < 0) | (kinds > 7))
    if len(bad):
        raise _BadGeometry(int(bad[0]), f"unsupported WKB geometry type {geoms[bad[0]].geom_type}")
    return geoms


def _split_coordinates(geoms: np.ndarray) -> list[np.ndarray]:
    """xy coordinates [N, 2] of every line or ring in ``geoms`` (Z and M dropped)."""
    shapely = require("shapely", "reading GeoPackage geometries")
    if len(geoms) == 0:
        return []
    xy = shapely.get_coordinates(geoms)
    ends = np.cumsum(shapely.get_num_coordinates(geoms)).tolist()
    return [xy[a:b] for a, b in zip([0] + ends[:-1], ends)]


def _to_numpy(geoms: np.ndarray) -> list[Any]:
    """The numpy representation (module docstring) of every shapely geometry in ``geoms`` [G], type by type."""
    shapely = require("shapely", "reading GeoPackage geometries")
    out: list[Any] = [None] * len(geoms)
    kinds = shapely.get_type_id(geoms) if len(geoms) else np.zeros(0, np.int32)
    points = np.flatnonzero(kinds == 0)
    if len(points):
        xy = np.full((len(points), 2), np.nan)  # an empty point is (NaN, NaN), as WKB writes it
        coords, which = shapely.get_coordinates(geoms[points], return_index=True)
        xy[which] = coords
        for k, i in enumerate(points):
            out[i] = xy[k]
    lines = np.flatnonzero((kinds == 1) | (kinds == 2))
    for i, c in zip(lines, _split_coordinates(geoms[lines])):
        out[i] = c
    polygons = np.flatnonzero(kinds == 3)
    if len(polygons):
        holes = shapely.get_num_interior_rings(geoms[polygons]) > 0
        plain = polygons[~holes & ~shapely.is_empty(geoms[polygons])]  # the exterior ring is all their coordinates
        for i, c in zip(plain, _split_coordinates(geoms[plain])):
            out[i] = [c]
        rest = polygons[holes | shapely.is_empty(geoms[polygons])]
        rings, owner = shapely.get_rings(geoms[rest], return_index=True)
        per: list[list[np.ndarray]] = [[] for _ in rest]
        for o, c in zip(owner.tolist(), _split_coordinates(rings)):
            per[o].append(c)
        for i, r in zip(rest, per):
            out[i] = r
    multi = np.flatnonzero((kinds >= 4) & (kinds <= 7))
    if len(multi):
        parts, owner = shapely.get_parts(geoms[multi], return_index=True)
        per = [[] for _ in multi]
        for o, g in zip(owner, _to_numpy(parts)):
            per[o].append(g)
        for i, p in zip(multi, per):
            out[i] = p
    return out


def decode_gpkg_geometries(blobs: Sequence[bytes | None]) -> tuple[list[Any], list[int]]:
    """Decode GeoPackage binary geometries in one batch: (geometries, srs_ids). A ``None`` blob or one flagged
    empty decodes to ``None`` (srs id 0 for a ``None`` blob). A bad blob raises :class:`GeoPackageError` whose
    ``index`` attribute (when present) is its position in ``blobs``."""
    srs = [0] * len(blobs)
    where, wkb = [], []
    for k, blob in enumerate(blobs):
        if blob is None:
            continue
        if type(blob) is not bytes:
            if not isinstance(blob, (bytes, bytearray, memoryview)):
                raise _BadGeometry(k, f"a {type(blob).__name__} where a GeoPackage geometry blob belongs")
            blob = bytes(blob)
        try:
            srs[k], start = _header(blob)
        except GeoPackageError as e:
            raise _BadGeometry(k, str(e)) from e
        if start is not None:
            where.append(k)
            wkb.append(blob[start:])
    geoms: list[Any] = [None] * len(blobs)
    try:
        decoded = _to_numpy(_from_wkb(wkb))
    except _BadGeometry as e:
        raise _BadGeometry(where[e.index], str(e)) from e
    for k, g in zip(where, decoded):
        geoms[k] = g
    return geoms, srs


def decode_gpkg_geometry(blob: bytes | None) -> tuple[Any, int]:
    """Decode a GeoPackage binary geometry: returns (geometry, srs_id). ``None`` geometry for an empty blob."""
    if blob is None:
        return None, 0
    try:
        geoms, srs = decode_gpkg_geometries([blob])
    except _BadGeometry as e:
        raise GeoPackageError(str(e)) from e
    return geoms[0], srs[0]


# ---------------------------------------------------------------------------------------------- encoding
def _to_shapely(geom: Any, kind: int) -> Any:
    """The shapely geometry of ``kind`` (a WKB_* code) from the numpy representation above (rings are closed)."""
    shapely = require("shapely", "writing GeoPackage geometries")
    if kind == WKB_POINT:
        return shapely.points(np.asarray(geom, np.float64)[:2])
    if kind == WKB_LINESTRING:
        return shapely.linestrings(np.asarray(geom, np.float64)[:, :2])
    if kind == WKB_POLYGON:
        if len(geom) == 0:
            return shapely.Polygon()
        rings = [np.asarray(r, np.float64)[:, :2] for r in geom]
        return shapely.polygons(rings[0], holes=rings[1:] or None)
    if kind == WKB_MULTIPOLYGON:
        return shapely.multipolygons([_to_shapely(p, WKB_POLYGON) for p in geom])
    if kind == WKB_MULTILINESTRING:
        return shapely.multilinestrings([_to_shapely(p, WKB_LINESTRING) for p in geom])
    raise GeoPackageError(f"cannot encode WKB type {kind}")


def encode_gpkg_geometry(geom: Any, kind: int, srs_id: int, envelope: bool = False) -> bytes:
    """GeoPackage binary blob (little endian, 2-D ISO WKB by shapely); ``envelope`` adds the 32-byte xy envelope
    (code 1)."""
    shapely = require("shapely", "writing GeoPackage geometries")
    g = _to_shapely(geom, kind)
    flags = 1 | ((1 << 1) if envelope else 0)
    head = b"GP" + bytes([0, flags]) + struct.pack("<i", srs_id)
    if envelope:
        x0, y0, x1, y1 = shapely.bounds(g)
        head += struct.pack("<4d", x0, x1, y0, y1)  # GeoPackage order: min x, max x, min y, max y
    return head + shapely.to_wkb(g, output_dimension=2, byte_order=1, flavor="iso")


GEOMETRY_NAMES = {WKB_POINT: "POINT", WKB_LINESTRING: "LINESTRING", WKB_POLYGON: "POLYGON",
                  WKB_MULTILINESTRING: "MULTILINESTRING", WKB_MULTIPOLYGON: "MULTIPOLYGON"}


def init_geopackage(con: sqlite3.Connection, srs_id: int, srs_name: str, definition: str = "undefined") -> None:
    """Create the GeoPackage system tables (application id 'GPKG') and register ``srs_id``."""
    con.execute("PRAGMA application_id = 1196444487")
    con.execute("PRAGMA user_version = 10200")
    con.execute("CREATE TABLE gpkg_spatial_ref_sys (srs_name TEXT NOT NULL, srs_id INTEGER PRIMARY KEY, "
                "organization TEXT NOT NULL, organization_coordsys_id INTEGER NOT NULL, definition TEXT NOT NULL, "
                "description TEXT)")
    con.execute("CREATE TABLE gpkg_contents (table_name TEXT PRIMARY KEY, data_type TEXT NOT NULL, identifier TEXT, "
                "description TEXT DEFAULT '', last_change DATETIME, min_x DOUBLE, min_y DOUBLE, max_x DOUBLE, "
                "max_y DOUBLE, srs_id INTEGER)")
    con.execute("CREATE TABLE gpkg_geometry_columns (table_name TEXT NOT NULL, column_name TEXT NOT NULL, "
                "geometry_type_name TEXT NOT NULL, srs_id INTEGER NOT NULL, z TINYINT NOT NULL, m TINYINT NOT NULL, "
                "PRIMARY KEY (table_name, column_name))")
    rows = [("Undefined cartesian SRS", -1, "NONE", -1, "undefined"), ("Undefined geographic SRS", 0, "NONE", 0,
                                                                         "undefined")]
    if srs_id not in (-1, 0):
        rows.append((srs_name, srs_id, "EPSG", srs_id, definition))
    con.executemany("INSERT INTO gpkg_spatial_ref_sys (srs_name, srs_id, organization, organization_coordsys_id, "
                    "definition) VALUES (?,?,?,?,?)", rows)


def register_srs(con: sqlite3.Connection, srs_id: int, srs_name: str, definition: str = "undefined") -> None:
    """Add an EPSG ``srs_id`` to ``gpkg_spatial_ref_sys`` (a GeoPackage may hold layers in several CRSs)."""
    con.execute("INSERT OR IGNORE INTO gpkg_spatial_ref_sys (srs_name, srs_id, organization, organization_coordsys_id, "
                "definition) VALUES (?,?,?,?,?)", (srs_name, srs_id, "EPSG", srs_id, definition))


def write_layer(con: sqlite3.Connection, name: str, kind: int | None, srs_id: int, columns: dict[str, str],
                rows: list[tuple[int, Any, tuple]], envelope: bool = False) -> None:
    """Write a layer: ``columns`` {name: SQL type}; ``rows`` (fid, geometry, attribute values in column order).

    ``kind=None`` writes an attribute-only table (like nuPlan's ``meta``).
    """
    cols = "".join(f", {c} {t}" for c, t in columns.items())
    geom_col = ", geom BLOB" if kind is not None else ""
    con.execute(f"CREATE TABLE {name} (fid INTEGER PRIMARY KEY AUTOINCREMENT{geom_col}{cols})")
    names = ["fid"] + (["geom"] if kind is not None else []) + list(columns)
    sql = f"INSERT INTO {name} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
    data = []
    for fid, geom, values in rows:
        g = (encode_gpkg_geometry(geom, kind, srs_id, envelope),) if kind is not None else ()
        data.append((fid, *g, *values))
    con.executemany(sql, data)
    con.execute("INSERT INTO gpkg_contents (table_name, data_type, identifier, srs_id) VALUES (?,?,?,?)",
                (name, "features" if kind is not None else "attributes", name, srs_id if kind is not None else None))
    if kind is not None:
        con.execute("INSERT INTO gpkg_geometry_columns VALUES (?,?,?,?,0,0)", (name, "geom", GEOMETRY_NAMES[kind],
                                                                               srs_id))


# ---------------------------------------------------------------------------------------------- reading
def open_geopackage(path: str | Path) -> sqlite3.Connection:
    """Open read-only; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise GeoPackageError(f"map file {path} does not exist")
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        con.execute("SELECT table_name FROM gpkg_contents LIMIT 1").fetchall()
    except sqlite3.DatabaseError as e:
        raise GeoPackageError(f"map file {path} is not a readable GeoPackage ({e})") from e
    return con


def list_layers(con: sqlite3.Connection) -> list[str]:
    return [r[0] for r in con.execute("SELECT table_name FROM gpkg_contents ORDER BY table_name")]


def srs_name(con: sqlite3.Connection, srs_id: int) -> str | None:
    """``ORGANIZATION:code`` (e.g. ``EPSG:4326``) of a srs id registered in ``gpkg_spatial_ref_sys``; None when the
    id is not registered."""
    row = con.execute("SELECT organization, organization_coordsys_id FROM gpkg_spatial_ref_sys WHERE srs_id=?",
                      (srs_id,)).fetchone()
    return None if row is None else f"{str(row[0]).upper()}:{row[1]}"


def read_layer(con: sqlite3.Connection, name: str, path: str | Path = "?") -> Layer:
    """Read every feature of ``name`` (geometry decoded, attributes as Python values)."""
    if name not in list_layers(con):
        raise GeoPackageError(f"map file {path} has no layer '{name}'")
    row = con.execute("SELECT column_name, srs_id FROM gpkg_geometry_columns WHERE table_name=?", (name,)).fetchone()
    geom_col, srs_id = (row[0], int(row[1])) if row else (None, 0)
    cur = con.execute(f'SELECT * FROM "{name}"')
    names = [d[0] for d in cur.description]
    rows = cur.fetchall()
    fid_i = names.index("fid") if "fid" in names else None
    g_i = names.index(geom_col) if geom_col in names else None
    columns = {n: [r[i] for r in rows] for i, n in enumerate(names) if i not in (fid_i, g_i)}
    fid_of = (lambda k: rows[k][fid_i]) if fid_i is not None else (lambda k: k)  # noqa: E731
    if g_i is None:
        geoms: list[Any] = [None] * len(rows)
    else:
        try:
            geoms, blob_srs = decode_gpkg_geometries([r[g_i] for r in rows])
        except _BadGeometry as e:
            raise GeoPackageError(f"map file {path}, layer '{name}', feature {fid_of(e.index)}: bad geometry ({e})"
                                  ) from e
        # a geometry whose own srs id contradicts its layer's would be placed in the wrong frame without a sound
        for k, r in enumerate(rows):
            if r[g_i] is not None and blob_srs[k] not in (srs_id, 0, -1):
                raise GeoPackageError(f"map file {path}, layer '{name}', feature {fid_of(k)}: geometry srs_id "
                                      f"{blob_srs[k]} differs from the layer's srs_id {srs_id} "
                                      "(gpkg_geometry_columns); re-export the layer in one CRS")
    fids = np.array([r[fid_i] for r in rows] if fid_i is not None else range(len(rows)), np.int64)
    return Layer(name=name, srs_id=srs_id, fids=fids, columns=columns, geometries=geoms)

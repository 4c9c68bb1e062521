"""GeoPackage reading and writing with the standard library only (OGC GeoPackage 1.2 binary geometry + WKB).

A GeoPackage is an SQLite file: ``gpkg_contents`` lists the layers, ``gpkg_geometry_columns`` names each layer's
geometry column and spatial reference id, and every geometry is a *GeoPackage binary* blob: the magic ``b"GP"``,
a version byte, a flags byte (bit 0 byte order of the header, bits 1-3 the envelope code), the int32 ``srs_id``,
an envelope of 0/32/48/48/64 bytes (codes 0-4), then standard WKB.

Geometries decode to numpy:

* Point -> ``[2]``; LineString -> ``[N, 2]``; Polygon -> list of rings ``[N, 2]`` (exterior first);
* Multi* -> list of the parts above. Z and M ordinates are dropped.

:func:`write_layer` is the inverse used by the synthetic dataset (no envelope by default).
"""
from __future__ import annotations

import importlib
import sqlite3
import struct
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

ENVELOPE_BYTES = {0: 0, 1: 32, 2: 48, 3: 48, 4: 64}
WKB_POINT, WKB_LINESTRING, WKB_POLYGON = 1, 2, 3
WKB_MULTIPOINT, WKB_MULTILINESTRING, WKB_MULTIPOLYGON = 4, 5, 6


class GeoPackageError(ValueError):
    """A GeoPackage that cannot be read; the message names the file, layer and feature."""


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
def _decode_wkb(buf: memoryview, pos: int) -> tuple[Any, int]:
    """Decode one WKB geometry at ``pos``; returns (geometry, position after it)."""
    order = "<" if buf[pos] == 1 else ">"
    (code,) = struct.unpack_from(order + "I", buf, pos + 1)
    pos += 5
    if code & 0xE0000000:  # EWKB flags (z 0x80000000, m 0x40000000, srid 0x20000000)
        has_z, has_m = bool(code & 0x80000000), bool(code & 0x40000000)
        if code & 0x20000000:
            pos += 4
        base = code & 0xFF
    else:  # ISO WKB: 1000s add Z, 2000s add M, 3000s add both
        base, family = code % 1000, code // 1000
        has_z, has_m = family in (1, 3), family in (2, 3)
    dims = 2 + int(has_z) + int(has_m)

    def coords(p: int) -> tuple[np.ndarray, int]:
        (n,) = struct.unpack_from(order + "I", buf, p)
        p += 4
        arr = np.frombuffer(buf, dtype=np.dtype(np.float64).newbyteorder(order), count=n * dims, offset=p)
        return arr.reshape(n, dims)[:, :2].astype(np.float64), p + 8 * n * dims

    if base == WKB_POINT:
        xy = np.frombuffer(buf, dtype=np.dtype(np.float64).newbyteorder(order), count=dims, offset=pos)
        return xy[:2].astype(np.float64), pos + 8 * dims
    if base == WKB_LINESTRING:
        return coords(pos)
    if base == WKB_POLYGON:
        (nr,) = struct.unpack_from(order + "I", buf, pos)
        pos += 4
        rings = []
        for _ in range(nr):
            ring, pos = coords(pos)
            rings.append(ring)
        return rings, pos
    if base in (WKB_MULTIPOINT, WKB_MULTILINESTRING, WKB_MULTIPOLYGON, 7):
        (n,) = struct.unpack_from(order + "I", buf, pos)
        pos += 4
        parts = []
        for _ in range(n):
            g, pos = _decode_wkb(buf, pos)
            parts.append(g)
        return parts, pos
    raise GeoPackageError(f"unsupported WKB geometry type {code}")


def decode_gpkg_geometry(blob: bytes) -> tuple[Any, int]:
    """Decode a GeoPackage binary geometry: returns (geometry, srs_id). ``None`` geometry for an empty blob."""
    if blob is None:
        return None, 0
    buf = memoryview(blob)
    if len(buf) < 8 or bytes(buf[:2]) != b"GP":
        raise GeoPackageError("not a GeoPackage binary geometry (missing 'GP' magic)")
    flags = buf[3]
    order = "<" if flags & 1 else ">"
    (srs_id,) = struct.unpack_from(order + "i", buf, 4)
    env = (flags >> 1) & 7
    if env not in ENVELOPE_BYTES:
        raise GeoPackageError(f"invalid GeoPackage envelope code {env}")
    if flags & 0x10:  # empty geometry flag
        return None, srs_id
    geom, _ = _decode_wkb(buf, 8 + ENVELOPE_BYTES[env])
    return geom, srs_id


# ---------------------------------------------------------------------------------------------- encoding
def _encode_wkb(geom: Any, kind: int) -> bytes:
    """Little-endian 2-D WKB for ``kind`` (a WKB_* code) from the numpy representation above."""
    head = struct.pack("<BI", 1, kind)
    if kind == WKB_POINT:
        return head + struct.pack("<2d", *np.asarray(geom, np.float64)[:2])
    if kind == WKB_LINESTRING:
        a = np.ascontiguousarray(np.asarray(geom, np.float64)[:, :2])
        return head + struct.pack("<I", len(a)) + a.astype("<f8").tobytes()
    if kind == WKB_POLYGON:
        out = head + struct.pack("<I", len(geom))
        for ring in geom:
            r = np.asarray(ring, np.float64)[:, :2]
            if not np.allclose(r[0], r[-1]):
                r = np.vstack([r, r[:1]])
            out += struct.pack("<I", len(r)) + np.ascontiguousarray(r).astype("<f8").tobytes()
        return out
    if kind == WKB_MULTIPOLYGON:
        return head + struct.pack("<I", len(geom)) + b"".join(_encode_wkb(p, WKB_POLYGON) for p in geom)
    if kind == WKB_MULTILINESTRING:
        return head + struct.pack("<I", len(geom)) + b"".join(_encode_wkb(p, WKB_LINESTRING) for p in geom)
    raise GeoPackageError(f"cannot encode WKB type {kind}")


def encode_gpkg_geometry(geom: Any, kind: int, srs_id: int, envelope: bool = False) -> bytes:
    """GeoPackage binary blob (little endian); ``envelope`` adds the 32-byte xy envelope (code 1)."""
    flags = 1 | ((1 << 1) if envelope else 0)
    head = b"GP" + bytes([0, flags]) + struct.pack("<i", srs_id)
    if envelope:
        pts = _all_points(geom)
        head += struct.pack("<4d", pts[:, 0].min(), pts[:, 0].max(), pts[:, 1].min(), pts[:, 1].max())
    return head + _encode_wkb(geom, kind)


def _all_points(geom: Any) -> np.ndarray:
    if isinstance(geom, np.ndarray):
        return geom.reshape(-1, 2)
    return np.concatenate([_all_points(g) for g in geom])


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
    geoms = []
    for k, r in enumerate(rows):
        if g_i is None:
            geoms.append(None)
            continue
        try:
            geom, blob_srs = decode_gpkg_geometry(r[g_i])
        except (GeoPackageError, struct.error, ValueError) as e:
            raise GeoPackageError(f"map file {path}, layer '{name}', feature {r[fid_i] if fid_i is not None else k}: "
                                  f"bad geometry ({e})") from e
        # a geometry whose own srs id contradicts its layer's would be placed in the wrong frame without a sound
        if r[g_i] is not None and blob_srs not in (srs_id, 0, -1):
            raise GeoPackageError(f"map file {path}, layer '{name}', feature "
                                  f"{r[fid_i] if fid_i is not None else k}: geometry srs_id {blob_srs} differs from "
                                  f"the layer's srs_id {srs_id} (gpkg_geometry_columns); re-export the layer in one "
                                  "CRS")
        geoms.append(geom)
    fids = np.array([r[fid_i] for r in rows] if fid_i is not None else range(len(rows)), np.int64)
    return Layer(name=name, srs_id=srs_id, fids=fids, columns=columns, geometries=geoms)

"""Compile a :class:`~envs.maps.lanegraph.LaneGraph` into top-down raster layers.

The simulator never draws the static map per tick: it compiles the lane graph once into a stack of uint8 layers
(road, shoulder, lane markings, speed signs, junction area, crosswalks) plus a per-pixel lane-segment index
(``seg_id``), and then only warps/crops those layers (:mod:`envs.sim.bev_draw`).

Raster frame: pixel ``(row, col)`` covers the world square whose corner is ``origin + (col, row) / ppm``; the row index
grows with world y (north) and the column index with world x (east). Note that this is *not* image orientation
(north is at the bottom when the array is shown as an image); the BEV crop takes care of the rotation.

Rasterisation is vectorised: every primitive (capsule-shaped lane segment, convex quad) gets a fixed ``K x K`` pixel
patch around its bounding box, all patch pixels are tested at once (in chunks to bound memory) and the results are
combined with ``scatter_reduce`` (``amax`` for layers, ``amin`` on a packed priority key for ``seg_id``).
"""
from __future__ import annotations

import hashlib
import math
import os
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from envs.maps.lanegraph import MARK_BROKEN, MARK_NONE, MARK_SOLID, LaneGraph, MapError

__all__ = [
    "LAYER_ROAD", "LAYER_SHOULDER", "LAYER_MARKINGS", "LAYER_SPEED_SIGNS", "LAYER_JUNCTION", "LAYER_CROSSWALK",
    "NUM_LAYERS", "LAYER_NAMES", "RASTER_FORMAT_VERSION", "MapRaster", "compile_raster", "load_or_compile_raster",
    "speed_encoding",
]

LAYER_ROAD, LAYER_SHOULDER, LAYER_MARKINGS, LAYER_SPEED_SIGNS, LAYER_JUNCTION, LAYER_CROSSWALK = range(6)
NUM_LAYERS = 6
LAYER_NAMES = ("road", "shoulder", "markings", "speed_signs", "junction", "crosswalk")
# Bump whenever the rasterisation changes so cached rasters are rebuilt.
RASTER_FORMAT_VERSION = 1

MARKING_HALF_WIDTH_M = 0.1  # lane markings are ~0.2 m wide (at least 1 px)
DASH_ON_M, DASH_OFF_M = 3.0, 3.0  # broken markings: 3 m painted, 3 m gap along the lane's arc length
SEG_MARGIN_M = 1.0  # seg_id covers the lane width plus this lateral margin on each side
SIGN_HALF_EXTENT_M = 1.0
END_OVERLAP_M = 0.05  # lane/shoulder ends are flat, pushed out by this much so consecutive lanes have no seam
_CHUNK_PIXELS = 1 << 18  # patch pixels per chunk: small chunks stay in cache (measured ~1 s vs ~3 s at 4M)


def speed_encoding(v: np.ndarray | torch.Tensor | float) -> np.ndarray | torch.Tensor:
    """CaRL's moving-actor / speed-sign value: ``127 + floor(128 * clip((v + 2.67) / 36, 0, 1))`` (max 255)."""
    if isinstance(v, torch.Tensor):
        return (127 + torch.floor(128 * ((v + 2.67) / 36.0).clamp(0, 1))).clamp(max=255).to(torch.uint8)
    v = np.asarray(v, np.float64)
    return np.minimum(127 + np.floor(128 * np.clip((v + 2.67) / 36.0, 0, 1)), 255).astype(np.uint8)


@dataclass
class MapRaster:
    """Static raster layers of one map.

    ``layers[k]`` is uint8 ``[H, W]`` for layer ``k`` (see ``LAYER_*``); ``seg_id`` is int32 ``[H, W]``: the index ``i``
    into ``graph.points`` of the lane segment ``points[i] -> points[i+1]`` covering the pixel, or -1.
    """

    origin: tuple[float, float]  # world (x, y) of the corner of pixel (row 0, col 0)
    ppm: float  # pixels per metre
    layers: torch.Tensor  # uint8 [NUM_LAYERS, H, W]
    seg_id: torch.Tensor  # int32 [H, W]
    # Derived tensors (e.g. padded/packed layer stacks for the BEV crop), keyed by their consumer. Not persisted.
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def height(self) -> int:
        return int(self.layers.shape[-2])

    @property
    def width(self) -> int:
        return int(self.layers.shape[-1])

    @property
    def device(self) -> torch.device:
        return self.layers.device

    def to(self, device: torch.device | str) -> "MapRaster":
        """The same raster on ``device`` (derived caches are rebuilt lazily there)."""
        return MapRaster(self.origin, self.ppm, self.layers.to(device), self.seg_id.to(device))

    def world_to_pixel(self, xy: torch.Tensor) -> torch.Tensor:
        """World ``(..., 2)`` metres -> float pixel coordinates ``(col, row)`` = ``(xy - origin) * ppm``.

        Pixel ``(col, row)`` covers ``[col, col + 1) x [row, row + 1)`` in these coordinates, so the pixel containing
        a point is ``floor()`` of the result and pixel centres sit at ``index + 0.5``.
        """
        # per-component arithmetic with Python floats: no host-to-device copy of the origin on CUDA
        return torch.stack(((xy[..., 0] - self.origin[0]) * self.ppm, (xy[..., 1] - self.origin[1]) * self.ppm), -1)


# ---------------------------------------------------------------------------------------------------- primitives
def _patch_offsets(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row/col offsets of a ``k x k`` patch, flattened: ``([k*k], [k*k])`` int64."""
    r = torch.arange(k).repeat_interleave(k)
    c = torch.arange(k).repeat(k)
    return r, c


def _capsule_patches(p0: torch.Tensor, p1: torch.Tensor, radius: torch.Tensor, t_lo: torch.Tensor,
                     t_hi: torch.Tensor, shape: tuple[int, int], origin: tuple[float, float], ppm: float):
    """Yield ``(first, flat_idx [n, K*K], dist [n, K*K], inside [n, K*K])`` chunks for a set of segments.

    A pixel centre ``q`` is inside segment ``j`` when its distance to the segment (projection parameter clamped to
    [0, 1], i.e. a capsule with round joins, so consecutive segments of a bent polyline have no seams) is
    ``<= radius[j]`` and the *unclamped* projection parameter lies in ``[t_lo[j], t_hi[j]]`` (flat lane ends use
    ``t_lo = -overlap`` / ``t_hi = 1 + overlap``; interior joints use +-inf). ``dist`` is that distance in metres.
    """
    h, w = shape
    n = p0.shape[0]
    if n == 0:
        return
    ext = (torch.minimum(p0, p1) - radius[:, None], torch.maximum(p0, p1) + radius[:, None])
    span = float(((ext[1] - ext[0]).max() * ppm).ceil()) + 2 if n else 2
    k = int(span)
    off_r, off_c = _patch_offsets(k)
    o = torch.tensor(origin, dtype=torch.float32)
    # patch corner = pixel containing the bbox min corner
    corner = torch.floor((ext[0] - o) * ppm).to(torch.int64)  # [n, 2] (col, row)
    per = max(1, _CHUNK_PIXELS // (k * k))
    for s in range(0, n, per):
        e = min(n, s + per)
        col = corner[s:e, 0:1] + off_c[None]  # [m, KK]
        row = corner[s:e, 1:2] + off_r[None]
        qx = (col.to(torch.float32) + 0.5) / ppm + o[0]
        qy = (row.to(torch.float32) + 0.5) / ppm + o[1]
        a, b = p0[s:e], p1[s:e]
        d = b - a
        len2 = (d * d).sum(-1).clamp_min(1e-12)[:, None]
        rx, ry = qx - a[:, 0:1], qy - a[:, 1:2]
        t = (rx * d[:, 0:1] + ry * d[:, 1:2]) / len2
        tc = t.clamp(0.0, 1.0)
        ex, ey = rx - tc * d[:, 0:1], ry - tc * d[:, 1:2]
        dist = torch.sqrt(ex * ex + ey * ey)
        inside = (dist <= radius[s:e, None]) & (t >= t_lo[s:e, None]) & (t <= t_hi[s:e, None])
        inside &= (col >= 0) & (col < w) & (row >= 0) & (row < h)
        flat = row.clamp(0, h - 1) * w + col.clamp(0, w - 1)
        yield s, flat, dist, inside


def _draw_capsules(canvas: torch.Tensor, p0: torch.Tensor, p1: torch.Tensor, radius: torch.Tensor,
                   t_lo: torch.Tensor, t_hi: torch.Tensor, value: torch.Tensor, origin: tuple[float, float],
                   ppm: float) -> None:
    """Max-combine ``value[j]`` (uint8) into ``canvas`` [H, W] on the pixels of capsule segment ``j``."""
    flat_canvas = canvas.view(-1)
    for s, flat, _, inside in _capsule_patches(p0, p1, radius, t_lo, t_hi, tuple(canvas.shape), origin, ppm):
        val = inside.view(torch.uint8) * value[s:s + flat.shape[0], None]  # faster than torch.where on uint8
        flat_canvas.scatter_reduce_(0, flat.reshape(-1), val.reshape(-1), "amax")


def _draw_convex_quads(canvas: torch.Tensor, quads: torch.Tensor, value: torch.Tensor,
                       origin: tuple[float, float], ppm: float) -> None:
    """Max-combine ``value[j]`` into ``canvas`` [H, W] inside convex quad ``quads[j]`` ([4, 2], either winding)."""
    n = quads.shape[0]
    if n == 0:
        return
    h, w = canvas.shape
    lo, hi = quads.min(1).values, quads.max(1).values
    k = int(float(((hi - lo).max() * ppm).ceil())) + 2
    off_r, off_c = _patch_offsets(k)
    o = torch.tensor(origin, dtype=torch.float32)
    corner = torch.floor((lo - o) * ppm).to(torch.int64)
    # edge vectors and the quad's orientation sign (positive area = counter-clockwise)
    nxt = quads.roll(-1, dims=1)
    edge = nxt - quads  # [n, 4, 2]
    area2 = (quads[..., 0] * nxt[..., 1] - nxt[..., 0] * quads[..., 1]).sum(-1)
    sign = torch.where(area2 >= 0, 1.0, -1.0)
    flat_canvas = canvas.view(-1)
    per = max(1, _CHUNK_PIXELS // (k * k * 4))
    for s in range(0, n, per):
        e = min(n, s + per)
        col = corner[s:e, 0:1] + off_c[None]
        row = corner[s:e, 1:2] + off_r[None]
        qx = ((col.to(torch.float32) + 0.5) / ppm + o[0])[:, None, :]  # [m, 1, KK]
        qy = ((row.to(torch.float32) + 0.5) / ppm + o[1])[:, None, :]
        cross = (edge[s:e, :, 0:1] * (qy - quads[s:e, :, 1:2]) - edge[s:e, :, 1:2] * (qx - quads[s:e, :, 0:1]))
        inside = ((cross * sign[s:e, None, None]) >= 0).all(1)
        inside &= (col >= 0) & (col < w) & (row >= 0) & (row < h)
        flat = row.clamp(0, h - 1) * w + col.clamp(0, w - 1)
        val = inside.view(torch.uint8) * value[s:e, None]
        flat_canvas.scatter_reduce_(0, flat.reshape(-1), val.reshape(-1), "amax")


def _polyline_segments(points: np.ndarray, offsets: np.ndarray, overlap: float):
    """Segments of concatenated polylines: ``(i0 [S], owner [S], t_lo [S], t_hi [S])``.

    ``i0`` indexes the first point of each segment; ``owner`` is the polyline index. Segments at the start/end of a
    polyline get a flat end (``t`` limited to ``-overlap/len`` / ``1 + overlap/len``); interior ends are unlimited.
    """
    counts = np.diff(offsets)
    owner_pt = np.repeat(np.arange(len(counts)), counts)
    i0 = np.nonzero(owner_pt[:-1] == owner_pt[1:])[0] if len(owner_pt) > 1 else np.zeros(0, np.int64)
    owner = owner_pt[i0]
    seg_len = np.maximum(np.linalg.norm(points[i0 + 1] - points[i0], axis=1), 1e-6)
    first = i0 == offsets[owner]
    last = i0 + 2 == offsets[owner + 1]
    t_lo = np.where(first, -overlap / seg_len, -np.inf).astype(np.float32)
    t_hi = np.where(last, 1.0 + overlap / seg_len, np.inf).astype(np.float32)
    return i0, owner, t_lo, t_hi


def _vertex_normals(points: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Unit left normals at every polyline vertex (mean of the adjacent segment directions)."""
    p = points.astype(np.float64)
    out = np.zeros_like(p)
    for_dir = np.zeros_like(p)
    counts = np.diff(offsets)
    owner = np.repeat(np.arange(len(counts)), counts)
    same = owner[:-1] == owner[1:]
    d = np.diff(p, axis=0)
    d /= np.maximum(np.linalg.norm(d, axis=1, keepdims=True), 1e-9)
    d[~same] = 0
    for_dir[:-1] += d  # outgoing direction
    for_dir[1:] += d  # incoming direction
    for_dir /= np.maximum(np.linalg.norm(for_dir, axis=1, keepdims=True), 1e-9)
    out[:, 0], out[:, 1] = -for_dir[:, 1], for_dir[:, 0]
    return out


# ---------------------------------------------------------------------------------------------------- compiling
def compile_raster(graph: LaneGraph, ppm: float = 4.0) -> MapRaster:
    """Rasterise ``graph`` at ``ppm`` pixels per metre (CPU, vectorised; a few seconds for a CARLA town)."""
    if ppm <= 0:
        raise MapError(f"map '{graph.name}': raster resolution must be > 0 px/m, got {ppm}")
    xmin, ymin, xmax, ymax = graph.bounds(margin=10.0)
    origin = (math.floor(xmin), math.floor(ymin))
    w = int(math.ceil((xmax - origin[0]) * ppm))
    h = int(math.ceil((ymax - origin[1]) * ppm))
    layers = torch.zeros(NUM_LAYERS, h, w, dtype=torch.uint8)
    pts = torch.from_numpy(np.ascontiguousarray(graph.points, np.float32))

    # --- lane segments: road, junction and seg_id in one pass over patch pixels
    i0, lane, t_lo_end, t_hi_end = _polyline_segments(graph.points, graph.offsets, END_OVERLAP_M)
    i0_t = torch.from_numpy(i0)
    lane_t = torch.from_numpy(lane)
    pw = graph.point_widths().astype(np.float32)  # lane width per point: tapering lanes follow their width
    half_w = torch.from_numpy((pw[i0] + pw[i0 + 1]) * 0.25)
    junc = torch.from_numpy(graph.is_junction.astype(bool))[lane_t]
    junc_u8 = junc.to(torch.uint8)
    p0, p1 = pts[i0_t], pts[i0_t + 1]
    # seg_id ends are as flat as the road's, but with the lateral margin (t limits scale with the segment only)
    seg_len = (p1 - p0).norm(dim=-1).clamp_min(1e-6)
    t_lo_seg = torch.where(torch.from_numpy(np.isfinite(t_lo_end)), -END_OVERLAP_M / seg_len,
                           torch.tensor(float("-inf")))
    t_hi_seg = torch.where(torch.from_numpy(np.isfinite(t_hi_end)), 1.0 + END_OVERLAP_M / seg_len,
                           torch.tensor(float("inf")))
    # priority key (smaller wins): [junction flag | distance in mm (31 bits) | segment point index (32 bits)]
    big = torch.iinfo(torch.int64).max
    key = torch.full((h * w,), big, dtype=torch.int64)
    road, jmap = layers[LAYER_ROAD].view(-1), layers[LAYER_JUNCTION].view(-1)
    radius = half_w + SEG_MARGIN_M
    for s, flat, dist, inside in _capsule_patches(p0, p1, radius, t_lo_seg, t_hi_seg, (h, w), origin, ppm):
        m = flat.shape[0]
        on_lane = inside & (dist <= half_w[s:s + m, None])
        v = on_lane.view(torch.uint8) * 255
        road.scatter_reduce_(0, flat.reshape(-1), v.reshape(-1), "amax")
        vj = v * junc_u8[s:s + m, None]
        jmap.scatter_reduce_(0, flat.reshape(-1), vj.reshape(-1), "amax")
        mm = (dist * 1000.0).clamp(max=2 ** 30).to(torch.int64)
        k = (junc[s:s + m, None].to(torch.int64) << 62) | (mm << 32) | i0_t[s:s + m, None]
        k = torch.where(inside, k, torch.tensor(big))
        key.scatter_reduce_(0, flat.reshape(-1), k.reshape(-1), "amin")
    seg_id = torch.where(key == big, torch.tensor(-1, dtype=torch.int64), key & 0xFFFFFFFF).to(torch.int32)
    seg_id = seg_id.view(h, w)

    # --- shoulders
    if len(graph.shoulder_width):
        si0, sown, slo, shi = _polyline_segments(graph.shoulder_points, graph.shoulder_offsets, END_OVERLAP_M)
        sp = torch.from_numpy(np.ascontiguousarray(graph.shoulder_points, np.float32))
        si = torch.from_numpy(si0)
        srad = torch.from_numpy(graph.shoulder_width.astype(np.float32))[torch.from_numpy(sown)] * 0.5
        _draw_capsules(layers[LAYER_SHOULDER], sp[si], sp[si + 1], srad, torch.from_numpy(slo),
                       torch.from_numpy(shi), torch.full((len(si0),), 255, dtype=torch.uint8), origin, ppm)

    # --- lane markings: boundaries of non-junction lanes
    normals = _vertex_normals(graph.points, graph.offsets)
    seg_arc = np.linalg.norm(graph.points[i0 + 1] - graph.points[i0], axis=1)
    # arc length at each segment's midpoint, restarted per lane
    cum = np.cumsum(seg_arc) - seg_arc
    lane_start = np.zeros(graph.num_lanes)
    first = np.r_[True, lane[1:] != lane[:-1]] if len(lane) else np.zeros(0, bool)
    lane_start[lane[first]] = cum[first]
    mid_s = cum - lane_start[lane] + 0.5 * seg_arc
    dash_on = np.mod(mid_s, DASH_ON_M + DASH_OFF_M) < DASH_ON_M
    mark_p0, mark_p1, mark_v = [], [], []
    for side, marking in ((1.0, graph.left_marking), (-1.0, graph.right_marking)):
        kind = marking[lane]
        keep = (~graph.is_junction[lane]) & (kind != MARK_NONE) & ((kind == MARK_SOLID) | dash_on)
        off0, off1 = side * 0.5 * pw[i0][:, None], side * 0.5 * pw[i0 + 1][:, None]
        mark_p0.append((graph.points[i0] + off0 * normals[i0])[keep])
        mark_p1.append((graph.points[i0 + 1] + off1 * normals[i0 + 1])[keep])
        mark_v.append(np.where(kind[keep] == MARK_BROKEN, 127, 255).astype(np.uint8))
    mp0 = torch.from_numpy(np.concatenate(mark_p0).astype(np.float32))
    mp1 = torch.from_numpy(np.concatenate(mark_p1).astype(np.float32))
    nm = mp0.shape[0]
    mrad = torch.full((nm,), max(MARKING_HALF_WIDTH_M, 0.5 / ppm))
    inf = torch.full((nm,), float("inf"))
    _draw_capsules(layers[LAYER_MARKINGS], mp0, mp1, mrad, -inf, inf,
                   torch.from_numpy(np.concatenate(mark_v)), origin, ppm)

    # --- speed signs: axis-aligned squares with the speed-encoded limit
    if len(graph.speed_signs):
        c = torch.from_numpy(graph.speed_signs[:, :2].astype(np.float32))
        sq = torch.tensor([[-1, -1], [1, -1], [1, 1], [-1, 1]], dtype=torch.float32) * SIGN_HALF_EXTENT_M
        val = torch.from_numpy(speed_encoding(graph.speed_signs[:, 2]))
        _draw_convex_quads(layers[LAYER_SPEED_SIGNS], c[:, None, :] + sq[None], val, origin, ppm)

    # --- crosswalks
    if len(graph.crosswalks):
        cw = torch.from_numpy(graph.crosswalks.astype(np.float32))
        _draw_convex_quads(layers[LAYER_CROSSWALK], cw, torch.full((len(cw),), 255, dtype=torch.uint8), origin, ppm)

    return MapRaster(origin=(float(origin[0]), float(origin[1])), ppm=float(ppm), layers=layers, seg_id=seg_id)


# ---------------------------------------------------------------------------------------------------- caching
def graph_hash(graph: LaneGraph, ppm: float) -> str:
    """Hash of the graph's arrays, ``ppm`` and the raster format version (the cache key)."""
    hsh = hashlib.sha1()
    hsh.update(f"v{RASTER_FORMAT_VERSION}:ppm={float(ppm)!r}".encode())
    for f in fields(graph):
        val = getattr(graph, f.name)
        if isinstance(val, np.ndarray):
            arr = np.ascontiguousarray(val)
            hsh.update(f"{f.name}:{arr.dtype.str}:{arr.shape}".encode())
            hsh.update(arr.tobytes())
    return hsh.hexdigest()[:20]


def load_or_compile_raster(graph: LaneGraph, ppm: float, cache_dir: Path | str | None) -> MapRaster:
    """Load the raster of ``graph`` from ``cache_dir`` or compile it (and cache it, written atomically).

    The cache file name carries the map name and a hash of the graph arrays, ``ppm`` and
    :data:`RASTER_FORMAT_VERSION`, so a changed map or rasteriser never reuses a stale file. An unreadable cache file
    is recompiled and overwritten.
    """
    if cache_dir is None:
        return compile_raster(graph, ppm)
    cache_dir = Path(cache_dir)
    safe_name = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in graph.name) or "map"
    path = cache_dir / f"{safe_name}_{graph_hash(graph, ppm)}.raster.npz"
    if path.exists():
        try:
            with np.load(path, allow_pickle=False) as z:
                return MapRaster(origin=(float(z["origin"][0]), float(z["origin"][1])), ppm=float(z["ppm"]),
                                 layers=torch.from_numpy(z["layers"]), seg_id=torch.from_numpy(z["seg_id"]))
        except Exception:  # noqa: BLE001 - a corrupt cache is simply rebuilt
            pass
    raster = compile_raster(graph, ppm)
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=cache_dir)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez_compressed(fh, origin=np.asarray(raster.origin, np.float64), ppm=np.float64(raster.ppm),
                                layers=raster.layers.numpy(), seg_id=raster.seg_id.numpy())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return raster

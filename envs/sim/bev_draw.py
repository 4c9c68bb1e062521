"""Batched bird's-eye-view drawing: the simulator's per-tick rendering hot path.

Every function works on a whole batch of environments at once: no Python loop over environments or objects. On
CUDA the shapes are fixed and nothing synchronises with the host (the code runs inside CUDA graphs); on CPU, where a
host sync costs nothing, only the valid objects are drawn (:func:`_objects`): most actor slots are empty on most rows
(the route scenarios' slots, the vehicles' light boxes), and a box costs its whole patch whether it is drawn or not.

BEV frame (CaRL): the image is ego-centric with the ego heading pointing up. The ego centre is the pixel
``(col, row) = (W // 2, H - 1 - ego_from_bottom)``; pixel centres sit at integer ``(col, row)`` coordinates, rows grow
downwards (backwards from the ego) and columns grow to the ego's right.

Boxes and discs use a fixed ``K x K`` pixel patch per object (``K`` from a maximum object size) and test every patch
pixel against the object's shape at once; segments use a fixed grid of samples along and across them. Everything is
combined into the canvas with ``scatter_reduce("amax")``, so overlapping objects keep the larger value and objects
outside the view are dropped (their pixels write 0, which ``amax`` ignores). On CPU the boxes' per-pixel work is done
in fixed-size blocks of objects so temporaries stay in cache; on CUDA all objects are one block.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from envs.maps.rasterize import MapRaster

__all__ = ["BevConfig", "crop_static", "crop_index", "world_to_bev", "draw_boxes", "draw_discs", "draw_segments",
           "box_fraction_on"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class BevConfig:
    """Geometry of the BEV image (CaRL: 256 x 256 at 2 px/m, ego 100 px above the bottom edge)."""

    size: int = 256  # H = W
    ppm: float = 2.0  # pixels per metre
    ego_from_bottom: int = 100  # ego centre row counted from the bottom edge

    @property
    def ego_col(self) -> int:
        return self.size // 2

    @property
    def ego_row(self) -> int:
        return self.size - 1 - self.ego_from_bottom


# ---------------------------------------------------------------------------------------------------- static map
def _bev_resolution_layers(raster: MapRaster, layer_ids: tuple[int, ...], ppm: float) -> tuple[Tensor, float]:
    """The selected layers ``[C, H, W]`` at (or near) the BEV resolution and their pixels per metre.

    When the raster resolution is an integer multiple ``f >= 2`` of ``ppm`` the layers are max-pooled by ``f``: thin
    features (1-px lane markings) survive the downsampling and the smaller map is friendlier to the cache.
    """
    sel = raster.layers[list(layer_ids)]
    f = raster.ppm / ppm
    if f >= 2 and abs(f - round(f)) < 1e-6:
        f = int(round(f))
        h, w = sel.shape[-2:]
        hh, ww = -(-h // f) * f, -(-w // f) * f
        if (hh, ww) != (h, w):
            sel = torch.nn.functional.pad(sel, (0, ww - w, 0, hh - h))
        sel = sel.view(len(layer_ids), hh // f, f, ww // f, f).amax(dim=(2, 4))
        return sel, raster.ppm / f
    return sel, raster.ppm


def _view_radius_px(cfg: BevConfig, map_ppm: float) -> int:
    """Upper bound, in map pixels, on the distance from the ego to any sampled point of the BEV."""
    dc = max(cfg.ego_col, cfg.size - 1 - cfg.ego_col) + 1
    dr = max(cfg.ego_row, cfg.size - 1 - cfg.ego_row) + 1
    return int(math.ceil(math.hypot(dc, dr) / cfg.ppm * map_ppm)) + 2


def _padded_layers(raster: MapRaster, layer_ids: tuple[int, ...],
                   cfg: BevConfig) -> tuple[Tensor, int, int, float, int]:
    """Selected layers with a zero border of ``2 * R`` pixels, channels packed into one machine word per pixel.

    ``R`` bounds the BEV's reach from the ego (:func:`_view_radius_px`). Returns ``(packed [Hp*Wp], bytes_per_word,
    Wp, map_ppm, pad)``: the uint8 ``[Hp, Wp, P]`` channels-last stack viewed as one ``P``-byte word per pixel (``P``
    in 1, 2, 4, 8), so one gather fetches all channels of a pixel. Cached on the raster.

    The wide border makes per-pixel bounds checks unnecessary: the ego's map position is clamped to at most ``R``
    outside the map (a per-environment operation), and an ego further out sees nothing but border either way.
    """
    key = ("crop", layer_ids, cfg)
    hit = raster.cache.get(key)
    if hit is not None:
        return hit
    c = len(layer_ids)
    if c > 8:
        raise ValueError(f"crop_static takes at most 8 layers per call, got {c}")
    p = 1 if c == 1 else 2 if c == 2 else 4 if c <= 4 else 8
    sel, map_ppm = _bev_resolution_layers(raster, layer_ids, cfg.ppm)
    pad = 2 * _view_radius_px(cfg, map_ppm)
    h, w = sel.shape[-2:]
    buf = torch.zeros(h + 2 * pad, w + 2 * pad, p, dtype=torch.uint8, device=sel.device)
    buf[pad:pad + h, pad:pad + w, :c] = sel.permute(1, 2, 0)
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[p]
    packed = buf.view(dtype).reshape(-1)
    raster.cache[key] = (packed, p, w + 2 * pad, map_ppm, pad)
    return raster.cache[key]


def _union_mask(raster: MapRaster, layer_ids: tuple[int, ...]) -> Tensor:
    """Flat uint8 ``[Hp*Wp]`` mask (1 where any of the layers is non-zero) with a 1-pixel zero border. Cached."""
    key = ("union", layer_ids)
    hit = raster.cache.get(key)
    if hit is not None:
        return hit
    sel = raster.layers[list(layer_ids)]
    h, w = sel.shape[-2:]
    buf = torch.zeros(h + 2, w + 2, dtype=torch.uint8, device=sel.device)
    buf[1:-1, 1:-1] = (sel > 0).any(0)
    mask = buf.view(-1)
    raster.cache[key] = mask
    return mask


def _bev_affine_terms(origin: tuple[float, float], map_ppm: float, pad: int, hp: int, wp: int, ego_xy: Tensor,
                      ego_yaw: Tensor, cfg: BevConfig) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Separable parts of the BEV -> padded-map affine map: ``(col_r [B,H], col_c [B,W], row_r [B,H], row_c [B,W])``.

    The padded-map column under BEV pixel ``(i, j)`` is ``col_r[:, i] + col_c[:, j]`` (likewise for the row); all
    such coordinates are >= 0 thanks to the map's wide zero border, so truncation is floor and no bounds checks are
    needed. The ego's map position is clamped to at most ``pad / 2`` pixels outside the map.
    """
    dev = ego_xy.device
    n = cfg.size
    cos, sin = torch.cos(ego_yaw).float(), torch.sin(ego_yaw).float()
    pm = float(map_ppm)
    ar = torch.arange(n, device=dev, dtype=torch.float32)
    fwd = (cfg.ego_row - ar) / cfg.ppm  # [H] metres ahead of the ego for each row
    left = (cfg.ego_col - ar) / cfg.ppm  # [W] metres to the left for each column
    # padded-map pixel index = floor((world - origin) * pm) + pad
    reach = pad // 2
    base_c = ((ego_xy[:, 0].float() - origin[0]) * pm).clamp(-reach, wp - 2 * pad + reach) + pad
    base_r = ((ego_xy[:, 1].float() - origin[1]) * pm).clamp(-reach, hp - 2 * pad + reach) + pad
    # world = ego + fwd * (cos, sin) + left * (-sin, cos)
    col_r = fwd[None] * (pm * cos)[:, None] + base_c[:, None]
    col_c = left[None] * (-pm * sin)[:, None]
    row_r = fwd[None] * (pm * sin)[:, None] + base_r[:, None]
    row_c = left[None] * (pm * cos)[:, None]
    return col_r, col_c, row_r, row_c


# CPU cache blocking for crop_static: environments per chunk so that the per-pixel temporaries (~30 bytes per
# BEV pixel) stay in L2. On CUDA the whole batch is one chunk.
_CPU_CROP_CHUNK_PIXELS = 1 << 17


def crop_static(raster: MapRaster, layer_ids: list[int], ego_xy: Tensor, ego_yaw: Tensor,
                cfg: BevConfig = BevConfig(), out: Tensor | None = None,
                out_channels: list[int] | None = None) -> Tensor:
    """Ego-centric crops of static map layers: uint8 ``[B, len(layer_ids), H, W]`` (nearest sampling).

    ``ego_xy`` ``[B, 2]`` world metres, ``ego_yaw`` ``[B]`` radians; at most 8 layers per call. Pixels outside the
    map are 0. When the raster resolution is an integer multiple of ``cfg.ppm`` the map is first max-pooled to the
    BEV resolution (once, cached), which keeps 1-px markings visible.

    To skip a copy, pass ``out`` (uint8 ``[B, C_out, H, W]``, e.g. the whole observation tensor) and
    ``out_channels`` (the channel of ``out`` that receives each layer); ``out`` is then filled and returned.

    Implementation: one index gather of all requested channels packed into a machine word per map pixel (measured
    several times faster than ``F.grid_sample`` on a float copy of the map); on CPU the batch is processed in
    fixed-size chunks of environments so per-pixel temporaries stay in cache (on CUDA: one chunk).
    """
    packed, p, wp, map_ppm, pad = _padded_layers(raster, tuple(int(i) for i in layer_ids), cfg)
    hp = packed.numel() // wp
    b, n, c = ego_xy.shape[0], cfg.size, len(layer_ids)
    if out is None:
        out = torch.empty(b, c, n, n, dtype=torch.uint8, device=ego_xy.device)
        out_channels = list(range(c))
    elif out_channels is None or len(out_channels) != c:
        raise ValueError("crop_static: out needs out_channels with one channel per layer id")
    contiguous_run = out_channels == list(range(out_channels[0], out_channels[0] + c))
    step = b if ego_xy.device.type != "cpu" else max(1, _CPU_CROP_CHUNK_PIXELS // (n * n))
    col_r, col_c, row_r, row_c = _bev_affine_terms(raster.origin, map_ppm, pad, hp, wp, ego_xy, ego_yaw, cfg)
    for s in range(0, b, step):
        e = min(b, s + step)
        # flat index (int32) of the map pixel under every BEV pixel of this chunk
        mc = (col_r[s:e, :, None] + col_c[s:e, None, :]).to(torch.int32)
        mr = (row_r[s:e, :, None] + row_c[s:e, None, :]).to(torch.int32)
        words = torch.index_select(packed, 0, torch.add(mc, mr, alpha=wp).view(-1))
        pix = words.view(torch.uint8).view(e - s, n, n, p)[..., :c].permute(0, 3, 1, 2)
        if contiguous_run:
            out[s:e, out_channels[0]:out_channels[0] + c].copy_(pix)
        else:
            for k, ch in enumerate(out_channels):
                out[s:e, ch].copy_(pix[:, k])
    return out


def crop_index(raster: MapRaster, key: str, index: Tensor | Callable[[], Tensor], ego_xy: Tensor, ego_yaw: Tensor,
               cfg: BevConfig = BevConfig()) -> Tensor:
    """Ego-centric crops of an integer map on the raster's grid: int32 ``[B, H, W]`` (nearest sampling at the
    raster's own resolution, never pooled; -1 outside the map).

    ``index`` is an integer ``[raster.height, raster.width]`` map (e.g. the lane under every pixel), or a function
    that makes it; it is padded once and cached on the raster under ``key`` (later calls with the same ``key`` and
    ``cfg`` reuse the cached copy, so a function is not called again). Same frame and gather as :func:`crop_static`.
    """
    ck = ("crop_index", key, cfg)
    hit = raster.cache.get(ck)
    if hit is None:
        pad = 2 * _view_radius_px(cfg, raster.ppm)
        index = index() if callable(index) else index
        h, w = index.shape[-2:]
        buf = torch.full((h + 2 * pad, w + 2 * pad), -1, dtype=torch.int32, device=raster.device)
        buf[pad:pad + h, pad:pad + w] = index.to(device=raster.device, dtype=torch.int32)
        hit = raster.cache[ck] = (buf.view(-1), w + 2 * pad, pad)
    flat, wp, pad = hit
    hp = flat.numel() // wp
    b, n = ego_xy.shape[0], cfg.size
    out = torch.empty(b, n, n, dtype=torch.int32, device=ego_xy.device)
    step = b if ego_xy.device.type != "cpu" else max(1, _CPU_CROP_CHUNK_PIXELS // (n * n))
    col_r, col_c, row_r, row_c = _bev_affine_terms(raster.origin, raster.ppm, pad, hp, wp, ego_xy, ego_yaw, cfg)
    for s in range(0, b, step):
        e = min(b, s + step)
        mc = (col_r[s:e, :, None] + col_c[s:e, None, :]).to(torch.int32)
        mr = (row_r[s:e, :, None] + row_c[s:e, None, :]).to(torch.int32)
        out[s:e] = torch.index_select(flat, 0, torch.add(mc, mr, alpha=wp).view(-1)).view(e - s, n, n)
    return out


def box_fraction_on(raster: MapRaster, layer_ids: list[int], center: Tensor, yaw: Tensor, half_extent: Tensor,
                    samples: tuple[int, int] = (4, 8)) -> Tensor:
    """Fraction (float32 ``[B]``) of a regular grid of points inside each box that lie on any of ``layer_ids``.

    ``center`` ``[B, 2]``, ``yaw`` ``[B]``, ``half_extent`` ``[B, 2]`` (half length along the heading, half width),
    ``samples = (across the width, along the length)``; points sit at the centres of a regular grid of cells.
    Used for CaRL's off-road check (terminate when > 95 % of the ego box is off road and shoulder).
    """
    mask = _union_mask(raster, tuple(int(i) for i in layer_ids))
    dev = center.device
    nw, nl = samples
    u = (torch.arange(nl, device=dev, dtype=torch.float32) + 0.5) / nl * 2 - 1  # along length, [-1, 1]
    v = (torch.arange(nw, device=dev, dtype=torch.float32) + 0.5) / nw * 2 - 1  # across width
    hl, hw = half_extent[:, 0:1].float(), half_extent[:, 1:2].float()
    cos, sin = torch.cos(yaw).float()[:, None], torch.sin(yaw).float()[:, None]
    lu = (u[None] * hl)[:, :, None]  # [B, nl, 1]
    lv = (v[None] * hw)[:, None, :]  # [B, 1, nw]
    x = center[:, 0:1, None].float() + lu * cos[..., None] - lv * sin[..., None]
    y = center[:, 1:2, None].float() + lu * sin[..., None] + lv * cos[..., None]
    pm = float(raster.ppm)
    hp, wp = raster.height + 2, raster.width + 2
    mc = ((x - raster.origin[0]) * pm + 1.0).clamp_(0, wp - 1).to(torch.int64)
    mr = ((y - raster.origin[1]) * pm + 1.0).clamp_(0, hp - 1).to(torch.int64)
    on = mask[(mr * wp + mc).view(center.shape[0], -1)]
    return on.float().mean(-1)


# ---------------------------------------------------------------------------------------------------- dynamic objects
def world_to_bev(xy: Tensor, ego_xy: Tensor, ego_yaw: Tensor, cfg: BevConfig = BevConfig()) -> Tensor:
    """World points ``[B, N, 2]`` -> float BEV pixel coordinates ``(col, row)`` ``[B, N, 2]``."""
    cos, sin = torch.cos(ego_yaw)[:, None], torch.sin(ego_yaw)[:, None]
    d = xy - ego_xy[:, None, :]
    fwd = cos * d[..., 0] + sin * d[..., 1]
    left = -sin * d[..., 0] + cos * d[..., 1]
    return torch.stack((cfg.ego_col - left * cfg.ppm, cfg.ego_row - fwd * cfg.ppm), dim=-1)


def _flat_view(canvas: Tensor) -> tuple[Tensor, tuple[int, int, int]]:
    """A 1-D view over the storage spanned by ``canvas`` [B, H, W] (may be a channel slice of a [B, C, H, W]
    tensor), plus the element strides to address it."""
    if canvas.dim() != 3 or canvas.dtype != torch.uint8:
        raise ValueError(f"canvas must be uint8 [B, H, W], got {canvas.dtype} {tuple(canvas.shape)}")
    s = canvas.stride()
    span = sum((d - 1) * st for d, st in zip(canvas.shape, s)) + 1
    return canvas.as_strided((span,), (1,), canvas.storage_offset()), (s[0], s[1], s[2])


def _value_tensor(value: Tensor | int, like: Tensor) -> Tensor:
    """``value`` as a uint8 tensor broadcastable to ``like`` [B, N]."""
    if not isinstance(value, Tensor):
        return torch.full((1, 1), int(value), dtype=torch.uint8, device=like.device)
    value = value.to(device=like.device, dtype=torch.uint8)
    return value.reshape(1, 1) if value.dim() == 0 else value


COMPACT_DEVICES = ("cpu",)  # device types that draw only the valid objects (data-dependent shapes)


def _objects(valid: Tensor, row_stride: int, *xs: Tensor) -> tuple[Tensor, ...]:
    """The objects of ``valid`` [B, N] flattened to one axis: (the canvas offset of each object's row [M], whether it
    is drawn [M], then each ``x`` [B, N, ...] (or broadcastable to it) as [M, ...]). On CPU only the valid objects
    (a data-dependent ``M``: one host sync, free there); elsewhere all ``B * N``, the invalid ones drawing nothing."""
    B, N = valid.shape
    if valid.device.type in COMPACT_DEVICES:
        b, n = valid.nonzero(as_tuple=True)
        xs = tuple(x.expand(B, N, *x.shape[2:])[b, n] for x in xs)
        return (b * row_stride, torch.ones_like(b, dtype=torch.bool), *xs)
    b = torch.arange(B, device=valid.device).repeat_interleave(N) * row_stride
    return (b, valid.reshape(-1), *(x.expand(B, N, *x.shape[2:]).reshape(B * N, *x.shape[2:]) for x in xs))


# CPU cache blocking for the patch-based drawing: patch pixels per block.
_CPU_PATCH_CHUNK_PIXELS = 1 << 16


def _draw_px_boxes(canvas: Tensor, c_px: Tensor, axis: Tensor, hl_px: Tensor, hw_px: Tensor, value: Tensor | int,
                   valid: Tensor, radius_px: float) -> None:
    """Draw oriented boxes given in BEV pixel space.

    ``c_px`` ``[B, N, 2]`` centre (col, row); ``axis`` ``[B, N, 2]`` unit heading in pixel space; ``hl_px``/``hw_px``
    ``[B, N]`` half length/width in pixels; boxes are clipped to a patch of radius ``radius_px`` around the centre.
    """
    flat_canvas, (s0, s1, s2) = _flat_view(canvas)
    _, h, w = canvas.shape
    dev = canvas.device
    row_off, drawn, c_px, axis, hl_px, hw_px, val = _objects(valid, s0, c_px, axis, hl_px, hw_px,
                                                              _value_tensor(value, valid))
    r = int(math.ceil(radius_px))
    off = torch.arange(-r, r + 1, device=dev, dtype=torch.float32)  # [K]
    base = torch.round(c_px)  # [M, 2]
    pc = base[:, 0:1] + off  # [M, K] patch columns
    pr = base[:, 1:2] + off  # [M, K] patch rows
    dc = pc - c_px[:, 0:1]
    dr = pr - c_px[:, 1:2]
    ac, ar = axis[:, 0:1], axis[:, 1:2]
    # Coordinates are pre-scaled by the box's half sizes so the test is one max(|lx|, |ly|) <= 1 per pixel.
    # Pixels outside the canvas and boxes not drawn get a large offset folded into the separable row/col terms.
    far = 1e6
    inv_l = 1.0 / hl_px.clamp_min(1e-3)
    inv_w = 1.0 / hw_px.clamp_min(1e-3)
    pen_c = ((pc < 0) | (pc > w - 1)).float() * far
    pen_r = (((pr < 0) | (pr > h - 1)) | ~drawn[:, None]).float() * far
    # along-heading and lateral coordinates (in half sizes), separable in (row, col): [M, K] terms
    lx_r = dr * (ar * inv_l[:, None]) + pen_r
    lx_c = dc * (ac * inv_l[:, None]) + pen_c
    ly_r = dr * (ac * inv_w[:, None])
    ly_c = dc * (ar * inv_w[:, None])
    ir = pr.clamp(0, h - 1).to(torch.int64) * s1 + row_off[:, None]  # [M, K]
    ic = pc.clamp(0, w - 1).to(torch.int64) * s2
    val = val[:, None, None]
    n_obj = len(val)
    # CPU: blocks of boxes small enough for the [m, K, K] temporaries to stay in cache (measured up to ~2x faster
    # than one pass when other processes compete for memory bandwidth); CUDA: one block.
    step = max(1, n_obj) if dev.type != "cpu" else max(1, _CPU_PATCH_CHUNK_PIXELS // (2 * r + 1) ** 2)
    for s in range(0, n_obj, step):
        e = min(n_obj, s + step)
        lx = lx_r[s:e, :, None] + lx_c[s:e, None, :]  # [m, K(row), K(col)]
        ly = ly_r[s:e, :, None] - ly_c[s:e, None, :]
        inside = torch.maximum(lx.abs_(), ly.abs_()) <= 1.0
        flat = ir[s:e, :, None] + ic[s:e, None, :]
        # bool -> uint8 view times the value: much faster on CPU than a broadcasting torch.where on uint8
        vals = inside.view(torch.uint8) * val[s:e]
        flat_canvas.scatter_reduce_(0, flat.view(-1), vals.view(-1), "amax")


def draw_boxes(canvas: Tensor, center: Tensor, yaw: Tensor, half_extent: Tensor, value: Tensor | int,
               valid: Tensor, ego_xy: Tensor, ego_yaw: Tensor, cfg: BevConfig = BevConfig(),
               max_extent_m: float = 3.0) -> None:
    """Draw filled oriented boxes into ``canvas`` uint8 ``[B, H, W]`` in place (overlaps keep the max value).

    ``center`` ``[B, N, 2]`` and ``yaw`` ``[B, N]`` in the world frame; ``half_extent`` ``[B, N, 2]`` metres (half
    length along the heading, half width); ``value`` uint8 ``[B, N]`` or a scalar; ``valid`` bool ``[B, N]``. A pixel is
    drawn when its centre lies in the box. ``max_extent_m`` bounds the half extents (the patch covers the box's
    circumscribed circle ``sqrt(2) * max_extent_m``); parts of larger boxes beyond it are clipped. ``canvas`` may be a
    channel slice ``obs[:, k]`` of a contiguous ``[B, C, H, W]`` tensor.
    """
    c_px = world_to_bev(center.float(), ego_xy.float(), ego_yaw.float(), cfg)
    rel = yaw.float() - ego_yaw.float()[:, None]
    # heading in pixel space: forward is -row, left is -col
    axis = torch.stack((-torch.sin(rel), -torch.cos(rel)), dim=-1)
    he = half_extent.float() * cfg.ppm
    draw_px = max(max_extent_m * cfg.ppm * math.sqrt(2.0), 0.5)
    _draw_px_boxes(canvas, c_px, axis, he[..., 0], he[..., 1], value, valid, draw_px)


def draw_segments(canvas: Tensor, p0: Tensor, p1: Tensor, thickness_m: float, value: Tensor | int, valid: Tensor,
                  ego_xy: Tensor, ego_yaw: Tensor, cfg: BevConfig = BevConfig(), max_length_m: float = 10.0) -> None:
    """Draw thick line segments ``p0 -> p1`` (world ``[B, N, 2]``) into ``canvas`` uint8 ``[B, H, W]`` in place.

    Lines are at least 1 px wide. Each segment is sampled on a fixed grid in its own frame (every half pixel along
    it, and every half pixel across its thickness) and every pixel containing a sample is drawn: unlike a square
    patch per segment, the cost grows only linearly with ``max_length_m`` (speed lines reach 36 m). Segments longer
    than ``max_length_m`` are clipped symmetrically around their midpoint.
    """
    flat_canvas, (s0, s1, s2) = _flat_view(canvas)
    _, h, w = canvas.shape
    dev = canvas.device
    row_off, drawn, a, b, val = _objects(valid, s0, world_to_bev(p0.float(), ego_xy.float(), ego_yaw.float(), cfg),
                                         world_to_bev(p1.float(), ego_xy.float(), ego_yaw.float(), cfg),
                                         _value_tensor(value, valid))
    d = b - a
    length = d.norm(dim=-1, keepdim=True)
    axis = d / length.clamp_min(1e-6)  # zero-length segments draw a single dot
    max_px = max(max_length_m * cfg.ppm, 0.0)
    eff = length.clamp(max=max_px)
    start = 0.5 * (a + b) - 0.5 * eff * axis  # [M, 2]
    n_along = int(math.ceil(max_px / 0.5)) + 1
    half = max(0.5 * thickness_m * cfg.ppm, 0.5) - 0.5  # lateral reach of the sample centres
    n_across = int(math.ceil(2 * half / 0.5)) + 1
    t = torch.linspace(0.0, 1.0, n_along, device=dev)  # [A]
    lat = torch.linspace(-half, half, n_across, device=dev)  # [T]
    reach = eff * axis  # [M, 2] the (clipped) segment vector
    coords = []
    for k, limit in ((0, w - 1), (1, h - 1)):
        # sample centre + 0.5, so floor() rounds to the nearest pixel; separable in (along, across)
        along = torch.addcmul((start[..., k] + 0.5)[..., None], reach[..., k][..., None], t)  # [M, A]
        if n_across > 1:
            normal_k = axis[..., 1 - k] * (-1.0 if k == 0 else 1.0)
            along = along[..., :, None] + (normal_k[..., None] * lat)[..., None, :]  # [M, A, T]
        raw = along.floor_()
        clamped = raw.clamp(0, limit)
        coords.append((clamped, clamped == raw))
    (col, col_ok), (row, row_ok) = coords
    plane = (row * s1 + col * s2).to(torch.int64)  # exact: in-plane offsets are far below 2**24
    flat = plane + row_off.view(-1, *([1] * (plane.dim() - 1)))
    val = (val * drawn.view(torch.uint8)).view(-1, *([1] * (plane.dim() - 1)))
    vals = (col_ok & row_ok).view(torch.uint8) * val
    flat_canvas.scatter_reduce_(0, flat.view(-1), vals.view(-1), "amax")


def draw_discs(canvas: Tensor, center: Tensor, radius_px: int, value: Tensor | int, valid: Tensor,
               ego_xy: Tensor, ego_yaw: Tensor, cfg: BevConfig = BevConfig()) -> None:
    """Draw filled discs of ``radius_px`` pixels centred on the pixel nearest each world point ``[B, N, 2]``.

    A pixel at integer offset ``(dx, dy)`` is in the disc when ``dx^2 + dy^2 <= r^2 + r`` (a round, symmetric disc
    similar to OpenCV's filled circles).
    """
    flat_canvas, (s0, s1, s2) = _flat_view(canvas)
    _, h, w = canvas.shape
    dev = canvas.device
    r = int(radius_px)
    off = torch.arange(-r, r + 1, device=dev, dtype=torch.int64)
    disc = (off[:, None] ** 2 + off[None, :] ** 2) <= r * r + r  # [K, K]
    row_off, drawn, centre_px, val = _objects(valid, s0, world_to_bev(center.float(), ego_xy.float(), ego_yaw.float(),
                                                                      cfg), _value_tensor(value, valid))
    base = torch.round(centre_px).to(torch.int64)
    pc = base[:, 0:1] + off  # [M, K]
    pr = base[:, 1:2] + off
    in_r = ((pr >= 0) & (pr < h) & drawn[:, None]).view(torch.uint8)
    in_c = ((pc >= 0) & (pc < w)).view(torch.uint8)
    inside = (in_r[:, :, None] * in_c[:, None, :]) * disc.view(torch.uint8)
    flat = (pr.clamp(0, h - 1) * s1 + row_off[:, None])[:, :, None] + (pc.clamp(0, w - 1) * s2)[:, None, :]
    vals = inside * val[:, None, None]
    flat_canvas.scatter_reduce_(0, flat.view(-1), vals.view(-1), "amax")

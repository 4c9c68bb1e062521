"""Several maps in one world: every map moves to its own place of a shared frame.

The batched step then needs no map index at all: a position names its map, lane and segment indices are global, and
the raster lookups (off-road, lane under a point, BEV crops) read one atlas raster. Maps sit at least ``gap_m`` apart,
a distance chosen wider than anything the simulator looks at (the BEV's reach), so no map is ever seen from another.

Each map keeps its own cached raster (:func:`~envs.maps.rasterize.load_or_compile_raster`); the atlas pastes them into
one array at pixel-aligned places found by a rectangle packer (``rectpack``'s MaxRects), so building an atlas costs a
copy, not a rasterisation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import rectpack
import torch

from envs.maps.lanegraph import LaneGraph, MapError
from envs.maps.rasterize import MapRaster

ALIGN_PX = 16  # places are multiples of this many pixels, so max-pooled BEV sources stay aligned with the map's own


@dataclass
class Atlas:
    """The combined world and where each map went."""

    graph: LaneGraph
    raster: MapRaster
    shifts: np.ndarray  # [M, 2] metres added to map k's coordinates
    lane_offsets: np.ndarray  # [M + 1] map k owns lanes lane_offsets[k]:lane_offsets[k + 1]


def pack(sizes: list[tuple[int, int]], gap: int) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """Pixel corners (col, row) for rectangles ``(width, height)`` at least ``gap`` apart, and the atlas (W, H).

    Tries a range of strip widths and keeps the smallest total area (MaxRects, best short side fit, no rotation).
    """
    boxes = [(-(-(w + gap) // ALIGN_PX) * ALIGN_PX, -(-(h + gap) // ALIGN_PX) * ALIGN_PX) for w, h in sizes]
    total = sum(w * h for w, h in boxes)
    widest = max(w for w, _ in boxes)
    best = None
    for width in sorted({max(widest, int(math.sqrt(total) * f) // ALIGN_PX * ALIGN_PX)
                         for f in np.linspace(0.8, 2.5, 18)}):
        packer = rectpack.newPacker(rotation=False, pack_algo=rectpack.MaxRectsBssf)
        for k, (w, h) in enumerate(boxes):
            packer.add_rect(w, h, rid=k)
        packer.add_bin(width, sum(h for _, h in boxes))
        packer.pack()
        rects = packer.rect_list()
        if len(rects) < len(boxes):
            continue
        corners = [(0, 0)] * len(boxes)
        for _, x, y, _, _, rid in rects:
            corners[rid] = (x + gap // 2, y + gap // 2)
        size = (max(x + w for _, x, _, w, _, _ in rects), max(y + h for _, _, y, _, h, _ in rects))
        if best is None or size[0] * size[1] < best[1][0] * best[1][1]:
            best = (corners, size)
    assert best is not None  # the widest strip always fits every box (bin height = sum of heights)
    return best


def build_atlas(graphs: list[LaneGraph], rasters: list[MapRaster], gap_m: float) -> Atlas:
    """Place ``graphs`` (with their rasters, all at one resolution) apart in one frame; one map stays as it is."""
    if len(graphs) != len(rasters) or not graphs:
        raise MapError(f"atlas: {len(graphs)} maps and {len(rasters)} rasters; give one raster per map")
    ppm = rasters[0].ppm
    if any(abs(r.ppm - ppm) > 1e-9 for r in rasters):
        raise MapError(f"atlas: rasters at {[r.ppm for r in rasters]} px/m; compile every map at one env.map_ppm")
    lane_offsets = np.cumsum([0] + [g.num_lanes for g in graphs])
    if len(graphs) == 1:
        return Atlas(graphs[0], rasters[0], np.zeros((1, 2)), lane_offsets)
    gap = int(math.ceil(gap_m * ppm))
    corners, (width, height) = pack([(r.width, r.height) for r in rasters], gap)
    layers = torch.zeros(rasters[0].layers.shape[0], height, width, dtype=torch.uint8)
    seg_id = torch.full((height, width), -1, dtype=torch.int32)
    point_base = 0
    shifts = np.zeros((len(graphs), 2))
    for k, ((col, row), r, g) in enumerate(zip(corners, rasters, graphs)):
        layers[:, row:row + r.height, col:col + r.width] = r.layers.cpu()
        ids = r.seg_id.cpu()
        seg_id[row:row + r.height, col:col + r.width] = torch.where(ids >= 0, ids + point_base, ids)
        point_base += len(g.points)
        # raster pixel (0, 0) of map k lands on atlas pixel (col, row); the atlas origin is (0, 0)
        shifts[k] = (col / ppm - r.origin[0], row / ppm - r.origin[1])
    graph = LaneGraph.concatenate("+".join(g.name for g in graphs),
                                  [g.translated(tuple(s)) for g, s in zip(graphs, shifts)])
    return Atlas(graph, MapRaster((0.0, 0.0), ppm, layers, seg_id), shifts, lane_offsets)

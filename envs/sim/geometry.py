"""Batched 2-D geometry used by dynamics, agents and infraction checks (pure tensor functions)."""
from __future__ import annotations

import math

import torch
from torch import Tensor


def true_first(mask: Tensor) -> Tensor:
    """Per row of ``mask`` [B, N], the indices of its True entries first (in order), cut to the most any row has
    ([B, K], K possibly 0; one host sync): gathering by them keeps every True entry in K columns instead of N."""
    k = int(mask.sum(1).max()) if mask.numel() else 0
    return mask.byte().sort(dim=1, descending=True, stable=True).indices[:, :k]


def wrap_angle(a: Tensor) -> Tensor:
    """Wrap to [-pi, pi)."""
    return torch.remainder(a + math.pi, 2 * math.pi) - math.pi


def rotate(xy: Tensor, yaw: Tensor) -> Tensor:
    """Rotate vectors ``xy[..., 2]`` by ``yaw[...]`` (counter-clockwise)."""
    c, s = torch.cos(yaw), torch.sin(yaw)
    return torch.stack((c * xy[..., 0] - s * xy[..., 1], s * xy[..., 0] + c * xy[..., 1]), dim=-1)


def to_local(xy: Tensor, origin: Tensor, yaw: Tensor) -> Tensor:
    """Express world points ``xy`` in the frame at ``origin`` with heading ``yaw`` (broadcasting)."""
    return rotate(xy - origin, -yaw)


def polyline_pose(points: Tensor, row: Tensor, f: Tensor, last: Tensor | int) -> tuple[Tensor, Tensor]:
    """Position and heading at fractional point index ``f`` on polyline ``row`` of ``points`` [R, P, 2] (rows padded
    to P), interpolated on its segments 0..``last`` (per row, or one for all; past them: along the last one)."""
    P = points.shape[1]
    flat = points.reshape(-1, 2)
    i = f.clamp(min=0.0).floor().long()
    i = torch.minimum(i, last) if isinstance(last, Tensor) else i.clamp(max=last)
    t = (f - i).clamp(0.0, 1.0).unsqueeze(-1)
    base = row * P + i
    p0, p1 = flat[base], flat[base + 1]
    d = p1 - p0
    return p0 + d * t, torch.atan2(d[..., 1], d[..., 0])


def box_corners(center: Tensor, yaw: Tensor, half_extent: Tensor) -> Tensor:
    """Corners [..., 4, 2] of oriented boxes (half_extent = (half length, half width)), counter-clockwise."""
    signs = center.new_tensor([[1.0, 1.0], [-1.0, 1.0], [-1.0, -1.0], [1.0, -1.0]])
    local = signs * half_extent.unsqueeze(-2)
    return rotate(local, yaw.unsqueeze(-1)) + center.unsqueeze(-2)


def boxes_overlap(c1: Tensor, yaw1: Tensor, he1: Tensor, c2: Tensor, yaw2: Tensor, he2: Tensor) -> Tensor:
    """Separating-axis test for oriented boxes; all arguments broadcast against each other.

    Returns a bool tensor: True where the boxes intersect (touching counts).
    """
    cos1, sin1, cos2, sin2 = torch.cos(yaw1), torch.sin(yaw1), torch.cos(yaw2), torch.sin(yaw2)
    dx, dy = c2[..., 0] - c1[..., 0], c2[..., 1] - c1[..., 1]
    l1, w1, l2, w2 = he1[..., 0], he1[..., 1], he2[..., 0], he2[..., 1]
    # |cos| and |sin| of the relative heading give every projected half-width in closed form
    c = (cos1 * cos2 + sin1 * sin2).abs()
    s = (sin2 * cos1 - cos2 * sin1).abs()
    dx1 = (dx * cos1 + dy * sin1).abs()  # centre offset on box 1's axes
    dy1 = (dy * cos1 - dx * sin1).abs()
    dx2 = (dx * cos2 + dy * sin2).abs()  # on box 2's axes
    dy2 = (dy * cos2 - dx * sin2).abs()
    return ((dx1 <= l1 + l2 * c + w2 * s) & (dy1 <= w1 + l2 * s + w2 * c)
            & (dx2 <= l2 + l1 * c + w1 * s) & (dy2 <= w2 + l1 * s + w1 * c))


def boxes_overlap_moving(c1: Tensor, yaw1: Tensor, he1: Tensor, v1: Tensor, c2: Tensor, yaw2: Tensor, he2: Tensor,
                         v2: Tensor, times: Tensor) -> Tensor:
    """:func:`boxes_overlap` of boxes moving at constant velocities ``v1``/``v2`` [..., 2] (headings fixed), at each
    of ``times`` [T]: bool [..., T].

    The headings do not change, so the separating axes and the projected half-widths are computed once; only the
    centre offset moves, linearly in t, on each axis.
    """
    cos1, sin1, cos2, sin2 = torch.cos(yaw1), torch.sin(yaw1), torch.cos(yaw2), torch.sin(yaw2)
    dx, dy = c2[..., 0] - c1[..., 0], c2[..., 1] - c1[..., 1]
    vx, vy = v2[..., 0] - v1[..., 0], v2[..., 1] - v1[..., 1]
    l1, w1, l2, w2 = he1[..., 0], he1[..., 1], he2[..., 0], he2[..., 1]
    c = (cos1 * cos2 + sin1 * sin2).abs()
    s = (sin2 * cos1 - cos2 * sin1).abs()
    inside = None
    for ax, ay, reach in ((cos1, sin1, l1 + l2 * c + w2 * s), (-sin1, cos1, w1 + l2 * s + w2 * c),
                          (cos2, sin2, l2 + l1 * c + w1 * s), (-sin2, cos2, w2 + l1 * s + w1 * c)):
        p0 = (dx * ax + dy * ay).unsqueeze(-1)
        p1 = (vx * ax + vy * ay).unsqueeze(-1)
        ok = torch.addcmul(p0, p1, times).abs_() <= reach.unsqueeze(-1)
        inside = ok if inside is None else inside & ok
    return inside


def points_in_polygons(points: Tensor, edges: Tensor, edge_polygon: Tensor, num_polygons: int) -> Tensor:
    """Whether each point lies inside any of a set of polygons (holes allowed), batched: ``points`` [B, K, 2],
    ``edges`` [B, E, 4] (x1, y1, x2, y2 of every ring edge; padding edges with y1 == y2 never count),
    ``edge_polygon`` [B, E] (the polygon each edge belongs to) -> [B, K] bool. Even-odd crossings per polygon, so
    overlapping polygons and their holes are each judged on their own."""
    px, py = points[..., 0].unsqueeze(-1), points[..., 1].unsqueeze(-1)  # [B, K, 1]
    x1, y1, x2, y2 = (edges[..., i].unsqueeze(1) for i in range(4))  # [B, 1, E]
    spans = (y1 > py) != (y2 > py)
    x_at = x1 + (py - y1) * (x2 - x1) / torch.where(y2 == y1, torch.ones_like(y2), y2 - y1)
    cross = (spans & (px < x_at)).to(torch.int32)  # [B, K, E]
    per_polygon = torch.zeros(*cross.shape[:2], num_polygons, dtype=torch.int32, device=points.device)
    per_polygon.scatter_add_(2, edge_polygon.unsqueeze(1).expand_as(cross), cross)
    return (per_polygon % 2 == 1).any(-1)

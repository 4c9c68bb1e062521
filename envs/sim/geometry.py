"""Batched 2-D geometry used by dynamics, agents and infraction checks (pure tensor functions)."""
from __future__ import annotations

import math

import torch
from torch import Tensor


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


def box_corners(center: Tensor, yaw: Tensor, half_extent: Tensor) -> Tensor:
    """Corners [..., 4, 2] of oriented boxes (half_extent = (half length, half width)), counter-clockwise."""
    signs = center.new_tensor([[1.0, 1.0], [-1.0, 1.0], [-1.0, -1.0], [1.0, -1.0]])
    local = signs * half_extent.unsqueeze(-2)
    return rotate(local, yaw.unsqueeze(-1)) + center.unsqueeze(-2)


def boxes_overlap(c1: Tensor, yaw1: Tensor, he1: Tensor, c2: Tensor, yaw2: Tensor, he2: Tensor) -> Tensor:
    """Separating-axis test for oriented boxes; all arguments broadcast against each other.

    Returns a bool tensor: True where the boxes intersect (touching counts).
    """
    d = c2 - c1
    axes1 = torch.stack((torch.cos(yaw1), torch.sin(yaw1)), -1)
    axes1n = torch.stack((-torch.sin(yaw1), torch.cos(yaw1)), -1)
    axes2 = torch.stack((torch.cos(yaw2), torch.sin(yaw2)), -1)
    axes2n = torch.stack((-torch.sin(yaw2), torch.cos(yaw2)), -1)
    separated = torch.zeros(torch.broadcast_shapes(d.shape[:-1], yaw1.shape, yaw2.shape), dtype=torch.bool,
                            device=d.device)
    u1 = (axes1 * he1[..., :1], axes1n * he1[..., 1:])
    u2 = (axes2 * he2[..., :1], axes2n * he2[..., 1:])
    for axis in (axes1, axes1n, axes2, axes2n):
        r1 = (u1[0] * axis).sum(-1).abs() + (u1[1] * axis).sum(-1).abs()
        r2 = (u2[0] * axis).sum(-1).abs() + (u2[1] * axis).sum(-1).abs()
        separated |= (d * axis).sum(-1).abs() > r1 + r2
    return ~separated


def point_in_quads(p: Tensor, quads: Tensor) -> Tensor:
    """Points ``p[..., 2]`` inside convex counter-clockwise quads ``quads[..., 4, 2]`` (broadcasting)."""
    a = quads
    b = torch.roll(quads, -1, dims=-2)
    e = b - a
    w = p.unsqueeze(-2) - a
    cross = e[..., 0] * w[..., 1] - e[..., 1] * w[..., 0]
    return (cross >= 0).all(-1)


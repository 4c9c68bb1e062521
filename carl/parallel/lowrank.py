"""Per-layer PowerSGD (rank-r approximation with error feedback and warm start), the engine behind ``lgreco``.

For a layer's gradient matrix ``M`` (``n x m``: the gradient viewed as ``[shape[0], -1]``) plus its residual:
``P = M Q`` is all-reduced and orthonormalised, ``Q = M^T P`` is all-reduced and averaged, and ``P Q^T``
approximates the mean gradient. The residual ``M - P Q^T`` is carried to the next step (error feedback) and
``Q`` is reused as the next starting point (warm start). All ``P`` of a bucket travel in one all-reduce and all
``Q`` in another. Bytes per layer: ``4 r (n + m)`` instead of ``4 n m``.

``Q`` is initialised from a generator seeded with the layer name, so it is identical on every rank; afterwards
it is the result of an all-reduce, hence also identical.
"""
from __future__ import annotations

import math
import zlib

import torch

from carl.parallel.accounting import SyncStats
from carl.parallel.layerwise import LayerwiseReducer, NamedGrads


def as_matrix(grad: torch.Tensor) -> torch.Tensor:
    """The most square ``[prod(shape[:k]), prod(shape[k:])]`` view (fewest values at a given rank).

    Conv weights ``[out, in, kh, kw]`` become ``[out, in kh kw]``; CaRL's LayerNorm affine parameters
    ``[C, H, W]`` become ``[C H, W]`` (torch's PowerSGD hook uses ``[C, H W]``, which it leaves uncompressed).
    """
    if grad.dim() <= 2:
        return grad.view(grad.shape[0], -1)
    shape = list(grad.shape)
    best = min(range(1, len(shape)), key=lambda k: math.prod(shape[:k]) + math.prod(shape[k:]))
    return grad.view(math.prod(shape[:best]), -1)


def worth_compressing(n: int, m: int, rank: int, min_rate: float = 2.0) -> bool:
    """torch's PowerSGD rule: compress when ``n m > min_rate * r (n + m)``."""
    return n * m > min_rate * min(n, m, rank) * (n + m)


class LowRankReducer(LayerwiseReducer):
    """PowerSGD per layer; ``plan`` maps a layer name to its rank (default: the uniform ``rank``)."""

    def __init__(self, stats: SyncStats, rank: int = 4, start_step: int = 2, seed: int = 0,
                 min_compression_rate: float = 2.0) -> None:
        super().__init__(stats, start_step)
        if rank < 1:
            raise ValueError(f"PowerSGD rank {rank} must be >= 1")
        self.rank, self.seed, self.min_rate = rank, seed, min_compression_rate
        self.plan: dict[str, int] = {}
        self.q: dict[str, torch.Tensor] = {}
        self.error: dict[str, torch.Tensor] = {}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "q": dict(self.q), "plan": dict(self.plan)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.q, self.plan = dict(state.get("q", {})), dict(state.get("plan", {}))

    def rank_state_dict(self) -> dict:
        return {"error": dict(self.error)}

    def load_rank_state_dict(self, state: dict) -> None:
        self.error = dict(state.get("error", {}))

    def compressible(self, name: str, grad: torch.Tensor) -> bool:
        if grad.dim() < 2:
            return False
        n, m = as_matrix(grad).shape
        return worth_compressing(n, m, self.rank, self.min_rate)

    def rank_of(self, name: str, n: int, m: int) -> int:
        return max(1, min(n, m, self.plan.get(name, self.rank)))

    def _initial_q(self, name: str, m: int, r: int, device: torch.device) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed + zlib.crc32(name.encode()))
        return torch.randn(m, r, generator=gen).to(device)

    def observe(self, name: str, matrix: torch.Tensor) -> None:
        """Hook for subclasses: the layer's matrix (gradient + residual) before compression."""

    def reduce_compressed(self, items: NamedGrads) -> int:
        world = self.world_size
        mats, qs = [], []
        for name, g in items:
            mat = as_matrix(g).float()
            if name in self.error:
                mat = mat + self.error[name]
            n, m = mat.shape
            r = self.rank_of(name, n, m)
            q = self.q.get(name)
            if q is None or q.shape != (m, r):
                q = self._initial_q(name, m, r, mat.device)
            self.observe(name, mat)
            mats.append(mat)
            qs.append(q)
        ps = [mat @ q for mat, q in zip(mats, qs)]
        flat_p = self.all_reduce(torch.cat([p.reshape(-1) for p in ps]))
        ps = [torch.linalg.qr(p, mode="reduced").Q for p in _split(flat_p, [p.shape for p in ps])]
        new_qs = [mat.T @ p for mat, p in zip(mats, ps)]
        flat_q = self.all_reduce(torch.cat([q.reshape(-1) for q in new_qs])).div_(world)
        new_qs = _split(flat_q, [q.shape for q in new_qs])
        for (name, g), mat, p, q in zip(items, mats, ps, new_qs):
            approx = p @ q.T
            self.error[name] = mat - approx
            self.q[name] = q
            as_matrix(g).copy_(approx)
        return (flat_p.numel() + flat_q.numel()) * 4


def _split(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = shape[0] * shape[1]
        out.append(flat[offset : offset + n].view(shape))
        offset += n
    return out

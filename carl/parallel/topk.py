"""``topk``: per-layer top-k sparsification with error feedback.

Each rank adds its residual to the gradient, keeps the ``ratio * numel`` entries of largest magnitude, and
all-gathers (value, index) pairs; every rank sums the sparse contributions and divides by the world size. The
entries not sent stay in the residual, so over many steps every coordinate of the gradient sum is applied
(error feedback): ``sum_t applied_t + mean_ranks(residual_T) = sum_t mean_ranks(grad_t)``.

Bytes per rank are ``k * 8`` per layer (fp32 value + int32 index); unlike an all-reduce, the all-gather's
received volume grows with the world size.
"""
from __future__ import annotations

import math

import torch

from carl.parallel.accounting import SyncStats
from carl.parallel.layerwise import LayerwiseReducer, NamedGrads


class TopKReducer(LayerwiseReducer):
    """Top-k of every layer with at least ``min_numel`` entries; smaller tensors are all-reduced densely."""

    def __init__(self, stats: SyncStats, ratio: float = 0.01, start_step: int = 2, min_numel: int = 256) -> None:
        super().__init__(stats, start_step)
        if not 0.0 < ratio < 1.0:
            raise ValueError(f"parallel.topk_ratio={ratio} must be in (0, 1), e.g. 0.01")
        self.ratio, self.min_numel = ratio, min_numel
        self.error: dict[str, torch.Tensor] = {}

    def rank_state_dict(self) -> dict:
        return {"error": dict(self.error)}

    def load_rank_state_dict(self, state: dict) -> None:
        self.error = dict(state.get("error", {}))

    def k_for(self, numel: int) -> int:
        return max(1, math.ceil(self.ratio * numel))

    def compressible(self, name: str, grad: torch.Tensor) -> bool:
        return grad.numel() >= self.min_numel and self.k_for(grad.numel()) * 2 < grad.numel()

    def reduce_compressed(self, items: NamedGrads) -> int:
        values, indices, ks = [], [], []
        for name, g in items:
            m = g.reshape(-1).float()
            if name in self.error:
                m = m + self.error[name]
            k = self.k_for(m.numel())
            idx = m.abs().topk(k, sorted=False).indices
            values.append(m[idx])
            indices.append(idx.to(torch.int32))
            residual = m.clone()
            residual[idx] = 0.0
            self.error[name] = residual
            ks.append(k)
        flat_v, flat_i = torch.cat(values), torch.cat(indices)
        all_v, all_i = self.all_gather(flat_v), self.all_gather(flat_i)
        world = len(all_v)
        for (_name, g), start, k in zip(items, _offsets(ks), ks):
            out = torch.zeros(g.numel(), dtype=torch.float32, device=g.device)
            for v, i in zip(all_v, all_i):
                out.index_add_(0, i[start : start + k].long(), v[start : start + k])
            g.copy_(out.div_(world).view_as(g))
        return flat_v.numel() * flat_v.element_size() + flat_i.numel() * flat_i.element_size()


def _offsets(sizes: list[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out

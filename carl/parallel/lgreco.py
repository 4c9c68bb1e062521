"""``lgreco``: layer-wise PowerSGD ranks chosen by L-GreCo's dynamic program.

Every ``every`` steps (after a window of ``acc_steps`` steps in which rank 0 averages each compressible layer's
matrix ``A_l``), rank 0 computes for every layer and every candidate rank ``r`` in
``[floor(min_factor r0), ceil(max_factor r0)]`` the exact approximation error ``e_l(r) = sqrt(sum_{i>r} s_i^2)``
(singular values of ``A_l``) and the size ``s_l(r) = r (n_l + m_l)``. It then picks one rank per layer to
minimise the total size subject to ``sum_l e_l(r_l) <= alpha * sum_l e_l(r0)`` (the uniform rank's error), a
multiple-choice knapsack solved by :func:`plan_ranks`, and broadcasts the plan. Layers whose rank changes
restart their warm-start ``Q``; residuals are kept. Until the first plan every layer uses ``r0``.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from carl.parallel.accounting import SyncStats
from carl.parallel.lowrank import LowRankReducer


def plan_ranks(errors: Sequence[Sequence[float]], sizes: Sequence[Sequence[float]], budget: float,
               bins: int = 10_000, fallback: Sequence[int] | None = None) -> list[int]:
    """Multiple-choice knapsack: one candidate per layer, minimal total size, total error within ``budget``.

    ``errors[l][j]`` and ``sizes[l][j]`` describe candidate ``j`` of layer ``l``. Errors are discretised into
    ``bins`` buckets of width ``budget / bins``, rounded up, so every plan the DP accepts truly meets the budget
    (exactly optimal when errors lie on the grid, otherwise optimal up to one bucket per layer). Rounding can
    reject a plan that meets the budget exactly, e.g. the uniform rank that defines it: ``fallback`` (candidate
    indices) is returned when it is smaller than the DP's plan or the DP finds none. Time ``O(L K bins)``.
    Returns the chosen candidate index per layer.
    """
    n_layers = len(errors)
    if n_layers == 0:
        return []

    def total_size(picks: Sequence[int]) -> float:
        return float(sum(sizes[layer][j] for layer, j in enumerate(picks)))

    if budget <= 0:  # only zero-error candidates fit
        picks = []
        for e, s in zip(errors, sizes):
            ok = [j for j in range(len(e)) if e[j] <= 0]
            if not ok:
                if fallback is not None:
                    return list(fallback)
                raise ValueError("no plan meets a zero error budget")
            picks.append(min(ok, key=lambda j: s[j]))
        return picks
    width = budget / bins

    def cost(e: float) -> int:
        return int(math.ceil(e / width - 1e-9))

    inf = float("inf")
    dp = np.full(bins + 1, inf)  # dp[b]: least total size of the layers so far with discretised error exactly b
    dp[0] = 0.0
    choice = np.zeros((n_layers, bins + 1), dtype=np.int64)
    for layer, (errs, szs) in enumerate(zip(errors, sizes)):
        new = np.full(bins + 1, inf)
        pick = np.zeros(bins + 1, dtype=np.int64)
        for j, (e, s) in enumerate(zip(errs, szs)):
            c = cost(e)
            if c > bins:
                continue
            cand = np.full(bins + 1, inf)
            cand[c:] = dp[: bins + 1 - c] + s
            better = cand < new
            new[better] = cand[better]
            pick[better] = j
        dp, choice[layer] = new, pick
    end = int(np.argmin(dp))
    if not math.isfinite(dp[end]):
        if fallback is not None:
            return list(fallback)
        raise ValueError("no plan meets the error budget")
    picks = [0] * n_layers
    for layer in range(n_layers - 1, -1, -1):
        j = int(choice[layer, end])
        picks[layer] = j
        end -= cost(errors[layer][j])
    if fallback is not None and total_size(fallback) < total_size(picks):
        return list(fallback)
    return picks


def candidate_ranks(r0: int, n: int, m: int, min_factor: float = 0.5, max_factor: float = 2.0) -> list[int]:
    lo = max(1, math.floor(min_factor * r0))
    hi = min(n, m, max(lo, math.ceil(max_factor * r0)))
    return list(range(lo, hi + 1)) or [min(n, m, r0)]


def rank_errors(matrix: torch.Tensor, ranks: Sequence[int]) -> list[float]:
    """Exact Frobenius error of the best rank-``r`` approximation, for every ``r`` in ``ranks``."""
    s2 = torch.linalg.svdvals(matrix.double()).pow(2)
    tail = torch.flip(torch.cumsum(torch.flip(s2, [0]), 0), [0])  # tail[i] = sum_{k >= i} s_k^2
    tail = torch.cat([tail, tail.new_zeros(1)])
    return [float(tail[min(r, s2.numel())].sqrt()) for r in ranks]


class LGreCoReducer(LowRankReducer):
    """:class:`LowRankReducer` whose per-layer ranks are re-planned every ``every`` steps."""

    def __init__(self, stats: SyncStats, rank: int = 4, every: int = 100, acc_steps: int = 10, alpha: float = 1.0,
                 min_factor: float = 0.5, max_factor: float = 2.0, start_step: int = 2, bins: int = 10_000) -> None:
        super().__init__(stats, rank, start_step)
        if every < 1:
            raise ValueError(f"parallel.lgreco_every={every} must be >= 1")
        self.every, self.acc_steps = every, max(1, min(acc_steps, every))
        self.alpha, self.min_factor, self.max_factor, self.bins = alpha, min_factor, max_factor, bins
        self.acc: dict[str, torch.Tensor] = {}
        self.replans = 0
        self.last_plan_bytes: tuple[int, int] = (0, 0)  # (planned, uniform) elements per step

    def state_dict(self) -> dict:
        return {**super().state_dict(), "replans": self.replans}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.replans = int(state.get("replans", 0))

    def rank_state_dict(self) -> dict:
        return {**super().rank_state_dict(), "acc": dict(self.acc)}  # acc: the re-plan window (rank 0 only)

    def load_rank_state_dict(self, state: dict) -> None:
        super().load_rank_state_dict(state)
        self.acc = dict(state.get("acc", {}))

    @property
    def _phase(self) -> int:
        return (self.step - self.start_step) % self.every

    def _accumulating(self) -> bool:
        is_main = not dist.is_initialized() or dist.get_rank() == 0
        return is_main and self._phase >= self.every - self.acc_steps

    def observe(self, name: str, matrix: torch.Tensor) -> None:
        if self._accumulating():
            a = matrix.detach() / self.acc_steps
            self.acc[name] = self.acc[name] + a if name in self.acc else a.clone()

    def begin_step(self) -> None:
        if self.step > self.start_step and self._phase == 0:
            self.replan()

    def make_plan(self, matrices: dict[str, torch.Tensor]) -> dict[str, int]:
        """The rank per layer for the given accumulated matrices (rank 0 calls this)."""
        names = sorted(matrices)
        cands, errs, sizes, uniform = [], [], [], []
        for name in names:
            n, m = matrices[name].shape
            rs = candidate_ranks(self.rank, n, m, self.min_factor, self.max_factor)
            all_errs = rank_errors(matrices[name], [*rs, min(self.rank, n, m)])
            cands.append(rs)
            errs.append(all_errs[:-1])
            uniform.append(all_errs[-1])
            sizes.append([r * (n + m) for r in rs])
        ref = [rs.index(min(self.rank, *matrices[nm].shape)) for nm, rs in zip(names, cands)]
        picks = plan_ranks(errs, sizes, self.alpha * sum(uniform), self.bins, fallback=ref if self.alpha >= 1 else None)
        plan = {name: rs[j] for name, rs, j in zip(names, cands, picks)}
        self.last_plan_bytes = (
            sum(plan[nm] * sum(matrices[nm].shape) for nm in names),
            sum(min(self.rank, *matrices[nm].shape) * sum(matrices[nm].shape) for nm in names),
        )
        return plan

    def replan(self) -> None:
        plan = self.make_plan(self.acc) if self.acc else None
        if dist.is_initialized() and self.world_size > 1:  # over the reducer's group (global rank 0 is in it)
            box = [plan]
            dist.broadcast_object_list(box, src=0, group=self.group)
            plan = box[0]
        self.acc.clear()
        if not plan:
            return
        for name, r in plan.items():
            if self.plan.get(name, self.rank) != r:
                self.q.pop(name, None)  # restart the warm start at the new rank
        self.plan = plan
        self.replans += 1

"""``localsgd``: local steps with outer averaging overlapped with computation (CO2-style).

Every rank runs the inner optimiser (Adam) on its own gradients, without any gradient communication. Every
``local_steps`` optimiser steps an *outer step* happens:

1. the local progress since the last outer step, ``d_i = theta_i - anchor``, is all-reduced **asynchronously**
   (a separate process group, so it never interleaves with other collectives) and overlaps the next
   ``local_steps`` inner steps;
2. the all-reduce launched one outer step earlier is awaited: ``d = mean_i d_i`` (one round stale);
3. outer momentum with a staleness penalty: ``m <- beta m + d / penalty``; ``m`` is clipped to norm
   ``outer_clip`` (0 = off); ``anchor <- anchor + outer_lr * m``;
4. every rank restarts from ``anchor`` (identical on all ranks).

Each round's progress enters the anchor exactly once, one round late. :meth:`LocalSGDSync.flush` (end of every
PPO update) waits for the in-flight round and synchronously averages the rest, so rollouts, evaluations and
checkpoints see one model. Bytes per outer step: the fp32 parameters, i.e. ``1 / local_steps`` of the fp32
all-reduce per optimiser step.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector

from carl.parallel.base import SyncMethod
from carl.parallel.context import DistContext


class LocalSGDSync(SyncMethod):
    name = "localsgd"

    def __init__(self, policy: nn.Module, ctx: DistContext, local_steps: int = 8, outer_lr: float = 1.0,
                 outer_momentum: float = 0.0, staleness_penalty: float = 1.0, outer_clip: float = 0.0) -> None:
        super().__init__(policy, ctx)
        if local_steps < 1 or staleness_penalty <= 0 or outer_lr <= 0 or not 0 <= outer_momentum < 1 or outer_clip < 0:
            raise ValueError("localsgd needs local_steps >= 1, outer_lr > 0, 0 <= outer_momentum < 1, "
                             "staleness_penalty > 0, outer_clip >= 0")
        self.local_steps, self.outer_lr, self.beta = local_steps, outer_lr, outer_momentum
        self.penalty, self.clip = staleness_penalty, outer_clip
        self.params = [p for p in policy.parameters() if p.requires_grad]
        self.group = None
        if ctx.distributed:
            with ctx.guard("localsgd setup"):
                for p in self.params:  # start from rank 0's initialisation
                    dist.broadcast(p.data, src=0)
                self.group = dist.new_group(backend=ctx.backend)  # async rounds never interleave with other ops
        self.anchor = parameters_to_vector(self.params).detach().clone()
        self.momentum = torch.zeros_like(self.anchor)
        self.pending: tuple[dist.Work, torch.Tensor, float] | None = None
        self.since_outer = 0
        self.outer_steps = 0

    # -- outer update ------------------------------------------------------------------------------------------------
    def _launch(self, delta: torch.Tensor) -> tuple[dist.Work | None, torch.Tensor, float]:
        n = self.anchor.numel() * 4
        self.stats.add(n, 0)
        if not self.ctx.distributed:
            return None, delta, time.perf_counter()
        with self.ctx.guard("localsgd outer all-reduce"):
            return dist.all_reduce(delta, group=self.group, async_op=True), delta, time.perf_counter()

    def _wait(self, pending: tuple[dist.Work | None, torch.Tensor, float]) -> torch.Tensor:
        work, buf, _ = pending
        start = time.perf_counter()
        if work is not None:
            with self.ctx.guard("localsgd outer all-reduce"):
                work.wait()
        self.stats.add_time(time.perf_counter() - start)
        return buf / self.ctx.world_size

    def _apply(self, mean_delta: torch.Tensor) -> None:
        self.momentum.mul_(self.beta).add_(mean_delta / self.penalty)
        if self.clip > 0:
            norm = float(self.momentum.norm())
            if norm > self.clip:
                self.momentum.mul_(self.clip / norm)
        self.anchor.add_(self.momentum, alpha=self.outer_lr)
        self.outer_steps += 1

    def _reset_to_anchor(self) -> None:
        offset = 0
        with torch.no_grad():  # copy (vector_to_parameters would alias the parameters to the anchor)
            for p in self.params:
                p.copy_(self.anchor[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def outer_step(self) -> None:
        delta = parameters_to_vector(self.params).detach() - self.anchor
        launched = self._launch(delta)
        if self.pending is not None:
            self._apply(self._wait(self.pending))
        self.pending = launched
        self.since_outer = 0
        self._reset_to_anchor()

    # -- SyncMethod ------------------------------------------------------------------------------------------------
    def after_step(self) -> None:
        self.stats.step()
        self.stats.add(0, self.anchor.numel() * 4)  # what an fp32 all-reduce would have sent this step
        self.since_outer += 1
        if self.since_outer >= self.local_steps:
            self.outer_step()

    def flush(self) -> None:
        # the rest of this round is measured against the anchor it started from, before any update of the anchor
        rest = None
        if self.since_outer > 0:
            rest = self._launch(parameters_to_vector(self.params).detach() - self.anchor)
        if self.pending is not None:
            self._apply(self._wait(self.pending))
            self.pending = None
        if rest is not None:
            self._apply(self._wait(rest))
            self.since_outer = 0
        self._reset_to_anchor()

    def state_dict(self) -> dict:
        return {"momentum": self.momentum.clone(), "outer_steps": self.outer_steps}

    def load_state_dict(self, state: dict) -> None:
        if "momentum" in state:
            self.momentum.copy_(state["momentum"])
            self.outer_steps = int(state.get("outer_steps", 0))
        self.anchor = parameters_to_vector(self.params).detach().clone()

"""Per-layer gradient compression inside a DDP comm hook, with state keyed by parameter name.

DDP hands a hook one bucket at a time; ``bucket.parameters()`` are the module's own parameters and
``bucket.gradients()`` are views into ``bucket.buffer()`` in the same order, so writing a layer's averaged
gradient into its view writes the bucket. Buckets are rebuilt after the first iteration, hence all state (error
feedback, warm start, plans) is keyed by parameter *name*, never by bucket index.

All collectives run synchronously inside the hook and the hook returns an already-completed future: on gloo,
collectives chained from a future's callback run on gloo's thread and interleave differently on different
ranks (a "collective mismatch" abort or a hang). Each bucket costs a fixed, small number of collectives: one
for the uncompressed tensors and one or two for the compressed ones, whatever the number of layers.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from carl.parallel.accounting import SyncStats
from carl.parallel.base import tensors_to
from carl.parallel.context import DistContext
from carl.parallel.hierarchy import NodeGroups, node_groups
from carl.parallel.hooks import DDPSync

NamedGrads = list[tuple[str, torch.Tensor]]


class LayerwiseReducer:
    """Averages named gradients over the ranks in place; subclasses compress the layers they accept.

    ``reduce`` may be called with any partition of the model's gradients (one call per bucket); ``end_step``
    marks the end of an optimiser step. The first ``start_step`` steps are plain fp32 all-reduces.
    """

    def __init__(self, stats: SyncStats, start_step: int = 2, group: dist.ProcessGroup | None = None) -> None:
        self.stats, self.start_step, self.group = stats, start_step, group
        self.step = 0
        self._in_step = False

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if not (dist.is_initialized() and self.world_size > 1):
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor, group=self.group)
        return out

    # -- checkpoint state (tensors on CPU; see SyncMethod.state_dict / rank_state_dict) ------------------------------
    def state_dict(self) -> dict:
        """Identical on every rank: the step counter (subclasses add warm starts and plans)."""
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state.get("step", 0))

    def rank_state_dict(self) -> dict:
        """This rank's own state: error-feedback residuals (subclasses)."""
        return {}

    def load_rank_state_dict(self, state: dict) -> None:
        pass

    # -- to override -----------------------------------------------------------------------------------------------
    def compressible(self, name: str, grad: torch.Tensor) -> bool:
        return False

    def begin_step(self) -> None:
        """Called before the first ``reduce`` of a step (re-planning goes here)."""

    def reduce_compressed(self, items: NamedGrads) -> int:
        """Average ``items`` in place with compression; return the bytes this rank sent."""
        raise NotImplementedError

    # -- driver ----------------------------------------------------------------------------------------------------
    def reduce_dense(self, grads: list[torch.Tensor]) -> int:
        if not grads:
            return 0
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.all_reduce(flat).div_(self.world_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return flat.numel() * flat.element_size()

    def reduce(self, named: NamedGrads) -> None:
        if not self._in_step:
            self._in_step = True
            if self.step >= self.start_step:
                self.begin_step()
        fp32 = sum(g.numel() * 4 for _, g in named)
        if self.step < self.start_step:
            sent = self.reduce_dense([g for _, g in named])
        else:
            comp = [(n, g) for n, g in named if self.compressible(n, g)]
            dense = [g for n, g in named if not self.compressible(n, g)]
            sent = self.reduce_dense(dense) + (self.reduce_compressed(comp) if comp else 0)
        self.stats.add(sent, fp32)

    def end_step(self) -> None:
        self.step += 1
        self._in_step = False
        self.stats.step()


def layerwise_hook(reducer: LayerwiseReducer, names: dict[nn.Parameter, str], stats: SyncStats,
                   nodes: NodeGroups | None = None) -> Callable:
    """A DDP comm hook running ``reducer`` synchronously on the bucket's per-parameter gradient views.

    With ``nodes`` (hierarchical): the bucket is averaged exactly inside the node, the node leaders run ``reducer``
    (its group: the leaders) on the node means, and each leader broadcasts the result inside its node.
    """

    def hook(state, bucket):  # DDP requires the name `bucket`; annotations must be real types or absent
        start = time.perf_counter()
        buf = bucket.buffer()
        if nodes is not None and nodes.intra is not None:
            dist.all_reduce(buf, group=nodes.intra)
            buf.div_(dist.get_world_size(nodes.intra))
            stats.add_intra(buf.numel() * buf.element_size())
        if nodes is None or nodes.leaders is not None:
            reducer.reduce([(names[p], g) for p, g in zip(bucket.parameters(), bucket.gradients())])
            if bucket.is_last():
                reducer.end_step()
        elif bucket.is_last():  # a node member, or a single node: nothing of this rank crosses a node boundary
            stats.step()
        if nodes is not None and nodes.intra is not None and nodes.nodes > 1:
            dist.broadcast(buf, src=nodes.leader, group=nodes.intra)
            stats.add_intra(buf.numel() * buf.element_size())
        stats.add_time(time.perf_counter() - start)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    return hook


class LayerwiseSync(DDPSync):
    """DDP whose comm hook is a :class:`LayerwiseReducer` (``powersgd``, ``lgreco``, ``topk``).

    ``node_size`` > 0 makes it hierarchical (:mod:`carl.parallel.hierarchy`): exact inside nodes of that many ranks,
    compressed between the nodes' leaders.
    """

    def __init__(self, policy: nn.Module, ctx: DistContext, make_reducer: Callable[[SyncStats], LayerwiseReducer],
                 name: str, bucket_cap_mb: float = 0.0, node_size: int = 0) -> None:
        self.name = name
        self._make_reducer = make_reducer
        self.node_size = node_size
        super().__init__(policy, ctx, bucket_cap_mb)

    def register_hook(self) -> None:
        self.reducer = self._make_reducer(self.stats)
        names = {p: n for n, p in self.policy.named_parameters()}
        nodes = None
        if self.node_size:
            nodes = node_groups(self.ctx, self.node_size)
            self.reducer.group = nodes.leaders
        self.actor.register_comm_hook(None, layerwise_hook(self.reducer, names, self.stats, nodes))

    @property
    def _device(self) -> torch.device:
        return next(self.policy.parameters()).device

    def state_dict(self) -> dict:
        return tensors_to(self.reducer.state_dict(), "cpu")

    def load_state_dict(self, state: dict) -> None:
        self.reducer.load_state_dict(tensors_to(state, self._device))

    def rank_state_dict(self) -> dict:
        return tensors_to(self.reducer.rank_state_dict(), "cpu")

    def load_rank_state_dict(self, state: dict) -> None:
        self.reducer.load_rank_state_dict(tensors_to(state, self._device))

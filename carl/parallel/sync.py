"""``make_sync``: the gradient-sync method named by ``parallel.sync``.

| method | what travels per optimiser step | built on |
|---|---|---|
| ``allreduce`` | fp32 gradients | DDP (all-reduce hook with accounting) |
| ``fp16`` / ``bf16`` | half-precision gradients (2x fewer bytes) | DDP + cast hook |
| ``powersgd`` | rank-r factors of each layer's matrix (error feedback, warm start) | DDP + :mod:`carl.parallel.lowrank` (``powersgd_impl=torch``: ``powerSGD_hook``) |
| ``lgreco`` | per-layer rank-r_l factors, ranks planned by L-GreCo's DP | DDP + :mod:`carl.parallel.lgreco` |
| ``topk`` | top-k (value, index) pairs per layer, error feedback | DDP + :mod:`carl.parallel.topk` |
| ``localsgd`` | parameters every ``local_steps`` steps, overlapped (CO2) | :mod:`carl.parallel.localsgd` |

With one process :class:`~carl.parallel.base.SyncMethod` (no communication) is used whatever the method.
``parallel.hierarchical=true`` (powersgd, lgreco, topk) all-reduces exactly inside each node and compresses only
between nodes (:mod:`carl.parallel.hierarchy`).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from carl.config import LAYERWISE_SYNC, SYNC_METHODS, ParallelConfig
from carl.parallel.base import SyncMethod
from carl.parallel.context import DistContext
from carl.parallel.hooks import CastSync, DDPSync, PowerSGDSync
from carl.parallel.layerwise import LayerwiseSync
from carl.parallel.lgreco import LGreCoReducer
from carl.parallel.localsgd import LocalSGDSync
from carl.parallel.lowrank import LowRankReducer
from carl.parallel.topk import TopKReducer

__all__ = ["SYNC_BUILDERS", "SYNC_METHODS", "make_sync"]


Builder = Callable[[nn.Module, DistContext, ParallelConfig, float, int], SyncMethod]


def _powersgd(policy: nn.Module, ctx: DistContext, par: ParallelConfig, cap: float, node_size: int) -> SyncMethod:
    if par.powersgd_impl == "torch":
        return PowerSGDSync(policy, ctx, par.powersgd_rank, par.powersgd_start_iter, cap)
    return LayerwiseSync(policy, ctx, lambda stats: LowRankReducer(
        stats, par.powersgd_rank, start_step=max(2, par.powersgd_start_iter)), "powersgd", cap, node_size)


# parallel.sync name -> builder (policy, context, options, bucket cap MB, node size for hierarchical reduction)
SYNC_BUILDERS: dict[str, Builder] = {
    "allreduce": lambda policy, ctx, par, cap, node: DDPSync(policy, ctx, cap),
    "fp16": lambda policy, ctx, par, cap, node: CastSync(policy, ctx, torch.float16, cap),
    "bf16": lambda policy, ctx, par, cap, node: CastSync(policy, ctx, torch.bfloat16, cap),
    "powersgd": _powersgd,
    "lgreco": lambda policy, ctx, par, cap, node: LayerwiseSync(policy, ctx, lambda stats: LGreCoReducer(
        stats, par.powersgd_rank, par.lgreco_every, par.lgreco_acc_steps, par.lgreco_alpha,
        start_step=max(2, par.powersgd_start_iter)), "lgreco", cap, node),
    "topk": lambda policy, ctx, par, cap, node: LayerwiseSync(
        policy, ctx, lambda stats: TopKReducer(stats, par.topk_ratio), "topk", cap, node),
    "localsgd": lambda policy, ctx, par, cap, node: LocalSGDSync(
        policy, ctx, par.local_steps, par.outer_lr, par.outer_momentum, par.staleness_penalty, par.outer_clip),
}
if set(SYNC_BUILDERS) != set(SYNC_METHODS):  # a method declared without a builder, or built without a declaration
    raise ImportError(f"carl.parallel.sync builds {sorted(SYNC_BUILDERS)} but carl.config declares "
                      f"{sorted(SYNC_METHODS)}")


def make_sync(policy: nn.Module, ctx: DistContext, par: ParallelConfig) -> SyncMethod:
    """Wrap ``policy`` for ``par.sync``; raise ``ValueError`` with the reason where the backend cannot run it."""
    method = par.sync
    if method not in SYNC_BUILDERS:
        raise ValueError(f"parallel.sync={method!r} is unknown; choose one of {', '.join(SYNC_METHODS)}")
    if not ctx.distributed:
        return SyncMethod(policy, ctx)
    node_size = (par.node_size or ctx.local_world_size) if par.hierarchical else 0
    if node_size and not par.per_layer_compression:
        raise ValueError(f"parallel.hierarchical=true needs parallel.sync=powersgd (layerwise), "
                         f"{' or '.join(LAYERWISE_SYNC)}, not {method!r}")
    return SYNC_BUILDERS[method](policy, ctx, par, par.bucket_cap_mb, node_size)

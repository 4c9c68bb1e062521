"""DDP-based methods: plain all-reduce, fp16/bf16 compressed all-reduce and torch's PowerSGD hook.

Each hook is wrapped so that it counts the bytes it hands to the backend and the time from the hook call until
its future completes (the callbacks only do bookkeeping, so they are safe on gloo's callback thread, see
``docs/distributed.md``).
"""
from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from carl.parallel.accounting import SyncStats
from carl.parallel.base import SyncMethod
from carl.parallel.context import DistContext

Hook = Callable[[object, dist.GradBucket], torch.futures.Future]


def model_megabytes(model: nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 2**20


def timed(fut: torch.futures.Future, stats: SyncStats, start: float) -> torch.futures.Future:
    """Charge the time until ``fut`` completes to ``stats``; returns a future with the same value."""

    def done(f: torch.futures.Future) -> torch.Tensor:
        stats.add_time(time.perf_counter() - start)
        return f.value()

    return fut.then(done)


def cast_allreduce_hook(dtype: torch.dtype | None, stats: SyncStats) -> Hook:
    """All-reduce the bucket (cast to ``dtype`` when given, e.g. fp16/bf16), average, cast back."""

    def hook(state, bucket):  # DDP requires the name `bucket`; annotations must be real types or absent
        start = time.perf_counter()
        buf = bucket.buffer()
        world = dist.get_world_size()
        wire = buf if dtype is None else buf.to(dtype)
        wire.div_(world)
        stats.add(wire.numel() * wire.element_size(), buf.numel() * 4)
        if bucket.is_last():
            stats.step()
        fut = dist.all_reduce(wire, async_op=True).get_future()

        def decompress(f: torch.futures.Future) -> torch.Tensor:
            out = f.value()[0]
            if out.data_ptr() != buf.data_ptr():
                buf.copy_(out)
            stats.add_time(time.perf_counter() - start)
            return buf

        return fut.then(decompress)

    return hook


def powersgd_counting_hook(stats: SyncStats) -> Hook:
    """torch's ``powerSGD_hook`` plus byte accounting from the state's own element counters."""

    def hook(state, bucket):  # (state: PowerSGDState, bucket: GradBucket) -> Future[Tensor]
        start = time.perf_counter()
        numel = bucket.buffer().numel()
        compressing = state.iter >= state.start_powerSGD_iter
        before = state.total_numel_after_compression
        last = bucket.is_last()
        fut = psgd.powerSGD_hook(state, bucket)
        sent = state.total_numel_after_compression - before if compressing else numel
        stats.add(sent * 4, numel * 4)
        if last:
            stats.step()
        return timed(fut, stats, start)

    return hook


class DDPSync(SyncMethod):
    """DistributedDataParallel around the policy with one comm hook (``register_hook`` in subclasses)."""

    name = "allreduce"

    def __init__(self, policy: nn.Module, ctx: DistContext, bucket_cap_mb: float = 0.0) -> None:
        super().__init__(policy, ctx)
        device = next(policy.parameters()).device
        kwargs: dict = {}
        if bucket_cap_mb > 0:
            kwargs["bucket_cap_mb"] = bucket_cap_mb
        if device.type == "cuda":
            kwargs["device_ids"] = [device]
        self.actor = DDP(self.actor, **kwargs)  # broadcasts rank 0's parameters to all ranks
        self.register_hook()

    def register_hook(self) -> None:
        self.actor.register_comm_hook(None, cast_allreduce_hook(None, self.stats))

    def act(self, obs: dict[str, torch.Tensor], action: torch.Tensor):  # -> PolicyOutput
        with self.ctx.guard(f"{self.name} gradient sync"):
            return self.actor(obs, action)

    def no_sync(self) -> AbstractContextManager:
        return self.actor.no_sync()


class CastSync(DDPSync):
    """``fp16`` / ``bf16``: all-reduce in half precision (2x fewer bytes), results cast back to fp32."""

    def __init__(self, policy: nn.Module, ctx: DistContext, dtype: torch.dtype, bucket_cap_mb: float = 0.0) -> None:
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"
        super().__init__(policy, ctx, bucket_cap_mb)

    def register_hook(self) -> None:
        self.actor.register_comm_hook(None, cast_allreduce_hook(self.dtype, self.stats))


class PowerSGDSync(DDPSync):
    """torch's PowerSGD hook (error feedback and warm start on), rank ``parallel.powersgd_rank``.

    On gloo the hook is only correct with one DDP bucket (its chained P/Q all-reduces race across buckets and gloo
    aborts with a "collective mismatch"), so the bucket cap is raised above the model size; an explicit smaller
    ``parallel.bucket_cap_mb`` is refused. Its residuals are keyed by DDP bucket index, which changes when DDP
    rebuilds buckets, so a resumed run restarts this hook's warm-up and error feedback (the default layerwise
    implementation keys them by parameter name and restores them).
    """

    name = "powersgd"

    def __init__(self, policy: nn.Module, ctx: DistContext, rank: int = 4, start_iter: int = 2,
                 bucket_cap_mb: float = 0.0) -> None:
        self.rank, self.start_iter = rank, max(2, start_iter)
        size_mb = model_megabytes(policy)
        if ctx.backend == "gloo":
            if 0 < bucket_cap_mb <= size_mb:
                raise ValueError(
                    f"parallel.sync=powersgd cannot run on gloo with parallel.bucket_cap_mb={bucket_cap_mb:g} "
                    f"(model {size_mb:.1f} MB -> several DDP buckets): torch's PowerSGD hook issues its P/Q "
                    "all-reduces from gloo's callback thread and ranks then mismatch collectives. Leave "
                    f"parallel.bucket_cap_mb=0 (one bucket), set it > {size_mb:.1f}, or use parallel.sync=lgreco"
                )
            bucket_cap_mb = bucket_cap_mb or (size_mb + 1.0)
        elif ctx.backend not in ("nccl", None):
            raise ValueError(f"parallel.sync=powersgd is not supported on backend {ctx.backend!r}; use gloo or nccl")
        super().__init__(policy, ctx, bucket_cap_mb)

    def register_hook(self) -> None:
        self.state = psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=self.rank, start_powerSGD_iter=self.start_iter,
            min_compression_rate=2, use_error_feedback=True, warm_start=True, random_seed=0,
            compression_stats_logging_frequency=10**9,
        )
        self.actor.register_comm_hook(self.state, powersgd_counting_hook(self.stats))

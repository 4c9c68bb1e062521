"""Checks that need the world size: the global minibatch split and resuming with the same layout."""
from __future__ import annotations

from carl.config import ConfigError, TrainConfig


def check_world(cfg: TrainConfig, world_size: int) -> None:
    """``ppo.minibatch_size`` is the *global* minibatch: every rank takes ``minibatch_size / world_size`` of it."""
    p = cfg.ppo
    if world_size <= 1:
        return
    if p.minibatch_size % world_size:
        lo = p.minibatch_size - p.minibatch_size % world_size
        hint = f"try ppo.minibatch_size={lo or world_size}" if lo else f"try ppo.minibatch_size={world_size}"
        raise ConfigError(
            f"ppo.minibatch_size={p.minibatch_size} (the global minibatch) must be divisible by the world size "
            f"{world_size} (torchrun --nproc_per_node x --nnodes); {hint}"
        )
    share = p.minibatch_size // world_size
    if share % p.accumulation_steps:
        raise ConfigError(
            f"ppo.accumulation_steps={p.accumulation_steps} must divide each rank's share of the minibatch "
            f"(ppo.minibatch_size / world size = {p.minibatch_size} / {world_size} = {share})"
        )


def check_resume_world(saved_world: int, world_size: int, path: str) -> None:
    if saved_world != world_size:
        raise ConfigError(
            f"resume: {path} was written by a run with world size {saved_world}; this launch has world size "
            f"{world_size}. Resume with the same layout (torchrun --nproc_per_node x --nnodes = {saved_world})"
        )

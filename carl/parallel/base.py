"""The interface between the PPO trainer and a gradient-synchronisation method.

The trainer calls, per optimiser step: :meth:`SyncMethod.act` for every micro-batch forward (inside
:meth:`SyncMethod.no_sync` for all but the last micro-batch), ``backward()``, ``optimizer.step()``, then
:meth:`SyncMethod.after_step`. At the end of every PPO update it calls :meth:`SyncMethod.flush`, after which all
replicas hold identical parameters (the rollout, evaluation and checkpoints see one model).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager

import torch
from torch import nn

from carl.parallel.accounting import SyncStats
from carl.parallel.context import DistContext


class PolicyActor(nn.Module):
    """``forward(obs, action) = policy.act(obs, action=action)``, so DDP sees the training forward pass."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, obs: dict[str, torch.Tensor], action: torch.Tensor):  # -> PolicyOutput
        return self.policy.act(obs, action=action)


class SyncMethod:
    """Base class: no communication (what one process needs). Subclasses synchronise gradients or parameters."""

    name = "none"

    def __init__(self, policy: nn.Module, ctx: DistContext | None = None) -> None:
        self.policy, self.ctx = policy, ctx
        self.actor: nn.Module = PolicyActor(policy)
        self.stats = SyncStats()

    def act(self, obs: dict[str, torch.Tensor], action: torch.Tensor):  # -> PolicyOutput
        """The training forward pass (through the DDP wrapper where there is one)."""
        return self.actor(obs, action)

    def no_sync(self) -> ContextManager:
        """Context for micro-batches whose gradients are only accumulated locally."""
        return nullcontext()

    def after_step(self) -> None:
        """Called after every ``optimizer.step()``."""

    def flush(self) -> None:
        """Make every replica's parameters identical (called at the end of each PPO update)."""

    def pop_stats(self) -> dict[str, float]:
        """``sync/*`` scalars since the last call; ``sync/seconds`` is also charged to the ``sync`` phase."""
        return self.stats.pop()

    def state_dict(self) -> dict:
        """State identical on every rank (saved once, by rank 0)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def rank_state_dict(self) -> dict:
        """State that differs between ranks (error-feedback residuals): saved once per rank, on CPU."""
        return {}

    def load_rank_state_dict(self, state: dict) -> None:
        pass


def tensors_to(state: dict, device: torch.device | str) -> dict:
    """``state`` with every tensor value (also inside nested dicts) moved to ``device``."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else tensors_to(v, device) if isinstance(v, dict) else v
            for k, v in state.items()}

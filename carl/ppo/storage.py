"""Rollout storage on the env's device and Generalised Advantage Estimation.

Layout is time-major ``[T, B, ...]``; observations keep the env's dtypes (the BEV stays uint8, 1 byte per pixel).
Index ``t`` holds the observation the action was taken in, the action, its log-prob and value, the reward that
followed, and ``done[t]`` = the episode ended with that transition (terminated OR truncated, as in CaRL).
``bootstrap[t]`` is an extra value added to the TD target of ended rows (V(final obs) of truncated rows when
``ppo.bootstrap_truncation`` is on; zero otherwise).
"""
from __future__ import annotations

import torch

from envs.api import TensorSpec


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    next_value: torch.Tensor,
    gamma: float,
    gae_lambda: float,
    bootstrap: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(gamma, lambda) over ``[T, B]`` tensors; returns (advantages, returns).

    delta_t = r_t + gamma * [(1 - done_t) * V_{t+1} + bootstrap_t] - V_t
    A_t     = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}
    where V_T is ``next_value`` (the value of the observation after the last step).
    """
    T = rewards.shape[0]
    not_done = 1.0 - dones.float()
    extra = torch.zeros_like(rewards) if bootstrap is None else bootstrap
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        v_next = next_value if t == T - 1 else values[t + 1]
        delta = rewards[t] + gamma * (not_done[t] * v_next + extra[t]) - values[t]
        last = delta + gamma * gae_lambda * not_done[t] * last
        advantages[t] = last
    return advantages, advantages + values


class RolloutStorage:
    """Fixed-size buffers for one rollout of ``num_steps`` x ``num_envs`` transitions."""

    def __init__(
        self,
        num_steps: int,
        num_envs: int,
        observation_spec: dict[str, TensorSpec],
        action_dim: int,
        device: torch.device,
    ) -> None:
        T, B = num_steps, num_envs
        self.num_steps, self.num_envs, self.device = T, B, device
        self.obs = {k: torch.zeros((T, B, *s.shape), dtype=s.dtype, device=device) for k, s in observation_spec.items()}
        self.actions = torch.zeros((T, B, action_dim), device=device)
        self.log_probs = torch.zeros((T, B), device=device)
        self.values = torch.zeros((T, B), device=device)
        self.rewards = torch.zeros((T, B), device=device)
        self.dones = torch.zeros((T, B), device=device)
        self.bootstrap = torch.zeros((T, B), device=device)
        self.alpha = torch.zeros((T, B, action_dim), device=device)  # old distribution, for the analytic KL
        self.beta = torch.zeros((T, B, action_dim), device=device)
        self.teacher = torch.zeros((T, B, action_dim), device=device)  # a teacher's actions (ppo.teacher), if any
        self.labelled = torch.zeros((T, B), device=device)  # 1 where the teacher labelled the step (ppo.teacher_every)
        self.advantages = torch.zeros((T, B), device=device)
        self.returns = torch.zeros((T, B), device=device)

    def insert(
        self,
        t: int,
        obs: dict[str, torch.Tensor],
        action: torch.Tensor,
        log_prob: torch.Tensor,
        value: torch.Tensor,
        alpha: torch.Tensor,
        beta: torch.Tensor,
    ) -> None:
        """Store what is known before stepping the env at time ``t``."""
        for k, buf in self.obs.items():
            buf[t].copy_(obs[k])
        self.actions[t].copy_(action)
        self.log_probs[t].copy_(log_prob)
        self.values[t].copy_(value)
        self.alpha[t].copy_(alpha)
        self.beta[t].copy_(beta)

    def insert_outcome(self, t: int, reward: torch.Tensor, done: torch.Tensor, bootstrap: torch.Tensor | None = None) -> None:
        """Store what the env returned for the step at time ``t``."""
        self.rewards[t].copy_(reward)
        self.dones[t].copy_(done.float())
        if bootstrap is None:
            self.bootstrap[t].zero_()
        else:
            self.bootstrap[t].copy_(bootstrap)

    def compute_returns(self, next_value: torch.Tensor, gamma: float, gae_lambda: float) -> None:
        self.advantages, self.returns = compute_gae(
            self.rewards, self.values, self.dones, next_value, gamma, gae_lambda, self.bootstrap
        )

    def flat(self) -> dict[str, torch.Tensor | dict[str, torch.Tensor]]:
        """The batch flattened to ``[T*B, ...]`` (views where possible)."""
        n = self.num_steps * self.num_envs
        return {
            "obs": {k: v.reshape(n, *v.shape[2:]) for k, v in self.obs.items()},
            "actions": self.actions.reshape(n, -1),
            "log_probs": self.log_probs.reshape(n),
            "values": self.values.reshape(n),
            "advantages": self.advantages.reshape(n),
            "returns": self.returns.reshape(n),
            "alpha": self.alpha.reshape(n, -1),
            "beta": self.beta.reshape(n, -1),
            "teacher": self.teacher.reshape(n, -1),
            "labelled": self.labelled.reshape(n),
        }


def rows(batch: dict, idx: torch.Tensor) -> dict:
    """Rows ``idx`` of a :meth:`RolloutStorage.flat` batch, nested dicts too: a minibatch. ``index_select``, not
    ``t[idx]``: the same rows 2-3x faster on CPU (docs/training.md, "Throughput")."""
    return {k: rows(v, idx) if isinstance(v, dict) else v.index_select(0, idx) for k, v in batch.items()}

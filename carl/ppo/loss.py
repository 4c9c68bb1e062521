"""PPO's loss for one (micro-)batch: clipped surrogate, clipped value loss, entropy bonus; and the teacher's term."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from carl.policy import beta_mean_action


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar to back-propagate
    policy_loss: torch.Tensor
    value_loss: torch.Tensor
    entropy: torch.Tensor
    clip_frac: torch.Tensor
    old_approx_kl: torch.Tensor  # the ratio-based estimator (CleanRL's), for reference


def normalize_advantages(adv: torch.Tensor, eps: float = 1e-8,
                         all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Zero mean, unit (Bessel-corrected) std; a single-sample batch is only centred.

    ``all_reduce_sum`` (DDP: the context's in-place sum over ranks) makes the statistics those of the *global*
    minibatch, every rank's share together: the same result as normalising their concatenation."""
    if all_reduce_sum is None:
        if adv.numel() < 2:
            return adv - adv.mean()
        return (adv - adv.mean()) / (adv.std() + eps)
    a = adv.double()
    stats = torch.stack([a.new_tensor(float(a.numel())), a.sum(), (a * a).sum()])
    all_reduce_sum(stats)
    n, s, ss = stats.tolist()
    mean = s / n
    if n < 2:
        return adv - mean
    var = max(ss - n * mean * mean, 0.0) / (n - 1)
    return (adv - mean) / (var ** 0.5 + eps)


def ppo_loss(
    new_log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    new_value: torch.Tensor,
    old_value: torch.Tensor,
    returns: torch.Tensor,
    entropy: torch.Tensor,
    clip_coef: float,
    clip_vloss: bool,
    vf_coef: float,
    ent_coef: float,
    pg_coef: float = 1.0,
) -> LossTerms:
    """All inputs are ``[N]``; ``advantages`` are already normalised if wanted. Means are over N. ``pg_coef`` weights
    the clipped surrogate (0 with a teacher: the actor learns from the teacher's term alone, DAgger)."""
    log_ratio = new_log_prob - old_log_prob
    ratio = log_ratio.exp()
    with torch.no_grad():
        old_approx_kl = ((ratio - 1) - log_ratio).mean()
        clip_frac = ((ratio - 1.0).abs() > clip_coef).float().mean()

    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1 - clip_coef, 1 + clip_coef)
    policy_loss = torch.max(pg1, pg2).mean()

    if clip_vloss:
        v_unclipped = (new_value - returns) ** 2
        v_clipped = old_value + (new_value - old_value).clamp(-clip_coef, clip_coef)
        value_loss = 0.5 * torch.max(v_unclipped, (v_clipped - returns) ** 2).mean()
    else:
        value_loss = 0.5 * ((new_value - returns) ** 2).mean()

    entropy_mean = entropy.mean()
    loss = pg_coef * policy_loss - ent_coef * entropy_mean + vf_coef * value_loss
    return LossTerms(loss, policy_loss.detach(), value_loss.detach(), entropy_mean.detach(), clip_frac, old_approx_kl)


def bc_loss(alpha: torch.Tensor, beta: torch.Tensor, teacher_action: torch.Tensor,
            labelled: torch.Tensor | None = None) -> torch.Tensor:
    """Behaviour cloning: squared error, summed over the action dims and averaged over the N samples (or over those
    ``labelled`` [N] marks with 1, 0 when none is), of the policy's mean action (the Beta mean on [-1, 1], the action
    it drives when evaluated) to the teacher's. Bounded, unlike the teacher action's log-likelihood, which is
    unbounded at the action bounds where an expert often acts (full brake)."""
    err = ((beta_mean_action(alpha.float(), beta.float()) - teacher_action) ** 2).sum(-1)
    if labelled is None:
        return err.mean()
    return (err * labelled).sum() / labelled.sum().clamp(min=1.0)

"""One PPO iteration, CleanRL style: collect a rollout, compute GAE, run the clipped-surrogate update.

Read top to bottom: :meth:`PPOTrainer.collect` fills :class:`RolloutStorage` with ``num_steps`` steps of every
env (timed as ``env`` and ``inference``), :meth:`PPOTrainer.update` computes advantages and runs
``update_epochs`` passes of shuffled minibatches (timed as ``update``). With a teacher (``ppo.teacher``) the rollout
also stores the teacher's action in each state the policy visited (timed as ``teacher``), and the loss adds the squared
error of the policy's mean action to it, weighted by ``ppo.bc_coef`` decaying to 0 (behaviour cloning beside PPO, on
the policy's own states, as Waymo's BC-SAC does for rare safety-critical situations). Minibatches larger than
memory are split into ``accumulation_steps`` micro-batches whose gradients are summed before one optimiser step;
advantage normalisation always uses the statistics of the whole minibatch, so the update does not depend on the split.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Callable

import torch

from carl.config import PPOConfig
from carl.monitor import EpisodeStats, PhaseTimer
from carl.policy import CarlPolicy, beta_kl
from carl.ppo.loss import bc_loss, normalize_advantages, ppo_loss
from carl.ppo.storage import RolloutStorage, rows
from envs import api
from envs.api import BatchedEnv

from carl.parallel.base import SyncMethod

if TYPE_CHECKING:
    from carl.parallel import DistContext

# the ``losses/...`` statistics of an update: means over its minibatches
LOSS_STATS = ("policy_loss", "value_loss", "entropy", "approx_kl", "clipfrac", "old_approx_kl", "grad_norm", "bc_loss")
FrameHook = Callable[[dict[str, torch.Tensor], torch.Tensor], None]  # (obs, done) after each env step
Teacher = Callable[[dict[str, torch.Tensor]], torch.Tensor]  # obs -> actions [B, A], e.g. the env's expert


class PPOTrainer:
    """Owns the optimiser and the rollout buffer; the policy and env are passed in."""

    def __init__(
        self,
        policy: CarlPolicy,
        env: BatchedEnv,
        cfg: PPOConfig,
        timer: PhaseTimer | None = None,
        bf16: bool = False,
        sync: SyncMethod | None = None,
        ctx: DistContext | None = None,
        teacher: Teacher | None = None,
    ) -> None:
        """With ``sync``/``ctx`` (torchrun), each rank takes ``minibatch_size / world_size`` of every global
        minibatch, advantages are normalised with global statistics and gradients go through ``sync``; without
        them (one process) the policy is called directly and nothing is synchronised. ``teacher``: the actions the
        behaviour-cloning term fits (``ppo.teacher``); None: PPO alone."""
        self.policy, self.env, self.cfg = policy, env, cfg
        self.teacher = teacher
        self.bc_weight = cfg.bc_coef if teacher is not None else 0.0
        self.sync = sync
        self.world_size = ctx.world_size if ctx is not None else 1
        reduce = ((lambda t: ctx.all_reduce_sum(t, "advantage statistics"))
                  if ctx is not None and ctx.distributed else None)
        self.normalize_advantages = lambda adv: normalize_advantages(adv, all_reduce_sum=reduce)
        self.device = env.device
        self.timer = timer or PhaseTimer()
        self.autocast = (
            (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if bf16 else nullcontext
        )
        # fused: one kernel for all parameters (2-core Zen 3, the set policy's 78 tensors: 0.58 ms per step against
        # 3.3 ms looping over them); the same update rule
        fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in policy.parameters())
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.learning_rate, eps=cfg.adam_eps, fused=fused)
        self.storage = RolloutStorage(cfg.num_steps, env.num_envs, env.observation_spec, env.action_spec.shape[0], self.device)
        self.episodes = EpisodeStats()
        self.next_obs: dict[str, torch.Tensor] | None = None

    # -- learning rate ----------------------------------------------------------------------------------------------
    def set_schedule(self, progress: float) -> float:
        """CaRL's linear schedule: lr = lr0 * (1 - progress), ``progress`` the share of the run done before this
        update (0 at the first; :class:`carl.progress.RunProgress`); with a teacher, its weight decays the same way to
        ``bc_final`` x ``bc_coef`` at ``bc_until`` of the run. Returns the learning rate."""
        progress = min(max(progress, 0.0), 1.0)
        lr = (1.0 - progress if self.cfg.anneal_lr else 1.0) * self.cfg.learning_rate
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.teacher is not None:
            left = max(0.0, 1.0 - progress / self.cfg.bc_until)
            self.bc_weight = self.cfg.bc_coef * (self.cfg.bc_final + (1.0 - self.cfg.bc_final) * left)
        return lr

    # -- rollout ----------------------------------------------------------------------------------------------------
    def reset(self, seed: int | None) -> None:
        self.next_obs = self.env.reset(seed=seed)

    @torch.no_grad()
    def collect(self, should_stop: Callable[[], bool] = lambda: False, on_step: FrameHook | None = None) -> bool:
        """Fill the storage with one rollout. Returns False if ``should_stop()`` interrupted it (storage invalid)."""
        assert self.next_obs is not None, "call reset() first"
        cfg, st = self.cfg, self.storage
        self.policy.eval()
        for t in range(cfg.num_steps):
            with self.timer.phase("inference"), self.autocast():
                out = self.policy.act(self.next_obs)
            st.insert(t, self.next_obs, out.action, out.log_prob, out.value, out.alpha, out.beta)
            labelled = self.bc_weight > 0 and t % cfg.teacher_every == 0
            st.labelled[t].fill_(float(labelled))
            if labelled:  # the teacher reads the state these observations came from
                with self.timer.phase("teacher"):
                    st.teacher[t].copy_(self.teacher(self.next_obs))

            with self.timer.phase("env"):
                res = self.env.step(out.action)
            done = res.terminated | res.truncated  # CaRL: no bootstrapping through either

            bootstrap = None
            if cfg.bootstrap_truncation:
                only_trunc = res.truncated & ~res.terminated
                if bool(only_trunc.any()):
                    final_obs = api.final_obs(res.info)
                    missing = [k for k in self.next_obs if k not in final_obs]
                    if missing:
                        raise ValueError(f"ppo.bootstrap_truncation=true needs the final observation of truncated "
                                         f"episodes, and the env gives no info['final_obs/{missing[0]}']; let it keep "
                                         "them (the built-in backends: env.options.keep_final_obs=true) or set "
                                         "ppo.bootstrap_truncation=false")
                    final_obs = {k: final_obs[k] for k in self.next_obs}
                    with self.timer.phase("inference"), self.autocast():
                        bootstrap = self.policy.get_value(final_obs) * only_trunc.float()
            st.insert_outcome(t, res.reward, done, bootstrap)
            self.episodes.add(res.info, done)
            if on_step is not None:
                on_step(res.obs, done)
            self.next_obs = res.obs
            if should_stop():
                return False
        return True

    # -- update -----------------------------------------------------------------------------------------------------
    def update(self) -> dict[str, float]:
        """GAE, then ``update_epochs`` x minibatches of clipped PPO. Returns the ``losses/...`` metrics."""
        cfg, st = self.cfg, self.storage
        with self.timer.phase("update"):
            with torch.no_grad(), self.autocast():
                next_value = self.policy.get_value(self.next_obs)
            st.compute_returns(next_value.float(), cfg.gamma, cfg.gae_lambda)
            batch = st.flat()
            metrics = self._optimise(batch)
            y_pred, y_true = batch["values"], batch["returns"]
            var_y = torch.var(y_true)
            metrics["losses/explained_variance"] = float("nan") if var_y == 0 else float(1 - torch.var(y_true - y_pred) / var_y)
            metrics["charts/discounted_returns"] = float(batch["returns"].mean())
            metrics["charts/advantages"] = float(batch["advantages"].mean())
        return metrics

    def _optimise(self, batch: dict) -> dict[str, float]:
        cfg = self.cfg
        n = batch["actions"].shape[0]
        mb, k = cfg.minibatch_size // self.world_size, cfg.accumulation_steps  # this rank's share
        # summed on the device: one host sync per update
        sums = {name: torch.zeros((), device=self.device) for name in LOSS_STATS}
        steps = 0
        # what a micro-batch reads: the advantages are gathered per minibatch (normalised there), the teacher's
        # labels only while cloning
        fields = ("obs", "actions", "log_probs", "values", "returns", "alpha", "beta") + (
            ("teacher", "labelled") if self.bc_weight > 0 else ())
        read = {key: batch[key] for key in fields}
        self.policy.train()
        for _epoch in range(cfg.update_epochs):
            perm = torch.randperm(n, device=self.device)
            for start in range(0, n, mb):
                idx = perm[start : start + mb]
                adv = batch["advantages"].index_select(0, idx)
                if cfg.norm_adv:
                    adv = self.normalize_advantages(adv)
                self.optimizer.zero_grad(set_to_none=True)
                for i, (micro, micro_adv) in enumerate(zip(idx.chunk(k), adv.chunk(k))):
                    weight = micro.numel() / idx.numel()
                    mbatch = rows(read, micro)
                    obs = mbatch["obs"]
                    local_only = self.sync.no_sync() if self.sync is not None and i < k - 1 else nullcontext()
                    with local_only:  # gradients are synchronised on the last micro-batch's backward
                        with self.autocast():
                            out = (self.sync.act(obs, mbatch["actions"]) if self.sync is not None
                                   else self.policy.act(obs, action=mbatch["actions"]))
                        terms = ppo_loss(
                            out.log_prob, mbatch["log_probs"], micro_adv, out.value, mbatch["values"],
                            mbatch["returns"], out.entropy, cfg.clip_coef, cfg.clip_vloss, cfg.vf_coef,
                            cfg.ent_coef, cfg.pg_coef,
                        )
                        loss = terms.loss
                        if self.bc_weight > 0:
                            bc = bc_loss(out.alpha, out.beta, mbatch["teacher"], mbatch["labelled"])
                            loss = loss + self.bc_weight * bc
                            sums["bc_loss"] += weight * bc.detach().float()
                        (loss * weight).backward()
                    with torch.no_grad():
                        kl = beta_kl(mbatch["alpha"], mbatch["beta"], out.alpha, out.beta).mean()
                        for name, value in (("policy_loss", terms.policy_loss), ("value_loss", terms.value_loss),
                                            ("entropy", terms.entropy), ("approx_kl", kl),
                                            ("clipfrac", terms.clip_frac), ("old_approx_kl", terms.old_approx_kl)):
                            sums[name] += weight * value.detach().float()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm)
                self.optimizer.step()
                if self.sync is not None:
                    self.sync.after_step()
                sums["grad_norm"] += grad_norm.detach().float()
                steps += 1
        if self.sync is not None:
            self.sync.flush()
        totals = torch.stack(list(sums.values())).tolist()
        return {f"losses/{name}": v / steps for name, v in zip(sums, totals)}

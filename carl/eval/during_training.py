"""Evaluation during a training run: the held-out routes periodically and at the end (with the random policy and
the backend's expert beside it), and the final benchmark at its own conditions."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from carl.eval.loop import evaluate
from carl.eval.policies import PolicyFactory, expert_factory, random_policy
from carl.eval.store import write_result
from carl.monitor import TBLogger, format_eval_table
from envs.api import BatchedEnv

if TYPE_CHECKING:
    from carl.config import TrainConfig
    from carl.policy import CarlPolicy


def run_benchmark(cfg: TrainConfig, run_dir: Path, device: torch.device) -> dict[str, Any]:
    """``carl-eval policy=<run>/best.pt benchmark=<logging.final_benchmark>`` into ``<run>/eval/<benchmark>``."""
    from carl.cli import load_config
    from carl.eval import cli as carl_eval

    name = cfg.logging.final_benchmark
    print(f"benchmark {name} (its own conditions) on {run_dir / 'best.pt'}:", flush=True)
    eval_cfg = load_config("eval", [f"benchmark={name}", f"policy={run_dir / 'best.pt'}",
                                    f"out_dir={run_dir / 'eval' / name}", f"device={device}", "overwrite=true"])
    return carl_eval.run(eval_cfg)


class Evaluation:
    """Held-out evaluation of the training policy (rank 0): periodic, final, and the baselines beside it."""

    def __init__(self, cfg: TrainConfig, is_main: bool, run_dir: Path, policy: CarlPolicy, tb: TBLogger,
                 build_env: Callable[[int, int], BatchedEnv]) -> None:
        """``build_env(num_envs, seed)``: the run's env on its held-out routes."""
        self.cfg, self.is_main, self.run_dir, self.policy, self.tb = cfg, is_main, run_dir, policy, tb
        self.build_env = build_env
        self.seed = cfg.logging.eval_seed  # not the training seed's: every seed meets the same routes

    @property
    def enabled(self) -> bool:
        return self.cfg.logging.eval_episodes > 0 and self.is_main

    def due(self, update: int) -> bool:
        every = self.cfg.logging.eval_every
        return bool(every) and update % every == 0

    def make_env(self, n: int) -> BatchedEnv:
        return self.build_env(n, self.seed)

    @property
    def final_episodes(self) -> int:
        lg = self.cfg.logging
        return lg.final_eval_episodes or lg.eval_episodes

    def run(self, name: str, update: int, global_step: int, episodes: int | None = None,
            weights: dict[str, torch.Tensor] | None = None) -> dict[str, Any] | None:
        """Evaluate the policy (or the same network with ``weights``, e.g. best.pt's) on ``episodes`` held-out routes
        (default ``eval_episodes``), write ``eval/<name>.json`` and log it; None where evaluation is off (or not
        rank 0)."""
        if not self.enabled:
            return None
        lg = self.cfg.logging
        policy = self.policy
        if weights is not None:
            policy = copy.deepcopy(self.policy)
            policy.load_state_dict(weights)
        policy.eval()
        result = evaluate(self.make_env, lambda _env: policy.deterministic_action, episodes or lg.eval_episodes,
                          lg.eval_max_steps, self.seed)
        result.update(update=update, global_step=global_step)
        write_result(result, self.run_dir / "eval" / f"{name}.json")
        if weights is None:
            scalars = {f"eval/{k}": result[k] for k in ("driving_score", "route_completion", "infraction_score",
                                                         "return", "closed_loop_score") if k in result}
            scalars.update({f"eval/infractions_per_km/{k}": v for k, v in result["infractions_per_km"].items()})
            scalars.update({f"eval/ds_lost/{k}": v for k, v in result["ds_lost"].items()})
            self.tb.scalars(scalars, global_step)
        return result

    def baselines(self, trained: dict[str, dict[str, Any]]) -> None:
        """The random policy and the backend's expert on the final evaluation's routes, beside ``trained`` (name:
        result, e.g. last and best); prints the table."""
        lg, name, episodes = self.cfg.logging, self.cfg.env.name, self.final_episodes
        results = dict(trained)
        if lg.final_baselines:
            factories: dict[str, PolicyFactory] = {"random": random_policy}
            expert = expert_factory(name)  # None for a custom env
            if expert is not None:
                factories["expert"] = expert
            for who, factory in factories.items():
                results[who] = evaluate(self.make_env, factory, episodes, lg.eval_max_steps, self.seed)
            write_result(results, self.run_dir / "eval" / "baselines.json")
        print(f"final evaluation on {episodes} held-out routes:\n{format_eval_table(results)}")

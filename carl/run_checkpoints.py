"""The run's checkpoint files: ``last.pt``, ``best.pt`` and ``update_<n>.pt`` with everything a resume needs, and
how the weights were made (``extra.provenance``: the facts a zoo card states). The file format is
:mod:`carl.checkpoint`'s; this is what a training run puts in it and takes back out."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from carl import checkpoint as ckpt_lib
from carl.config import TrainConfig, cpu_line
from carl.parallel import DistContext, SyncMethod
from carl.parallel.launch import check_resume_world
from carl.policy import CarlPolicy
from carl.ppo import PPOTrainer
from carl.spec import git_commit
from envs.api import BatchedEnv


class Checkpoints:
    """Writes ``last.pt``, ``best.pt`` and ``update_<n>.pt`` (rank 0) with everything a resume needs: weights,
    optimiser, counters, the env's and (with several ranks) every rank's env, RNG and sync state."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext, run_dir: Path, policy: CarlPolicy, trainer: PPOTrainer,
                 env: BatchedEnv, sync: SyncMethod, signature: dict[str, Any]) -> None:
        self.cfg, self.ctx, self.run_dir = cfg, ctx, run_dir
        self.policy, self.trainer, self.env, self.sync, self.signature = policy, trainer, env, sync, signature
        self.rank_states: list[dict[str, Any]] = []  # gathered on rank 0 before a checkpoint may be written
        # how the weights were made (a zoo card's facts): this process's command, commit and CPU, and the wall time
        # of every run that led here (resumes add theirs)
        self.provenance = {"command": " ".join(sys.argv), "commit": git_commit(), "cpu": cpu_line(),
                           "seconds_before": 0.0}
        self.t0 = time.perf_counter()

    def restore(self) -> tuple[int, int, float]:
        """Load ``last.pt`` of the run being resumed; returns (update, global step, best driving score)."""
        path = self.run_dir / "last.pt"
        ck = ckpt_lib.load_checkpoint(path, self.signature, map_location=self.env.device)
        check_resume_world(int(ck["extra"].get("world_size", 1)), self.ctx.world_size, str(path))
        ckpt_lib.restore(ck, self.policy, self.trainer.optimizer)
        before = ck["extra"].get("provenance", {})
        self.provenance["seconds_before"] = float(before.get("seconds", 0.0))
        self.provenance["runs_before"] = [*before.get("runs_before", []),
                                          {k: before[k] for k in ("command", "commit", "cpu") if k in before}]
        if self.ctx.distributed:  # this rank's own env and RNG state; the sync method's shared state
            own = ck["extra"]["ranks"][self.ctx.rank]
            self.env.load_state_dict(own["env"])
            ckpt_lib.restore_rng(own["rng"])
            self.sync.load_state_dict(ck["extra"].get("sync", {}))
            self.sync.load_rank_state_dict(own.get("sync", {}))  # error-feedback residuals
        else:
            self.env.load_state_dict(ck["env"])
        return ck["update"], ck["global_step"], ck["extra"].get("best_driving_score", float("-inf"))

    def due(self, update: int, last: bool) -> list[str]:
        """The files to write after ``update`` (``last``: the final or an interrupted update)."""
        lg = self.cfg.logging
        names = ["last.pt"] if update % lg.checkpoint_last_every == 0 or last else []
        if lg.checkpoint_every and update % lg.checkpoint_every == 0:
            names.append(f"update_{update:06d}.pt")
        return names

    def gather(self) -> None:
        """With several ranks: collect every rank's env, RNG and sync state on rank 0 (all ranks call this)."""
        if self.ctx.distributed:
            self.rank_states = self.ctx.gather_to_main({"env": self.env.state_dict(), "rng": ckpt_lib.capture_rng(),
                                                        "sync": self.sync.rank_state_dict()}, "checkpoint state")

    def seconds(self) -> float:
        """The run's wall time so far, every run that led here included (what ``ppo.train_for_seconds`` budgets)."""
        return self.provenance["seconds_before"] + time.perf_counter() - self.t0

    def save(self, name: str, update: int, global_step: int, best_ds: float) -> None:
        if not self.ctx.is_main:
            return
        seconds = self.seconds()
        extra: dict[str, Any] = {"best_driving_score": best_ds, "control_dt": float(self.env.control_dt),
                                 "provenance": {**self.provenance, "seconds": round(seconds, 1)}}
        if self.ctx.distributed:
            extra.update(world_size=self.ctx.world_size, ranks=self.rank_states, sync=self.sync.state_dict())
        payload = ckpt_lib.make_checkpoint(self.policy, self.trainer.optimizer, update, global_step, self.signature,
                                           self.cfg.to_dict(), self.env.state_dict(), extra)
        ckpt_lib.atomic_save(payload, self.run_dir / name)

"""``carl-train`` / ``python -m carl.train``: PPO training with CaRL's recipe.

Usage::

    carl-train +experiment=quick                       # laptop preset
    carl-train +experiment=carl_carla                  # CaRL's 300M setup (needs CARLA)
    carl-train +experiment=quick ppo.learning_rate=1e-4 run_dir=runs/mine
    carl-train resume=runs/quick-20250101-120000       # continue a run (counters, curves, RNG, env state)
    carl-train --cfg +experiment=quick                 # print the composed config and exit
    carl-train -m +experiment=quick seed=1,2,3         # a sweep: 3 runs in one folder, a summary at the end
    carl-train -m +experiment=quick hydra/launcher=slurm_node   # each run a SLURM job (docs/distributed.md)
    carl-train -m +experiment=quick hydra/sweeper=optuna_lr     # Optuna: lr and ent_coef for the final DS

The config is ``conf/train.yaml`` over the schema of :mod:`carl.config`. Every override is checked first (every
error at once; exit code 2), then Hydra's app runner runs the job(s) without changing the working directory. The
run folder is ``run_dir`` if given, else ``hydra.run.dir`` (default ``runs/<experiment>-<timestamp>``); in a sweep
(``-m``) ``hydra.sweep.dir/<job number>`` (default ``runs/sweeps/<experiment>-<timestamp>/<n>``), with
``sweep_summary.md``/``.json`` beside. The run's config is saved to ``<run dir>/config.yaml``. The loop below is
the whole algorithm: collect, update, log, evaluate, checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

import envs
from carl import checkpoint as ckpt_lib
from carl import config
from carl import sweep
from carl.bundle import BundleError, load_initial_weights
from carl.cli import Command, quote, run_command
from carl.config import ConfigError, TrainConfig, check_device, use_bf16, use_compile
from carl.eval.during_training import Evaluation, run_benchmark
from carl.eval.store import headline, keeps_final
from carl.factory import make_env
from carl.monitor import PhaseTimer, ProgressBar, TBLogger, VideoRecorder, summary_line
from carl.parallel import DistContext, DistributedError, SyncMethod, init_distributed, make_sync
from carl.parallel.context import run_as_rank
from carl.parallel.launch import check_world
from carl.policy import compile_network, describe, make_policy
from carl.ppo import PPOTrainer
from carl.progress import RunProgress
from carl.resume import env_group, resume_of, resumed_config, saved_config
from carl.run_checkpoints import Checkpoints
from carl.runlock import RunLock, claim_run_dir
from carl.stop import StopRequest
from envs.api import BatchedEnv


# ------------------------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------------------------
def train_config(overrides: list[str]) -> TrainConfig:
    """Compose (or, with ``resume=<dir>``, reload ``<dir>/config.yaml``), apply overrides, validate (for torchrun's
    ``WORLD_SIZE`` ranks)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    resume = resume_of(overrides)
    if not resume:
        return config.load(overrides, world_size)
    return resumed_config(resume, [o for o in overrides if not o.startswith("resume=")], world_size)


# ------------------------------------------------------------------------------------------------------------------
# Environments
# ------------------------------------------------------------------------------------------------------------------
def build_env(cfg: TrainConfig, num_envs: int, device: torch.device, seed: int, eval: bool = False,
              **extra: Any) -> BatchedEnv:
    """The run's env (:func:`carl.factory.make_env`): ``env.options``, then ``env.eval_options`` for the held-out
    evaluation env, then ``extra``."""
    return make_env(cfg.env.name, num_envs, device, seed, cfg.env.options, cfg.env.eval_options if eval else {},
                    extra)


def rank_routes(options: dict[str, Any], num_envs: int, rank: int, world_size: int) -> dict[str, int]:
    """Env options that split a fixed route assignment (a ``route_file``) between DDP ranks: rank r's rows start at
    ``first_route + r N`` and advance by ``N W`` routes, so no two ranks drive the same routes (random routes need
    nothing: each rank draws its own with its seed)."""
    if world_size == 1 or not options.get("route_file"):
        return {}
    first = int(options.get("first_route") or 0)
    return {"first_route": first + rank * num_envs, "route_stride": num_envs * world_size}


# ------------------------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(cfg: TrainConfig) -> int:
    """One process, or one rank of a torchrun launch (``WORLD_SIZE`` > 1): join the process group, then train."""
    check_device(cfg, torch.cuda.is_available())
    try:
        ctx, device = init_distributed(cfg.parallel.device, cfg.parallel.backend, cfg.parallel.timeout_s)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        return _train(cfg, ctx, device)
    finally:
        ctx.shutdown()


def rollout_progress(bar: ProgressBar, video: VideoRecorder, label: str, global_step: int, steps_this_run: int,
                     t_begin: float, num_envs: int) -> Callable[[dict[str, torch.Tensor], torch.Tensor], None]:
    """The collector's per-step callback: the video's frames and the progress bar's samples, rate and ``label``."""
    step_count = 0

    def on_step(obs: dict[str, torch.Tensor], done: torch.Tensor) -> None:
        nonlocal step_count
        step_count += 1
        video.on_step(obs, done)
        elapsed = time.perf_counter() - t_begin
        bar.update(global_step + step_count * num_envs, (steps_this_run + step_count * num_envs) / max(elapsed, 1e-9),
                   label)

    return on_step


def update_stats(metrics: dict[str, float], trainer: PPOTrainer, sync: SyncMethod, timer: PhaseTimer,
                 ctx: DistContext, lr: float, sps: float, update: int) -> dict[str, float]:
    """One update's scalars: the loss terms, the finished episodes, the phase times and the sync's, as means over
    ranks (episode means weighted by episode counts)."""
    sync_stats = sync.pop_stats()
    timer.totals["sync"] += sync_stats.get("sync/seconds", 0.0)  # part of `update`, shown separately
    times = timer.pop()
    stats: dict[str, float] = dict(metrics)
    stats.update(trainer.episodes.summary())
    trainer.episodes.clear()
    stats.update({f"time/{k}": v for k, v in times.items()})
    stats.update(sync_stats)
    stats = ctx.reduce_metrics(stats)
    stats["charts/learning_rate"] = lr
    stats["charts/SPS"] = sps
    stats["charts/update"] = update
    return stats


def evaluate_and_save(evaluation: Evaluation, checkpoints: Checkpoints, stats: dict[str, float], update: int,
                      global_step: int, best_ds: float, last: bool, stop: StopRequest | None = None) -> float:
    """Evaluate when due (best.pt on a new best) and write the checkpoints due; returns the best score so far.
    ``last``: the final update, one that spent the time budget, or one after which a stop was asked for: no evaluation
    then (the final evaluation scores the policy, or the loop saves last.pt and exits). With ``stop`` (one process), a
    signal during an evaluation cuts it short (it can take minutes)."""
    evaluating = evaluation.due(update) and not last
    files = checkpoints.due(update, last=last)
    if files or evaluating:  # every rank decides alike, so the state gather is collective
        checkpoints.gather()
    if evaluating:
        t_eval = time.perf_counter()
        try:
            with stop.at_once() if stop is not None else contextlib.nullcontext():
                result = evaluation.run(f"update_{update:06d}", update, global_step)
        except KeyboardInterrupt:
            if stop is None:  # several ranks: a second Ctrl-C aborts as anywhere else
                raise
            stop.requested, result = True, None  # the loop saves last.pt and exits
            print(f"\n{stop.signal_name} received during the evaluation of update {update}: it stopped; saving "
                  "last.pt", file=sys.stderr, flush=True)
        stats["time/eval"] = time.perf_counter() - t_eval
        if result is not None and headline(result) > best_ds:
            best_ds = headline(result)
            checkpoints.save("best.pt", update, global_step, best_ds)
    t_ck = time.perf_counter()
    for name in files:
        checkpoints.save(name, update, global_step, best_ds)
    stats["time/checkpoint"] = time.perf_counter() - t_ck
    return best_ds


def final_evaluation(evaluation: Evaluation, run_dir: Path, signature: dict[str, Any], update: int,
                     global_step: int) -> dict[str, dict[str, Any]]:
    """The final policy (``eval/final.json``) and the periodic evaluations' best.pt (``eval/final_best.json``) on the
    final evaluation's held-out routes (``logging.final_eval_episodes``): both reported, and best.pt kept only where
    it beats the final policy on these routes. Empty where evaluation is off."""
    final = evaluation.run("final", update, global_step, episodes=evaluation.final_episodes)
    if final is None:
        return {}
    trained = {"last": final}
    best_file = run_dir / "best.pt"
    if best_file.is_file():
        ck = ckpt_lib.load_checkpoint(best_file, signature)
        trained["best"] = evaluation.run("final_best", ck["update"], ck["global_step"],
                                         episodes=evaluation.final_episodes, weights=ck["model"])
    return trained


def write_logs(stats: dict[str, float], tb: TBLogger, video: VideoRecorder, bar: ProgressBar, cfg: TrainConfig,
               run_dir: Path, update: int, num_updates: int, global_step: int, last: bool,
               say: Callable[..., None]) -> None:
    """The update's video (when one was recorded), TensorBoard scalars and, when due, the summary line (``say``:
    print on rank 0)."""
    frames = video.take()
    if frames is not None:
        where = tb.video("video/bev_env0", frames, global_step, 10, run_dir / "videos" / f"update_{video.update:06d}.gif")
        stats["video/frames"] = float(len(frames))
        say(f"video: {where}", flush=True)
    tb.scalars(stats, global_step)
    tb.flush()
    if update % cfg.logging.summary_every == 0 or last:
        bar.clear()
        say(summary_line(update, num_updates, global_step, stats["charts/SPS"], stats), flush=True)


def _train(cfg: TrainConfig, ctx: DistContext, device: torch.device) -> int:
    check_world(cfg, ctx.world_size)
    lock = RunLock()  # rank 0 holds the run folder until this function returns, however it ends
    run_dir = ctx.run_on_main(lambda: claim_run_dir(cfg, lock), "run folder")
    try:
        return _train_in(cfg, ctx, device, run_dir)
    finally:
        lock.release()


def save_config(cfg: TrainConfig, run_dir: Path) -> None:
    """``<run dir>/config.yaml``: what a resume reloads."""
    from omegaconf import OmegaConf

    OmegaConf.save(OmegaConf.create(cfg.to_dict()), run_dir / "config.yaml")


def _train_in(cfg: TrainConfig, ctx: DistContext, device: torch.device, run_dir: Path) -> int:
    say = print if ctx.is_main else (lambda *_a, **_k: None)  # only rank 0 prints, logs and writes files
    if cfg.parallel.torch_threads:
        torch.set_num_threads(cfg.parallel.torch_threads)
    rank_seed = cfg.seed + 7919 * ctx.rank  # per-rank envs and sampling; rank 0 = the single-process seed
    seed_everything(rank_seed)

    # -- env, model, trainer (the env first: a rejected option must not leave a run folder behind) -----------------
    env = build_env(cfg, cfg.env.num_envs, device, rank_seed,
                    **rank_routes(cfg.env.options, cfg.env.num_envs, ctx.rank, ctx.world_size))
    policy = make_policy(env.observation_spec, env.action_spec.names, cfg.model).to(device)
    signature = policy.signature()
    teacher = (envs.make_expert(cfg.env.name, env, seen_only=cfg.ppo.teacher == "expert_seen")
               if cfg.ppo.teacher != "none" else None)
    # a resumed run's weights come from its own last.pt
    loaded = load_initial_weights(policy, cfg.init_from) if cfg.init_from and not cfg.resume else None
    cfg.run_dir = str(run_dir)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not cfg.resume:  # a resume keeps the saved one until last.pt accepted this config (below)
            save_config(cfg, run_dir)
    say(f"run folder: {run_dir}", flush=True)
    if loaded:
        say(loaded, flush=True)
    if use_compile(cfg, device.type == "cuda"):
        compile_network(policy)
    try:
        sync = make_sync(policy, ctx, cfg.parallel)  # one process: the no-op method (its stats only); DDP broadcasts rank 0's weights
    except ValueError as exc:
        raise ConfigError(f"rank {ctx.rank}: {exc}") from None
    timer = PhaseTimer(cuda_sync=device.type == "cuda")
    trainer = PPOTrainer(policy, env, cfg.ppo, timer, bf16=use_bf16(cfg, device.type == "cuda"),
                         sync=sync if ctx.distributed else None, ctx=ctx if ctx.distributed else None,
                         teacher=teacher)
    batch = cfg.batch_size * ctx.world_size  # samples per update, all ranks together
    num_updates = max(1, cfg.ppo.total_timesteps // batch)
    how = cfg.parallel.sync
    if cfg.parallel.hierarchical:
        node = cfg.parallel.node_size or ctx.local_world_size
        how += f" between {ctx.world_size // node} nodes of {node}, exact inside"
    ranks = f" | {ctx.world_size} ranks ({ctx.backend}, sync {how})" if ctx.distributed else ""
    say(f"{describe(policy)} | device {device} | env {cfg.env.name} x{cfg.env.num_envs}{ranks} | "
        f"{num_updates} updates x {batch} samples (minibatch {cfg.ppo.minibatch_size}, {cfg.ppo.update_epochs} epochs)",
        flush=True)

    checkpoints = Checkpoints(cfg, ctx, run_dir, policy, trainer, env, sync, signature)
    start_update, global_step, best_ds = 0, 0, float("-inf")
    if cfg.resume:
        start_update, global_step, best_ds = checkpoints.restore()
        if ctx.is_main:
            save_config(cfg, run_dir)
        say(f"resumed from {run_dir / 'last.pt'} at update {start_update} ({global_step:,} samples)", flush=True)
        trainer.reset(seed=None)
    else:
        trainer.reset(seed=rank_seed)  # each rank its own routes and traffic (docs/distributed.md)

    tb = TBLogger(run_dir / "tb", cfg.logging.tensorboard and ctx.is_main,
                  purge_step=global_step + 1 if cfg.resume else None)
    evaluation = Evaluation(cfg, ctx.is_main, run_dir, policy, tb,
                            lambda n, seed: build_env(cfg, n, device, seed, eval=True))
    stop = StopRequest()
    stop.install()
    # with several ranks, a stop is agreed on at update boundaries (all ranks stop at the same update)
    should_stop = (lambda: False) if ctx.distributed else stop
    bar = ProgressBar(cfg.ppo.total_timesteps, cfg.logging.progress_bar and ctx.is_main)
    video = VideoRecorder(cfg.logging.video_max_frames)
    progress = RunProgress(num_updates, cfg.ppo.train_for_seconds, checkpoints.seconds, ctx)
    if progress.budget:
        say(f"time budget: {progress.budget:,.1f} s (ppo.train_for_seconds; {progress.seconds:,.1f} s spent): the run "
            f"ends at update {num_updates} or when it is spent, the schedules follow whichever is further along",
            flush=True)

    # -- the loop: collect, update, log, evaluate, checkpoint ------------------------------------------------------
    t_begin, steps_this_run, status = time.perf_counter(), 0, "finished"
    update = start_update
    first = start_update + 1
    if cfg.resume and progress.spent():  # straight to the end (a fresh run trains at least one update)
        say(f"time budget already spent ({progress.seconds:,.1f} of {progress.budget:,.1f} s): nothing left to train; "
            "lift it with ppo.train_for_seconds=<more> or 0", flush=True)
        first = num_updates + 1
    for update in range(first, num_updates + 1):
        lr = trainer.set_schedule(progress.fraction(update))
        if cfg.logging.video_every and update % cfg.logging.video_every == 0:
            video.arm(update)
        t0 = time.perf_counter()
        on_step = rollout_progress(bar, video, f"update {update}/{num_updates} {progress.describe()}", global_step,
                                   steps_this_run, t_begin, cfg.env.num_envs)
        if not trainer.collect(should_stop=should_stop, on_step=on_step):
            update -= 1  # this rollout is discarded; last.pt holds the last completed update
            status = f"stopped by {stop.signal_name}"
            break
        with ctx.guard(f"update {update}"):
            metrics = trainer.update()
        global_step += batch
        steps_this_run += batch
        stats = update_stats(metrics, trainer, sync, timer, ctx, lr, batch / (time.perf_counter() - t0), update)
        if ctx.distributed and ctx.any(stop.requested):
            stop.requested, stop.signal_name = True, stop.signal_name or "a signal to another rank"
        progress.tick()
        last = update == num_updates or progress.spent()
        best_ds = evaluate_and_save(evaluation, checkpoints, stats, update, global_step, best_ds,
                                    last=stop.requested or last,
                                    stop=None if ctx.distributed else stop)  # ranks agree on a stop per update
        write_logs(stats, tb, video, bar, cfg, run_dir, update, num_updates, global_step, last, say)
        if stop.requested:
            status = f"stopped by {stop.signal_name}"
            break
        if progress.spent():
            say(f"time budget spent ({progress.seconds:,.1f} of {progress.budget:,.1f} s) after update {update} of "
                f"{num_updates} ({global_step:,} samples)", flush=True)
            break

    # -- the end: an interrupted run saves and says how to continue; a finished one is evaluated (rank 0) ----------
    bar.clear()
    if status != "finished":
        checkpoints.save("last.pt", update, global_step, best_ds)
        say(f"{status}: saved {run_dir / 'last.pt'} (update {update}, {global_step:,} samples); "
            f"continue with: carl-train resume={run_dir}", flush=True)
    elif ctx.is_main:
        try:  # the checkpoints are saved: a signal cuts the final evaluations short (never a checkpoint's write)
            with stop.at_once():
                trained = final_evaluation(evaluation, run_dir, signature, update, global_step)
            if trained:
                final, best = trained["last"], trained.get("best")
                if keeps_final(final, best):
                    best_ds = headline(final)
                    checkpoints.save("best.pt", update, global_step, best_ds)
                checkpoints.save("last.pt", update, global_step, best_ds)
                with stop.at_once():
                    evaluation.baselines({f"{k} ({v['update']})": v for k, v in trained.items()})
            if cfg.logging.final_benchmark:
                with stop.at_once():
                    run_benchmark(cfg, run_dir, device)
        except KeyboardInterrupt:
            say(f"{stop.signal_name or 'an interrupt'}: the final evaluation stopped; the checkpoints in {run_dir} are "
                f"saved (evaluate with: carl-eval policy={run_dir / 'best.pt'})", flush=True)
    tb.close()
    env.close()
    # every rank leaves together: a rank tearing down its process group while rank 0 still evaluates, or while
    # its last checkpoint-state gather is in flight, can abort gloo at exit ("terminate called ...")
    ctx.barrier("end of training")
    say(f"run folder: {run_dir}  ({time.perf_counter() - t_begin:.0f}s)", flush=True)
    return 0


# ------------------------------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------------------------------
class TrainCommand(Command):
    """``carl-train`` for :func:`carl.cli.run_command`: the run folder is ``run_dir`` (one run: else
    ``hydra.run.dir``; a sweep: ``hydra.sweep.dir/<job>``); the result is ``eval/final.json``."""

    name = "train"
    folder_key = "run_dir"
    groups = config.GROUPS
    errors = {  # noqa: RUF012
        ConfigError: ("config error", 2, ""), ckpt_lib.CheckpointError: ("checkpoint error", 2, ""),
        BundleError: ("bundle error", 2, ""),
        DistributedError: ("distributed error", 3, "; the last checkpoint (last.pt) is intact")}
    result_source = "eval/final.json"
    locks_folder = True

    def rewrite(self, overrides: list[str]) -> list[str]:
        """A resume is composed with the run's own env group, so that options only its backend has (nuPlan's
        ``data_root``, a custom factory's free keys) can be overridden."""
        resume = resume_of(overrides)
        if not resume or not (Path(resume) / "config.yaml").is_file() or any(
                o.lstrip("+").startswith("env=") for o in overrides):
            return overrides
        return [f"env={env_group(saved_config(resume))}", *overrides]

    def load(self, overrides: list[str]) -> TrainConfig:
        return train_config(overrides)

    def build(self, cfg: Any, overrides: list[str]) -> TrainConfig:
        if any(o.startswith("resume=") for o in overrides):  # the run's saved config, not conf/train.yaml
            return train_config(overrides)
        return config.to_train_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))

    def run(self, cfg: TrainConfig) -> int:
        return train(cfg)

    def execute(self, cfg: TrainConfig, job: Any) -> int:
        """In a cluster job of several GPUs or nodes (``hydra/launcher=slurm_node``...): the same run through
        torchrun, one rank per GPU, in this job's run folder."""
        from omegaconf import OmegaConf

        torchrun = sweep.torchrun_args(OmegaConf.to_container(job.launcher, resolve=True))
        if torchrun is None:
            return train(cfg)
        command = [*torchrun, "-m", "carl.train", *job.overrides.task, f"run_dir={quote(cfg.run_dir)}",
                   "hydra.output_subdir=null"]
        print("torchrun:", " ".join(command), flush=True)
        return subprocess.call(command)

    def folder(self, cfg: TrainConfig) -> str | None:
        return cfg.run_dir

    def with_folder(self, cfg: TrainConfig, folder: str) -> TrainConfig:
        cfg.run_dir = folder
        return cfg

    def check(self, cfg: TrainConfig) -> list[str]:
        if cfg.resume and not (Path(cfg.resume) / "last.pt").is_file():
            return [f"resume={cfg.resume}: {Path(cfg.resume) / 'last.pt'} does not exist (nothing to resume)"]
        return []

    def check_sweep(self, cfg: TrainConfig) -> list[str]:
        if cfg.resume:
            return [f"resume={cfg.resume} continues one run in its own folder: run it without -m (on a cluster as "
                    "one job, through torchrun for several GPUs: docs/distributed.md)"]
        return []

    def holds_run(self, folder: Path) -> bool:
        return (folder / "config.yaml").exists() or (folder / "last.pt").exists()

    def refuses(self, cfg: TrainConfig) -> bool:
        return not cfg.resume

    def show(self, cfg: TrainConfig, overrides: list[str]) -> dict[str, Any] | None:
        return cfg.to_dict() if cfg.resume else None  # a resumed run's saved config, as it will run

    def result(self, folder: Path) -> dict[str, Any] | None:
        """The final policy's evaluation, with the driving score of the best.pt the run kept (the higher of the final
        policy and the periodic best on the same routes) where it evaluated one."""
        final, best = folder / "eval" / "final.json", folder / "eval" / "final_best.json"
        if not final.is_file():
            return None
        result = json.loads(final.read_text())
        if best.is_file():  # the rule of the run's end
            periodic = json.loads(best.read_text())
            result["best_driving_score"] = (result if keeps_final(result, periodic) else periodic)["driving_score"]
        return result


def main(argv: list[str] | None = None) -> None:
    run_as_rank(lambda: run_command(TrainCommand(), argv))


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    from carl.train import main as _main  # this module under its own name: a cluster job unpickles it by that name

    _main()

"""``carl-train`` / ``python -m carl.train``: PPO training with CaRL's recipe.

Usage::

    carl-train +experiment=quick                       # laptop preset
    carl-train +experiment=carl_carla                  # CaRL's 300M setup (needs CARLA)
    carl-train +experiment=quick ppo.learning_rate=1e-4 run_dir=runs/mine
    carl-train resume=runs/quick-20250101-120000       # continue a run (counters, curves, RNG, env state)
    carl-train --cfg +experiment=quick                 # print the composed config and exit

The config is composed with Hydra's compose API from ``conf/train.yaml`` (no working-directory change, no
``outputs/`` folder), validated once (:mod:`carl.config`; errors exit with code 2) and saved to
``<run dir>/config.yaml``. The loop below is the whole algorithm: collect, update, log, evaluate, checkpoint.
"""
from __future__ import annotations

import importlib
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from carl import checkpoint as ckpt_lib
from carl.config import ConfigError, TrainConfig, check_device, from_dict, schema_keys, use_bf16
from carl.evaluate_loop import PolicyFactory, evaluate, expert_factory, random_policy, write_result
from carl.logging import PhaseTimer, ProgressBar, TBLogger, format_eval_table, summary_line
from carl.parallel import DistContext, DistributedError, init_distributed, make_sync
from carl.parallel.launch import check_resume_world, check_world
from carl.policy import CarlPolicy, describe
from carl.ppo import PPOTrainer
from envs.api import OBS_BEV, BatchedEnv

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
CONFIG_GROUPS = ("env", "model", "ppo", "parallel", "logging", "experiment")
FREE_FORM_PREFIXES = ("env.options.", "env.eval_options.", "hydra.")


# ------------------------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------------------------
def _check_override_keys(overrides: list[str]) -> None:
    """Give a clear error for ``key=value`` overrides of keys that do not exist (before Hydra's own message)."""
    import difflib

    known = set(schema_keys())
    for item in overrides:
        if "=" not in item or item.startswith(("+", "~", "--")):
            continue
        key = item.split("=", 1)[0]
        if key in CONFIG_GROUPS or key in known or key.startswith(FREE_FORM_PREFIXES):
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f"did you mean {close[0]}?" if close else "see `carl-train --cfg` for all keys"
        raise ConfigError(f"unknown key {key} (in override {item!r}); {hint}")


def compose_config(overrides: list[str]) -> dict[str, Any]:
    """Compose ``conf/train.yaml`` + overrides with Hydra and return a plain dict."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    _check_override_keys(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config_name="train", overrides=overrides)
        data = OmegaConf.to_container(cfg, resolve=True)
    except Exception as exc:  # noqa: BLE001 - Hydra/OmegaConf raise many types; all are user errors here
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{msg} (overrides: {' '.join(overrides) or 'none'})") from None
    assert isinstance(data, dict)
    return data


def load_config(overrides: list[str]) -> TrainConfig:
    """Compose (or, with ``resume=<dir>``, reload ``<dir>/config.yaml``), apply overrides, validate."""
    resume = next((o.split("=", 1)[1] for o in overrides if o.startswith("resume=")), None)
    if not resume:
        return from_dict(compose_config(overrides))
    from omegaconf import OmegaConf

    saved = Path(resume) / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"resume={resume}: {saved} does not exist; pass the run folder of an earlier run")
    rest = [o for o in overrides if not o.startswith("resume=")]
    groups = [o for o in rest if o.lstrip("+").split("=", 1)[0] in CONFIG_GROUPS]
    if groups:
        raise ConfigError(f"resume={resume} reuses the run's config; group selections {groups} are not allowed")
    _check_override_keys(rest)
    base = OmegaConf.load(saved)
    merged = OmegaConf.merge(base, OmegaConf.from_dotlist([o.lstrip("+") for o in rest]))
    data = OmegaConf.to_container(merged, resolve=True)
    assert isinstance(data, dict)
    data["resume"] = resume
    data["run_dir"] = resume
    return from_dict(data)


def resolve_device(cfg: TrainConfig) -> torch.device:
    check_device(cfg, torch.cuda.is_available())
    dev = cfg.parallel.device
    if dev == "auto":
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(dev)


def resolve_run_dir(cfg: TrainConfig) -> Path:
    """``run_dir`` or ``runs/<experiment>-<timestamp>``; refuse a folder that already holds a run unless resuming."""
    if cfg.resume:
        run_dir = Path(cfg.resume)
        if not (run_dir / "last.pt").is_file():
            raise ConfigError(f"resume={cfg.resume}: {run_dir / 'last.pt'} does not exist (nothing to resume)")
        return run_dir
    run_dir = Path(cfg.run_dir) if cfg.run_dir else Path("runs") / f"{cfg.experiment}-{time.strftime('%Y%m%d-%H%M%S')}"
    if (run_dir / "config.yaml").exists() or (run_dir / "last.pt").exists():
        raise ConfigError(
            f"run_dir={run_dir} already holds a run; continue it with resume={run_dir} or pick another run_dir="
        )
    return run_dir


# ------------------------------------------------------------------------------------------------------------------
# Environments
# ------------------------------------------------------------------------------------------------------------------
def build_env(cfg: TrainConfig, num_envs: int, device: torch.device, seed: int, eval: bool = False, **extra: Any) -> BatchedEnv:
    """``envs.make_env(env.name, ...)``, or ``module:function`` for a custom factory with the same signature."""
    options = dict(cfg.env.options)
    if eval:
        options.update(cfg.env.eval_options)
    options.update(extra)
    name = cfg.env.name
    try:
        if ":" in name:
            module, fn = name.split(":", 1)
            factory = getattr(importlib.import_module(module), fn)
            return factory(num_envs=num_envs, device=device, seed=seed, **options)
        import envs

        return envs.make_env(name, num_envs=num_envs, device=device, seed=seed, **options)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"env.name={name!r} cannot be created: {exc}") from None
    except (TypeError, ValueError) as exc:  # backends reject unknown/invalid options with these
        raise ConfigError(f"env {name!r} rejected its options {options}: {exc}") from None


# ------------------------------------------------------------------------------------------------------------------
# Signals and videos
# ------------------------------------------------------------------------------------------------------------------
class StopRequest:
    """SIGINT/SIGTERM set a flag; the loop finishes the current env step, saves last.pt and exits 0."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.requested and signum == signal.SIGINT:  # a second Ctrl-C aborts at once
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        print(f"\n{self.signal_name} received: finishing the current step, then saving last.pt", file=sys.stderr, flush=True)

    def __call__(self) -> bool:
        return self.requested


class VideoRecorder:
    """Records env 0's BEV for one whole episode (starting at its next reset) when armed."""

    def __init__(self, max_frames: int) -> None:
        self.max_frames = max_frames
        self.render: Callable[[Any], np.ndarray] | None = None
        try:
            from envs.sim.render import bev_to_rgb  # type: ignore[import-not-found]

            self.render = bev_to_rgb
        except ImportError:
            pass
        self.state = "idle"  # idle -> waiting (for env 0's reset) -> recording -> ready
        self.frames: list[np.ndarray] = []
        self.update = 0

    def arm(self, update: int) -> None:
        if self.render is not None and self.state == "idle":
            self.state, self.frames, self.update = "waiting", [], update

    def on_step(self, obs: dict[str, torch.Tensor], done: torch.Tensor) -> None:
        if self.state == "recording":
            self.frames.append(np.asarray(self.render(obs[OBS_BEV][0].cpu().numpy())))  # type: ignore[misc]
            if bool(done[0]) or len(self.frames) >= self.max_frames:
                self.state = "ready"
        elif self.state == "waiting" and bool(done[0]):
            self.state = "recording"
            self.frames = [np.asarray(self.render(obs[OBS_BEV][0].cpu().numpy()))]  # type: ignore[misc]

    def take(self) -> np.ndarray | None:
        if self.state != "ready":
            return None
        self.state = "idle"
        return np.stack(self.frames).astype(np.uint8)


# ------------------------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_benchmark(cfg: TrainConfig, run_dir: Path, device: torch.device) -> dict[str, Any]:
    """``carl-eval policy=<run>/best.pt benchmark=<logging.final_benchmark>`` into ``<run>/eval/<benchmark>``."""
    from carl import evaluate as carl_eval

    name = cfg.logging.final_benchmark
    print(f"benchmark {name} (its own conditions) on {run_dir / 'best.pt'}:", flush=True)
    eval_cfg = carl_eval.compose("eval", [f"benchmark={name}", f"policy={run_dir / 'best.pt'}",
                                          f"out_dir={run_dir / 'eval' / name}", f"device={device}", "overwrite=true"])
    return carl_eval.run(eval_cfg)


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


def _train(cfg: TrainConfig, ctx: DistContext, device: torch.device) -> int:
    from omegaconf import OmegaConf

    check_world(cfg, ctx.world_size)
    run_dir = ctx.run_on_main(lambda: resolve_run_dir(cfg), "run folder")
    say = print if ctx.is_main else (lambda *_a, **_k: None)  # only rank 0 prints, logs and writes files
    if cfg.parallel.torch_threads:
        torch.set_num_threads(cfg.parallel.torch_threads)
    rank_seed = cfg.seed + 7919 * ctx.rank  # per-rank envs and sampling; rank 0 = the single-process seed
    seed_everything(rank_seed)

    # -- env, model, trainer (the env first: a rejected option must not leave a run folder behind) -----------------
    env = build_env(cfg, cfg.env.num_envs, device, rank_seed)
    cfg.run_dir = str(run_dir)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(cfg.to_dict()), run_dir / "config.yaml")
    say(f"run folder: {run_dir}", flush=True)
    policy = CarlPolicy(env.observation_spec, env.action_spec.shape[0], cfg.model.features_dim,
                        cfg.model.hidden_dim, cfg.model.fusion_dim, cfg.model.min_final_size).to(device)
    signature = policy.signature()
    if cfg.parallel.compile:
        policy.compile()
    sync = None
    if ctx.distributed:
        try:
            sync = make_sync(policy, ctx, cfg.parallel)  # DDP broadcasts rank 0's weights
        except ValueError as exc:
            raise ConfigError(f"rank {ctx.rank}: {exc}") from None
    timer = PhaseTimer(cuda_sync=device.type == "cuda")
    trainer = PPOTrainer(policy, env, cfg.ppo, timer, bf16=use_bf16(cfg, device.type == "cuda"), sync=sync,
                         ctx=ctx if ctx.distributed else None)
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

    start_update, global_step, best_ds = 0, 0, float("-inf")
    if cfg.resume:
        ck = ckpt_lib.load_checkpoint(run_dir / "last.pt", signature, map_location=device)
        check_resume_world(int(ck["extra"].get("world_size", 1)), ctx.world_size, str(run_dir / "last.pt"))
        ckpt_lib.restore(ck, policy, trainer.optimizer)
        if ctx.distributed:  # this rank's own env and RNG state; the sync method's shared state
            own = ck["extra"]["ranks"][ctx.rank]
            env.load_state_dict(own["env"])
            ckpt_lib.restore_rng(own["rng"])
            assert sync is not None
            sync.load_state_dict(ck["extra"].get("sync", {}))
            sync.load_rank_state_dict(own.get("sync", {}))  # error-feedback residuals
        else:
            env.load_state_dict(ck["env"])
        start_update, global_step = ck["update"], ck["global_step"]
        best_ds = ck["extra"].get("best_driving_score", best_ds)
        say(f"resumed from {run_dir / 'last.pt'} at update {start_update} ({global_step:,} samples)", flush=True)
        trainer.reset(seed=None)
    else:
        trainer.reset(seed=cfg.seed)

    tb = TBLogger(run_dir / "tb", cfg.logging.tensorboard and ctx.is_main,
                  purge_step=global_step + 1 if cfg.resume else None)
    stop = StopRequest()
    stop.install()
    # with several ranks, a stop is agreed on at update boundaries (all ranks stop at the same update)
    should_stop = (lambda: False) if ctx.distributed else stop
    bar = ProgressBar(cfg.ppo.total_timesteps, cfg.logging.progress_bar and ctx.is_main)
    rank_states: list[dict[str, Any]] = []  # every rank's env, RNG and sync state, gathered on rank 0 for checkpoints
    video = VideoRecorder(cfg.logging.video_max_frames)
    eval_seed = cfg.seed + 1_000_003

    def make_eval_env(n: int) -> BatchedEnv:
        return build_env(cfg, n, device, eval_seed, eval=True)

    def save(name: str, update: int) -> None:
        if not ctx.is_main:
            return
        extra: dict[str, Any] = {"best_driving_score": best_ds}
        if ctx.distributed:
            assert sync is not None
            extra.update(world_size=ctx.world_size, ranks=rank_states, sync=sync.state_dict())
        payload = ckpt_lib.make_checkpoint(policy, trainer.optimizer, update, global_step, signature, cfg.to_dict(),
                                           env.state_dict(), extra)
        ckpt_lib.atomic_save(payload, run_dir / name)

    def run_eval(name: str, update: int) -> dict[str, Any] | None:
        if cfg.logging.eval_episodes == 0 or not ctx.is_main:
            return None
        policy.eval()
        result = evaluate(make_eval_env, lambda _env: policy.deterministic_action, cfg.logging.eval_episodes,
                          cfg.logging.eval_max_steps, eval_seed)
        result.update(update=update, global_step=global_step)
        write_result(result, run_dir / "eval" / f"{name}.json")
        scalars = {f"eval/{k}": result[k] for k in ("driving_score", "route_completion", "infraction_score", "return")}
        scalars.update({f"eval/infractions_per_km/{k}": v for k, v in result["infractions_per_km"].items()})
        tb.scalars(scalars, global_step)
        return result

    # -- the loop -------------------------------------------------------------------------------------------------
    t_begin, steps_this_run, status = time.perf_counter(), 0, "finished"
    update = start_update
    for update in range(start_update + 1, num_updates + 1):
        lr = trainer.set_learning_rate(update, num_updates)
        if cfg.logging.video_every and update % cfg.logging.video_every == 0:
            video.arm(update)
        t0 = time.perf_counter()
        step_count = 0

        def on_step(obs: dict[str, torch.Tensor], done: torch.Tensor) -> None:
            nonlocal step_count
            step_count += 1
            video.on_step(obs, done)
            done_samples = global_step + step_count * cfg.env.num_envs
            elapsed = time.perf_counter() - t_begin
            bar.update(done_samples, (steps_this_run + step_count * cfg.env.num_envs) / max(elapsed, 1e-9),
                       f"update {update}/{num_updates}")

        if not trainer.collect(should_stop=should_stop, on_step=on_step):
            update -= 1  # this rollout is discarded; last.pt holds the last completed update
            status = f"stopped by {stop.signal_name}"
            break
        with ctx.guard(f"update {update}"):
            metrics = trainer.update()
        global_step += batch
        steps_this_run += batch
        iter_time = time.perf_counter() - t0
        sync_stats = sync.pop_stats() if sync is not None else {}
        timer.totals["sync"] += sync_stats.get("sync/seconds", 0.0)  # part of `update`, shown separately
        times = timer.pop()

        stats: dict[str, float] = dict(metrics)
        stats.update(trainer.episodes.summary())
        trainer.episodes.clear()
        stats.update({f"time/{k}": v for k, v in times.items()})
        stats.update(sync_stats)
        stats = ctx.reduce_metrics(stats)  # means over ranks (episode means weighted by episode counts)
        stats["charts/learning_rate"] = lr
        stats["charts/SPS"] = batch / iter_time
        stats["charts/update"] = update
        if ctx.distributed and ctx.any(stop.requested):
            stop.requested, stop.signal_name = True, stop.signal_name or "a signal to another rank"

        if (cfg.logging.eval_every and update % cfg.logging.eval_every == 0) and update != num_updates:
            t_eval = time.perf_counter()
            result = run_eval(f"update_{update:06d}", update)
            stats["time/eval"] = time.perf_counter() - t_eval
            if result is not None and result["driving_score"] > best_ds:
                best_ds = result["driving_score"]
                save("best.pt", update)
        t_ck = time.perf_counter()
        if ctx.distributed:  # same decision on every rank: gather env/RNG states when any file may be written
            if (update % cfg.logging.checkpoint_last_every == 0 or stop.requested or update == num_updates
                    or (cfg.logging.checkpoint_every and update % cfg.logging.checkpoint_every == 0)
                    or (cfg.logging.eval_every and update % cfg.logging.eval_every == 0)):
                rank_states = ctx.gather_to_main({"env": env.state_dict(), "rng": ckpt_lib.capture_rng(),
                                                  "sync": sync.rank_state_dict() if sync is not None else {}},
                                                 "checkpoint state")
        if update % cfg.logging.checkpoint_last_every == 0 or stop.requested or update == num_updates:
            save("last.pt", update)
        if cfg.logging.checkpoint_every and update % cfg.logging.checkpoint_every == 0:
            save(f"update_{update:06d}.pt", update)
        stats["time/checkpoint"] = time.perf_counter() - t_ck

        frames = video.take()
        if frames is not None:
            where = tb.video("video/bev_env0", frames, global_step, 10, run_dir / "videos" / f"update_{video.update:06d}.gif")
            stats["video/frames"] = float(len(frames))
            say(f"video: {where}", flush=True)

        tb.scalars(stats, global_step)
        tb.flush()
        if update % cfg.logging.summary_every == 0 or update == num_updates:
            bar.clear()
            say(summary_line(update, num_updates, global_step, stats["charts/SPS"], stats), flush=True)
        if stop.requested:
            status = f"stopped by {stop.signal_name}"
            break

    bar.clear()
    if status != "finished":
        save("last.pt", update)
        say(f"{status}: saved {run_dir / 'last.pt'} (update {update}, {global_step:,} samples); "
              f"continue with: carl-train resume={run_dir}", flush=True)
    elif ctx.is_main:
        # -- final evaluation and baselines (rank 0 only) --------------------------------------------------------
        final = run_eval("final", update)
        if final is not None:
            if final["driving_score"] > best_ds:
                best_ds = final["driving_score"]
                save("best.pt", update)
            save("last.pt", update)
            results: dict[str, dict[str, Any]] = {"trained": final}
            if cfg.logging.final_baselines:
                baselines: dict[str, PolicyFactory] = {"random": random_policy}
                expert = None if ":" in cfg.env.name else expert_factory(cfg.env.name)
                if expert is not None:
                    baselines["expert"] = expert
                for name, factory in baselines.items():
                    results[name] = evaluate(make_eval_env, factory, cfg.logging.eval_episodes,
                                             cfg.logging.eval_max_steps, eval_seed)
                write_result(results, run_dir / "eval" / "baselines.json")
                if expert is None and ":" not in cfg.env.name:
                    print(f"(no expert for env {cfg.env.name!r}: envs.{cfg.env.name}.expert.make_expert not found)")
            print(f"final evaluation on {cfg.logging.eval_episodes} held-out routes:\n{format_eval_table(results)}")
        if cfg.logging.final_benchmark:
            run_benchmark(cfg, run_dir, device)
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
def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        sys.exit(0)
    print_cfg = "--cfg" in argv
    overrides = [a for a in argv if a != "--cfg"]
    try:
        cfg = load_config(overrides)
        if print_cfg:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict())))
            sys.exit(0)
        code = train(cfg)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        sys.exit(2)
    except ckpt_lib.CheckpointError as exc:
        print(f"checkpoint error: {exc}", file=sys.stderr)
        sys.exit(2)
    except DistributedError as exc:
        print(f"distributed error: {exc}; the last checkpoint (last.pt) is intact", file=sys.stderr)
        sys.exit(3)
    sys.exit(code)


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    main()

"""Training throughput: one JSON line per preset with samples/s and seconds per phase (per update).

    python scripts/bench_train.py                 # quick preset + CaRL's model at 10x256x256, on CPU
    python scripts/bench_train.py --device cuda   # same on the GPU
    python scripts/bench_train.py --updates 3 --preset quick

Each preset runs one warm-up update (not timed) and ``--updates`` timed updates of the real trainer (rollout +
PPO update). If the configured env cannot be built (e.g. the simulator is missing), the test fake env with the same
BEV size is used and the line says ``"env": "fake"``. With ``parallel.compile=true`` among the overrides (or ``auto``
on a CPU with AMX) the network compiles during the warm-up update (``"compiled": true`` in the line).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from carl.config import ConfigError, TrainConfig, check_device, cpu_line, use_bf16, use_compile  # noqa: E402
from carl.monitor import PhaseTimer  # noqa: E402
from carl.policy import compile_network, make_policy  # noqa: E402
from carl.ppo import PPOTrainer  # noqa: E402
from carl.cli import load_config  # noqa: E402
from carl.train import build_env  # noqa: E402

PRESETS: dict[str, list[str]] = {
    # the laptop preset as `make train` runs it, but only a few updates
    "quick": ["+experiment=quick"],
    # its twin on the vector path: entity sets and the set-encoder policy (model.name=set)
    "quick_vector": ["+experiment=quick_vector"],
    # CaRL's network at its native 10x256x256, few envs and steps so CPU finishes in about a minute
    "carl_256": [
        "+experiment=quick", "env.options.bev_size=256", "env.options.bev_ppm=2.0", "env.num_envs=4",
        "ppo.num_steps=32", "ppo.minibatch_size=64", "ppo.update_epochs=1",
    ],
    # the laptop recipe for the benchmark towns (multi-map world of Town01-06)
    "towns": ["+experiment=towns"],
    # the best recipe so far (issue #25): the vector path on the towns with the expert's cloning term beside PPO
    "towns_vector_clone": ["+experiment=towns_vector_clone"],
    # CaRL's real shape for one GPU: 10x256x256, 1024 envs x 64 steps = 65,536 samples per update, minibatch 16,384,
    # 3 epochs, Town01-07 + Town10HD (GPU only: one update takes minutes on a CPU). One GPU holds what one of
    # CaRL's 8 ranks holds: 8 micro-batches of 2,048 (the float BEV of 16,384 samples alone is 43 GB)
    "carl_sim": ["+experiment=carl_sim", "env.num_envs=1024", "ppo.accumulation_steps=8"],
}
GPU_ONLY = ("carl_sim",)


def bench(name: str, overrides: list[str], device: str, updates: int) -> dict:
    cfg: TrainConfig = load_config("train", [*overrides, f"parallel.device={device}"])
    dev = torch.device(device)
    if cfg.parallel.torch_threads:
        torch.set_num_threads(cfg.parallel.torch_threads)
    env_name = cfg.env.name
    try:
        env = build_env(cfg, cfg.env.num_envs, dev, cfg.seed)
    except (ConfigError, Exception) as exc:  # noqa: BLE001 - any failure: fall back to the fake env
        from tests.fake_env import make_fake_env

        print(f"[{name}] env {env_name!r} unavailable ({exc}); using the fake env", file=sys.stderr)
        env = make_fake_env(cfg.env.num_envs, dev, cfg.seed, bev_size=int(cfg.env.options.get("bev_size", 128)))
        env_name = "fake"
    policy = make_policy(env.observation_spec, env.action_spec.names, cfg.model).to(dev)
    timer = PhaseTimer(cuda_sync=dev.type == "cuda")
    check_device(cfg, torch.cuda.is_available())
    compiled = use_compile(cfg, dev.type == "cuda")
    if compiled:  # compiled during the warm-up update
        compile_network(policy)
    bf16 = use_bf16(cfg, dev.type == "cuda")
    trainer = PPOTrainer(policy, env, cfg.ppo, timer, bf16=bf16)
    trainer.reset(seed=cfg.seed)
    trainer.collect()
    trainer.update()
    timer.pop()
    t0 = time.perf_counter()
    for _ in range(updates):
        trainer.collect()
        trainer.update()
    wall = time.perf_counter() - t0
    phases = timer.pop()
    samples = updates * cfg.batch_size
    return {
        "preset": name,
        "device": str(dev),
        "env": env_name,
        "model": cfg.model.name,
        "observation": {k: list(v.shape) for k, v in env.observation_spec.items()},
        "num_envs": cfg.env.num_envs,
        "num_steps": cfg.ppo.num_steps,
        "params": policy.num_params(),
        "samples_per_s": round(samples / wall, 1),
        "s_per_update": round(wall / updates, 3),
        "env_s": round(phases["env"] / updates, 3),
        "inference_s": round(phases["inference"] / updates, 3),
        "update_s": round(phases["update"] / updates, 3),
        "threads": torch.get_num_threads(),
        "bf16": bf16,
        "compiled": compiled,
        "cpu": cpu_line(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--updates", type=int, default=2, help="timed updates per preset")
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), help="default: all")
    parser.add_argument("overrides", nargs="*", help="config overrides applied after each preset's, e.g. "
                                                     "env.num_envs=512")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda requested but CUDA is not available")
    default = [p for p in PRESETS if args.device.startswith("cuda") or p not in GPU_ONLY]
    for name in args.preset or default:
        print(json.dumps(bench(name, [*PRESETS[name], *args.overrides], args.device, args.updates)), flush=True)


if __name__ == "__main__":
    main()

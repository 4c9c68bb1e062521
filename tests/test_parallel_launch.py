"""``torchrun --nproc_per_node=2 -m carl.train`` on the fake env (gloo, CPU): run, resume, bad layouts."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from carl.config import ConfigError, TrainConfig
from carl.parallel.launch import check_world

REPO = Path(__file__).resolve().parent.parent
TINY = [
    "env.name=tests.fake_env:make_fake_env", "env.num_envs=2", "env.options.bev_size=24",
    "++env.options.bev_channels=3", "++env.options.episode_length=8", "ppo.num_steps=8", "ppo.minibatch_size=8",
    "ppo.update_epochs=1", "ppo.total_timesteps=64", "logging.eval_episodes=1", "logging.eval_max_steps=20",
    "logging.final_baselines=false", "parallel.torch_threads=1",
]


def torchrun(args: list[str], nproc: int = 2, timeout: float = 120) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
           "-m", "carl.train", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_torchrun_train_resume_and_world_size_check(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = torchrun([*TINY, "parallel.sync=powersgd", f"run_dir={run_dir}"])
    assert first.returncode == 0, first.stdout + first.stderr
    assert "2 ranks (gloo, sync powersgd)" in first.stdout and "2 updates x 32 samples" in first.stdout
    assert first.stdout.count("update 2/2") == 1  # only rank 0 prints
    ck = torch.load(run_dir / "last.pt", weights_only=False)
    assert ck["extra"]["world_size"] == 2 and len(ck["extra"]["ranks"]) == 2 and ck["global_step"] == 64
    errors = [r["sync"]["error"] for r in ck["extra"]["ranks"]]  # each rank's own error-feedback residuals
    assert errors[0] and errors[0].keys() == errors[1].keys() and ck["extra"]["sync"]["step"] == 8
    assert any(not torch.equal(errors[0][k], errors[1][k]) for k in errors[0])

    resumed = torchrun([f"resume={run_dir}", "ppo.total_timesteps=128"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "at update 2" in resumed.stdout and "update 4/4" in resumed.stdout

    single = subprocess.run([sys.executable, "-m", "carl.train", f"resume={run_dir}", "ppo.total_timesteps=256"],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                            timeout=120)
    assert single.returncode == 2 and "world size 2" in single.stderr and "world size 1" in single.stderr


def test_global_minibatch_must_split_evenly() -> None:
    cfg = TrainConfig()
    cfg.ppo.minibatch_size = 10
    with pytest.raises(ConfigError, match=r"ppo.minibatch_size=10 \(the global minibatch\) must be divisible by the world size 4"):
        check_world(cfg, 4)
    cfg.ppo.minibatch_size, cfg.ppo.accumulation_steps = 8, 4
    with pytest.raises(ConfigError, match="accumulation_steps=4 must divide each rank's share"):
        check_world(cfg, 4)
    check_world(cfg, 2)

"""End to end through the CLI (`python -m carl.train`) on the fake env: run, resume, refusal, SIGINT."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
TINY = [
    "env=custom",  # free options: ++ adds them
    "env.name=tests.fake_env:make_fake_env",
    "env.num_envs=2",
    "++env.options.bev_size=24",
    "++env.options.bev_channels=3",
    "++env.options.episode_length=8",
    "ppo.num_steps=8",
    "ppo.minibatch_size=8",
    "ppo.update_epochs=1",
    "ppo.total_timesteps=32",  # 2 updates of 16 samples
    "logging.eval_episodes=2",
    "logging.eval_max_steps=50",
    "parallel.torch_threads=1",
]


def run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "carl.train", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_train_resume_and_refuse(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = run([*TINY, f"run_dir={run_dir}"])
    assert first.returncode == 0, first.stderr
    assert "update 2/2" in first.stdout and f"run folder: {run_dir}" in first.stdout
    for name in ("config.yaml", "last.pt", "eval/final.json", "eval/baselines.json"):
        assert (run_dir / name).is_file(), name
    final = json.loads((run_dir / "eval/final.json").read_text())
    assert final["episodes"] == 2 and {"driving_score", "route_completion", "infraction_score"} <= set(final)
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "tb").iterdir())

    # the same run dir without resume is refused with exit code 2
    again = run([*TINY, f"run_dir={run_dir}"])
    assert again.returncode == 2 and "already holds a run" in again.stderr and "resume=" in again.stderr

    # resume continues the update counter up to the new total
    resumed = run([f"resume={run_dir}", "ppo.total_timesteps=64"])
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "at update 2" in resumed.stdout
    assert "update 3/4" in resumed.stdout and "update 4/4" in resumed.stdout
    assert torch.load(run_dir / "last.pt", weights_only=False)["update"] == 4


def test_config_error_exit_code(tmp_path: Path) -> None:
    bad = run([*TINY, "ppo.minibatch_size=7", f"run_dir={tmp_path / 'x'}"])
    assert bad.returncode == 2
    assert "ppo.minibatch_size=7 must divide the batch" in bad.stderr and "Traceback" not in bad.stderr


def test_sigint_saves_and_exits_zero(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [*TINY, "ppo.total_timesteps=100000", "logging.eval_episodes=0", f"run_dir={run_dir}"]
    proc = subprocess.Popen([sys.executable, "-m", "carl.train", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not (run_dir / "last.pt").exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "SIGINT received" in err and "saved" in out and "resume=" in out
    assert torch.load(run_dir / "last.pt", weights_only=False)["update"] >= 1

"""The nuPlan env on the synthetic dataset: batched steps, log replay, bicycle model, reactive mode, training."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from envs.nuplan.env import EGO_HALF, NuplanEnv, make_nuplan_env
from envs.nuplan.synthetic import make_synthetic_dataset
from envs.config import ConfigError

pytestmark = pytest.mark.nuplan
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = make_synthetic_dataset(tmp_path_factory.mktemp("nuplan"), num_logs=2)
    return root, tmp_path_factory.mktemp("cache")


def small(data, **kw) -> NuplanEnv:
    root, cache = data
    return make_nuplan_env(3, "cpu", 0, cache_dir=str(cache), data_root=str(root), sim={"bev_size": 32, "bev_ego_from_bottom": 12}, **kw)


def test_env_steps_and_replays_the_log(data):
    env = small(data, route_split="eval")
    obs = env.reset(seed=1)
    assert obs["bev"].shape == (3, 10, 32, 32)
    s = env.state
    assert s.scenario.tolist() == [0, 1, 2]
    # the ego starts at the logged pose; vehicles follow the log frame by frame
    log_xy = env.log_veh[s.scenario, 5, :, :2]
    for _ in range(5):
        res = env.step(torch.zeros(3, 2))
    assert torch.allclose(env.state.veh.xy[:3], log_xy, atol=1e-4)
    assert res.reward.shape == (3,) and torch.isfinite(res.reward).all()


def test_bicycle_model_and_action_mapping(data):
    env = small(data, route_split="eval")
    env.reset()
    s = env.state
    s.ego_speed[:] = 5.0
    s.ego_accel[:] = 0.0
    s.ego_steer[:] = 0.0
    y0, xy0 = s.ego_yaw.clone(), s.ego_xy.clone()
    env.ego.step(s, torch.tensor([[0.0, 1.0]] * 3))
    # first-order lag: a = 0 + 0.1 / 0.3 * 2.4; straight ahead by v * dt
    assert torch.allclose(s.ego_accel, torch.full((3,), 0.8))
    assert torch.allclose(s.ego_speed, torch.full((3,), 5.08))
    assert torch.allclose((s.ego_xy - xy0).norm(dim=-1), torch.full((3,), 0.5), atol=1e-5)
    env.ego.step(s, torch.tensor([[1.0, -1.0]] * 3))
    # steering lag 0.05 s: δ = 0 + 0.1/0.15 * 0.8378 (first step turns nothing, heading uses the old angle)
    assert torch.allclose(s.ego_steer, torch.full((3,), 0.1 / 0.15 * 0.83775804), atol=1e-5)
    assert torch.allclose(s.ego_yaw, y0, atol=1e-6)
    # reverse guard: from standstill a brake command does not drive backwards
    s.ego_speed[:] = 0.0
    s.ego_accel[:] = 0.0
    env.ego.step(s, torch.tensor([[0.0, -1.0]] * 3))
    assert (s.ego_speed >= 0).all()
    assert env.ego_half[0].tolist() == pytest.approx(list(EGO_HALF))


def test_episodes_end_and_reset(data):
    env = small(data)
    env.reset(seed=0)
    ends = 0
    for _ in range(155):
        res = env.step(torch.tensor([[0.0, -0.2]] * 3))
        ends += int((res.terminated | res.truncated).sum())
    assert ends >= 3  # every scenario ends at iteration T-2 (≈ 15 s) at the latest
    assert (env.state.steps < 150).all()


def test_reactive_mode(data):
    env = small(data, reactive=True)
    env.reset(seed=0)
    for _ in range(10):
        res = env.step(torch.zeros(3, 2))
    assert torch.isfinite(res.reward).all() and env.state.veh.valid.any()


def test_bad_options(data):
    root, cache = data
    with pytest.raises(ConfigError, match="route_split"):
        make_nuplan_env(1, cache_dir=str(cache), route_split="test")
    with pytest.raises(ConfigError, match="unknown key"):
        make_nuplan_env(1, cache_dir=str(cache), nonsense=1)


def test_carl_train_runs_ppo_updates(data, tmp_path):
    root, cache = data
    args = ["env=nuplan", "env.num_envs=2", f"env.options.cache_dir={cache}", f"env.options.data_root={root}",
            "env.options.sim.bev_size=32", "++env.options.sim.bev_ego_from_bottom=12", "ppo.num_steps=8", "ppo.minibatch_size=8", "ppo.update_epochs=1",
            "ppo.total_timesteps=32", "logging.eval_episodes=1", "logging.eval_max_steps=10",
            "parallel.torch_threads=1", f"run_dir={tmp_path / 'run'}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "carl.train", *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert any((tmp_path / "run").rglob("*.pt")) or any((tmp_path / "run").rglob("*.json"))

"""The nuPlan env on the synthetic dataset: batched steps, log replay, bicycle model, reactive mode, training."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from envs.nuplan.env import EGO_HALF, make_nuplan_env
from envs.sim.env import SimEnv
from envs.nuplan.synthetic import make_synthetic_dataset
from envs.config import ConfigError

pytestmark = pytest.mark.nuplan
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = make_synthetic_dataset(tmp_path_factory.mktemp("nuplan"), num_logs=2)
    return root, tmp_path_factory.mktemp("cache")


def small(data, **kw) -> SimEnv:
    root, cache = data
    return make_nuplan_env(3, "cpu", 0, cache_dir=str(cache), data_root=str(root), sim={"bev_size": 32, "bev_ego_from_bottom": 12}, **kw)


def test_env_steps_and_replays_the_log(data):
    env = small(data, route_split="eval")
    obs = env.reset(seed=1)
    assert obs["bev"].shape == (3, 9, 32, 32)  # CaRL nuPlan: 9 channels
    assert obs["measurements"].shape == (3, 10) and obs["value_measurements"].shape == (3, 4)
    s = env.state
    assert s.scenario.tolist() == [0, 1, 2]
    # the ego starts at the logged pose; vehicles follow the log frame by frame
    log_xy = env.data.log_veh[s.scenario, 5, :, :2]
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
    env.ego.step(s, torch.tensor([[1.0, 0.0]] * 3))  # CaRL's nuPlan order: (acceleration, steering angle)
    # first-order lag: a = 0 + 0.1 / 0.3 * 2.4; straight ahead by v * dt
    assert torch.allclose(s.ego_accel, torch.full((3,), 0.8))
    assert torch.allclose(s.ego_speed, torch.full((3,), 5.08))
    assert torch.allclose((s.ego_xy - xy0).norm(dim=-1), torch.full((3,), 0.5), atol=1e-5)
    env.ego.step(s, torch.tensor([[-1.0, 1.0]] * 3))
    # steering lag 0.05 s: δ = 0 + 0.1/0.15 * 0.8378 (first step turns nothing, heading uses the old angle)
    assert torch.allclose(s.ego_steer, torch.full((3,), 0.1 / 0.15 * 0.83775804), atol=1e-5)
    assert torch.allclose(s.ego_yaw, y0, atol=1e-6)
    # reverse guard: from standstill a brake command does not drive backwards
    s.ego_speed[:] = 0.0
    s.ego_accel[:] = 0.0
    env.ego.step(s, torch.tensor([[-1.0, 0.0]] * 3))
    assert (s.ego_speed >= 0).all()
    assert env.ego_half[0].tolist() == pytest.approx(list(EGO_HALF))
    # the CARLA order, (steer, acceleration), when asked for
    env = small(data, route_split="eval", action_order=["steer", "accel"])
    env.reset()
    s = env.state
    s.ego_accel[:] = 0.0
    env.ego.step(s, torch.tensor([[0.0, 1.0]] * 3))
    assert torch.allclose(s.ego_accel, torch.full((3,), 0.8))


def test_episodes_end_and_reset(data):
    env = small(data)
    env.reset(seed=0)
    ends = 0
    for _ in range(155):
        res = env.step(torch.tensor([[-0.2, 0.0]] * 3))
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


def test_carl_nuplan_preset_trains_and_its_bundle_drives_the_planner_adapter(data, tmp_path):
    """+experiment=carl_nuplan: a few PPO updates on the synthetic set with CaRL's nuPlan reward and observation;
    the exported bundle runs through the devkit planner adapter's observation path."""
    root, cache = data
    args = ["+experiment=carl_nuplan", "env.num_envs=2", f"env.options.cache_dir={cache}",
            f"env.options.data_root={root}", "env.options.sim.bev_size=32", "env.options.sim.bev_ego_from_bottom=12",
            "ppo.num_steps=8", "ppo.minibatch_size=8", "ppo.update_epochs=1", "ppo.total_timesteps=32",
            "logging.eval_episodes=1", "logging.eval_max_steps=10", "parallel.torch_threads=1",
            f"run_dir={tmp_path / 'run'}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "carl.train", *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "update 2/2" in out.stdout, out.stdout[-2000:]
    import carl
    from carl.bundle import action_names, observation_layout
    from carl.export import export_bundle
    from carl.deploy import nuplan_planner as dp
    from envs.nuplan.nuplan_map import load_location

    export_bundle(tmp_path / "run" / "last.pt", tmp_path / "bundle", onnx=False)
    policy, spec = carl.load_policy(tmp_path / "bundle")
    assert observation_layout(spec) == "nuplan" and action_names(spec) == ("accel", "steer")
    assert spec["observations"]["bev"]["shape"] == [9, 32, 32]
    m = load_location(root / "maps", next(p.name for p in (root / "maps").iterdir() if p.is_dir()))
    lane = next(lane for lane in m.lanes.values() if not lane.is_connector)
    yaw = float(np.arctan2(*(lane.baseline[1] - lane.baseline[0])[::-1]))
    g = spec["bev_geometry"]
    b = dp.ObservationBuilder(m, lane.baseline[0], yaw, [lane.group], cache_dir=str(tmp_path / "r"),
                              sim={k: g[k] for k in ("bev_size", "bev_ppm", "bev_ego_from_bottom")},
                              layout=observation_layout(spec), action_names=action_names(spec))
    ego = {"rear": lane.baseline[0], "yaw": yaw, "speed": 3.0, "accel": 0.0, "steer": 0.0}
    none = np.zeros((0, 7))
    traj, first = dp.plan(b, policy, ego, none, none, none, {}, 0.0, np.zeros(2), steps=10)
    assert traj.shape == (11, 7) and np.isfinite(traj).all() and np.all(np.abs(first) <= 1.0)

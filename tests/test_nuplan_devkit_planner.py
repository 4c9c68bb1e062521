"""The nuplan-devkit planner adapter's devkit-free parts: rollout to a trajectory, observation from devkit-style
inputs (synthetic map), planning with a policy; the planner itself gives a clear ImportError without the devkit."""
import math

import numpy as np
import pytest
import torch

from carl.deploy import nuplan_planner as dp
from envs.nuplan.dynamics import MAX_ACCEL

pytestmark = pytest.mark.nuplan


def test_rollout_straight_accelerating():
    traj = dp.rollout_trajectory(np.array([10.0, 5.0]), 0.0, 5.0, 0.0, 0.0,
                                 lambda k, *state: torch.tensor([[0.0, 1.0]]), steps=20)
    assert traj.shape == (21, 7)
    assert np.allclose(traj[:, 0], np.arange(21) * 0.1)
    assert np.allclose(traj[:, 2], 5.0) and np.allclose(traj[:, 3], 0.0)  # straight along +x
    assert np.all(np.diff(traj[:, 1]) > 0) and np.all(np.diff(traj[:, 4]) > 0)
    assert traj[1, 1] == pytest.approx(10.5)  # first step: v * dt at the current speed
    assert traj[-1, 5] < MAX_ACCEL + 1e-6 and traj[1, 5] == pytest.approx(0.1 / 0.3 * MAX_ACCEL, rel=1e-5)


def test_rollout_turning_and_braking():
    left = dp.rollout_trajectory(np.zeros(2), 0.0, 8.0, 0.0, 0.0, lambda k, *s: torch.tensor([[1.0, 0.0]]), steps=30)
    assert left[-1, 3] > 0.5 and left[-1, 2] > 0  # turned left
    stop = dp.rollout_trajectory(np.zeros(2), math.pi / 2, 3.0, 0.0, 0.0, lambda k, *s: torch.tensor([[0.0, -1.0]]),
                                 steps=40)
    assert stop[-1, 4] == pytest.approx(0.0, abs=1e-3) and np.all(stop[:, 4] >= 0)  # stops, never reverses
    assert np.allclose(stop[:, 1], 0.0, atol=1e-4) and np.all(np.diff(stop[:, 2]) >= -1e-6)  # along +y


def test_observation_builder_and_plan_on_the_synthetic_map(tmp_path):
    from envs.nuplan.cache import build_cache, list_cache, load
    from envs.nuplan.nuplan_map import load_location
    from envs.nuplan.reader import select_scenarios
    from envs.nuplan.synthetic import make_synthetic_dataset

    root = make_synthetic_dataset(tmp_path / "data", num_logs=1)
    build_cache(select_scenarios(root), root / "maps", tmp_path / "cache")
    sc = load(list_cache(tmp_path / "cache")[0])
    m = load_location(root / "maps", sc.map_name)
    rear0 = sc.ego[0, :2] + sc.origin
    b = dp.ObservationBuilder(m, rear0, float(sc.ego[0, 2]), sc.meta["route_roadblock_ids"],
                              sim={"bev_size": 32, "bev_ego_from_bottom": 12}, cache_dir=str(tmp_path / "r"))
    car = np.array([[*(rear0 + 8 * np.array([math.cos(sc.ego[0, 2]), math.sin(sc.ego[0, 2])])), sc.ego[0, 2],
                     4.5, 2.0, 0.0, 0.0]])
    ego = {"rear": rear0, "yaw": float(sc.ego[0, 2]), "speed": 3.0, "accel": 0.0, "steer": 0.0}
    b.set_state(ego["rear"], ego["yaw"], 3.0, 0.0, 0.0, np.zeros(2), car, np.zeros((0, 7)), np.zeros((0, 7)), {}, 0.0)
    obs = b.observe()
    assert obs["bev"].shape == (1, 10, 32, 32)
    assert obs["bev"][0, 0].float().mean() > 0  # road around the ego
    assert obs["bev"][0, 3].sum() > 0  # the vehicle ahead is drawn
    assert obs["measurements"][0, 4] == pytest.approx(3.0)
    calls = []

    def policy(o):
        calls.append(o["bev"].shape)
        return torch.tensor([[0.0, 0.5]])

    traj, first = dp.plan(b, policy, ego, car, np.zeros((0, 7)), np.zeros((0, 7)), {}, 0.0, np.zeros(2), steps=20,
                          replan_every=5)
    assert len(calls) == 4 and traj.shape == (21, 7) and first.tolist() == [0.0, 0.5]
    assert np.allclose(traj[0, 1:3], rear0)  # global frame
    assert np.linalg.norm(traj[-1, 1:3] - rear0) > 5.0


def test_planner_without_devkit_is_a_clear_import_error():
    if dp.NUPLAN_AVAILABLE:
        pytest.skip("nuplan-devkit is installed")
    with pytest.raises(ImportError, match="nuplan-devkit"):
        dp.CarlPlanner("no/such/policy")


def test_plan_with_a_loaded_policy(tmp_path):
    """carl.load_policy's callable drives the planner loop on observations of the policy's BEV geometry."""
    import carl
    from envs.nuplan.nuplan_map import load_location
    from envs.nuplan.synthetic import make_synthetic_dataset
    from tests.test_eval_val14 import tiny_checkpoint

    root = make_synthetic_dataset(tmp_path / "data", num_logs=1)
    policy, spec = carl.load_policy(tiny_checkpoint(tmp_path / "run" / "last.pt"))
    g = spec["bev_geometry"]
    m = load_location(root / "maps", next(iter(p.name for p in (root / "maps").iterdir() if p.is_dir())))
    lane = next(lane for lane in m.lanes.values() if not lane.is_connector)
    start = lane.baseline[0]
    yaw = float(np.arctan2(*(lane.baseline[1] - lane.baseline[0])[::-1]))
    b = dp.ObservationBuilder(m, start, yaw, [lane.group], cache_dir=str(tmp_path / "r"),
                              sim={k: g[k] for k in ("bev_size", "bev_ppm", "bev_ego_from_bottom")})
    ego = {"rear": start, "yaw": yaw, "speed": 2.0, "accel": 0.0, "steer": 0.0}
    traj, first = dp.plan(b, policy, ego, np.zeros((0, 7)), np.zeros((0, 7)), np.zeros((0, 7)), {}, 0.0,
                          np.zeros(2), steps=10)
    assert traj.shape == (11, 7) and np.isfinite(traj).all() and np.all(np.abs(first) <= 1.0)


def test_plan_with_a_nuplan_layout_bundle(tmp_path):
    """A bundle of CaRL's nuPlan variant: the adapter builds its 9-channel observation and 10 + 4 measurements with
    the env's observation part and maps its (accel, steer) actions to the rollout."""
    import carl
    from carl.bundle import action_names, observation_layout
    from carl.export import export_bundle
    from envs.nuplan.nuplan_map import load_location
    from envs.nuplan.synthetic import make_synthetic_dataset
    from test_export import tiny_nuplan_checkpoint

    root = make_synthetic_dataset(tmp_path / "data", num_logs=1)
    export_bundle(tiny_nuplan_checkpoint(tmp_path / "run" / "last.pt"), tmp_path / "bundle", onnx=False)
    policy, spec = carl.load_policy(tmp_path / "bundle")
    assert observation_layout(spec) == "nuplan" and action_names(spec) == ("accel", "steer")
    g = spec["bev_geometry"]
    m = load_location(root / "maps", next(iter(p.name for p in (root / "maps").iterdir() if p.is_dir())))
    lane = next(lane for lane in m.lanes.values() if not lane.is_connector)
    start = lane.baseline[0]
    yaw = float(np.arctan2(*(lane.baseline[1] - lane.baseline[0])[::-1]))
    b = dp.ObservationBuilder(m, start, yaw, [lane.group], cache_dir=str(tmp_path / "r"),
                              sim={k: g[k] for k in ("bev_size", "bev_ppm", "bev_ego_from_bottom")},
                              layout=observation_layout(spec), action_names=action_names(spec))
    ahead = np.array([[*(start + 10 * np.array([math.cos(yaw), math.sin(yaw)])), yaw, 4.5, 2.0, 0.0, 0.0]])
    kin = {"vel": (2.0, 0.1), "acc": (0.5, 0.02), "steer_rate": 0.3, "yaw_rate": 0.04, "yaw_acc": -0.2}
    b.set_state(start, yaw, 2.0, 0.5, 0.01, np.array([0.5, -0.2]), ahead, np.zeros((0, 7)), np.zeros((0, 7)), {},
                0.0, kinematics=kin)
    obs = b.observe()
    assert obs["bev"].shape == (1, 9, 32, 32) and obs["bev"][0, 0].float().mean() > 0  # drivable area
    assert obs["bev"][0, 6].sum() > 0 and obs["bev"][0, 8].sum() > 0  # the vehicle ahead; the ego
    assert obs["measurements"][0].tolist() == pytest.approx([0.5, -0.2, 2.0, 0.1, 0.5, 0.02, 0.01, 0.3, 0.04, -0.2])
    assert obs["value_measurements"].shape == (1, 4)
    ego = {"rear": start, "yaw": yaw, "speed": 2.0, "accel": 0.0, "steer": 0.0}
    traj, first = dp.plan(b, policy, ego, ahead, np.zeros((0, 7)), np.zeros((0, 7)), {}, 0.0, np.zeros(2), steps=10)
    assert traj.shape == (11, 7) and np.isfinite(traj).all() and np.all(np.abs(first) <= 1.0)
    # (accel, steer) = (1, 0): the rollout accelerates straight ahead; (0, 1): it turns left at constant speed
    traj, _ = dp.plan(b, lambda o: torch.tensor([[1.0, 0.0]]), ego, ahead, np.zeros((0, 7)), np.zeros((0, 7)), {}, 0.0,
                      np.zeros(2), steps=10)
    assert np.all(np.diff(traj[:, 4]) > 0) and np.allclose(traj[:, 3], traj[0, 3], atol=1e-6)
    traj, _ = dp.plan(b, lambda o: torch.tensor([[0.0, 1.0]]), ego, ahead, np.zeros((0, 7)), np.zeros((0, 7)), {}, 0.0,
                      np.zeros(2), steps=10)
    assert traj[-1, 3] - traj[0, 3] > 0.05 and traj[-1, 4] == pytest.approx(2.0, abs=1e-4)


def test_plan_with_a_vector_bundle(tmp_path):
    """A set-policy bundle: the adapter builds the vector observation with the env's vector observer at the bundle's
    sizes (a vehicle 10 m ahead of the rear axle is a valid row ahead of the ego, on its route) and plans with it."""
    import carl
    from carl.bundle import observation_layout
    from carl.export import export_bundle
    from envs.nuplan.cache import REAR_AXLE_TO_CENTRE
    from envs.nuplan.nuplan_map import load_location
    from envs.nuplan.synthetic import make_synthetic_dataset
    from test_set_policy import COUNTS, tiny_set_checkpoint

    root = make_synthetic_dataset(tmp_path / "data", num_logs=1)
    export_bundle(tiny_set_checkpoint(tmp_path / "run" / "last.pt"), tmp_path / "bundle", onnx=False)
    policy, spec = carl.load_policy(tmp_path / "bundle")
    assert observation_layout(spec) == "vector"
    m = load_location(root / "maps", next(iter(p.name for p in (root / "maps").iterdir() if p.is_dir())))
    lane = next(lane for lane in m.lanes.values() if not lane.is_connector)
    start = lane.baseline[0]
    yaw = float(np.arctan2(*(lane.baseline[1] - lane.baseline[0])[::-1]))
    sim = {"observation": "vector", "bev": False, "vector": dict(spec["vector_geometry"])}
    b = dp.ObservationBuilder(m, start, yaw, [lane.group], cache_dir=str(tmp_path / "r"), sim=sim,
                              layout=observation_layout(spec))
    ahead = np.array([[*(start + 10 * np.array([math.cos(yaw), math.sin(yaw)])), yaw, 4.5, 2.0, 0.0, 0.0]])
    b.set_state(start, yaw, 2.0, 0.0, 0.0, np.zeros(2), ahead, np.zeros((0, 7)), np.zeros((0, 7)), {}, 0.0)
    obs = b.observe()
    assert "bev" not in obs and obs["vehicles"].shape == (1, COUNTS["vehicles"], 13)
    row = obs["vehicles"][0, obs["vehicles"][0, :, -1] > 0]
    assert len(row) == 1 and row[0, 0].item() == pytest.approx(10.0 - REAR_AXLE_TO_CENTRE, abs=0.2)
    assert abs(row[0, 1].item()) < 0.2
    ego = {"rear": start, "yaw": yaw, "speed": 2.0, "accel": 0.0, "steer": 0.0}
    traj, first = dp.plan(b, policy, ego, ahead, np.zeros((0, 7)), np.zeros((0, 7)), {}, 0.0, np.zeros(2), steps=10)
    assert traj.shape == (11, 7) and np.isfinite(traj).all() and np.all(np.abs(first) <= 1.0)

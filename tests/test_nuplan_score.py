"""nuPlan's closed-loop score reported by the nuPlan env per episode (synthetic dataset), and the log-following
expert."""
import pytest
import torch

from envs.metrics.nuplan import MULTIPLIERS, WEIGHTS
from envs.nuplan.env import NuplanEnv, make_nuplan_env, nuplan_ttc_violation
from envs.nuplan.expert import make_expert
from envs.nuplan.synthetic import make_synthetic_dataset

pytestmark = pytest.mark.nuplan


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = make_synthetic_dataset(tmp_path_factory.mktemp("nuplan"), num_logs=1)
    return root, tmp_path_factory.mktemp("cache")


def small(data, **kw) -> NuplanEnv:
    root, cache = data
    return make_nuplan_env(3, "cpu", 0, cache_dir=str(cache), data_root=str(root), route_split="eval",
                           sim={"bev_size": 32, "bev_ego_from_bottom": 12}, **kw)


def first_episodes(env: NuplanEnv, policy) -> dict[int, dict[str, float]]:
    obs = env.reset(seed=0)
    got: dict[int, dict[str, float]] = {}
    for _ in range(env.num_frames + 5):
        res = env.step(policy(obs))
        for row in torch.nonzero(res.terminated | res.truncated).flatten().tolist():
            got.setdefault(row, {k: float(v[row]) for k, v in res.info.items() if k.startswith("episode/")})
        obs = res.obs
        if len(got) == env.num_envs:
            break
    assert len(got) == env.num_envs
    return got


@pytest.mark.parametrize("reactive", [False, True])
def test_expert_replay_scores_high(data, reactive):
    env = small(data, reactive=reactive)
    eps = first_episodes(env, make_expert(env))
    for ep in eps.values():
        for k in (*MULTIPLIERS, *WEIGHTS):
            assert f"episode/nuplan/{k}" in ep
        assert ep["episode/nuplan/drivable_area_compliance"] == 1.0
        assert ep["episode/nuplan/driving_direction_compliance"] == 1.0
        assert ep["episode/nuplan/making_progress"] == 1.0
        assert ep["episode/nuplan/ego_progress"] > 0.9
    mean = sum(ep["episode/nuplan_score"] for ep in eps.values()) / len(eps)
    assert mean > (0.9 if not reactive else 0.6), eps


def test_leaving_the_road_scores_zero(data):
    env = small(data)
    eps = first_episodes(env, lambda obs: torch.tensor([[1.0, 1.0]] * env.num_envs))
    for ep in eps.values():
        assert ep["episode/nuplan_score"] == 0.0
        assert ep["episode/nuplan/drivable_area_compliance"] == 0.0 or ep["episode/nuplan/no_at_fault_collisions"] < 1


def test_standing_still_fails_making_progress(data):
    env = small(data)
    eps = first_episodes(env, lambda obs: torch.tensor([[0.0, -1.0]] * env.num_envs))
    for ep in eps.values():
        assert ep["episode/nuplan/making_progress"] == 0.0
        assert ep["episode/nuplan_score"] == 0.0


def test_at_fault_collision_scores_zero(data):
    """Put a stopped car right ahead of the driving ego: an ACTIVE_FRONT / STOPPED_TRACK collision is at fault."""
    env = small(data)
    env.reset(seed=0)
    s = env.state
    fwd = torch.stack((torch.cos(s.ego_yaw), torch.sin(s.ego_yaw)), -1)
    env.log_veh[s.scenario, 1, 0, :2] = s.ego_xy + fwd * 4.0
    env.log_veh[s.scenario, 1, 0, 2] = s.ego_yaw
    env.log_veh[s.scenario, 1, 0, 3:5] = torch.tensor([4.5, 2.0])
    env.log_veh[s.scenario, 1, 0, 5:7] = 0.0
    env.log_veh_valid[s.scenario, 1, 0] = True
    s.ego_speed[:] = 8.0
    res = env.step(torch.tensor([[0.0, 1.0]] * 3))
    assert res.terminated.all()
    assert (res.info["episode/nuplan/no_at_fault_collisions"] == 0).all()
    assert (res.info["episode/nuplan/time_to_collision"] == 0).all()
    assert (res.info["episode/nuplan_score"] == 0).all()


def test_ttc_step_check():
    ego = {"ego_xy": torch.zeros(2, 2), "ego_yaw": torch.zeros(2), "ego_speed": torch.tensor([10.0, 0.0]),
           "ego_half": torch.tensor([[2.5, 1.0]] * 2), "junction": torch.zeros(2, dtype=torch.bool)}
    # a stopped car 10 m ahead: the moving ego reaches it within 0.95 s; the stopped ego has no TTC
    xy = torch.tensor([[[10.0, 0.0], [-10.0, 0.0]]] * 2)
    out = nuplan_ttc_violation(**ego, xy=xy, yaw=torch.zeros(2, 2), speed=torch.zeros(2, 2),
                               half=torch.tensor([2.5, 1.0]).expand(2, 2, 2), valid=torch.ones(2, 2, dtype=torch.bool))
    assert out.tolist() == [True, False]
    # 30 m ahead is beyond 0.95 s at 10 m/s; a car behind never counts
    xy = torch.tensor([[[30.0, 0.0], [-6.0, 0.0]]] * 2)
    out = nuplan_ttc_violation(**ego, xy=xy, yaw=torch.zeros(2, 2), speed=torch.tensor([[0.0, 20.0]] * 2),
                               half=torch.tensor([2.5, 1.0]).expand(2, 2, 2), valid=torch.ones(2, 2, dtype=torch.bool))
    assert out.tolist() == [False, False]

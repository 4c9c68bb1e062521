"""What CaRL's nuPlan reward reads, as the nuPlan env measures it (envs/nuplan/carl_reward.py): hand-computed
geometry, and the reward's hard constraints and progress bound in the env."""
import pytest
import torch

from envs.nuplan.carl_reward import edge_table, project_on_paths
from envs.nuplan.env import make_nuplan_env
from envs.nuplan.expert import make_expert
from envs.nuplan.mapgraph import PolygonSet
from envs.nuplan.synthetic import make_synthetic_dataset
from envs.sim.geometry import points_in_polygons

pytestmark = pytest.mark.nuplan


def test_points_in_polygons_with_holes_and_overlaps():
    shapely = pytest.importorskip("shapely")
    ring = shapely.Polygon([(0, 0), (10, 0), (10, 10), (0, 10)], holes=[[(4, 4), (6, 4), (6, 6), (4, 6)]])
    overlap = shapely.Polygon([(8, 8), (14, 8), (14, 14), (8, 14)])
    edges, owner, n = edge_table([PolygonSet.from_shapely([ring, overlap], ["a", "b"]), PolygonSet.empty()])
    pts = torch.tensor([[[1.0, 1.0], [5.0, 5.0], [9.0, 9.0], [12.0, 12.0], [20.0, 1.0]]] * 2)
    inside = points_in_polygons(pts, edges, owner, n)
    # in the square; in its hole; where both overlap (each polygon judged alone); in the second only; outside
    assert inside[0].tolist() == [True, False, True, True, False]
    assert inside[1].tolist() == [False] * 5  # a scenario without polygons holds nothing


def test_projection_on_the_logged_path():
    path = torch.tensor([[[0.0, 0.0], [10.0, 0.0], [10.0, 10.0]]], dtype=torch.float64)  # 20 m
    cum = torch.tensor([[0.0, 10.0, 20.0]], dtype=torch.float64)
    rc = project_on_paths(torch.tensor([[5.0, 2.0]], dtype=torch.float64), path, cum)
    assert rc.tolist() == pytest.approx([0.25])  # 5 m of 20
    rc = project_on_paths(torch.tensor([[12.0, 15.0]], dtype=torch.float64), path, cum)
    assert rc.tolist() == pytest.approx([1.0])  # beyond the end: no extension past the log
    still = torch.zeros(1, 3, 2, dtype=torch.float64)
    assert project_on_paths(torch.ones(1, 2, dtype=torch.float64), still, torch.zeros(1, 3, dtype=torch.float64)
                            ).tolist() == [0.0]


@pytest.fixture(scope="module")
def env_args(tmp_path_factory):
    root = make_synthetic_dataset(tmp_path_factory.mktemp("nuplan"), num_logs=1)
    return {"cache_dir": str(tmp_path_factory.mktemp("cache")), "data_root": str(root),
            "sim": {"bev_size": 32, "bev_ego_from_bottom": 12}}


def test_expert_return_is_at_most_100_and_leaving_the_road_ends_the_episode(env_args):
    env = make_nuplan_env(3, "cpu", 0, route_split="eval", run_to_end=False, **env_args)
    act, obs = make_expert(env), env.reset(seed=0)
    returns = {}
    for _ in range(env.data.num_frames):
        res = env.step(act(obs))
        obs = res.obs
        for row in torch.nonzero(res.terminated | res.truncated).flatten().tolist():
            returns.setdefault(row, float(res.info["episode/return"][row]))
    # 100 · Σ ΔRC ≤ 100 · 1: progress is the best-so-far projection, soft factors are <= 1
    assert len(returns) == 3 and all(0.0 < r <= 100.0 + 1e-4 for r in returns.values()), returns
    # full steering at full acceleration leaves the drivable polygons: a CaRL hard constraint ends the episode
    env = make_nuplan_env(3, "cpu", 0, route_split="eval", run_to_end=False, **env_args)
    env.reset(seed=0)
    for _ in range(env.data.num_frames):
        res = env.step(torch.tensor([[1.0, 1.0]] * 3))  # (accel, steer)
        if res.terminated.any():
            break
    row = int(torch.nonzero(res.terminated)[0])
    assert res.info["episode/termination/carl_off_road"][row] + res.info["episode/termination/carl_collision"][row] >= 1
    assert res.reward[row] == 0.0  # nothing on the terminating step
    assert int(env.state.steps[row]) == 0  # and it restarted

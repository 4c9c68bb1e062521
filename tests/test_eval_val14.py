"""carl-eval benchmark=val14 env=nuplan on the synthetic nuPlan dataset: token filtering, per-scenario records,
summary.json with the closed-loop score, resume, reactive."""
import json

import pytest
import yaml

from carl.eval import EvalError
from carl.cli import load_config
from carl.eval.cli import run
from test_export import tiny_checkpoint, tiny_nuplan_checkpoint  # tiny trainer checkpoints

pytestmark = pytest.mark.nuplan


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from envs.nuplan.reader import find_logs, list_scenarios
    from envs.nuplan.synthetic import make_synthetic_dataset

    root = make_synthetic_dataset(tmp_path_factory.mktemp("nuplan"), num_logs=1)
    tokens = [sp.token for log in find_logs(root) for sp in list_scenarios(log)]
    split = tmp_path_factory.mktemp("split") / "val14_test.yaml"
    split.write_text(yaml.safe_dump({"scenario_tokens": tokens + ["00000000deadbeef"]}))
    return root, split, tokens


def cfg_for(dataset, tmp_path, *extra):
    root, split, _ = dataset
    return load_config("eval", [  # carl-eval's shortcuts (env=, data_root=, cache_dir=) expanded by the loader
        "benchmark=val14", "env=nuplan", f"data_root={root}", f"cache_dir={tmp_path / 'cache'}",
        f"benchmark.options.split_yaml={split}", "policy=expert", "worst_videos=0", *extra])


def test_val14_writes_scores_and_resumes(dataset, tmp_path):
    out = tmp_path / "out"
    logs: list[str] = []
    summary = run(cfg_for(dataset, tmp_path, f"out_dir={out}"), log=logs.append)
    n = len(dataset[2])
    assert any(f"{n} of {n + 1} scenario tokens found" in m and "1 missing" in m for m in logs)
    saved = json.loads((out / "summary.json").read_text())
    assert saved["routes"] == n and saved["benchmark"] == "val14"
    assert 0.0 <= saved["closed_loop_score"] <= 100.0 and saved["closed_loop_score"] > 50.0
    assert set(saved["nuplan_metrics"]) >= {"no_at_fault_collisions", "drivable_area_compliance", "ego_progress",
                                            "time_to_collision", "speed_limit", "comfort", "making_progress",
                                            "driving_direction_compliance"}
    records = json.loads((out / "results.json").read_text())["_checkpoint"]["records"]
    assert sorted(r["route_id"] for r in records) == sorted(dataset[2])
    assert all(0.0 <= r["nuplan"]["score"] <= 1.0 for r in records)
    assert "nuplan_cls" in (out / "summary.md").read_text()
    # resume: nothing is re-run, the summary is the same
    logs.clear()
    again = run(cfg_for(dataset, tmp_path, f"out_dir={out}"), log=logs.append)
    assert any("resuming" in m for m in logs)
    assert again["closed_loop_score"] == pytest.approx(summary["closed_loop_score"])
    # reactive results are another evaluation: refused in the same folder, fine in another
    with pytest.raises(EvalError, match="another evaluation"):
        run(cfg_for(dataset, tmp_path, f"out_dir={out}", "reactive=true"), log=logs.append)
    rs = run(cfg_for(dataset, tmp_path, f"out_dir={tmp_path / 'out_r'}", "reactive=true"), log=logs.append)
    assert rs["benchmark"] == "val14-reactive" and rs["routes"] == n


def test_val14_without_matching_tokens_is_a_clear_error(dataset, tmp_path):
    split = tmp_path / "none.yaml"
    split.write_text(yaml.safe_dump({"scenario_tokens": ["00000000deadbeef"]}))
    with pytest.raises(EvalError, match="none of the 1 scenario tokens"):
        run(cfg_for(dataset, tmp_path, f"out_dir={tmp_path / 'o'}", f"benchmark.options.split_yaml={split}"))


def test_val14_with_a_checkpoint(dataset, tmp_path):
    ckpt = tiny_nuplan_checkpoint(tmp_path / "run" / "last.pt")
    summary = run(cfg_for(dataset, tmp_path, f"out_dir={tmp_path / 'out'}", f"policy={ckpt}"), log=lambda m: None)
    assert summary["routes"] == len(dataset[2]) and 0.0 <= summary["closed_loop_score"] <= 100.0
    # a policy trained on the CARLA observation (10 channels) cannot drive CaRL's nuPlan one: a clear error
    carla = tiny_checkpoint(tmp_path / "carla" / "last.pt")
    with pytest.raises(EvalError, match=r"expects bev of shape \[10, 32, 32\], the benchmark env gives \[9, 32, 32\]; "
                                        r"evaluate it on a benchmark of the env it was trained on"):
        run(cfg_for(dataset, tmp_path, f"out_dir={tmp_path / 'out_carla'}", f"policy={carla}"), log=lambda m: None)


def test_val14_score_does_not_depend_on_the_batch(dataset, tmp_path):
    """One scenario per env or all in one env: every scenario's score and the CLS agree to 1e-6."""
    one = run(cfg_for(dataset, tmp_path, f"out_dir={tmp_path / 'one'}", "benchmark.group_size=1"), log=lambda m: None)
    all_ = run(cfg_for(dataset, tmp_path, f"out_dir={tmp_path / 'all'}", "benchmark.group_size=64"),
               log=lambda m: None)
    assert one["closed_loop_score"] == pytest.approx(all_["closed_loop_score"], abs=1e-6)

    def scores(folder: str) -> dict[str, float]:
        records = json.loads((tmp_path / folder / "results.json").read_text())["_checkpoint"]["records"]
        return {r["route_id"]: r["nuplan"]["score"] for r in records}

    a, b = scores("one"), scores("all")
    assert a.keys() == b.keys() and len(a) == len(dataset[2])
    assert all(abs(a[k] - b[k]) <= 1e-6 for k in a), (a, b)


def test_training_evaluations_rank_nuplan_runs_by_the_closed_loop_score():
    """carl-train's periodic evaluation on env=nuplan reports CLS (x 100) and picks best.pt by it."""
    from carl.eval.store import aggregate, headline

    eps = [{"episode/driving_score": 90.0, "episode/route_completion": 90.0, "episode/infraction_score": 1.0,
            "episode/return": 1.0, "episode/nuplan_score": s} for s in (0.5, 1.0)]
    result = aggregate(eps, 2)
    assert result["closed_loop_score"] == pytest.approx(75.0) and headline(result) == pytest.approx(75.0)
    carla = aggregate([{k: v for k, v in ep.items() if k != "episode/nuplan_score"} for ep in eps], 2)
    assert "closed_loop_score" not in carla and headline(carla) == pytest.approx(90.0)

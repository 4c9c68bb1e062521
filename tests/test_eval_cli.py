"""carl-eval on short held-out routes: Leaderboard results layout, summary, resume, refusal, bad benchmarks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from carl.eval import EvalError
from carl.eval.store import ResultStore
from carl.cli import load_config
from carl.eval.cli import main, run

# 2 short procedural routes, driven for at most 12 s (routes still running then are reported as they stand)
SHORT = ["benchmark=towns", "benchmark.num_routes=2", "+benchmark.options.route_length=[15,25]",
         "benchmark.max_steps=120", "+benchmark.options.num_vehicles=2", "+benchmark.options.num_pedestrians=1",
         "worst_videos=0", "torch_threads=1"]


def load(overrides: list[str]) -> dict:
    return load_config("eval", overrides)


def evaluate(out: Path, *extra: str) -> tuple[dict, list[str]]:
    lines: list[str] = []
    summary = run(load([*SHORT, f"out_dir={out}", *extra]), log=lines.append)
    return summary, lines


def test_expert_results_summary_and_resume(tmp_path: Path) -> None:
    out = tmp_path / "expert"
    summary, _ = evaluate(out, "policy=expert", "worst_videos=1", "video_max_frames=5")
    results = json.loads((out / "results.json").read_text())
    records = results["_checkpoint"]["records"]
    assert len(records) == 2 and results["_checkpoint"]["progress"] == [2, 2] and results["entry_status"] == "Finished"
    for r in records:
        assert set(r) >= {"index", "route_id", "status", "infractions", "scores", "meta", "num_infractions"}
        assert set(r["scores"]) == {"score_route", "score_penalty", "score_composed"}
        assert r["scores"]["score_composed"] == pytest.approx(r["scores"]["score_route"] * r["scores"]["score_penalty"],
                                                              abs=1e-3)
        assert {"collisions_vehicle", "collisions_layout", "red_light", "route_dev", "vehicle_blocked"} <= set(r["infractions"])
        assert r["meta"]["route_length"] > 10 and r["meta"]["duration_game"] > 0
    assert results["_checkpoint"]["global_record"]["scores_mean"]["score_composed"] == pytest.approx(summary["driving_score"])
    saved = json.loads((out / "summary.json").read_text())
    assert saved["routes"] == 2 and saved["policy"] == "expert" and saved["benchmark"] == "towns"
    assert {"driving_score", "route_completion", "infraction_score", "infractions_per_km", "km"} <= set(saved)
    for name in ("summary.md", "summary.csv", "score_per_route.png", "infractions.png"):
        assert (out / name).is_file(), name
    assert len(list((out / "videos").glob("*.gif"))) == 1
    assert (out / "summary.csv").read_text().splitlines()[1].startswith("expert,2/2,")

    # an interrupted run: one route's record is missing; the re-run records only that one
    kept = records[0]
    results["_checkpoint"]["records"] = [kept]
    (out / "results.json").write_text(json.dumps(results))
    again, lines = evaluate(out, "policy=expert")
    assert any("resuming" in line and "1/2" in line for line in lines)
    records2 = json.loads((out / "results.json").read_text())["_checkpoint"]["records"]
    assert len(records2) == 2 and records2[0] == kept and again["routes"] == 2
    assert {r["route_id"] for r in records2} == {r["route_id"] for r in records}

    # everything finished: nothing is driven again
    _, lines = evaluate(out, "policy=expert")
    assert not any(line.startswith("  ") and "DS" in line for line in lines)


def test_results_of_another_policy_are_not_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "e"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"carl": {"policy": {"kind": "expert"}}, "_checkpoint": {"records": []}}))
    with pytest.raises(EvalError, match="already holds results of another evaluation"):
        evaluate(out, "policy=random")
    summary, _ = evaluate(out, "policy=random", "overwrite=true")
    assert summary["routes"] == 2 and summary["policy"] == "random"


def test_a_float32_folder_is_not_resumed_in_float64_and_the_error_says_how(tmp_path: Path) -> None:
    """Results written before ``precision`` existed are float32; carl-eval now evaluates in float64 and refuses to mix
    them, naming the key that resumes the folder."""
    found = {"policy": {"kind": "checkpoint", "sha256": "ab"}, "benchmark": "towns", "seed": 0}
    (tmp_path / "results.json").write_text(json.dumps({"carl": found, "_checkpoint": {"records": []}}))
    mine = {**found, "policy": {**found["policy"], "precision": "float64"}}
    with pytest.raises(EvalError, match="differ only in precision .*pass precision=float32 to resume it"):
        ResultStore(tmp_path, mine, 2, overwrite=False)
    other = {**mine, "seed": 1}  # another evaluation as well: no hint that would not help
    with pytest.raises(EvalError) as exc:
        ResultStore(tmp_path, other, 2, overwrite=False)
    assert "precision=" not in str(exc.value)
    ResultStore(tmp_path, found, 2, overwrite=False)  # the same identity resumes


def test_benchmarks_without_routes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(EvalError, match="has no routes"):
        evaluate(tmp_path / "a", "policy=expert", "benchmark.num_routes=0")
    town01 = tmp_path / "town01.xml"
    town01.write_text('<routes><route id="0" town="Town01"><waypoints><position x="1" y="2" z="0"/>'
                      '<position x="50" y="2" z="0"/></waypoints></route></routes>')
    with pytest.raises(EvalError, match=r"towns \['Town99'\] have no routes"):
        run(load(["benchmark=longest6", f"benchmark.route_file={town01}", "benchmark.towns=[Town99]",
                             f"out_dir={tmp_path / 'b'}"]))
    with pytest.raises(EvalError, match="val14.*none of the 1118 scenario tokens"):
        run(load(["benchmark=val14", f"out_dir={tmp_path / 'c'}"]))
    empty = tmp_path / "empty.xml"
    empty.write_text("<routes></routes>")
    with pytest.raises(SystemExit) as exc:  # the CLI: exit code 2 and a message naming the file
        main(["benchmark=longest6", f"benchmark.route_file={empty}", f"out_dir={tmp_path / 'd'}"])
    assert exc.value.code == 2 and "empty.xml" in capsys.readouterr().err


def test_unknown_policy_path(tmp_path: Path) -> None:
    with pytest.raises(EvalError, match="no such file or folder"):
        evaluate(tmp_path / "x", f"policy={tmp_path / 'nope.pt'}")


def test_checkpoint_policy_with_baselines(tmp_path: Path) -> None:
    from test_export import tiny_checkpoint

    ckpt = tiny_checkpoint(tmp_path / "run" / "last.pt")
    out = tmp_path / "learned"
    summary, _ = evaluate(out, f"policy={ckpt}", "baselines=true")
    assert summary["routes"] == 2 and summary["policy_id"]["kind"] == "checkpoint"
    rows = (out / "summary.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["run/last", "random", "expert"]
    for name in ("random", "expert"):
        assert json.loads((out / "baselines" / name / "summary.json").read_text())["routes"] == 2


def test_routes_still_running_at_max_steps_are_reported(tmp_path: Path) -> None:
    """A step limit below the routes' length reports every route as it stands, none is dropped."""
    out = tmp_path / "cut"
    summary, lines = evaluate(out, "policy=expert", "benchmark.max_steps=15")
    records = json.loads((out / "results.json").read_text())["_checkpoint"]["records"]
    assert len(records) == 2 and summary["routes"] == 2
    for r in records:
        assert r["meta"]["termination"] == "max_steps" and r["status"].startswith("Failed - Still running")
        assert 0 < r["scores"]["score_route"] < 100  # the progress made in 1.5 s
        assert r["meta"]["duration_game"] == pytest.approx(1.5)


def test_leaderboard_rules_are_the_default_and_carl_rules_an_option() -> None:
    for bench in ("towns", "longest6", "longest6_carla"):
        assert load([f"benchmark={bench}"])["benchmark"]["options"]["rules"] == "leaderboard"
    assert load(["benchmark.options.rules=carl"])["benchmark"]["options"]["rules"] == "carl"


def test_hydra_run_dir_is_the_results_folder(tmp_path: Path) -> None:
    """carl-eval hydra.run.dir=<dir>: the results go under <dir> (out_dir, when given, comes first)."""
    with pytest.raises(SystemExit) as exc:
        main([f"hydra.run.dir={tmp_path / 'h'}", "policy=expert", *SHORT])
    assert exc.value.code == 0
    assert json.loads((tmp_path / "h" / "summary.json").read_text())["routes"] == 2
    assert (tmp_path / "h" / "results.json").is_file() and (tmp_path / "h" / ".hydra" / "overrides.yaml").is_file()
    with pytest.raises(SystemExit) as exc:
        main([f"hydra.run.dir={tmp_path / 'h2'}", f"out_dir={tmp_path / 'o'}", "policy=random", *SHORT])
    assert exc.value.code == 0 and (tmp_path / "o" / "summary.json").is_file() and not (tmp_path / "h2").exists()


def test_final_benchmark_of_a_run_loads_its_eval_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """carl-train's logging.final_benchmark evaluates <run>/best.pt with carl-eval's own config loader (the run
    itself is not needed to check that the config it asks for loads)."""
    import carl.eval.cli as carl_eval
    from carl.eval.during_training import run_benchmark

    monkeypatch.setattr(carl_eval, "run", lambda cfg: cfg)
    train = load_config("train", ["logging.final_benchmark=towns"])
    got = run_benchmark(train, tmp_path, torch.device("cpu"))
    assert got["benchmark"]["name"] == "towns" and got["policy"] == str(tmp_path / "best.pt")
    assert got["out_dir"] == str(tmp_path / "eval" / "towns") and got["overwrite"] is True and got["device"] == "cpu"


def test_repetitions_drive_every_route_again_with_the_next_traffic_seeds(tmp_path: Path) -> None:
    """benchmark.repetitions=2: each route twice, repetition k exactly the run with traffic seed seed + k, named
    ``<route>_rep<k>``; the summary's means are over all records and the spreads are computed from them."""
    reps, lines = evaluate(tmp_path / "reps", "policy=expert", "benchmark.repetitions=2", "seed=5")
    records = json.loads((tmp_path / "reps" / "results.json").read_text())["_checkpoint"]["records"]
    assert len(records) == 4 and reps["routes"] == 4
    for k in (0, 1):
        single, _ = evaluate(tmp_path / f"seed{5 + k}", "policy=expert", f"seed={5 + k}")
        alone = json.loads((tmp_path / f"seed{5 + k}" / "results.json").read_text())["_checkpoint"]["records"]
        mine = sorted((r for r in records if r["carl"]["repetition"] == k), key=lambda r: r["route_id"])
        assert [r["route_id"] for r in mine] == sorted(f"{r['route_id']}_rep{k}" for r in alone)
        assert [r["scores"] for r in mine] == [r["scores"] for r in sorted(alone, key=lambda r: r["route_id"])]
        assert reps["repetitions"]["driving_score"]["per_repetition"][k] == pytest.approx(single["driving_score"])
    ds = [r["scores"]["score_composed"] for r in records]
    assert reps["driving_score"] == pytest.approx(sum(ds) / 4)
    a, b = reps["repetitions"]["driving_score"]["per_repetition"]
    assert reps["repetitions"]["driving_score"]["sd_over_repetitions"] == pytest.approx(abs(a - b) / 2 ** 0.5)
    assert any("repetition 2/2" in line for line in lines)
    assert "2 repetitions" in (tmp_path / "reps" / "summary.md").read_text()

    with pytest.raises(EvalError, match="benchmark.repetitions=0: give a whole number >= 1"):
        evaluate(tmp_path / "bad", "policy=expert", "benchmark.repetitions=0")
    assert not (tmp_path / "bad").exists()  # refused before the results folder is made


def test_unseen_towns_drives_held_out_lane_changing_routes_on_each_named_town(tmp_path: Path) -> None:
    """benchmark=unseen_towns: one group per town of ``towns`` (its own summary row), random held-out routes on that
    map with lane changes and the six scenario types, Leaderboard rules."""
    from carl.eval.benchmarks import resolve_benchmark

    cfg = load(["benchmark=unseen_towns"])["benchmark"]
    bench = resolve_benchmark(cfg)
    assert [g.name for g in bench.groups] == ["Town07", "Town10HD"] and bench.num_routes == 32
    for g in bench.groups:
        assert g.options["map"] == g.name and g.options["maps"] == [] and g.options["num_routes"] == 16
        assert g.options["route_lane_changes"] is True and g.options["route_split"] == "eval"
        assert g.options["rules"] == "leaderboard" and g.options["scenario_density"] == 7.4

    summary = run(load(["policy=expert", "benchmark=unseen_towns", "benchmark.towns=[Town07]", "benchmark.num_routes=2",
                        "benchmark.max_steps=20", "worst_videos=0", "torch_threads=1", f"out_dir={tmp_path / 't7'}"]),
                  log=lambda _: None)
    records = json.loads((tmp_path / "t7" / "results.json").read_text())["_checkpoint"]["records"]
    assert sorted(r["route_id"] for r in records) == ["Town07_rand7919_0", "Town07_rand7919_1"]
    assert summary["groups"] and set(summary["groups"]) == {"Town07"}


def test_the_seen_only_expert_is_a_policy_and_drives_as_the_expert_where_no_flow_runs(tmp_path: Path) -> None:
    """policy=expert_seen evaluates the simulator's expert without the junction flows' unspawned cars; on routes
    without scenarios nothing differs, so its route scores are the expert's."""
    seen, _ = evaluate(tmp_path / "seen", "policy=expert_seen", "+benchmark.options.scenario_density=0")
    full, _ = evaluate(tmp_path / "full", "policy=expert", "+benchmark.options.scenario_density=0")
    records = {name: json.loads((tmp_path / name / "results.json").read_text())["_checkpoint"]["records"]
               for name in ("seen", "full")}
    assert [r["scores"] for r in records["seen"]] == [r["scores"] for r in records["full"]]
    assert "expert_seen" in (tmp_path / "seen" / "summary.md").read_text()

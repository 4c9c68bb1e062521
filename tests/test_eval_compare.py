"""carl-compare: two evaluations (or two sets of them) paired route by route, expectations computed by hand."""
from __future__ import annotations

import json
import math

import pytest

from scipy import stats

from carl.eval.compare import compare, main
from envs.metrics.leaderboard import make_record, results_file

T_975_DF2 = 4.302653  # Student's t, 97.5 % quantile, 2 degrees of freedom (tables)


def record(group: str, index: int, infraction_score: float, repetition: int = 0, **extra: float) -> dict:
    """A finished route (RC 100) whose DS is 100 x ``infraction_score``."""
    ep = {"episode/route_completion": 100.0, "episode/infraction_score": infraction_score,
          "episode/termination/route_completed": 1.0, "episode/length": 10.0, **extra}
    rec = make_record(0, f"{group}_{index}_rep{repetition}", ep, 1000.0, group, index, 1.0, 0.1)
    rec["carl"]["repetition"] = repetition
    return rec


def write(tmp_path, name: str, records: list[dict], benchmark: str = "longest6", total: int | None = None) -> str:
    """A carl-eval folder holding ``records``, of ``total`` route runs (default: as many, a finished evaluation)."""
    folder = tmp_path / name
    folder.mkdir()
    identity = {"policy": {"kind": "checkpoint", "sha256": name * 16}, "benchmark": benchmark, "seed": 0}
    (folder / "results.json").write_text(json.dumps(results_file(records, total or len(records), identity)))
    return str(folder)


def two_evaluations() -> tuple[list[dict], list[dict]]:
    """A drives DS 50 / 60 / 70 on Town01_0-2 and 40 on Town02_0; B 55 / 60 / 80 on Town01_0-2 (route 2 twice: 70
    and 90, averaged) and not Town02_0. Paired differences 5, 0, 10."""
    a = [record("Town01", 0, 0.5), record("Town01", 1, 0.6), record("Town01", 2, 0.7), record("Town02", 0, 0.4)]
    b = [record("Town01", 0, 0.55, **{"episode/infractions/collision_vehicle": 1.0}), record("Town01", 1, 0.6),
         record("Town01", 2, 0.7, 0), record("Town01", 2, 0.9, 1)]
    a[2]["scenarios"] = {"ControlLoss": {"total": 1, "skipped": 0, "triggered": 1, "passed": 0, "collided": 1}}
    b[2]["scenarios"] = {"ControlLoss": {"total": 1, "skipped": 0, "triggered": 1, "passed": 1, "collided": 0}}
    b[3]["scenarios"] = {"ControlLoss": {"total": 1, "skipped": 0, "triggered": 1, "passed": 1, "collided": 0}}
    return a, b


def test_paired_difference_interval_and_sign_test():
    a, b = two_evaluations()
    result = compare([a], [b])
    assert result["routes"] == 3 and result["only_a"] == ["Town02_0"] and result["only_b"] == []
    ds = result["scores"]["driving_score"]
    # differences 5, 0, 10: mean 5, sd sqrt((0 + 25 + 25) / 2) = 5, half-width t(0.975, 2) x 5 / sqrt(3)
    half = T_975_DF2 * 5.0 / math.sqrt(3.0)
    assert ds["a"] == pytest.approx(60.0) and ds["b"] == pytest.approx(65.0)
    assert ds["diff"] == pytest.approx(5.0) and ds["diff_sd"] == pytest.approx(5.0)
    assert (ds["ci_low"], ds["ci_high"]) == pytest.approx((5.0 - half, 5.0 + half), abs=1e-4)
    assert (ds["won"], ds["lost"], ds["tied"]) == (2, 0, 1)
    assert ds["sign_test_p"] == pytest.approx(0.5)  # two of two pairs won: 2 x 0.5^2
    rc = result["scores"]["route_completion"]
    assert (rc["diff"], rc["tied"], rc["sign_test_p"]) == (0.0, 3, 1.0)
    assert result["groups"]["Town01"]["diff"] == pytest.approx(5.0) and "Town02" not in result["groups"]
    # A loses 50 / 40 / 30 to an unexplained penalty ("other"); B 40 + 20 (averaged) on routes 1-2 and, on route 0,
    # 45 to its vehicle collision (the only factor)
    assert result["ds_lost"]["other"] == pytest.approx({"a": 40.0, "b": 20.0})
    assert result["ds_lost"]["collision_vehicle"] == pytest.approx({"a": 0.0, "b": 15.0})
    control = result["scenarios"]["ControlLoss"]
    assert (control["a"]["collided"], control["b"]["collided"], control["b"]["passed"]) == (1, 0, 2)
    assert [r["route"] for r in result["moved"]["b_gained"]] == ["Town01_2", "Town01_0"]
    assert result["moved"]["b_lost"] == [] and "seeds" not in result


def test_cli_prints_and_writes_the_report(tmp_path, capsys):
    a, b = two_evaluations()
    out = tmp_path / "a_vs_b"
    main([write(tmp_path, "a", a), write(tmp_path, "b", b), "--out", str(out)])
    md = capsys.readouterr().out
    assert "| driving_score | 60.00 | 65.00 | +5.00 |" in md and "| 2 / 0 / 1 | 0.500 |" in md
    assert "only in A (left out): 1: Town02_0" in md and "| ControlLoss | 1 -> 2 | 0 -> 2 |" in md
    assert (out / "compare.md").read_text() == md
    assert json.loads((out / "compare.json").read_text())["scores"]["driving_score"]["won"] == 2


def test_an_unfinished_evaluation_is_compared_as_it_stands_and_says_so(tmp_path, capsys):
    a, b = two_evaluations()
    main([write(tmp_path, "a", a), write(tmp_path, "b", b, total=6)])  # B: 4 of its 6 route runs written so far
    captured = capsys.readouterr()
    assert "b is unfinished (4 of 6 route runs)" in captured.err and "a is unfinished" not in captured.err
    assert "traffic seed 0, **unfinished: 4 of 6 route runs**" in captured.out
    assert "- an evaluation is unfinished" in captured.out
    assert "| driving_score | 60.00 | 65.00 | +5.00 |" in captured.out  # compared as it stands
    main([write(tmp_path, "a2", a), write(tmp_path, "b2", b)])
    captured = capsys.readouterr()
    assert "**unfinished" not in captured.out and "is unfinished" not in captured.out + captured.err


def test_bad_inputs_name_the_file_and_the_fix(tmp_path):
    a, b = two_evaluations()
    with pytest.raises(SystemExit, match="no carl-eval results here"):
        main([str(tmp_path / "missing"), write(tmp_path, "b", b)])
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "results.json").write_text("{}")
    with pytest.raises(SystemExit, match="junk/results.json is not a carl-eval results file"):
        main([str(tmp_path / "junk"), str(tmp_path / "b")])
    with pytest.raises(SystemExit, match="same benchmark"):
        main([write(tmp_path, "a", a), write(tmp_path, "t", b, benchmark="towns")])
    with pytest.raises(SystemExit, match="share no route"):
        main([str(tmp_path / "a"), write(tmp_path, "c", [record("Town05", 0, 0.5)])])


def seed_sides() -> tuple[list[list[dict]], list[list[dict]]]:
    """Two recipes' training seeds on Town01_0-1 (DS): A 50 / 70 and 60 / 80 (means 60, 70); B 70 / 70, 80 / 80 and
    90 / 60 (means 70, 80, 75). A's first seed also drove Town02_0 (its other seed did not) and both A seeds drove
    Town03_0, which only B's first drove."""
    a = [[record("Town01", 0, 0.5), record("Town01", 1, 0.7), record("Town02", 0, 0.1), record("Town03", 0, 0.2)],
         [record("Town01", 0, 0.6), record("Town01", 1, 0.8), record("Town03", 0, 0.2)]]
    b = [[record("Town01", 0, 0.7), record("Town01", 1, 0.7), record("Town03", 0, 0.9)],
         [record("Town01", 0, 0.8), record("Town01", 1, 0.8)],
         [record("Town01", 0, 0.9), record("Town01", 1, 0.6)]]
    return a, b


def test_several_seeds_per_side_pool_routes_and_compare_the_means():
    a, b = seed_sides()
    result = compare(a, b)
    assert result["routes"] == 2 and result["evaluations"] == {"a": 2, "b": 3}
    assert (result["only_a"], result["only_b"], result["partial"]) == (["Town03_0"], [], ["Town02_0"])
    ds = result["scores"]["driving_score"]  # routes pooled: A 55 / 75, B 80 / 70: differences 25, -5
    assert (ds["a"], ds["b"], ds["diff"]) == pytest.approx((65.0, 75.0, 10.0))
    assert (ds["won"], ds["lost"]) == (1, 1)
    seeds = result["seeds"]["driving_score"]
    assert seeds["a_each"] == pytest.approx([60.0, 70.0]) and seeds["b_each"] == pytest.approx([70.0, 80.0, 75.0])
    assert (seeds["a"], seeds["a_sd"], seeds["b"], seeds["b_sd"]) == pytest.approx((65.0, math.sqrt(50.0), 75.0, 5.0))
    assert seeds["diff"] == pytest.approx(10.0) and seeds["ratio"] == pytest.approx(75.0 / 65.0)
    # Welch: squared standard errors 50 / 2 = 25 and 25 / 3; Welch-Satterthwaite degrees of freedom
    va, vb = 25.0, 25.0 / 3.0
    df = (va + vb) ** 2 / (va ** 2 / 1 + vb ** 2 / 2)
    half = stats.t.ppf(0.975, df) * math.sqrt(va + vb)
    assert (seeds["ci_low"], seeds["ci_high"]) == pytest.approx((10.0 - half, 10.0 + half))


def test_one_evaluation_against_seeds_uses_the_seeds_spread_only():
    _, b = seed_sides()
    expert = [record("Town01", 0, 0.8), record("Town01", 1, 0.8)]
    seeds = compare([expert], b)["seeds"]["driving_score"]
    half = T_975_DF2 * 5.0 / math.sqrt(3.0)  # B's means 70 / 80 / 75: sd 5 over 3 seeds, 2 degrees of freedom
    assert (seeds["diff"], seeds["a_sd"]) == pytest.approx((-5.0, 0.0))
    assert (seeds["ci_low"], seeds["ci_high"]) == pytest.approx((-5.0 - half, -5.0 + half))
    assert seeds["ratio"] == pytest.approx(75.0 / 80.0)


def test_cli_takes_comma_separated_seeds(tmp_path, capsys):
    a, b = seed_sides()
    a_spec = ",".join(write(tmp_path, f"a{i}", r) for i, r in enumerate(a))
    b_spec = ",".join(write(tmp_path, f"b{i}", r) for i, r in enumerate(b))
    main([a_spec, b_spec])
    md = capsys.readouterr().out
    assert md.startswith("# 3 evaluations (") and "## Over the evaluations (training seeds)" in md
    assert "| driving_score | 60.00 / 70.00 | 70.00 / 80.00 / 75.00 | 65.00 +- 7.07 | 75.00 +- 5.00 | +10.00 |" in md
    assert "only in some evaluations (left out): 1: Town02_0" in md
    with pytest.raises(SystemExit, match="names an evaluation twice"):
        main([f"{a_spec},{a_spec.split(',')[0]}", b_spec])

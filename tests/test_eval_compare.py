"""carl-compare: two evaluations paired route by route, expectations computed by hand."""
from __future__ import annotations

import json
import math

import pytest

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


def write(tmp_path, name: str, records: list[dict], benchmark: str = "longest6") -> str:
    folder = tmp_path / name
    folder.mkdir()
    identity = {"policy": {"kind": "checkpoint", "sha256": name * 16}, "benchmark": benchmark, "seed": 0}
    (folder / "results.json").write_text(json.dumps(results_file(records, len(records), identity)))
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
    result = compare(*two_evaluations())
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
    assert result["moved"]["b_lost"] == []


def test_cli_prints_and_writes_the_report(tmp_path, capsys):
    a, b = two_evaluations()
    out = tmp_path / "a_vs_b"
    main([write(tmp_path, "a", a), write(tmp_path, "b", b), "--out", str(out)])
    md = capsys.readouterr().out
    assert "| driving_score | 60.00 | 65.00 | +5.00 |" in md and "| 2 / 0 / 1 | 0.500 |" in md
    assert "only in A (left out): 1: Town02_0" in md and "| ControlLoss | 1 -> 2 | 0 -> 2 |" in md
    assert (out / "compare.md").read_text() == md
    assert json.loads((out / "compare.json").read_text())["scores"]["driving_score"]["won"] == 2


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

"""``carl-eval benchmark=longest6_carla``: Leaderboard routes driven through the real ``carla`` client against the
protocol stand-in (the closest thing to CARLA servers here), two servers at a time, with the rule-based expert."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from envs.maps.opendrive import default_maps_dir
from tests.support.processes import standin_executable

MAPS = default_maps_dir()
TOWN01 = MAPS / "Town01.xodr" if MAPS else None
ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.carla,
              pytest.mark.skipif(TOWN01 is None or not TOWN01.is_file(), reason="CARLA town maps not available")]

# three short stretches of longest6 v2's Town01 route 5 (CARLA coordinates)
ROUTES = [("a", (157.99, 39.40), (157.96, 17.95)), ("b", (315.18, 1.78), (348.85, 1.79)),
          ("c", (392.27, 62.62), (392.35, 120.0))]


def _route_file(path: Path) -> Path:
    body = "".join(f'<route id="{rid}" town="Town01"><waypoints><position x="{a[0]}" y="{a[1]}" z="0"/>'
                   f'<position x="{b[0]}" y="{b[1]}" z="0"/></waypoints></route>' for rid, a, b in ROUTES)
    path.write_text(f"<routes>{body}</routes>")
    return path


def test_longest6_carla_expert_two_servers_at_a_time(tmp_path: Path) -> None:
    out, logs = tmp_path / "eval", tmp_path / "logs"
    cmd = [sys.executable, "-m", "carl.eval", "policy=expert", "benchmark=longest6_carla",
           f"benchmark.route_file={_route_file(tmp_path / 'routes.xml')}", "benchmark.parallel_routes=2",
           f"benchmark.options.executable={standin_executable(tmp_path, TOWN01)}", "benchmark.options.base_port=24800",
           f"benchmark.options.log_dir={logs}", "benchmark.options.traffic_vehicles=0",
           "benchmark.options.traffic_pedestrians=0", "benchmark.options.ready_timeout=30", "benchmark.max_steps=400",
           f"out_dir={out}", "worst_videos=1", "torch_threads=1"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        for f in logs.glob("carla_*.pid"):  # never leak a server
            try:
                os.killpg(int(f.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "3 routes in 2 groups, env carla" in proc.stdout
    records = json.loads((out / "results.json").read_text())["_checkpoint"]["records"]
    assert sorted(r["route_id"] for r in records) == ["Town01_a", "Town01_b", "Town01_c"]
    assert {r["carl"]["group"] for r in records} == {"Town01[0:2]", "Town01[2:3]"}
    by_id = {r["route_id"]: r for r in records}
    assert by_id["Town01_c"]["carl"]["route_index"] == 2  # the second group's row 0 drove route 2
    for r in records:  # the expert finishes these short stretches through the real client
        assert r["scores"]["score_route"] > 90.0, r
    summary = json.loads((out / "summary.json").read_text())
    assert summary["env"] == "carla" and summary["routes"] == 3
    assert not list((out / "videos").glob("*.gif"))  # re-driving for videos is a simulator-only feature

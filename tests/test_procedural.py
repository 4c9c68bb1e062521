"""Procedural towns: topology (no dead ends, strong connectivity), geometry, traffic control, worlds, config errors."""
from __future__ import annotations

import math
from dataclasses import fields, replace

import numpy as np
import pytest

from envs.maps.lanegraph import CONTROL_LIGHT, CONTROL_STOP, MARK_BROKEN, MARK_NONE, MARK_SOLID, LaneGraph, MapError
from envs.maps.procedural import ProceduralConfig, generate_town, generate_world

ARRAYS = [f.name for f in fields(LaneGraph) if f.name not in ("name", "meta")]


def _succ(g: LaneGraph) -> list[list[int]]:
    return [g.successors(i).tolist() for i in range(g.num_lanes)]


def _driving(g: LaneGraph) -> list[list[int]]:
    """Successors plus lane changes: what a vehicle (and the route planner) can follow."""
    return [s + [int(j) for j in (g.left[i], g.right[i]) if j >= 0] for i, s in enumerate(_succ(g))]


def _reach(adj: list[list[int]], start: int) -> set[int]:
    seen, todo = {start}, [start]
    while todo:
        for j in adj[todo.pop()]:
            if j not in seen:
                seen.add(j)
                todo.append(j)
    return seen


def _strongly_connected(adj: list[list[int]]) -> bool:
    rev: list[list[int]] = [[] for _ in adj]
    for i, js in enumerate(adj):
        for j in js:
            rev[j].append(i)
    return len(_reach(adj, 0)) == len(adj) == len(_reach(rev, 0))


def _heading(p: np.ndarray) -> np.ndarray:
    d = np.diff(p.astype(np.float64), axis=0)
    return np.arctan2(d[:, 1], d[:, 0])


def _wrap(a: np.ndarray) -> np.ndarray:
    return (a + np.pi) % (2 * np.pi) - np.pi


def _approaches(g: LaneGraph) -> dict[int, list[list[int]]]:
    """Per junction id: incoming road lanes grouped by approach (same-direction lanes joined by left/right)."""
    pred = g.predecessors()
    out: dict[int, list[list[int]]] = {}
    for j in np.unique(g.junction[g.is_junction]):
        incoming = sorted({p for c in np.flatnonzero(g.junction == j) for p in pred[c] if not g.is_junction[p]})
        groups: list[list[int]] = []
        left = set(incoming)
        while left:
            comp = _reach([[int(x) for x in (g.left[i], g.right[i]) if x >= 0] for i in range(g.num_lanes)],
                          left.pop())
            left -= comp
            groups.append(sorted(comp))
        out[int(j)] = groups
    return out


@pytest.fixture(scope="module")
def town() -> LaneGraph:
    return generate_town(ProceduralConfig(rows=3, cols=4), seed=3)


@pytest.fixture(scope="module")
def irregular_towns() -> list[LaneGraph]:
    return [generate_town(ProceduralConfig(kind="irregular", rows=4, cols=4), seed=s) for s in range(5)]


def test_deterministic_and_seed_dependent() -> None:
    cfg = ProceduralConfig(kind="irregular", rows=3, cols=3)
    a, b, c = generate_town(cfg, 7), generate_town(cfg, 7), generate_town(cfg, 8)
    for k in ARRAYS:
        np.testing.assert_array_equal(getattr(a, k), getattr(b, k), err_msg=k)
    assert a.meta == b.meta and a.meta["seed"] == 7 and a.meta["cfg"]["kind"] == "irregular"
    assert a.points.shape != c.points.shape or not np.array_equal(a.points, c.points)


def test_no_dead_ends_and_strongly_connected(town: LaneGraph, irregular_towns: list[LaneGraph]) -> None:
    for g in [town, *irregular_towns]:
        assert all(len(s) > 0 for s in _succ(g)), g.name
        assert _strongly_connected(_driving(g)), g.name


def test_single_lane_roads_strongly_connected_by_successors_alone() -> None:
    for kind in ("grid", "irregular"):
        g = generate_town(ProceduralConfig(kind=kind, rows=3, cols=3, lanes_per_direction=(1, 1)), seed=1)
        assert _strongly_connected(_succ(g)), kind


def test_polylines_smooth_and_continuous(town: LaneGraph, irregular_towns: list[LaneGraph]) -> None:
    for g in [town, *irregular_towns]:
        seg = np.linalg.norm(np.diff(g.points.astype(np.float64), axis=0), axis=1)
        for i in range(g.num_lanes):
            p = g.lane_points(i)
            assert np.all(seg[g.offsets[i]:g.offsets[i + 1] - 1] <= 1.0 + 1e-4), (g.name, i)
            h = _heading(p)
            assert np.abs(_wrap(np.diff(h))).max(initial=0.0) < math.radians(10), (g.name, i)
            for j in g.successors(i):
                q = g.lane_points(int(j))
                assert np.linalg.norm(p[-1] - q[0]) < 0.1, (g.name, i, int(j))
                assert abs(_wrap(_heading(q)[0] - h[-1])) < math.radians(10), (g.name, i, int(j))


def test_lane_attributes(town: LaneGraph) -> None:
    g = town
    road = ~g.is_junction
    assert np.all(g.junction[road] == -1) and np.all(g.junction[g.is_junction] >= 0)
    assert np.all(g.left_marking[g.is_junction] == MARK_NONE) and np.all(g.right_marking[g.is_junction] == MARK_NONE)
    assert np.all(g.left_marking[road & (g.left < 0)] == MARK_SOLID)
    assert np.all(g.left_marking[road & (g.left >= 0)] == MARK_BROKEN)
    assert np.all(g.right_marking[road & (g.right < 0)] == MARK_SOLID)
    assert np.all(g.right_marking[road & (g.right >= 0)] == MARK_BROKEN)
    pred = g.predecessors()
    for c in np.flatnonzero(g.is_junction):  # connector limit = min of the two roads it joins
        (a,), (b,) = pred[c], g.successors(c)
        assert g.speed_limit[c] == min(g.speed_limit[a], g.speed_limit[b])
    directions = np.count_nonzero(road & (g.left < 0))  # one innermost lane per road direction
    assert len(g.shoulder_width) == directions and np.all(g.shoulder_width == np.float32(1.5))
    assert len(g.speed_signs) == directions
    assert set(g.speed_signs[:, 2].tolist()) <= set(np.float32([8.33, 11.11, 13.89]).tolist())


def test_neighbours_symmetric_and_same_direction(town: LaneGraph) -> None:
    g = generate_town(ProceduralConfig(rows=3, cols=3, lanes_per_direction=(1, 3)), seed=2)
    for gr in (town, g):
        for i in range(gr.num_lanes):
            for nb, back in ((gr.left[i], gr.right), (gr.right[i], gr.left)):
                if nb < 0:
                    continue
                assert back[nb] == i and not gr.is_junction[i] and not gr.is_junction[nb]
                hi, hn = _heading(gr.lane_points(i))[0], _heading(gr.lane_points(int(nb)))[0]
                assert abs(_wrap(hi - hn)) < 1e-3
                # left neighbour lies to the left: positive cross product of heading and offset
                d = gr.lane_points(int(nb))[0] - gr.lane_points(i)[0]
                cross = math.cos(hi) * d[1] - math.sin(hi) * d[0]
                assert (cross > 0) == (nb == gr.left[i])


@pytest.mark.parametrize("kind,seed", [("grid", 0), ("irregular", 0), ("irregular", 1)])
def test_three_lanes_per_direction(kind: str, seed: int) -> None:
    g = generate_town(ProceduralConfig(kind=kind, rows=3, cols=3, lanes_per_direction=(3, 3)), seed=seed)
    middle = (g.left >= 0) & (g.right >= 0)
    assert middle.any()
    assert all(len(s) > 0 for s in _succ(g)) and _strongly_connected(_driving(g))


def test_irregular_at_minimum_block() -> None:
    """Near the shortest allowed block the jitter shrinks instead of the layout failing."""
    cfg = ProceduralConfig(kind="irregular", block=49.0, lanes_per_direction=(3, 3))
    for seed in range(3):
        g = generate_town(cfg, seed)
        assert _strongly_connected(_driving(g))


def test_traffic_control(town: LaneGraph, irregular_towns: list[LaneGraph]) -> None:
    for g in [town, *irregular_towns]:
        stop_at = {int(lane): k for k, lane in enumerate(g.stop_lane)}
        n_light = n_stop = 0
        for j, groups in _approaches(g).items():
            if len(groups) < 3:  # bend: connected through without control
                assert not any(i in stop_at for grp in groups for i in grp)
                continue
            controls = {int(g.stop_control[stop_at[i]]) for grp in groups for i in grp}
            assert len(controls) == 1, (g.name, j)
            if controls == {CONTROL_STOP}:
                n_stop += 1
                assert all(i in stop_at for grp in groups for i in grp)
                continue
            n_light += 1
            phases = []
            for grp in groups:
                lg = {int(g.stop_light_group[stop_at[i]]) for i in grp}
                assert len(lg) == 1, "all lanes of an approach share one light group"
                (lg,) = lg
                assert g.light_junction[lg] == j and g.light_num_phases[lg] == len(groups)
                phases.append(int(g.light_phase[lg]))
            assert sorted(phases) == list(range(len(groups))), (g.name, j)
        assert n_light + n_stop > 0
    assert np.all(np.isin(town.stop_control, (CONTROL_LIGHT, CONTROL_STOP)))


def test_signal_fraction_extremes() -> None:
    all_lights = generate_town(ProceduralConfig(rows=3, cols=3, signal_fraction=1.0), seed=0)
    all_stops = generate_town(ProceduralConfig(rows=3, cols=3, signal_fraction=0.0), seed=0)
    assert np.all(all_lights.stop_control == CONTROL_LIGHT) and len(all_stops.light_phase) == 0
    assert np.all(all_stops.stop_control == CONTROL_STOP)


def test_crosswalks_convex_ccw(town: LaneGraph) -> None:
    cw = town.crosswalks.astype(np.float64)
    assert len(cw) > 0
    for q in cw:
        e = np.roll(q, -1, axis=0) - q
        cross = e[:, 0] * np.roll(e, -1, axis=0)[:, 1] - e[:, 1] * np.roll(e, -1, axis=0)[:, 0]
        assert np.all(cross > 0)
        assert 2.5 < min(np.linalg.norm(e, axis=1)) < 3.5  # ~3 m deep
    assert len(generate_town(ProceduralConfig(rows=3, cols=3, crosswalks=False), 0).crosswalks) == 0


def test_irregular_kind_varies(irregular_towns: list[LaneGraph]) -> None:
    grid = generate_town(ProceduralConfig(rows=4, cols=4), seed=0)
    sizes = {g.num_lanes for g in irregular_towns}
    assert len(sizes) > 1
    # jittered nodes: road lanes are not all axis-aligned
    angles = np.concatenate([_heading(g.lane_points(i)) for g in irregular_towns[:1]
                             for i in np.flatnonzero(~g.is_junction)])
    assert np.abs(_wrap(angles * 4)).max() > 0.05
    assert grid.meta["cfg"]["kind"] == "grid"


def test_world_towns_disjoint_and_unlinked() -> None:
    cfg = ProceduralConfig(rows=3, cols=3)
    w = generate_world(cfg, [0, 1, 2])
    towns = w.meta["towns"]
    assert [t["seed"] for t in towns] == [0, 1, 2] and towns[-1]["lanes"][1] == w.num_lanes
    boxes = []
    for t in towns:
        a, b = t["lanes"]
        p = w.points[w.offsets[a]:w.offsets[b]]
        boxes.append((p.min(0), p.max(0)))
        for i in range(a, b):
            links = [*w.successors(i).tolist(), int(w.left[i]), int(w.right[i])]
            assert all(a <= j < b for j in links if j >= 0)
        ja, jb = t["junctions"]
        assert np.all((w.junction[a:b] == -1) | ((w.junction[a:b] >= ja) & (w.junction[a:b] < jb)))
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            (lo1, hi1), (lo2, hi2) = boxes[i], boxes[j]
            assert np.any(hi1 < lo2) or np.any(hi2 < lo1)
    # the single-town arrays are reproduced exactly inside the world (translated)
    t1 = generate_town(cfg, 1)
    a, b = towns[1]["lanes"]
    np.testing.assert_allclose(w.points[w.offsets[a]:w.offsets[b]] - np.float32(towns[1]["offset"]), t1.points,
                               atol=1e-3)
    assert _strongly_connected(_driving(t1))
    with pytest.raises(MapError, match="spacing"):
        generate_world(cfg, [0, 1], spacing=10.0)


@pytest.mark.parametrize("field,value", [
    ("rows", 1), ("cols", 0), ("kind", "hex"), ("lanes_per_direction", (0, 2)), ("lanes_per_direction", (1, 4)),
    ("lanes_per_direction", (2, 1)), ("block", 30.0), ("lane_width", 0.5), ("speed_limits", ()),
    ("signal_fraction", 1.5), ("shoulder_width", -1.0),
])
def test_bad_config_names_field(field: str, value: object) -> None:
    with pytest.raises(MapError, match=field):
        generate_town(replace(ProceduralConfig(), **{field: value}), 0)


def test_block_too_short_for_lane_count() -> None:
    ok = ProceduralConfig(block=45.0, lanes_per_direction=(1, 1))
    generate_town(ok, 0)
    with pytest.raises(MapError, match="block=45.0"):
        generate_town(replace(ok, lanes_per_direction=(3, 3)), 0)


def test_save_load_round_trip(tmp_path, town: LaneGraph) -> None:
    path = tmp_path / "town.npz"
    town.save(path)
    back = LaneGraph.load(path)
    assert back.name == town.name and back.meta["seed"] == 3
    for k in ARRAYS:
        np.testing.assert_array_equal(getattr(back, k), getattr(town, k), err_msg=k)

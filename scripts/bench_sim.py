"""Throughput of the built-in simulator: environment steps per second by batch size, without and with the BEV.

Prints one JSON line per configuration, e.g.
``{"device": "cpu", "batch": 1024, "bev": "none", "steps_per_s": 51234.5, "ms_per_step": 19.99, ...}``:
``ms_per_step`` is the median over blocks of ~0.5 s (``ms_per_step_min`` their fastest). The configurations a
ratio compares (no observation and the vector ones; each with and without scenarios) are timed in alternating
blocks, and each ratio line is the median of the per-round ratios: a shared VM's rate drifts by 20-25 % between
runs a minute apart, and alternating blocks see the same drift.
Targets (issue 2): 2-core CPU >= 50,000 steps/s at batch 1024 without BEV and >= 2,000 steps/s at batch 256 with
a 10x128x128 BEV; H200 >= 1,000,000 without BEV and >= 100,000 with 10x256x256.

    python scripts/bench_sim.py [--device cpu|cuda] [--batches 1 64 256 1024] [--seconds 5] [--threads 2]
    python scripts/bench_sim.py --worlds Town01 Town04 all --batches 256   # multi-map world beside single towns

``--worlds``: ``procedural`` (the default: two procedural towns), a CARLA town or map file (one map), or ``all``
(Town01-07, Town10HD and the procedural towns in one multi-map world). Target (issue 12): the ``all`` world's
ms_per_step within 20 % of a single town's at the same batch. Each line carries the world's build time and size.

    python scripts/bench_sim.py --batches 256 --scenario-densities 0 7.4   # route scenarios off and at longest6's

    python scripts/bench_sim.py --batches 1024 --vector   # the vector observation beside no observation

``--vector``: also time the vector observation (``env.options.observation=vector``) at each batch; a ``vector_cost``
line gives its cost beside no observation. Target (issue 24): at most 25 % at batch 1024 on 2 cores.
``--path-conflicts`` (with ``--vector``): also the vector observation with ``vector.path_conflicts`` (the towns_vector
recipe's), observation ``vector+paths``, with its own cost line. ``--compile`` (with ``--vector``): the vector
observation's stages compiled (``env.options.vector.compile``); each batch size compiles in the warm-up, before its
timing starts. ``--no-bev``: skip the BEV runs (no observation and the vector one only).

``--scenario-densities``: scenarios per km on the random routes (``env.options.scenario_density``; longest6 v2 carries
7.4). Target (issue 23): ms_per_step with scenarios within 15 % of the same run without them; with a density of 0
among them, a ``scenario_cost`` line per configuration gives that ratio - 1.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from envs import make_env  # noqa: E402
from carl.config import cpu_line  # noqa: E402


TOWNS = ("Town01", "Town02", "Town03", "Town04", "Town05", "Town06", "Town07", "Town10HD")


def world_options(world: str) -> dict:
    if world == "procedural":
        return dict(town_seeds=(0, 1))
    if world == "all":
        return dict(maps=(*TOWNS, "procedural"), town_seeds=(0, 1))
    return dict(map=world)


def world_mb(env) -> float:
    """Megabytes of the world's tensors: lane and route tensors, the (atlas) raster and its derived BEV sources."""
    w, seen, total = env.world, set(), 0
    tensors = [v for v in vars(w).values() if isinstance(v, torch.Tensor)]
    tensors += [w.raster.layers, w.raster.seg_id]
    for v in w.raster.cache.values():
        tensors += [x for x in (v if isinstance(v, tuple) else (v,)) if isinstance(x, torch.Tensor)]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return round(total / 2**20, 1)


class Timed:
    """One configuration's env, built and warmed up, timed in blocks of steps. Configurations compared by a ratio
    (scenarios on and off, an observation and none) are timed in alternating blocks (:func:`interleaved`): on a shared
    VM the step rate drifts by 20-25 % between runs a minute apart, and a ratio of two runs inherits that drift."""

    def __init__(self, device: str, batch: int, bev_size: int | str | None, traffic: bool, world: str = "procedural",
                 scenario_density: float = 0.0, compile_vector: bool = False) -> None:
        """``bev_size``: a BEV size, None (no observation beyond the measurements), "vector" or "vector+paths" (with
        path conflicts)."""
        observation = bev_size if bev_size in ("vector", "vector+paths") else None
        options = dict(bev=bev_size is not None and observation is None, traffic=traffic, num_routes=256,
                       scenario_density=scenario_density, **world_options(world))
        if observation:
            options["observation"], bev_size = "vector", None
            options["vector"] = {"path_conflicts": observation == "vector+paths", "compile": compile_vector}
        if bev_size is not None:
            options.update(bev_size=bev_size, bev_ego_from_bottom=bev_size * 100 // 256)
        t_load = time.perf_counter()
        self.env = env = make_env("sim", batch, device, 0, **options)
        env.reset()
        load_s = time.perf_counter() - t_load
        gen = torch.Generator(device=device).manual_seed(0)
        # mostly forward, gentle steering: episodes of useful length
        self.actions = (torch.rand(64, batch, 2, generator=gen, device=device) * torch.tensor([0.2, 1.2], device=device)
                        - torch.tensor([0.1, 0.2], device=device))
        self.sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        self.steps, self.blocks = 0, []  # ms per step of each timed block
        self.block(10)  # warm-up (and compilation), not counted
        self.blocks.clear()
        self.info = {"device": device, "batch": batch,
                     "bev": "none" if bev_size is None else f"10x{bev_size}x{bev_size}",
                     "observation": observation or ("bev" if bev_size is not None else "none"),
                     "compiled": bool(observation and compile_vector), "traffic": traffic,
                     "threads": torch.get_num_threads(), "simulator": "carl", "world": world,
                     "maps": env.world.num_maps, "world_build_s": round(load_s, 2), "world_mb": world_mb(env),
                     "scenario_density": scenario_density, "scenarios": int((env.world.scn.route_scn >= 0).sum()),
                     "cpu": cpu_line()}

    def block(self, steps: int) -> float:
        """Time ``steps`` env steps (rounded up to tens); returns and records ms per step."""
        steps = -(-steps // 10) * 10
        self.sync()
        t0 = time.perf_counter()
        for i in range(steps):
            self.env.step(self.actions[(self.steps + i) % 64])
        self.sync()
        ms = (time.perf_counter() - t0) / steps * 1000
        self.steps += steps
        self.blocks.append(ms)
        return ms

    def result(self) -> dict:
        ms = statistics.median(self.blocks)
        return {**self.info, "steps_per_s": round(self.info["batch"] * 1000 / ms, 1), "ms_per_step": round(ms, 3),
                "ms_per_step_min": round(min(self.blocks), 3), "blocks": len(self.blocks)}

    def close(self) -> None:
        self.env.close()


def interleaved(timed: list[Timed], seconds: float, block_s: float = 0.5) -> None:
    """Time each configuration for about ``seconds`` in alternating blocks of about ``block_s`` (sized from the
    warm-up), so that each ratio between them compares steps taken within the same few seconds."""
    steps = [max(10, int(block_s * 1000 / t.block(10))) for t in timed]  # one more warm-up block each, to size
    for t in timed:
        t.blocks.clear()
    for _ in range(max(1, round(seconds / block_s))):
        for t, n in zip(timed, steps):
            t.block(n)


def block_ratio(r: Timed, base: Timed) -> float:
    """The median over rounds of ``r``'s ms per step over ``base``'s in the same round, minus 1."""
    return round(statistics.median(a / b for a, b in zip(r.blocks, base.blocks)) - 1.0, 3)


def bench_highway_env(seconds: float) -> dict | None:
    """highway-env's intersection-v0 (optional `bench` extra), random actions, for a like-for-like ratio."""
    try:
        import gymnasium
        import highway_env  # noqa: F401
    except ImportError:
        return None
    env = gymnasium.make("intersection-v0")
    env.reset(seed=0)
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        steps += 1
        if term or trunc:
            env.reset()
    return {"device": "cpu", "batch": 1, "bev": "none", "simulator": "highway-env intersection-v0",
            "steps_per_s": round(steps / (time.perf_counter() - t0), 2)}


def cost_lines(timed: list[Timed]) -> list[dict]:
    """``vector_cost`` (a vector observation against none, same scenarios) and ``scenario_cost`` (scenarios against
    none, same observation) of an interleaved group, each the median of its per-round ratios."""
    lines = []
    for t in timed:
        r = t.info
        if r["observation"].startswith("vector"):
            base = next(b for b in timed if b.info["observation"] == "none"
                        and b.info["scenario_density"] == r["scenario_density"])
            lines.append({"vector_cost": block_ratio(t, base), "observation": r["observation"],
                          "compiled": r["compiled"], "batch": r["batch"], "world": r["world"],
                          "scenario_density": r["scenario_density"], "target": 0.25, "cpu": r["cpu"]})
    for t in timed:
        r = t.info
        base = next((b for b in timed if b.info["scenario_density"] == 0 and b.info["bev"] == r["bev"]
                     and b.info["observation"] == r["observation"]), None)
        if r["scenario_density"] > 0 and base is not None:  # else no run without scenarios to compare with
            lines.append({"scenario_cost": block_ratio(t, base), "observation": r["observation"], "bev": r["bev"],
                          "batch": r["batch"], "world": r["world"], "scenario_density": r["scenario_density"],
                          "target": 0.15, "cpu": r["cpu"]})
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", type=int, nargs="*", default=None)
    p.add_argument("--bev-sizes", type=int, nargs="*", default=None, help="BEV sizes to time besides 'none'")
    p.add_argument("--no-bev", action="store_true", help="time no BEV (only 'none' and the vector observation)")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-traffic", action="store_true")
    p.add_argument("--vector", action="store_true", help="also time the vector observation at each batch")
    p.add_argument("--path-conflicts", action="store_true", help="with --vector: also with vector.path_conflicts")
    p.add_argument("--compile", action="store_true", help="with --vector: its stages compiled (vector.compile)")
    p.add_argument("--scenario-densities", type=float, nargs="*", default=[0.0],
                   help="route scenarios per km on the random routes (0: none)")
    p.add_argument("--worlds", nargs="*", default=["procedural"],
                   help="procedural | a town or map file | all (8 towns + procedural in one world)")
    args = p.parse_args()
    if args.compile and not args.vector:
        p.error("--compile compiles the vector observation's stages: add --vector")
    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    batches = args.batches or ([1, 64, 256, 1024, 16384, 65536] if cuda else [1, 64, 256, 1024])
    bev_sizes = [] if args.no_bev else args.bev_sizes or ([128, 256] if cuda else [128])
    results, costs = [], []
    for world in args.worlds:
        vectors = (["vector", *(["vector+paths"] if args.path_conflicts else [])] if args.vector else [])
        # each group is timed interleaved: no observation beside the vector ones (vector_cost), each beside itself
        # with and without scenarios (scenario_cost); a BEV size is a group of its own (one BEV env of a large batch
        # holds GBs)
        for observations in [[None, *vectors], *[[b] for b in bev_sizes]]:
            for batch in batches:
                if isinstance(observations[0], int) and batch * observations[0] ** 2 * 10 > (
                        8 << 30 if cuda else 1 << 30):
                    continue  # observation alone would not fit
                timed = [Timed(args.device, batch, o, not args.no_traffic, world, density, args.compile)
                         for o in observations for density in args.scenario_densities]
                interleaved(timed, args.seconds)
                for t in timed:
                    results.append(t.result())
                    print(json.dumps(results[-1]), flush=True)
                costs += cost_lines(timed)
                for t in timed:
                    t.close()
    for line in costs:
        print(json.dumps(line), flush=True)
    ref = bench_highway_env(args.seconds)
    if ref is not None:
        ours = next((r for r in results if r["batch"] == 1 and r["observation"] == "none"), None)
        if ours:
            ref["ratio_carl_batch1_to_highway_env"] = round(ours["steps_per_s"] / ref["steps_per_s"], 1)
        best = max(r["steps_per_s"] for r in results if r["observation"] == "none")
        ref["ratio_carl_best_to_highway_env"] = round(best / ref["steps_per_s"], 1)
        print(json.dumps(ref), flush=True)
    else:
        print(json.dumps({"note": "highway-env not installed (pip install -e '.[bench]'): no comparison"}), flush=True)


if __name__ == "__main__":
    main()

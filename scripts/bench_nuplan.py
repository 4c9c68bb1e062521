"""Benchmark the nuPlan env: scenario steps per second (CPU; CUDA when present) and the time to load one scenario
from the cache. Prints JSON lines with at least ``device``, ``batch`` and ``steps_per_s``.

    python scripts/bench_nuplan.py [--cache-dir DIR] [--data-root DIR] [--batch 8 32] [--steps 100] [--no-bev]

Without ``--data-root``/``--cache-dir`` a synthetic dataset is generated in a temporary folder.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from envs.nuplan.cache import list_cache, load  # noqa: E402
from envs.nuplan.env import make_nuplan_env  # noqa: E402
from envs.nuplan.synthetic import make_synthetic_dataset  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--reactive", action="store_true")
    ap.add_argument("--no-bev", action="store_true")
    a = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    data_root = a.data_root
    if a.cache_dir is None and data_root is None:
        data_root = str(make_synthetic_dataset(Path(tmp.name) / "data", num_logs=3))
    cache_dir = a.cache_dir or str(Path(tmp.name) / "cache")
    opts = {"cache_dir": cache_dir, "data_root": data_root, "reactive": a.reactive, "sim": {"bev": not a.no_bev}}
    make_nuplan_env(1, "cpu", 0, **opts)  # builds the cache when needed
    files = list_cache(cache_dir)
    t0 = time.perf_counter()
    for f in files:
        load(f)
    load_ms = (time.perf_counter() - t0) / len(files) * 1e3
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        for b in a.batch:
            env = make_nuplan_env(b, dev, 0, **opts)
            env.reset(seed=0)
            act = torch.zeros(b, 2, device=dev)
            act[:, 1] = 0.2
            for _ in range(5):
                env.step(act)
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                env.step(act)
            if dev == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            print(json.dumps({"device": dev, "batch": b, "steps_per_s": round(a.steps * b / dt, 1),
                              "step_ms": round(dt / a.steps * 1e3, 2), "scenario_load_ms": round(load_ms, 2),
                              "scenarios": len(env.data.scenarios), "reactive": a.reactive, "bev": not a.no_bev,
                              "threads": torch.get_num_threads()}), flush=True)
    tmp.cleanup()


if __name__ == "__main__":
    main()

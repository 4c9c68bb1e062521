"""Gradient-sync benchmark: bytes and seconds per update for every ``parallel.sync`` method on CaRL's model.

Two gloo ranks on this machine train CaRL's network (10x256x256 BEV, ~2M parameters) on random data; after a
warm-up (PowerSGD starts at step 2) each method is timed over ``--steps`` updates. ``lgreco`` is timed after its first
plan (step ``2 + --lgreco-every``) over one whole re-plan period, so its planning cost (SVDs on rank 0) is amortised
as in training.
One JSON line per (method, bandwidth)::

    {"method": "powersgd", "bandwidth_mbit": 100, "bytes_per_update": 98304, "compression_ratio": 81.0,
     "update_s": 0.41, "sync_s": 0.05, "params": 1979916, "world_size": 2}

``bytes_per_update`` is what one rank hands to its collectives per optimiser step (the all-reduce payload);
``update_s`` is the wall time of one optimiser step (forward, backward with sync, Adam); ``sync_s`` the part
spent in communication hooks.

Network emulation (root, iproute2, tbf in the kernel): two network namespaces joined by a veth pair whose egress
is shaped with ``tc qdisc ... tbf rate <R>mbit burst 32kbit latency 400ms`` (``docs/distributed.md``); each rank
runs in its own namespace with ``GLOO_SOCKET_IFNAME`` set to its veth end. Only these private namespaces and
addresses (10.231.0.1/2) are used. Where namespaces cannot be made the shaped runs are skipped with a message;
``--no-netns`` runs once on plain loopback without shaping (``bandwidth_mbit`` null).

    python scripts/bench_sync.py --no-netns
    sudo python scripts/bench_sync.py --bandwidth 100 1000
    python scripts/bench_sync.py --learn --methods allreduce powersgd lgreco   # ~10 min per method on 2 cores

``--learn`` trains the quick preset with 2 ranks (torchrun, 16 envs per rank: the single-process batch of 2048) once
per method and seed (``--seeds 1 2 3``) and prints each final evaluation (``eval/final.json``) as ``{"method", "seed",
"driving_score", "route_completion", ...}``, then a ``mean_driving_score`` line per method when there are several
seeds (one seed's score moves by ~10 points from seed to seed); the bar is the same evaluation bar as ``allreduce``.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from carl.config import SYNC_METHODS  # noqa: E402 - light (no torch): the method names, declared once

METHODS = list(SYNC_METHODS)
NS = ("carl_bs_a", "carl_bs_b")
VETH = ("carl_va", "carl_vb")
ADDR = ("10.231.0.1", "10.231.0.2")


# ------------------------------------------------------------------------------------------------------------------
# worker: one rank
# ------------------------------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO))
    import torch

    from carl.config import ParallelConfig
    from carl.parallel import init_distributed, make_sync
    from carl.policy import CarlPolicy
    from envs.api import TensorSpec

    torch.set_num_threads(args.threads)
    ctx, _ = init_distributed("cpu", "gloo", timeout_s=600)
    spec = {"bev": TensorSpec((10, args.bev, args.bev), torch.uint8, 0, 255),
            "measurements": TensorSpec((8,), torch.float32),
            "value_measurements": TensorSpec((10,), torch.float32)}
    gen = torch.Generator().manual_seed(ctx.rank)
    n = args.batch
    obs = {"bev": torch.randint(0, 255, (n, 10, args.bev, args.bev), generator=gen).to(torch.uint8),
           "measurements": torch.randn(n, 8, generator=gen), "value_measurements": torch.randn(n, 10, generator=gen)}
    action = torch.rand(n, 2, generator=gen) * 1.8 - 0.9
    for method in args.methods:
        torch.manual_seed(0)
        policy = CarlPolicy(spec, 2)
        par = ParallelConfig(sync=method, powersgd_rank=args.rank, powersgd_impl=args.powersgd_impl,
                             lgreco_every=args.lgreco_every, lgreco_acc_steps=min(10, args.lgreco_every),
                             topk_ratio=args.topk_ratio, local_steps=args.local_steps,
                             hierarchical=args.hierarchical, node_size=args.ranks_per_node if args.hierarchical else 0)
        sync = make_sync(policy, ctx, par)
        opt = torch.optim.Adam(policy.parameters(), lr=1e-4)
        times = []
        warmup, steps = 8, args.steps  # PowerSGD compresses from step 2
        if method == "localsgd":
            steps = max(steps, args.local_steps)  # whole outer rounds
        if method == "lgreco":  # after the first plan (step 2 + every); one whole period, its re-plan amortised
            warmup, steps = par.powersgd_start_iter + args.lgreco_every + 1, max(steps, args.lgreco_every)
        for step in range(warmup + steps):
            if step == warmup:
                sync.pop_stats()
                ctx.barrier()
            t0 = time.perf_counter()
            out = sync.act(obs, action)
            loss = -out.log_prob.mean() + out.value.pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sync.after_step()
            if step >= warmup:
                times.append(time.perf_counter() - t0)
        stats = sync.pop_stats()
        sync.flush()
        row = {"method": method, "bandwidth_mbit": args.bandwidth_mbit,
               "bytes_per_update": int(round(stats.get("sync/bytes_per_step", 0.0))),
               "compression_ratio": round(stats.get("sync/compression_ratio", 0.0), 2),
               "update_s": round(sum(times) / len(times), 4),
               "sync_s": round(stats.get("sync/seconds", 0.0) / max(1, len(times)), 4),
               "params": policy.num_params(), "world_size": ctx.world_size, "ranks_per_node": args.ranks_per_node,
               "hierarchical": args.hierarchical, "batch_per_rank": n}
        if "sync/intra_node_bytes_per_update" in stats:
            row["intra_node_bytes_per_update"] = int(round(stats["sync/intra_node_bytes_per_update"]
                                                           / max(1.0, stats["sync/steps"])))
        if ctx.is_main:
            print(json.dumps(row), flush=True)
    ctx.shutdown()


# ------------------------------------------------------------------------------------------------------------------
# launcher
# ------------------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sh(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def make_namespaces(rate_mbit: int) -> None:
    """Two namespaces joined by a veth pair, each end shaped to ``rate_mbit`` with tbf."""
    remove_namespaces()
    for ns in NS:
        sh(["ip", "netns", "add", ns])
    sh(["ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1]])
    for ns, veth, addr in zip(NS, VETH, ADDR):
        sh(["ip", "link", "set", veth, "netns", ns])
        sh(["ip", "netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", veth])
        sh(["ip", "netns", "exec", ns, "ip", "link", "set", veth, "up"])
        sh(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])
        sh(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", f"{rate_mbit}mbit",
            "burst", "32kbit", "latency", "400ms"])


def remove_namespaces() -> None:
    for ns in NS:  # deleting a namespace also removes its veth end (and so the pair)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run_ranks(args: argparse.Namespace, bandwidth: int | None, timeout: float) -> int:
    """Two "nodes" (namespaces, or loopback) of ``--ranks-per-node`` ranks each, numbered node by node."""
    port = free_port() if bandwidth is None else 29517
    per_node = args.ranks_per_node
    procs = []
    for rank in range(2 * per_node):
        node = rank // per_node
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "WORLD_SIZE": str(2 * per_node),
               "LOCAL_WORLD_SIZE": str(per_node), "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(args.threads),
               "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--methods", *args.methods,
               "--steps", str(args.steps), "--batch", str(args.batch), "--bev", str(args.bev),
               "--rank", str(args.rank), "--powersgd-impl", args.powersgd_impl, "--topk-ratio", str(args.topk_ratio),
               "--local-steps", str(args.local_steps), "--lgreco-every", str(args.lgreco_every),
               "--ranks-per-node", str(per_node), "--threads", str(args.threads),
               "--bandwidth-mbit", "none" if bandwidth is None else str(bandwidth),
               *(["--hierarchical"] if args.hierarchical else [])]
        if bandwidth is None:
            env["MASTER_ADDR"] = "127.0.0.1"
        else:
            env.update(MASTER_ADDR=ADDR[0], GLOO_SOCKET_IFNAME=VETH[node])
            cmd = ["ip", "netns", "exec", NS[node], "env", *[f"{k}={env[k]}" for k in
                   ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "OMP_NUM_THREADS", "PYTHONPATH", "GLOO_SOCKET_IFNAME")], *cmd]
        procs.append(subprocess.Popen(cmd, env=env, stdout=None if rank == 0 else subprocess.DEVNULL))
    try:
        return max(p.wait(timeout=timeout) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def learn(args: argparse.Namespace) -> int:
    """Train the quick preset per method and seed with 2 ranks; print each final evaluation, then per-method means."""
    import tempfile

    root = Path(args.learn_dir or tempfile.mkdtemp(prefix="bench_sync_learn_"))
    code = 0
    for method in args.methods:
        scores = []
        for seed in args.seeds:
            run_dir = root / f"quick-{method}-seed{seed}"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                   "carl.train", "+experiment=quick", "parallel=ddp", f"parallel.sync={method}", "env.num_envs=16",
                   f"seed={seed}", "parallel.torch_threads=1", "logging.progress_bar=false", f"run_dir={run_dir}",
                   *args.overrides]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
            final = run_dir / "eval" / "final.json"
            if proc.returncode != 0 or not final.is_file():
                print(f"bench_sync --learn: {method} seed {seed} failed (exit {proc.returncode}):\n"
                      f"{proc.stderr[-2000:]}", file=sys.stderr)
                code = 1
                continue
            result = json.loads(final.read_text())
            scores.append((result["driving_score"], result["route_completion"]))
            print(json.dumps({"method": method, "learn": True, "seed": seed, "world_size": 2,
                              "driving_score": round(result["driving_score"], 2),
                              "route_completion": round(result["route_completion"], 2),
                              "infraction_score": round(result["infraction_score"], 3),
                              "episodes": result["episodes"], "seconds": round(time.perf_counter() - t0, 1),
                              "overrides": args.overrides, "run_dir": str(run_dir)}), flush=True)
        if len(scores) > 1:
            ds, rc = (sum(x) / len(scores) for x in zip(*scores))
            print(json.dumps({"method": method, "learn": True, "seeds": len(scores), "mean_driving_score": round(ds, 2),
                              "mean_route_completion": round(rc, 2), "min_driving_score": round(min(s[0] for s in scores), 2),
                              "overrides": args.overrides}), flush=True)
    return code


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--bandwidth", nargs="+", type=int, default=[100, 1000], help="shaped rates in Mbit/s")
    ap.add_argument("--no-netns", action="store_true", help="plain loopback, no shaping")
    ap.add_argument("--steps", type=int, default=4, help="timed updates per method (after 8 warm-up updates)")
    ap.add_argument("--batch", type=int, default=2, help="samples per rank per update")
    ap.add_argument("--bev", type=int, default=256, help="BEV size (CaRL: 256)")
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD rank / L-GreCo reference rank")
    ap.add_argument("--powersgd-impl", default="layerwise", choices=("layerwise", "torch"),
                    help="powersgd: per-layer near-square matrices (default) or torch's powerSGD_hook")
    ap.add_argument("--topk-ratio", type=float, default=0.01)
    ap.add_argument("--lgreco-every", type=int, default=100,
                    help="lgreco re-plan period (parallel.lgreco_every); lgreco is timed over one whole period")
    ap.add_argument("--local-steps", type=int, default=8)
    ap.add_argument("--ranks-per-node", type=int, default=1,
                    help="ranks in each of the 2 nodes (namespaces); bytes_per_update is rank 0's")
    ap.add_argument("--hierarchical", action="store_true",
                    help="parallel.hierarchical: exact inside a node, the method between node leaders")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per (bandwidth) run")
    ap.add_argument("--learn", action="store_true", help="train the quick preset per method; print final evaluations")
    ap.add_argument("--learn-dir", help="where --learn puts its runs (default: a new temporary folder)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[1], help="--learn: one run per seed; means when several")
    ap.add_argument("--overrides", nargs="*", default=[], help="--learn: extra Hydra overrides for every run")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bandwidth-mbit", default="none", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.bandwidth_mbit = None if args.bandwidth_mbit == "none" else int(args.bandwidth_mbit)
        worker(args)
        return
    if args.learn:
        sys.exit(learn(args))
    if args.no_netns:
        sys.exit(run_ranks(args, None, args.timeout))
    code = 0
    for rate in args.bandwidth:
        try:
            make_namespaces(rate)
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            remove_namespaces()
            print(f"bench_sync: skipping the shaped runs: cannot create network namespaces ({detail.strip()}); "
                  "needs root, iproute2 and tbf. Use --no-netns for plain loopback.", file=sys.stderr)
            sys.exit(0)
        try:
            code = max(code, run_ranks(args, rate, args.timeout))
        finally:
            remove_namespaces()
    sys.exit(code)


if __name__ == "__main__":
    main()

"""``carl-eval`` / ``python -m carl.eval``: benchmark a policy and write Leaderboard-style results.

Usage::

    carl-eval policy=expert benchmark=towns
    carl-eval policy=runs/quick-20250101-120000/best.pt benchmark=longest6 baselines=true
    carl-eval policy=bundles/quick benchmark=longest6 benchmark.towns=[Town01,Town02] out_dir=runs/eval/mine
    carl-eval policy=random benchmark=towns benchmark.num_routes=4 overwrite=true
    carl-eval --cfg policy=expert                     # print the composed config and exit
    carl-eval hydra.run.dir=runs/eval/mine policy=expert          # results under runs/eval/mine
    carl-eval -m policy=expert,random benchmark=towns seed=0,1    # a sweep: one folder per job, a summary

``policy`` is ``expert`` (the backend's rule-based expert, privileged state), ``expert_seen`` (the simulator's
expert without the junction flows' next cars before they spawn), ``random`` (uniform actions), a training checkpoint
(``.pt``) or a bundle directory (``carl-export``); learned policies act deterministically (the Beta mean), computed
in float64 (``precision=float32``: as they trained; docs/evaluation.md says why). Benchmarks
(``conf/benchmark/*.yaml``) list route groups; each group is one batched env whose rows drive all its routes in
parallel (longest6: one group per town).

Output folder (``out_dir``, else ``hydra.run.dir`` if given, else ``runs/eval/<benchmark>-<policy>``; in a sweep,
``-m``, ``hydra.sweep.dir/<job number>`` with ``sweep_summary.md``/``.json`` beside)::

    results.json         Leaderboard 2.0 layout: _checkpoint.records (one per route, written as each finishes)
    summary.json         aggregates (DS, RC, IS, infractions per km, routes = the routes run)
    summary.md / .csv    the policy beside the random policy and the expert (baselines=true)
    score_per_route.png, infractions.png
    videos/<route>.gif   BEV of the worst routes (re-driven)
    baselines/<name>/    the baselines' own result folders

Re-running the same command resumes: finished routes are kept, a group whose routes all finished is skipped. A
folder holding results of another policy or benchmark is refused unless ``overwrite=true``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from carl import zoo
from carl.bundle import BundleError, precision_problem
from carl.checkpoint import CheckpointError
from carl.cli import Command, run_command
from carl.config import ConfigError
from carl.eval import EvalError
from carl.eval.benchmarks import Benchmark, resolve_benchmark
from carl.eval.loop import evaluate_policy
from carl.eval.policies import BASELINES, RULE_BASED, PolicySource, resolve_policy
from carl.eval.report import plot_infractions, plot_scores, record_worst, write_tables
from carl.runlock import RunLock, took_over

# top-level shortcuts for benchmark keys: carl-eval benchmark=val14 env=nuplan reactive=true data_root=...
SHORTCUTS = {"env": "++benchmark.env", "reactive": "++benchmark.reactive",
             "data_root": "++benchmark.options.data_root", "cache_dir": "++benchmark.options.cache_dir"}


@dataclass
class EvalConfig:
    """``carl-eval``'s keys and defaults (``conf/eval.yaml`` picks the benchmark)."""

    policy: str = "expert"  # expert | expert_seen | random | <checkpoint .pt> | <bundle dir (carl-export)> | zoo:<name>
    out_dir: str | None = None  # default runs/eval/<benchmark>-<policy>
    overwrite: bool = False  # replace results of another policy/benchmark in out_dir (never done silently)
    baselines: bool = False  # also evaluate the random policy and the expert (out_dir/baselines/<name>)
    device: str = "cpu"  # cpu | cuda | cuda:N (env and policy)
    precision: str = "float64"  # float64 | float32: a learned policy's arithmetic. float64's actions do not follow the
    # BLAS kernels' float32 sums (docs/evaluation.md); float32 as the policy trained, and as results before 2026-12-07
    seed: int = 0  # traffic seed of every route group
    torch_threads: int = 0  # 0 = PyTorch's default
    worst_videos: int = 3  # BEV GIFs of the N lowest-scoring routes (0 = none)
    video_max_frames: int = 600  # at most this many 0.1 s frames per video
    benchmark: dict[str, Any] = field(default_factory=dict)  # conf/benchmark/<name>.yaml (route groups, env options)


def policy_name(arg: str) -> str:
    """The display name ``policy=`` gets (:func:`resolve_policy`), without loading it."""
    if arg in RULE_BASED:
        return arg
    if arg.startswith(zoo.PREFIX):
        return arg[len(zoo.PREFIX):]
    path = Path(arg)
    return path.name if path.is_dir() else f"{path.parent.name}/{path.stem}"


def default_out_dir(bench: str, policy: PolicySource | str) -> Path:
    safe = (policy if isinstance(policy, str) else policy.name).replace("/", "-")
    return Path("runs") / "eval" / f"{bench}-{safe}"


def run(cfg: dict[str, Any], log: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole ``carl-eval`` job for a composed config; returns the policy's summary."""
    if cfg.get("torch_threads"):
        torch.set_num_threads(int(cfg["torch_threads"]))
    device = torch.device(cfg.get("device") or "cpu")
    bench = resolve_benchmark(cfg["benchmark"])
    precision = str(cfg.get("precision", EvalConfig.precision))
    policy = resolve_policy(str(cfg["policy"]), device, precision)
    out_dir = Path(cfg["out_dir"]) if cfg.get("out_dir") else default_out_dir(bench.name, policy)
    seed, overwrite = int(cfg.get("seed", 0)), bool(cfg.get("overwrite", False))
    arithmetic = f" ({precision})" if policy.kind == "learned" else ""
    log(f"carl-eval: policy {policy.name}{arithmetic} | benchmark {bench.name} ({bench.num_routes} routes in "
        f"{len(bench.groups)} groups, env {bench.env}) | out {out_dir}")
    if bench.note:
        log(bench.note)
    with RunLock() as lock:  # one process writes in out_dir at a time
        previous = lock.acquire(out_dir, "out_dir")
        if previous is not None:
            log(took_over(previous))
        return _evaluate(cfg, bench, policy, out_dir, device, seed, overwrite, log)


def _evaluate(cfg: dict[str, Any], bench: Benchmark, policy: PolicySource, out_dir: Path, device: torch.device,
              seed: int, overwrite: bool, log: Callable[[str], None]) -> dict[str, Any]:
    summary, records = evaluate_policy(policy, bench, out_dir, device, seed, overwrite, log)

    summaries = {policy.name: summary}
    if cfg.get("baselines"):
        for name in BASELINES:
            if name == policy.kind:
                continue
            base, _ = evaluate_policy(resolve_policy(name, device), bench, out_dir / "baselines" / name, device, seed,
                                      overwrite, log)
            summaries[name] = base
    title = f"{bench.name} ({bench.env}): {summary['routes']}/{bench.num_routes} routes"
    write_tables(summaries, out_dir, title)
    if records:
        plot_scores(records, out_dir / "score_per_route.png", f"{policy.name} on {bench.name}")
        plot_infractions(summary, out_dir / "infractions.png", f"{policy.name} on {bench.name}")
        record_worst(records, bench, policy, device, seed, int(cfg.get("worst_videos", 0)),
                     int(cfg.get("video_max_frames", 600)), out_dir, log)
    log((out_dir / "summary.md").read_text())
    log(f"results: {out_dir / 'results.json'}  summary: {out_dir / 'summary.json'}")
    return summary


def expand_shortcuts(overrides: list[str]) -> list[str]:
    """``env=``, ``reactive=``, ``data_root=``, ``cache_dir=`` -> the benchmark keys they stand for."""
    out = []
    for a in overrides:
        key, eq, value = a.partition("=")
        out.append(f"{SHORTCUTS[key]}={value}" if eq and key in SHORTCUTS else a)
    return out


class EvalCommand(Command):
    """``carl-eval`` for :func:`carl.cli.run_command`: results go to ``out_dir``, else ``hydra.run.dir`` if given,
    else ``runs/eval/<benchmark>-<policy>`` (a sweep: ``hydra.sweep.dir/<job>``)."""

    name = "eval"
    folder_key = "out_dir"
    groups = ("benchmark",)
    schemas = {"eval_schema": EvalConfig}  # noqa: RUF012
    result_source = "summary.json"
    locks_folder = True

    @property
    def errors(self) -> dict[type[BaseException], tuple[str, int, str]]:  # type: ignore[override]
        from envs.maps.lanegraph import MapError
        from envs.maps.routes import RouteError

        error = ("carl-eval error", 2, "")
        return {ConfigError: error, EvalError: error, CheckpointError: error, BundleError: error, RouteError: error,
                MapError: error, KeyboardInterrupt: ("\ninterrupted", 130,
                                                     "finished routes are in results.json; re-run the same command "
                                                     "to resume")}

    def rewrite(self, overrides: list[str]) -> list[str]:
        return expand_shortcuts(overrides)

    def run(self, cfg: dict[str, Any]) -> dict[str, Any]:
        return run(cfg)

    def default_folder(self, cfg: dict[str, Any]) -> str:
        return str(default_out_dir(str(cfg["benchmark"].get("name", "benchmark")), policy_name(str(cfg["policy"]))))

    def check(self, cfg: dict[str, Any]) -> list[str]:
        policy, problem = str(cfg["policy"]), precision_problem(cfg.get("precision"))
        problems = [problem] if problem else []
        if policy in RULE_BASED or policy.startswith(zoo.PREFIX) or Path(policy).exists():
            return problems  # a zoo name is checked when it resolves (the message lists the shipped ones)
        return [*problems, f"policy={policy}: no such file or folder; use expert, expert_seen, random, a checkpoint "
                f".pt, a bundle dir or zoo:<name> ({', '.join(zoo.names())})"]

    def holds_run(self, folder: Path) -> bool:
        return (folder / "results.json").exists()

    def result(self, folder: Path) -> dict[str, Any] | None:
        summary = folder / "summary.json"
        return json.loads(summary.read_text()) if summary.is_file() else None


def main(argv: list[str] | None = None) -> None:
    """The ``carl-eval`` command: exit code 0, 2 for bad input (the message names the key or file), 130 on Ctrl-C."""
    run_command(EvalCommand(), argv)

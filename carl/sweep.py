"""Sweeps (``-m``/``--multirun``): the jobs a sweep will run, the summary written when it ends, and torchrun
inside a cluster job.

* :func:`expand` lists the jobs of a sweep the way Hydra's basic sweeper does (the product of the swept values),
  so that every job's config and run folder are checked before anything runs (:mod:`carl.cli`).
* :func:`write_summary` reads each run folder of a finished sweep (``<hydra.sweep.dir>/<job>``): one table of the
  final held-out evaluations (DS / RC / IS), plus the mean and spread over seeds of the runs that differ only by
  ``seed``; printed and written as ``sweep_summary.md`` and ``sweep_summary.json`` in the sweep folder.
* :func:`torchrun_args`: a SLURM job of ``nodes`` x ``gpus_per_node`` (``hydra/launcher=slurm_node`` and
  friends) trains through torchrun, one rank per GPU, nodes joined by torchrun's c10d rendezvous.
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from envs.config import ConfigError

SUMMARY = "sweep_summary"  # <sweep dir>/sweep_summary.md and .json
ERROR_FILE = "error.txt"  # a failed job's one-line error, in its run folder
METRICS = (("driving_score", "DS", 2), ("route_completion", "RC", 2), ("infraction_score", "IS", 3),
           ("best_driving_score", "best.pt DS", 2))
OPTIONAL_METRICS = ("best_driving_score",)  # a column only where some run has it (carl-train's final_best.json)
RDZV_PORT = 29400  # torchrun's rendezvous port on the first node of a multi-node job (env CARL_RDZV_PORT)


# ----------------------------------------------------------------------------------------------------------------
# The jobs of a sweep
# ----------------------------------------------------------------------------------------------------------------
def expand(overrides: list[str], params: Mapping[str, str] | None = None, exact: bool = True) -> list[list[str]]:
    """The override lists of the jobs a sweep runs: ``hydra.sweeper.params`` then ``overrides``, swept values
    multiplied out in the basic sweeper's order. ``exact=False`` (a sampling sweeper such as Optuna): an
    ``interval(a, b)`` stands for its two ends, the configs worth checking; with the basic sweeper it is an error."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import IntervalSweep
    from hydra.errors import HydraException, OverrideParseException

    texts = [f"{k}={v}" for k, v in (params or {}).items()] + list(overrides)
    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides(texts)
    except OverrideParseException as exc:
        raise ConfigError(f"{str(exc).splitlines()[0]} (overrides: {' '.join(texts)})") from None
    ends = []
    for text, ov in zip(texts, parsed):
        if ov.is_sweep_override() and not ov.is_discrete_sweep():
            sweep = ov.value()
            if exact or not isinstance(sweep, IntervalSweep):
                raise ConfigError(f"{text}: the basic sweeper runs lists and ranges (key=a,b or key=range(1,5)); an "
                                  "interval is sampled by a sweeper such as hydra/sweeper=optuna_lr")
            text = f"{ov.get_key_element()}={sweep.start},{sweep.end}"
        ends.append(text)
    try:
        return BasicSweeper.split_arguments(parser.parse_overrides(ends), None)[0]
    except HydraException as exc:
        raise ConfigError(str(exc)) from None


def sweep_values(overrides: list[str]) -> list[str]:
    """The overrides that sweep (``seed=1,2``), as typed."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return [t for t, o in zip(overrides, OverridesParser.create().parse_overrides(overrides)) if o.is_sweep_override()]


def first_values(overrides: list[str]) -> list[str]:
    """Each sweep replaced by its first value (an interval by its start): one job's overrides."""
    return expand(overrides, exact=False)[0]


def shared_folders(folders: list[Path]) -> dict[Path, list[int]]:
    """Folders that more than one job would use -> those jobs' numbers."""
    seen: dict[Path, list[int]] = {}
    for num, folder in enumerate(folders):
        seen.setdefault(folder.resolve(), []).append(num)
    return {f: nums for f, nums in seen.items() if len(nums) > 1}


# ----------------------------------------------------------------------------------------------------------------
# The summary of a finished sweep
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One job of a sweep, as its run folder shows it."""

    num: int
    folder: Path
    overrides: list[str]
    metrics: dict[str, Any] | None  # the final held-out evaluation (None: the run did not finish)
    status: str = "ok"
    varying: list[str] = field(default_factory=list)  # the overrides that differ between the sweep's runs


def _job(folder: Path) -> tuple[int, list[str]]:
    import yaml

    hydra = yaml.safe_load((folder / ".hydra" / "hydra.yaml").read_text()).get("hydra", {})
    overrides = yaml.safe_load((folder / ".hydra" / "overrides.yaml").read_text()) or []
    num = hydra.get("job", {}).get("num")
    return (int(num) if isinstance(num, int) else -1), [str(o) for o in overrides]


def collect(sweep_dir: Path, read: Callable[[Path], dict[str, Any] | None]) -> list[Run]:
    """Every job folder under ``sweep_dir`` (it holds Hydra's ``.hydra/hydra.yaml``), in job order, with ``read``'s
    metrics (``None`` where the run has none) and a status."""
    runs = []
    for marker in sweep_dir.glob("**/.hydra/hydra.yaml"):
        folder = marker.parent.parent
        if ".submitit" in folder.parts:
            continue
        num, overrides = _job(folder)
        metrics = read(folder)
        status = "ok"
        if metrics is None:
            error = folder / ERROR_FILE
            status = f"failed: {error.read_text().strip().splitlines()[0]}" if error.is_file() else "no result"
        runs.append(Run(num, folder, overrides, metrics, status))
    runs.sort(key=lambda r: (r.num, str(r.folder)))
    common = set.intersection(*(set(r.overrides) for r in runs)) if runs else set()
    for r in runs:
        r.varying = [o for o in r.overrides if o not in common]
    return runs


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def _stats(values: list[float]) -> dict[str, float]:
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values), "n": n}


def seed_groups(runs: list[Run]) -> list[dict[str, Any]]:
    """Runs that differ only by ``seed`` (two or more, all finished): mean, sample standard deviation, min and max
    of each metric."""
    groups: dict[tuple[str, ...], list[Run]] = {}
    for r in runs:
        if any(_key(o) == "seed" for o in r.varying):
            groups.setdefault(tuple(sorted(o for o in r.varying if _key(o) != "seed")), []).append(r)
    out = []
    for rest, members in groups.items():
        done = [r for r in members if r.metrics is not None]
        if len(done) < 2:
            continue
        seeds = [next(o.split("=", 1)[1] for o in r.varying if _key(o) == "seed") for r in done]
        stats = {name: _stats([float(r.metrics[name]) for r in done]) for name, _, _ in METRICS
                 if all(isinstance(r.metrics.get(name), (int, float)) for r in done)}
        out.append({"overrides": list(rest), "seeds": seeds, "runs": [r.num for r in done],
                    "failed": [r.num for r in members if r.metrics is None], **stats})
    return out


def summarize(sweep_dir: Path, read: Callable[[Path], dict[str, Any] | None], source: str) -> dict[str, Any]:
    """The summary as data (``sweep_summary.json``)."""
    runs = collect(sweep_dir, read)
    common = sorted(set.intersection(*(set(r.overrides) for r in runs))) if runs else []
    optuna = sweep_dir / "optimization_results.yaml"
    return {
        "sweep_dir": str(sweep_dir), "source": source, "common_overrides": common,
        "runs": [{"job": r.num, "folder": str(r.folder), "overrides": r.overrides, "varying": r.varying,
                  "status": r.status, **{name: (r.metrics or {}).get(name) for name, _, _ in METRICS},
                  "episodes": (r.metrics or {}).get("episodes", (r.metrics or {}).get("routes"))} for r in runs],
        "seed_groups": seed_groups(runs),
        "optuna": str(optuna) if optuna.is_file() else None,
    }


def _num(value: Any, digits: int) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) and math.isfinite(value) else "-"


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as Markdown (``sweep_summary.md``, also printed)."""
    runs = summary["runs"]
    metrics = [m for m in METRICS if m[0] not in OPTIONAL_METRICS or any(r.get(m[0]) is not None for r in runs)]
    lines = [f"# Sweep {summary['sweep_dir']}", "",
             f"{len(runs)} runs; final held-out evaluation of each ({summary['source']}). "
             f"Common overrides: {' '.join(summary['common_overrides']) or 'none'}.", "",
             "| job | overrides | " + " | ".join(short for _, short, _ in metrics) + " | episodes | status | folder |",
             "|---|---|" + "---|" * len(metrics) + "---|---|---|"]
    for r in runs:
        folder = Path(r["folder"])
        rel = folder.relative_to(summary["sweep_dir"]) if folder.is_relative_to(summary["sweep_dir"]) else folder
        lines.append(f"| {r['job']} | {' '.join(r['varying']) or '-'} | "
                     + " | ".join(_num(r[name], d) for name, _, d in metrics)
                     + f" | {r['episodes'] if r['episodes'] is not None else '-'} | {r['status']} | {rel} |")
    groups = summary["seed_groups"]
    if groups:
        lines += ["", "Mean ± sample standard deviation [min, max] over seeds (runs that differ only by seed):", "",
                  "| overrides | seeds | " + " | ".join(short for _, short, _ in metrics) + " |",
                  "|---|---|" + "---|" * len(metrics)]
        for g in groups:
            cells = []
            for name, _, d in metrics:
                st = g.get(name)
                cells.append(f"{st['mean']:.{d}f} ± {st['std']:.{d}f} [{st['min']:.{d}f}, {st['max']:.{d}f}]"
                             if st else "-")
            failed = f" ({len(g['failed'])} failed)" if g["failed"] else ""
            lines.append(f"| {' '.join(g['overrides']) or '-'} | {', '.join(g['seeds'])}{failed} | "
                         + " | ".join(cells) + " |")
    if summary["optuna"]:
        lines += ["", f"Optuna's best parameters: {summary['optuna']}"]
    return "\n".join(lines) + "\n"


def write_summary(sweep_dir: Path, read: Callable[[Path], dict[str, Any] | None],
                  source: str) -> tuple[str, dict[str, Any]]:
    """Write ``sweep_summary.md`` / ``.json`` into ``sweep_dir``; returns the Markdown and the data."""
    summary = summarize(sweep_dir, read, source)
    text = format_summary(summary)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / f"{SUMMARY}.json").write_text(json.dumps(summary, indent=2) + "\n")
    (sweep_dir / f"{SUMMARY}.md").write_text(text)
    return text, summary


# ----------------------------------------------------------------------------------------------------------------
# torchrun inside a cluster job
# ----------------------------------------------------------------------------------------------------------------
def check_launcher(launcher: Mapping[str, Any]) -> list[str]:
    """A submitit launcher's layout that carl cannot use, named with the fix: carl starts one torchrun per node."""
    tasks, gpus = int(launcher.get("tasks_per_node") or 1), int(launcher.get("gpus_per_node") or 0)
    if tasks != 1 and "submitit" in str(launcher.get("_target_", "")):
        return [f"hydra.launcher.tasks_per_node={tasks}: carl starts one torchrun per node, which runs one rank per "
                f"GPU; set hydra.launcher.tasks_per_node=1 and hydra.launcher.gpus_per_node={max(gpus, tasks)}"]
    return []


def torchrun_args(launcher: Mapping[str, Any], environ: Mapping[str, str] = os.environ,
                  hosts: list[str] | None = None) -> list[str] | None:
    """The torchrun command (``python -m torch.distributed.run``, the same interpreter) that a job of the submitit
    ``launcher`` runs on each node: ``--nproc_per_node`` = ``gpus_per_node``; one node: ``--standalone``; several:
    c10d rendezvous on the job's first host (port ``$CARL_RDZV_PORT``, default 29400, id = the SLURM job id).
    None where the job is one process (one node with at most one GPU), or already a torchrun rank."""
    if "submitit" not in str(launcher.get("_target_", "")) or "WORLD_SIZE" in environ:
        return None
    nodes, gpus = int(launcher.get("nodes") or 1), int(launcher.get("gpus_per_node") or 0)
    if nodes <= 1 and gpus <= 1:
        return None
    args = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc_per_node={max(gpus, 1)}"]
    if nodes == 1:
        return [*args, "--standalone"]
    if hosts is None:
        import submitit

        hosts = list(submitit.JobEnvironment().hostnames)
    port = environ.get("CARL_RDZV_PORT", str(RDZV_PORT))
    return [*args, "--rdzv_backend=c10d", f"--rdzv_endpoint={hosts[0]}:{port}",
            f"--rdzv_id={environ.get('SLURM_JOB_ID', 'carl')}"]

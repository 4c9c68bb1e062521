"""Sweeps through Hydra's command line (`-m`): jobs checked before anything runs, one folder per run, the sweep
summary; submitit's local executor, torchrun inside a job, Optuna's objective; the bad inputs named."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from carl import sweep
from carl.config import ConfigError
from carl.train import TrainCommand
from tests.test_train_cli import REPO, TINY


def cli(*args: str, module: str = "carl.train", timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def final(folder: Path) -> dict:
    return json.loads((folder / "eval" / "final.json").read_text())


# -- the jobs of a sweep ------------------------------------------------------------------------------------------
def test_expand_lists_the_jobs_like_the_basic_sweeper() -> None:
    jobs = sweep.expand(["+experiment=quick", "seed=1,2", "ppo.learning_rate=1e-4,3e-4"])
    assert jobs == [["+experiment=quick", "seed=1", "ppo.learning_rate=0.0001"],
                    ["+experiment=quick", "seed=1", "ppo.learning_rate=0.0003"],
                    ["+experiment=quick", "seed=2", "ppo.learning_rate=0.0001"],
                    ["+experiment=quick", "seed=2", "ppo.learning_rate=0.0003"]]
    assert sweep.expand(["seed=range(1,4)"], {"ppo.ent_coef": "0,0.01"}) == [
        [f"ppo.ent_coef={e}", f"seed={s}"] for e in ("0", "0.01") for s in (1, 2, 3)]
    # a sampling sweeper's interval is checked at both ends; the basic sweeper refuses it with the fix
    assert sweep.expand([], {"ppo.learning_rate": "tag(log, interval(1e-5, 1e-3))"}, exact=False) == [
        ["ppo.learning_rate=1e-05"], ["ppo.learning_rate=0.001"]]
    with pytest.raises(ConfigError, match=r"interval is sampled by a sweeper such as hydra/sweeper=optuna_lr"):
        sweep.expand(["ppo.learning_rate=interval(1e-5,1e-3)"])


def test_torchrun_inside_a_cluster_job() -> None:
    slurm = {"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
             "nodes": 1, "gpus_per_node": 8, "tasks_per_node": 1}
    one = sweep.torchrun_args(slurm, environ={})
    assert one is not None and one[1:] == ["-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=8",
                                           "--standalone"]
    two = sweep.torchrun_args({**slurm, "nodes": 2}, environ={"SLURM_JOB_ID": "77", "CARL_RDZV_PORT": "29555"},
                              hosts=["gpu-a", "gpu-b"])
    assert two is not None and two[3:] == ["--nnodes=2", "--nproc_per_node=8", "--rdzv_backend=c10d",
                                           "--rdzv_endpoint=gpu-a:29555", "--rdzv_id=77"]
    assert sweep.torchrun_args({**slurm, "gpus_per_node": 1}, environ={}) is None  # one process: no torchrun
    assert sweep.torchrun_args(slurm, environ={"WORLD_SIZE": "8"}) is None  # already a rank
    assert sweep.torchrun_args({"_target_": "basic", "gpus_per_node": 8}, environ={}) is None
    assert "tasks_per_node=1" in sweep.check_launcher({**slurm, "tasks_per_node": 8})[0]


# -- the summary --------------------------------------------------------------------------------------------------
def _fake_run(sweep_dir: Path, num: int, overrides: list[str], ds: float | None) -> None:
    folder = sweep_dir / str(num)
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"job": {"num": num}}}))
    (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if ds is None:
        (folder / sweep.ERROR_FILE).write_text("config error: env.options.x=1 rejected\n")
        return
    (folder / "eval").mkdir()
    (folder / "eval" / "final.json").write_text(json.dumps(
        {"driving_score": ds, "route_completion": ds + 10, "infraction_score": ds / 100, "episodes": 32}))


def test_summary_table_and_mean_over_seeds(tmp_path: Path) -> None:
    runs = [("1e-4", 1, 40.0), ("1e-4", 2, 50.0), ("1e-4", 3, 60.0), ("3e-4", 1, 20.0), ("3e-4", 2, None)]
    for num, (lr, seed, ds) in enumerate(runs):
        _fake_run(tmp_path, num, ["+experiment=quick", f"ppo.learning_rate={lr}", f"seed={seed}"], ds)
    text, data = sweep.write_summary(tmp_path, lambda f: final(f) if (f / "eval" / "final.json").is_file() else None,
                                     "eval/final.json")
    assert json.loads((tmp_path / "sweep_summary.json").read_text()) == data
    assert (tmp_path / "sweep_summary.md").read_text() == text
    assert data["common_overrides"] == ["+experiment=quick"]
    assert [r["job"] for r in data["runs"]] == [0, 1, 2, 3, 4]
    assert data["runs"][4]["status"] == "failed: config error: env.options.x=1 rejected"
    assert "| 0 | ppo.learning_rate=1e-4 seed=1 | 40.00 | 50.00 | 0.400 | 32 | ok | 0 |" in text
    (lr1,) = [g for g in data["seed_groups"] if g["overrides"] == ["ppo.learning_rate=1e-4"]]
    assert lr1["seeds"] == ["1", "2", "3"] and lr1["driving_score"]["mean"] == pytest.approx(50.0)
    assert lr1["driving_score"]["std"] == pytest.approx(10.0)  # sample standard deviation
    assert (lr1["route_completion"]["min"], lr1["route_completion"]["max"]) == (50.0, 70.0)
    assert "| ppo.learning_rate=1e-4 | 1, 2, 3 | 50.00 ± 10.00 [40.00, 60.00] |" in text
    assert not any(g["overrides"] == ["ppo.learning_rate=3e-4"] for g in data["seed_groups"])  # one finished seed
    assert "best.pt DS" not in text  # no run reports best.pt's final score: no column


def test_summary_has_best_pt_s_score_where_the_runs_report_it(tmp_path: Path) -> None:
    for num, (seed, ds, best) in enumerate([(1, 40.0, 44.0), (2, 50.0, 41.0)]):
        _fake_run(tmp_path, num, ["+experiment=quick", f"seed={seed}"], ds)
        (tmp_path / str(num) / "eval" / "final_best.json").write_text(json.dumps({"driving_score": best}))
    text, data = sweep.write_summary(tmp_path, TrainCommand().result, "eval/final.json")
    # best.pt is the periodic best where it scored higher (44 > 40), else the final policy (50 > 41)
    assert [r["best_driving_score"] for r in data["runs"]] == [44.0, 50.0]
    assert "| job | overrides | DS | RC | IS | best.pt DS | episodes | status | folder |" in text
    assert "| 0 | seed=1 | 40.00 | 50.00 | 0.400 | 44.00 | 32 | ok | 0 |" in text
    (group,) = data["seed_groups"]
    assert group["best_driving_score"]["mean"] == pytest.approx(47.0)
    assert "| - | 1, 2 | 45.00 ± 7.07 [40.00, 50.00] | 55.00 ± 7.07 [50.00, 60.00] | 0.450 ± 0.071 [0.400, 0.500] | " \
           "47.00 ± 4.24 [44.00, 50.00] |" in text


# -- bad input: named with the fix, before anything runs ----------------------------------------------------------
def test_a_sweep_whose_runs_would_share_a_folder_is_refused(tmp_path: Path) -> None:
    shared = cli("-m", *TINY, "seed=1,2", f"run_dir={tmp_path / 'x'}")
    assert shared.returncode == 2, shared.stderr
    assert f"run_dir={tmp_path / 'x'} would be the run folder of all 2 runs" in shared.stderr
    assert "drop run_dir=" in shared.stderr and "Traceback" not in shared.stderr
    subdir = cli("-m", *TINY, "seed=1,2", "hydra.sweep.subdir=same", f"hydra.sweep.dir={tmp_path / 's'}")
    assert subdir.returncode == 2 and "hydra.sweep.subdir=same gives jobs 0, 1 the same run folder" in subdir.stderr
    assert "hydra.sweep.subdir='${hydra.job.num}'" in subdir.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "s").exists()


def test_unknown_launcher_sweeper_and_bad_sweep_values_are_named() -> None:
    out = cli("-m", *TINY, "hydra/launcher=slurm_nod", "hydra/sweeper=bayes", "seed=1,x", "ppo.minibatch_size=7")
    assert out.returncode == 2, out.stderr
    for line in ("hydra/launcher=slurm_nod is unknown; did you mean hydra/launcher=slurm_node?",
                 "hydra/sweeper=bayes is unknown", "choose one of basic, optuna, optuna_lr",
                 "seed='x' must be an integer", "ppo.minibatch_size=7 must divide the batch"):
        assert line in out.stderr, out.stderr
    single = cli(*TINY, "seed=1,2")  # a sweep value without -m
    assert single.returncode == 2 and "seed=1,2: a sweep runs with -m (--multirun)" in single.stderr


# -- sweeps that run ----------------------------------------------------------------------------------------------
def test_sweep_runs_into_one_folder_and_summarises(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    out = cli("-m", *TINY, "seed=1,2", f"hydra.sweep.dir={sweep_dir}")
    assert out.returncode == 0, out.stderr
    for num, seed in ((0, 1), (1, 2)):
        run = sweep_dir / str(num)
        assert yaml.safe_load((run / "config.yaml").read_text())["seed"] == seed
        assert (run / "last.pt").is_file() and final(run)["episodes"] == 2
    data = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert [r["varying"] for r in data["runs"]] == [["seed=1"], ["seed=2"]]
    assert [r["driving_score"] for r in data["runs"]] == [final(sweep_dir / "0")["driving_score"],
                                                         final(sweep_dir / "1")["driving_score"]]
    assert data["seed_groups"][0]["seeds"] == ["1", "2"]
    assert "Mean ± sample standard deviation" in out.stdout and "sweep summary:" in out.stdout
    # the same sweep folder again: refused, nothing overwritten
    before = (sweep_dir / "sweep_summary.json").stat().st_mtime_ns, (sweep_dir / "0" / "last.pt").stat().st_mtime_ns
    again = cli("-m", *TINY, "seed=1,2", f"hydra.sweep.dir={sweep_dir}")
    assert again.returncode == 2 and f"hydra.sweep.dir={sweep_dir} already holds a sweep" in again.stderr
    assert ((sweep_dir / "sweep_summary.json").stat().st_mtime_ns,
            (sweep_dir / "0" / "last.pt").stat().st_mtime_ns) == before


def test_submitit_local_launcher_runs_two_jobs(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep_dir = tmp_path / "sweep"
    out = cli("-m", "hydra/launcher=submitit_local", *TINY, "seed=1,2", f"hydra.sweep.dir={sweep_dir}")
    assert out.returncode == 0, out.stderr
    assert "Submitit 'local' sweep output dir" in out.stdout
    assert {r["status"] for r in json.loads((sweep_dir / "sweep_summary.json").read_text())["runs"]} == {"ok"}
    logs = sorted(sweep_dir.glob(".submitit/*/*_0_log.out"))  # each job's own output
    assert len(logs) == 2 and all("final evaluation on 2 held-out routes" in p.read_text() for p in logs)


def test_torchrun_two_ranks_inside_a_submitit_job(tmp_path: Path) -> None:
    """gpus_per_node=2 in the launcher: the job runs torchrun with 2 ranks (gloo on CPU here)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep_dir = tmp_path / "sweep"
    args = [a for a in TINY if not a.startswith("ppo.total_timesteps")]
    out = cli("-m", "hydra/launcher=submitit_local", "hydra.launcher.gpus_per_node=2", "parallel=ddp",
              "parallel.device=cpu", *args, "ppo.total_timesteps=64", f"hydra.sweep.dir={sweep_dir}")
    assert out.returncode == 0, out.stderr
    (log,) = sweep_dir.glob(".submitit/*/*_0_log.out")
    text = log.read_text()
    assert "torch.distributed.run --nnodes=1 --nproc_per_node=2 --standalone -m carl.train" in text
    assert "2 ranks (gloo" in text and final(sweep_dir / "0")["episodes"] == 2


def test_optuna_maximises_the_final_held_out_driving_score(tmp_path: Path) -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep_dir = tmp_path / "sweep"
    out = cli("-m", "hydra/sweeper=optuna_lr", "hydra.sweeper.n_trials=2", *TINY, f"hydra.sweep.dir={sweep_dir}")
    assert out.returncode == 0, out.stderr
    best = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert set(best["best_params"]) == {"ppo.learning_rate", "ppo.ent_coef"}
    scores = [final(sweep_dir / str(n))["driving_score"] for n in (0, 1)]
    assert math.isclose(best["best_value"], max(scores))
    for n in (0, 1):  # each trial's sampled values are in its run's config, inside the preset's bounds
        ppo = yaml.safe_load((sweep_dir / str(n) / "config.yaml").read_text())["ppo"]
        assert 3e-5 <= ppo["learning_rate"] <= 1e-3 and 0.0 <= ppo["ent_coef"] <= 0.03

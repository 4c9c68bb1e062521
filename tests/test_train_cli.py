"""End to end through the CLI (`python -m carl.train`) on the fake env: run, resume, refusal, SIGINT."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
TINY = [
    "env=custom",  # free options: ++ adds them
    "env.name=tests.fake_env:make_fake_env",
    "env.num_envs=2",
    "++env.options.bev_size=24",
    "++env.options.bev_channels=3",
    "++env.options.episode_length=8",
    "ppo.num_steps=8",
    "ppo.minibatch_size=8",
    "ppo.update_epochs=1",
    "ppo.total_timesteps=32",  # 2 updates of 16 samples
    "logging.eval_episodes=2",
    "logging.eval_max_steps=50",
    "parallel.torch_threads=1",
]


def run(args: list[str], timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "carl.train", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_train_resume_and_refuse(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = run([*TINY, f"run_dir={run_dir}"])
    assert first.returncode == 0, first.stderr
    assert "update 2/2" in first.stdout and f"run folder: {run_dir}" in first.stdout
    for name in ("config.yaml", "last.pt", "eval/final.json", "eval/baselines.json"):
        assert (run_dir / name).is_file(), name
    final = json.loads((run_dir / "eval/final.json").read_text())
    assert final["episodes"] == 2 and {"driving_score", "route_completion", "infraction_score"} <= set(final)
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "tb").iterdir())

    made = torch.load(run_dir / "last.pt", weights_only=True)["extra"]["provenance"]  # for a zoo card
    from carl.config import cpu_line

    assert made["cpu"] == cpu_line() and made["commit"] and made["seconds"] > 0 and "env.num_envs=2" in made["command"]

    # the same run dir without resume is refused with exit code 2
    again = run([*TINY, f"run_dir={run_dir}"])
    assert again.returncode == 2 and "already holds a run" in again.stderr and "resume=" in again.stderr

    # a resume whose options build another observation is refused by last.pt, naming the fix, and the run's
    # config.yaml stays as it was: a later plain resume still reads the options the run was saved with
    saved = (run_dir / "config.yaml").read_bytes()
    other = run([f"resume={run_dir}", "env.options.bev_size=32"])
    assert other.returncode == 2 and "belongs to another model" in other.stderr and "run_dir=" in other.stderr
    assert (run_dir / "config.yaml").read_bytes() == saved

    # resume continues the update counter up to the new total (a custom factory's free option may be given again:
    # the resume is composed with the run's own env group)
    resumed = run([f"resume={run_dir}", "ppo.total_timesteps=64", "++env.options.episode_length=8"])
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "at update 2" in resumed.stdout
    assert "update 3/4" in resumed.stdout and "update 4/4" in resumed.stdout
    again_made = torch.load(run_dir / "last.pt", weights_only=True)
    assert again_made["update"] == 4
    made2 = again_made["extra"]["provenance"]  # the wall time of both runs, and the first run's command
    assert made2["seconds_before"] == made["seconds"] and made2["seconds"] > made["seconds"]
    assert made2["runs_before"] == [{k: made[k] for k in ("command", "commit", "cpu")}]


def test_a_spent_time_budget_ends_the_run_and_a_resume_can_lift_it(tmp_path: Path) -> None:
    """``ppo.train_for_seconds``: a budget shorter than one update ends the run after update 1 of 3 (last.pt and the
    final evaluation as for a finished run); resumed under the same budget it goes straight to the end; resumed
    without one it trains on to update 3."""
    run_dir = tmp_path / "run"
    tiny = [*TINY, "ppo.total_timesteps=48", "ppo.train_for_seconds=0.001"]
    first = run([*tiny, f"run_dir={run_dir}"])
    assert first.returncode == 0, first.stderr
    assert "time budget spent" in first.stdout and "after update 1 of 3 (16 samples)" in first.stdout
    assert torch.load(run_dir / "last.pt", weights_only=True)["update"] == 1
    assert (run_dir / "eval/final.json").is_file()
    same = run([f"resume={run_dir}"])
    assert same.returncode == 0, same.stderr
    assert "update 2/3" not in same.stdout and torch.load(run_dir / "last.pt", weights_only=True)["update"] == 1
    lifted = run([f"resume={run_dir}", "ppo.train_for_seconds=0"])
    assert lifted.returncode == 0, lifted.stderr
    assert "update 3/3" in lifted.stdout and torch.load(run_dir / "last.pt", weights_only=True)["update"] == 3


def test_a_compiled_network_trains_on_cpu_and_saves_the_plain_module_s_weights(tmp_path: Path) -> None:
    """``parallel.compile=true`` on CPU: the run trains through the compiled forward (its torch cache in
    ``tmp_path``), and last.pt holds the same parameter names as an uncompiled run's, so evaluation, export and
    init_from read it."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    plain = run([*TINY, "logging.eval_episodes=0", f"run_dir={tmp_path / 'plain'}"])
    done = run([*TINY, "logging.eval_episodes=0", "parallel.compile=true", f"run_dir={tmp_path / 'compiled'}"],
               timeout=600, env=env)
    assert plain.returncode == 0 and done.returncode == 0, done.stderr[-3000:]
    assert "update 2/2" in done.stdout
    assert any(p.is_file() for p in (tmp_path / "inductor").rglob("*")), "nothing was compiled"
    weights = [torch.load(tmp_path / d / "last.pt", weights_only=True)["model"] for d in ("plain", "compiled")]
    assert list(weights[1]) == list(weights[0])


def test_the_final_evaluation_scores_last_and_best_on_its_own_routes(tmp_path: Path) -> None:
    """3 updates, held-out evaluations after updates 1 and 2 (2 routes each; best.pt from them), then the final one on
    ``final_eval_episodes`` = 3 routes for the final policy and for best.pt's weights, the baselines beside them;
    best.pt ends as whichever of the two scores higher there (ties: the final policy)."""
    run_dir = tmp_path / "run"
    done = run([*TINY, "ppo.total_timesteps=48", "logging.eval_every=1", "logging.final_eval_episodes=3",
                f"run_dir={run_dir}"])
    assert done.returncode == 0, done.stderr
    periodic = [json.loads((run_dir / f"eval/update_{u:06d}.json").read_text()) for u in (1, 2)]
    assert [p["episodes"] for p in periodic] == [2, 2]
    last = json.loads((run_dir / "eval/final.json").read_text())
    best = json.loads((run_dir / "eval/final_best.json").read_text())
    assert last["episodes"] == best["episodes"] == 3 and last["update"] == 3
    first_best = max(periodic, key=lambda p: p["driving_score"])  # the first of equal scores stays best
    assert best["update"] == first_best["update"]
    table = json.loads((run_dir / "eval/baselines.json").read_text())
    assert set(table) == {"last (3)", f"best ({best['update']})", "random"}
    assert table["random"]["episodes"] == 3
    kept = torch.load(run_dir / "best.pt", weights_only=True)["update"]
    assert kept == (3 if last["driving_score"] >= best["driving_score"] else best["update"])
    assert "final evaluation on 3 held-out routes" in done.stdout


def test_init_from_starts_a_new_run_from_another_run_s_weights(tmp_path: Path) -> None:
    first = run([*TINY, f"run_dir={tmp_path / 'a'}"])
    assert first.returncode == 0, first.stderr
    source = tmp_path / "a" / "last.pt"
    # another seed (another fresh init) and a learning rate too small to move the weights: they are the file's
    tuned = run([*TINY, "seed=5", "ppo.learning_rate=1e-12", "ppo.total_timesteps=16", f"init_from={source}",
                 f"run_dir={tmp_path / 'b'}"])
    assert tuned.returncode == 0, tuned.stderr
    assert f"initial weights from {source}" in tuned.stdout and "update 1/1" in tuned.stdout  # counters start at 0
    want = torch.load(source, weights_only=True)["model"]
    got = torch.load(tmp_path / "b" / "last.pt", weights_only=True)["model"]
    assert max((got[k].float() - v.float()).abs().max().item() for k, v in want.items()) < 1e-6
    # weights of another observation (3 BEV channels against 4): refused before a run folder exists, naming the input
    other = run([*TINY, "++env.options.bev_channels=4", f"init_from={source}", f"run_dir={tmp_path / 'c'}"])
    assert other.returncode == 2 and "init_from=" in other.stderr and "obs_shapes.bev" in other.stderr
    assert "Traceback" not in other.stderr and not (tmp_path / "c").exists()


def test_config_error_exit_code(tmp_path: Path) -> None:
    bad = run([*TINY, "ppo.minibatch_size=7", f"run_dir={tmp_path / 'x'}"])
    assert bad.returncode == 2
    assert "ppo.minibatch_size=7 must divide the batch" in bad.stderr and "Traceback" not in bad.stderr
    # an error once Hydra has made the run folder (the env factory cannot be found): no folder is left behind
    gone = run([*[a for a in TINY if not a.startswith("env.name=")], "env.name=tests.fake_env:nope",
                f"run_dir={tmp_path / 'y'}"])
    assert gone.returncode == 2 and "env.name='tests.fake_env:nope' cannot be created" in gone.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_run_folder_precedence_and_working_directory(tmp_path: Path) -> None:
    """run_dir if given, else hydra.run.dir (default runs/<experiment>-<timestamp>); relative to where the command
    started, which stays the working directory."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def run_in(cwd: Path, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "carl.train", *TINY, *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=120)

    by_hydra = run_in(tmp_path, "hydra.run.dir=out/h")
    assert by_hydra.returncode == 0, by_hydra.stderr
    assert (tmp_path / "out/h/config.yaml").is_file() and (tmp_path / "out/h/.hydra/overrides.yaml").is_file()
    both = run_in(tmp_path, "run_dir=out/r", "hydra.run.dir=out/h2")
    assert both.returncode == 0, both.stderr
    assert (tmp_path / "out/r/last.pt").is_file() and not (tmp_path / "out/h2").exists()
    default = run_in(tmp_path)
    assert default.returncode == 0, default.stderr
    (folder,) = (tmp_path / "runs").glob("default-*")
    assert (folder / "eval/final.json").is_file() and not (tmp_path / "outputs").exists()


def _signal_run(args: list[str], ready, sig: int, wait: float) -> tuple[int, str, str]:  # noqa: ANN001
    """Start ``carl.train`` with ``args``, send ``sig`` once ``ready()`` holds (60 s at most), return (code, out,
    err) of a run that must end within ``wait`` seconds of the signal."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "carl.train", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not ready() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=wait)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, err


def test_sigint_saves_and_exits_zero(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*TINY, "ppo.total_timesteps=100000", "logging.eval_episodes=0", f"run_dir={run_dir}"]
    code, out, err = _signal_run(args, (run_dir / "last.pt").exists, signal.SIGINT, 60)
    assert code == 0, err
    assert "SIGINT received" in err and "saved" in out and "resume=" in out
    assert torch.load(run_dir / "last.pt", weights_only=True)["update"] >= 1


def test_a_signal_during_the_final_evaluation_stops_it_at_once(tmp_path: Path) -> None:
    """After the last update the checkpoints are saved; SIGTERM during the final evaluation (episodes that would run
    10^6 steps) ends the run at once, exit 0, with last.pt of the last update intact."""
    run_dir = tmp_path / "run"
    args = [*TINY, "++env.options.episode_length=1000000", "logging.eval_max_steps=1000000", "logging.eval_every=0",
            f"run_dir={run_dir}"]

    def in_final_evaluation() -> bool:
        try:
            if torch.load(run_dir / "last.pt", weights_only=True)["update"] != 2:
                return False
        except (FileNotFoundError, RuntimeError, EOFError, KeyError):
            return False
        time.sleep(1.0)  # last.pt of the last update is written just before the final evaluation starts
        return True

    code, out, err = _signal_run(args, in_final_evaluation, signal.SIGTERM, 30)
    assert code == 0, err
    assert "SIGTERM: the final evaluation stopped" in out
    assert torch.load(run_dir / "last.pt", weights_only=True)["update"] == 2


def test_a_signal_during_a_periodic_evaluation_stops_it_and_saves(tmp_path: Path) -> None:
    """A periodic evaluation can take minutes: SIGINT during it (here: episodes that would run 10^6 steps) stops it,
    saves last.pt of the update just trained and exits 0 within seconds, as a stop between evaluations does."""
    run_dir, marker = tmp_path / "run", tmp_path / "evaluation_env_built"
    args = [*TINY, "++env.options.episode_length=1000000", "logging.eval_max_steps=1000000", "logging.eval_every=1",
            "ppo.total_timesteps=100000", f"++env.eval_options.built_marker={marker}", f"run_dir={run_dir}"]

    def evaluating() -> bool:  # the evaluation env of update 1 is built; its episodes never end on their own
        if not marker.exists():
            return False
        time.sleep(1.0)
        return True

    code, out, err = _signal_run(args, evaluating, signal.SIGINT, 30)
    assert code == 0, err
    assert "SIGINT received during the evaluation of update 1: it stopped; saving last.pt" in err
    assert "stopped by SIGINT" in out and "resume=" in out
    assert torch.load(run_dir / "last.pt", weights_only=True)["update"] == 1
    assert not (run_dir / "eval" / "update_000001.json").exists()


def test_a_stop_before_a_due_evaluation_skips_it() -> None:
    """A stop asked for while an update trains: the evaluation due after it is skipped, the checkpoints due (last.pt
    with ``last``) are written; without ``stop`` (several ranks, which agree on a stop per update) it runs, except
    after the last update (the final evaluation scores that one)."""
    from carl.stop import StopRequest
    from carl.train import evaluate_and_save

    class Evaluation:
        runs: list[int] = []

        def due(self, update: int) -> bool:
            return True

        def run(self, name: str, update: int, global_step: int) -> dict:
            self.runs.append(update)
            return {"driving_score": 1.0}

    class Checkpoints:
        saved: list[str] = []

        def due(self, update: int, last: bool) -> list[str]:
            return ["last.pt"] if last else []

        def gather(self) -> None:
            pass

        def save(self, name: str, update: int, global_step: int, best_ds: float) -> None:
            self.saved.append(name)

    ev, ck, stop = Evaluation(), Checkpoints(), StopRequest()
    stop.requested = True
    assert evaluate_and_save(ev, ck, {}, 3, 48, 0.0, last=True, stop=stop) == 0.0  # type: ignore[arg-type]
    assert ev.runs == [] and ck.saved == ["last.pt"]
    evaluate_and_save(ev, ck, {}, 4, 64, 0.0, last=False, stop=None)  # type: ignore[arg-type]
    evaluate_and_save(ev, ck, {}, 5, 80, 0.0, last=True, stop=None)  # type: ignore[arg-type]
    assert ev.runs == [4]


def test_runs_of_any_seed_are_evaluated_on_the_same_held_out_routes() -> None:
    """The held-out evaluation's env is built from ``logging.eval_seed``, whatever the training ``seed``."""
    from carl.cli import load_config
    from carl.eval.during_training import Evaluation

    built: list[int] = []
    for seed in (1, 2):
        cfg = load_config("train", [*TINY, f"seed={seed}", "logging.eval_seed=77"])
        Evaluation(cfg, True, Path("unused"), None, None, lambda _n, s: built.append(s)).make_env(2)  # type: ignore[arg-type]
    assert built == [77, 77]


def test_ddp_ranks_split_a_route_file_between_them() -> None:
    """With a route file (a fixed assignment), rank r of W with N envs starts at route r N and advances by N W:
    two ranks never drive the same route at once. Random routes need no split (each rank draws its own)."""
    from carl.factory import make_env
    from carl.train import rank_routes
    from envs.data import data_path

    opts = {"map": "Town01", "route_file": data_path("data:longest6-v2/longest6_v2.xml"), "route_scenarios": False,
            "bev": False, "traffic": False}
    assert rank_routes(opts, 2, 0, 1) == {} and rank_routes({"map": "Town01"}, 2, 1, 2) == {}
    assert rank_routes({**opts, "first_route": 1}, 2, 1, 2) == {"first_route": 3, "route_stride": 4}
    first, following = [], []
    for rank in (0, 1):
        env = make_env("sim", 2, torch.device("cpu"), 5 + rank, opts, {}, rank_routes(opts, 2, rank, 2))
        env.reset(seed=5 + rank)
        first.append(env.state.route_id.tolist())
        following.append(env.starts.next_route.tolist())  # what these rows drive after their first episode
        env.close()
    assert first == [[0, 1], [2, 3]]  # Town01 has 6 routes in longest6 v2
    assert following == [[4, 5], [0, 1]]  # + N W = 4, modulo the 6 routes

"""``torchrun --nproc_per_node=2 -m carl.train`` on the fake env (gloo, CPU): run, resume, bad layouts."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from carl.config import ConfigError, TrainConfig
from carl.parallel.launch import check_world

REPO = Path(__file__).resolve().parent.parent
TINY = [
    "env=custom", "env.name=tests.fake_env:make_fake_env", "env.num_envs=2", "++env.options.bev_size=24",
    "++env.options.bev_channels=3", "++env.options.episode_length=8", "ppo.num_steps=8", "ppo.minibatch_size=8",
    "ppo.update_epochs=1", "ppo.total_timesteps=64", "logging.eval_episodes=1", "logging.eval_max_steps=20",
    "logging.final_baselines=false", "parallel.torch_threads=1",
]


def torchrun(args: list[str], nproc: int = 2, timeout: float = 120) -> subprocess.CompletedProcess:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
           "-m", "carl.train", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_torchrun_train_resume_and_world_size_check(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = torchrun([*TINY, "parallel.sync=powersgd", "seed=3", f"run_dir={run_dir}"])
    assert first.returncode == 0, first.stdout + first.stderr
    assert "2 ranks (gloo, sync powersgd)" in first.stdout and "2 updates x 32 samples" in first.stdout
    assert first.stdout.count("update 2/2") == 1  # only rank 0 prints
    ck = torch.load(run_dir / "last.pt", weights_only=True)
    assert ck["extra"]["world_size"] == 2 and len(ck["extra"]["ranks"]) == 2 and ck["global_step"] == 64
    # rank r resets its envs with seed + 7919 r (docs/distributed.md): the ranks drive different routes and traffic
    assert [r["env"]["seed"] for r in ck["extra"]["ranks"]] == [3, 3 + 7919]
    errors = [r["sync"]["error"] for r in ck["extra"]["ranks"]]  # each rank's own error-feedback residuals
    assert errors[0] and errors[0].keys() == errors[1].keys() and ck["extra"]["sync"]["step"] == 8
    assert any(not torch.equal(errors[0][k], errors[1][k]) for k in errors[0])

    # a time budget the run does not reach: rank 0's clock is broadcast after every update, the ranks go on together
    resumed = torchrun([f"resume={run_dir}", "ppo.total_timesteps=128", "ppo.train_for_seconds=3600"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "at update 2" in resumed.stdout and "update 4/4" in resumed.stdout
    assert "time budget: 3,600.0 s" in resumed.stdout

    single = subprocess.run([sys.executable, "-m", "carl.train", f"resume={run_dir}", "ppo.total_timesteps=256"],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                            timeout=120)
    assert single.returncode == 2 and "world size 2" in single.stderr and "world size 1" in single.stderr


@pytest.mark.parametrize(("code", "rc", "err"), [(0, 0, ""), (3, 3, ""), (None, 0, ""), ("bad config", 1, "bad config")])
def test_a_rank_leaves_after_its_exit_handlers_with_its_code(tmp_path: Path, code: object, rc: int, err: str) -> None:
    """run_as_rank in a torchrun rank (WORLD_SIZE 2): a command's exit runs the atexit handlers and writes buffered
    output, then leaves with the code without the interpreter's finalisation (an object's ``__del__`` at shutdown
    never runs); a single process (WORLD_SIZE 1) exits as usual, finalisation included."""
    script = ("import atexit, pathlib, sys; from carl.parallel.context import run_as_rank\n"
              f"atexit.register(lambda: pathlib.Path({str(tmp_path / 'ran')!r}).write_text('yes'))\n"
              "class Finalised:\n    def __del__(self): print('finalised', end='')\n"
              f"keep = Finalised()\nprint('buffered', end='')\nrun_as_rank(lambda: sys.exit({code!r}))\n")
    for world, tail in (("2", ""), ("1", "finalised")):
        (tmp_path / "ran").unlink(missing_ok=True)
        out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(REPO), "WORLD_SIZE": world})
        assert (out.returncode, out.stdout, out.stderr.strip()) == (rc, "buffered" + tail, err), world
        assert (tmp_path / "ran").read_text() == "yes"


def test_global_minibatch_must_split_evenly() -> None:
    cfg = TrainConfig()
    cfg.ppo.minibatch_size = 10
    with pytest.raises(ConfigError, match=r"ppo.minibatch_size=10 \(the global minibatch\) must be divisible by the world size 4"):
        check_world(cfg, 4)
    cfg.ppo.minibatch_size, cfg.ppo.accumulation_steps = 8, 4
    with pytest.raises(ConfigError, match="accumulation_steps=4 must divide each rank's share"):
        check_world(cfg, 4)
    check_world(cfg, 2)


def _rank_pids(parent: int) -> dict[int, int]:
    """``{rank: pid}`` of torchrun's worker processes (children of ``parent`` with ``RANK`` in their environment)."""
    out: dict[int, int] = {}
    for child in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        try:
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                out[int(item[5:])] = int(child)
    return out


@pytest.mark.parametrize("how", ["hangs", "dies"])
def test_a_hung_or_killed_rank_stops_training_with_the_checkpoint_intact(tmp_path: Path, how: str) -> None:
    """Rank 1 is frozen (SIGSTOP) or killed (SIGKILL) once a checkpoint exists: the run ends within a bounded time,
    naming the failure, and last.pt still loads."""
    import signal
    import time

    run_dir = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}", "-m",
           "carl.train", *TINY, "ppo.total_timesteps=32000", "parallel.timeout_s=5", "logging.progress_bar=false",
           f"run_dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    victim = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (run_dir / "last.pt").exists() and proc.poll() is None:
            time.sleep(0.1)
        assert (run_dir / "last.pt").exists(), "no checkpoint was written"
        ranks = _rank_pids(proc.pid)
        victim = ranks[1]
        os.kill(victim, signal.SIGSTOP if how == "hangs" else signal.SIGKILL)
        start = time.monotonic()
        if how == "hangs":
            # once rank 0 has given up on its peer and ended, let the frozen rank take torchrun's SIGTERM, as a rank
            # stuck in a collective does (a stopped one would hold torchrun for its 30 s SIGTERM grace)
            while Path(f"/proc/{ranks[0]}").exists() and time.monotonic() - start < 60:
                time.sleep(0.1)
            os.kill(victim, signal.SIGCONT)
        out, _ = proc.communicate(timeout=90)
        waited = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if victim is not None:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode != 0, out[-3000:]
    if how == "hangs":  # rank 0 waits parallel.timeout_s, then names itself, the collective and the cause
        assert "distributed error: rank 0/2" in out and "a peer rank died or hung" in out, out[-3000:]
        assert "last.pt) is intact" in out
    else:  # torchrun sees the dead worker and stops the job, naming the rank
        assert "exitcode  : -9" in out and "rank      : 1" in out, out[-3000:]
    assert waited < 60, waited
    ck = torch.load(run_dir / "last.pt", weights_only=True)
    assert ck["update"] >= 1 and len(ck["extra"]["ranks"]) == 2

"""Checkpoints: atomic write, round trip (model, optimiser, RNG), corrupt file and model-mismatch errors, provenance."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from carl.checkpoint import CheckpointError, atomic_save, load_checkpoint, make_checkpoint, restore
from carl.policy import CarlPolicy
from envs.api import TensorSpec


def make_policy(size: int = 32) -> CarlPolicy:
    return CarlPolicy({
        "bev": TensorSpec((10, size, size), torch.uint8),
        "measurements": TensorSpec((8,), torch.float32),
        "value_measurements": TensorSpec((10,), torch.float32),
    })


def test_atomic_save_leaves_no_tmp_and_replaces(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    atomic_save({"a": 1}, path)
    atomic_save({"a": 2}, path)
    assert torch.load(path)["a"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_atomic_save_failure_keeps_previous(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    atomic_save({"a": 1}, path)

    class Unpicklable:
        def __reduce__(self):  # noqa: D105
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        atomic_save({"a": Unpicklable()}, path)
    assert torch.load(path)["a"] == 1  # the interrupted write never touched the target


def test_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(0)
    policy = make_policy()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    policy(  # one step so the optimiser has state
        {"bev": torch.zeros(1, 10, 32, 32, dtype=torch.uint8), "measurements": torch.zeros(1, 8),
         "value_measurements": torch.zeros(1, 10)}
    )[2].sum().backward()
    opt.step()
    random.seed(5)
    np.random.seed(5)
    ck = make_checkpoint(policy, opt, update=7, global_step=700, signature=policy.signature(),
                         config={"seed": 1}, env_state={"k": 3})
    atomic_save(ck, tmp_path / "c.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1))

    other = make_policy()
    opt2 = torch.optim.Adam(other.parameters(), lr=1e-3)
    loaded = load_checkpoint(tmp_path / "c.pt", other.signature())
    restore(loaded, other, opt2)
    assert loaded["update"] == 7 and loaded["global_step"] == 700 and loaded["env"] == {"k": 3}
    for a, b in zip(policy.parameters(), other.parameters()):
        assert torch.equal(a, b)
    assert opt2.state_dict()["state"][0]["step"] == 1
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected  # RNG streams continue identically


def test_corrupt_and_missing_files_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "last.pt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match=str(bad)):
        load_checkpoint(bad)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt")


def test_model_mismatch_is_refused(tmp_path: Path) -> None:
    small = make_policy(32)
    ck = make_checkpoint(small, torch.optim.Adam(small.parameters()), 1, 1, small.signature(), {})
    atomic_save(ck, tmp_path / "c.pt")
    big = make_policy(64)
    with pytest.raises(CheckpointError, match=r"belongs to another model: obs_shapes"):
        load_checkpoint(tmp_path / "c.pt", big.signature())


def test_a_run_from_a_git_archive_records_the_commit_it_was_made_from(tmp_path: Path) -> None:
    """A long run is often started from ``git archive`` (a snapshot that later commits leave alone): the checkpoint's
    provenance (a zoo card's commit) names the archived commit, and a plain copy of the file names none."""
    import subprocess

    from carl.spec import git_commit

    repo = Path(__file__).resolve().parent.parent
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD", "carl/.git_archival.txt"], cwd=repo,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive, check=True)
    assert git_commit(tmp_path) == head.stdout.strip()[:12]
    (tmp_path / "carl" / ".git_archival.txt").write_text("node: $Format:%H$\n")  # copied, not archived
    assert git_commit(tmp_path) == "unknown"

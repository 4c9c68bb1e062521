"""Loading a file never runs code from it (docs/security.md): a checkpoint or bundle crafted to run a command
(``__reduce__`` -> ``os.system``) is refused by every entry point with an error naming the file, and nothing runs,
is created or overwritten. Format-1 checkpoints (numpy RNG state) still load."""
from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from carl.bundle import BundleError, load_policy, sha256_file
from carl.export import export_bundle
from carl.checkpoint import CheckpointError, load_checkpoint, restore_rng
from carl.deploy.leaderboard_agent import read_agent_config
from test_export import tiny_checkpoint


class RunsACommand:
    """Pickles as a call of ``os.system``: unpickling it with plain ``pickle`` would run the command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: D105
        return (os.system, (f"touch {self.marker}",))


def crafted(path: Path, marker: Path, **extra: object) -> Path:
    """A torch.save file whose ``format_version`` runs ``touch marker`` when unpickled."""
    torch.save({"format_version": RunsACommand(marker), **extra}, path)
    return path


def test_the_crafted_file_would_run_its_command(tmp_path: Path) -> None:
    """The premise of the tests below: an unrestricted load of the crafted file runs the command."""
    evil = crafted(tmp_path / "evil.pt", tmp_path / "ran")
    torch.load(evil, weights_only=False)
    assert (tmp_path / "ran").exists()


def test_load_checkpoint_refuses_a_crafted_file(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    evil = crafted(tmp_path / "evil.pt", marker)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(evil)
    assert str(evil) in str(err.value) and "posix.system" in str(err.value)
    assert not marker.exists()


def _cli(main, argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    return int(exit_.value.code), capsys.readouterr().err


def test_carl_eval_refuses_a_crafted_policy(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from carl.eval.cli import main

    marker, out = tmp_path / "ran", tmp_path / "eval"
    evil = crafted(tmp_path / "evil.pt", marker)
    code, err = _cli(main, [f"policy={evil}", "benchmark=towns", "benchmark.num_routes=1", f"out_dir={out}"], capsys)
    assert code == 2 and str(evil) in err and "posix.system" in err
    assert not marker.exists() and not out.exists()


def test_carl_export_refuses_a_crafted_checkpoint_and_keeps_the_bundle(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    from carl.export import main

    marker, bundle = tmp_path / "ran", tmp_path / "bundle"
    export_bundle(tiny_checkpoint(tmp_path / "good.pt"), bundle, onnx=False)
    before = {p.name: p.read_bytes() for p in bundle.iterdir()}
    evil = crafted(tmp_path / "evil.pt", marker)
    code, err = _cli(main, [f"checkpoint={evil}", f"out_dir={bundle}", "overwrite=true"], capsys)
    assert code == 2 and str(evil) in err
    assert not marker.exists()
    assert {p.name: p.read_bytes() for p in bundle.iterdir()} == before  # overwrite=true lost nothing


def test_carl_train_resume_refuses_a_crafted_last_pt(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from omegaconf import OmegaConf

    from carl.config import load as load_train_config
    from carl.train import main
    from test_train_cli import TINY

    marker, run_dir = tmp_path / "ran", tmp_path / "run"
    run_dir.mkdir()
    cfg = load_train_config([*TINY, f"run_dir={run_dir}", "logging.tensorboard=false"])
    OmegaConf.save(OmegaConf.create(cfg.to_dict()), run_dir / "config.yaml")
    saved = crafted(run_dir / "last.pt", marker).read_bytes()
    before = sorted(p.name for p in run_dir.iterdir())
    code, err = _cli(main, [f"resume={run_dir}"], capsys)
    assert code == 2 and str(run_dir / "last.pt") in err and "posix.system" in err
    assert not marker.exists()
    assert (run_dir / "last.pt").read_bytes() == saved  # untouched
    assert sorted(p.name for p in run_dir.iterdir() if p.name != ".hydra") == before


def test_bundles_with_crafted_files_are_refused(tmp_path: Path) -> None:
    """A bundle whose weights or TorchScript file was swapped for the crafted pickle (spec.json's hashes updated to
    match, as an attacker would): the loaders refuse the file by format and run nothing; a hash mismatch is named."""
    marker = tmp_path / "ran"
    good = tmp_path / "good"
    export_bundle(tiny_checkpoint(tmp_path / "tiny.pt"), good, onnx=False)
    for kind, backend in (("weights", "torch"), ("torchscript", "torchscript")):
        bundle = tmp_path / kind
        shutil.copytree(good, bundle)
        spec = json.loads((bundle / "spec.json").read_text())
        name = spec["files"][kind]
        crafted(bundle / name, marker)
        with pytest.raises(BundleError, match="does not match the sha256"):
            load_policy(bundle, backend=backend)
        spec["sha256"][name] = sha256_file(bundle / name)
        (bundle / "spec.json").write_text(json.dumps(spec))
        with pytest.raises(BundleError, match=f"{name} is not a"):
            load_policy(bundle, backend=backend)
        assert not marker.exists()
    # a real TorchScript archive whose pickles were replaced by the crafted one: TorchScript's unpickler knows no
    # Python globals
    bundle = tmp_path / "archive"
    shutil.copytree(good, bundle)
    spec = json.loads((bundle / "spec.json").read_text())
    source = zipfile.ZipFile(good / "policy.ts")
    with zipfile.ZipFile(bundle / "policy.ts", "w") as out:
        for item in source.infolist():
            data = source.read(item.filename)
            out.writestr(item, pickle.dumps(RunsACommand(marker), protocol=2) if item.filename.endswith(".pkl")
                         else data)
    spec["sha256"]["policy.ts"] = sha256_file(bundle / "policy.ts")
    (bundle / "spec.json").write_text(json.dumps(spec))
    with pytest.raises(BundleError, match="posix.system"):
        load_policy(bundle, backend="torchscript")
    assert not marker.exists()
    # the Leaderboard agent's config names a policy; the policy is loaded by the same load_policy
    (tmp_path / "agent.json").write_text(json.dumps({"policy": "weights"}))
    with pytest.raises(BundleError):
        load_policy(read_agent_config(tmp_path / "agent.json")["policy"])
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "foreign", "no_format", "newer", "incomplete"])
def test_bad_checkpoints_are_named_with_the_fix(tmp_path: Path, damage: str) -> None:
    good = tiny_checkpoint(tmp_path / "good.pt")
    path = tmp_path / "bad.pt"
    if damage == "truncated":
        path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
        want = "truncated"
    elif damage == "foreign":
        with open(path, "wb") as f:
            np.save(f, np.zeros(3))
        want = "not a torch.save file"
    elif damage == "no_format":
        torch.save({"state_dict": {"w": torch.zeros(2)}}, path)
        want = "not a carl checkpoint"
    elif damage == "newer":
        ck = torch.load(good, weights_only=True)
        torch.save({**ck, "format_version": 99}, path)
        want = "update carl"
    else:
        ck = torch.load(good, weights_only=True)
        del ck["optimizer"]
        torch.save(ck, path)
        want = "incomplete: optimizer"
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert str(path) in str(err.value) and want in str(err.value)


def test_format_1_checkpoints_load_and_restore_their_rng(tmp_path: Path) -> None:
    """Format 1 kept np.random.get_state() (a numpy array) in ``rng``: still read with weights_only, RNG restored."""
    ck = torch.load(tiny_checkpoint(tmp_path / "new.pt"), weights_only=True)
    assert ck["format_version"] == 2 and isinstance(ck["rng"]["numpy"]["keys"], torch.Tensor)
    np.random.seed(11)
    random.seed(11)
    old_rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    expected = (random.random(), np.random.rand(), float(torch.rand(1)))
    torch.save({**ck, "format_version": 1, "rng": old_rng}, tmp_path / "v1.pt")
    np.random.seed(0)
    random.seed(0)
    loaded = load_checkpoint(tmp_path / "v1.pt")
    restore_rng(loaded["rng"])
    assert (random.random(), np.random.rand(), float(torch.rand(1))) == expected


def test_checkpoints_hold_only_plain_data() -> None:
    """What a weights_only load could not read back is refused when the checkpoint is made, naming the key."""
    from carl.checkpoint import make_checkpoint
    from test_checkpoint import make_policy

    policy = make_policy()
    with pytest.raises(TypeError, match=r"checkpoint\['extra'\]\['when'\] is a pathlib"):
        make_checkpoint(policy, torch.optim.Adam(policy.parameters()), 1, 1, policy.signature(), {},
                        extra={"when": Path("x")})

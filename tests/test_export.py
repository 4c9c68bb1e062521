"""carl-export and policy bundles: ONNX/TorchScript parity, reload equality, spec, and bad input."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import carl
from carl.export import export_bundle
from carl.bundle import (BundleError, action_names, check_bundle, load_policy, observation_layout,
                         random_observations)
from carl.checkpoint import CheckpointError, atomic_save, make_checkpoint
from carl.config import TrainConfig
from carl.policy import CarlPolicy
from envs.api import (ACTIONS, BEV_CHANNELS, MEASUREMENTS, NUPLAN_ACTIONS, NUPLAN_BEV_CHANNELS, NUPLAN_MEASUREMENTS,
                      NUPLAN_VALUE_MEASUREMENTS, TensorSpec)

# the export extra (pyproject: onnx, onnxscript, onnxruntime; also in dev)
pytest.importorskip("onnx", reason="ONNX export needs the export extra: pip install -e '.[export]'")
pytest.importorskip("onnxruntime", reason="ONNX parity needs the export extra: pip install -e '.[export]'")

TINY_BEV = {"bev_size": 32, "bev_ppm": 1.0, "bev_ego_from_bottom": 10}
TINY_MODEL = {"features_dim": 32, "hidden_dim": 32, "fusion_dim": 64}


def tiny_checkpoint(path: Path, seed: int = 0, **model: int) -> Path:
    """A carl-train checkpoint of a tiny CarlPolicy (32 px BEV), written with the trainer's own functions."""
    torch.manual_seed(seed)
    cfg = TrainConfig().to_dict()
    cfg["env"]["options"] = dict(TINY_BEV)
    cfg["model"].update(TINY_MODEL, **model)
    m = cfg["model"]
    spec = {"bev": TensorSpec((10, 32, 32), torch.uint8), "measurements": TensorSpec((8,), torch.float32),
            "value_measurements": TensorSpec((10,), torch.float32)}
    policy = CarlPolicy(spec, 2, m["features_dim"], m["hidden_dim"], m["fusion_dim"], m["min_final_size"])
    optimizer = torch.optim.Adam(policy.parameters())
    atomic_save(make_checkpoint(policy, optimizer, 3, 48, policy.signature(), cfg), path)
    return path


def tiny_nuplan_checkpoint(path: Path, seed: int = 0) -> Path:
    """A checkpoint of a tiny CarlPolicy trained on CaRL's nuPlan observation (9 channels, 10 + 4 measurements,
    actions accel, steer), as carl-train writes it for env=nuplan."""
    torch.manual_seed(seed)
    cfg = TrainConfig().to_dict()
    cfg["env"]["name"] = "nuplan"
    cfg["env"]["options"] = {"sim": dict(TINY_BEV)}
    cfg["model"].update(TINY_MODEL)
    m = cfg["model"]
    spec = {"bev": TensorSpec((9, 32, 32), torch.uint8, 0, 255, NUPLAN_BEV_CHANNELS),
            "measurements": TensorSpec((10,), torch.float32, names=NUPLAN_MEASUREMENTS),
            "value_measurements": TensorSpec((4,), torch.float32, names=NUPLAN_VALUE_MEASUREMENTS)}
    policy = CarlPolicy(spec, 2, m["features_dim"], m["hidden_dim"], m["fusion_dim"], m["min_final_size"],
                        action_names=NUPLAN_ACTIONS)
    atomic_save(make_checkpoint(policy, torch.optim.Adam(policy.parameters()), 3, 48, policy.signature(), cfg), path)
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("export")
    ckpt = tiny_checkpoint(root / "run" / "last.pt")
    # the legacy ONNX exporter takes ~1 s; the default (dynamo) one ~10 s: tested in test_dynamo_exporter_parity
    export_bundle(ckpt, root / "bundle", onnx_exporter="torchscript")
    return ckpt, root / "bundle"


def test_bundle_files_and_spec(exported: tuple[Path, Path]) -> None:
    _, bundle = exported
    for name in ("policy.ts", "policy.onnx", "weights.safetensors", "config.yaml", "spec.json"):
        assert (bundle / name).is_file(), name
    spec = json.loads((bundle / "spec.json").read_text())
    assert spec["observations"]["bev"] == {**spec["observations"]["bev"], "shape": [10, 32, 32], "dtype": "uint8"}
    assert spec["observations"]["measurements"]["shape"] == [8]
    assert spec["actions"]["shape"] == [2] and spec["actions"]["range"] == [-1.0, 1.0]
    assert spec["bev_geometry"]["bev_size"] == 32 and spec["bev_geometry"]["metres_ahead"] == 22.0
    assert spec["model"]["signature"]["conv"] and spec["carl_version"]
    assert set(spec["sha256"]) == set(spec["files"].values())


def test_onnx_parity_with_torch(exported: tuple[Path, Path]) -> None:
    import onnxruntime as ort

    ckpt, bundle = exported
    session = ort.InferenceSession(str(bundle / "policy.onnx"), providers=["CPUExecutionProvider"])
    torch_policy, spec = load_policy(ckpt)
    for batch in (1, 5):  # dynamic batch dimension
        obs = random_observations(spec, batch, seed=batch)
        action, alpha, beta = session.run(["action", "alpha", "beta"], {k: v.numpy() for k, v in obs.items()})
        want = torch_policy.distribution(obs)
        for got, ref in zip((action, alpha, beta), want):
            np.testing.assert_allclose(got, ref.numpy(), atol=1e-4, rtol=0)
    assert all(d <= 1e-4 for d in check_bundle(bundle, ckpt).values())


def test_bundle_reloads_with_the_checkpoint_actions(exported: tuple[Path, Path]) -> None:
    ckpt, bundle = exported
    from_ckpt, _ = carl.load_policy(ckpt)
    obs = random_observations(from_ckpt.spec, 6, seed=3)
    want = from_ckpt(obs)
    assert want.shape == (6, 2) and want.abs().max() <= 1
    for backend in ("torch", "torchscript", "onnx"):
        policy, spec = carl.load_policy(bundle, backend=backend)
        torch.testing.assert_close(policy(obs), want, atol=1e-5, rtol=0)
    sampled, _ = carl.load_policy(bundle, deterministic=False)
    assert sampled(obs).abs().max() <= 1


@pytest.mark.slow
def test_dynamo_exporter_parity(exported: tuple[Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("onnxscript", reason="the default ONNX exporter needs onnxscript (export extra)")
    ckpt, _ = exported
    export_bundle(ckpt, tmp_path / "b")  # the default exporter (torch.export)
    assert all(d <= 1e-4 for d in check_bundle(tmp_path / "b", ckpt, batch=5).values())


def test_float_bev_export(exported: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt, _ = exported
    spec = export_bundle(ckpt, tmp_path / "b", bev_dtype="float32", onnx_exporter="torchscript")
    assert spec["observations"]["bev"]["dtype"] == "float32"
    assert all(d <= 1e-4 for d in check_bundle(tmp_path / "b", ckpt).values())


def test_export_cli(exported: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from carl.export import main

    ckpt, _ = exported
    out = tmp_path / "cli"
    with pytest.raises(SystemExit) as exc:
        main([f"checkpoint={ckpt}", f"out_dir={out}", "onnx_exporter=torchscript"])
    assert exc.value.code == 0 and "parity vs checkpoint" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:  # a non-empty folder is never overwritten silently
        main([f"checkpoint={ckpt}", f"out_dir={out}", "onnx=false"])
    assert exc.value.code == 2 and "overwrite=true" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main([f"checkpoint={tmp_path / 'missing.pt'}"])
    assert exc.value.code == 2 and "missing.pt does not exist" in capsys.readouterr().err


def test_checkpoint_of_another_model_or_version(tmp_path: Path) -> None:
    ckpt = tiny_checkpoint(tmp_path / "a.pt")
    data = torch.load(ckpt, weights_only=True)

    other = dict(data, config={**data["config"], "model": {**data["config"]["model"], "name": "transfuser"}})
    torch.save(other, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match=r"other\.pt holds model 'transfuser'"):
        load_policy(tmp_path / "other.pt")

    torch.save(dict(data, format_version=99), tmp_path / "v99.pt")
    with pytest.raises(CheckpointError, match=r"v99\.pt has format version 99"):
        load_policy(tmp_path / "v99.pt")

    # weights of a wider network under a config that rebuilds a narrower one
    wide = torch.load(tiny_checkpoint(tmp_path / "wide.pt", hidden_dim=48), weights_only=True)
    wide["config"]["model"]["hidden_dim"] = 32
    wide["signature"].pop("num_params")
    torch.save(wide, tmp_path / "mixed.pt")
    with pytest.raises(CheckpointError, match=r"mixed\.pt belongs to another model: .*shape mismatch"):
        load_policy(tmp_path / "mixed.pt")

    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"junk\.pt is not a torch.save file"):
        load_policy(tmp_path / "junk.pt")


def test_bundle_of_another_version(exported: tuple[Path, Path], tmp_path: Path) -> None:
    _, bundle = exported
    with pytest.raises(BundleError, match="spec.json is missing"):
        load_policy(tmp_path)
    old = tmp_path / "old"
    old.mkdir()
    spec = json.loads((bundle / "spec.json").read_text())
    (old / "spec.json").write_text(json.dumps(dict(spec, bundle_version=99)))
    with pytest.raises(BundleError, match="bundle version 99"):
        load_policy(old)


def test_bundle_records_the_carla_layout_and_reads_old_bundles(exported: tuple[Path, Path], tmp_path: Path) -> None:
    _, bundle = exported
    spec = json.loads((bundle / "spec.json").read_text())
    assert spec["observation_layout"] == "carla" and observation_layout(spec) == "carla"
    assert spec["observations"]["bev"]["channels"] == list(BEV_CHANNELS)
    assert spec["observations"]["measurements"]["fields"] == list(MEASUREMENTS)
    assert len(spec["critic_observations"]["value_measurements"]["fields"]) == 10
    assert action_names(spec) == ACTIONS
    # a bundle written before the layout keys: the CARLA layout and (steer, longitudinal)
    old = {k: v for k, v in spec.items() if k != "observation_layout"}
    old["actions"] = {k: v for k, v in spec["actions"].items() if k != "fields"}
    assert observation_layout(old) == "carla" and action_names(old) == ACTIONS


def test_nuplan_layout_bundle(tmp_path: Path) -> None:
    """A policy trained on CaRL's nuPlan observation: the bundle names its 9 channels, 10 measurements, 4 critic values
    and its actions (accel first, with the scaling), and reloads with them."""
    ckpt = tiny_nuplan_checkpoint(tmp_path / "run" / "last.pt")
    spec = export_bundle(ckpt, tmp_path / "bundle", onnx=False)
    assert spec["observation_layout"] == "nuplan"
    assert spec["observations"]["bev"]["shape"] == [9, 32, 32]
    assert spec["observations"]["bev"]["channels"] == list(NUPLAN_BEV_CHANNELS)
    assert spec["observations"]["measurements"]["fields"] == list(NUPLAN_MEASUREMENTS)
    assert spec["critic_observations"]["value_measurements"]["fields"] == list(NUPLAN_VALUE_MEASUREMENTS)
    fields = spec["actions"]["fields"]
    assert [f["name"] for f in fields] == ["accel", "steer"]
    assert fields[0]["scaling"] == {"positive_mps2": 2.4, "negative_mps2": 3.2} and "2.4 m/s^2" in fields[0]["meaning"]
    assert fields[1]["scaling"] == {"max_tire_angle_rad": 0.83775804}
    assert spec["model"]["signature"]["layout"]["actions"] == ["accel", "steer"]
    for source in (tmp_path / "bundle", ckpt):
        policy, loaded = load_policy(source)
        assert observation_layout(loaded) == "nuplan" and action_names(loaded) == NUPLAN_ACTIONS
        assert policy(random_observations(loaded, 3)).shape == (3, 2)
    assert all(d <= 1e-4 for d in check_bundle(tmp_path / "bundle", ckpt).values())


"""The set-encoder policy (carl/set_policy.py): a function of each set as a set, blind to padding, the unit scales
its docstring states, the config checks that pair it with its observation, and the export parity of its bundle."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from carl.bundle import check_bundle, load_policy, observation_layout, random_observations
from carl.checkpoint import atomic_save, make_checkpoint
from carl.config import ConfigError, ModelConfig, TrainConfig, validate
from carl.policy import make_policy
from carl.set_policy import SetEncoder, SetPolicy, _MaskedMaxPool, unit_scale
from envs.api import (MEASUREMENTS, OBS_LANES, OBS_MEASUREMENTS, OBS_VALUE_MEASUREMENTS, OBS_VEHICLES,
                      VALUE_MEASUREMENTS, VECTOR_FEATURES, VECTOR_SETS, TensorSpec)

COUNTS = {"route": 6, "lanes": 7, "vehicles": 5, "pedestrians": 3, "statics": 2, "stops": 2}
TINY = {"name": "set", "embed_dim": 8, "hidden_dim": 16, "features_dim": 16, "fusion_dim": 16}


def spec() -> dict[str, TensorSpec]:
    out = {OBS_MEASUREMENTS: TensorSpec((8,), torch.float32, names=MEASUREMENTS),
           OBS_VALUE_MEASUREMENTS: TensorSpec((10,), torch.float32, names=VALUE_MEASUREMENTS)}
    out.update({k: TensorSpec((n, len(VECTOR_FEATURES[k])), torch.float32, names=VECTOR_FEATURES[k])
                for k, n in COUNTS.items()})
    return out


def observations(batch: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    obs = {OBS_MEASUREMENTS: torch.randn(batch, 8, generator=gen), OBS_VALUE_MEASUREMENTS: torch.randn(batch, 10)}
    for k, n in COUNTS.items():
        x = torch.randn(batch, n, len(VECTOR_FEATURES[k]), generator=gen)
        valid = torch.ones(batch, n, 1)
        valid[:, -1] = 0.0  # the last row of every set is padding
        obs[k] = torch.cat((x[..., :-1], valid), -1) * valid
    return obs


def policy(seed: int = 0) -> SetPolicy:
    torch.manual_seed(seed)
    return make_policy(spec(), ("steer", "longitudinal"), ModelConfig(**TINY)).eval()


def test_a_set_is_read_as_a_set() -> None:
    """Permuting the entities of a set leaves every output unchanged (max-pooling is symmetric)."""
    p, obs = policy(), observations()
    alpha, beta, value = p(obs)
    for key in (OBS_LANES, OBS_VEHICLES):
        perm = torch.randperm(COUNTS[key])
        shuffled = {**obs, key: obs[key][:, perm]}
        for a, b in zip(p(shuffled), (alpha, beta, value)):
            assert torch.allclose(a, b, atol=1e-6)


def test_padding_rows_are_not_read() -> None:
    """A row whose validity flag is 0 changes nothing, whatever its other features hold."""
    p, obs = policy(), observations()
    want = p(obs)
    garbage = {**obs, OBS_VEHICLES: obs[OBS_VEHICLES].clone()}
    garbage[OBS_VEHICLES][:, -1, :-1] = 1e3  # the padding row, flag still 0
    for a, b in zip(p(garbage), want):
        assert torch.allclose(a, b)
    # and an entity that is there is read
    seen = {**obs, OBS_VEHICLES: obs[OBS_VEHICLES].clone()}
    seen[OBS_VEHICLES][:, -1, -1] = 1.0
    seen[OBS_VEHICLES][:, -1, :-1] = 3.0
    assert not torch.allclose(p(seen)[0], want[0])


def test_inputs_are_scaled_by_the_units_in_their_names() -> None:
    """_mps / 10, _m / 20, _s / 5, anything else 1 (the docstring's rule), on the vehicles' and stops' names."""
    names = VECTOR_FEATURES[OBS_VEHICLES]
    expect = [0.1 if n.endswith("_mps") else 0.05 if n.endswith("_m") else 1.0 for n in names]
    assert unit_scale(names, len(names)).tolist() == pytest.approx(expect)
    stops = VECTOR_FEATURES["stops"]
    assert unit_scale(stops, len(stops))[stops.index("yellow_left_s")].item() == pytest.approx(0.2)


def test_the_network_and_the_observation_must_match() -> None:
    """model.name=set with the BEV observation (and model.name=carl with the vector one) is one config error naming both
    keys; a set policy built on a BEV spec names the option to set."""
    cfg = TrainConfig()
    cfg.model.name = "set"
    with pytest.raises(ConfigError, match=r"model.name=set reads the vector observation.*env.options.observation="):
        validate(cfg)
    cfg = TrainConfig()
    cfg.env.options = {"observation": "vector"}
    with pytest.raises(ConfigError, match=r"model.name=carl reads the bev observation"):
        validate(cfg)
    bev = {"bev": TensorSpec((10, 32, 32), torch.uint8), OBS_MEASUREMENTS: TensorSpec((8,), torch.float32),
           OBS_VALUE_MEASUREMENTS: TensorSpec((10,), torch.float32)}
    with pytest.raises(ValueError, match="observation=vector"):
        make_policy(bev, (), ModelConfig(**TINY))


def test_the_bundle_of_a_set_policy_matches_its_checkpoint(tmp_path: Path) -> None:
    """carl-export of a set-policy checkpoint: the spec lists its inputs and sizes; TorchScript and ONNX give the
    checkpoint's outputs within 1e-5 on random observations; loading it as a BEV policy is refused."""
    pytest.importorskip("onnxruntime")
    from carl.export import export_bundle

    ckpt = tiny_set_checkpoint(tmp_path / "last.pt")
    spec_ = export_bundle(ckpt, tmp_path / "bundle", onnx_exporter="torchscript")
    assert observation_layout(spec_) == "vector" and spec_["inputs"] == [OBS_MEASUREMENTS, *VECTOR_SETS]
    assert spec_["vector_geometry"]["lanes"] == COUNTS["lanes"] and spec_["vector_geometry"]["vehicles"] == 5
    assert "bev_geometry" not in spec_
    diffs = check_bundle(tmp_path / "bundle", ckpt)
    assert set(diffs) == {"torch", "torchscript", "onnx"} and max(diffs.values()) <= 1e-5, diffs
    loaded, _ = load_policy(tmp_path / "bundle")
    obs = random_observations(spec_, 3)
    assert loaded(obs).shape == (3, 2)
    with pytest.raises(Exception, match="observation lacks"):
        loaded({"bev": torch.zeros(3, 10, 32, 32, dtype=torch.uint8), OBS_MEASUREMENTS: obs[OBS_MEASUREMENTS]})
    assert json.loads((tmp_path / "bundle" / "spec.json").read_text())["onnx"]["inputs"] == spec_["inputs"]


def tiny_set_checkpoint(path: Path, seed: int = 0) -> Path:
    """A carl-train checkpoint of a tiny set policy (the vector observation at COUNTS), as carl-train writes it."""
    p = policy(seed)
    cfg = TrainConfig().to_dict()
    cfg["env"]["options"] = {"observation": "vector", "bev": False, "vector": {"lanes": COUNTS["lanes"]}}
    cfg["model"].update(TINY)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_save(make_checkpoint(p, torch.optim.Adam(p.parameters()), 1, 16, p.signature(), cfg), path)
    return path


def test_the_pairing_reads_nuplans_nested_simulator_options() -> None:
    """env=nuplan nests the simulator's options under env.options.sim: the check reads the observation there and
    names that key."""
    cfg = TrainConfig()
    cfg.model.name = "set"
    cfg.env.options = {"sim": {"observation": "vector"}}
    try:
        validate(cfg)
    except ConfigError as exc:
        assert "reads the vector observation" not in str(exc), exc
    cfg.env.options = {"sim": {"observation": "bev"}}
    with pytest.raises(ConfigError, match=r"env.options.sim.observation=bev; set env.options.sim.observation=vector"):
        validate(cfg)


def test_a_bundle_records_whether_its_policy_reads_the_path_conflicts() -> None:
    """``vector.path_conflicts`` is part of the geometry an evaluation env must rebuild (3 more features per actor)."""
    from carl.spec import vector_geometry
    from envs.api import vector_features

    shapes = {k: [4, len(v)] for k, v in vector_features(True).items()}
    on = {"env": {"name": "sim", "options": {"observation": "vector", "vector": {"path_conflicts": True}}}}
    assert vector_geometry(on, shapes)["path_conflicts"] is True
    assert vector_geometry({"env": {"name": "sim", "options": {"observation": "vector"}}}, shapes)["path_conflicts"] is False


def _reference_encoding(enc: SetEncoder, x: torch.Tensor, context: torch.Tensor | None) -> torch.Tensor:
    """The encoder as the module docstring states it, in plain autograd ops: scaled features (and the context)
    -> Linear, LayerNorm, ReLU twice per entity -> padding zeroed -> max over the set."""
    inp = x * enc.scale
    if context is not None:
        inp = torch.cat((inp, context.unsqueeze(1).expand(-1, x.shape[1], -1)), -1)
    h = inp
    for linear, norm in ((enc.mlp[0], enc.mlp[1]), (enc.mlp[3], enc.mlp[4])):
        h = torch.relu(torch.nn.functional.layer_norm(h @ linear.weight.T + linear.bias, norm.normalized_shape,
                                                      norm.weight, norm.bias, norm.eps))
    return (h * (x[..., -1:] > 0)).max(1).values


@pytest.mark.parametrize("context", [0, 3])
def test_the_encoder_trains_with_the_gradients_of_its_plain_formula(context: int) -> None:
    """In training mode the encoder's fused pool gives the values and parameter gradients of the plain formula."""
    torch.manual_seed(0)
    enc = SetEncoder(5, 8, torch.rand(5) + 0.5, context).train()
    x = torch.randn(6, 7, 5)
    x[..., -1] = (torch.rand(6, 7) > 0.4).float()
    x[2, :, -1] = 0.0  # an empty set: pools to 0, passes no gradient
    x = x * x[..., -1:]
    ctx = torch.randn(6, context) if context else None
    weights = torch.randn(6, 8)
    got = enc(x, ctx)
    (got * weights).sum().backward()
    grads = [p.grad.clone() for p in enc.parameters()]
    enc.zero_grad()
    want = _reference_encoding(enc, x, ctx)
    (want * weights).sum().backward()
    assert torch.allclose(got, want.detach(), atol=1e-6)
    assert torch.equal(got[2], torch.zeros(8))
    for g, w in zip(grads, enc.parameters()):
        assert torch.allclose(g, w.grad, rtol=1e-5, atol=1e-6)


def test_the_pool_splits_the_gradient_between_tied_entities() -> None:
    """Two identical valid entities tie for the maximum in every feature: each receives half of the gradient that
    one of them alone receives (amax's rule); a padding row, whatever it holds, receives none."""
    torch.manual_seed(0)
    enc = SetEncoder(3, 4, torch.ones(3)).train()
    pair = torch.tensor([[[0.3, -1.2, 1.0], [0.3, -1.2, 1.0], [5.0, 5.0, 0.0]]], requires_grad=True)
    enc(pair).sum().backward()
    alone = pair.detach()[:, :1].clone().requires_grad_(True)
    enc(alone).sum().backward()
    assert alone.grad[0, 0, :2].abs().sum() > 0
    assert torch.allclose(pair.grad[0, 0, :2], alone.grad[0, 0, :2] / 2, atol=1e-7)
    assert torch.allclose(pair.grad[0, 1, :2], alone.grad[0, 0, :2] / 2, atol=1e-7)
    assert torch.equal(pair.grad[0, 2], torch.zeros(3))


def test_the_pool_by_hand() -> None:
    """relu(y) * valid, max over the set, for one set of three entities and three features; the gradient of the sum
    reaches only the entry that holds a maximum > 0 (split between ties), never padding or a feature whose
    entries are all negative."""
    y = torch.tensor([[[-1.0, 2.0, 0.5], [-3.0, 1.0, 0.5], [-0.5, 9.0, 7.0]]], requires_grad=True)
    valid = torch.tensor([[[1.0], [1.0], [0.0]]])  # the third entity is padding: its 9 and 7 are not read
    pooled = _MaskedMaxPool.apply(y, valid)
    assert torch.equal(pooled, torch.tensor([[0.0, 2.0, 0.5]]))
    pooled.sum().backward()
    assert torch.equal(y.grad, torch.tensor([[[0.0, 1.0, 0.5], [0.0, 0.0, 0.5], [0.0, 0.0, 0.0]]]))

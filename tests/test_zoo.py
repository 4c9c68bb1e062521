"""The shipped policies (``carl/zoo``, ``policy=zoo:<name>``): each is a sound bundle with a card, and one drives."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from carl import zoo
from carl.bundle import (BundleError, build_policy, check_bundle, load_initial_weights, load_policy,
                         random_observations, read_spec)
from carl.cli import load_config
from carl.eval import EvalError
from carl.eval.cli import EvalCommand
from carl.eval.cli import run as carl_eval
from carl.eval.policies import resolve_policy

CARD_ITEMS = ("Command", "Seed", "Commit", "Samples", "Wall time", "CPU", "longest6", "towns")


@pytest.mark.parametrize("name", zoo.names())
def test_a_shipped_policy_is_a_sound_bundle_with_a_card(name: str) -> None:
    policy, spec = load_policy(f"{zoo.PREFIX}{name}")
    assert spec["model"]["name"] in ("carl", "set")
    diffs = check_bundle(zoo.ZOO_DIR / name)  # TorchScript and ONNX against the weights, within the export's bound
    assert set(diffs) >= {"torch", "torchscript"} and max(diffs.values()) <= 1e-5, diffs
    card = (zoo.ZOO_DIR / name / "card.md").read_text()
    missing = [item for item in CARD_ITEMS if f"| {item}" not in card]
    assert not missing, f"card.md of {name} lacks rows {missing}"


def test_the_zoo_ships_the_towns_vector_policy() -> None:
    assert "towns_vector" in zoo.names()


def test_zoo_towns_names_the_towns_recipe_s_best_policy() -> None:
    assert zoo.resolve("zoo:towns") == zoo.resolve("zoo:towns_vector") == str(zoo.ZOO_DIR / "towns_vector")
    assert all(target in zoo.names() for target in zoo.aliases().values())  # every alias names a shipped folder


def test_an_unknown_zoo_name_lists_the_shipped_ones() -> None:
    with pytest.raises(BundleError, match="zoo:towns_vector"):
        load_policy("zoo:no_such_policy")
    with pytest.raises(EvalError, match="zoo:towns_vector"):
        resolve_policy("zoo:no_such_policy", "cpu")  # type: ignore[arg-type]
    with pytest.raises(BundleError, match=r"^init_from=zoo:no_such_policy: no such policy in the zoo .*zoo:towns_vector"):
        load_initial_weights(torch.nn.Linear(1, 1), "zoo:no_such_policy")  # named with the key the user gave


def test_the_shipped_towns_policy_drives_two_longest6_routes(tmp_path: Path) -> None:
    """carl-eval on the first two Town01 routes of longest6 for 40 s each: the shipped policy covers more of them
    than the random policy on the same routes and traffic."""
    cfg = load_config("eval", ["policy=zoo:towns_vector", "benchmark=longest6", "benchmark.towns=[Town01]",
                               "benchmark.routes_per_town=2", "benchmark.max_steps=400", "baselines=true",
                               "worst_videos=0", f"out_dir={tmp_path / 'zoo'}"])
    trained = carl_eval(cfg, log=lambda *_a: None)
    random = json.loads((tmp_path / "zoo" / "baselines" / "random" / "summary.json").read_text())
    assert trained["episodes"] == 2 and random["episodes"] == 2
    assert trained["means"]["route_completion"] > 2 * random["means"]["route_completion"] + 5.0, (trained, random)


def test_a_policy_evaluated_in_float64_acts_as_in_float32_to_float32_s_precision() -> None:
    """``precision=float64`` (the torch backend; carl-eval's default): float64 weights, float32 actions within
    float32's rounding of the float32 policy's, and an identity that keeps its results apart from float32 ones."""
    obs = random_observations(read_spec(zoo.ZOO_DIR / "towns_vector"), 64)
    single, _ = load_policy("zoo:towns")
    double, _ = load_policy("zoo:towns", precision="float64")
    assert double.actor is not None and {p.dtype for p in double.actor.parameters()} == {torch.float64}
    got, want = double(obs), single(obs)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert resolve_policy("zoo:towns", torch.device("cpu")).identity["precision"] == "float64"  # carl-eval's default
    assert "precision" not in resolve_policy("zoo:towns", torch.device("cpu"), "float32").identity  # as before


def test_an_unknown_precision_or_one_an_exported_graph_cannot_run_is_named() -> None:
    with pytest.raises(ValueError, match="precision=float16: use float32 or float64"):
        load_policy("zoo:towns", precision="float16")
    with pytest.raises(ValueError, match="precision=float64 needs backend=torch"):
        load_policy("zoo:towns", precision="float64", backend="torchscript")
    cfg = load_config("eval", ["policy=zoo:towns", "precision=float16"])
    assert EvalCommand().check(cfg) == ["precision=float16: use float32 or float64"]


def test_a_shipped_policy_starts_a_fine_tuning_run() -> None:
    """``init_from=zoo:<name>``: a freshly built network of the bundle's model takes the bundle's weights."""
    spec = read_spec(zoo.ZOO_DIR / "towns_vector")
    signature = spec["model"]["signature"]
    fresh = build_policy(signature["obs_shapes"], spec["model"], "test", signature.get("layout"))
    assert "zoo/towns_vector" in load_initial_weights(fresh, "zoo:towns")
    shipped = load_policy("zoo:towns_vector")[0].actor.policy.state_dict()
    mine = fresh.state_dict()
    assert shipped.keys() == mine.keys() and all(torch.equal(mine[k], v) for k, v in shipped.items())


def test_a_damaged_zoo_policy_is_named_with_how_to_restore_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shipped policy cannot be exported again by its user: a damaged one (here a copy in a zoo folder of its own,
    its weights cut short) is named with the restore from the repository, not carl-export."""
    import shutil

    shipped = tmp_path / "carl" / "zoo"
    shutil.copytree(zoo.ZOO_DIR / "towns_vector", shipped / "towns_vector")
    weights = shipped / "towns_vector" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    monkeypatch.setattr(zoo, "ZOO_DIR", shipped)
    with pytest.raises(BundleError, match=r"weights\.safetensors does not match the sha256 .*restore the shipped files "
                                          r"\(git checkout -- carl/zoo/towns_vector, or a fresh clone\)"):
        load_policy("zoo:towns_vector")

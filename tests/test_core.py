"""The simulator core reads in one screen and backends compose it (docs/architecture.md, "One step of the
simulator"): checked on the source, so a change that grows the step or couples the parts again fails here."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from envs import make_env
from envs.sim.parts import Part

ROOT = Path(__file__).resolve().parent.parent
SIM = ROOT / "envs" / "sim"


def functions(path: Path) -> list[tuple[str, int]]:
    """(qualified name, length in lines) of every function in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            for f in node.body:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.append((f"{node.name}.{f.name}", f.end_lineno - f.lineno + 1))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((node.name, node.end_lineno - node.lineno + 1))
    return out


def runtime_imports(path: Path) -> set[str]:
    """Modules ``path`` imports when it runs (imports under ``if TYPE_CHECKING:`` are for type checkers only)."""
    tree = ast.parse(path.read_text())
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            typing_only |= {id(n) for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_the_step_reads_in_one_screen_and_no_sim_function_is_long() -> None:
    step = dict(functions(SIM / "env.py"))["SimEnv.step"]
    assert step <= 40, f"SimEnv.step is {step} lines; keep it a list of stages (at most 40)"
    long = [f"{p.name}:{name} ({n} lines)" for p in sorted(SIM.glob("*.py")) for name, n in functions(p) if n > 60]
    assert long == [], f"functions over 60 lines in envs/sim: {long}"


def test_only_the_package_entry_imports_the_core() -> None:
    """Parts, rules and helpers get their inputs; none of them imports the env (no cycle back into the core)."""
    offenders = [p.name for p in sorted(SIM.glob("*.py")) if p.name != "env.py"
                 and "envs.sim.env" in runtime_imports(p)]
    assert offenders == []


def test_nothing_subclasses_the_core() -> None:
    """Backends assemble parts; the only classes deriving from SimEnv would be copies of its step."""
    found = []
    for path in [*ROOT.glob("envs/**/*.py"), *ROOT.glob("carl/**/*.py"), *ROOT.glob("scripts/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [getattr(b, "id", getattr(b, "attr", "")) for b in node.bases]
                if "SimEnv" in bases:
                    found.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert found == []


def test_parts_are_bound_to_the_setup_not_the_env() -> None:
    """Every part of a built env holds the env's Setup and no reference to the env itself."""
    env = make_env("sim", 2, "cpu", 0, town_seeds=(0,), num_routes=4, bev=False)
    parts = [env.starts, env.ego, env.actors, env.lights, env.rules, env.reward, env.observer, *env.metrics]
    for part in parts:
        assert isinstance(part, Part) and part.setup is env.setup
        assert all(v is not env for v in vars(part).values()), type(part).__name__
    env.reset()
    r = env.step(torch.zeros(2, 2))
    assert r.obs["measurements"].shape == (2, 8)


def test_every_backend_registers_its_parts_once() -> None:
    """Each registered backend's options dataclass, factory, option check and expert resolve (the evaluation's expert
    column and the config check find them through the registry, not by trying names)."""
    import dataclasses

    import envs

    for name, b in envs.BACKENDS.items():
        assert dataclasses.is_dataclass(envs.options_schema(name))
        for ref in (b.factory, b.check, b.expert):
            assert callable(envs.load_ref(ref)), (name, ref)
    assert envs.final_obs_option("sim") == "keep_final_obs" and envs.final_obs_option("nuplan") == "sim.keep_final_obs"


def test_option_sets_merge_one_way_for_every_caller() -> None:
    """Later layers win key by key; nested mappings merge; a nesting backend (nuPlan) takes simulator options (a
    policy's BEV geometry) under ``sim``, beside what its config put there; its own keys stay at the top."""
    import envs
    from envs.config import ConfigError

    assert envs.merge_options("sim", {"map": "Town01", "reward": {"mode": "carl_carla"}}, {"rules": "leaderboard"},
                              {"reward": {"ttc_times": [1.0]}, "map": "Town02"}) == {
        "map": "Town02", "rules": "leaderboard", "reward": {"mode": "carl_carla", "ttc_times": [1.0]}}
    assert envs.merge_options("nuplan", {"cache_dir": "c", "sim": {"bev_size": 64, "dt": 0.1}},
                              {"route_split": "eval"}, {"bev_size": 128, "bev_ppm": 1.0}) == {
        "cache_dir": "c", "route_split": "eval", "sim": {"bev_size": 128, "dt": 0.1, "bev_ppm": 1.0}}
    with pytest.raises(ConfigError, match=r"env=carla: env.options.bogus=1: unknown key; CARLA keys"):
        envs.check_options("carla", {"bogus": 1})

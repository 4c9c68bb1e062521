"""The simulator core reads in one screen and backends compose it (docs/architecture.md, "One step of the
simulator"): checked on the source, so a change that grows the step or couples the parts again fails here."""
from __future__ import annotations

import ast
from pathlib import Path

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

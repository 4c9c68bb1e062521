"""The package layering of docs/architecture.md, checked on the source so that it cannot erode silently.

* ``envs/`` never imports ``carl`` (environments know nothing of the trainer);
* ``carl/`` (outside ``carl/deploy/``) reaches the environments only through their interface: ``envs`` itself
  (``make_env``), ``envs.api``, ``envs.metrics*`` and ``envs.reward``, plus the modules in :data:`ALLOWED`, each with
  the reason it is needed; never a backend (``envs.sim``, ``envs.carla``, ``envs.nuplan``, ``envs.maps``, ...);
* ``carl/`` (outside ``carl/deploy/``) never imports ``carl.deploy``: the adapters that join a policy to an outside
  evaluator sit above both packages and may import both, so importing them from the trainer would pull every backend
  in through the back door.
* ``envs/maps/`` (the lane graph every map source compiles into) sits below the backends: of ``envs/`` it imports only
  the leaf modules in :data:`MAPS_MAY_IMPORT` (names, data paths, config errors), never a backend or the envs package.

Every ``import`` / ``from ... import`` counts, wherever it stands (module level, inside functions, under
``TYPE_CHECKING``); relative imports are resolved against the file's package. Imports written as strings
(``importlib.import_module``, Hydra's ``_target_``) are not seen.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The environments' interface for the trainer (docs/architecture.md): ``envs`` (make_env, options_schema), the batched
# env API, the metric definitions and CaRL's reward. A module matches itself and everything below it.
INTERFACE = ("envs.api", "envs.metrics", "envs.reward")

# What envs/maps/ may import of envs/: itself and leaf modules that import nothing of envs/ (observation and scenario
# type names, the data registry's paths, ConfigError)
MAPS_MAY_IMPORT = ("envs.maps", "envs.api", "envs.data", "envs.config")

# Backend modules carl/ imports today, keyed by the module imported (the reason belongs to the dependency, not to
# where it is written). Each entry is a
# debt or a deliberate exception; remove it when nothing imports it any more (test_allow_list_is_current says so).
ALLOWED: dict[str, str] = {
    # configuration plumbing shared by every backend and the trainer (ConfigError, Checks, suggest, from_dict); no
    # backend code and no torch, so carl/config.py validates `env.*` with the same error type the backends raise
    "envs.config": "shared configuration errors and checks (carl/config.py)",
    # torch.compile with the ConfigError that names the option where a platform cannot compile: the simulator's
    # vector.compile and the trainer's parallel.compile share it (no backend code)
    "envs.compiled": "parallel.compile's torch.compile with a clear error (carl/policy.py)",
    # training videos: carl/monitor.py renders the BEV of env 0 to RGB frames for TensorBoard; imported in a try/except
    # so another backend without it still trains (a candidate for envs.api: a backend-neutral `render` hook)
    "envs.sim.render": "BEV -> RGB frames for training videos (carl/monitor.py)",
    # evaluation on Leaderboard route files: carl-eval reads the route XML to split a CARLA benchmark's routes by town
    # into groups, and turns a bad route file (RouteError) into a clean CLI error
    "envs.maps.routes": "carl-eval parses Leaderboard route XML (towns, groups) and reports RouteError",
    # evaluation: a bad town / map file (MapError) becomes a clean carl-eval error instead of a traceback
    "envs.maps.lanegraph": "carl-eval reports MapError as a CLI error",
    # evaluation on nuPlan (Val14): carl-eval reads the split's scenario tokens and prepares the scenario cache
    # before it creates the env (the env itself comes from envs.make_env); their errors become clean CLI errors
    "envs.nuplan.cache": "carl-eval prepares the nuPlan scenario cache (Val14), CacheError",
    "envs.nuplan.reader": "carl-eval reads the Val14 split YAML, NuplanDataError",
    # benchmark data: carl-eval resolves a benchmark's `data:<dataset>/<file>` route file / split yaml (fetched on
    # first use, docs/data.md) and turns DataError (file, URL, mirror, fix) into a clean CLI error
    "envs.data": "carl-eval resolves data: references of benchmark configs, DataError",
    # evaluation videos: carl-eval re-drives its worst routes in the built-in simulator and saves their frames
    "envs.sim.recorder": "carl-eval's videos of the worst routes (env=sim only)",
}


@dataclass(frozen=True)
class Violation:
    """One import that breaks the layering."""

    path: str  # relative to the scanned root
    line: int
    statement: str  # the import as written
    module: str  # the module it resolves to
    rule: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.statement}  ->  {self.module}  ({self.rule})"


def module_name(path: Path, root: Path) -> tuple[str, bool]:
    """Dotted module name of ``path`` under ``root`` and whether it is a package ``__init__``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def is_module(name: str, root: Path) -> bool:
    """Whether ``name`` is a module or package in the source tree at ``root``."""
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imported_modules(path: Path, root: Path) -> list[tuple[int, str, str]]:
    """``(line, statement, module)`` for every import in ``path``, at any depth, relative imports resolved.

    ``from a import b`` counts as importing ``a.b`` when that is a module of the tree (``from envs import sim``
    imports a backend), else as importing ``a`` (``from envs import make_env``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name, is_package = module_name(path, root)
    package = name.split(".") if is_package else name.split(".")[:-1]
    out: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append((node.lineno, f"import {alias.name}", alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                keep = len(package) - (node.level - 1)
                if keep <= 0:  # beyond the top-level package: Python refuses it; report it as written
                    base = "." * node.level + (node.module or "")
                else:
                    base = ".".join(package[:keep] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            written = f"from {'.' * node.level}{node.module or ''} import {', '.join(a.name for a in node.names)}"
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                out.append((node.lineno, written, sub if alias.name != "*" and is_module(sub, root) else base))
    return sorted(set(out))  # one entry per module and line (``from a import x, y`` names ``a`` once)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def check_layers(root: Path, allowed: dict[str, str] | None = None) -> list[Violation]:
    """Every import under ``root/envs`` and ``root/carl`` that breaks the layering (see the module docstring).

    ``allowed``: backend modules carl/ may import (default: :data:`ALLOWED`)."""
    allowed = ALLOWED if allowed is None else allowed
    out: list[Violation] = []
    for top in ("envs", "carl"):
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            deploy = rel.startswith("carl/deploy/")
            for line, statement, module in imported_modules(path, root):
                if top == "envs" and _under(module, "carl"):
                    out.append(Violation(rel, line, statement, module, "envs/ must not import carl"))
                elif (rel.startswith("envs/maps/") and _under(module, "envs")
                      and not any(_under(module, m) for m in MAPS_MAY_IMPORT)):
                    out.append(Violation(rel, line, statement, module,
                                         "envs/maps/ sits below the backends: of envs/ it may import only "
                                         + ", ".join(MAPS_MAY_IMPORT)))
                elif top == "carl" and not deploy:
                    if _under(module, "carl.deploy"):
                        out.append(Violation(rel, line, statement, module,
                                             "only carl/deploy/ is above the trainer; carl/ must not import it"))
                    elif (_under(module, "envs") and module != "envs" and module not in allowed
                          and not any(_under(module, m) for m in INTERFACE)):
                        out.append(Violation(rel, line, statement, module,
                                             "carl/ imports a backend: use envs, envs.api, envs.metrics, envs.reward,"
                                             " or add it to ALLOWED in tests/test_layers.py with the reason"))
    return out


def test_layers_hold() -> None:
    bad = check_layers(ROOT)
    assert not bad, "imports across the layers of docs/architecture.md:\n" + "\n".join(map(str, bad))


def test_allow_list_is_current() -> None:
    """An allow-list entry nothing imports any more is removed, so the list only shrinks."""
    used = {module for top in ("carl",) for path in (ROOT / top).rglob("*.py")
            if not path.relative_to(ROOT).as_posix().startswith("carl/deploy/")
            for _, _, module in imported_modules(path, ROOT)}
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"ALLOWED entries no longer imported by carl/ (remove them): {stale}"
    assert all(is_module(m, ROOT) for m in ALLOWED), [m for m in ALLOWED if not is_module(m, ROOT)]


def _write(root: Path, rel: str, text: str = "") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_checker_reports_upward_and_backend_imports(tmp_path: Path) -> None:
    """The checker can fail: a synthetic tree with one import of each forbidden kind, and allowed ones beside them (the
    lane graph's leaf imports of envs/ among them)."""
    for pkg in ("envs", "envs/sim", "envs/carla", "envs/metrics", "envs/maps", "carl", "carl/ppo", "carl/deploy"):
        _write(tmp_path, f"{pkg}/__init__.py")
    _write(tmp_path, "envs/api.py")
    _write(tmp_path, "envs/data.py")
    _write(tmp_path, "envs/maps/graph.py",
           "from envs.api import SCENARIO_TYPES\nfrom envs import data\nfrom envs.sim.env import SimEnv\n"
           "from . import graph\n")
    _write(tmp_path, "envs/sim/env.py")
    _write(tmp_path, "envs/metrics/nuplan.py")
    _write(tmp_path, "carl/bundle.py")
    _write(tmp_path, "envs/carla/agent.py", "import torch\n\n\ndef load():\n    from carl.bundle import load_policy\n")
    _write(tmp_path, "envs/sim/up.py", "import carl\n")
    _write(tmp_path, "carl/ppo/bad.py",
           "from envs import make_env, api\nimport envs.metrics.nuplan\nfrom envs.api import BatchedEnv\n\n"
           "def f():\n    from envs import sim\n    import envs.sim.env\n    from ..deploy import agent\n")
    _write(tmp_path, "carl/ppo/good.py", "from . import bad\nfrom .. import bundle\nfrom ..bundle import x\n")
    _write(tmp_path, "carl/deploy/agent.py", "from envs.sim.env import SimEnv\nfrom carl.bundle import load_policy\n")
    found = {(v.path, v.line, v.module) for v in check_layers(tmp_path, allowed={})}
    assert found == {
        ("envs/carla/agent.py", 5, "carl.bundle"),  # inside a function
        ("envs/sim/up.py", 1, "carl"),
        ("envs/maps/graph.py", 3, "envs.sim.env"),  # the lane graph below a backend
        ("carl/ppo/bad.py", 6, "envs.sim"),  # `from envs import sim` imports the backend package
        ("carl/ppo/bad.py", 7, "envs.sim.env"),
        ("carl/ppo/bad.py", 8, "carl.deploy.agent"),  # relative import, resolved
    }, found
    allow_sim = {"envs.sim": "test", "envs.sim.env": "test"}
    assert {v.module for v in check_layers(tmp_path, allowed=allow_sim)} == {  # ALLOWED is carl/'s list only
        "carl", "carl.bundle", "carl.deploy.agent", "envs.sim.env"}
    assert "carl/ppo/bad.py:7: import envs.sim.env" in "\n".join(map(str, check_layers(tmp_path, allowed={})))


MAX_LINES = 500


def long_files_without_reason(root: Path) -> list[str]:
    """Files of the packages and scripts over :data:`MAX_LINES` lines whose docstring does not say why they are one
    file ("One file, on purpose: ...")."""
    out = []
    for path in sorted(p for d in ("carl", "envs", "scripts") for p in (root / d).rglob("*.py")):
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if len(text.splitlines()) > MAX_LINES and "One file, on purpose" not in doc:
            out.append(f"{path.relative_to(root)}: {len(text.splitlines())} lines")
    return out


def test_long_files_say_why_they_are_one_file(tmp_path: Path) -> None:
    assert long_files_without_reason(ROOT) == []
    _write(tmp_path, "carl/big.py", '"""A big module."""\n' + "x = 1\n" * MAX_LINES)
    _write(tmp_path, "envs/big.py", '"""A big module.\n\nOne file, on purpose: it is one algorithm."""\n'
           + "x = 1\n" * MAX_LINES)
    assert long_files_without_reason(tmp_path) == [f"carl/big.py: {MAX_LINES + 1} lines"]

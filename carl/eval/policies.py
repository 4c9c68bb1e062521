"""Policies to evaluate: the baselines (uniform random actions, the backend's rule-based expert) and learned
policies (a training checkpoint or a bundle), resolved from carl-eval's ``policy=`` into a :class:`PolicySource`.

A *policy factory* takes the eval env and returns a *policy callable* ``obs dict -> action tensor [B, 2]`` (the
expert needs the env for privileged state; the others ignore it).
"""
from __future__ import annotations

import envs
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from carl import zoo
from carl.bundle import PolicyFn, load_policy, sha256_file
from carl.eval import EvalError
from envs.api import BatchedEnv

PolicyFactory = Callable[[BatchedEnv], PolicyFn]
BASELINES = ("random", "expert")  # what baselines=true evaluates beside a policy
RULE_BASED = (*BASELINES, "expert_seen")  # every policy= that names no file: expert_seen is the simulator's expert
# without the junction flows' next cars before they spawn (ppo.teacher=expert_seen)


def random_policy(env: BatchedEnv) -> PolicyFn:
    """Uniform actions in [-1, 1]^2 (the floor any learned policy should beat)."""
    gen = torch.Generator(device="cpu").manual_seed(12345)

    def act(obs: dict[str, torch.Tensor]) -> torch.Tensor:
        return (torch.rand(env.num_envs, 2, generator=gen) * 2 - 1).to(env.device)

    return act


def expert_factory(backend: str, seen_only: bool = False) -> PolicyFactory | None:
    """The rule-based expert each backend registers (``envs.BACKENDS``; ``seen_only``: its variant without what no
    observation shows); None for a custom env, which has none, so callers just skip the expert column."""
    if backend not in envs.BACKENDS:
        return None
    return lambda env: envs.make_expert(backend, env, seen_only)


@dataclass
class PolicySource:
    """What ``policy=`` named: a baseline or a learned policy (with its spec)."""

    name: str  # display name: expert, random, or the checkpoint/bundle name
    kind: str  # expert | random | learned
    identity: dict[str, Any]  # kind + weights hash; another identity in the same results folder is refused
    path: str | None = None  # resolved checkpoint/bundle path (informative: a moved bundle is the same policy)
    loaded: Any = None  # carl.bundle.LoadedPolicy
    spec: dict[str, Any] | None = None

    def env_options(self) -> dict[str, Any]:
        """Env options this policy needs: the BEV geometry it was trained on, or its vector observation's sizes
        (baselines need no BEV)."""
        if self.spec is None:
            return {"bev": False}
        if "vector_geometry" in self.spec:
            return {"observation": "vector", "bev": False, "vector": dict(self.spec["vector_geometry"])}
        g = self.spec["bev_geometry"]
        return {"bev": True, "bev_size": g["bev_size"], "bev_ppm": g["bev_ppm"],
                "bev_ego_from_bottom": g["bev_ego_from_bottom"]}

    def make(self, env: BatchedEnv, backend: str) -> PolicyFn:
        """The callable for ``env`` (the expert reads the env's privileged state)."""
        if self.kind == "random":
            return random_policy(env)
        if self.kind in ("expert", "expert_seen"):
            factory = expert_factory(backend, seen_only=self.kind == "expert_seen")
            if factory is None:
                raise EvalError(f"env={backend} has no rule-based expert (envs.{backend}.expert)")
            try:
                return factory(env)
            except ValueError as e:
                raise EvalError(f"policy={self.kind}: {e}") from None
        self._check_obs(env)
        return self.loaded

    def _check_obs(self, env: BatchedEnv) -> None:
        assert self.spec is not None
        for key, want in self.spec["observations"].items():
            have = env.observation_spec.get(key)
            if have is None or list(have.shape) != list(want["shape"]):
                raise EvalError(f"policy {self.path} expects {key} of shape {want['shape']}, the "
                                f"benchmark env gives {None if have is None else list(have.shape)}; evaluate it on "
                                "a benchmark of the env it was trained on, without benchmark.options that change "
                                "its observation (the policy's own are in its spec.json / config.yaml)")


def resolve_policy(arg: str, device: torch.device, precision: str = "float64") -> PolicySource:
    """``expert`` | ``expert_seen`` | ``random`` | checkpoint file | bundle directory | ``zoo:<name>`` ->
    :class:`PolicySource`; a learned policy computes in ``precision`` (``carl.bundle.PRECISIONS``; float64, as
    carl-eval), which its identity records where it is not float32 (so a results folder never mixes the two, and
    float32 folders written before the key existed still resume with ``precision=float32``)."""
    if arg in RULE_BASED:
        return PolicySource(arg, arg, {"kind": arg})
    try:
        path = Path(zoo.resolve(arg))
    except zoo.ZooError as exc:
        raise EvalError(str(exc)) from None
    if not path.exists():
        raise EvalError(f"policy={arg}: no such file or folder; use expert, expert_seen, random, a checkpoint .pt, a "
                        f"bundle dir or zoo:<name> ({', '.join(zoo.names())})")
    loaded, spec = load_policy(path, device=device, deterministic=True, precision=precision)
    weights = path / spec["files"]["weights"] if path.is_dir() else path
    name = path.name if path.is_dir() else f"{path.parent.name}/{path.stem}"
    identity = {"kind": "bundle" if path.is_dir() else "checkpoint", "sha256": sha256_file(weights)}
    if precision != "float32":
        identity["precision"] = precision
    return PolicySource(name, "learned", identity, path=str(path.resolve()), loaded=loaded, spec=spec)

"""Environments: everything that produces experience. Never imports the trainer.

Each backend is registered once here (:data:`BACKENDS`): its options dataclass, its factory, its option check, its
rule-based expert, the observation layout it produces and where its options nest the simulator's. Everything else
reads the registry: ``make_env(name, num_envs, device, seed, **options)`` builds an env (``options`` are validated
against the backend's dataclass, so a misspelt key fails at start-up with the valid keys listed),
:func:`merge_options` layers option sets the one way every caller needs, :func:`make_expert` gives the expert.
Imports are lazy ("module:attribute" strings), so importing ``envs`` costs nothing.
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # torch is imported by the backends; keep importers of envs.maps (tests' CARLA stand-in) light
    import torch

    from envs.api import BatchedEnv


@dataclass(frozen=True)
class Backend:
    """One environment backend, by the places its parts live (``"module:attribute"``)."""

    options: str  # the dataclass of its env.options
    factory: str  # (num_envs, device, seed, **options) -> BatchedEnv
    check: str  # (options) -> None: validates without building anything; every problem in one ConfigError
    expert: str  # (env) -> policy(obs) -> actions: the rule-based expert on the env's privileged state
    layout: str  # the observation layout it produces (envs.api.LAYOUTS): what a policy trained on it reads
    sim_key: str = ""  # where its options hold the simulator's (SimConfig) options; "" = at the top level


BACKENDS: dict[str, Backend] = {
    "sim": Backend("envs.sim.config:SimConfig", "envs.sim.env:make_sim_env", "envs.sim.config:check_options",
                   "envs.sim.expert:Expert", "carla"),
    "carla": Backend("envs.carla.config:CarlaOptions", "envs.carla.vector:make_carla_env",
                     "envs.carla.config:split_options", "envs.carla.expert:make_expert", "carla"),
    "nuplan": Backend("envs.nuplan.config:NuplanOptions", "envs.nuplan.env:make_nuplan_env",
                      "envs.nuplan.config:check_options", "envs.nuplan.expert:make_expert", "nuplan", "sim"),
}


def backend(name: str) -> Backend:
    if name not in BACKENDS:
        from envs.config import ConfigError

        raise ConfigError(f"env.name={name!r}: unknown environment backend; use one of {', '.join(BACKENDS)} or "
                          "package.module:function (env=custom)")
    return BACKENDS[name]


def load_ref(ref: str) -> Any:
    """The object a ``"package.module:attribute"`` reference names (a backend's part, or a custom env factory)."""
    module, attr = ref.split(":", 1)
    return getattr(importlib.import_module(module), attr)


def options_schema(name: str) -> type:
    """The dataclass of backend ``name``'s ``options``: the schema of Hydra's typed ``env.options``."""
    return load_ref(backend(name).options)


def final_obs_option(name: str) -> str:
    """The option (a dotted path in env.options) that makes backend ``name`` keep an episode's final observation in
    ``info["final_obs/<key>"]``."""
    key = backend(name).sim_key
    return f"{key}.keep_final_obs" if key else "keep_final_obs"


def check_options(name: str, options: dict[str, Any]) -> None:
    """Validate backend ``name``'s ``options`` without building anything; every problem in one ``ConfigError``, each
    naming the backend (an unknown key lists the backend's own keys)."""
    from envs.config import ConfigError

    try:
        load_ref(backend(name).check)(options)
    except ConfigError as exc:
        raise ConfigError([f"env={name}: {p}" for p in exc.problems]) from None


def merge_options(name: str, base: dict[str, Any], *layers: dict[str, Any]) -> dict[str, Any]:
    """``base`` with each of ``layers`` on top (later wins), key by key; simulator options (a policy's BEV geometry,
    an evaluation's route split) go where backend ``name`` keeps them, merged into what is there. A custom backend
    (``package.module:function``) takes the layers as they are."""
    key = BACKENDS[name].sim_key if name in BACKENDS else ""
    own = {f.name for f in dataclasses.fields(options_schema(name))} if key else set()
    out = dict(base)
    for layer in layers:
        for k, v in layer.items():
            if key and k not in own:  # a simulator option of a nesting backend
                out[key] = {**(out.get(key) or {}), k: v}
            elif isinstance(v, dict) and isinstance(out.get(k), dict):
                out[k] = {**out[k], **v}
            else:
                out[k] = v
    return out


def make_env(name: str, num_envs: int, device: "str | torch.device" = "cpu", seed: int = 0, **options: Any
             ) -> "BatchedEnv":
    """Build ``num_envs`` environments of backend ``name`` on ``device`` (stepping on the host keeps its freed
    memory: :mod:`envs.host_memory`)."""
    if str(device).startswith("cpu"):
        from envs.host_memory import keep_freed_memory

        keep_freed_memory()
    return load_ref(backend(name).factory)(num_envs, device, seed, **options)


SEEN_ONLY_EXPERTS = ("sim",)  # backends whose expert has a variant without what no observation shows


def make_expert(name: str, env: "BatchedEnv", seen_only: bool = False) -> Callable:
    """Backend ``name``'s rule-based expert for ``env``: ``policy(obs) -> actions`` (it reads privileged state).
    ``seen_only``: the variant that yields only to actors that exist (the simulator's, without the junction flows'
    next cars before they spawn; ``ppo.teacher=expert_seen``)."""
    if not seen_only:
        return load_ref(backend(name).expert)(env)
    if name not in SEEN_ONLY_EXPERTS:
        raise ValueError(f"env {name!r}: its expert has no seen-only variant (only {', '.join(SEEN_ONLY_EXPERTS)}); "
                         "use the expert itself")
    return load_ref(backend(name).expert)(env, unseen_flow_cars=False)

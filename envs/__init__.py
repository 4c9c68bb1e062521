"""Environments: everything that produces experience. Never imports the trainer.

``make_env(name, num_envs, device, seed, **options)`` is the one entry point the trainer uses; ``options`` are
validated against the backend's config dataclass (:func:`options_schema`), so a misspelt key fails at start-up with
the valid keys listed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by the backends; keep importers of envs.maps (tests' CARLA stand-in) light
    import torch

    from envs.api import BatchedEnv

BACKENDS = ("sim", "carla", "nuplan")
# the observation layout (envs.api.LAYOUTS) each backend produces: what a policy trained on it reads
BACKEND_LAYOUTS = {"sim": "carla", "carla": "carla", "nuplan": "nuplan"}
# the option (a dotted path in env.options) that makes each backend keep an episode's final observation in
# info["final_obs/<key>"]; nuPlan nests the simulator's options under `sim`
FINAL_OBS_OPTIONS = {"sim": "keep_final_obs", "carla": "keep_final_obs", "nuplan": "sim.keep_final_obs"}


def _unknown_backend(name: str) -> Exception:
    from envs.config import ConfigError

    return ConfigError(f"env.name={name!r}: unknown environment backend; use one of {', '.join(BACKENDS)} or "
                       "package.module:function (env=custom)")


def options_schema(name: str) -> type:
    """The dataclass of backend ``name``'s ``options``: the schema of Hydra's typed ``env.options``."""
    if name == "sim":
        from envs.sim.config import SimConfig

        return SimConfig
    if name == "carla":
        from envs.carla.config import CarlaOptions

        return CarlaOptions
    if name == "nuplan":
        from envs.nuplan.config import NuplanOptions

        return NuplanOptions
    raise _unknown_backend(name)


def check_options(name: str, options: dict[str, Any]) -> None:
    """Validate backend ``name``'s ``options`` without building anything; every problem in one ``ConfigError``."""
    from envs.config import from_dict

    if name == "sim":
        from envs.sim.config import SimConfig

        from_dict(SimConfig, options, "env.options").validate()
    elif name == "carla":
        from envs.carla.config import split_options

        split_options(options)
    elif name == "nuplan":
        from envs.nuplan.config import NuplanOptions
        from envs.sim.config import SimConfig

        opts = from_dict(NuplanOptions, options, "env.options").validate()
        from_dict(SimConfig, opts.sim, "env.options.sim")  # keys and types; values are checked with the data's defaults
    else:
        raise _unknown_backend(name)


def make_env(name: str, num_envs: int, device: "str | torch.device" = "cpu", seed: int = 0, **options: Any
             ) -> "BatchedEnv":
    """Build ``num_envs`` environments of backend ``name`` on ``device``."""
    if name == "sim":
        from envs.config import from_dict
        from envs.sim.config import SimConfig
        from envs.sim.env import SimEnv

        return SimEnv(from_dict(SimConfig, options, "env.options").validate(), num_envs, device, seed)
    if name == "carla":
        from envs.carla.vector import make_carla_env

        return make_carla_env(num_envs, device, seed, **options)
    if name == "nuplan":
        from envs.nuplan.env import make_nuplan_env

        return make_nuplan_env(num_envs, device, seed, **options)
    raise _unknown_backend(name)

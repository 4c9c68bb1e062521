"""Environments: everything that produces experience. Never imports the trainer.

``make_env(name, num_envs, device, seed, **options)`` is the one entry point the trainer uses; ``options`` are
validated against the backend's config dataclass, so a misspelt key fails at start-up with the valid keys listed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported by the backends; keep `python -m envs.carla.standin` light
    import torch

    from envs.api import BatchedEnv

BACKENDS = ("sim", "carla", "nuplan")


def make_env(name: str, num_envs: int, device: "str | torch.device" = "cpu", seed: int = 0, **options: Any
             ) -> "BatchedEnv":
    """Build ``num_envs`` environments of backend ``name`` on ``device``."""
    if name == "sim":
        from envs.sim.config import SimConfig, from_dict
        from envs.sim.env import SimEnv

        return SimEnv(from_dict(SimConfig, options).validate(), num_envs, device, seed)
    if name == "carla":
        from envs.carla.vector import make_carla_env

        return make_carla_env(num_envs, device, seed, **options)
    if name == "nuplan":
        from envs.nuplan.env import make_nuplan_env

        return make_nuplan_env(num_envs, device, seed, **options)
    raise ValueError(f"env.name={name!r}: unknown environment backend; available: {', '.join(BACKENDS)}")

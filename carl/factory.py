"""The one road from a config to an env: training, evaluation during training, ``carl-eval``'s route groups and the
benchmarks all build their environments here, with one rule for layering option sets (:func:`envs.merge_options`)
and one way to reach a custom factory (``env.name=package.module:function``). The policy's road is
:func:`carl.policy.make_policy`."""
from __future__ import annotations

from typing import Any

import torch

import envs
from envs.api import BatchedEnv
from envs.config import ConfigError


def make_env(name: str, num_envs: int, device: torch.device | str, seed: int, *options: dict[str, Any],
             where: str = "env") -> BatchedEnv:
    """``num_envs`` environments of backend ``name`` (or ``module:function``) with the option sets ``options``
    layered in order (later wins; see :func:`envs.merge_options`); ``where`` names the config that asked, for
    errors."""
    merged = envs.merge_options(name, *(options or ({},)))
    try:
        if ":" in name:
            return envs.load_ref(name)(num_envs=num_envs, device=device, seed=seed, **merged)
        return envs.make_env(name, num_envs=num_envs, device=device, seed=seed, **merged)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{where}: env.name={name!r} cannot be created: {exc}") from None
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:  # backends reject unknown/invalid options with these
        raise ConfigError(f"{where}: env {name!r} rejected its options {merged}: {exc}") from None

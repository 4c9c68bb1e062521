"""The set-encoder policy (``model=set``) for the vector observation (``env.options.observation=vector``).

The cheap twin of CaRL's CNN: the same Beta policy head, value head and PPO, over object-level inputs instead of a
BEV (:data:`envs.api.VECTOR_FEATURES`):

* each entity set (lanes, vehicles, pedestrians, statics, stops) -> a shared per-entity MLP ``F -> embed -> embed``
  (Linear, LayerNorm, ReLU per layer, as every MLP here), zeroed on padding rows, max-pooled over the set
  (PointNet's symmetric pool: the order and the number of entities do not matter; an empty set pools to 0); the
  actors' and the stop lines' MLPs also see the ego's measurements beside each entity (``CONDITIONED_SETS``);
* the route (ordered points) flattened -> MLP to ``hidden``; the measurements -> MLP to ``hidden``;
* fusion: concat -> ``fusion`` -> ``features`` (Linear, LayerNorm, ReLU), then CaRL's heads.

Inputs are scaled by their units, read from the feature names (``_m`` / 20, ``_mps`` / 10, ``_s`` / 5), so that
positions tens of metres away and 0/1 flags enter the first layer on a similar scale.
"""
from __future__ import annotations

import torch
from torch import nn

from carl.config import ModelConfig
from carl.policy import ActorCritic, _mlp
from envs.api import (OBS_MEASUREMENTS, OBS_PEDESTRIANS, OBS_ROUTE, OBS_STATICS, OBS_STOPS, OBS_VEHICLES, VECTOR_SETS,
                      TensorSpec)

UNIT_SCALES = (("_mps", 0.1), ("_m", 0.05), ("_s", 0.2))  # feature-name suffix -> input scale (first match)
POOLED_SETS = tuple(k for k in VECTOR_SETS if k != OBS_ROUTE)
CONDITIONED_SETS = (OBS_VEHICLES, OBS_PEDESTRIANS, OBS_STATICS, OBS_STOPS)  # entities read beside the ego's state


def unit_scale(names: tuple[str, ...] | list[str], width: int) -> torch.Tensor:
    """Per-feature input scales from the features' names (1 where unnamed or unitless)."""
    scale = torch.ones(width)
    for i, name in enumerate(names[:width]):
        scale[i] = next((v for suffix, v in UNIT_SCALES if name.endswith(suffix)), 1.0)
    return scale


class SetEncoder(nn.Module):
    """A padded set [B, K, F] (validity flag last) -> [B, embed]: shared MLP per entity, masked max-pool. With
    ``context`` > 0 each entity also sees a context vector [B, context] (the ego's measurements): what makes an
    actor matter (closing speed, time to reach it) depends on the ego as much as on the actor."""

    def __init__(self, width: int, embed: int, scale: torch.Tensor, context: int = 0) -> None:
        super().__init__()
        self.mlp = _mlp([width + context, embed, embed])
        self.register_buffer("scale", scale, persistent=False)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        inp = x * self.scale
        if context is not None:
            inp = torch.cat((inp, context.unsqueeze(1).expand(-1, x.shape[1], -1)), -1)
        # ReLU outputs >= 0, so zeroed padding never wins the max; a product, not torch.where: the same values and
        # gradients, and on CPU cheaper (torch.where with a mixed mask: ~30x a mul per element, docs/simulator.md)
        h = self.mlp(inp) * (x[..., -1:] > 0).to(inp.dtype)
        return h.max(1).values  # (max's backward scatters through its indices: cheaper than amax's)


class SetPolicy(ActorCritic):
    """Set encoders, a route MLP and a measurement MLP fused into one feature; CaRL's heads (module docstring)."""

    INPUTS = (OBS_MEASUREMENTS, *VECTOR_SETS)
    NEEDS = "the set policy (model=set) reads the vector observation: use env.options.observation=vector"

    def __init__(
        self,
        observation_spec: dict[str, TensorSpec],
        action_dim: int = 2,
        features_dim: int = ModelConfig.features_dim,
        hidden_dim: int = ModelConfig.hidden_dim,
        fusion_dim: int = ModelConfig.fusion_dim,
        embed_dim: int = ModelConfig.embed_dim,
        action_names: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self._read_spec(observation_spec, action_names)
        for key in VECTOR_SETS:
            if len(observation_spec[key].shape) != 2:
                raise ValueError(f"observation {key!r} has shape {observation_spec[key].shape}; the set policy needs "
                                 "[count, features] (env.options.observation=vector)")
        spec = lambda k: observation_spec[k]  # noqa: E731
        n_meas = spec(OBS_MEASUREMENTS).shape[0]
        self.sets = nn.ModuleDict({k: SetEncoder(spec(k).shape[1], embed_dim, unit_scale(spec(k).names,
                                                                                          spec(k).shape[1]),
                                                 n_meas if k in CONDITIONED_SETS else 0)
                                   for k in POOLED_SETS})
        n, f = spec(OBS_ROUTE).shape
        self.register_buffer("route_scale", unit_scale(spec(OBS_ROUTE).names, f), persistent=False)
        self.route_mlp = _mlp([n * f, hidden_dim])
        self.register_buffer("meas_scale", unit_scale(spec(OBS_MEASUREMENTS).names, n_meas), persistent=False)
        self.measurement_mlp = _mlp([n_meas, hidden_dim])
        self.fusion = _mlp([embed_dim * len(POOLED_SETS) + 2 * hidden_dim, fusion_dim, features_dim])
        self._build_heads(action_dim, features_dim, hidden_dim)

    def describe(self) -> str:
        sizes = ", ".join(f"{k} {self.obs_shapes[k][0]}" for k in VECTOR_SETS)
        return f"SetPolicy {self.num_params() / 1e6:.2f}M params; sets: {sizes}"

    def features(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        ego = obs[OBS_MEASUREMENTS].float() * self.meas_scale
        pooled = [enc(obs[k].float(), ego if k in CONDITIONED_SETS else None) for k, enc in self.sets.items()]
        route = self.route_mlp((obs[OBS_ROUTE].float() * self.route_scale).flatten(1))
        meas = self.measurement_mlp(ego)
        return self.fusion(torch.cat([*pooled, route, meas], dim=-1))

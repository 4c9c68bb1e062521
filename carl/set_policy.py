"""The set-encoder policy (``model.name=set``) for the vector observation (``env.options.observation=vector``).

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


class _MaskedMaxPool(torch.autograd.Function):
    """``(relu(y) * valid).amax(1)`` for [B, K, E] pre-activations ``y`` and [B, K, 1] 0/1 ``valid``, with a backward
    that needs no indices: the gradient goes to the entries equal to the pooled maximum (split among ties, as amax's
    does), only where that maximum is > 0 (the ReLU's and the mask's gradients are implied by it). On CPU a max with
    indices over the middle dim costs ~10x ``amax``, and autograd's chain (the ReLU, the mask's mul, max's scatter)
    passes over [B, K, E] three times each way where this passes once forward and twice back (docs/training.md,
    "Throughput")."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        h = y * valid
        pooled = h.amax(1).clamp_min_(0)  # max(relu(.)) = relu(max(.)), and padding's 0 is in the max as relu's
        ctx.save_for_backward(h, pooled)
        return pooled

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        h, pooled = ctx.saved_tensors
        hit = torch.eq(h, pooled.unsqueeze(1), out=torch.empty_like(h))  # 0/1 as floats: 2x faster than bool.to()
        share = grad * (pooled > 0) / hit.sum(1).clamp_min_(1)  # no hit: all < 0 (pooled 0, no gradient)
        return hit.mul_(share.unsqueeze(1)), None


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
        # ReLU outputs >= 0, so padding zeroed by the mask never wins the max (an empty set pools to 0); a product,
        # not torch.where: on CPU torch.where with a mixed mask costs ~30x a mul per element (docs/simulator.md)
        valid = (x[..., -1:] > 0).to(inp.dtype)
        if self.training and torch.is_grad_enabled():
            return self._differentiable(inp, valid)
        return (self.mlp(inp) * valid).amax(1)  # inference and export: plain ops

    def _differentiable(self, inp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The same function for PPO's update, faster to differentiate on CPU (measured, docs/training.md,
        "Throughput"): self.mlp's layers over [B*K, F] rows (there the ReLU's backward takes half its time on [B, K, E]),
        each weight transposed to contiguous (the first layer's weight gradient becomes x^T g, 4x faster than
        Linear's (g^T x)^T for F ~ 10), the last ReLU, the mask and the max fused in :class:`_MaskedMaxPool`."""
        b, k = inp.shape[:2]
        h = inp.reshape(b * k, -1)
        for layer in self.mlp[:-1]:  # the last ReLU is the pool's; the others act in place (LayerNorm's backward
            # reads its input, not its output)
            h = (torch.addmm(layer.bias, h, layer.weight.t().contiguous()) if isinstance(layer, nn.Linear)
                 else layer(h))
        return _MaskedMaxPool.apply(h.view(b, k, -1), valid)


class SetPolicy(ActorCritic):
    """Set encoders, a route MLP and a measurement MLP fused into one feature; CaRL's heads (module docstring)."""

    INPUTS = (OBS_MEASUREMENTS, *VECTOR_SETS)
    NEEDS = "the set policy (model.name=set) reads the vector observation: use env.options.observation=vector"

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
        ego = obs[OBS_MEASUREMENTS].to(self.dtype) * self.meas_scale
        pooled = [enc(obs[k].to(self.dtype), ego if k in CONDITIONED_SETS else None) for k, enc in self.sets.items()]
        route = self.route_mlp((obs[OBS_ROUTE].to(self.dtype) * self.route_scale).flatten(1))
        meas = self.measurement_mlp(ego)
        return self.fusion(torch.cat([*pooled, route, meas], dim=-1))

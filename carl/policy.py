"""CaRL's actor-critic network and its Beta action distribution.

The network follows CaRL's ``roach_ln2`` encoder (reference §4) exactly at 10x256x256:

* BEV (uint8, divided by 255) -> 7 conv layers without padding, each followed by LayerNorm over (C, H, W) with
  affine parameters and ReLU; channels 8, 16, 24, 32, 64, 128, 256; kernels 5, 5, 5, 5, 3, 3, 3; strides
  2, 2, 2, 2, 2, 1, 1 -> 256x2x2 -> flatten (1024).
* measurements (raw) -> MLP 8 -> 256 -> 256.
* fusion: concat -> 512 -> 256 (the shared feature).
* policy head 256 -> 256 -> 256, then Linear alpha and Linear beta, each ``softplus(.) + 1``.
* value head: concat(feature, value measurements) -> 256 -> 256 -> 1.

Every hidden Linear is followed by LayerNorm and ReLU. Conv weights are Xavier-uniform with ReLU gain and bias 0.1;
Linear layers keep PyTorch's default initialisation (the reference specifies only the conv initialisation).

Other BEV sizes (stride rule)
-----------------------------
The channel and kernel table is kept for every input size; only strides change. Layers are visited in order and a
layer keeps CaRL's stride 2 as long as the remaining layers, all at stride 1, can still produce a map of at least
``min_final_size`` (default 1) pixels; otherwise that layer uses stride 1. At 256x256 this reproduces CaRL's table
(final 2x2); at 128x128 layers 4 and 5 become stride 1 (final 3x3); at 64x64 layers 2, 4 and 5 do (final 1x1).
Inputs smaller than the all-stride-1 receptive field (23 px) are refused.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from carl.config import ModelConfig
from envs.api import OBS_BEV, OBS_MEASUREMENTS, OBS_VALUE_MEASUREMENTS, TensorSpec
from envs.compiled import compiled

# (out_channels, kernel, stride) of CaRL's roach_ln2 encoder at 256x256.
CARL_CONV_TABLE: tuple[tuple[int, int, int], ...] = (
    (8, 5, 2),
    (16, 5, 2),
    (24, 5, 2),
    (32, 5, 2),
    (64, 3, 2),
    (128, 3, 1),
    (256, 3, 1),
)
BETA_EPS = 1e-7  # actions mapped to [0, 1] are clamped to [eps, 1 - eps] before the log-prob


@dataclass(frozen=True)
class ConvLayer:
    in_channels: int
    out_channels: int
    kernel: int
    stride: int
    out_size: tuple[int, int]


def _conv_out(size: int, kernel: int, stride: int) -> int:
    return (size - kernel) // stride + 1


def _min_input(kernels: list[int], min_final: int) -> int:
    """Smallest input size for which stride-1 convolutions with ``kernels`` produce ``min_final`` pixels."""
    return min_final + sum(k - 1 for k in kernels)


def plan_conv_stack(in_channels: int, height: int, width: int, min_final_size: int = 1) -> list[ConvLayer]:
    """Apply the stride rule of the module docstring and return the layers with their output sizes."""
    kernels = [k for _, k, _ in CARL_CONV_TABLE]
    need = _min_input(kernels, min_final_size)
    if min(height, width) < need:
        raise ValueError(
            f"BEV of {height}x{width} is too small for CaRL's encoder: need at least {need}x{need} pixels "
            f"(set the env's bev_size to {need} or more)"
        )
    layers: list[ConvLayer] = []
    h, w, c = height, width, in_channels
    for i, (out_c, k, s) in enumerate(CARL_CONV_TABLE):
        rest = _min_input(kernels[i + 1 :], min_final_size)
        stride = s
        if s > 1 and min(_conv_out(h, k, s), _conv_out(w, k, s)) < rest:
            stride = 1
        h, w = _conv_out(h, k, stride), _conv_out(w, k, stride)
        layers.append(ConvLayer(c, out_c, k, stride, (h, w)))
        c = out_c
    return layers


def _mlp(sizes: list[int]) -> nn.Sequential:
    """Linear -> LayerNorm -> ReLU for every consecutive pair of ``sizes``."""
    mods: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        mods += [nn.Linear(a, b), nn.LayerNorm(b), nn.ReLU(inplace=True)]
    return nn.Sequential(*mods)


# ----------------------------------------------------------------------------------------------------------------
# Beta distribution on [-1, 1] (analytic formulas; shapes [..., action_dim])
# ----------------------------------------------------------------------------------------------------------------
def beta_log_prob(alpha: torch.Tensor, beta: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """Log-density of ``action`` in [-1, 1] (mapped to x = (a+1)/2, clamped), summed over the action dims.

    As in CaRL, the density is that of x in [0, 1]; the constant log(1/2) of the change of variables is omitted
    (it cancels in PPO's ratio).
    """
    x = ((action + 1.0) * 0.5).clamp(BETA_EPS, 1.0 - BETA_EPS)
    log_norm = torch.lgamma(alpha + beta) - torch.lgamma(alpha) - torch.lgamma(beta)
    return (log_norm + (alpha - 1.0) * torch.log(x) + (beta - 1.0) * torch.log1p(-x)).sum(-1)


def beta_entropy(alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Differential entropy of Beta(alpha, beta) on [0, 1], summed over the action dims."""
    total = alpha + beta
    log_b = torch.lgamma(alpha) + torch.lgamma(beta) - torch.lgamma(total)
    ent = (
        log_b
        - (alpha - 1.0) * torch.digamma(alpha)
        - (beta - 1.0) * torch.digamma(beta)
        + (total - 2.0) * torch.digamma(total)
    )
    return ent.sum(-1)


def beta_kl(a1: torch.Tensor, b1: torch.Tensor, a2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """Analytic KL(Beta(a1, b1) || Beta(a2, b2)), summed over the action dims."""
    t1, t2 = a1 + b1, a2 + b2
    kl = (
        torch.lgamma(t1) - torch.lgamma(a1) - torch.lgamma(b1)
        - torch.lgamma(t2) + torch.lgamma(a2) + torch.lgamma(b2)
        + (a1 - a2) * torch.digamma(a1)
        + (b1 - b2) * torch.digamma(b1)
        + (t2 - t1) * torch.digamma(t1)
    )
    return kl.sum(-1)


def beta_sample(alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Sample x ~ Beta(alpha, beta) and return a = 2x - 1 in [-1, 1]."""
    x = torch.distributions.Beta(alpha.float(), beta.float(), validate_args=False).sample()
    return 2.0 * x - 1.0


def beta_mean_action(alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Deterministic action: the Beta mean alpha / (alpha + beta), mapped to [-1, 1]."""
    return 2.0 * alpha / (alpha + beta) - 1.0


# ----------------------------------------------------------------------------------------------------------------
# Network
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PolicyOutput:
    action: torch.Tensor  # [B, A] in [-1, 1]
    log_prob: torch.Tensor  # [B]
    entropy: torch.Tensor  # [B]
    value: torch.Tensor  # [B]
    alpha: torch.Tensor  # [B, A]
    beta: torch.Tensor  # [B, A]


class ActorCritic(nn.Module):
    """What every carl network shares: a feature of the observation (:meth:`features`, the subclass's encoder), the
    Beta policy head and the value head over the feature and the critic's value measurements, and the signature a
    checkpoint records. ``INPUTS``: the observation keys the encoder reads (the value measurements beside them)."""

    INPUTS: tuple[str, ...] = ()

    def _read_spec(self, observation_spec: dict[str, TensorSpec], action_names: tuple[str, ...]) -> None:
        """The input shapes and names this network records (its signature), or a clear error for an observation
        without its inputs."""
        keys = (*self.INPUTS, OBS_VALUE_MEASUREMENTS)
        missing = [k for k in keys if k not in observation_spec]
        if missing:
            raise ValueError(f"{type(self).__name__} reads observation keys {list(keys)}; the observation lacks "
                             f"{missing} (it has {sorted(observation_spec)}): {self.NEEDS}")
        self.obs_shapes = {k: tuple(observation_spec[k].shape) for k in keys}
        # what the inputs and outputs mean, as the env named them (TensorSpec.names; the bundle records them)
        self.layout = {k: list(observation_spec[k].names) for k in keys if observation_spec[k].names}
        if action_names:
            self.layout["actions"] = list(action_names)

    def _build_heads(self, action_dim: int, features_dim: int, hidden_dim: int) -> None:
        """CaRL's policy and value heads over the feature (built after the encoder: the parameter order, which the
        optimizer state of a checkpoint follows, is CaRL's network's)."""
        n_vmeas = self.obs_shapes[OBS_VALUE_MEASUREMENTS][0]
        self.policy_head = _mlp([features_dim, hidden_dim, hidden_dim])
        self.alpha_out = nn.Linear(hidden_dim, action_dim)
        self.beta_out = nn.Linear(hidden_dim, action_dim)
        self.value_head = nn.Sequential(_mlp([features_dim + n_vmeas, hidden_dim, hidden_dim]), nn.Linear(hidden_dim, 1))

    NEEDS = ""  # how to get the observation this network reads (for the error above)

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype, which the inputs are cast to: float32, or float64 where an evaluation's actions must
        not follow the BLAS kernel's float32 sums (``carl-eval precision=float64``); bf16 training autocasts around
        float32 parameters."""
        return self.alpha_out.weight.dtype

    # -- signature used by checkpoints ----------------------------------------------------------------------------
    def signature(self) -> dict:
        """What a checkpoint must match to be loadable into this model (obs shapes and the parameter count), plus the
        names of the inputs and actions (``layout``) where known."""
        out = {"obs_shapes": {k: list(v) for k, v in self.obs_shapes.items()}, "num_params": self.num_params()}
        if self.layout:
            out["layout"] = {k: list(v) for k, v in self.layout.items()}
        return out

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def describe(self) -> str:
        """One line for the start-of-run banner."""
        return f"{type(self).__name__} {self.num_params() / 1e6:.2f}M params"

    # -- forward ----------------------------------------------------------------------------------------------------
    def features(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def _heads(self, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.policy_head(feat)
        return F.softplus(self.alpha_out(h)) + 1.0, F.softplus(self.beta_out(h)) + 1.0

    def _value(self, feat: torch.Tensor, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.value_head(torch.cat([feat, obs[OBS_VALUE_MEASUREMENTS].to(self.dtype)], dim=-1)).squeeze(-1)

    def forward(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return (alpha, beta, value) in float32."""
        feat = self.features(obs)
        alpha, beta = self._heads(feat)
        return alpha.float(), beta.float(), self._value(feat, obs).float()

    def get_value(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._value(self.features(obs), obs).float()

    def act(self, obs: dict[str, torch.Tensor], action: torch.Tensor | None = None, deterministic: bool = False) -> PolicyOutput:
        """Sample (or take the mean, or score the given ``action``) and return log-prob, entropy and value."""
        alpha, beta, value = self(obs)
        if action is None:
            action = beta_mean_action(alpha, beta) if deterministic else beta_sample(alpha, beta)
        return PolicyOutput(
            action=action,
            log_prob=beta_log_prob(alpha, beta, action),
            entropy=beta_entropy(alpha, beta),
            value=value,
            alpha=alpha,
            beta=beta,
        )

    @torch.no_grad()
    def actor(self, obs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Beta parameters (alpha, beta) in float32, without the value head (export, deployment)."""
        alpha, beta = self._heads(self.features(obs))
        return alpha.float(), beta.float()

    def deterministic_action(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Beta mean in [-1, 1]: the evaluation action (CaRL's SAMPLE_TYPE=mean)."""
        feat = self.features(obs)
        alpha, beta = self._heads(feat)
        return beta_mean_action(alpha.float(), beta.float())


class CarlPolicy(ActorCritic):
    """Shared-trunk actor-critic: (BEV, measurements) -> Beta(alpha, beta); + value measurements -> V."""

    INPUTS = (OBS_BEV, OBS_MEASUREMENTS)
    NEEDS = ("CaRL's CNN (model.name=carl) reads the BEV: use env.options.observation=bev, or model.name=set for the "
             "vector one")

    def __init__(
        self,
        observation_spec: dict[str, TensorSpec],
        action_dim: int = 2,
        features_dim: int = ModelConfig.features_dim,
        hidden_dim: int = ModelConfig.hidden_dim,
        fusion_dim: int = ModelConfig.fusion_dim,
        min_final_size: int = ModelConfig.min_final_size,
        action_names: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self._read_spec(observation_spec, action_names)
        c, h, w = observation_spec[OBS_BEV].shape
        n_meas = observation_spec[OBS_MEASUREMENTS].shape[0]
        self.conv_plan = plan_conv_stack(c, h, w, min_final_size)

        convs: list[nn.Module] = []
        for layer in self.conv_plan:
            convs += [
                nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel, layer.stride),
                nn.LayerNorm([layer.out_channels, *layer.out_size]),
                nn.ReLU(inplace=True),
            ]
        self.cnn = nn.Sequential(*convs, nn.Flatten())
        last = self.conv_plan[-1]
        cnn_out = last.out_channels * last.out_size[0] * last.out_size[1]

        self.measurement_mlp = _mlp([n_meas, hidden_dim, hidden_dim])
        self.fusion = _mlp([cnn_out + hidden_dim, fusion_dim, features_dim])
        self._build_heads(action_dim, features_dim, hidden_dim)

        for m in self.cnn.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.xavier_uniform_(m.weight, gain=nn.init.calculate_gain("relu"))
                nn.init.constant_(m.bias, 0.1)

    def signature(self) -> dict:
        """The shared signature and the conv layer plan (else the code's stride rule changed)."""
        return {**super().signature(), "conv": [[l.out_channels, l.kernel, l.stride] for l in self.conv_plan]}

    def describe(self) -> str:
        plan = " ".join(f"{l.out_channels}k{l.kernel}s{l.stride}" for l in self.conv_plan)
        last = self.conv_plan[-1].out_size
        return f"CarlPolicy {self.num_params() / 1e6:.2f}M params; conv {plan} -> {last[0]}x{last[1]}"

    def features(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        # channels-last activations: measured 1.1-1.4x faster convolutions on CPU (fp32 and bf16)
        bev = (obs[OBS_BEV].to(self.dtype) / 255.0).contiguous(memory_format=torch.channels_last)
        img = self.cnn(bev)
        meas = self.measurement_mlp(obs[OBS_MEASUREMENTS].to(self.dtype))
        return self.fusion(torch.cat([img, meas], dim=-1))


def describe(policy: ActorCritic) -> str:
    """One line: the network and its size, e.g. for the start-of-run banner."""
    return policy.describe()


__all__ = [
    "ActorCritic",
    "CARL_CONV_TABLE",
    "CarlPolicy",
    "PolicyOutput",
    "beta_entropy",
    "beta_kl",
    "beta_log_prob",
    "beta_mean_action",
    "beta_sample",
    "describe",
    "plan_conv_stack",
]


def make_policy(observation_spec: dict[str, TensorSpec], action_names: tuple[str, ...] = (),
                model: ModelConfig | dict | None = None) -> ActorCritic:
    """The policy for an env's observations and actions and a ``model`` config (a :class:`ModelConfig` or its dict,
    as checkpoints store it; missing widths are the defaults): the one road from a config to a network, for
    training, bundles and benchmarks."""
    if isinstance(model, dict):
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        model = ModelConfig(**{k: v for k, v in model.items() if k in known})
    m = model or ModelConfig()
    if m.name == "set":
        from carl.set_policy import SetPolicy  # it builds on this module's base class

        return SetPolicy(observation_spec, len(action_names) or 2, int(m.features_dim), int(m.hidden_dim),
                         int(m.fusion_dim), int(m.embed_dim), action_names=tuple(action_names))
    return CarlPolicy(observation_spec, len(action_names) or 2, int(m.features_dim), int(m.hidden_dim),
                      int(m.fusion_dim), int(m.min_final_size), action_names=tuple(action_names))


def compile_network(policy: ActorCritic) -> None:
    """``parallel.compile``: the policy's forward compiled in place (its own module keeps the parameters, so DDP,
    checkpoints and export see the same names); a platform that cannot compile raises a ConfigError naming the key."""
    policy.forward = compiled(policy.forward, "parallel.compile", dynamic=None)

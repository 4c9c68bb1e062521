"""Training configuration: dataclasses (the schema) and one up-front validation pass.

Hydra composes ``conf/train.yaml`` with its groups into a plain dictionary; :func:`from_dict` turns that dictionary
into a :class:`TrainConfig`, checking every key, type and range once, before anything is built. Each problem is
reported as a :class:`ConfigError` that names the full key, the offending value and the fix, e.g.::

    config error: ppo.minibatch_size=1000 must divide the batch (env.num_envs * ppo.num_steps = 4096);
    try ppo.minibatch_size=1024
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """An invalid configuration value; the message names the key, the value and how to fix it."""


@dataclass
class EnvConfig:
    """Which environment backend, how many parallel environments and the backend's own options."""

    name: str = "sim"  # a backend of envs.make_env, or "package.module:function" for a custom factory
    num_envs: int = 8
    options: dict[str, Any] = field(default_factory=dict)  # passed verbatim to make_env (bev_size, town, ...)
    eval_options: dict[str, Any] = field(default_factory=lambda: {"route_split": "eval"})  # merged for eval envs


@dataclass
class ModelConfig:
    """CaRL's network (carl/policy.py); the widths default to CaRL's."""

    name: str = "carl"
    features_dim: int = 256
    hidden_dim: int = 256
    fusion_dim: int = 512
    min_final_size: int = 1  # the stride rule keeps the conv output at least this many pixels wide


@dataclass
class PPOConfig:
    """CleanRL-style PPO with CaRL's settings (reference §5)."""

    total_timesteps: int = 1_000_000
    num_steps: int = 128  # rollout length per env; batch = env.num_envs * num_steps
    minibatch_size: int = 256
    update_epochs: int = 3
    learning_rate: float = 2.5e-4
    anneal_lr: bool = True  # linear decay: lr = lr0 * (1 - (update - 1) / num_updates)
    adam_eps: float = 1e-5
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_coef: float = 0.1
    clip_vloss: bool = True  # value clipping, +-clip_coef around the old value (absolute units)
    vf_coef: float = 0.5
    ent_coef: float = 0.01
    max_grad_norm: float = 0.5
    norm_adv: bool = True  # per-minibatch advantage normalisation
    accumulation_steps: int = 1  # split each minibatch into this many micro-batches (gradient accumulation)
    bootstrap_truncation: bool = False  # CaRL: done = terminated OR truncated, no bootstrap at truncation


@dataclass
class ParallelConfig:
    """Device and process layout; with torchrun, how gradients are synchronised (``carl/parallel``)."""

    name: str = "single"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # bfloat16 autocast for the network: true | false | auto (on where the device has native bf16: CUDA, or a CPU
    # with AVX-512 BF16 / AMX; measured 1.6x faster PPO updates on such a CPU, see docs/training.md)
    bf16: bool | str = False
    compile: bool = False  # torch.compile the network (CUDA only)
    torch_threads: int = 0  # 0 = leave PyTorch's default
    # -- multi-process (torchrun); ignored with one process. See docs/distributed.md --
    sync: str = "allreduce"  # allreduce | fp16 | bf16 | powersgd | lgreco | topk | localsgd
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    timeout_s: float = 1800.0  # a collective waiting longer than this fails with the rank and the reason
    bucket_cap_mb: float = 0.0  # DDP bucket size; 0 = DDP's default (powersgd on gloo: one bucket)
    powersgd_rank: int = 4  # powersgd rank; lgreco's uniform reference rank r0
    powersgd_start_iter: int = 2  # plain all-reduce before this step (>= 2: DDP rebuilds buckets after step 1)
    # powersgd implementation: "layerwise" (per-parameter matrices, near-square views of conv/LayerNorm tensors) or
    # "torch" (torch's powerSGD_hook on flat buckets: views tensors as [shape[0], -1], so CaRL's LayerNorm [8,126,126]
    # weights stay uncompressed and the whole model only reaches ~6x)
    powersgd_impl: str = "layerwise"
    lgreco_every: int = 100  # re-plan the per-layer ranks every K optimiser steps
    lgreco_acc_steps: int = 10  # steps averaged before each re-plan
    lgreco_alpha: float = 1.0  # error budget = alpha * error of the uniform rank
    topk_ratio: float = 0.01  # fraction of each layer's entries sent
    # exact fp32 all-reduce inside a node, the compression method only between nodes (powersgd/lgreco/topk)
    hierarchical: bool = False
    node_size: int = 0  # ranks per node for `hierarchical`; 0 = torchrun's LOCAL_WORLD_SIZE
    local_steps: int = 8  # localsgd: optimiser steps between outer steps
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    staleness_penalty: float = 1.0  # the one-round-stale average is divided by this
    outer_clip: float = 0.0  # clip the outer momentum to this norm; 0 = off

    @property
    def per_layer_compression(self) -> bool:
        """A method run by our per-layer reducers (the only ones ``hierarchical`` can wrap)."""
        return self.sync in ("lgreco", "topk") or (self.sync == "powersgd" and self.powersgd_impl == "layerwise")


@dataclass
class LoggingConfig:
    """What is written where and how often (in updates)."""

    tensorboard: bool = True
    progress_bar: bool = True
    summary_every: int = 1  # one summary line every N updates
    checkpoint_last_every: int = 1  # last.pt
    checkpoint_every: int = 0  # update_<n>.pt; 0 = never
    eval_every: int = 0  # evaluation (and best.pt); 0 = only at the end
    eval_episodes: int = 8
    eval_max_steps: int = 3000  # cap per evaluation episode (control steps)
    final_baselines: bool = True  # evaluate random + expert policies on the same routes at the end
    # a carl-eval benchmark (conf/benchmark/<name>.yaml, e.g. towns or longest6) run on best.pt at the end: the
    # benchmark's own conditions beside the training distribution's; null = none
    final_benchmark: str | None = None
    video_every: int = 0  # BEV video of env 0 every N updates; 0 = off
    video_max_frames: int = 400


@dataclass
class TrainConfig:
    """The whole run. ``run_dir`` defaults to ``runs/<experiment>-<timestamp>``."""

    experiment: str = "default"
    seed: int = 1
    run_dir: str | None = None
    resume: str | None = None
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    # -- derived sizes --------------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.env.num_envs * self.ppo.num_steps

    @property
    def num_updates(self) -> int:
        return max(1, self.ppo.total_timesteps // self.batch_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------------------------
# Conversion with type checks
# ----------------------------------------------------------------------------------------------------------------
def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp`` (int, float, bool, str, optional, dict) and return it."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for tp_i in inner[:-1]:  # the first type that takes the value; the last one reports the error
            try:
                return _coerce(key, value, tp_i)
            except ConfigError:
                pass
        return _coerce(key, value, inner[-1])
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping, e.g. {key}={{bev_size: 64}}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} must be true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}={value!r} must be an integer, e.g. {key}=8")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}={value!r} must be a number, e.g. {key}=0.5")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}={value!r} must be a string")
    raise ConfigError(f"{key}: unsupported type {_type_name(tp)}")  # pragma: no cover - schema bug


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}={data!r} must be a mapping of {cls.__name__} fields")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            full = f"{prefix}.{key}" if prefix else str(key)
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {prefix + '.' if prefix else ''}{close[0]}?" if close else f"valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown key {full}={data[key]!r}; {hint}")
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        full = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, data[name], full)
        else:
            kwargs[name] = _coerce(full, data[name], tp)
    return cls(**kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Range checks
# ----------------------------------------------------------------------------------------------------------------
def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check ranges and cross-field constraints; raise :class:`ConfigError` on the first problem."""
    e, p, par, lg = cfg.env, cfg.ppo, cfg.parallel, cfg.logging
    _require(e.num_envs >= 1, f"env.num_envs={e.num_envs} must be >= 1")
    _require(bool(e.name), "env.name is empty; use env=sim (or env.name=package.module:function)")
    _require(p.num_steps >= 1, f"ppo.num_steps={p.num_steps} must be >= 1")
    _require(p.total_timesteps >= 1, f"ppo.total_timesteps={p.total_timesteps} must be >= 1")
    batch = cfg.batch_size
    _require(
        p.total_timesteps >= batch,
        f"ppo.total_timesteps={p.total_timesteps} is smaller than one batch (env.num_envs * ppo.num_steps = {batch}); "
        f"try ppo.total_timesteps={batch}",
    )
    _require(p.minibatch_size >= 1, f"ppo.minibatch_size={p.minibatch_size} must be >= 1")
    if batch % p.minibatch_size:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        best = min(divisors, key=lambda d: abs(d - p.minibatch_size))
        raise ConfigError(
            f"ppo.minibatch_size={p.minibatch_size} must divide the batch (env.num_envs * ppo.num_steps = {batch}); "
            f"try ppo.minibatch_size={best}"
        )
    _require(p.accumulation_steps >= 1, f"ppo.accumulation_steps={p.accumulation_steps} must be >= 1")
    _require(
        p.minibatch_size % p.accumulation_steps == 0,
        f"ppo.accumulation_steps={p.accumulation_steps} must divide ppo.minibatch_size={p.minibatch_size}",
    )
    _require(p.update_epochs >= 1, f"ppo.update_epochs={p.update_epochs} must be >= 1")
    _require(p.learning_rate > 0, f"ppo.learning_rate={p.learning_rate} must be > 0, e.g. ppo.learning_rate=2.5e-4")
    _require(p.adam_eps > 0, f"ppo.adam_eps={p.adam_eps} must be > 0, e.g. ppo.adam_eps=1e-5")
    _require(0.0 <= p.gamma <= 1.0, f"ppo.gamma={p.gamma} must be in [0, 1], e.g. ppo.gamma=0.99")
    _require(0.0 <= p.gae_lambda <= 1.0, f"ppo.gae_lambda={p.gae_lambda} must be in [0, 1], e.g. ppo.gae_lambda=0.95")
    _require(p.clip_coef > 0, f"ppo.clip_coef={p.clip_coef} must be > 0, e.g. ppo.clip_coef=0.1")
    _require(p.vf_coef >= 0, f"ppo.vf_coef={p.vf_coef} must be >= 0")
    _require(p.ent_coef >= 0, f"ppo.ent_coef={p.ent_coef} must be >= 0")
    _require(p.max_grad_norm > 0, f"ppo.max_grad_norm={p.max_grad_norm} must be > 0, e.g. ppo.max_grad_norm=0.5")
    _require(cfg.model.name == "carl", f"model.name={cfg.model.name!r} is unknown; the only model is model=carl")
    for k in ("features_dim", "hidden_dim", "fusion_dim", "min_final_size"):
        v = getattr(cfg.model, k)
        _require(v >= 1, f"model.{k}={v} must be >= 1")
    dev = par.device
    _require(
        dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit()),
        f"parallel.device={dev!r} must be auto, cpu, cuda or cuda:N",
    )
    _require(par.name in ("single", "ddp"), f"parallel.name={par.name!r}: use parallel=single or parallel=ddp")
    _require(par.bf16 in (True, False, "auto"), f"parallel.bf16={par.bf16!r} must be true, false or auto")
    syncs = ("allreduce", "fp16", "bf16", "powersgd", "lgreco", "topk", "localsgd")
    _require(par.sync in syncs, f"parallel.sync={par.sync!r} is unknown; choose one of {', '.join(syncs)}")
    _require(par.powersgd_impl in ("layerwise", "torch"),
             f"parallel.powersgd_impl={par.powersgd_impl!r} must be layerwise or torch")
    _require(not par.hierarchical or par.per_layer_compression,
             "parallel.hierarchical=true compresses between nodes with parallel.sync=lgreco, topk or powersgd "
             f"(powersgd_impl=layerwise); it cannot wrap parallel.sync={par.sync!r}"
             + (f" with powersgd_impl={par.powersgd_impl}" if par.sync == "powersgd" else ""))
    _require(par.node_size >= 0, f"parallel.node_size={par.node_size} must be >= 0 (0 = torchrun's LOCAL_WORLD_SIZE)")
    _require(par.backend in ("auto", "gloo", "nccl"), f"parallel.backend={par.backend!r} must be auto, gloo or nccl")
    _require(par.timeout_s > 0, f"parallel.timeout_s={par.timeout_s} must be > 0, e.g. parallel.timeout_s=600")
    _require(par.bucket_cap_mb >= 0, f"parallel.bucket_cap_mb={par.bucket_cap_mb} must be >= 0 (0 = default)")
    for k in ("powersgd_rank", "lgreco_every", "lgreco_acc_steps", "local_steps"):
        _require(getattr(par, k) >= 1, f"parallel.{k}={getattr(par, k)} must be >= 1")
    _require(par.lgreco_alpha > 0, f"parallel.lgreco_alpha={par.lgreco_alpha} must be > 0, e.g. 1.0")
    _require(0 < par.topk_ratio < 1, f"parallel.topk_ratio={par.topk_ratio} must be in (0, 1), e.g. 0.01")
    _require(par.outer_lr > 0, f"parallel.outer_lr={par.outer_lr} must be > 0")
    _require(0 <= par.outer_momentum < 1, f"parallel.outer_momentum={par.outer_momentum} must be in [0, 1)")
    _require(par.staleness_penalty > 0, f"parallel.staleness_penalty={par.staleness_penalty} must be > 0")
    _require(par.outer_clip >= 0, f"parallel.outer_clip={par.outer_clip} must be >= 0 (0 = off)")
    _require(par.torch_threads >= 0, f"parallel.torch_threads={par.torch_threads} must be >= 0 (0 = default)")
    for k in ("summary_every", "checkpoint_last_every"):
        v = getattr(lg, k)
        _require(v >= 1, f"logging.{k}={v} must be >= 1")
    for k in ("checkpoint_every", "eval_every", "video_every"):
        v = getattr(lg, k)
        _require(v >= 0, f"logging.{k}={v} must be >= 0 (0 = off)")
    if lg.final_benchmark is not None:
        from pathlib import Path

        benches = sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "conf" / "benchmark").glob("*.yaml"))
        _require(lg.final_benchmark in benches, f"logging.final_benchmark={lg.final_benchmark!r} is not a benchmark; "
                 f"use one of {', '.join(benches)} (conf/benchmark), or null")
    _require(lg.eval_episodes >= 0, f"logging.eval_episodes={lg.eval_episodes} must be >= 0 (0 = no evaluation)")
    _require(lg.eval_max_steps >= 1, f"logging.eval_max_steps={lg.eval_max_steps} must be >= 1")
    _require(lg.video_max_frames >= 1, f"logging.video_max_frames={lg.video_max_frames} must be >= 1")
    return cfg


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX); elsewhere bf16 autocast is slower."""
    import torch

    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    return bool(torch.cpu._is_avx512_bf16_supported() or amx())


def use_bf16(cfg: TrainConfig, on_cuda: bool) -> bool:
    """``parallel.bf16`` resolved for the device: true/false as given, ``auto`` = where the hardware has it."""
    if cfg.parallel.bf16 == "auto":
        import torch

        return torch.cuda.is_bf16_supported() if on_cuda else cpu_has_bf16()
    return bool(cfg.parallel.bf16)


def check_device(cfg: TrainConfig, cuda_available: bool, cpu_bf16: bool | None = None) -> None:
    """Refuse options the device cannot run (called once the device is resolved)."""
    dev = cfg.parallel.device
    on_cuda = dev.startswith("cuda") or (dev == "auto" and cuda_available)
    if dev.startswith("cuda") and not cuda_available:
        raise ConfigError(f"parallel.device={dev!r} but CUDA is not available; use parallel.device=cpu (or auto)")
    if not on_cuda:
        if cfg.parallel.bf16 is True and not (cpu_has_bf16() if cpu_bf16 is None else cpu_bf16):
            raise ConfigError("parallel.bf16=true: this CPU has no native bfloat16 (AVX-512 BF16 or AMX), where bf16 "
                              "autocast is slower than fp32; set parallel.bf16=false (or auto: on where supported)")
        if cfg.parallel.compile:
            raise ConfigError("parallel.compile=true needs CUDA; this run is on CPU, set parallel.compile=false")


def from_dict(data: dict[str, Any]) -> TrainConfig:
    """Build and validate a :class:`TrainConfig` from a plain (Hydra-composed) dictionary."""
    data = {k: v for k, v in data.items() if k != "hydra"}
    return validate(_build(TrainConfig, data, ""))


def schema_keys(cls: type = TrainConfig, prefix: str = "") -> list[str]:
    """All dotted keys of the schema (for error hints about unknown overrides)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        full = f"{prefix}{f.name}"
        keys.append(full)
        if dataclasses.is_dataclass(hints[f.name]):
            keys += schema_keys(hints[f.name], full + ".")
    return keys
